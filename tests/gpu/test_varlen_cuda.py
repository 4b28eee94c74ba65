"""The fast varlen backends on CUDA ("torch", "cudnn", "flex", and "flash" where installed) against the SDPA
backend, and a patched tiny model against stock.

Stated tolerances. Inputs are drawn in fp32, rounded to the low precision dtype, and the reference is the
"sdpa" backend in fp32 on those same rounded values. For each fast backend and "sdpa" (the reference
implementation at the same dtype):

- forward: ``|out - ref| <= atol + rtol * |ref|`` elementwise, atol = rtol = 1e-2 (bf16), 2e-3 (fp16);
- backward (dq, dk, dv for a random output gradient): ``max|g - ref| <= tol * max(1, max|ref|)`` per tensor,
  tol = 2e-2 (bf16), 4e-3 (fp16);
- and, forward and backward, the fast backend's max error against the fp32 reference is at most twice the
  low precision "sdpa" backend's, plus tol / 4 (so that an sdpa error that happens to be ~0 does not demand 0).

Patched model: a tiny llama (head_dim 64) in bf16 with each fast backend, packed, against the stock model run
per sequence in bf16 (sdpa): per-token logits within 4e-2 absolute (logits reach ~1.3; a bf16 ulp at 1 is 2**-8), and
the patched model's error against the stock fp32 model at most twice the stock bf16 model's, plus 1e-2.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

import tfcompat
from tests.helpers import pack
from tfcompat.core import attention
from tfcompat.core.attention import available_backends, select_backend, varlen_attention
from tfcompat.core.packing import from_lengths
from tfcompat.registry import resolve
from tfcompat.selfcheck import sample_sequences, stock_inputs, tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine")]

DEVICE = "cuda"
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
GRAD_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
LENGTHS = [1, 37, 128, 300, 5, 1, 64]


def _has_torch_varlen() -> bool:
    try:
        importlib.import_module("torch.nn.attention.varlen").varlen_attn  # noqa: B018
        return True
    except (ImportError, AttributeError):
        return False


def _run(q, k, v, seqs, grad, backend):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = varlen_attention(q, k, v, seqs, backend=backend)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    return [t.detach().float() for t in (out, dq, dk, dv)]


FAST = ["flash", "torch", "cudnn", "flex"]


def _needs(backend, dtype=torch.bfloat16, head_dim=64):
    q = torch.empty(1, 8, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    if backend not in available_backends(q, k=q[:, :2]):
        pytest.skip(f"backend {backend!r} cannot run {dtype} head_dim {head_dim} here: {available_backends(q)}")


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fast_backend_matches_sdpa(backend, dtype, head_dim):
    """Rule: each fast backend's forward and backward agree with SDPA (GQA 8 q / 2 kv heads; lengths include 1)."""
    _needs(backend, dtype, head_dim)
    gen = torch.Generator().manual_seed(head_dim)
    total, hq, hkv = sum(LENGTHS), 8, 2
    seqs = from_lengths(LENGTHS, device=DEVICE)
    q, k, v = (torch.randn(total, h, head_dim, generator=gen).to(DEVICE, dtype) for h in (hq, hkv, hkv))
    grad = torch.randn(total, hq, head_dim, generator=gen).to(DEVICE)
    ref = _run(q.float(), k.float(), v.float(), seqs, grad, "sdpa")
    low = _run(q, k, v, seqs, grad, "sdpa")
    got = _run(q, k, v, seqs, grad, backend)
    tol, gtol = TOL[dtype], GRAD_TOL[dtype]
    for name, r, lo, g, bound in zip(("out", "dq", "dk", "dv"), ref, low, got, (tol, gtol, gtol, gtol)):
        err, err_sdpa = float((g - r).abs().max()), float((lo - r).abs().max())
        if name == "out":
            assert torch.allclose(g, r, atol=tol, rtol=tol), f"{name}: max error {err:.3e} vs fp32 sdpa"
        else:
            limit = bound * max(1.0, float(r.abs().max()))
            assert err <= limit, f"{name}: max error {err:.3e} > {limit:.3e} vs fp32 sdpa"
        assert err <= 2 * err_sdpa + bound / 4, (
            f"{name}: {backend} backend error {err:.3e} is over twice the {dtype} sdpa backend's {err_sdpa:.3e}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cudnn_forward_matches_sdpa_and_refuses_gradients(dtype):
    """Rule: the forward-only "cudnn" backend agrees with SDPA without gradients, and raises when q needs one."""
    gen = torch.Generator().manual_seed(3)
    seqs = from_lengths(LENGTHS, device=DEVICE)
    q, k, v = (torch.randn(sum(LENGTHS), h, 128, generator=gen).to(DEVICE, dtype) for h in (8, 2, 2))
    if "cudnn" not in available_backends(q, k=k):
        pytest.skip(f"cuDNN varlen attention is not usable here: {available_backends(q, k=k)}")
    with torch.no_grad():
        ref = varlen_attention(q.float(), k.float(), v.float(), seqs, backend="sdpa")
        low = varlen_attention(q, k, v, seqs, backend="sdpa").float()
        got = varlen_attention(q, k, v, seqs, backend="cudnn").float()
    tol = TOL[dtype]
    assert torch.allclose(got, ref, atol=tol, rtol=tol), float((got - ref).abs().max())
    assert float((got - ref).abs().max()) <= 2 * float((low - ref).abs().max()) + tol / 4
    with pytest.raises(tfcompat.InvalidInputError, match="cannot run these inputs"):
        varlen_attention(q.requires_grad_(), k, v, seqs, backend="cudnn")


@pytest.mark.parametrize("backend", FAST)
def test_fast_backend_isolates_sequences(backend):
    """Rule: a token never sees another sequence: changing sequence 2 leaves sequence 1's output unchanged."""
    _needs(backend)
    gen = torch.Generator().manual_seed(0)
    lengths = [40, 1, 23]
    seqs = from_lengths(lengths, device=DEVICE)
    q, k, v = (torch.randn(64, h, 64, generator=gen).to(DEVICE, torch.bfloat16) for h in (4, 2, 2))
    out = varlen_attention(q, k, v, seqs, backend=backend)
    k2, v2 = k.clone(), v.clone()
    k2[40:], v2[40:] = k2[40:] * 3 + 1, -v2[40:]
    out2 = varlen_attention(q, k2, v2, seqs, backend=backend)
    assert torch.equal(out[:40], out2[:40])
    ref = varlen_attention(q.float(), k.float(), v.float(), seqs, backend="sdpa")
    assert torch.allclose(out.float(), ref, atol=1e-2, rtol=1e-2)
    # non-vacuity: attending across the boundary (one sequence of 64) changes sequence 2's output
    joined = varlen_attention(q, k, v, from_lengths([64], device=DEVICE), backend=backend)
    assert not torch.allclose(joined[41:].float(), out[41:].float(), atol=1e-2, rtol=1e-2)


def test_select_backend_on_cuda():
    """Rule: bf16/fp16 CUDA "auto" takes the first usable backend of the decision table (short sequences: the
    default order; long ones on Hopper: per-sequence sdpa unless flash-attn is installed); fp32 picks "sdpa";
    an explicit backend that cannot run raises."""
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.empty(4, 28, 128, device=DEVICE, dtype=dtype, requires_grad=True)
        k = q[:, :4]
        usable = available_backends(q, k=k)
        want = next(b for b in attention.AUTO_ORDER if b in usable)
        assert select_backend(q, k=k) == want, usable
        assert select_backend(q, k=k, seqs=from_lengths([1024] * 8, device=DEVICE)) == want
        long = select_backend(q, k=k, seqs=from_lengths([4096] * 8, device=DEVICE))
        hopper = attention._hopper_cudnn_sdpa(q.device)
        assert long == ("flash" if "flash" in usable else "sdpa" if hopper else want), (long, usable, hopper)
        assert usable[-1] == "sdpa"
        if _has_torch_varlen():
            assert "torch" in usable
    q32 = torch.empty(4, 2, 64, device=DEVICE)
    assert select_backend(q32) == "sdpa"
    assert set(available_backends(q32)) <= {"flex", "sdpa"}
    with pytest.raises(tfcompat.InvalidInputError, match="cannot run these inputs"):
        select_backend(q32, "torch")
    with pytest.raises(tfcompat.InvalidInputError, match="cannot run these inputs"):
        select_backend(torch.empty(4, 2, 256, device=DEVICE, dtype=torch.bfloat16), "cudnn")


def test_flex_block_mask_built_once_per_forward(monkeypatch):
    """Rule: a patched forward with backend "flex" builds its document block mask once, not once per layer."""
    _needs("flex")
    builds = []
    real = attention._build_document_block_mask
    monkeypatch.setattr(attention, "_build_document_block_mask",
                        lambda seqs, window=None: builds.append(1) or real(seqs, window))
    model = tiny_model("llama", "sdpa", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, num_hidden_layers=3).to(DEVICE, torch.bfloat16)
    seqs = sample_sequences(model, [7, 12, 30], [None] * 3, seed=2)
    inputs = {k: v.to(DEVICE) for k, v in pack(model, seqs).items()}
    with torch.no_grad(), tfcompat.patch(model, backend="flex"):
        model(**inputs, use_cache=False)
        model(**inputs, use_cache=False)
    assert len(builds) == 2, f"{len(builds)} block masks for 2 forwards of a 3-layer model"


@pytest.mark.parametrize("backend", FAST)
def test_patched_tiny_model_bf16_matches_stock_per_sequence(backend):
    """Rule: packed patched logits (each fast backend) equal stock per-sequence logits within bf16 tolerance."""
    _needs(backend)
    fp32 = tiny_model("llama", "sdpa", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2)
    seqs = sample_sequences(fp32, [7, 12, 1, 30, 64], [None] * 5, seed=1)
    inputs = {k: v.to(DEVICE) for k, v in pack(fp32, seqs).items()}
    r = resolve("llama")
    bf16 = copy.deepcopy(fp32).to(DEVICE, torch.bfloat16)
    fp32 = fp32.to(DEVICE)

    def stock(model):
        outs = []
        for s in seqs:
            kw = {k: v.to(DEVICE) for k, v in stock_inputs(r, model, s).items()}
            outs.append(model(**kw, use_cache=False).logits[0].float())
        return torch.cat(outs)

    with torch.no_grad():
        ref32, ref16 = stock(fp32), stock(bf16)
        with tfcompat.patch(bf16, backend=backend):
            got = bf16(**inputs, use_cache=False).logits[0].float()
    assert got.shape == ref16.shape
    diff = float((got - ref16).abs().max())
    err, err_stock = float((got - ref32).abs().max()), float((ref16 - ref32).abs().max())
    assert diff <= 4e-2, f"patched bf16 vs stock bf16: max |logit diff| {diff:.3e}"
    assert err <= 2 * err_stock + 1e-2, f"patched bf16 error {err:.3e} vs stock bf16 error {err_stock:.3e} (fp32 ref)"
