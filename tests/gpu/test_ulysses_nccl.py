"""Ulysses sequence parallelism over NCCL on 2 GPUs: SP=2 equals SP=1 per token, forward and backward.

The GPU twin of tests/distributed/test_ulysses.py (gloo on CPU). Each rank runs on ``cuda:rank``; the SP=1 reference is
computed on every rank with the same dtype and backend. Each case runs over both transports: ``"all_to_all"``
and ``"auto"``, which must pick ``"symm_mem"`` on two GPUs of one host with peer access.
Stated tolerances (max abs difference per tensor):

- fp32 (backend "auto", which selects "sdpa" for fp32; TF32 off in the workers): ``1e-5 * max(1, |ref|.max())``
  for the logits and for each all-reduced gradient of q_proj, o_proj, the embeddings (and the vision tower), as on CPU.
- bf16 (backend "torch", varlen_attn): ``5e-2 * |ref|.max()`` per tensor. SP changes the GEMM shapes (T/2 rows per
  rank) and sums two bf16 partial gradients, so a few bf16 ulps (2**-8 relative each) of the tensor's largest
  entry are expected; 5e-2 is about 13 ulps. The same run on CPU with gloo and the sdpa backend stays under 1e-2.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_world
from tests.gpu import nccl_workers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.dist,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA GPUs for SP=2 over NCCL"),
]

HEAD_DIM_64 = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
BF16_TOL = 5e-2

# lengths whose totals are odd, so the pad segment is always exercised; length 1 included in the bf16 cases
FP32_CASES = {
    "qwen2": ("qwen2", [7, 12, 6], [None, None, None], {}),
    "llama-kv1": ("llama", [9, 5, 8], [None, None, None], {"num_key_value_heads": 1}),
    "glm4v-image": ("glm4v", [7, 12, 6], [None, (1, 4, 6), None], {}),
}
BF16_CASES = {
    "qwen2": ("qwen2", [7, 12, 1, 30], [None] * 4, HEAD_DIM_64),
    "llama-kv1": ("llama", [9, 5, 8], [None] * 3, {**HEAD_DIM_64, "num_key_value_heads": 1}),
}


# "auto" must pick symm_mem on two GPUs of one host that reach each other
AUTO = "symm_mem" if torch.cuda.device_count() >= 2 and torch.cuda.can_device_access_peer(0, 1) else "all_to_all"
TRANSPORTS = ["all_to_all", "auto"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", sorted(FP32_CASES))
def test_sp2_equals_single_process_fp32(case, transport):
    """Rule: fp32 on CUDA, SP=2 logits and all-reduced gradients match SP=1 within 1e-5 (sdpa auto-selected)."""
    run_world(nccl_workers.sp_equals_single, 2, *FP32_CASES[case], "float32", "auto", 1e-5, False, transport,
              AUTO if transport == "auto" else None, backend="nccl")


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", sorted(BF16_CASES))
def test_sp2_equals_single_process_bf16_torch_varlen(case, transport):
    """Rule: bf16 with backend "torch", SP=2 matches SP=1 bf16 within 5e-2 of each tensor's largest entry."""
    run_world(nccl_workers.sp_equals_single, 2, *BF16_CASES[case], "bfloat16", "torch", BF16_TOL, True, transport,
              AUTO if transport == "auto" else None, backend="nccl")


def test_symm_mem_exchanges_equal_all_to_all():
    """Rule: the symm_mem transport is bit-identical to all_to_all_single through growth, bursts and rank skew."""
    run_world(nccl_workers.exchanges_agree, 2, backend="nccl")


def test_shard_inputs_syncs_the_host_once():
    """Rule: the forward's one host sync is shard_inputs' (boundaries, lengths and transport from one copy)."""
    run_world(nccl_workers.shard_inputs_syncs_once, 2, backend="nccl")
