"""`patch(model, fused=True)` with Liger-Kernel's real Triton kernels on CUDA, against the same model patched
without them (and, for the fp32 case, against stock per sequence through the unfused patch's own tests).

fp32: per-token logits and every parameter gradient within rel 1e-5 of the unfused patched model (the kernels
compute the same forms in fp32; their sigmoid, rsqrt and summation order differ in the last bits). bf16: the fused
model's logits differ from the fp32 unfused model's by at most twice what the unfused bf16 model's do, plus 1e-2.
Gradient checkpointing is on in training mode, so the rotary kernel runs in the recompute too.
"""

from __future__ import annotations

import copy
import importlib
import os

import pytest
import torch

import tfcompat
from tests.helpers import pack
from tfcompat.selfcheck import sample_sequences, tiny_model

# Liger's fused MoE kernels autotune on their first call per shape (minutes); the configuration does not change
# what they compute. Read when liger_kernel.ops.fused_moe_kernels is first imported.
os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine")]

DEVICE = "cuda"
FAMILIES = ["llama", "qwen2", "qwen3"]
DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)


def _liger():
    try:
        importlib.import_module("liger_kernel.ops")
    except ImportError as e:
        pytest.skip(f"liger-kernel is not installed: {e}")


def _step(model, inputs, fused):
    model.zero_grad(set_to_none=True)
    with tfcompat.patch(model, fused=fused) as handle:
        logits = model(**inputs, use_cache=False).logits[0].float()  # (T, V)
        (logits.square().mean()).backward()
        records = [r.note for r in handle.records]
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, records


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_matches_unfused_fp32(family, head_dim):
    """Rule: with Liger's kernels the packed forward and backward are the unfused ones (fp32, rel 1e-5), at head
    dims that are powers of two and not (the rotary kernel pads its head to a power of two: FA4's Hopper backward,
    another kernel, was wrong at 80)."""
    _liger()
    dims = {**DIMS, "hidden_size": 4 * head_dim, "head_dim": head_dim}  # 4 heads
    model = tiny_model(family, "sdpa", **dims).to(DEVICE).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seqs = sample_sequences(model, [7, 130, 1, 61], [None] * 4, seed=4)
    inputs = {k: v.to(DEVICE) for k, v in pack(model, seqs).items()}
    want, want_grads, _ = _step(model, inputs, False)
    got, got_grads, notes = _step(model, inputs, True)
    assert any("Liger RMSNorm" in n for n in notes) and any("Liger SwiGLU" in n for n in notes)
    assert any("rotary through Liger" in n for n in notes)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want_grads.keys() == got_grads.keys()
    for n, g in got_grads.items():
        scale = float(want_grads[n].abs().max())
        assert float((g - want_grads[n]).abs().max()) <= 1e-5 * max(1.0, scale), n


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_bf16_within_bf16_noise(family):
    """Rule: in bf16 the fused model is no further from the fp32 model than the unfused bf16 model is (x2 +
    1e-2), with finite gradients."""
    _liger()
    fp32 = tiny_model(family, "sdpa", **DIMS).to(DEVICE).train()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    seqs = sample_sequences(fp32, [7, 130, 1, 61], [None] * 4, seed=5)
    inputs = {k: v.to(DEVICE) for k, v in pack(fp32, seqs).items()}
    ref, _, _ = _step(fp32, inputs, False)
    low, _, _ = _step(bf16, inputs, False)
    got, grads, _ = _step(bf16, inputs, True)
    err, err_low = float((got - ref).abs().max()), float((low - ref).abs().max())
    assert err <= 2 * err_low + 1e-2, f"fused bf16 error {err:.3e} vs unfused bf16 {err_low:.3e}"
    assert all(torch.isfinite(g).all() for g in grads.values())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm()) / max(float(b.norm()), 1e-12)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fused_experts_bf16_within_bf16_noise(family):
    """Rule: with Liger's fused MoE kernel (bf16, gradient checkpointing on) the logits and every parameter's
    gradient, the router's and the experts' included, are no further from the fp32 model's than the unfused bf16
    model's are (x2 + 1e-2 relative), and every experts call went through the kernel."""
    _liger()
    if getattr(importlib.import_module("tfcompat.hf.fused")._liger(), "fused_moe", None) is None:
        pytest.skip("this liger-kernel has no fused MoE kernel (0.8.5 or later)")
    dims = {**DIMS, "moe_intermediate_size": 128, "intermediate_size": 128, "num_experts": 8,
            "num_local_experts": 8, "num_experts_per_tok": 2}
    fp32 = tiny_model(family, "sdpa", **dims).to(DEVICE).train()
    fp32.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    seqs = sample_sequences(fp32, [7, 130, 1, 61], [None] * 4, seed=6)
    inputs = {k: v.to(DEVICE) for k, v in pack(fp32, seqs).items()}
    ref, ref_grads, _ = _step(fp32, inputs, False)
    low, low_grads, _ = _step(bf16, inputs, False)
    got, got_grads, notes = _step(bf16, inputs, ("experts",))
    assert any("fused MoE" in n for n in notes)
    assert _rel(got, ref) <= 2 * _rel(low, ref) + 1e-2, (_rel(got, ref), _rel(low, ref))
    assert got_grads.keys() == ref_grads.keys() and any("experts" in n for n in got_grads)
    for n, g in got_grads.items():
        assert torch.isfinite(g).all(), n
        assert _rel(g, ref_grads[n]) <= 2 * _rel(low_grads[n], ref_grads[n]) + 1e-2, n


@pytest.mark.parametrize("block_rows", [None, 1000])
def test_swiglu_down_is_silu_mul_and_linear_with_liger_kernels(monkeypatch, block_rows):
    """Rule: with Liger's real kernels the two-node down projection gives SiLUMul + linear's output and
    gradients (fp32, within 1e-5 of each tensor's scale; 4,100 rows in one block and in blocks of 1,000),
    and in bf16 it holds one (T, I) tensor less from the forward to the backward."""
    _liger()
    from tfcompat.hf import fused as F
    from tfcompat.hf import swiglu_down as SD

    if block_rows is not None:
        monkeypatch.setattr(SD, "BLOCK_ELEMENTS", 1536 * block_rows)
    liger = F._liger()
    rows, width, hidden = 4100, 1536, 512
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        leaves = [torch.randn(*s, device=DEVICE, dtype=dtype, generator=gen).requires_grad_()
                  for s in ((rows, width), (rows, width), (hidden, width))]
        dy = torch.randn(rows, hidden, device=DEVICE, dtype=dtype, generator=gen)
        outs, grads, held = [], [], []
        for ours in (False, True):
            a, b, w = leaves[0] * 1, leaves[1] * 1, leaves[2]
            before = torch.cuda.memory_allocated()
            y = (SD.swiglu_down(a, b, w, None, liger) if ours
                 else torch.nn.functional.linear(liger.silu_mul(a, b), w))
            del a, b
            held.append(torch.cuda.memory_allocated() - before - y.numel() * y.element_size())
            outs.append(y.detach().float())
            grads.append([g.float() for g in torch.autograd.grad(y, leaves, dy)])
            del y
        if dtype == torch.float32:
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
            for g, r in zip(grads[1], grads[0], strict=True):
                # the blocks' matmuls may take other cuBLAS kernels: float32 summation order, as the model test
                assert float((g - r).abs().max()) <= 1e-5 * max(1.0, float(r.abs().max()))
        else:
            assert held[0] - held[1] >= rows * width * 2, held  # the activation c, bf16
