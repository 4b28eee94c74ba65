"""Qwen3.5 (``config.model_type == "qwen3_5"``): the table of ``_qwen3_5``; its text-only model ``Qwen3_5ForCausalLM``
(``qwen3_5_text``) is `tfcompat.records.Family.text_only`."""

from __future__ import annotations

from ._qwen3_5 import qwen3_5_family

FAMILY = qwen3_5_family("qwen3_5", "Qwen3_5", "Qwen3_5Config")
