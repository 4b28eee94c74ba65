"""Qwen2-VL (``config.model_type == "qwen2_vl"``): the table of ``_qwen_vl``."""

from __future__ import annotations

from ..registry import Family
from ._qwen_vl import mm_token_types, qwen_vl_entries, qwen_vl_tiny_config

ENTRIES = qwen_vl_entries("qwen2_vl", "Qwen2VL", takes_seconds=False, videos_rejected_454=True)
FAMILY = Family(
    key="qwen2_vl",
    entries=ENTRIES,
    mm_token_types=mm_token_types,
    reference_rope_index=True,
    tiny_config=qwen_vl_tiny_config("Qwen2VLConfig", dict(
        depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14, temporal_patch_size=2,
        spatial_merge_size=2)),
)
