"""Ulysses for the hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) on CPU with gloo: sp = 2 and 4 equal sp = 1.

The Gated DeltaNet layers trade their conv input for a head split over the whole sequence, the gated-attention
layers go through the shared varlen core; the VLMs run their packed sample (text and three images).
"""

from __future__ import annotations

import pytest

from tests.distributed import hybrid_workers
from tests.distributed.harness import run_world
from tfcompat.registry import installed_families
from tfcompat.selfcheck import sample_case

pytestmark = pytest.mark.dist

HYBRID = sorted(k for k, f in installed_families().items() if any(e.linear_attention for e in f.entries))
WORLDS = [(family, world) for family in HYBRID for world in (2, 4)]


@pytest.mark.parametrize("family,world", WORLDS, ids=[f"{f}-sp{w}" for f, w in WORLDS])
def test_sp_equals_single_process(family, world):
    """Rule: logits and every parameter's gradient (summed over ranks) match SP=1, images included."""
    run_world(hybrid_workers.hybrid_sp_equals_single, world, family, *sample_case(family))


@pytest.mark.parametrize("family", HYBRID)
def test_linear_heads_checked_at_patch(family):
    run_world(hybrid_workers.linear_heads_checked_at_patch, 2, family)
