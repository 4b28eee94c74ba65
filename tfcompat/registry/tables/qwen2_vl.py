"""Qwen2-VL (``config.model_type == "qwen2_vl"``): the table of ``_qwen_vl``."""

from __future__ import annotations

from ._qwen_vl import qwen_vl_family

FAMILY = qwen_vl_family(
    "qwen2_vl", "Qwen2VL", "Qwen2VLConfig",
    dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14, temporal_patch_size=2,
         spatial_merge_size=2),
    takes_seconds=False, videos_rejected_454=True,
)
