"""Ulysses for derived vision-language families whose model numbers M-RoPE itself, on CPU with gloo: sp = 2 and 4
equal sp = 1, images included (whole images through the tower first, then the row of embeddings and its
``(4, 1, T)`` positions sliced)."""

from __future__ import annotations

import pytest

from tests.distributed import vlm_workers
from tests.distributed.harness import run_world
from tests.test_derived_mrope import TYPES
from tfcompat.tiny_models import attention_implementations

pytestmark = pytest.mark.dist

SDPA = [t for t in TYPES if "sdpa" in attention_implementations(t, "image_text_to_text")][:1]  # the workers run sdpa


@pytest.mark.skipif(not SDPA, reason="no derived vision-language family with sdpa numbers M-RoPE itself here")
@pytest.mark.parametrize("world", [2, 4])
def test_sp_equals_single_process(world):
    """Rule: logits and every parameter's gradient (summed over ranks) match SP=1, images included."""
    run_world(vlm_workers.vlm_sp_equals_single, world, SDPA[0], True)  # images: the zoo's video is Qwen-VL's
