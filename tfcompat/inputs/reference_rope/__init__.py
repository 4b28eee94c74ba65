"""tfcompat's reference M-RoPE indices, one module per scheme, named by `tfcompat.records.Family.reference_rope_index`.

Each computes ``(3, B, L)`` rows ``[t; h; w]`` from the original model's semantics, without any installed
release's bugs; a release's known departures are declared on its registry entry by name (the scheme's
``DEVIATIONS``) and can be reproduced, so the tests tell a known bug from a new one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import torch

from . import ernie4_5_vl, glm4v, qwen2_vl, qwen3_vl

__all__ = ["REFERENCES", "Reference", "ReferenceRopeIndex"]


class ReferenceRopeIndex(Protocol):
    def __call__(
        self,
        config: Any,
        input_ids: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        deviations: tuple[str, ...] = (),
    ) -> torch.Tensor: ...


class Reference(NamedTuple):
    """A reference index: ``compute(config, input_ids (B, L), grids..., deviations=()) -> (3, B, L)`` and the
    deviations it can reproduce, name -> description."""

    name: str
    compute: ReferenceRopeIndex
    deviations: Mapping[str, str]


REFERENCES: dict[str, Reference] = {
    "ernie4_5_vl": Reference("ernie4_5_vl", ernie4_5_vl.rope_index, ernie4_5_vl.DEVIATIONS),
    "glm4v": Reference("glm4v", glm4v.rope_index, glm4v.DEVIATIONS),
    "qwen2_vl": Reference("qwen2_vl", qwen2_vl.rope_index, qwen2_vl.DEVIATIONS),
    "qwen3_vl": Reference("qwen3_vl", qwen3_vl.rope_index, qwen3_vl.DEVIATIONS),
}
