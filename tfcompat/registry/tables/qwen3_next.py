"""Qwen3-Next (``config.model_type == "qwen3_next"``): a text-only hybrid of Gated DeltaNet and gated-attention
layers (``config.layer_types``) with sparse MoE blocks; the same mixers as Qwen3.5, other projections.

Boundaries read from the wheels (the family appears in 4.57.0): the linear layer projects with ``in_proj_qkvz`` and
``in_proj_ba`` regrouped by ``fix_query_key_value_ordering`` on every release, and up to 5.8 the decoder layer calls
it without ``**kwargs``. 5.0 moves to ``rope_parameters`` (and drops ``apply_rotary_pos_emb``'s unused
``position_ids``); 5.9 passes ``**kwargs`` to ``linear_attn``; 5.24 renames the cache kwarg of both mixers to
``cache``; 5.25 moves the conv into the kernel hook ``causal_conv1d_forward`` (the packed mixer runs the layer's
``conv1d`` weights itself, so nothing it reads changes). Softmax-attention layers forward ``**kwargs`` throughout.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..records import Entry, Family, LinearAttention, Rotary
from ..versions import VersionRange

_GATED_DELTANET = LinearAttention(attr="linear_attn", projections="qkvz_ba", layer_forwards_kwargs=False)
_BASE = Entry(
    family="qwen3_next",
    versions=VersionRange("4.57", "5.0"),
    module="transformers.models.qwen3_next.modeling_qwen3_next",
    classes={
        "attention": "Qwen3NextAttention",
        "linear_attention": "Qwen3NextGatedDeltaNet",
        "rotary": "Qwen3NextRotaryEmbedding",
        "text_model": "Qwen3NextModel",
        "decoder_layer": "Qwen3NextDecoderLayer",
        "for_causal_lm": "Qwen3NextForCausalLM",
    },
    rotary=Rotary("apply_rotary_pos_emb", "folded"),
    rope_config_key="rope_scaling",
    text_model_positions="text",
    layer_forwards_kwargs=True,
    rope_index_mm_token_types=False,
    cache_kwarg="past_key_values",
    why="first release: hybrid Gated DeltaNet / gated attention; the decoder layer calls linear_attn without **kwargs",
    linear_attention=_GATED_DELTANET,
)
_KWARGS_REACH = replace(_GATED_DELTANET, layer_forwards_kwargs=True)

ENTRIES: tuple[Entry, ...] = (
    _BASE,
    replace(_BASE, versions=VersionRange("5.0", "5.9"), rope_config_key="rope_parameters",
            why="rope_parameters; apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)"),
    replace(_BASE, versions=VersionRange("5.9", "5.24"), rope_config_key="rope_parameters",
            linear_attention=_KWARGS_REACH, why="the decoder layer passes **kwargs to linear_attn"),
    replace(_BASE, versions=VersionRange("5.24", "5.26"), rope_config_key="rope_parameters", cache_kwarg="cache",
            linear_attention=_KWARGS_REACH, why="cache kwarg of both mixers renamed to cache"),
)


def tiny_config(entry: Entry) -> tuple[str, dict[str, Any]]:
    """One Gated DeltaNet layer then one gated-attention layer, both with a 4-expert MoE block (2 per token);
    attention head_dim 16 with partial rotary 0.5; linear attention with 2 key / 4 value heads of 16."""
    rope = {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    rope_keys = (rope if entry.rope_config_key == "rope_scaling"
                 else {"rope_parameters": {"rope_type": "default", **rope}})
    return "Qwen3NextConfig", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, max_position_embeddings=512, pad_token_id=0, **rope_keys,
    )


FAMILY = Family(key="qwen3_next", entries=ENTRIES, tiny_config=tiny_config)
