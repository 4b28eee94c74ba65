"""Qwen3 (``config.model_type == "qwen3"``): the dense table of ``_dense``."""

from __future__ import annotations

from ..registry import Family
from ._dense import dense_entries, dense_tiny_config

ENTRIES = dense_entries("qwen3", "Qwen3")
FAMILY = Family(key="qwen3", entries=ENTRIES, mm_token_types=None, tiny_config=dense_tiny_config("Qwen3Config", head_dim=16))
