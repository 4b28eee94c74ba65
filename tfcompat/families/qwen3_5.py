"""Qwen3.5 (``config.model_type == "qwen3_5"``): the table of ``_qwen3_5``."""

from __future__ import annotations

from ._qwen3_5 import qwen3_5_family

FAMILY = qwen3_5_family("qwen3_5", "Qwen3_5", "Qwen3_5Config")
