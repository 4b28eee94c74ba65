"""Qwen2.5-VL (``config.model_type == "qwen2_5_vl"``): the table of ``_qwen_vl``."""

from __future__ import annotations

from ._qwen_vl import qwen_vl_family

FAMILY = qwen_vl_family(
    "qwen2_5_vl", "Qwen2_5_VL", "Qwen2_5_VLConfig",
    dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2, patch_size=14,
         temporal_patch_size=2, spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1], tokens_per_second=2),
    takes_seconds=True, videos_rejected_454=False,
)
