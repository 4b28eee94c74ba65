"""Ulysses for derived vision-language families on CPU with gloo: sp = 2 and 4 equal sp = 1, images included.

The vision tower runs whole images before sharding (`tfcompat.embed_inputs`); the text model is patched as its
derived or written text family.
"""

from __future__ import annotations

import pytest

from tests.distributed import vlm_workers
from tests.distributed.harness import run_world
from tfcompat.tiny_models import model_types

pytestmark = pytest.mark.dist

NAMED = [t for t in ("internvl", "gemma3", "mistral3") if t in model_types("image_text_to_text")]
WORLDS = [(t, world) for t in NAMED for world in (2, 4)]


@pytest.mark.parametrize("model_type,world", WORLDS, ids=[f"{t}-sp{w}" for t, w in WORLDS])
def test_sp_equals_single_process(model_type, world):
    """Rule: logits and every parameter's gradient (summed over ranks) match SP=1, images included."""
    run_world(vlm_workers.vlm_sp_equals_single, world, model_type)


@pytest.mark.skipif("gemma3" not in NAMED, reason="transformers ships no gemma3")
def test_image_blocks_are_refused_under_ulysses():
    """Rule: bidirectional attention within images is not sharded; a sharded row whose token types mark images raises
    a typed error rather than running causal."""
    run_world(vlm_workers.image_blocks_refused_under_ulysses, 2, "gemma3")
