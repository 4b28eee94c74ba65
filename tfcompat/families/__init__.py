"""One module per model family; each declares its table and nothing else (no transformers import).

Family modules import `tfcompat.records` (and their builders here) only; `tfcompat.registry` collects them.
"""

from __future__ import annotations

from ..records import Family
from . import glm4v, llama, qwen2, qwen2_5_vl, qwen2_vl, qwen3

__all__ = ["FAMILIES"]

FAMILIES: tuple[Family, ...] = (
    glm4v.FAMILY, qwen2_vl.FAMILY, qwen2_5_vl.FAMILY, llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY,
)
