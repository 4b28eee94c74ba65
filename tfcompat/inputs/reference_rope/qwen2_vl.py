"""The reference M-RoPE index of Qwen2-VL and Qwen2.5-VL, the one the installed ``get_rope_index`` is tested against.

Reference: Qwen2-VL (Wang et al. 2024, section 2.1) and transformers 4.57's ``Qwen2_5_VLModel.get_rope_index``.
Text tokens advance all three rows together; a vision item of grid ``(t, h, w)`` (``h, w`` after the
spatial merge) gets ``t``/``h``/``w`` coordinates offset by the position after the preceding text, and the
text after it resumes at ``max + 1``. Qwen2.5-VL scales ``t`` by ``second_per_grid_t * tokens_per_second``
(images: 0) in torch arithmetic of the seconds' dtype, as transformers (5.18+) and verl do: ``(arange(t) *
(tokens_per_second * seconds)).long()``, so float32 seconds such as 0.7 land where theirs do (float64 would
round 2 * 0.7 * 5 up to 7, float32 gives 6.9999995 -> 6). Padding positions are left at 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ...errors import InvalidInputError

__all__ = ["DEVIATIONS", "rope_index"]

DEVIATIONS = {
    "seconds_truncated": "a fractional second_per_grid_ts is truncated to an int before scaling the t row",
    "text_after_video_overlaps": "text after a vision item resumes at start + max(h, w) rather than max + 1, "
    "so after a video whose t extent exceeds its h/w extent text positions overlap the video's",
    "vision_grid_flattened": "a vision item's positions ignore its frames: every token gets t = start * "
    "time_interval, and h = k // (w * t) for token k, so a video's frames share one t and smear h",
    "seconds_consumed_by_images": "images consume second_per_grid_ts entries too (and each item defaults to 1 "
    "when none is given), so a video can get another item's seconds",
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
    """``(3, B, L)`` rows ``[t; h; w]`` for ``input_ids (B, L)``; grids ``(n, 3)`` in order of appearance.

    deviations: names from `DEVIATIONS` to reproduce (to tell a known transformers bug from a new one).
    """
    unknown = set(deviations) - DEVIATIONS.keys()
    if unknown:
        raise InvalidInputError("unknown rope-index deviations", why=f"{sorted(unknown)}",
                                supported=f"{sorted(DEVIATIONS)}")
    merge = config.vision_config.spatial_merge_size
    tokens_per_second = getattr(config.vision_config, "tokens_per_second", None)
    out = torch.ones(3, *input_ids.shape, dtype=torch.long)
    grids = {config.image_token_id: _rows(image_grid_thw), config.video_token_id: _rows(video_grid_thw)}
    # 0-d tensors: their dtype
    seconds: Iterator[torch.Tensor] = iter(second_per_grid_ts if second_per_grid_ts is not None else [])
    for b, row in enumerate(input_ids.tolist()):
        keep = [True] * len(row) if attention_mask is None else attention_mask[b].bool().tolist()
        tokens = [tok for tok, k in zip(row, keep) if k]
        pos: list[tuple[int, int, int]] = []
        i, nxt = 0, 0  # token index, first position after what came before
        while i < len(tokens):
            tok = tokens[i]
            if tok not in grids:
                pos.append((nxt, nxt, nxt))
                nxt, i = nxt + 1, i + 1
                continue
            try:
                t, h, w = next(grids[tok])
            except StopIteration:
                raise InvalidInputError("more vision placeholder runs than grids", why=f"row {b}, token {i}") from None
            h, w = h // merge, w // merge
            interval: Any = 1  # t steps per frame; an image has one frame, so only videos' matters
            consumed = tok == config.video_token_id or "seconds_consumed_by_images" in deviations
            if tokens_per_second is not None and consumed:  # Qwen2.5-VL: absolute time
                second = next(seconds, 1)
                interval = tokens_per_second * (int(second) if "seconds_truncated" in deviations else second)
            steps = (torch.arange(t) * interval).long().tolist()  # t row offsets, in the seconds' dtype
            if "vision_grid_flattened" in deviations:  # token k: t fixed, h = k // (w * t), w = k % w
                start = int((torch.tensor(nxt) * interval).long())
                pos += [(start, nxt + k // (w * t), nxt + k % w) for k in range(t * h * w)]
            else:
                pos += [(nxt + steps[ti], nxt + hi, nxt + wi) for ti in range(t) for hi in range(h) for wi in range(w)]
            i += t * h * w
            nxt = nxt + max(h, w) if "text_after_video_overlaps" in deviations else max(max(p) for p in pos) + 1
        flat = torch.tensor(pos, dtype=torch.long).T if pos else torch.empty(3, 0, dtype=torch.long)
        out[:, b, torch.tensor(keep, dtype=torch.bool)] = flat
    return out


def _rows(grid: torch.Tensor | None):
    return iter(grid.tolist() if grid is not None else [])
