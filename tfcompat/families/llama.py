"""Llama (``config.model_type == "llama"``): the dense table of ``_dense``."""

from __future__ import annotations

from ..registry import Family
from ._dense import dense_entries, dense_tiny_config

ENTRIES = dense_entries("llama", "Llama")
FAMILY = Family(key="llama", entries=ENTRIES, mm_token_types=None, tiny_config=dense_tiny_config("LlamaConfig"))
