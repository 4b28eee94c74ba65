"""The mask a text model's forward builds for each of its layers, read from its source.

Stock eager and sdpa attention apply the mask the text model builds, not the keywords its attention call passes: a
window, a chunk or a bidirectional span may live in the mask alone (Phimoe: ``mask_function =
create_causal_mask if self.config.sliding_window is None else create_sliding_window_causal_mask``, no
``sliding_window`` keyword; Qwen2-MoE: a ``"sliding_attention"`` mask, no keyword). `read_masks` reads, with `ast`,
which functions of ``transformers.masking_utils`` the forward calls (resolved by identity in the modeling module's
namespace, never by name alone), through which selector (a name, a local chosen by a config test, a dict keyed by
layer type, transformers' ``LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING``), and which overlays (``or_mask_function`` /
``and_mask_function``: bidirectional image spans, prefix masks) it may add, under which ``if`` tests. It follows the
forward into the methods of ``self`` and the module's functions it calls, one level down. `layer_mask` evaluates the
reading on a config for one layer kind: the `MaskRule` that layer's stock mask applies, or why tfcompat cannot tell.
`tfcompat.hf.features` compares it with what the attention call passes.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
import types
from typing import Any, NamedTuple, cast

from .derive import _method, guard_holds

__all__ = ["MASK_FUNCTIONS", "MaskReading", "MaskRule", "layer_mask", "read_masks"]

# transformers.masking_utils' mask builders -> the rule each adds to causal attention (its size read from the
# config it is given: ``sliding_window``, ``attention_chunk_size``); "recurrent" masks go to linear-attention layers
MASK_FUNCTIONS = {
    "create_causal_mask": "causal",
    "create_sliding_window_causal_mask": "window",
    "create_chunked_causal_mask": "chunk",
    "create_bidirectional_mask": "bidirectional",
    "create_bidirectional_sliding_window_mask": "bidirectional",
    "create_recurrent_attention_mask": "recurrent",
}
_SIZE_FIELDS = {"window": "sliding_window", "chunk": "attention_chunk_size"}
_MAPPING = "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING"
_OVERLAYS = ("or_mask_function", "and_mask_function")
_CROSS = ("encoder_hidden_states", "encoder_attention_mask")  # a mask over encoder states: cross-attention's


class MaskRule(NamedTuple):
    """What a layer's stock mask adds to causal attention. kind: "causal" | "window" | "chunk" | "bidirectional";
    size: the window or chunk (None otherwise); source: where it was read, for notes and errors."""

    kind: str
    size: int | None
    source: str


class MaskReading(NamedTuple):
    """The masks ``owner.forward`` builds. selectors: ``(layer kind, selector source, if tests)``, kind "" where
    the mask reaches every layer; a selector is a masking_utils builder name, or an ``a if test else b`` of them;
    the tests enclose its call (each may fail to evaluate: the mask then counts as built). overlays: the ``if``
    tests of each overlay handed to a builder. unread: why the reading is incomplete ("" = complete)."""

    owner: str
    selectors: tuple[tuple[str, str, tuple[str, ...]], ...]
    overlays: tuple[tuple[str, ...], ...]
    unread: str


@functools.cache
def read_masks(text: type) -> MaskReading:
    """The `MaskReading` of ``text`` (a text model class), cached per class."""
    module = importlib.import_module(text.__module__)
    masking = importlib.import_module("transformers.masking_utils")
    known = {name: fn for name in (*MASK_FUNCTIONS, _MAPPING, "create_masks_for_generate")
             if (fn := getattr(masking, name, None)) is not None}
    aliases = {n: next(k for k, f in known.items() if f is v) for n, v in vars(module).items()
               if any(v is f for f in known.values())}  # the module's names of masking_utils' builders
    fn = _method(text, "forward")
    if fn is None:
        return MaskReading(text.__name__, (), (), f"{text.__name__}.forward has no readable source")
    selectors: list[tuple[str, str, tuple[str, ...]]] = []
    overlays: list[tuple[str, ...]] = []
    unread = ""
    for body in [fn, *(f for f in _callees(text, module, fn) if f is not None)]:
        found, over, why = _read(body, aliases)
        selectors += found
        overlays += over
        unread = unread or why
    return MaskReading(text.__name__, tuple(dict.fromkeys(selectors)), tuple(dict.fromkeys(overlays)), unread)


def layer_mask(reading: MaskReading, config: Any, kind: str | None) -> MaskRule | str | None:
    """The rule of the stock mask of a layer of ``kind`` (its ``config.layer_types`` value, None without layer
    types) under ``config``: a `MaskRule`, a string saying why it cannot be told, or None where tfcompat read no
    self-attention mask the forward builds for it (nothing to compare)."""
    shim = types.SimpleNamespace(config=config)  # ``self`` of the text model, as far as its tests read it
    built = [(k, s) for k, s, tests in reading.selectors if _may_hold(tests, shim)]
    selectors = [s for k, s in built if k and k == kind] or [s for k, s in built if not k] or (
        [s for k, s in built] if kind is None else [])
    rules: set[MaskRule] = set()
    for selector in selectors:
        name = _select(selector, shim)
        if name is None:
            return f"{reading.owner}.forward picks its mask by `{selector}`, which tfcompat cannot evaluate"
        rule = MASK_FUNCTIONS.get(name)
        if rule is None:
            return f"{reading.owner}.forward builds its mask with {name}, whose rule tfcompat does not read"
        if rule == "recurrent":  # the linear-attention layers' mask
            continue
        field = _SIZE_FIELDS.get(rule)
        size = getattr(config, field, None) if field else None
        rules.add(MaskRule(rule, size, f"{reading.owner}'s {name}" + (f" (config.{field} = {size})" if field else "")))
    if len(rules) > 1:
        return f"{reading.owner}.forward builds several masks that may reach this layer: " + ", ".join(
            sorted(r.source for r in rules))
    for tests in reading.overlays:
        if _may_hold(tests, shim):
            return (f"{reading.owner}.forward hands its mask builder an overlay (or_mask_function / "
                    "and_mask_function: a bidirectional or prefix span)"
                    + (f" when {' and '.join(tests)}" if tests else ""))
    if not rules and reading.unread:
        return f"tfcompat cannot read {reading.owner}'s mask: {reading.unread}"
    return rules.pop() if rules else None


def _may_hold(tests: tuple[str, ...], shim: Any) -> bool:
    """Whether the ``if`` tests may all hold on ``shim``: none evaluates to False (one that reads more than the
    config, or a walrus, counts as holding)."""
    for test in tests:
        try:
            if guard_holds(test, shim) is False:
                return False
        except Exception:  # noqa: BLE001 -- a test tfcompat cannot evaluate may hold
            continue
    return True


def _select(selector: str, shim: Any) -> str | None:
    """The builder name a selector picks on ``shim`` (``self`` with the config), None where it cannot be evaluated."""
    node = ast.parse(selector, mode="eval").body
    while isinstance(node, ast.IfExp):
        held = guard_holds(ast.unparse(node.test), shim)
        if held is None:
            return None
        node = node.body if held else node.orelse
    return node.id if isinstance(node, ast.Name) else None


def _read(fn: ast.FunctionDef, aliases: dict[str, str]
          ) -> tuple[list[tuple[str, str, tuple[str, ...]]], list[tuple[str, ...]], str]:
    """``(selectors, overlay guards, why unread)`` of one function body (see `MaskReading`)."""
    local = {t.id: n.value for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Name)}
    tests = _tests(fn)

    def selector(func: ast.expr) -> str | None:
        """The selector of a called expression, None where it calls no mask builder."""
        if isinstance(func, ast.Name) and func.id in aliases:
            return aliases[func.id]
        if isinstance(func, ast.Name) and isinstance(local.get(func.id), (ast.IfExp, ast.Name)):
            value = local[func.id]
            if any(isinstance(n, ast.Name) and n.id in aliases for n in ast.walk(value)):
                return ast.unparse(_renamed(value, aliases))
        return None

    keyed: dict[int, str] = {}  # id of a node inside a dict value or subscript assignment -> its layer kind
    for node in ast.walk(fn):
        pairs: list[tuple[ast.AST | None, ast.AST]] = []
        if isinstance(node, ast.Dict):
            pairs = list(zip(node.keys, node.values))
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
            pairs = [(node.targets[0].slice, node.value)]
        for key, value in pairs:
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                keyed |= {id(n): key.value for n in ast.walk(value)}
    found: list[tuple[str, str, tuple[str, ...]]] = []
    why = ""
    for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
        if any(k.arg in _CROSS for k in call.keywords):
            continue
        guard = tests.get(id(call), ())
        table = call.func.value if isinstance(call.func, ast.Subscript) else None
        if isinstance(table, ast.Name) and aliases.get(table.id) == _MAPPING:
            # LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING[kind](...): the installed mapping decides, nested per kind
            mapping = getattr(importlib.import_module("transformers.masking_utils"), _MAPPING)
            for k, v in mapping.items():
                inner = v.items() if isinstance(v, dict) else [(k, v)]
                found += [(kind, _builder(f, aliases), guard) for kind, f in inner]
            continue
        if isinstance(table, ast.Name) and isinstance(local.get(table.id), ast.Dict):
            # mask_creation_functions[layer_type](...) over a local dict of builders (Lara-Mini)
            entries = cast(ast.Dict, local[table.id])
            found += [(k.value, aliases[v.id], guard) for k, v in zip(entries.keys, entries.values)
                      if isinstance(k, ast.Constant) and isinstance(k.value, str) and isinstance(v, ast.Name)
                      and v.id in aliases]
            continue
        name = selector(call.func)
        if name == "create_masks_for_generate":
            why = why or f"it calls {name}"
        elif name is not None:
            found.append((keyed.get(id(call), ""), name, guard))
    overlays = [tests.get(id(n), ()) for n in ast.walk(fn) if _is_overlay(n)]
    return found, overlays, why


def _builder(fn: Any, aliases: dict[str, str]) -> str:
    """masking_utils' name of a builder object (a ``functools.partial`` of one reads as it)."""
    return getattr(getattr(fn, "func", fn), "__name__", repr(fn))


