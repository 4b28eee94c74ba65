"""Qwen3-VL-MoE (``config.model_type == "qwen3_vl_moe"``): the table of ``_qwen3_vl``, with the 4.57 sparse block's bug.

Routing is per token on every release (softmax over the experts, top-k, no capacity limit), so a packed row
routes each token as its sequence alone does. 4.57's ``Qwen3VLMoeTextSparseMoeBlock`` casts the routing weights
to the hidden states' dtype and scatters them into ``zeros_like(router_logits)``: where the gate's output dtype
differs from the hidden states' (autocast over fp32 weights), ``scatter_`` raises. verl replaces the block's
forward up to 4.57.3 for this; the line is unchanged through 4.57.6 and gone in 5.0 (a ``TopKRouter`` with
float routing weights). Declared as ``moe_router_dtype``.
"""

from __future__ import annotations

from dataclasses import replace

from ..versions import VersionRange
from ._qwen3_vl import qwen3_vl_family
from ._table import overlay

_FAMILY = qwen3_vl_family("qwen3_vl_moe", "Qwen3VLMoe", "Qwen3VLMoeConfig", num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, decoder_sparse_step=1)
FAMILY = replace(_FAMILY, entries=overlay(
    _FAMILY.entries, VersionRange("4.57", "5.0"), _FAMILY.entries[0].why, known_issues=("moe_router_dtype",)))
