"""Selective activation checkpointing: outputs of chosen modules kept through gradient checkpointing.

With transformers' gradient checkpointing each decoder layer runs its forward twice: once without saving
activations, and again in the backward to rebuild them. `tfcompat.patch(model, checkpoint_keep=...)` keeps the
outputs of the named modules of each checkpointed layer out of that recompute:

- ``"attention"``: the layer's attention module (q/k/v projections, rotary, the attention call with what its
  backend saves for its backward: q, k, v, output and log-sum-exp; the output projection);
- ``"mlp"``: the layer's MLP or MoE block (``mlp``, ``feed_forward`` or ``block_sparse_moe``).

The recompute still runs everything else of the layer (norms, residual adds, the modules not kept). Gradients
are those of full checkpointing: the backward runs the same graph; only where the saved tensors come from changes.

How: the patch adds a ``context_fn`` (`torch.utils.checkpoint`'s selective-checkpoint hook: one context around
the forward, one around the recompute) to the checkpoint function transformers' ``gradient_checkpointing_enable``
set on each layer. In the forward a kept module runs with its saved tensors held as they are (an inner
``saved_tensors_hooks``, so checkpointing does not drop them) and its output is remembered; in the recompute it
is not run: its output comes back from the forward. Both passes then save the same tensors in the same order,
which non-reentrant checkpointing checks. This works at module boundaries rather than on aten ops
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`) because an op policy cannot cache kernels that
are not aten ops, such as FlashAttention-4's, and would recompute them.

Memory: what the kept modules save stays from the forward until the layer's backward. On a 28-layer
Qwen2.5-7B-shaped step of 19,679 tokens (bench/RESULTS.md section 11): full checkpointing 31 GiB peak, ``"attention"``
38 GiB (1.04x faster), ``("attention", "mlp")`` 102 GiB (1.22x faster; checkpointing off: 98 GiB, as fast).

Needs gradient checkpointing on, non-reentrant, before `patch` (`PatchError` otherwise). Enabling it again after
the patch replaces the checkpoint function; a kept module then raises `PatchedModelError` in the next checkpointed
forward rather than silently recomputing. Not for ``torch.compile`` of a checkpointed layer (its ``context_fn``
must be a dispatch mode).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils._pytree import tree_map, tree_map_only

from ..errors import PatchedModelError, PatchError

__all__ = ["KEEP", "CheckpointKeep", "Kept", "apply", "kinds_of", "plan"]

KEEP: tuple[str, ...] = ("attention", "mlp")
CheckpointKeep = str | Collection[str]
_MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe")


@dataclass(frozen=True)
class Kept:
    """One module whose output a checkpointed ``layer`` keeps (``kind`` in `KEEP`), ``name`` in the model."""

    name: str
    module: torch.nn.Module
    layer: torch.nn.Module
    kind: str


def kinds_of(keep: CheckpointKeep) -> frozenset[str]:
    """``checkpoint_keep`` as a set of kinds; `PatchError` for unknown ones."""
    names = frozenset([keep] if isinstance(keep, str) else keep)
    unknown = sorted(names - set(KEEP))
    if unknown:
        raise PatchError(f"unknown checkpoint_keep kinds {unknown}", supported=", ".join(KEEP),
                         fix="pass e.g. checkpoint_keep='attention' or checkpoint_keep=('attention', 'mlp')")
    return names


def plan(model: torch.nn.Module, keep: CheckpointKeep, attention_cls: type, error: Callable[..., PatchError]
         ) -> tuple[list[Kept], list[torch.nn.Module]]:
    """The kept modules and the modules whose checkpoint function gets the context, before anything changes.

    ``error(PatchError, what, why=..., fix=...)`` builds the family's error. Raises when checkpointing is off or
    reentrant, or a kind is found in no checkpointed layer.
    """
    kinds = kinds_of(keep)
    if not kinds:
        return [], []
    holders = [m for m in model.modules() if "_gradient_checkpointing_func" in vars(m)]
    layers = [m for m in holders if getattr(m, "gradient_checkpointing", False)]
    if not layers:
        raise error(PatchError, f"checkpoint_keep={keep!r} but gradient checkpointing is off",
                    why="checkpoint_keep keeps module outputs out of gradient checkpointing's recompute",
                    fix="call model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
                        "False}) before patch(), or leave checkpoint_keep out")
    for m in holders:
        fn = m._gradient_checkpointing_func
        kw = fn.keywords if isinstance(fn, functools.partial) else None
        if kw is None or kw.get("use_reentrant", True) or "context_fn" in kw:
            raise error(PatchError, f"checkpoint_keep needs non-reentrant checkpointing without a context_fn, "
                        f"{type(m).__name__} has {fn!r}",
                        why="the kept outputs come back through torch.utils.checkpoint's context_fn, which only the "
                            "non-reentrant checkpoint takes (and takes once)",
                        fix="gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})")
    names = {id(m): n for n, m in model.named_modules()}
    kept: list[Kept] = []
    for layer in layers:
        for child in layer.children():
            if "attention" in kinds and isinstance(child, attention_cls):
                kept.append(Kept(names[id(child)], child, layer, "attention"))
        for attr in _MLP_NAMES:
            mlp = getattr(layer, attr, None)
            if "mlp" in kinds and isinstance(mlp, torch.nn.Module):
                kept.append(Kept(names[id(mlp)], mlp, layer, "mlp"))
    missing = sorted(kinds - {k.kind for k in kept})
    if missing:
        raise error(PatchError, f"checkpoint_keep {missing} matches no module of a checkpointed layer",
                    why=f"checkpointed layers: {sorted({type(m).__name__ for m in layers})}; attention is a child "
                        f"{attention_cls.__name__}, mlp a child named one of {_MLP_NAMES}",
                    fix=f"leave {missing} out of checkpoint_keep")
    return kept, holders


def apply(handle: Any, kept: list[Kept], holders: list[torch.nn.Module]) -> None:
    """Give each checkpoint function the context and each kept module its forward, recorded on the handle."""
    for m in holders:
        fn = cast(functools.partial, m._gradient_checkpointing_func)  # plan checked it
        handle._set("instance", m, "_gradient_checkpointing_func", _with_context(fn),
                    "checkpoint with tfcompat's context_fn (kept module outputs are not recomputed)")
    for k in kept:
        handle._set("instance", k.module, "forward", _kept_forward(k.module.forward, k.layer),
                    f"output kept through gradient checkpointing ({k.kind}), not recomputed")


# ------------------------------------------------------------------------------------------ forward time


class _Outputs:
    """One checkpointed call's kept outputs, in call order: appended in the forward, taken in the recompute."""

    def __init__(self) -> None:
        self.items: list[tuple[Any, Any]] = []  # (outputs detached, their requires_grad)
        self.taken = 0


