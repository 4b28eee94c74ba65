"""The per-sequence labels rule of a packed row: no target crosses a sequence boundary.

transformers' causal-LM loss shifts ``labels`` by one over the whole row (``logits[t]`` predicts ``labels[t + 1]``),
so on a packed row the label at a sequence start is only ever the target of the previous sequence's last token:
`mask_starts` ignores it there. Already shifted labels (``shift_labels[t]`` is the target of token ``t``) have no
target at a sequence's last token: `mask_ends` ignores it there, and `shift_labels` builds them from unshifted
labels. With these the row's loss is the sum of its sequences' losses, on every release.
"""

from __future__ import annotations

import torch

from .packing import PackedSeqs

__all__ = ["mask_ends", "mask_starts", "shift_labels"]


def mask_starts(labels: torch.Tensor, seqs: PackedSeqs, ignore_index: int = -100) -> torch.Tensor:
    """``labels (B, L)`` (unshifted) with ``ignore_index`` at every sequence start.

    >>> from tfcompat.core.packing import from_lengths
    >>> mask_starts(torch.tensor([[5, 6, 7, 8, 9]]), from_lengths([3, 2])).tolist()
    [[-100, 6, 7, -100, 9]]
    """
    starts = seqs.cu_seqlens[:-1].to(labels.device, torch.long)
    return labels.reshape(-1).index_fill(0, starts, ignore_index).view_as(labels)  # (B * L,) -> (B, L)


def mask_ends(shift_labels: torch.Tensor, seqs: PackedSeqs, ignore_index: int = -100) -> torch.Tensor:
    """``shift_labels (B, L)`` (already shifted) with ``ignore_index`` at every sequence's last token."""
    ends = seqs.cu_seqlens[1:].to(shift_labels.device, torch.long) - 1
    return shift_labels.reshape(-1).index_fill(0, ends, ignore_index).view_as(shift_labels)  # (B * L,) -> (B, L)


def shift_labels(labels: torch.Tensor, seqs: PackedSeqs, ignore_index: int = -100) -> torch.Tensor:
    """Next-token targets of ``labels (1, T)`` (unshifted) within each sequence: ``out[t] = labels[t + 1]``, and
    ``ignore_index`` at each sequence's last token. ``seqs`` cover the ``T`` tokens.

    >>> from tfcompat.core.packing import from_lengths
    >>> shift_labels(torch.tensor([[5, 6, 7, 8, 9]]), from_lengths([3, 2])).tolist()
    [[6, 7, -100, 9, -100]]
    """
    shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore_index)], dim=1)  # (1, T)
    return mask_ends(shifted, seqs, ignore_index)
