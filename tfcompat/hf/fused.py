"""Liger-Kernel's fused kernels composed per module, where they compute exactly what the module computes.

`tfcompat.patch(model, fused=...)` routes four kinds of modules through Liger-Kernel's Triton kernels:

- ``"rms_norm"``: an RMSNorm whose forward is one of the two forms Liger's ``LigerRMSNormFunction`` implements
  (its ``casting_mode``): llama's (normalize in fp32, cast back, times the weight; Llama, Qwen2/3 and their q/k
  norms, Mistral, ...) or gemma's (everything in fp32, times ``1 + weight``, cast back).
- ``"swiglu"``: an MLP ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with a SiLU ``act_fn``, through Liger's
  SiLUMul kernels (silu(gate) * up in one kernel). Where the down projection is a plain ``nn.Linear`` and a
  gradient is wanted, it and the activation are two autograd nodes that hold gate / up's outputs only, not the
  activation, and whose backward runs in row blocks (`tfcompat.hf.swiglu_down`): less memory from the forward to
  the backward and at the backward's peak, and a checkpointed layer's recompute stops before the activation.
- ``"rope"``: the modeling module's ``apply_rotary_pos_emb`` in the llama form (``q * cos + rotate_half(q) *
  sin``, cos/sin unsqueezed at dim 1), through ``LigerRopeFunction``, for the attention modules of this model.
- ``"experts"``: a transformers 5.x MoE experts module (``@use_experts_implementation``: ``gate_up_proj`` ``(E, 2I,
  H)``, ``down_proj`` ``(E, H, I)``) computing ``sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))``, through
  ``LigerFusedMoEFunction`` (liger-kernel >= 0.8.5: grouped GEMMs with the gather and SwiGLU fused in, no padded
  or masked copies). Stock's ``grouped_mm`` path spends more time in its sorting, masking and scatter copies than
  in its GEMMs (bench/RESULTS.md section 20). Only where the weights are bf16 or fp16 when it runs: with float32
  weights the module runs stock (the kernel's float32 dot products would be TF32). Its router-weight gradient is
  summed over intermediate tiles in the weights' dtype (bf16 atomics), so it is not bitwise deterministic: under
  ``torch.use_deterministic_algorithms(True)`` the module runs stock too. The kernels autotune on their first
  call per shape (minutes on a fresh machine; ``LIGER_FUSED_MOE_AUTOTUNE=0`` before importing liger-kernel pins one
  configuration).

Exactness is decided from the code, not from the family name: a module's forward (and for gemma its ``_norm``)
must be, as a syntax tree without docstrings and annotations, one of the forms in ``_FORMS``; so a release or a
family that changes the computation is refused, not silently fused. The forms cover transformers 4.53 to 5.24.

What a fused patch changes, recorded on the handle and undone with it: an instance ``forward`` on each fused
RMSNorm and MLP, an instance ``forward`` on each attention module whose rotary is fused (it marks the call so
that the rotary of this model's attention, and only that, takes the kernel), and, process-wide and reference
counted, the modeling module's ``apply_rotary_pos_emb`` replaced by a dispatcher that calls the original
whenever no fused attention forward is running.

``fused=True`` (all four) or a collection of kernel names raises `PatchError` at patch time for any module of a
requested kind that the kernel would not compute exactly; ``fused="auto"`` fuses where exact (nothing without
liger-kernel) and leaves the other modules as they are; `plan` says which is which.
"""

from __future__ import annotations

import ast
import contextvars
import dataclasses
import functools
import importlib
import inspect
import sys
import textwrap
import types
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from ..errors import PatchError
from ..registry.sources import function
from . import swiglu_down
from .changes import Record

__all__ = ["KERNELS", "Fused", "FusedModule", "apply", "plan", "prepare"]

KERNELS: tuple[str, ...] = ("rms_norm", "swiglu", "rope", "experts")
Fused = bool | Literal["auto"] | Collection[str]

