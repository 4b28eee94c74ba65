"""GLM-4V (GLM-4.1V-Thinking), ``config.model_type == "glm4v"``.

Boundaries read from the wheels: 4.53 introduces the family and its decoder layer drops ``**kwargs``;
5.0 removes ``apply_multimodal_rotary_pos_emb`` (sectioning folds into ``Glm4vTextRotaryEmbedding`` via
``apply_mrope``), switches to ``rope_parameters`` and lets the text model split 4-row ids; 5.3 makes
``get_rope_index`` require ``mm_token_type_ids``; 5.17 moves the interleave into the embedding's
``recomposition_frequencies`` (cos/sin layout change); 5.24 renames the cache kwarg to ``cache``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..registry import Entry, Family
from ..versions import VersionRange

_BASE = Entry(
    family="glm4v",
    versions=VersionRange("4.53", "4.54"),
    module="transformers.models.glm4v.modeling_glm4v",
    classes={
        "attention": "Glm4vTextAttention",
        "rotary": "Glm4vTextRotaryEmbedding",
        "text_model": "Glm4vTextModel",
        "decoder_layer": "Glm4vTextDecoderLayer",
        "model": "Glm4vModel",
        "for_causal_lm": "Glm4vForConditionalGeneration",
    },
    apply_rotary="apply_multimodal_rotary_pos_emb",
    rotary_layout="sectioned",
    rope_config_key="rope_scaling",
    text_model_positions="mrope",
    layer_forwards_kwargs=False,
    rope_index_mm_token_types=False,
    cache_kwarg="past_key_value",
    why="first release; decoder layer drops **kwargs before attention",
)

_V5 = dict(
    apply_rotary="apply_rotary_pos_emb",
    rotary_layout="folded",
    rope_config_key="rope_parameters",
    text_model_positions="text+mrope",
    cache_kwarg="past_key_values",
)

ENTRIES = (
    _BASE,
    replace(_BASE, versions=VersionRange("4.54", "4.56"), layer_forwards_kwargs=True,
            why="decoder layer forwards **kwargs to attention"),
    replace(_BASE, versions=VersionRange("4.56", "5.0"), layer_forwards_kwargs=True, cache_kwarg="past_key_values",
            why="cache kwarg renamed past_key_value -> past_key_values"),
    replace(_BASE, versions=VersionRange("5.0", "5.3"), layer_forwards_kwargs=True, **_V5,
            why="apply_multimodal_rotary_pos_emb removed: mrope folded into the rotary embedding ([f, f] cos/sin, "
            "interleaved in apply_rotary_pos_emb); rope_parameters; text model splits 4-row ids"),
    replace(_BASE, versions=VersionRange("5.3", "5.17"), layer_forwards_kwargs=True, rope_index_mm_token_types=True,
            **_V5, why="get_rope_index requires mm_token_type_ids"),
    replace(_BASE, versions=VersionRange("5.17", "5.24"), layer_forwards_kwargs=True, rope_index_mm_token_types=True,
            rotary_marker="recomposition_frequencies", **_V5,
            why="interleave moved into Glm4vTextRotaryEmbedding.recomposition_frequencies (cos/sin layout change)"),
    replace(_BASE, versions=VersionRange("5.24", "5.25"), layer_forwards_kwargs=True, rope_index_mm_token_types=True,
            rotary_marker="recomposition_frequencies", **{**_V5, "cache_kwarg": "cache"},
            why="cache kwarg renamed past_key_values -> cache"),
)


def mm_token_types(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """0 text, 1 image, 2 video: GLM marks video frames with the image token inside video start/end."""
    in_video = (input_ids == config.video_start_token_id).cumsum(-1) > (input_ids == config.video_end_token_id).cumsum(-1)
    is_vision = input_ids == config.image_token_id
    return (is_vision & ~in_video).int() + 2 * (is_vision & in_video).int()


def tiny_config(entry: Entry) -> tuple[str, dict[str, Any]]:
    """A ~200k-parameter GLM-4V: head_dim 16, partial rotary 0.5, so 4 rotary frequencies."""
    rope = {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    section = {"mrope_section": [1, 1, 2]}
    if entry.rope_config_key == "rope_scaling":
        rope_keys = {**rope, "rope_scaling": {"type": "default", **section}}
    else:
        rope_keys = {**rope, "rope_parameters": {"rope_type": "default", **rope, **section}}
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, **rope_keys)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2, patch_size=14,
                  temporal_patch_size=2, spatial_merge_size=2, image_size=56)
    tokens = dict(image_token_id=250, video_token_id=251, image_start_token_id=252, image_end_token_id=253,
                  video_start_token_id=254, video_end_token_id=255)
    return "Glm4vConfig", dict(text_config=text, vision_config=vision, **tokens)


FAMILY = Family(key="glm4v", entries=ENTRIES, mm_token_types=mm_token_types, tiny_config=tiny_config)
