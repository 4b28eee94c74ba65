"""FSDP2 on a (dp, sp) DeviceMesh over NCCL on 2 GPUs: the GPU twin of tests/distributed/test_fsdp2.py.

dp x sp = 1 x 2 (``cuda:0``, ``cuda:1``), Ulysses over ``mesh["sp"]``, ``fully_shard`` per decoder layer and vision
block and at the root, gradient checkpointing on, AdamW steps on packed VLM batches with images. Every rank first
trains the stock model (each sequence alone, no FSDP) on its own GPU; the loss of every step and the gradients after
step 1 must match it: fp32 with TF32 off (the sdpa backend, which ``"auto"`` picks for fp32), 1e-5 per step and
``1e-5 * max(1, |ref|.max())`` per gradient, as on CPU.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed import fsdp2_workers
from tests.distributed.harness import run_world

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.dist,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA GPUs for dp x sp = 1 x 2 over NCCL"),
]

CASES = [("qwen2_5_vl", "fsdp"), ("glm4v", "hsdp")]


@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{layout}" for f, layout in CASES])
def test_fsdp2_sp2_nccl_equals_single_process(family, layout, tmp_path):
    """Rule: loss curve within 1e-5 per step, every step-1 gradient within 1e-5 * max(1, |ref|) (fp32, no TF32)."""
    out = tmp_path / "fsdp2.json"
    run_world(fsdp2_workers.fsdp2_equals_single, 2, family, 1, layout, str(out), backend="nccl", timeout=600)
    r = json.loads(out.read_text())
    print(f"\n{family} {layout} dp={r['dp']} sp={r['sp']} (NCCL): max loss diff {r['max_loss_diff']:.2e}, "
          f"max step-1 grad diff {r['max_grad_diff_relative']:.2e} ({r['worst_grad']})")
