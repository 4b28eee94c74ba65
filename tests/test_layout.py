"""The layout by concept: which folder may import which, read from the source with ``ast`` (function-level
imports included), and no import circle among tfcompat's modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tfcompat

ROOT = Path(tfcompat.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str) -> tuple[set[str], set[str]]:
    """The tfcompat modules ``name`` imports (anywhere in it, functions included), and the other top-level
    packages it imports (``import x``, ``from x import``, ``importlib.import_module("x...")`` with a literal)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    ours: set[str] = set()
    others: set[str] = set()

    def add(target: str) -> None:
        if target == "tfcompat" or target.startswith("tfcompat."):
            ours.add(target)
        else:
            others.add(target.split(".")[0])

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if module == "__future__":
                continue
            for alias in node.names:  # `from pkg import sub` imports the submodule where there is one
                sub = f"{module}.{alias.name}"
                add(sub if sub in MODULES else module)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            add(node.args[0].value)
    ours.discard(name)
    return ours, others


GRAPH = {name: _imports(name)[0] for name in MODULES}


def _folder(name: str) -> str:
    """``tfcompat.core.a2a`` -> ``core``; top-level modules by their own name (``ulysses``, ``errors``, ...)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "tfcompat"


# folder -> the folders (and top-level modules) it may import from tfcompat
ALLOWED = {
    "errors": {"errors"},
    "core": {"core", "errors"},
    "registry": {"registry", "errors"},
    "heads": {"heads", "errors"},
    "inputs": {"inputs", "core", "registry", "errors"},
    "ulysses": {"ulysses", "core", "errors"},
    # tiny_models: the patch-time proof builds its tiny copy (`tfcompat.hf.proof`); it imports no forward-time code
    "hf": {"hf", "core", "registry", "inputs", "tiny_models", "errors"},
    "integrations": {"integrations", "hf", "inputs", "core", "heads", "registry", "ulysses", "errors"},
}


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_folder_imports_only_what_its_rule_allows(folder):
    """Rule: core/ is pure torch and knows no registry, patch or inputs; registry/ knows no forward-time code;
    heads/ stand alone; inputs/ know no patch; `ulysses` knows no patch nor registry; hf/ knows no integration,
    `ulysses` or heads; integrations know neither the CLI nor the self-check."""
    names = [n for n in MODULES if _folder(n) == folder]
    assert names, folder
    for name in names:
        bad = sorted(t for t in GRAPH[name] if _folder(t) not in ALLOWED[folder])
        assert not bad, f"{name} imports {bad}; {folder}/ may import {sorted(ALLOWED[folder])}"


@pytest.mark.parametrize("folder", ["core", "heads", "errors"])
def test_pure_folders_import_no_transformers(folder):
    """Rule: core/, heads/ and errors import neither transformers nor anything but torch (and Triton, flash-attn,
    flash-linear-attention, causal-conv1d by name, where installed)."""
    for name in (n for n in MODULES if _folder(n) == folder):
        assert "transformers" not in _imports(name)[1], name


def test_no_import_circle():
    """Rule: the module import graph (function-level imports included) is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(GRAPH.get(node, ())):
            if state.get(nxt) == 1:
                pytest.fail("import circle: " + " -> ".join([*path[path.index(nxt):], nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)


def test_the_graph_is_read_from_the_source():
    """Non-vacuity: the graph holds edges known to exist (module level, function level, relative)."""
    assert "tfcompat.core.a2a" in GRAPH["tfcompat.ulysses"]
    assert "tfcompat.registry.tables" in GRAPH["tfcompat.registry.lookup"]  # inside families()
    assert "tfcompat.heads._triton" in GRAPH["tfcompat.heads"]  # inside a function
    assert "tfcompat.hf.patching" in GRAPH["tfcompat"]
