"""The table shared by Qwen3-VL and Qwen3-VL-MoE: the same boundaries, other class names.

Boundaries read from the wheels (both families appear in 4.57.0; none before): 4.57 puts the vision tower and
``get_rope_index`` on the Model, interleaves the M-RoPE frequencies inside ``Qwen3VL*TextRotaryEmbedding``
(``apply_interleaved_mrope``; ``apply_rotary_pos_emb`` sees folded cos/sin), lets the text model split 4-row
``[text; t; h; w]`` ids, and feeds DeepStack features (``visual_pos_masks``, ``deepstack_visual_embeds``) to
the text model; ``get_image_features`` returns ``(features, deepstack list)``. 5.0 moves to
``rope_parameters`` and returns an output with ``pooler_output`` / ``deepstack_features``; 5.3 makes
``get_rope_index`` require ``mm_token_type_ids``; 5.17 renames the interleave to
``recomposition_frequencies``; 5.24 renames the cache kwarg to ``cache``; 5.25 keeps the modeling file (its processor
no longer wraps a video's frames in a second vision start/end pair: the layout per frame is the same). Decoder layers
forward ``**kwargs`` to attention throughout. 5.3's rewritten ``get_rope_index`` drops the split of ``video_grid_thw``
into frames, so every video of more than one frame fails (``StopIteration``) in it and in the stock forward
(``video_grid_unsplit``, ``videos_rejected``); 5.4 restores the split.

Videos: the processor writes each frame as its own item, ``<t seconds>`` text then vision start, the frame's
tokens, vision end; ``get_rope_index`` splits ``video_grid_thw`` into one ``(1, h, w)`` item per frame.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..records import Entry, Family, Rotary, VisionItem, VisionTower
from ..versions import VersionRange
from ._qwen_vl import mm_token_types
from ._table import overlay

INTERLEAVED = Rotary("apply_rotary_pos_emb", "folded", marker="apply_interleaved_mrope")
RECOMPOSED = Rotary("apply_rotary_pos_emb", "folded", marker="recomposition_frequencies")
# the packed sample of the tests and the self-check: text, two image grids, a 2-frame video, text
SAMPLE_VISION: tuple[VisionItem | None, ...] = (
    None, ("image", (1, 4, 6)), ("image", (1, 2, 4)), ("video", (2, 4, 4)), None)
TIMESTAMP = (5, 6, 7)  # stand-in ids for the "<t seconds>" text before each frame


def qwen3_vl_entries(family: str, prefix: str) -> tuple[Entry, ...]:
    """Entries for classes ``{prefix}TextAttention``, ``{prefix}TextModel``, ``{prefix}Model``, ...
    in ``transformers.models.{family}.modeling_{family}``."""
    base = Entry(
        family=family,
        versions=VersionRange("4.57", "5.0"),
        module=f"transformers.models.{family}.modeling_{family}",
        classes={
            "attention": f"{prefix}TextAttention",
            "rotary": f"{prefix}TextRotaryEmbedding",
            "text_model": f"{prefix}TextModel",
            "decoder_layer": f"{prefix}TextDecoderLayer",
            "model": f"{prefix}Model",
            "for_causal_lm": f"{prefix}ForConditionalGeneration",
        },
        rotary=INTERLEAVED,
        rope_config_key="rope_scaling",
        text_model_positions="text+mrope",
        layer_forwards_kwargs=True,
        rope_index_mm_token_types=False,
        cache_kwarg="past_key_values",
        why="first release: interleaved M-RoPE in the rotary embedding; DeepStack features for the text model; "
        "get_image_features returns (features, deepstack list)",
        vision=VisionTower(owner="model", attr="visual", output="tensors", deepstack=True),
    )
    v5 = replace(base, rope_config_key="rope_parameters",
                 vision=VisionTower(owner="model", attr="visual", output="model_output", deepstack=True))
    entries: tuple[Entry, ...] = (
        base,
        replace(v5, versions=VersionRange("5.0", "5.3"),
                why="rope_parameters; get_image_features returns an output with deepstack_features"),
        replace(v5, versions=VersionRange("5.3", "5.17"), rope_index_mm_token_types=True,
                why="get_rope_index rewritten, requires mm_token_type_ids"),
        replace(v5, versions=VersionRange("5.17", "5.24"), rope_index_mm_token_types=True, rotary=RECOMPOSED,
                why="apply_interleaved_mrope renamed recomposition_frequencies"),
        replace(v5, versions=VersionRange("5.24", "5.26"), rope_index_mm_token_types=True, rotary=RECOMPOSED,
                cache_kwarg="cache", why="cache kwarg renamed past_key_values -> cache"),
    )
    entries = overlay(entries, VersionRange("5.3", "5.4"), "get_rope_index rewritten, requires mm_token_type_ids",
                      rope_index_deviations=("video_grid_unsplit",), known_issues=("videos_rejected",))
    return overlay(entries, VersionRange("5.4"), "get_rope_index splits video grids into frames again")


def vision_placeholder(config: Any, kind: str, grid: tuple[int, int, int]) -> list[int]:
    """Token ids of one vision item as Qwen3-VL's processor writes it: an image is vision start, its
    ``h * w / merge**2`` tokens, vision end; a video repeats that per frame, each after its timestamp text."""
    t, h, w = grid
    per_frame = h * w // config.vision_config.spatial_merge_size**2
    run = [config.vision_start_token_id], [config.vision_end_token_id]
    if kind == "image":
        return [*run[0], *[config.image_token_id] * (t * per_frame), *run[1]]
    return [tok for _ in range(t) for tok in (*TIMESTAMP, *run[0], *[config.video_token_id] * per_frame, *run[1])]


def qwen3_vl_tiny_config(config_name: str, **text: Any):
    """A ``tiny_config``: head_dim 16 (8 rotary frequencies, interleaved ``mrope_section`` [4, 2, 2]), two text
    layers both taking DeepStack features from the two vision layers. text: extra text-config keys (MoE sizes)."""

    def tiny_config(entry: Entry) -> tuple[str, dict[str, Any]]:
        rope = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}
        if entry.rope_config_key == "rope_scaling":
            rope_keys: dict[str, Any] = {"rope_theta": 10000.0, "rope_scaling": rope}
        else:
            rope_keys = {"rope_parameters": {**rope, "rope_theta": 10000.0}}
        text_config = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2, **rope_keys, **text)
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, temporal_patch_size=2,
                      spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=64,
                      deepstack_visual_indexes=[0, 1])
        tokens = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
        return config_name, dict(text_config=text_config, vision_config=vision, **tokens)

    return tiny_config


def qwen3_vl_family(key: str, prefix: str, config_name: str, **text: Any) -> Family:
    """A Qwen3-VL family: the table of `qwen3_vl_entries`, Qwen's token types, the Qwen3-VL reference M-RoPE
    index, Qwen3-VL's placeholder layout and a tiny config (``text``: extra text-config keys)."""
    return Family(
        key=key,
        entries=qwen3_vl_entries(key, prefix),
        tiny_config=qwen3_vl_tiny_config(config_name, **text),
        mm_token_types=mm_token_types,
        reference_rope_index="qwen3_vl",
        sample_vision=SAMPLE_VISION,
        vision_placeholder=vision_placeholder,
    )