_SCOPE: contextvars.ContextVar[tuple[_Outputs, bool] | None] = contextvars.ContextVar("tfcompat_kept", default=None)


@contextlib.contextmanager
def _scope(outputs: _Outputs, recompute: bool) -> Iterator[None]:
    if recompute:
        outputs.taken = 0  # a second backward (retain_graph) recomputes again
    token = _SCOPE.set((outputs, recompute))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def _context_fn() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    outputs = _Outputs()
    return _scope(outputs, False), _scope(outputs, True)


def _with_context(fn: functools.partial) -> Callable[..., Any]:
    """transformers' checkpoint function (a partial of ``checkpoint`` with ``use_reentrant=False``) plus the
    context_fn."""
    return functools.partial(fn, context_fn=_context_fn)


def _hold(t: torch.Tensor) -> torch.Tensor:
    return t.detach()  # the saved tensor's data without its autograd history


def _kept_forward(forward: Callable[..., Any], layer: torch.nn.Module) -> Callable[..., Any]:
    @functools.wraps(forward)
    def kept(*args: Any, **kwargs: Any) -> Any:
        scope = _SCOPE.get()
        if scope is None:
            if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
                raise PatchedModelError(
                    f"{type(layer).__name__} checkpoints without tfcompat's context, so checkpoint_keep is lost",
                    why="gradient checkpointing was enabled again after patch(checkpoint_keep=...), which replaced "
                        "the checkpoint function the patch had extended",
                    fix="undo() the patch, enable gradient checkpointing, then patch again")
            return forward(*args, **kwargs)
        outputs, recompute = scope
        if recompute:
            detached, grads = outputs.items[outputs.taken]
            outputs.taken += 1
            # the same requires_grad as in the forward: the rest of the recompute then saves the same tensors
            return _rebuild(detached, grads)
        with torch.autograd.graph.saved_tensors_hooks(_hold, lambda t: t):  # innermost hooks: kept, not dropped
            out = forward(*args, **kwargs)
        outputs.items.append((tree_map_only(torch.Tensor, torch.Tensor.detach, out),
                              tree_map_only(torch.Tensor, lambda t: t.requires_grad, out)))
        return out

    return kept


def _rebuild(detached: Any, grads: Any) -> Any:
    """Fresh leaves of the kept outputs (each recompute builds its own graph on them)."""
    return tree_map(lambda d, g: d.detach().requires_grad_(g) if isinstance(d, torch.Tensor) else d, detached, grads)

