"""A caller's 4-D attention mask, compared with the block-diagonal causal mask of the packed boundaries.

transformers takes ``attention_mask`` of shape ``(B, 1, L, L)`` (or ``(1, 1, L, L)``, broadcast over the rows) as
given: bool (True attends) or floating additive (0 attends, a large negative value hides). On a raw packed row such a
mask means what the varlen core does only where it equals the mask the boundaries imply: each token attends to
itself and the earlier tokens of its own sequence. `disagreement` finds, on the mask's device and without a sync,
the first key where it does not; the forward copies that to the host with the position ids
(`tfcompat.hf.forward.Router.decide`), once per forward.
"""

from __future__ import annotations

import torch

__all__ = ["HIDDEN_AT_MOST", "block_causal", "disagreement", "is_comparable"]

# an additive mask hides a key with any value at or below this (transformers writes the dtype's minimum, older code
# -1e4 or -inf): softmax gives such a key a weight of exactly 0 next to any score an fp32 or bf16 model computes
HIDDEN_AT_MOST = -1e4


def is_comparable(mask: torch.Tensor, batch: int, length: int) -> bool:
    """Whether ``mask`` has a form transformers takes as a 4-D mask of ``batch`` rows of ``length`` tokens:
    ``(batch or 1, 1, length, length)``, bool or floating."""
    return (mask.ndim == 4 and mask.shape[0] in (1, batch) and tuple(mask.shape[1:]) == (1, length, length)
            and (mask.dtype == torch.bool or mask.is_floating_point()))


def block_causal(text: torch.Tensor) -> torch.Tensor:
    """``(B, L, L)`` bool, True where query ``i`` may attend key ``j``: ``j <= i`` in the same sequence. text: the
    ``(B, L)`` text position row; a sequence starts at each row start and wherever the position is 0 (the rule of
    `tfcompat.core.packing.from_host_positions`)."""
    starts = text == 0
    starts[:, 0] = True
    sequence = starts.long().cumsum(-1)  # (B, L): the index of each token's sequence in its row
    index = torch.arange(text.shape[-1], device=text.device)
    causal = index[:, None] >= index[None, :]  # (L, L)
    return (sequence[:, :, None] == sequence[:, None, :]) & causal  # (B, L, 1) == (B, 1, L) -> (B, L, L)


def disagreement(mask: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` int64: per query token, the first key where ``mask`` differs from `block_causal` of ``text``, -1
    where the whole row agrees. mask: ``(B or 1, 1, L, L)`` (`is_comparable`); text: ``(B, L)``. An additive
    mask agrees where it is exactly 0 at an attended key and at most `HIDDEN_AT_MOST` at a hidden one (NaN
    disagrees). Computed on ``mask``'s device, no sync."""
    expected = block_causal(text.to(mask.device))
    given = mask[:, 0]  # (B or 1, L, L)
    if given.dtype == torch.bool:
        differs = given != expected
    else:
        differs = torch.where(expected, given != 0, ~(given <= HIDDEN_AT_MOST))  # (B, L, L)
    first = differs.to(torch.uint8).argmax(-1)  # (B, L): the first True (argmax returns the first maximum)
    return torch.where(differs.any(-1), first, -1)
