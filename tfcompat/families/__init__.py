"""One module per model family; each declares its entries and nothing else (no transformers import)."""

from __future__ import annotations

from ..registry import Family
from . import glm4v, llama, qwen2, qwen3

__all__ = ["FAMILIES"]

FAMILIES: tuple[Family, ...] = (glm4v.FAMILY, llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY)
