"""The GLM-V table: GLM-4.1V's boundaries, for the families built on its text model.

Boundaries read from the wheels (``glm4v``): 4.53 introduces the family and its decoder layer drops
``**kwargs``; 4.54 forwards them; 4.56 renames the cache kwarg to ``past_key_values``; 5.0 removes
``apply_multimodal_rotary_pos_emb`` (sectioning folds into the text rotary embedding via ``apply_mrope``),
switches to ``rope_parameters`` and lets the text model split 4-row ids; 5.3 makes ``get_rope_index``
require ``mm_token_type_ids``; 5.17 moves the interleave into the embedding's ``recomposition_frequencies``
(cos/sin layout change); 5.24 renames the cache kwarg to ``cache``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..records import Entry, Family, Rotary, VisionItem, VisionTower
from ..versions import VersionRange
from ._table import starting_at

SECTIONED = Rotary("apply_multimodal_rotary_pos_emb", "sectioned")
FOLDED = Rotary("apply_rotary_pos_emb", "folded")
RECOMPOSED = Rotary("apply_rotary_pos_emb", "folded", marker="recomposition_frequencies")
# the packed sample of the tests and the self-check: text and images of three grids
SAMPLE_VISION: tuple[VisionItem | None, ...] = (None, ("image", (1, 4, 6)), ("image", (1, 2, 4)), ("image", (1, 4, 4)))


def glm_vl_entries(family: str, prefix: str, *, first: str = "4.53", first_why: str = "first release") -> tuple[Entry, ...]:
    """The GLM-V table for classes ``{prefix}TextAttention``, ``{prefix}TextModel``, ``{prefix}Model``, ...
    in ``transformers.models.{family}.modeling_{family}``, from release ``first`` on (reason ``first_why``)."""
    base = Entry(
        family=family,
        versions=VersionRange("4.53", "4.54"),
        module=f"transformers.models.{family}.modeling_{family}",
        classes={
            "attention": f"{prefix}TextAttention",
            "rotary": f"{prefix}TextRotaryEmbedding",
            "text_model": f"{prefix}TextModel",
            "decoder_layer": f"{prefix}TextDecoderLayer",
            "model": f"{prefix}Model",
            "for_causal_lm": f"{prefix}ForConditionalGeneration",
        },
        rotary=SECTIONED,
        rope_config_key="rope_scaling",
        text_model_positions="mrope",
        layer_forwards_kwargs=False,
        rope_index_mm_token_types=False,
        cache_kwarg="past_key_value",
        why="first release; decoder layer drops **kwargs before attention",
        vision=VisionTower(owner="model", attr="visual"),
    )
    v4 = replace(base, layer_forwards_kwargs=True)
    v5 = replace(v4, rotary=FOLDED, rope_config_key="rope_parameters", text_model_positions="text+mrope",
                 cache_kwarg="past_key_values")
    entries = (
        base,
        replace(v4, versions=VersionRange("4.54", "4.56"), why="decoder layer forwards **kwargs to attention"),
        replace(v4, versions=VersionRange("4.56", "5.0"), cache_kwarg="past_key_values",
                why="cache kwarg renamed past_key_value -> past_key_values"),
        replace(v5, versions=VersionRange("5.0", "5.3"),
                why="apply_multimodal_rotary_pos_emb removed: mrope folded into the rotary embedding ([f, f] cos/sin, "
                "interleaved in apply_rotary_pos_emb); rope_parameters; text model splits 4-row ids"),
        replace(v5, versions=VersionRange("5.3", "5.17"), rope_index_mm_token_types=True,
                why="get_rope_index requires mm_token_type_ids"),
        replace(v5, versions=VersionRange("5.17", "5.24"), rope_index_mm_token_types=True, rotary=RECOMPOSED,
                why=f"interleave moved into {prefix}TextRotaryEmbedding.recomposition_frequencies (cos/sin layout change)"),
        replace(v5, versions=VersionRange("5.24", "5.25"), rope_index_mm_token_types=True, rotary=RECOMPOSED,
                cache_kwarg="cache", why="cache kwarg renamed past_key_values -> cache"),
    )
    return entries if first == "4.53" else starting_at(entries, first, first_why)


def mm_token_types(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """0 text, 1 image, 2 video: GLM marks video frames with the image token inside video start/end."""
    in_video = (input_ids == config.video_start_token_id).cumsum(-1) > (input_ids == config.video_end_token_id).cumsum(-1)
    is_vision = input_ids == config.image_token_id
    return (is_vision & ~in_video).int() + 2 * (is_vision & in_video).int()


def glm_vl_tiny_config(config_name: str, **text: Any):
    """A ``tiny_config``: a ~200k-parameter GLM-V, head_dim 16, partial rotary 0.5, so 4 rotary frequencies.

    text: extra text-config keys (e.g. MoE sizes).
    """

    def tiny_config(entry: Entry) -> tuple[str, dict[str, Any]]:
        rope = {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        section = {"mrope_section": [1, 1, 2]}
        if entry.rope_config_key == "rope_scaling":
            rope_keys = {**rope, "rope_scaling": {"type": "default", **section}}
        else:
            rope_keys = {**rope, "rope_parameters": {"rope_type": "default", **rope, **section}}
        text_config = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0,
                           **rope_keys, **text)
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2, patch_size=14,
                      temporal_patch_size=2, spatial_merge_size=2, image_size=56)
        tokens = dict(image_token_id=250, video_token_id=251, image_start_token_id=252, image_end_token_id=253,
                      video_start_token_id=254, video_end_token_id=255)
        return config_name, dict(text_config=text_config, vision_config=vision, **tokens)

    return tiny_config


def glm_vl_family(key: str, prefix: str, config_name: str, *, first: str = "4.53", first_why: str = "first release",
                  **text: Any) -> Family:
    """A GLM-V family: the table of `glm_vl_entries`, GLM's token types, a tiny config (``text``: extra
    text-config keys); no reference M-RoPE index."""
    return Family(
        key=key,
        entries=glm_vl_entries(key, prefix, first=first, first_why=first_why),
        tiny_config=glm_vl_tiny_config(config_name, **text),
        mm_token_types=mm_token_types,
        sample_vision=SAMPLE_VISION,
    )