# The forms Liger's kernels compute, as the modeling code writes them (4.53 .. 5.24; names of parameters and
# locals as there). Compared as syntax trees without docstrings and annotations.
_FORMS: dict[str, list[str]] = {
    "rms_norm/llama": ["""
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
"""],
    "rms_norm/gemma": ["""
def forward(self, x):
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)
"""],
    "rms_norm/gemma._norm": ["""
def _norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
"""],
    "swiglu": ["""
def forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj
""", """
def forward(self, hidden_state):
    return self.down_proj(self.act_fn(self.gate_proj(hidden_state)) * self.up_proj(hidden_state))
"""],
    "rope": ["""
def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
""", """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
"""],
    # the eager experts forward of the @use_experts_implementation classes (5.2 .. 5.17, then 5.25's sentinel row)
    "experts/eager": [f"""
def forward(self, hidden_states, top_k_index, top_k_weights):
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes={classes})
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = self.act_fn(gate) * up
        current_hidden_states = nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    return final_hidden_states
""" for classes in ("self.num_experts", "self.num_experts + 1")],
    "rope/rotate_half": ["""
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
"""],
}


@dataclass(frozen=True)
class FusedModule:
    """One module of a kind a kernel handles: ``name`` in the model, the ``kernel``, and ``why`` it is not exact
    ("" when it is). For "rope", ``module`` is the attention module and ``form`` the modeling module's name."""

    name: str
    module: torch.nn.Module
    kernel: str
    form: str
    why: str


def kernels_of(fused: Fused) -> tuple[frozenset[str], bool]:
    """``fused`` as (kernel names, strict); strict: a non-exact module raises. `PatchError` for unknown names."""
    if fused is False:
        return frozenset(), True
    if fused is True:
        return frozenset(KERNELS), True
    if fused == "auto":
        return (frozenset(KERNELS) if _liger() is not None else frozenset()), False
    if isinstance(fused, str) or not isinstance(fused, Collection):
        raise PatchError(f"unknown fused option {fused!r}", supported=f"False, True, 'auto', or a subset of {KERNELS}",
                         fix="pass fused=True, fused='auto' or e.g. fused=('rms_norm', 'swiglu')")
    names = frozenset(fused)
    unknown = sorted(names - set(KERNELS))
    if unknown:
        raise PatchError(f"unknown fused kernels {unknown}", supported=", ".join(KERNELS),
                         fix="name kernels from the supported list")
    return names, True


def plan(model: torch.nn.Module, kernels: Collection[str] = KERNELS) -> list[FusedModule]:
    """Every module of ``model`` of a kind in ``kernels``, with whether the kernel is exact for it (``why`` empty).

    RMSNorm: a module whose class name ends in ``RMSNorm``; SwiGLU: a module with ``gate_proj``, ``up_proj``,
    ``down_proj`` and ``act_fn``; rope: a module whose class name ends in ``Attention`` and whose forward calls its
    modeling module's ``apply_rotary_pos_emb``; experts: a module of an ``@use_experts_implementation`` class (its
    ``has_bias`` and ``is_transposed`` flags) with ``gate_up_proj`` or ``up_proj``. Needs no liger-kernel.
    """
    found = []
    for name, module in model.named_modules():
        cls = type(module)
        if "rms_norm" in kernels and cls.__name__.endswith("RMSNorm"):
            form, why = _rms_norm_form(module)
            found.append(FusedModule(name, module, "rms_norm", form, why))
        elif "swiglu" in kernels and all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            found.append(FusedModule(name, module, "swiglu", "swiglu", _swiglu_gap(module)))
        elif ("experts" in kernels and hasattr(module, "has_bias") and hasattr(module, "is_transposed")
              and any(hasattr(module, a) for a in ("gate_up_proj", "up_proj"))):
            found.append(FusedModule(name, module, "experts", "experts", _experts_gap(module)))
        if "rope" in kernels and cls.__name__.endswith("Attention") and _calls(cls.forward, "apply_rotary_pos_emb"):
            modeling = sys.modules.get(cls.__module__)
            if modeling is not None and hasattr(modeling, "apply_rotary_pos_emb"):
                found.append(FusedModule(name, module, "rope", modeling.__name__, _rope_gap(modeling)))
    return found


