"""Cross-attention states in a packed row (`tfcompat.registry.records.CrossStates`: Mllama's images).

The owner runs its vision tower on the row's images (each sequence's, concatenated in sequence order by
`tfcompat.pack`) and prepares the mask over their keys from the per-token mask over items, over the whole row. Stock
per sequence differs from that in two places, which the patch restores:

- a token that sees no item of its own sequence (before its first image) attends stock uniformly over its own
  sequence's keys (the prepared mask of such a row is 0) and its layer's MLP is gated off: the packed text model's
  forward hides every other sequence's keys from each token (`per_sequence_mask`), so such a row attends its own
  sequence's keys alone;
- a sequence without items skips its cross-attention layers stock: its tokens then attend no key at all, and
  `keep_skipped` hands the layer's input through as its output at those tokens.

The cross-attention itself attends to the states, not to the row: it runs the stock attention function of the
pre-patch implementation with that mask (`stock_attention`), never the packed core.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..core.context import CONTEXT_KWARG, ForwardContext, StockContext
from ..errors import InvalidInputError
from ..registry import Resolved

__all__ = ["keep_skipped", "per_sequence_mask", "stock_attention"]


def per_sequence_mask(r: Resolved, mask: Any, ctx: ForwardContext, name: str) -> torch.Tensor:
    """``mask`` ``(1, 1, T, K)`` (additive over the row's cross-attention keys, 0 attends) with every key of another
    sequence's items hidden (the dtype's min) from each token of the packed row ``ctx.seqs``; each of the row's
    ``sum(ctx.cross.counts)`` items holds ``K / sum`` keys, in sequence order. Device ops only (no host sync).
    `InvalidInputError` where the row's items are not known by sequence (a raw packed call), there is no mask, or
    the shapes disagree. name: the mask's keyword, for the errors."""
    fix = "pack the examples with tfcompat.pack(model, examples) and pass its model_inputs"
    if ctx.cross is None:
        raise r.error(InvalidInputError,
                      "cross-attention states on a packed row whose images are not known by sequence",
                      why="a raw packed call (position ids restarting, no tfcompat context from pack) does not say "
                      "which sequence each image belongs to; each token may attend to its own sequence's only",
                      fix=fix)
    if ctx.group is not None:
        raise r.error(InvalidInputError, "cross-attention states on a sequence-parallel packed row",
                      why="each rank holds a slice of the row's tokens; tfcompat hands the images' states to the "
                      "cross-attention of a whole row only", fix="run rows with images on one process (no "
                      "ulysses_group), or text rows only under Ulysses")
    counts = ctx.cross.counts
    items = sum(counts)
    if items == 0:
        raise r.error(InvalidInputError, "cross-attention states on a packed row whose examples hold no images",
                      why="tfcompat.pack assigns the images of each example's pixel_values to its sequence; states "
                      "given as such are assigned to none", fix="pass each example's pixel_values (the model's "
                      "vision tower computes the states)")
    if not isinstance(mask, torch.Tensor) or mask.ndim != 4 or mask.shape[:2] != (1, 1) or (
            mask.shape[-1] % items) or mask.shape[2] != ctx.seqs.total:
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise r.error(InvalidInputError, f"cross-attention states on a packed row with {name} {got}",
                      why=f"a packed row of {ctx.seqs.total} tokens whose sequences hold {list(counts)} images takes "
                      f"the (1, 1, T, K) mask its owner prepares from the processor's per-token mask, K a multiple of "
                      f"{items}", fix=fix)
    device = mask.device
    per_item = mask.shape[-1] // items
    ends = torch.tensor(counts).cumsum(0).mul(per_item).to(device, non_blocking=True)  # (N,): each one's keys end
    key_seq = torch.bucketize(torch.arange(mask.shape[-1], device=device), ends, right=True)  # (K,)
    token_seq = torch.bucketize(torch.arange(mask.shape[2], device=device), ctx.seqs.cu_seqlens[1:].to(device),
                                right=True)  # (T,)
    own = token_seq[:, None] == key_seq[None, :]  # (T, K)
    return mask.masked_fill(~own, torch.finfo(mask.dtype).min)


def stock_attention(context: StockContext) -> Any:
    """A forward pre-hook for a cross-attention module: its attention function gets ``context`` (the stock
    implementation), whichever path the forward took; the mask it is given says what it attends."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        return args, {**kwargs, CONTEXT_KWARG: context}

    return hook


def keep_skipped(layer: type, mask: str) -> Any:
    """A forward hook for a decoder layer holding cross-attention (class ``layer``): at the tokens whose ``mask``
    (its keyword, ``(1, 1, T, K)`` additive) hides every key, its output is its input (``hidden_states``), as the
    stock text model skips the layer for a sequence without states. A mask the owner prepares hides no row entirely
    (it sets such rows to 0), so only `per_sequence_mask`'s rows of a sequence without items are kept. A tuple
    output (4.x) keeps its first element so."""
    signature = inspect.signature(getattr(layer, "forward"))  # noqa: B009 -- a Module class

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        if output is None:  # the forward raised
            return None
        bound = signature.bind_partial(module, *args, **kwargs).arguments
        given, hidden = bound.get(mask), bound.get("hidden_states")
        if not isinstance(given, torch.Tensor) or given.ndim != 4 or not isinstance(hidden, torch.Tensor):
            return output
        attends = (given > torch.finfo(given.dtype).min).any(-1)[:, 0, :, None]  # (B, 1, T, K) -> (B, T, 1)
        first = output[0] if isinstance(output, tuple) else output
        kept = torch.where(attends, first, hidden)
        return (kept, *output[1:]) if isinstance(output, tuple) else kept

    return hook
