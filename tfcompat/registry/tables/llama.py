"""Llama (``config.model_type == "llama"``): the dense table of ``_dense``."""

from __future__ import annotations

from ._dense import dense_family

FAMILY = dense_family("llama", "Llama", "LlamaConfig")
