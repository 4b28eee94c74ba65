"""What a causal LM's forward does to its lm head's output, read from that forward: `final_logits`.

`model_logprobs` runs the backbone and computes the head itself, so it must apply what the model's own forward
applies between ``self.lm_head(...)`` and the logits it returns. Transformers (4.53 .. 5.24) writes that as a few
statements of the ``*ForCausalLM`` / ``*ForConditionalGeneration`` forward:

- a scale: ``logits * self.logit_scale`` (cohere, cohere2), ``logits / self.config.logits_scaling`` (granite,
  granitemoe*), ``self.lm_head(h) * self.model.lm_head_multiplier`` (falcon_h1), ``* self.config.logits_scaling``
  (hyperclovax);
- a final-logit softcap: ``if self.config.final_logit_softcapping is not None:`` divide, ``torch.tanh``, multiply
  (gemma2, gemma3_text, gemma3n, vaultgemma, ...; through ``get_text_config()`` in the multimodal ones), or
  ``nn.functional.tanh(logits / cap) * cap`` (recurrent_gemma);
- float casts (``.float()``, ``.to(torch.float32)``, ``.contiguous()``).

Rather than a table per model type and release, the statements after the lm head call are read (``ast``) as a
small program over the logits (multiply or divide by a value of the model, tanh, casts, ``if value is not
None``), its values read from the model at each call, and the result folded into ``c * tanh(s * x / c)`` (or
``s * x``). Whatever else a forward does (a module on the hidden states before the head or on the logits after
it, masked columns, a head other than the output embeddings, a statement not listed here) is refused with the
statement quoted: the chunked head would compute something other than the model's logits.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..errors import InvalidInputError

__all__ = ["FinalLogits", "final_logits"]


class FinalLogits(NamedTuple):
    """The model's logits are ``softcap * tanh(logit_scale * x / softcap)`` of the lm head's output ``x``
    (``logit_scale * x`` when softcap is None), and its backbone is ``model.<backbone>``."""

    softcap: float | None
    logit_scale: float
    backbone: str


class _Unknown(Exception):
    """A statement or expression outside the program's language; carries the node."""

    def __init__(self, node: ast.AST) -> None:
        super().__init__(ast.unparse(node))
        self.node = node


# A value of the model: a constant, a local name, or attributes read from ``self`` (``("config", "x")``; the
# item ``"get_text_config()"`` calls that method, an item ``(name, default)`` is ``getattr(obj, name, default)``).
# Ops over the logits: ("scale", value, divide), ("tanh",), ("bind", name, value), ("if", name or None, value,
# ops): ops run where value is not None.
_Value = tuple[Any, ...]
_Op = tuple[Any, ...]


class _Program(NamedTuple):
    backbone_calls: tuple[str, ...]  # names X of the ``self.X(...)`` calls before the head
    ops: tuple[_Op, ...]


_TANH = {"torch.tanh", "nn.functional.tanh", "torch.nn.functional.tanh", "F.tanh"}
_CASTS = {"float", "contiguous"}


def final_logits(model: torch.nn.Module) -> FinalLogits:
    """Read ``type(model).forward`` (source, cached per function) and ``model``'s values: what its forward applies
    to ``model.lm_head(...)``. Raises `InvalidInputError` naming the statement where it cannot be expressed."""
    forward = type(model).forward
    try:
        program = _program(forward)
    except _Unknown as error:
        raise _refusal(model, f"its forward has `{textwrap.shorten(str(error), 200)}`, which is not a scale, "
                       "softcap or cast of the head's logits") from None
    except _Refused as error:
        raise _refusal(model, str(error)) from None
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear) or head is not _output_embeddings(model):
        raise _refusal(model, f"its lm_head is {type(head).__name__}, not the nn.Linear of get_output_embeddings()")
    modules = [name for name in program.backbone_calls if isinstance(getattr(model, name, None), torch.nn.Module)]
    if len(modules) != 1:
        raise _refusal(model, f"its forward runs {modules or 'no'} submodule(s) before the lm head, not one backbone")
    scale, tanh_factor = 1.0, None  # logits = tanh_factor * tanh(scale * x), or scale * x
    for kind, value in _run(program.ops, model, {}):
        if kind == "tanh":
            if tanh_factor is not None:
                raise _refusal(model, "its forward applies tanh twice")
            tanh_factor = 1.0
        elif tanh_factor is None:
            scale *= value
        else:
            tanh_factor *= value
    if tanh_factor is None:
        return FinalLogits(None, scale, modules[0])
    if not tanh_factor > 0:
        raise _refusal(model, f"its softcap multiplies tanh by {tanh_factor!r}, not by a cap > 0")
    return FinalLogits(tanh_factor, scale * tanh_factor, modules[0])


