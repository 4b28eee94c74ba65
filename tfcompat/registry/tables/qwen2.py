"""Qwen2 (``config.model_type == "qwen2"``): the dense table of ``_dense``."""

from __future__ import annotations

from ._dense import dense_family

FAMILY = dense_family("qwen2", "Qwen2", "Qwen2Config")
