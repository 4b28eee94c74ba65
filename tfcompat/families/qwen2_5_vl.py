"""Qwen2.5-VL (``config.model_type == "qwen2_5_vl"``): the table of ``_qwen_vl``."""

from __future__ import annotations

from ..registry import Family
from ._qwen_vl import mm_token_types, qwen_vl_entries, qwen_vl_tiny_config

ENTRIES = qwen_vl_entries("qwen2_5_vl", "Qwen2_5_VL", takes_seconds=True, videos_rejected_454=False)
FAMILY = Family(
    key="qwen2_5_vl",
    entries=ENTRIES,
    mm_token_types=mm_token_types,
    reference_rope_index=True,
    tiny_config=qwen_vl_tiny_config("Qwen2_5_VLConfig", dict(
        depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2, patch_size=14,
        temporal_patch_size=2, spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1],
        tokens_per_second=2)),
)