def prepare(model: torch.nn.Module, fused: Fused, family: str, version: str) -> list[FusedModule]:
    """The modules `apply` will fuse, decided before `patch` changes anything.

    Raises `PatchError` when liger-kernel is missing for an explicit request, or, for an explicit request, when a
    module of a requested kind is not exact.
    """
    kernels, strict = kernels_of(fused)
    if not kernels:
        return []
    if _liger() is None:
        raise PatchError("fused kernels need liger-kernel, which does not import here", family=family,
                         transformers_version=version, why=_liger_error(),
                         fix="pip install liger-kernel (it needs triton and a GPU), or pass fused=False / 'auto'")
    modules = plan(model, kernels)
    if getattr(_liger(), "fused_moe", None) is None:
        modules = [dataclasses.replace(m, why="this liger-kernel has no fused MoE kernel (LigerFusedMoEFunction, "
                                       "liger-kernel 0.8.5 or later)") if m.kernel == "experts" and not m.why else m
                   for m in modules]
    refused = [m for m in modules if m.why]
    if strict and refused:
        first = refused[0]
        where = f"{first.name or 'the model'} ({type(first.module).__name__})"
        raise PatchError(
            f"fused kernel {first.kernel!r} is not exact for {where}"
            + (f" and {len(refused) - 1} more modules" if len(refused) > 1 else ""),
            family=family, transformers_version=version, why=first.why,
            supported="RMSNorm in the llama or gemma form, a SiLU gate/up/down MLP, the llama form of "
                      "apply_rotary_pos_emb, SiLU-gated MoE experts without biases in (E, 2I, H) / (E, H, I)",
            fix=f"pass fused='auto' (fuse only where exact) or leave {first.kernel!r} out of fused")
    return [m for m in modules if not m.why]


def apply(handle: Any, modules: list[FusedModule]) -> None:
    """Fuse the modules `prepare` chose, each change recorded on the `PatchHandle` and undone with it."""
    if not modules:
        return
    liger = cast(types.SimpleNamespace, _liger())  # prepare found it
    for m in modules:
        if m.kernel == "rms_norm":
            handle._set("instance", m.module, "forward", _rms_norm_forward(m.module, m.form, liger),
                        f"Liger RMSNorm ({m.form.split('/')[1]} casting)")
        elif m.kernel == "swiglu":
            handle._set("instance", m.module, "forward", _swiglu_forward(m.module, liger), "Liger SwiGLU (silu * up)")
        elif m.kernel == "experts":
            handle._set("instance", m.module, "forward", _experts_forward(m.module, liger),
                        "Liger fused MoE experts (grouped GEMMs, SwiGLU fused in; stock with float32 weights, in "
                        "deterministic mode or expert parallel)")
        else:
            modeling = sys.modules[m.form]
            _ROPE.acquire(handle, modeling, liger)
            handle._set("instance", m.module, "forward", _rope_scope(m.module.forward),
                        f"rotary through Liger's kernel ({modeling.__name__}.apply_rotary_pos_emb)")


# ------------------------------------------------------------------------------------------ forward time


def _rms_norm_forward(module: torch.nn.Module, form: str, liger: types.SimpleNamespace) -> Callable[..., Any]:
    gemma = form == "rms_norm/gemma"
    eps = module.eps if gemma else module.variance_epsilon
    offset, casting = (1.0, "gemma") if gemma else (0.0, "llama")

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        # in_place=False: the incoming gradient may be read again (residual branches)
        return liger.rms_norm(hidden_states, module.weight, eps, offset, casting, False)

    return forward


def _swiglu_forward(module: torch.nn.Module, liger: types.SimpleNamespace) -> Callable[..., Any]:
    mlp: Any = module

    def forward(x: torch.Tensor) -> torch.Tensor:
        a, b, down = mlp.gate_proj(x), mlp.up_proj(x), mlp.down_proj
        if swiglu_down.usable(down, a, b):  # holds a and b only; its backward in row blocks
            return swiglu_down.swiglu_down(a, b, down.weight, down.bias, liger)
        return down(liger.silu_mul(a, b))

    return forward