class _Refused(Exception):
    """The forward's shape is outside what `model_logprobs` expresses; the message says where."""


def _refusal(model: torch.nn.Module, why: str) -> InvalidInputError:
    return InvalidInputError(
        f"model_logprobs cannot compute the logits of {type(model).__name__}",
        family=getattr(getattr(model, "config", None), "model_type", None),
        transformers_version=getattr(sys.modules.get("transformers"), "__version__", None), why=why,
        supported="forwards returning s * lm_head(h) or c * tanh(s * lm_head(h) / c) of one backbone's h "
        "(softcaps, logit scales, casts)",
        fix="run the model and pass its logits' log_softmax, or logprobs_entropy(hidden, weight, labels, "
        "softcap=..., logit_scale=...) with what the forward applies",
    )


def _output_embeddings(model: torch.nn.Module) -> object:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def _run(ops: tuple[_Op, ...], model: torch.nn.Module, names: dict[str, Any]) -> list[tuple[str, float]]:
    """The ops as ("scale", factor) and ("tanh", 1.0) with the model's values, in order."""
    out: list[tuple[str, float]] = []
    for op in ops:
        if op[0] == "tanh":
            out.append(("tanh", 1.0))
        elif op[0] == "bind":
            names[op[1]] = _value(op[2], model, names)
        elif op[0] == "if":
            value = _value(op[2], model, names)
            if op[1] is not None:
                names[op[1]] = value
            if value is not None:
                out += _run(op[3], model, names)
        else:
            value = _value(op[1], model, names)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value == 0:
                raise _refusal(model, f"its logits are scaled by {value!r} ({_describe(op[1])}), not by a number "
                               "!= 0")
            out.append(("scale", 1.0 / value if op[2] else float(value)))
    return out


def _value(value: _Value, model: torch.nn.Module, names: dict[str, Any]) -> Any:
    if value[0] == "const":
        return value[1]
    if value[0] == "name":
        if value[1] not in names:
            raise _refusal(model, f"its logits depend on {value[1]!r}, a value of the call")
        return names[value[1]]
    obj: Any = model
    for item in value[1:]:
        if item == "get_text_config()":
            obj = obj.get_text_config()
        else:
            obj = getattr(obj, *item) if isinstance(item, tuple) else getattr(obj, item)
    return obj


def _describe(value: _Value) -> str:
    if value[0] != "attr":
        return repr(value[1])
    return ".".join(["self", *(item[0] if isinstance(item, tuple) else item for item in value[1:])])


# ------------------------------------------------------------------------------------------------ parsing


@functools.cache
def _program(forward: Callable[..., Any]) -> _Program:
    """The forward's statements around its ``self.lm_head(...)`` call, parsed; raises `_Unknown` / `_Refused`."""
    try:
        source = textwrap.dedent(inspect.getsource(forward))
    except (OSError, TypeError) as error:
        raise _Refused(f"its forward's source cannot be read ({error})") from None
    function = ast.parse(source).body[0]
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise _Refused("its forward is not a function definition")
    body = function.body
    at = next((i for i, stmt in enumerate(body) if _calls_head(stmt)), None)
    if at is None:
        raise _Refused("its forward calls no self.lm_head")
    head = body[at]  # `var = <head call ...>`, not inside a branch or a return
    if not (isinstance(head, ast.Assign) and len(head.targets) == 1 and isinstance(head.targets[0], ast.Name)):
        raise _Unknown(head)
    var = head.targets[0].id
    ops = list(_logits_ops(head.value, var, first=True))
    rest = body[at + 1:]
    while rest:
        try:
            ops += _statement(rest[0], var)
        except _Unknown:
            break
        rest = rest[1:]
    for stmt in rest:  # nothing after the program may change the logits' values (4.x casts them for the loss)
        casts = {id(node.targets[0]) for node in ast.walk(stmt) if isinstance(node, ast.Assign) and _is_cast(node, var)}
        if any(_stores(node, var) and id(node) not in casts for node in ast.walk(stmt)):
            raise _Unknown(stmt)
    calls = tuple(node.func.attr for stmt in body[:at] for node in ast.walk(stmt)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_self_attr(node.func))
    return _Program(calls, tuple(ops))


def _is_self_attr(node: ast.AST, attr: str | None = None) -> bool:
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            and (attr is None or node.attr == attr))


def _calls_head(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and _is_self_attr(n.func, "lm_head") for n in ast.walk(node))


