"""The position-id contract.

The contract, the same on every transformers version: position ids are ``(4, B, L)`` rows
``[text; t; h; w]`` (M-RoPE families) or ``(B, L)`` (text only: all four rows equal it). The text row
drives sequence boundaries and masks; ``t, h, w`` drive the multimodal rotary. A text model with another
number ``A`` of M-RoPE axes (HunYuan-VL's XD-RoPE: four) takes ``(1 + A, B, L)`` = ``[text; A rows]`` alike. Each
registry entry says which layout its text model accepts, and `tfcompat.hf.forward.to_text_model_layout` converts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import InvalidInputError

__all__ = ["Positions", "contract_shape", "split_positions", "text_row_from_mask"]


class Positions(NamedTuple):
    """Position ids split by role. text: ``(B, L)``; mrope: ``(A, B, L)`` rows ``[t; h; w]`` (A = 3, or the text
    model's number of M-RoPE axes)."""

    text: torch.Tensor
    mrope: torch.Tensor


def contract_shape(axes: int = 3) -> str:
    """The contract's position ids in words, for ``axes`` M-RoPE axes: ``(4, B, L) [text; t; h; w] or (B, L)``."""
    rows = "t; h; w" if axes == 3 else f"{axes} M-RoPE rows"
    return f"({axes + 1}, B, L) [text; {rows}] or (B, L)"


def split_positions(position_ids: torch.Tensor, *, seq_len: int, family: str | None = None,
                    axes: int | None = 3) -> Positions:
    """Split contract position ids into their text row and M-RoPE rows.

    position_ids: ``(1 + axes, B, L)`` ``[text; t; h; w]`` or ``(B, L)``. An ``(axes, B, L)`` tensor has no text
    row and is rejected: on a packed batch its rows do not restart at sequence starts, so boundaries and masks cannot
    be derived from it. axes: the text model's number of M-RoPE axes (3 but for HunYuan-VL's XD-RoPE); None where
    only the text row is read (a model-agnostic caller): any ``(R, B, L)`` with ``R >= 4`` is ``[text; R - 1]``.
    """
    if position_ids.is_floating_point() or position_ids.dtype in (torch.bool, torch.uint8):
        raise InvalidInputError(
            "position_ids must be an integer tensor",
            family=family,
            why=f"got dtype {position_ids.dtype}",
            fix="pass a LongTensor, e.g. the output of tfcompat.rope_index",
        )
    if position_ids.shape[-1] != seq_len:
        raise InvalidInputError(
            "position_ids and the input tokens differ in length",
            family=family,
            why=f"position_ids {tuple(position_ids.shape)} has {position_ids.shape[-1]} positions, the input has "
            f"{seq_len} tokens",
            fix="build one position per token (tfcompat.rope_index per sequence, concatenated on the last dim)",
        )
    rows = position_ids.shape[0] if position_ids.ndim == 3 else 0
    if position_ids.ndim == 2:
        return Positions(position_ids, position_ids[None].expand(axes or 3, -1, -1))
    if rows == (axes + 1 if axes is not None else max(rows, 4)):
        return Positions(position_ids[0], position_ids[1:])
    if rows == (axes if axes is not None else 3):
        raise InvalidInputError(
            f"{rows}-row position ids have no text row",
            family=family,
            why=f"({rows}, B, L) ids are the M-RoPE rows only; a packed batch needs the text row in front of them "
            "to find sequence boundaries",
            supported=contract_shape(axes or 3),
            fix=f"pass tfcompat.rope_index(model, input_ids, ...) ({rows + 1} rows), concatenated per sequence",
        )
    raise InvalidInputError(
        "position_ids have an unsupported shape",
        family=family,
        why=f"got {tuple(position_ids.shape)}",
        supported=contract_shape(axes or 3),
    )


def text_row_from_mask(attention_mask: torch.Tensor | None, batch: int, length: int,
                       device: torch.device) -> torch.Tensor:
    """The text row of a (possibly padded) batch: ``(B, L)``, counting only attended tokens.

    Padding positions get 1, as transformers' generation does, so they never look like a sequence start.
    """
    if attention_mask is None:
        return torch.arange(length, device=device).expand(batch, -1)
    mask = attention_mask.to(device=device, dtype=torch.long)
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
