"""Qwen3.5-MoE (``config.model_type == "qwen3_5_moe"``): the table of ``_qwen3_5``, with tiny MoE sizes (4 experts,
2 per token, a shared expert); its text-only model ``Qwen3_5MoeForCausalLM`` (``qwen3_5_moe_text``) is
`tfcompat.records.Family.text_only`."""

from __future__ import annotations

from ._qwen3_5 import qwen3_5_family

FAMILY = qwen3_5_family("qwen3_5_moe", "Qwen3_5Moe", "Qwen3_5MoeConfig", num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=32)
