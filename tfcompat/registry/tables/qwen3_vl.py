"""Qwen3-VL (``config.model_type == "qwen3_vl"``): the table of ``_qwen3_vl``."""

from __future__ import annotations

from ._qwen3_vl import qwen3_vl_family

FAMILY = qwen3_vl_family("qwen3_vl", "Qwen3VL", "Qwen3VLConfig")
