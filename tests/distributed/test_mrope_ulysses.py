"""Ulysses for derived vision-language families whose model numbers M-RoPE itself, on CPU with gloo: sp = 2 and 4
equal sp = 1, images included (whole images through the tower first, then the row of embeddings and its
``(4, 1, T)`` positions sliced, with the DeepStack features where the text model takes them)."""

from __future__ import annotations

import pytest

import tfcompat
from tests.distributed import vlm_workers
from tests.distributed.harness import run_world
from tests.test_derived_mrope import TYPES
from tfcompat.tiny_models import attention_implementations

pytestmark = pytest.mark.dist


def _deepstack(model_type: str) -> bool:
    return bool(tfcompat.resolve(model_type).entry.derived_vision.visual_extras)


SDPA_ALL = [t for t in TYPES if "sdpa" in attention_implementations(t, "image_text_to_text")]  # the workers run sdpa
SDPA = [t for t in SDPA_ALL if not _deepstack(t)][:1]
DEEPSTACK = [t for t in SDPA_ALL if _deepstack(t)][:1]


@pytest.mark.skipif(not SDPA, reason="no derived vision-language family with sdpa numbers M-RoPE itself here")
@pytest.mark.parametrize("world", [2, 4])
def test_sp_equals_single_process(world):
    """Rule: logits and every parameter's gradient (summed over ranks) match SP=1, images included."""
    run_world(vlm_workers.vlm_sp_equals_single, world, SDPA[0], True)  # images: the zoo's video is Qwen-VL's


@pytest.mark.skipif(not DEEPSTACK, reason="no derived family here hands its text model DeepStack features")
def test_sp_with_deepstack_features_equals_single_process():
    """Rule: the DeepStack features `embed_inputs` captures travel sliced with the row (`VisualExtras`): SP = 2
    equals SP = 1, logits and gradients."""
    run_world(vlm_workers.vlm_sp_equals_single, 2, DEEPSTACK[0], True)
