"""The reference M-RoPE index of ERNIE-4.5-VL: Qwen2-VL's (`tfcompat.inputs.reference_rope.qwen2_vl`) on merged grids.

Reference: transformers 5.0's ``Ernie4_5_VL_MoeModel.get_rope_index`` (the release that added the model). Text
tokens advance all three rows together; an image of patch grid ``(1, h, w)`` or a video of ``(t, h, w)`` (``t``
frames, merged in pairs by the resampler: ``t // temporal_merge_size`` temporal steps) takes ``t``/``h``/``w``
coordinates offset by the position after the preceding text (``h, w`` after the spatial merge), and the text after
it resumes at ``max + 1``. No absolute time: the temporal step is 1. The image/video start and end tokens are text.
The departures of later releases are the Qwen2-VL ones (`qwen2_vl.DEVIATIONS`), on the same merged grids.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import InvalidInputError
from . import qwen2_vl

__all__ = ["DEVIATIONS", "rope_index"]

DEVIATIONS = {k: qwen2_vl.DEVIATIONS[k] for k in ("text_after_video_overlaps", "vision_grid_flattened")}


def rope_index(
    config: Any,
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    deviations: tuple[str, ...] = (),
) -> torch.Tensor:
    """``(3, B, L)`` rows ``[t; h; w]`` for ``input_ids (B, L)``; grids ``(n, 3)`` of patches, in order of appearance.

    second_per_grid_ts: refused (ERNIE-4.5-VL has no absolute time). deviations: names from `DEVIATIONS`.
    """
    unknown = set(deviations) - DEVIATIONS.keys()
    if unknown or second_per_grid_ts is not None:
        raise InvalidInputError("unknown rope-index deviations" if unknown else "ERNIE-4.5-VL takes no seconds",
                                why=f"{sorted(unknown)}" if unknown else "its temporal step is 1 per merged frame pair",
                                supported=f"{sorted(DEVIATIONS)}")
    if video_grid_thw is not None:  # (n, 3): frames -> temporal steps after the resampler's merge
        merged = video_grid_thw.clone()
        merged[:, 0] = merged[:, 0] // config.vision_config.temporal_merge_size
        video_grid_thw = merged
    return qwen2_vl.rope_index(config, input_ids, image_grid_thw, video_grid_thw, None, attention_mask, deviations)
