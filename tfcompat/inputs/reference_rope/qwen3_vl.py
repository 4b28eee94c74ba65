"""The reference M-RoPE index of Qwen3-VL and Qwen3-VL-MoE, the one the installed ``get_rope_index`` is tested against.

Reference: Qwen3-VL (Qwen team 2025, "Qwen3-VL technical report", interleaved MRoPE and text-timestamp video
alignment) and transformers 4.57's ``Qwen3VLModel.get_rope_index`` with ``Qwen3VLProcessor``'s layout. Text
tokens advance all three rows together. Every image, and every *frame* of a video (the processor writes each
frame as its own vision run after a ``<t seconds>`` timestamp text), is an item of grid ``(1, h, w)`` (``h, w``
after the spatial merge): ``t`` stays at the item's start, ``h``/``w`` count from it, and the text after it
resumes at ``max + 1``. Time lives in the timestamp text, never in the ``t`` row. Padding positions are left at 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ...errors import InvalidInputError

__all__ = ["DEVIATIONS", "rope_index"]

DEVIATIONS = {
    "video_grid_unsplit": "a video's grid is not split into frames: the first frame's run takes the whole video's "
    "grid, so a video of more than one frame cannot be placed (the installed index raises StopIteration)",
}


def rope_index(
    config: Any,
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    deviations: tuple[str, ...] = (),
) -> torch.Tensor:
    """``(3, B, L)`` rows ``[t; h; w]`` for ``input_ids (B, L)``; grids ``(n, 3)`` in order of appearance, a video's
    ``t`` counting its frames. second_per_grid_ts: must be None (Qwen3-VL's time is in the timestamp text).

    deviations: names from `DEVIATIONS` to reproduce (to tell a known transformers bug from a new one).
    """
    unknown = set(deviations) - DEVIATIONS.keys()
    if unknown:
        raise InvalidInputError("unknown rope-index deviations", why=f"{sorted(unknown)}",
                                supported=f"{sorted(DEVIATIONS)}")
    if second_per_grid_ts is not None:
        raise InvalidInputError("Qwen3-VL takes no second_per_grid_ts", why="video time is written as timestamp text",
                                fix="drop the argument")
    merge = config.vision_config.spatial_merge_size
    out = torch.ones(3, *input_ids.shape, dtype=torch.long)
    if "video_grid_unsplit" in deviations and video_grid_thw is not None and bool((video_grid_thw[:, 0] > 1).any()):
        raise InvalidInputError("a video of more than one frame cannot be placed with 'video_grid_unsplit'",
                                why=DEVIATIONS["video_grid_unsplit"], fix="use the reference without the deviation")
    frames = {config.image_token_id: _items(image_grid_thw), config.video_token_id: _items(video_grid_thw)}
    for b, row in enumerate(input_ids.tolist()):
        keep = [True] * len(row) if attention_mask is None else attention_mask[b].bool().tolist()
        tokens = [tok for tok, k in zip(row, keep) if k]
        pos: list[tuple[int, int, int]] = []
        i, nxt = 0, 0  # token index, first position after what came before
        while i < len(tokens):
            tok = tokens[i]
            if tok not in frames:
                pos.append((nxt, nxt, nxt))
                nxt, i = nxt + 1, i + 1
                continue
            try:
                h, w = next(frames[tok])
            except StopIteration:
                raise InvalidInputError("more vision placeholder runs than grids", why=f"row {b}, token {i}") from None
            h, w = h // merge, w // merge
            pos += [(nxt, nxt + hi, nxt + wi) for hi in range(h) for wi in range(w)]
            i += h * w
            nxt += max(h, w)
        flat = torch.tensor(pos, dtype=torch.long).T if pos else torch.empty(3, 0, dtype=torch.long)
        out[:, b, torch.tensor(keep, dtype=torch.bool)] = flat
    return out


def _items(grid: torch.Tensor | None) -> Iterator[tuple[int, int]]:
    """``(h, w)`` of every image, or of every frame of every video, in order."""
    for t, h, w in grid.tolist() if grid is not None else []:
        for _ in range(t):
            yield h, w