def _renamed(node: ast.expr, aliases: dict[str, str]) -> ast.expr:
    """``node`` with the module's names of builders replaced by masking_utils' own."""
    class Rename(ast.NodeTransformer):
        def visit_Name(self, n: ast.Name) -> ast.Name:
            return ast.Name(aliases.get(n.id, n.id), n.ctx)

    return Rename().visit(ast.parse(ast.unparse(node), mode="eval").body)


def _is_overlay(node: ast.AST) -> bool:
    """Whether ``node`` hands a mask builder an overlay: a keyword ``or_mask_function=`` / ``and_mask_function=``, or
    a dict key or subscript assignment of that name, not None."""
    if isinstance(node, ast.keyword):
        return node.arg in _OVERLAYS and not _is_none(node.value)
    if isinstance(node, ast.Dict):
        return any(isinstance(k, ast.Constant) and k.value in _OVERLAYS and not _is_none(v)
                   for k, v in zip(node.keys, node.values))
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
        key = node.targets[0].slice
        return isinstance(key, ast.Constant) and key.value in _OVERLAYS and not _is_none(node.value)
    return False


def _tests(fn: ast.FunctionDef) -> dict[int, tuple[str, ...]]:
    """Node id -> the ``if`` tests (and their negations in ``else``) that enclose it in ``fn``."""
    out: dict[int, tuple[str, ...]] = {}

    def visit(node: ast.AST, tests: tuple[str, ...]) -> None:
        out[id(node)] = tests
        if isinstance(node, ast.If):
            for child in node.body:
                visit(child, (*tests, ast.unparse(node.test)))
            for child in node.orelse:
                visit(child, (*tests, f"not ({ast.unparse(node.test)})"))
            return
        for sub in ast.iter_child_nodes(node):
            visit(sub, tests)

    for statement in fn.body:
        visit(statement, ())
    return out


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _callees(text: type, module: Any, fn: ast.FunctionDef) -> list[ast.FunctionDef | None]:
    """The methods of ``self`` and the functions of ``module`` that ``fn`` calls (their ``ast``)."""
    out: list[ast.FunctionDef | None] = []
    for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
        func = call.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self" \
                and callable(getattr(text, func.attr, None)) and not isinstance(getattr(text, func.attr), type):
            out.append(_method(text, func.attr))
        elif isinstance(func, ast.Name) and isinstance(getattr(module, func.id, None), types.FunctionType) \
                and getattr(module, func.id).__module__ == module.__name__:
            out.append(_function(getattr(module, func.id)))
    return out


def _function(fn: Any) -> ast.FunctionDef | None:
    """The ``ast`` of a module-level function (decorators unwrapped)."""
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))).body[0]
    except (OSError, TypeError, SyntaxError):
        return None
    return node if isinstance(node, ast.FunctionDef) else None
