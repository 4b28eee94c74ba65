"""Sequence classifiers (reward models) on packed rows: one score per sequence, not one per row.

transformers' ``*ForSequenceClassification`` pools the score of each row's last non-pad token; on a packed row that
is the last sequence's only. A patched classifier returns, for a packed forward, the score of each sequence's last
non-pad token (what the stock model returns for that sequence alone), ``(N, C)`` for the ``N`` sequences of the
batch in order; padding at the end of a row (a sequence of its own for the boundaries) gets none.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..core.context import CONTEXT_KWARG, ForwardContext
from ..core.packing import PackedSeqs
from ..errors import InvalidInputError
from .forward import Router

__all__ = ["is_sequence_classifier", "pool_per_sequence", "pooled_forward", "scores_holder"]


def is_sequence_classifier(model: torch.nn.Module) -> bool:
    """``model`` is a transformers sequence classifier: it pools its ``score`` head's per-token output per row."""
    return type(model).__name__.endswith("ForSequenceClassification") and isinstance(
        getattr(model, "score", None), torch.nn.Module)


def pool_per_sequence(logits: torch.Tensor, seqs: PackedSeqs, input_ids: torch.Tensor | None, pad_token_id: int | None,
                      attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Each sequence's score, as the stock classifier pools a row holding that sequence alone.

    logits: ``(B, L, C)`` per-token scores of the packed rows; seqs: their boundaries (``T = B * L``); input_ids:
    ``(B, L)`` or None (inputs_embeds); attention_mask: ``(B, L)`` or None. The stock rule per sequence: its
    rightmost token that is not ``pad_token_id`` (its first token when every token is), or its last token without
    ids or without a pad id. Sequences with no attended token (a row's padding) are left out. Returns ``(N, C)``.
    """
    flat = logits.reshape(-1, logits.shape[-1])  # (B, L, C) -> (T, C)
    starts = seqs.cu_seqlens[:-1].to(flat.device, torch.long)
    ends = seqs.cu_seqlens[1:].to(flat.device, torch.long) - 1
    if input_ids is not None and pad_token_id is not None:
        ids = input_ids.reshape(-1).to(flat.device)  # (B, L) -> (T,)
        lengths = torch.tensor(seqs.lengths, device=flat.device)
        seq_of = torch.repeat_interleave(torch.arange(len(seqs.lengths), device=flat.device), lengths)  # (T,)
        index = torch.arange(ids.numel(), device=flat.device)
        candidate = torch.where(ids != pad_token_id, index, starts[seq_of])  # a pad token counts as the start
        ends = starts.scatter_reduce(0, seq_of, candidate, "amax")  # (N,): rightmost non-pad, else the start
    if attention_mask is not None:
        attended = attention_mask.reshape(-1).to(flat.device).bool()[starts]  # (N,)
        ends = ends[attended]
    return flat[ends]


def scores_holder(score: torch.nn.Module, held: dict[str, torch.Tensor]) -> Callable[..., torch.Tensor]:
    """An instance forward for the classifier's ``score`` head that keeps its per-token output ``(B, L, C)``."""
    original = score.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        held["logits"] = out = original(*args, **kwargs)
        return out

    return forward


def pooled_forward(original: Callable[..., Any], router: Router, held: dict[str, torch.Tensor],
                   pad_token_id: int | None) -> Callable[..., Any]:
    """Wrap the classifier's bound forward: on a packed forward, ``logits`` become the per-sequence scores
    `pool_per_sequence` gives; labels are refused there (the stock loss pairs one label with each row)."""
    sig = inspect.signature(original)
    var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        # a forward without **kwargs (4.x MistralForSequenceClassification) takes pack's context through the wrapper
        # below it (`_top_forward`), not by its signature
        a = sig.bind(*args, **{k: v for k, v in kwargs.items() if var_kw or k != CONTEXT_KWARG}).arguments
        router.last = None
        held.clear()
        out = original(*args, **kwargs)
        ctx = router.last
        if not isinstance(ctx, ForwardContext) or "logits" not in held:
            return out
        if a.get("labels") is not None:
            raise router.r.error(
                InvalidInputError, "labels passed to a packed forward of a sequence classifier",
                why="the stock loss pairs one label with each row's pooled score; a packed row holds several sequences",
                fix="compute the loss from out.logits (one score per sequence, (N, num_labels)) and a label per "
                "sequence")
        mask = a.get("attention_mask")
        out.logits = pool_per_sequence(held.pop("logits"), ctx.seqs, a.get("input_ids"), pad_token_id,
                                       mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None)
        return out

    return forward
