"""The GLM-V table: GLM-4.1V's boundaries, shared by GLM-4.5V (``glm4v_moe``) and GLM-4.6V (``glm46v``).

Boundaries read from the wheels (``glm4v``; ``glm4v_moe`` from 4.56 and ``glm46v`` from 5.0 cross the same
ones): 4.53 introduces the family and its decoder layer drops ``**kwargs``; 4.54 forwards them; 4.56 renames
the cache kwarg to ``past_key_values``; 5.0 removes ``apply_multimodal_rotary_pos_emb`` (sectioning folds into
the text rotary embedding via ``apply_mrope``), switches to ``rope_parameters``, lets the text model split
4-row ids and makes ``get_image_features`` return an output; 5.3 makes ``get_rope_index`` require
``mm_token_type_ids``; 5.17 moves the sectioning into the embedding's ``recomposition_frequencies``
(cos/sin layout change); 5.24 renames the cache kwarg to ``cache``; 5.25 changes only the processors'
kwargs merging (the modeling files are 5.24's).

Stock forward, every release: the placeholder mask counts image and video tokens with the same (image)
token, so a forward holding both images and videos raises (``images_with_videos_rejected``); such batches
go through `tfcompat.embed_inputs`, which tells video frames apart by the video start/end tokens.
``get_rope_index`` agrees with the reference (`tfcompat.reference_rope.glm4v`) on attended tokens on every
release; padding gets 1 up to 5.2, 0 from the 5.3 rewrite (outside the contract: padding is never attended).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..records import Entry, Family, Rotary, VisionItem, VisionTower
from ..versions import VersionRange
from ._table import overlay, starting_at

SECTIONED = Rotary("apply_multimodal_rotary_pos_emb", "sectioned")
FOLDED = Rotary("apply_rotary_pos_emb", "folded")
RECOMPOSED = Rotary("apply_rotary_pos_emb", "folded", marker="recomposition_frequencies")
# the packed sample of the tests and the self-check: text, images of three grids, a 2-frame video
SAMPLE_VISION: tuple[VisionItem | None, ...] = (
    None, ("image", (1, 4, 6)), ("image", (1, 2, 4)), ("video", (2, 4, 4)), ("image", (1, 4, 4)))
MIXED_REJECTED = ("images_with_videos_rejected",)


def glm_vl_entries(family: str, prefix: str, *, first: str = "4.53", first_why: str = "first release",
                   text: tuple[str, str] | None = None) -> tuple[Entry, ...]:
    """The GLM-V table for classes ``{prefix}Model``, ``{prefix}ForConditionalGeneration`` and the text classes
    ``{prefix}TextAttention``, ``{prefix}TextModel``, ... in ``transformers.models.{family}.modeling_{family}``,
    from release ``first`` on (reason ``first_why``).

    text: ``(family, prefix)`` of the module the text classes live in, where the model builds its text model
        from another family's module (`tfcompat.records.Entry.text_module`).
    """
    text_family, text_prefix = text or (family, prefix)
    base = Entry(
        family=family,
        versions=VersionRange("4.53", "4.54"),
        module=f"transformers.models.{family}.modeling_{family}",
        classes={
            "attention": f"{text_prefix}TextAttention",
            "rotary": f"{text_prefix}TextRotaryEmbedding",
            "text_model": f"{text_prefix}TextModel",
            "decoder_layer": f"{text_prefix}TextDecoderLayer",
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
        known_issues=MIXED_REJECTED,
        text_module=f"transformers.models.{text_family}.modeling_{text_family}" if text else None,
    )
    v4 = replace(base, layer_forwards_kwargs=True)
    v5 = replace(v4, rotary=FOLDED, rope_config_key="rope_parameters", text_model_positions="text+mrope",
                 cache_kwarg="past_key_values", vision=VisionTower(owner="model", attr="visual", output="model_output"))
    entries: tuple[Entry, ...] = (
        base,
        replace(v4, versions=VersionRange("4.54", "4.56"), why="decoder layer forwards **kwargs to attention"),
        replace(v4, versions=VersionRange("4.56", "5.0"), cache_kwarg="past_key_values",
                why="cache kwarg renamed past_key_value -> past_key_values"),
        replace(v5, versions=VersionRange("5.0", "5.3"),
                why="apply_multimodal_rotary_pos_emb removed: mrope folded into the rotary embedding; "
                "rope_parameters; text model splits 4-row ids; get_image_features returns an output"),
        replace(v5, versions=VersionRange("5.3", "5.17"), rope_index_mm_token_types=True,
                why="get_rope_index requires mm_token_type_ids"),
        replace(v5, versions=VersionRange("5.17", "5.24"), rope_index_mm_token_types=True, rotary=RECOMPOSED,
                why=f"sectioning moved into {text_prefix}TextRotaryEmbedding.recomposition_frequencies "
                "(cos/sin layout change)"),
        replace(v5, versions=VersionRange("5.24", "5.26"), rope_index_mm_token_types=True, rotary=RECOMPOSED,
                cache_kwarg="cache", why="cache kwarg renamed past_key_values -> cache"),
    )
    # 4.55's placeholder mask counts video tokens by video_token_id, which GLM's processor never writes (its
    # frames are image tokens inside video start/end): every video is rejected ("tokens: 0"); 4.56 counts them again
    entries = overlay(entries, VersionRange("4.55", "4.56"), "the placeholder mask counts videos by video_token_id "
                      "(GLM writes frames as image tokens: every video rejected)", known_issues=("videos_rejected",))
    return entries if first == "4.53" else starting_at(entries, first, first_why)


def mm_token_types(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """0 text, 1 image, 2 video: GLM marks video frames with the image token inside video start/end."""
    in_video = ((input_ids == config.video_start_token_id).cumsum(-1)
                > (input_ids == config.video_end_token_id).cumsum(-1))
    is_vision = input_ids == config.image_token_id
    return (is_vision & ~in_video).int() + 2 * (is_vision & in_video).int()


def glm_vl_placeholder(timestamp_tokens: int):
    """A ``vision_placeholder`` laid out as GLM's processor does: an image is ``[image_start, image * n,
    image_end]``; a video of grid ``(t, h, w)`` is ``[video_start, frame * t, video_end]`` where each frame is
    an image of ``h * w / merge**2`` tokens followed by its timestamp as text (``timestamp_tokens`` tokens:
    GLM-4.1V/4.5V write ``int(seconds)``, GLM-4.6V ``f"{seconds:.1f} seconds"``)."""

    def placeholder(config: Any, kind: str, grid: tuple[int, int, int]) -> list[int]:
        t, h, w = grid
        n = h * w // config.vision_config.spatial_merge_size**2
        frame = [config.image_start_token_id, *[config.image_token_id] * n, config.image_end_token_id]
        if kind == "image":
            return [config.image_start_token_id, *[config.image_token_id] * (t * n), config.image_end_token_id]
        stamps = [[16 + (2 * f + k) % 10 for k in range(timestamp_tokens)] for f in range(t)]  # digits-like text ids
        return [config.video_start_token_id, *[x for s in stamps for x in (*frame, *s)], config.video_end_token_id]

    return placeholder


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
                  text_module_of: tuple[str, str] | None = None, timestamp_tokens: int = 1,
                  text_variants: tuple[tuple[str, str], ...] = (), **text: Any) -> Family:
    """A GLM-V family: the table of `glm_vl_entries` (``text_module_of``: its ``text``), GLM's token types and
    placeholder layout, the GLM-V reference M-RoPE index, a tiny config (``text``: extra text-config keys);
    ``text_variants``: `tfcompat.records.Family.text_variants`."""
    return Family(
        key=key,
        entries=glm_vl_entries(key, prefix, first=first, first_why=first_why, text=text_module_of),
        tiny_config=glm_vl_tiny_config(config_name, **text),
        mm_token_types=mm_token_types,
        reference_rope_index="glm4v",
        sample_vision=SAMPLE_VISION,
        vision_placeholder=glm_vl_placeholder(timestamp_tokens),
        text_variants=text_variants,
    )
