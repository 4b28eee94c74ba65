"""The adapter between transformers' attention dispatch and tfcompat's varlen core.

transformers' attention modules compute q/k/v, apply their own rotary, then call
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, scaling=..., **kwargs)``.
A patched model's text config names `ATTENTION_KEY`, registered here, so the stock forward (and the stock
rotary of that version) runs unchanged and only the attention itself is ours. The key has no mask function
registered, so transformers builds no (T, T) mask for it. The packed boundaries travel in ``kwargs`` under
`CONTEXT_KWARG` (checkpoint-safe: recomputation replays the same kwargs).
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import torch

from .attention import Backend, varlen_attention
from .errors import PatchError
from .packing import PackedSeqs

__all__ = ["ATTENTION_KEY", "CONTEXT_KWARG", "BRIDGE_ATTR", "ForwardContext", "packed_attention", "register", "unregister"]

ATTENTION_KEY = "tfcompat_packed"
CONTEXT_KWARG = "tfcompat_context"
BRIDGE_ATTR = "_tfcompat_context"  # set by the decoder-layer pre-hook where layers drop kwargs


class ForwardContext(NamedTuple):
    """What every attention layer of one forward shares: boundaries and the backend."""

    seqs: PackedSeqs
    backend: Backend = "auto"


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over the packed core.

    query: ``(B, Hq, L, D)``; key, value: ``(B, Hkv, L, D)`` (already rotated by the stock forward).
    Returns ``(B, L, Hq, D)`` and no weights. ``attention_mask`` is ignored: causality and sequence
    boundaries come from the context.
    """
    ctx = kwargs.get(CONTEXT_KWARG) or module.__dict__.get(BRIDGE_ATTR)
    if ctx is None:
        raise PatchError(
            f"{type(module).__name__} runs tfcompat's packed attention without packed boundaries",
            why="the attention was called outside the patched text model's forward",
            fix="call the patched model (or its text model) rather than a decoder layer directly, or undo() the patch",
        )
    b, hq, length, d = query.shape
    # (B, H, L, D) -> (B * L, H, D)
    q = query.transpose(1, 2).reshape(b * length, hq, d)
    k = key.transpose(1, 2).reshape(b * length, key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * length, value.shape[1], d)
    out = varlen_attention(q, k, v, ctx.seqs, scale=scaling, backend=ctx.backend)
    return out.view(b, length, hq, d), None


def _interface() -> Any:
    return importlib.import_module("transformers.modeling_utils").AttentionInterface


_users = 0


def register() -> None:
    """Add `ATTENTION_KEY` to transformers' AttentionInterface (process-wide; reference counted)."""
    global _users
    _interface().register(ATTENTION_KEY, packed_attention)
    _users += 1


def unregister() -> None:
    """Drop one use of `ATTENTION_KEY`; the last one removes it from the AttentionInterface."""
    global _users
    _users -= 1
    if _users == 0:
        _interface()._global_mapping.pop(ATTENTION_KEY, None)