def _experts_forward(module: torch.nn.Module, liger: types.SimpleNamespace) -> Callable[..., Any]:
    """hidden_states ``(T, H)``, top_k_index ``(T, K)``, top_k_weights ``(T, K)`` -> ``(T, H)``, as stock."""
    experts: Any = module
    stock = type(module).forward.__get__(module)

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        w1, w2 = experts.gate_up_proj, experts.down_proj
        # float32: the kernel's dot products would be TF32; deterministic mode: its router gradient sums by atomics;
        # expert parallel (set up after the patch): the routes hold sentinel rows the kernel would index with
        if (w1.dtype not in (torch.bfloat16, torch.float16) or torch.are_deterministic_algorithms_enabled()
                or getattr(experts, "_is_expert_parallel", False)):
            return stock(hidden_states, top_k_index, top_k_weights)
        k = top_k_index.shape[-1]
        x = hidden_states.reshape(-1, hidden_states.shape[-1]).to(w1.dtype)  # as stock casts to the weights'
        out = liger.fused_moe(x, w1, w2, top_k_index.reshape(-1, k).to(torch.int32), top_k_weights.reshape(-1, k))
        return out.view(hidden_states.shape).to(hidden_states.dtype)

    return forward


_IN_FUSED_ATTENTION: contextvars.ContextVar[bool] = contextvars.ContextVar("tfcompat_fused_rope", default=False)


