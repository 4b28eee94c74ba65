"""The fused q/k/v all-to-all on GPUs: over NCCL at every group size the machine has (2, 4, 8), both transports;
and the attention backends on the strided q/k/v views it returns (one GPU).

The GPU twin of tests/distributed/test_a2a_gloo.py. The views are ``(T, H/sp, D)`` with rows ``W`` elements apart
(``W`` = the q, k and v heads of a rank side by side): every backend must give what it gives on contiguous copies.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import a2a_workers
from tests.distributed.harness import run_world
from tfcompat.core.attention import available_backends, varlen_attention
from tfcompat.core.packing import from_lengths

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine")]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = [w for w in (2, 4, 8) if w <= GPUS] or [2]
# (q heads, KV heads, head_dim, tokens per rank, dtype): KV heads below, at and above each group size
CASES = [(16, 1, 128, 64, "bfloat16"), (16, 2, 64, 33, "bfloat16"), (32, 8, 128, 17, "float32"),
         (16, 16, 80, 9, "float16")]


@pytest.mark.dist
@pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA GPUs")
@pytest.mark.parametrize("transport", ["all_to_all", "symm_mem"])
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES, ids=[f"q{c[0]}-kv{c[1]}-d{c[2]}-{c[4]}" for c in CASES])
def test_fused_exchange_equals_three_nccl(case, world, transport):
    """Rule: one exchange of q, k, v equals the definition and three exchanges, forward and backward."""
    hq, hkv, dim, t_local, dtype = case
    if hkv % world and world % hkv:
        pytest.skip(f"{hkv} KV heads and sp = {world} do not divide each other (rejected by check_heads)")
    run_world(a2a_workers.fused_equals_separate, world, hq, hkv, dim, t_local, dtype, True, transport, backend="nccl")


@pytest.mark.dist
@pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA GPUs")
@pytest.mark.parametrize("world", WORLDS)
def test_fused_symm_mem_equals_all_to_all(world):
    """Rule: symm_mem is bit-identical to all_to_all for the fused exchange through growth, bursts and rank skew."""
    run_world(a2a_workers.fused_transports_agree, world, backend="nccl")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_backends_read_the_strided_views(dtype):
    """Rule: every usable backend gives on the fused exchange's views what it gives on contiguous copies."""
    device = torch.device("cuda", 0)
    lengths = [37, 200, 1, 90]
    seqs = from_lengths(lengths, device=device)
    t, hq, hkv, d = sum(lengths), 4, 1, 128
    wire = torch.randn(t, (hq + 2 * hkv) * d, device=device, dtype=dtype)  # (T, W): a received buffer
    q, k, v = wire.split([hq * d, hkv * d, hkv * d], dim=1)
    q, k, v = q.unflatten(1, (hq, d)), k.unflatten(1, (hkv, d)), v.unflatten(1, (hkv, d))  # (T, W) -> (T, h, D)
    grad = torch.randn(t, hq, d, device=device, dtype=dtype)
    for needs_grad in (False, True):
        views = [x.detach().requires_grad_(needs_grad) for x in (q, k, v)]
        copies = [x.detach().contiguous().requires_grad_(needs_grad) for x in (q, k, v)]
        for backend in available_backends(views[0], k=views[1]):
            got = varlen_attention(*views, seqs, backend=backend)
            want = varlen_attention(*copies, seqs, backend=backend)
            _assert_same(got, want, f"{backend} {dtype} grad={needs_grad}: the output")
            if needs_grad:
                got_grads = torch.autograd.grad(got, views, grad)
                want_grads = torch.autograd.grad(want, copies, grad)
                for name, a, b in zip("qkv", got_grads, want_grads):
                    _assert_same(a, b, f"{backend} {dtype}: d{name}")


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal up to two roundings of the largest entry: a kernel may tile strided rows differently, a misread
    layout (rows taken H*D apart instead of W) is off by the values themselves."""
    bound = 2 * torch.finfo(want.dtype).eps * float(want.abs().max())
    diff = float((got.float() - want.float()).abs().max())
    assert diff <= bound, f"{what} differs on the strided views by {diff:.3e} (bound {bound:.3e})"
