"""The table shared by Qwen3.5 and Qwen3.5-MoE: the same boundaries, other class names.

Hybrid decoders: each decoder layer holds either ``linear_attn``, a Gated DeltaNet (`tfcompat.records.LinearAttention`:
a depthwise causal conv over ``[q | k | v]``, then the gated delta rule), or ``self_attn``, softmax attention with a
sigmoid output gate (``q_proj`` also yields the gate) and partial rotary (``apply_rotary_pos_emb`` rotates the first
``cos.shape[-1]`` dims), as ``config.layer_types`` says. Natively multimodal: a Qwen3-VL-like vision tower
(no DeepStack) on ``*Model``; M-RoPE interleaved ``[t h w t h w ...]`` inside the rotary embedding.
``get_rope_index``, ``get_placeholder_mask`` and ``compute_3d_position_ids`` are Qwen3-VL's, line for line, on every
release 5.2..5.24 (read from the wheels): the Qwen3-VL reference index, placeholder layout (one vision run per
video frame, after its timestamp text) and known deviations apply.

Boundaries read from the wheels (both families appear in 5.2.0; none before): 5.2 puts ``get_rope_index`` and
the tower on ``*Model``, lets the text model split 4-row ``[text; t; h; w]`` ids, interleaves in
``*TextRotaryEmbedding.apply_interleaved_mrope`` and returns an output from ``get_image_features``; the decoder
layer calls ``linear_attn(hidden_states, cache_params, cache_position, attention_mask)`` without ``**kwargs``
(its forward takes none). 5.3 rewrites ``get_rope_index``, which then requires ``mm_token_type_ids``. 5.4 drops
``cache_position`` from both mixers (the patched forward takes any keywords). 5.9 passes ``**kwargs`` to
``linear_attn``. 5.15 moves the kernels from instance attributes to module functions (the patched forward calls
none of them). 5.17 renames the interleave to ``recomposition_frequencies``. 5.24 renames the cache kwarg of both
mixers to ``cache``. 5.25 moves the conv into the kernel hook ``causal_conv1d_forward`` (the packed mixer runs the
layer's ``conv1d`` weights itself). Softmax-attention layers forward ``**kwargs`` throughout. As Qwen3-VL's, 5.3's
``get_rope_index`` does not split video grids into frames (every multi-frame video is rejected); 5.4 splits again.

Text-only models (`tfcompat.records.Family.text_only`): ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` on the
``*TextModel``, built on the text config alone (``model_type`` ``qwen3_5_text`` / ``qwen3_5_moe_text``;
``AutoModelForCausalLM.from_pretrained`` builds it from a checkpoint of the family on every release, ``from_config``
from 5.8), in the same module on every release from 5.2. Their table is the text model's boundaries above (5.9, 5.17,
5.24) without the vision half; the text model expands ``(B, L)`` position ids to its M-RoPE rows.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..records import Entry, Family, LinearAttention, VisionTower
from ..versions import VersionRange
from ._qwen3_vl import INTERLEAVED, RECOMPOSED, SAMPLE_VISION, vision_placeholder
from ._qwen_vl import mm_token_types
from ._table import overlay

# the decoder layer calls linear_attn without **kwargs up to 5.8, with them from 5.9
_GATED_DELTANET = LinearAttention(attr="linear_attn", projections="qkv_z_b_a", layer_forwards_kwargs=False)
_KWARGS_REACH = replace(_GATED_DELTANET, layer_forwards_kwargs=True)


def _first_entry(family: str, prefix: str) -> Entry:
    """The 5.2 entry of the vision-language model: classes ``{prefix}Attention``, ``{prefix}GatedDeltaNet``,
    ``{prefix}TextModel``, ``{prefix}Model``, ... in ``transformers.models.{family}.modeling_{family}``."""
    return Entry(
        family=family,
        versions=VersionRange("5.2", "5.3"),
        module=f"transformers.models.{family}.modeling_{family}",
        classes={
            "attention": f"{prefix}Attention",
            "linear_attention": f"{prefix}GatedDeltaNet",
            "rotary": f"{prefix}TextRotaryEmbedding",
            "text_model": f"{prefix}TextModel",
            "decoder_layer": f"{prefix}DecoderLayer",
            "model": f"{prefix}Model",
            "for_causal_lm": f"{prefix}ForConditionalGeneration",
        },
        rotary=INTERLEAVED,
        rope_config_key="rope_parameters",
        text_model_positions="text+mrope",
        layer_forwards_kwargs=True,
        rope_index_mm_token_types=False,
        cache_kwarg="past_key_values",
        why="first release: hybrid Gated DeltaNet / gated attention; the decoder layer calls linear_attn without "
        "**kwargs",
        vision=VisionTower(owner="model", attr="visual", output="model_output"),
        linear_attention=_GATED_DELTANET,
    )


def qwen3_5_entries(family: str, prefix: str) -> tuple[Entry, ...]:
    """Entries of the vision-language model (`_first_entry`'s classes) in ``transformers.models.{family}``."""
    base = _first_entry(family, prefix)
    entries: tuple[Entry, ...] = (
        base,
        replace(base, versions=VersionRange("5.3", "5.9"), rope_index_mm_token_types=True,
                why="get_rope_index rewritten, requires mm_token_type_ids"),
        replace(base, versions=VersionRange("5.9", "5.17"), rope_index_mm_token_types=True,
                linear_attention=_KWARGS_REACH, why="the decoder layer passes **kwargs to linear_attn"),
        replace(base, versions=VersionRange("5.17", "5.24"), rope_index_mm_token_types=True, rotary=RECOMPOSED,
                linear_attention=_KWARGS_REACH, why="apply_interleaved_mrope renamed recomposition_frequencies"),
        replace(base, versions=VersionRange("5.24", "5.26"), rope_index_mm_token_types=True, rotary=RECOMPOSED,
                cache_kwarg="cache", linear_attention=_KWARGS_REACH,
                why="cache kwarg of both mixers renamed to cache"),
    )
    entries = overlay(entries, VersionRange("5.3", "5.4"), "get_rope_index rewritten, requires mm_token_type_ids",
                      rope_index_deviations=("video_grid_unsplit",), known_issues=("videos_rejected",))
    return overlay(entries, VersionRange("5.4"), "get_rope_index splits video grids into frames again")


def qwen3_5_text_entries(family: str, prefix: str) -> tuple[Entry, ...]:
    """Entries of the text-only model ``{prefix}ForCausalLM`` (``config.model_type == f"{family}_text"``) in
    ``transformers.models.{family}.modeling_{family}``: `qwen3_5_entries`' text classes and text boundaries, no
    vision half."""
    vlm = _first_entry(family, prefix)
    classes = {role: name for role, name in vlm.classes.items() if role != "model"}
    base = replace(vlm, family=f"{family}_text", versions=VersionRange("5.2", "5.9"), vision=None,
                   classes={**classes, "for_causal_lm": f"{prefix}ForCausalLM"})
    return (
        base,
        replace(base, versions=VersionRange("5.9", "5.17"), linear_attention=_KWARGS_REACH,
                why="the decoder layer passes **kwargs to linear_attn"),
        replace(base, versions=VersionRange("5.17", "5.24"), rotary=RECOMPOSED, linear_attention=_KWARGS_REACH,
                why="apply_interleaved_mrope renamed recomposition_frequencies"),
        replace(base, versions=VersionRange("5.24", "5.26"), rotary=RECOMPOSED, cache_kwarg="cache",
                linear_attention=_KWARGS_REACH, why="cache kwarg of both mixers renamed to cache"),
    )


def qwen3_5_tiny_text(**text: Any) -> dict[str, Any]:
    """The tiny text config: one Gated DeltaNet layer then one gated-attention layer; attention head_dim 16 with
    partial rotary 0.5 (4 frequencies, interleaved ``mrope_section`` [2, 1, 1]); linear attention with 2 key heads
    and 4 value heads of 16 (so Ulysses at sp 2 and 4). text: extra text-config keys (MoE sizes)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
            "mrope_interleaved": True}
    return dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, rope_parameters=rope, **text)


def qwen3_5_tiny_config(config_name: str, **text: Any):
    """A ``tiny_config``: `qwen3_5_tiny_text` (``text``: extra text-config keys) and a 2-block vision tower."""

    def tiny_config(entry: Entry) -> tuple[str, dict[str, Any]]:
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, temporal_patch_size=2,
                      spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=64)
        tokens = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
        return config_name, dict(text_config=qwen3_5_tiny_text(**text), vision_config=vision, **tokens)

    return tiny_config


def qwen3_5_family(key: str, prefix: str, config_name: str, **text: Any) -> Family:
    """A Qwen3.5 family: the table of `qwen3_5_entries`, Qwen's token types, Qwen3-VL's reference M-RoPE index,
    placeholder layout and packed sample (text, two images, a 2-frame video), a tiny config (``text``: extra
    text-config keys); its text-only model (``{key}_text``: `qwen3_5_text_entries`, the tiny text config of
    ``{config_name}``'s text half, ``{prefix}TextConfig``)."""
    text_only = Family(
        key=f"{key}_text",
        entries=qwen3_5_text_entries(key, prefix),
        tiny_config=lambda entry: (f"{prefix}TextConfig", qwen3_5_tiny_text(**text)),
    )
    return Family(
        key=key,
        entries=qwen3_5_entries(key, prefix),
        tiny_config=qwen3_5_tiny_config(config_name, **text),
        mm_token_types=mm_token_types,
        reference_rope_index="qwen3_vl",
        sample_vision=SAMPLE_VISION,
        vision_placeholder=vision_placeholder,
        text_only=text_only,
    )