def _is_cast(node: ast.AST, var: str) -> bool:
    """``var = var.float()`` and the like: an assignment that keeps the logits' values."""
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == var):
        return False
    try:
        return _logits_ops(node.value, var, first=False) == []
    except _Unknown:
        return False


def _stores(node: ast.AST, var: str) -> bool:
    if isinstance(node, ast.Name) and node.id == var and isinstance(node.ctx, ast.Store):
        return True
    return isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and _stores_base(node.value, var)


def _stores_base(node: ast.AST, var: str) -> bool:
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return isinstance(node, ast.Name) and node.id == var


def _statement(stmt: ast.stmt, var: str) -> list[_Op]:
    """One statement after the head call: ``var = <logits expression>``, ``name = <value>``, or ``if <value> is not
    None:`` (optionally ``(name := <value>)``) around such statements."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        target = stmt.targets[0].id
        if target == var:
            return _logits_ops(stmt.value, var, first=False)
        return [("bind", target, _scalar(stmt.value))]
    if (isinstance(stmt, ast.If) and not stmt.orelse and isinstance(stmt.test, ast.Compare)
            and len(stmt.test.ops) == 1 and isinstance(stmt.test.ops[0], ast.IsNot)
            and isinstance(stmt.test.comparators[0], ast.Constant) and stmt.test.comparators[0].value is None):
        tested = stmt.test.left
        name = None
        if isinstance(tested, ast.NamedExpr):
            name, tested = tested.target.id, tested.value
        body = [op for inner in stmt.body for op in _statement(inner, var)]
        return [("if", name, _scalar(tested), tuple(body))]
    raise _Unknown(stmt)


def _logits_ops(node: ast.expr, var: str, *, first: bool) -> list[_Op]:
    """The ops an expression applies to the logits: the head call (``first``) or ``var``, scaled, tanh'd or cast."""
    if first and isinstance(node, ast.Call) and _is_self_attr(node.func, "lm_head"):
        if len(node.args) != 1 or node.keywords or not _plain_hidden(node.args[0]):
            raise _Unknown(node)
        return []
    if not first and isinstance(node, ast.Name) and node.id == var:
        return []
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        dotted = ast.unparse(node.func)
        if dotted in _TANH and len(node.args) == 1 and not node.keywords:
            return [*_logits_ops(node.args[0], var, first=first), ("tanh",)]
        if node.func.attr in _CASTS and not node.args and not node.keywords or _is_float32_cast(node):
            return _logits_ops(node.func.value, var, first=first)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
        try:
            return [*_logits_ops(node.left, var, first=first), ("scale", _scalar(node.right),
                                                                 isinstance(node.op, ast.Div))]
        except _Unknown:
            if isinstance(node.op, ast.Div):
                raise
            return [*_logits_ops(node.right, var, first=first), ("scale", _scalar(node.left), False)]
    raise _Unknown(node)


def _is_float32_cast(node: ast.Call) -> bool:
    """``.to(torch.float32)``, or ``.to(x.dtype)`` (gpt_neo casts its float32 logits back to their own dtype)."""
    if not (isinstance(node.func, ast.Attribute) and node.func.attr == "to" and len(node.args) == 1
            and not node.keywords):
        return False
    arg = node.args[0]
    return ast.unparse(arg) in ("torch.float32", "torch.float") or (isinstance(arg, ast.Attribute)
                                                                     and arg.attr == "dtype")


def _plain_hidden(node: ast.expr) -> bool:
    """The head's argument only selects or moves the hidden states (names, subscripts, slices, ``.to(...)``)."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Call) and not (isinstance(inner.func, ast.Attribute) and inner.func.attr == "to"):
            return False
    return True


def _scalar(node: ast.expr) -> _Value:
    """A value of the model: a number or None, a local name, or an attribute path from ``self`` (through
    ``get_text_config()`` and ``getattr(obj, "name", default)``)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (int, float))):
        return ("const", node.value)
    if isinstance(node, ast.Name) and node.id != "self":
        return ("name", node.id)
    path: list[Any] = []
    while True:
        if isinstance(node, ast.Attribute):
            path.append(node.attr)
            node = node.value
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and len(node.args) == 3
              and not node.keywords and isinstance(name := node.args[1], ast.Constant) and isinstance(name.value, str)
              and isinstance(default := node.args[2], ast.Constant)):  # getattr(obj, "name", default)
            path.append((name.value, default.value))
            node = node.args[0]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args
              and not node.keywords and node.func.attr == "get_text_config"):
            path.append("get_text_config()")
            node = node.func.value
        elif isinstance(node, ast.Name) and node.id == "self" and path:
            return ("attr", *reversed(path))
        else:
            raise _Unknown(node)
