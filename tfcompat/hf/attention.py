"""The adapter between transformers' attention dispatch and tfcompat's varlen core.

transformers' attention modules compute q/k/v, apply their own rotary, then call
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, scaling=..., **kwargs)``.
A patched model's text config names `ATTENTION_KEY`, registered here, so the stock forward (and the stock
rotary of that version) runs unchanged and only the attention itself is ours. The key has no mask function
registered, so transformers builds no (T, T) mask for it. The packed boundaries arrive in the
`tfcompat.context.ForwardContext`.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from .. import ulysses
from ..core.attention import varlen_attention
from ..core.context import BRIDGE_ATTR, CONTEXT_KWARG, StockContext
from ..errors import PatchedModelError

__all__ = ["ATTENTION_KEY", "FEATURES_ATTR", "packed_attention", "register", "stock_function", "unregister"]

ATTENTION_KEY = "tfcompat_packed"
# the attention module's `tfcompat.core.attention.AttentionFeatures`, set by `tfcompat.patch` (`tfcompat.hf.features`)
FEATURES_ATTR = "_tfcompat_features"


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
    boundaries come from the context. A `tfcompat.context.StockContext` (an ordinary call recomputed under
    gradient checkpointing) goes to the stock function instead, with the stock mask. Under Ulysses (``B == 1``, ``L = T / sp``), q/k/v are traded for a
    head split before the core and back after it.
    """
    ctx = kwargs.get(CONTEXT_KWARG) or module.__dict__.get(BRIDGE_ATTR)
    if isinstance(ctx, StockContext):  # an ordinary call, recomputed under gradient checkpointing after its forward
        return stock_function(ctx)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if ctx is None:
        raise PatchedModelError(
            f"{type(module).__name__} runs tfcompat's packed attention without packed boundaries",
            why="the attention was called outside the patched text model's forward",
            fix="call the patched model (or its text model) rather than a decoder layer directly, or undo() the patch",
        )
    b, hq, length, d = query.shape
    # (B, H, L, D) -> (B * L, H, D)
    q = query.transpose(1, 2).reshape(b * length, hq, d)
    k = key.transpose(1, 2).reshape(b * length, key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * length, value.shape[1], d)
    if ctx.group is None:
        out = varlen_attention(q, k, v, ctx.seqs, scale=scaling, backend=ctx.backend)
        return out.view(b, length, hq, d), None
    # one exchange: (T/sp, Hq, D), 2 x (T/sp, Hkv, D) -> (T, Hq/sp, D), 2 x (T, max(Hkv/sp, 1), D); with Hkv < sp
    # each rank receives its one KV head (repeated sp // Hkv times over the group, not to full multi-head)
    q, k, v = ulysses.qkv_to_heads(q, k, v, ctx.group, ctx.transport)
    out = varlen_attention(q, k, v, ctx.seqs, scale=scaling, backend=ctx.backend)
    return ulysses.heads_to_seq(out, ctx.group, ctx.transport).view(b, length, hq, d), None


def stock_function(ctx: StockContext) -> Any:
    """The attention function of the implementation named by ``ctx`` (``"eager"``: the family's own)."""
    if ctx.impl == "eager" and ctx.eager is not None:
        return ctx.eager
    return importlib.import_module("transformers.modeling_utils").ALL_ATTENTION_FUNCTIONS[ctx.impl]


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
