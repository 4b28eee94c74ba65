"""Qwen2 (``config.model_type == "qwen2"``): the dense table of ``_dense``."""

from __future__ import annotations

from ..registry import Family
from ._dense import dense_entries, dense_tiny_config

ENTRIES = dense_entries("qwen2", "Qwen2")
FAMILY = Family(key="qwen2", entries=ENTRIES, mm_token_types=None, tiny_config=dense_tiny_config("Qwen2Config"))
