"""One module per model family; each declares its table and nothing else (no transformers import).

Family modules import `tfcompat.records` (and their builders here) only; `tfcompat.registry` collects them.
"""

from __future__ import annotations

from ..records import Family
from . import (
    ernie4_5_vl_moe,
    glm4v,
    glm4v_moe,
    glm46v,
    llama,
    qwen2,
    qwen2_5_vl,
    qwen2_vl,
    qwen3,
    qwen3_5,  # hybrid: Gated DeltaNet + gated attention
    qwen3_5_moe,  # hybrid: Gated DeltaNet + gated attention
    qwen3_next,  # hybrid: Gated DeltaNet + gated attention
    qwen3_vl,
    qwen3_vl_moe,
)

__all__ = ["FAMILIES"]

FAMILIES: tuple[Family, ...] = (
    glm4v.FAMILY, glm4v_moe.FAMILY, glm46v.FAMILY, ernie4_5_vl_moe.FAMILY,
    qwen2_vl.FAMILY, qwen2_5_vl.FAMILY, qwen3_vl.FAMILY, qwen3_vl_moe.FAMILY, llama.FAMILY, qwen2.FAMILY,
    qwen3.FAMILY, qwen3_5.FAMILY, qwen3_5_moe.FAMILY, qwen3_next.FAMILY,
)
