"""One module per model family; each declares its entries and nothing else (no transformers import)."""

from __future__ import annotations

from ..registry import Family
from . import glm4v

__all__ = ["FAMILIES"]

FAMILIES: tuple[Family, ...] = (glm4v.FAMILY,)
