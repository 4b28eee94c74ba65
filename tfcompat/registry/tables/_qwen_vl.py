"""The table shared by Qwen2-VL and Qwen2.5-VL: the same boundaries, other class names.

Boundaries read from the wheels: 4.53 moves the vision tower and ``get_rope_index`` to the *Model and the
decoder into *TextModel, whose forward cannot take a text row yet; 4.54 lets the text model split 4-row
``[text; t; h; w]`` ids; 4.56 renames the attention cache kwarg to ``past_key_values``; 5.0 moves to
``rope_parameters``; 5.3 makes ``get_rope_index`` require ``mm_token_type_ids``; 5.17 removes
``apply_multimodal_rotary_pos_emb`` (sectioning folds into the rotary embedding's
``recomposition_frequencies``); 5.24 renames the cache kwarg to ``cache``; 5.25 keeps the modeling files.

``get_rope_index`` against tfcompat's reference (`tfcompat.reference_rope.qwen2_vl.DEVIATIONS`, found by the tests):
before 5.18 Qwen2.5-VL truncates a fractional ``second_per_grid_ts``; from the 5.3 rewrite on, text after a video
whose temporal extent exceeds its spatial one overlaps the video's positions, and (to 5.4) Qwen2.5-VL's
seconds are consumed by images too; 5.3-5.5 flatten a video's frames (one t for all, h smeared).
Stock forward: 4.54's Qwen2-VL counts video placeholders with the image token and rejects every video.
Decoder layers forward ``**kwargs`` to attention throughout.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..records import Entry, Family, Rotary, VisionItem, VisionTower
from ..versions import VersionRange
from ._table import overlay

SECTIONED = Rotary("apply_multimodal_rotary_pos_emb", "sectioned")
RECOMPOSED = Rotary("apply_rotary_pos_emb", "folded", marker="recomposition_frequencies")
# the packed sample of the tests and the self-check: text, two image grids, a video, text
SAMPLE_VISION: tuple[VisionItem | None, ...] = (
    None, ("image", (1, 4, 6)), ("image", (1, 2, 4)), ("video", (2, 4, 4)), None)


def qwen_vl_entries(family: str, prefix: str, *, takes_seconds: bool, videos_rejected_454: bool) -> tuple[Entry, ...]:
    """API boundaries, then the known ``get_rope_index`` deviations and stock bugs over their own ranges.

    takes_seconds: ``get_rope_index`` takes ``second_per_grid_ts`` (Qwen2.5-VL).
    videos_rejected_454: 4.54's forward counts video placeholders with the image token (Qwen2-VL).
    """
    base = Entry(
        family=family,
        versions=VersionRange("4.53", "4.54"),
        module=f"transformers.models.{family}.modeling_{family}",
        classes={
            "attention": f"{prefix}Attention",
            "rotary": f"{prefix}RotaryEmbedding",
            "text_model": f"{prefix}TextModel",
            "decoder_layer": f"{prefix}DecoderLayer",
            "model": f"{prefix}Model",
            "for_causal_lm": f"{prefix}ForConditionalGeneration",
        },
        rotary=SECTIONED,
        rope_config_key="rope_scaling",
        text_model_positions="mrope",
        layer_forwards_kwargs=True,
        rope_index_mm_token_types=False,
        cache_kwarg="past_key_value",
        why="vision tower and get_rope_index on the Model; the text model takes 3-row ids only",
        vision=VisionTower(owner="model", attr="visual"),
    )
    v4 = replace(base, text_model_positions="text+mrope")
    v5 = replace(v4, cache_kwarg="past_key_values", rope_config_key="rope_parameters",
                 vision=VisionTower(owner="model", attr="visual", output="model_output"))
    folded = replace(v5, rotary=RECOMPOSED, rope_index_mm_token_types=True)
    entries: tuple[Entry, ...] = (
        base,
        replace(v4, versions=VersionRange("4.54", "4.56"), why="the text model splits 4-row [text; t; h; w] ids"),
        replace(v4, versions=VersionRange("4.56", "5.0"), cache_kwarg="past_key_values",
                why="cache kwarg renamed past_key_value -> past_key_values"),
        replace(v5, versions=VersionRange("5.0", "5.3"), why="rope_parameters; get_image_features returns an output"),
        replace(v5, versions=VersionRange("5.3", "5.17"), rope_index_mm_token_types=True,
                why="get_rope_index rewritten, requires mm_token_type_ids"),
        replace(folded, versions=VersionRange("5.17", "5.24"),
                why="apply_multimodal_rotary_pos_emb removed: mrope folded into the rotary embedding"),
        replace(folded, versions=VersionRange("5.24", "5.26"), cache_kwarg="cache",
                why="cache kwarg renamed past_key_values -> cache"),
    )
    entries = overlay(entries, VersionRange("5.3"), "get_rope_index rewritten, requires mm_token_type_ids",
                      rope_index_deviations=("text_after_video_overlaps",))
    entries = overlay(entries, VersionRange("5.3", "5.6"), "get_rope_index rewritten, requires mm_token_type_ids",
                      rope_index_deviations=("vision_grid_flattened",))
    entries = overlay(entries, VersionRange("5.6"), "vision positions follow the frames again")
    if takes_seconds:
        entries = overlay(entries, VersionRange("4.53", "5.18"), base.why, rope_index_deviations=("seconds_truncated",))
        entries = overlay(entries, VersionRange("5.18"), "get_rope_index keeps fractional second_per_grid_ts")
        entries = overlay(entries, VersionRange("5.3", "5.5"), "get_rope_index rewritten, requires mm_token_type_ids",
                          rope_index_deviations=("seconds_consumed_by_images",))
        entries = overlay(entries, VersionRange("5.5"), "images no longer consume second_per_grid_ts")
    if videos_rejected_454:
        entries = overlay(entries, VersionRange("4.54", "4.55"), "the text model splits 4-row [text; t; h; w] ids",
                          known_issues=("videos_rejected",))
        entries = overlay(entries, VersionRange("4.55"), "the forward counts video placeholders right again")
    return entries


def mm_token_types(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """0 text, 1 image, 2 video: Qwen marks each modality with its own placeholder token."""
    return (input_ids == config.image_token_id).int() + 2 * (input_ids == config.video_token_id).int()


def qwen_vl_tiny_config(config_name: str, vision: dict[str, Any]):
    """A ``tiny_config``: head_dim 16 (8 rotary frequencies, ``mrope_section`` [2, 3, 3]).

    vision: the tiny vision config (its keys differ between Qwen-VL generations).
    """

    def tiny_config(entry: Entry) -> tuple[str, dict[str, Any]]:
        section = {"mrope_section": [2, 3, 3]}
        if entry.rope_config_key == "rope_scaling":
            rope = {"rope_theta": 10000.0, "rope_scaling": {"type": "mrope", **section}}
        else:
            rope = {"rope_theta": 10000.0,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, **section}}
        text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                    **rope)
        tokens = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
        return config_name, dict(text_config=text, vision_config=dict(vision), **tokens)

    return tiny_config


def qwen_vl_family(key: str, prefix: str, config_name: str, vision: dict[str, Any], *, takes_seconds: bool,
                   videos_rejected_454: bool) -> Family:
    """A Qwen-VL family: the table of `qwen_vl_entries`, Qwen's token types, the Qwen2-VL reference M-RoPE
    index, and a tiny config with ``vision`` as its vision config."""
    return Family(
        key=key,
        entries=qwen_vl_entries(key, prefix, takes_seconds=takes_seconds, videos_rejected_454=videos_rejected_454),
        tiny_config=qwen_vl_tiny_config(config_name, vision),
        mm_token_types=mm_token_types,
        reference_rope_index="qwen2_vl",
        sample_vision=SAMPLE_VISION,
    )
