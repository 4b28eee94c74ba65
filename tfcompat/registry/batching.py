"""How a vision-language type batches its vision inputs, read from its processors' and its model's source with `ast`.

Most image and video processors return a batch's items (images, tiles, frames) on dim 0, and `tfcompat.pack`
concatenates a packed row's there. NaViT-packing processors (MiniCPM-V) instead return a batch of one entry whose
items lie along another axis: ``pixel_values = torch.cat(patches, dim=-1).unsqueeze(0)``, ``(1, C, p, N * p)``; the
model reads that one entry (``pixel_values[:1]``) and splits it by the per-item sizes. A packed row is what the
processor returns for all its examples' items at once, so `pack` concatenates such an input on that axis
(`item_axes`); the source is read, not imported: a processor whose backend is missing (torchvision) still names it.

Index inputs (Molmo2's ``image_token_pooling``: each image token pools patches by their row in the flattened patches)
index the whole batch's patches unless the model offsets them per item itself (5.25's Molmo2 adds each image's
patch offset in ``get_image_features``): `batch_indices` names those a packed row must shift.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import pathlib
from collections.abc import Iterator
from typing import Any

from .derive import _method

__all__ = ["batch_indices", "item_axes"]

# (auto module, mapping) of the processors whose outputs are a model's vision inputs (a name is None where its backend
# is missing: 5.x video processors without torchvision, which then process nothing)
_MAPPINGS = (("image_processing_auto", "IMAGE_PROCESSOR_MAPPING_NAMES"),
             ("video_processing_auto", "VIDEO_PROCESSOR_MAPPING_NAMES"))


@functools.cache
def item_axes(model_type: str) -> tuple[tuple[str, int], ...]:
    """``(output name, axis)`` of each vision input ``model_type``'s image or video processors return as one batch
    entry holding every item along ``axis`` of the returned tensor (``torch.cat(items, dim=d).unsqueeze(0)``:
    ``d`` where negative, else ``d + 1``), in name order; an input whose processors disagree is left out (dim 0)."""
    found: dict[str, set[int]] = {}
    for cls in _processor_classes(model_type):
        for name, axis in _batch_of_one(cls):
            found.setdefault(name, set()).add(axis)
    return tuple(sorted((name, axes.pop()) for name, axes in found.items() if len(axes) == 1))


def _names(value: Any) -> list[str]:
    """The class names of one auto-mapping value: a name, a tuple (4.x: slow, fast) or a dict by backend (5.x)."""
    if isinstance(value, str):
        return [value]
    values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return [v for v in values if isinstance(v, str)]


def _processor_classes(model_type: str) -> Iterator[ast.ClassDef]:
    """The class definitions of ``model_type``'s image and video processors, from the packages whose mapping entries
    name them (MiniCPM-V 4.7 takes 4.6's), with the bases its file defines."""
    auto = importlib.import_module("transformers.models.auto.configuration_auto")
    for module_name, mapping_name in _MAPPINGS:
        try:
            mapping = getattr(importlib.import_module(f"transformers.models.auto.{module_name}"), mapping_name)
        except (ImportError, AttributeError):  # a release without video processors
            continue
        for name in _names(mapping.get(model_type)):
            holders = [k for k, v in mapping.items() if name in _names(v)]
            for tree in (_parsed(auto.model_type_to_module_name(k)) for k in holders):
                classes = {c.name: c for t in tree for c in t.body if isinstance(c, ast.ClassDef)}
                if name in classes:
                    yield from _with_bases(classes[name], classes)
                    break


@functools.cache
def _parsed(package: str) -> tuple[ast.Module, ...]:
    """The parsed processing modules (``*processing*.py``) of ``transformers.models.<package>``."""
    spec = importlib.util.find_spec(f"transformers.models.{package}")
    if spec is None or not spec.submodule_search_locations:
        return ()
    files = sorted(f for d in spec.submodule_search_locations for f in pathlib.Path(d).glob("*processing*.py"))
    return tuple(ast.parse(f.read_text(encoding="utf-8")) for f in files)


def _with_bases(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> Iterator[ast.ClassDef]:
    yield cls
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes and base.id != cls.name:
            yield from _with_bases(classes[base.id], classes)


def _batch_of_one(cls: ast.ClassDef) -> Iterator[tuple[str, int]]:
    """``(output name, axis)`` where a method of ``cls`` assigns ``x = <concatenation on d>`` under a leading batch
    of one (``.unsqueeze(0)``, ``[None]``, ``[np.newaxis, ...]``, ``np.expand_dims(..., 0)``) and returns ``x``
    under a dict key (``BatchFeature(data={"pixel_values": x, ...})``)."""
    for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
        keys = {ast.unparse(v): k.value for d in ast.walk(fn) if isinstance(d, ast.Dict)
                for k, v in zip(d.keys, d.values) if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
                continue
            axis = _leading_one(node.value)
            if axis is not None and node.targets[0].id in keys:
                yield keys[node.targets[0].id], axis if axis < 0 else axis + 1


def _leading_one(value: ast.expr) -> int | None:
    """The concatenation axis of ``value`` where it is a concatenation with a new leading dim of one, else None."""
    inner: ast.expr | None = None
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "unsqueeze":
        inner = value.func.value if [ast.unparse(a) for a in value.args] == ["0"] else None
    elif isinstance(value, ast.Subscript):
        index = value.slice.elts if isinstance(value.slice, ast.Tuple) else [value.slice]
        lead = ast.unparse(index[0]) in ("None", "np.newaxis") and all(
            isinstance(i, ast.Constant) and i.value is Ellipsis for i in index[1:])
        inner = value.value if lead else None
    elif isinstance(value, ast.Call) and ast.unparse(value.func) == "np.expand_dims" and value.args:
        given = [ast.unparse(a) for a in value.args[1:]] + [ast.unparse(k.value) for k in value.keywords
                                                              if k.arg == "axis"]
        inner = value.args[0] if given == ["0"] else None
    return _concat_axis(inner) if inner is not None else None


def _concat_axis(call: ast.expr) -> int | None:
    """The axis of ``torch.cat`` / ``torch.concat`` / ``np.concatenate`` (``dim`` / ``axis``, else the second
    argument, else 0), or None for another expression or an axis that is not a literal."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr in ("cat", "concat", "concatenate")):
        return None
    given = [k.value for k in call.keywords if k.arg in ("dim", "axis")] + call.args[1:2]
    try:
        axis = ast.literal_eval(given[0]) if given else 0
    except ValueError:
        return None
    return axis if isinstance(axis, int) else None


def batch_indices(owner: type, names: list[str]) -> tuple[tuple[str, str], ...]:
    """``(index input, pixel input)`` for each of ``names`` (parameters of ``owner.forward``: Molmo2's
    ``image_token_pooling``) that indexes the rows of the whole batch's flattened patches: the pixel input is what the
    forward's call handing it on (``self.get_image_features(pixel_values, image_token_pooling, ...)``) passes by a
    ``pixel_values*`` name ("" where it passes none); a name the called method (or one it hands it to) offsets itself
    (``image_token_pooling + offsets``: each item's indices its own) is left out."""
    fn = _method(owner, "forward")
    calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
             and ast.unparse(c.func.value) == "self"] if fn is not None else []
    found = []
    for name in names:
        takers = [c for c in calls if name in _names_passed(c)]
        if any(_offsets(owner, c, name) for c in takers):
            continue
        pixels = [p for c in takers for p in _names_passed(c) if p.startswith("pixel_values")]
        found.append((name, pixels[0] if pixels else ""))
    return tuple(found)


def _names_passed(call: ast.Call) -> list[str]:
    return [a.id for a in (*call.args, *(k.value for k in call.keywords)) if isinstance(a, ast.Name)]


def _offsets(cls: type, call: ast.Call, name: str, depth: int = 3) -> bool:
    """Whether the method of ``cls`` that ``call`` (``self.<method>(...)``) calls adds to the parameter it takes
    ``name`` as (``image_token_pooling = torch.where(..., image_token_pooling + offsets, ...)``), or hands it to a
    method of ``cls`` that does, ``depth`` calls down."""
    method = _method(cls, call.func.attr) if isinstance(call.func, ast.Attribute) else None
    if method is None or depth == 0:
        return False
    params = [a.arg for a in method.args.args[1:]]
    taken = [params[i] for i, a in enumerate(call.args[:len(params)]) if isinstance(a, ast.Name) and a.id == name]
    taken += [k.arg for k in call.keywords if k.arg and isinstance(k.value, ast.Name) and k.value.id == name]
    if not taken:
        return False
    param = taken[0]
    for node in ast.walk(method):
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == param for t in node.targets)
                and any(isinstance(b, ast.BinOp) and isinstance(b.op, ast.Add)
                        and param in (ast.unparse(b.left), ast.unparse(b.right)) for b in ast.walk(node.value))):
            return True
    return any(_offsets(cls, c, param, depth - 1) for c in ast.walk(method) if isinstance(c, ast.Call)
               and isinstance(c.func, ast.Attribute) and ast.unparse(c.func.value) == "self")
