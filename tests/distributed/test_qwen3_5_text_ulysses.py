"""Ulysses for the text-only Qwen3.5 models (`Family.text_only`: ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``) on
CPU with gloo: sp = 2 and 4 equal sp = 1, logits and every gradient (the hybrid families' worker,
tests/distributed/hybrid_workers.py, on a text-only packed row). Ids start with the parent family's key (CI filter)."""

from __future__ import annotations

import pytest

from tests.distributed import hybrid_workers
from tests.distributed.harness import run_world
from tfcompat.registry import installed_families
from tfcompat.selfcheck import sample_case

pytestmark = pytest.mark.dist

WORLDS = [(parent, fam.text_only.key, world) for parent, fam in sorted(installed_families().items())
          if fam.text_only is not None for world in (2, 4)]


@pytest.mark.skipif(not WORLDS, reason="no family with a text-only model in this transformers (Qwen3.5 from 5.2)")
@pytest.mark.parametrize("parent,text,world", WORLDS, ids=[f"{p}-{t}-sp{w}" for p, t, w in WORLDS])
def test_sp_equals_single_process(parent, text, world):
    run_world(hybrid_workers.hybrid_sp_equals_single, world, text, *sample_case(text))
