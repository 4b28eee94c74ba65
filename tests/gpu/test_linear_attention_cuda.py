"""The packed linear-attention core on CUDA: every backend against the torch reference, and no host sync.

Stated tolerances (max abs difference per tensor):

- fp32, torch backends on CUDA (TF32 off) vs the same on CPU: ``1e-5 * max(1, |ref|.max())`` for the output and the
  per-token gradients; ``1e-4 * max(1, |ref|.max())`` for the parameter gradients (conv weight, A_log, dt_bias), sums
  over every token (2,501 here) whose fp32 summation order differs between the devices (measured on an H200:
  A_log 1.6e-5 at scale 1.1).
- bf16, fla / causal-conv1d vs the torch backend on the same bf16 inputs: ``3e-2 * max(1, |ref|.max())``. The torch
  path computes the rule in fp32 from bf16 inputs; fla keeps bf16 operands with fp32 accumulation inside its
  chunks, so differences of a few bf16 ulps (2**-8 relative) of the largest entry are expected.

Host syncs: after one warm call (index maps built, kernels compiled), a forward and backward of `linear_attention`
runs under ``torch.cuda.set_sync_debug_mode("error")``: any synchronizing op raises.
"""

from __future__ import annotations

import pytest
import torch

from tfcompat.core.linear_attention import (
    LinearAttentionParams,
    LinearHeads,
    available_conv_backends,
    available_rule_backends,
    linear_attention,
)
from tfcompat.core.packing import from_lengths

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine")]

LENGTHS = [7, 300, 1, 129, 64, 2000]
HEADS = LinearHeads(4, 8, 128, 128)


def _case(device, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t, hv, c = sum(LENGTHS), HEADS.num_v_heads, HEADS.conv_dim
    tokens = [torch.randn(t, c, generator=gen), torch.randn(t, hv, generator=gen), torch.randn(t, hv, generator=gen)]
    params = [torch.randn(c, 4, generator=gen) * 0.5, None, torch.rand(hv, generator=gen).mul(3).add(0.5).log(),
              torch.randn(hv, generator=gen)]
    tokens = [x.to(device, dtype).requires_grad_() for x in tokens]
    weight, _, a_log, dt_bias = (None if p is None else p.to(device, dtype).requires_grad_() for p in params)
    grad_out = torch.randn(t, hv, HEADS.head_v_dim, generator=gen).to(device, dtype)
    return tokens, [weight, a_log, dt_bias], grad_out


def _forward_backward(case, seqs, **backends):
    tokens, params, grad_out = case
    weight, a_log, dt_bias = params
    out = linear_attention(*tokens, LinearAttentionParams(HEADS, weight, None, "silu", a_log, dt_bias), seqs,
                           **backends)
    return [out, *torch.autograd.grad(out, [*tokens, *params], grad_out)]


def _run(device, dtype, **backends):
    return _forward_backward(_case(device, dtype), from_lengths(LENGTHS, device), **backends)


def _assert_all_close(got, want, rel, what, param_rel=None):
    names = ["out", "mixed_qkv", "a", "b", "conv weight", "A_log", "dt_bias"]
    for i, (name, a, b) in enumerate(zip(names, got, want)):
        bound = (param_rel or rel) if i >= 4 else rel  # parameter gradients sum over every token
        scale = max(1.0, float(b.abs().max()))
        diff = float((a.float().cpu() - b.float().cpu()).abs().max())
        assert diff <= bound * scale, f"{what}: {name} differs by {diff:.3e} (scale {scale:.2e})"


def test_torch_backend_on_cuda_equals_cpu_fp32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cuda = _run(torch.device("cuda"), torch.float32, backend="torch", conv_backend="torch")
    cpu = _run(torch.device("cpu"), torch.float32, backend="torch", conv_backend="torch")
    _assert_all_close(cuda, cpu, 1e-5, "fp32 CUDA vs CPU", param_rel=1e-4)


@pytest.mark.parametrize("rule,conv", [("fla", "torch"), ("torch", "fla"), ("torch", "causal_conv1d"), ("fla", "auto")])
def test_fast_backends_equal_torch_bf16(rule, conv):
    probe = torch.zeros(1, device="cuda", dtype=torch.bfloat16)
    if rule not in available_rule_backends(probe) or (conv != "auto" and conv not in available_conv_backends(probe)):
        pytest.skip(f"rule {rule!r} / conv {conv!r} not installed here (usable: rule "
                    f"{available_rule_backends(probe)}, conv {available_conv_backends(probe)})")
    cuda = torch.device("cuda")
    fast = _run(cuda, torch.bfloat16, backend=rule, conv_backend=conv)
    ref = _run(cuda, torch.bfloat16, backend="torch", conv_backend="torch")
    _assert_all_close(fast, ref, 3e-2, f"bf16 rule={rule} conv={conv}")


@pytest.mark.parametrize("rule,conv", [("torch", "torch"), ("auto", "auto")])
def test_no_host_sync_after_warm_up(rule, conv):
    cuda = torch.device("cuda")
    case, seqs = _case(cuda, torch.bfloat16), from_lengths(LENGTHS, cuda)
    _forward_backward(case, seqs, backend=rule, conv_backend=conv)  # builds the index maps, compiles kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _forward_backward(case, seqs, backend=rule, conv_backend=conv)
    finally:
        torch.cuda.set_sync_debug_mode(0)
