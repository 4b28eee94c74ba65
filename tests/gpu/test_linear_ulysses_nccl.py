"""Ulysses for linear-attention layers over NCCL on 2 GPUs: sp = 2 equals sp = 1 per token, forward and backward.

The GPU twin of tests/distributed/test_linear_ulysses.py (gloo on CPU), same worker and tolerances (fp32, TF32 off:
``1e-5``, parameter gradients ``1e-5 * max(1, |ref|.max())``).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import linear_workers
from tests.distributed.harness import run_world

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.dist,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA GPUs for SP=2 over NCCL"),
]


@pytest.mark.parametrize("lengths,heads", [([7, 70, 1, 19], (2, 4, 8, 6)), ([9, 40], (1, 2, 4, 5))],
                         ids=["even", "one-key-head"])
def test_linear_sp2_equals_single_process_nccl(lengths, heads):
    run_world(linear_workers.linear_sp_equals_single, 2, lengths, heads, backend="nccl")