def _rope_scope(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The attention module's forward with the fused rotary switched on for its duration (the checkpointing
    recompute runs it again, switched on again)."""

    @functools.wraps(forward)
    def scoped(*args: Any, **kwargs: Any) -> Any:
        token = _IN_FUSED_ATTENTION.set(True)
        try:
            return forward(*args, **kwargs)
        finally:
            _IN_FUSED_ATTENTION.reset(token)

    return scoped


class _RopeSwap:
    """Reference-counted replacement of ``modeling.apply_rotary_pos_emb`` by a dispatcher: Liger's kernel inside
    a fused attention forward (4-d q/k ``(B, H, L, D)``, cos/sin ``(B, L, D)``, ``unsqueeze_dim`` 1), the
    original everywhere else."""

    def __init__(self) -> None:
        self.active: dict[str, tuple[Callable[..., Any], Callable[..., Any], int]] = {}

    def acquire(self, handle: Any, modeling: types.ModuleType, liger: types.SimpleNamespace) -> None:
        key = modeling.__name__
        if key in self.active:
            original, dispatcher, count = self.active[key]
            self.active[key] = (original, dispatcher, count + 1)
        else:
            original = getattr(modeling, "apply_rotary_pos_emb")  # noqa: B009 (plan found it)
            dispatcher = _rope_dispatcher(original, liger)
            setattr(modeling, "apply_rotary_pos_emb", dispatcher)  # noqa: B010
            self.active[key] = (original, dispatcher, 1)
        handle._add(_record(modeling, self.active[key][0], self.active[key][1]), lambda: self.release(modeling))

    def release(self, modeling: types.ModuleType) -> None:
        original, dispatcher, count = self.active[modeling.__name__]
        if count > 1:
            self.active[modeling.__name__] = (original, dispatcher, count - 1)
            return
        del self.active[modeling.__name__]
        if getattr(modeling, "apply_rotary_pos_emb") is dispatcher:  # noqa: B009 (replaced again: keep that)
            setattr(modeling, "apply_rotary_pos_emb", original)  # noqa: B010


_ROPE = _RopeSwap()


def _record(modeling: types.ModuleType, old: Any, new: Any) -> Any:
    return Record("process", modeling, "apply_rotary_pos_emb", old, new, True,
                  "fused attention forwards take Liger's rotary kernel; every other caller the original "
                  "(reference counted)")


def _rope_dispatcher(original: Callable[..., Any], liger: types.SimpleNamespace) -> Callable[..., Any]:
    @functools.wraps(original)
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             *args: Any, **kwargs: Any) -> Any:
        unsqueeze_dim = kwargs.get("unsqueeze_dim", args[-1] if args else 1)
        if (_IN_FUSED_ATTENTION.get() and unsqueeze_dim == 1 and q.ndim == 4 and cos.ndim == 3
                and cos.shape[-1] == q.shape[-1]):
            return liger.rope(q, k, cos, sin, None, 1)
        return original(q, k, cos, sin, *args, **kwargs)

    return apply_rotary_pos_emb


# ------------------------------------------------------------------------------------------- exactness


def _rms_norm_form(module: torch.nn.Module) -> tuple[str, str]:
    cls = type(module)
    forward = _tree(cls.forward)
    if forward in _trees("rms_norm/llama") and hasattr(module, "variance_epsilon"):
        return "rms_norm/llama", _weight_gap(module)
    if (forward in _trees("rms_norm/gemma") and hasattr(module, "eps")
            and _tree(getattr(cls, "_norm", None)) in _trees("rms_norm/gemma._norm")):
        return "rms_norm/gemma", _weight_gap(module)
    return "rms_norm/other", (f"{cls.__module__}.{cls.__name__}.forward is neither the llama nor the gemma RMSNorm "
                              "form Liger's kernel computes")


def _weight_gap(module: torch.nn.Module) -> str:
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.ndim != 1:
        return f"{type(module).__name__} has no 1-d weight (Liger's RMSNorm takes one of the hidden size)"
    return ""


def _swiglu_gap(module: torch.nn.Module) -> str:
    cls = type(module)
    if _tree(cls.forward) not in _trees("swiglu"):
        return f"{cls.__module__}.{cls.__name__}.forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x))"
    act = module.act_fn
    if not _is_silu(act):
        return f"its activation is {_name(act)}, not SiLU (Liger's SwiGLU kernel computes silu(gate) * up)"
    return ""


def _is_silu(act: Any) -> bool:
    return (act is torch.nn.functional.silu or isinstance(act, torch.nn.SiLU)
            or (type(act).__name__ == "SiLUActivation" and type(act).__module__ == "transformers.activations"))


def _name(act: Any) -> str:
    return getattr(act, "__name__", type(act).__name__)


# transformers' own experts implementations, whose arithmetic the flags below fix ("eager": the class's forward)
_EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")


def _experts_gap(module: torch.nn.Module) -> str:
    cls, m = type(module), cast(Any, module)
    flags = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
             "has_post_expert_norm": False, "_is_expert_parallel": False}
    off = [f"{k}={getattr(m, k)!r}" for k, v in flags.items() if getattr(m, k, v) != v]
    if off:
        return (f"its experts are not gate/up concatenated, untransposed, without biases or post-norms on one rank "
                f"({', '.join(off)})")
    moe = sys.modules.get("transformers.integrations.moe")
    if moe is None or getattr(cls, "_apply_gate", None) is not getattr(moe, "_default_apply_gate", None):
        return f"{cls.__name__} has its own _apply_gate (the kernel computes silu(gate) * up)"
    act = getattr(m, "act_fn", None)
    if not _is_silu(act):
        return f"its activation is {_name(act)}, not SiLU (the kernel computes silu(gate) * up)"
    w1, w2 = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not (isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor) and w1.ndim == w2.ndim == 3
            and w1.shape[0] == w2.shape[0] and w1.shape[1] == 2 * w2.shape[2] and w1.shape[2] == w2.shape[1]):
        return "its weights are not gate_up_proj (E, 2I, H) and down_proj (E, H, I)"
    implementation = getattr(getattr(m, "config", None), "_experts_implementation", None) or "eager"
    if implementation not in _EXPERTS_IMPLEMENTATIONS:
        return (f"it dispatches to experts implementation {implementation!r}, not one of "
                f"{', '.join(_EXPERTS_IMPLEMENTATIONS)}")
    if implementation == "eager" and _tree(getattr(cls.forward, "__wrapped__", cls.forward)) not in _trees(
            "experts/eager"):
        return f"{cls.__module__}.{cls.__name__}.forward is not the eager experts loop the kernel computes"
    return ""


def _rope_gap(modeling: types.ModuleType) -> str:
    fn = modeling.apply_rotary_pos_emb
    if fn in (d for _, d, _ in _ROPE.active.values()):
        fn = next(o for o, d, _ in _ROPE.active.values() if d is fn)  # fused already by another patched model
    if _tree(fn) not in _trees("rope"):
        return f"{modeling.__name__}.apply_rotary_pos_emb is not the llama form (q * cos + rotate_half(q) * sin)"
    if _tree(getattr(modeling, "rotate_half", None)) not in _trees("rope/rotate_half"):
        return f"{modeling.__name__}.rotate_half does not swap the two halves of the head dim"
    return ""


def _calls(fn: Any, name: str) -> bool:
    """Whether ``fn``'s source calls the global ``name`` (so replacing it in its module reaches the call)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function(fn))))
    except (TypeError, OSError, SyntaxError):
        return False
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name for n in ast.walk(tree))


