"""Ulysses sequence parallelism (gloo, CPU) for derived families: SP=2 and SP=4 equal SP=1 per token, forward and
backward, with sinks (gpt_oss), windows (gpt_oss, gemma3_text), MLA head dims (deepseek_v3) and MoE routing."""

from __future__ import annotations

import pytest

from tests.distributed import derived_workers
from tests.distributed.harness import run_world
from tests.test_derived import INSTALLED

pytestmark = pytest.mark.dist

TYPES = [t for t in ("qwen3_moe", "gpt_oss", "deepseek_v3", "gemma3_text") if t in INSTALLED]
WORLDS = [(t, w) for t in TYPES for w in (2, 4)]


@pytest.mark.parametrize("model_type,world", WORLDS, ids=[f"{t}-sp{w}" for t, w in WORLDS])
def test_sp_equals_single_process(model_type, world):
    run_world(derived_workers.sp_equals_single, world, model_type)
