"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on a dp x sp = 2 x 2 DeviceMesh of 4 gloo processes on CPU.

A patched tiny VLM, sharded per decoder layer and vision block, gradient checkpointing on, Ulysses over the mesh's
sp dimension, trains a few AdamW steps on packed batches with images (and a text-only batch, where the vision
tower runs on a dummy image); the loss of every step and the gradients after step 1 equal a single-process run of
the stock model, each sequence alone (fp32). Two shardings: the 2-D mesh itself (HSDP: replicate over dp, shard
over sp) and one dimension over all four ranks (verl's FSDP layout). The NCCL twin is tests/gpu/test_fsdp2_nccl.py.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed import fsdp2_workers
from tests.distributed.harness import run_world

pytestmark = pytest.mark.dist


# every VLM family once (each run spawns 4 ranks): two on verl's layout, one with the 2-D mesh as the sharding mesh
CASES = [("glm4v", "fsdp"), ("qwen2_5_vl", "fsdp"), ("qwen2_vl", "hsdp")]


@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{layout}" for f, layout in CASES])
def test_fsdp2_dp2_sp2_equals_single_process(family, layout, tmp_path):
    """Rule: loss curve within 1e-5 per step, every step-1 gradient within 1e-5 * max(1, |ref|) (fp32)."""
    out = tmp_path / "fsdp2.json"
    run_world(fsdp2_workers.fsdp2_equals_single, 4, family, 2, layout, str(out), timeout=600)
    r = json.loads(out.read_text())
    print(f"\n{r['family']} {layout} dp={r['dp']} sp={r['sp']}: losses {r['losses']}, max loss diff "
          f"{r['max_loss_diff']:.2e}, max step-1 grad diff {r['max_grad_diff_relative']:.2e} ({r['worst_grad']}, "
          f"{r['params']} params)")