def _tree(fn: Any) -> str | None:
    """``fn``'s syntax tree without its docstring, annotations and decorators; None if it has no Python source.
    A kernels function module (5.25's ``apply_rotary_pos_emb``) reads as the function it calls."""
    try:
        source = textwrap.dedent(inspect.getsource(function(fn)))
    except (TypeError, OSError):
        return None
    return _normalize(source)


@functools.cache
def _trees(form: str) -> frozenset[str]:
    return frozenset(t for t in (_normalize(s) for s in _FORMS[form]) if t is not None)


def _normalize(source: str) -> str | None:
    node = ast.parse(source).body[0]
    if not isinstance(node, ast.FunctionDef):
        return None
    node.decorator_list = []
    node.returns = None
    for arg in _all_args(node.args):
        arg.annotation = None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        node.body = body[1:]
    return ast.dump(node, annotate_fields=False, include_attributes=False)


def _all_args(args: ast.arguments) -> Iterator[ast.arg]:
    yield from args.posonlyargs
    yield from args.args
    yield from args.kwonlyargs
    if args.vararg:
        yield args.vararg
    if args.kwarg:
        yield args.kwarg


# ---------------------------------------------------------------------------------------------- kernels


@functools.cache
def _liger() -> types.SimpleNamespace | None:
    """Liger-Kernel's four Triton ops (the autograd Functions themselves, not its backend dispatch, which may
    pick another implementation), or None where liger-kernel or triton does not import."""
    try:
        ops = importlib.import_module("liger_kernel.ops")
        rope = importlib.import_module("liger_kernel.ops.rope").LigerRopeFunction
        try:
            fused_moe = importlib.import_module("liger_kernel.ops.fused_moe").LigerFusedMoEFunction.apply
        except (ImportError, AttributeError):  # liger-kernel < 0.8.5
            fused_moe = None
        swiglu = importlib.import_module("liger_kernel.ops.swiglu")
        return types.SimpleNamespace(rms_norm=ops.LigerRMSNormFunction.apply, silu_mul=ops.LigerSiLUMulFunction.apply,
                                     swiglu_forward=swiglu.swiglu_forward, swiglu_backward=swiglu.swiglu_backward,
                                     rope=rope.apply, fused_moe=fused_moe)
    except (ImportError, AttributeError, OSError, RuntimeError):  # not installed, or no usable triton
        return None


def _liger_error() -> str:
    try:
        importlib.import_module("liger_kernel.ops")
    except Exception as e:  # the reason it is unusable, for the error message
        return f"import liger_kernel.ops: {type(e).__name__}: {e}"
    return "liger_kernel.ops imports but lacks LigerRMSNormFunction / LigerSiLUMulFunction / LigerRopeFunction"
