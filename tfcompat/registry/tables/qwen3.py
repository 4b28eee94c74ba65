"""Qwen3 (``config.model_type == "qwen3"``): the dense table of ``_dense``."""

from __future__ import annotations

from ._dense import dense_family

FAMILY = dense_family("qwen3", "Qwen3", "Qwen3Config", head_dim=16)
