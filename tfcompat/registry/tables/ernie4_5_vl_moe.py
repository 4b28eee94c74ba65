"""ERNIE-4.5-VL (``config.model_type == "ernie4_5_vl_moe"``), from 5.0, its first release.

Boundaries read from the wheels: 5.0 adds the model (classes ``Ernie4_5_VL_Moe*``); 5.3 renames them
``Ernie4_5_VLMoe*`` (the old names stay as deprecated subclasses) and rewrites ``get_rope_index``, which then requires
``mm_token_type_ids`` (5.0-5.2 take them optionally and place every token as text without them); 5.17 renames the
rotary's ``recomposition_to_3d`` to ``recomposition_frequencies``; 5.24 renames the cache kwarg to ``cache``; 5.25
keeps the modeling file. The rotary embedding folds the 3-D sections itself on every release (``(B, L, D)`` cos/sin,
interleaved halves), and the text model splits 4-row ``[text; t; h; w]`` ids itself.

``get_rope_index`` against tfcompat's reference (`tfcompat.inputs.reference_rope.ernie4_5_vl`, Qwen2-VL's on the
resampler's merged grids): from the 5.3 rewrite on, text after a video whose temporal extent exceeds its spatial one
overlaps the video's positions; 5.3-5.5 flatten a video's frames (one t for all, h smeared).

Its MoE block sends text tokens to the text experts and image/video tokens (with their start and end tokens) to the
vision experts by ``moe_mm_token_type_ids``, per token, each token on its own scores (softmax top-k, no capacity):
a packed row routes each token as its sequence alone does. `tfcompat.pack` builds ``moe_mm_token_type_ids`` from the
ids as the processor does; `tfcompat.embed_inputs` returns them with the embeddings. Under sequence parallelism
`tfcompat.ulysses.shard_inputs` slices them to a rank's tokens with the embeddings (routing is per token: a rank's
slice routes as the whole row does).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..records import Entry, Family, Rotary, VisionItem, VisionTower
from ..versions import VersionRange
from ._qwen_vl import mm_token_types
from ._table import overlay

# the packed sample: text, two images, a four-frame video (two merged temporal steps over a 1 x 1 merged grid: its
# temporal extent exceeds its spatial one, where the 5.3+ index departs from the reference), text
SAMPLE_VISION: tuple[VisionItem | None, ...] = (
    None, ("image", (1, 4, 6)), ("image", (1, 2, 4)), ("video", (4, 2, 2)), None)


def _entries() -> tuple[Entry, ...]:
    def classes(prefix: str) -> dict[str, str]:
        return {"attention": f"{prefix}TextAttention", "rotary": f"{prefix}TextRotaryEmbedding",
                "text_model": f"{prefix}TextModel", "decoder_layer": f"{prefix}DecoderLayer", "model": f"{prefix}Model",
                "for_causal_lm": f"{prefix}ForConditionalGeneration"}

    base = Entry(
        family="ernie4_5_vl_moe",
        versions=VersionRange("5.0", "5.3"),
        module="transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe",
        classes=classes("Ernie4_5_VL_Moe"),
        rotary=Rotary("apply_rotary_pos_emb", "folded", marker="recomposition_to_3d"),
        rope_config_key="rope_parameters",
        text_model_positions="text+mrope",
        layer_forwards_kwargs=True,
        rope_index_mm_token_types=True,  # optional before 5.3, but without them every token is placed as text
        cache_kwarg="past_key_values",
        why="first release (ERNIE-4.5-VL)",
        vision=VisionTower(owner="model", attr="vision_tower", output="model_output"),
    )
    renamed = replace(base, classes=classes("Ernie4_5_VLMoe"))
    folded = replace(renamed, rotary=Rotary("apply_rotary_pos_emb", "folded", marker="recomposition_frequencies"))
    entries: tuple[Entry, ...] = (
        base,
        replace(renamed, versions=VersionRange("5.3", "5.17"),
                why="classes renamed Ernie4_5_VL_Moe* -> Ernie4_5_VLMoe*; get_rope_index rewritten"),
        replace(folded, versions=VersionRange("5.17", "5.24"),
                why="rotary recomposition_to_3d renamed recomposition_frequencies"),
        replace(folded, versions=VersionRange("5.24", "5.26"), cache_kwarg="cache",
                why="cache kwarg renamed past_key_values -> cache"),
    )
    entries = overlay(entries, VersionRange("5.3"), "classes renamed Ernie4_5_VL_Moe* -> Ernie4_5_VLMoe*; "
                      "get_rope_index rewritten", rope_index_deviations=("text_after_video_overlaps",))
    entries = overlay(entries, VersionRange("5.3", "5.6"), "classes renamed Ernie4_5_VL_Moe* -> Ernie4_5_VLMoe*; "
                      "get_rope_index rewritten", rope_index_deviations=("vision_grid_flattened",))
    return overlay(entries, VersionRange("5.6"), "vision positions follow the frames again")


def moe_token_types(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` 0 text, 1 image, 2 video, the start and end tokens of each kind counted with it (what the
    processor's ``create_moe_mm_token_type_ids`` builds)."""
    types = mm_token_types(config, input_ids)
    for code, kind in ((1, "image"), (2, "video")):
        for edge in ("start", "end"):
            types = torch.where(input_ids == getattr(config, f"{kind}_{edge}_token_id"), code, types)
    return types


def vision_placeholder(config: Any, kind: str, grid: tuple[int, int, int]) -> list[int]:
    """One item as the processor lays it out: ``<kind start>``, ``t * h * w / merge**2`` placeholders (a video's
    ``t`` divided by the temporal merge too), ``<kind end>``."""
    t, h, w = grid
    vision = config.vision_config
    tokens = t * h * w // vision.spatial_merge_size**2 // (vision.temporal_merge_size if kind == "video" else 1)
    return [getattr(config, f"{kind}_start_token_id"), *[getattr(config, f"{kind}_token_id")] * tokens,
            getattr(config, f"{kind}_end_token_id")]


def tiny_config(entry: Entry) -> tuple[str, dict[str, Any]]:
    """head_dim 16 (8 rotary frequencies, ``mrope_section`` [3, 3, 2] = h, w, t); layer 0 dense, layer 1 MoE (4 text
    and 4 vision experts, top 2, one shared expert)."""
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]},
                mlp_layer_types=["dense", "sparse"], moe_num_experts=4, moe_k=2, moe_intermediate_size=[32, 32],
                moe_num_shared_experts=1)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_merge_size=2)
    tokens = dict(image_token_id=250, video_token_id=251, image_start_token_id=246, image_end_token_id=247,
                  video_start_token_id=248, video_end_token_id=249)
    config = entry.classes["model"].removesuffix("Model") + "Config"
    return config, dict(text_config=text, vision_config=vision, **tokens)


FAMILY = Family(
    key="ernie4_5_vl_moe",
    entries=_entries(),
    tiny_config=tiny_config,
    mm_token_types=mm_token_types,
    reference_rope_index="ernie4_5_vl",
    sample_vision=SAMPLE_VISION,
    vision_placeholder=vision_placeholder,
    moe_token_types=moe_token_types,
)
