"""The attention features (sliding window, softcap, sinks, chunks, q/k head dim != v's) on the CUDA backends
against the "sdpa" reference, forward and backward.

Each fast backend runs only the feature sets `unsupported()` lets it run on this machine (the others skip with
its reason, which the test also checks is non-empty: a refusal is stated, never a silent fallback). Tolerances as
in test_varlen_cuda.py: inputs drawn in fp32 and rounded to bf16, the reference is "sdpa" in fp32 on the rounded
values (its explicit fp32 math path wherever there is a softcap or sinks), and

- forward: ``|out - ref| <= 1e-2 + 1e-2 |ref|`` elementwise;
- backward (dq, dk, dv, dsinks for a random output gradient): ``max|g - ref| <= 2e-2 * max(1, max|ref|)``;
- and the fast backend's max error against the fp32 reference at most twice the bf16 "sdpa" backend's, plus
  tol / 4.
"""

from __future__ import annotations

import pytest
import torch

import tfcompat
from tfcompat.core.attention import (
    AttentionFeatures,
    available_backends,
    select_backend,
    unsupported,
    varlen_attention,
)
from tfcompat.core.packing import chunked, from_lengths

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine")]

DEVICE = "cuda"
DTYPE = torch.bfloat16
TOL, GRAD_TOL = 1e-2, 2e-2
LENGTHS = [1, 37, 128, 300, 5, 1, 64, 200]
FAST = ["flash", "torch", "flex", "cudnn"]
# (name, features, q/k head dim, v head dim): gemma2-, gpt-oss-, llama4- and DeepSeek-shaped layers
CASES = [
    ("window", AttentionFeatures(window=64), 64, 64),
    ("softcap", AttentionFeatures(softcap=5.0), 128, 128),
    ("sinks", AttentionFeatures(sinks=True), 64, 64),
    ("window-sinks", AttentionFeatures(window=32, sinks=True), 64, 64),
    ("window-softcap", AttentionFeatures(window=100, softcap=3.0), 128, 128),
    ("chunk", AttentionFeatures(chunk=48), 128, 128),
    ("mla-192-128", AttentionFeatures(), 192, 128),
    ("mla-window", AttentionFeatures(window=50), 192, 128),
]


def _inputs(dqk, dv, seed, hq=8, hkv=2):
    gen = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(total, h, d, generator=gen).to(DEVICE, DTYPE) for h, d in ((hq, dqk), (hkv, dqk), (hkv, dv)))
    sinks = torch.randn(hq, generator=gen).to(DEVICE)
    grad = torch.randn(total, hq, dv, generator=gen).to(DEVICE)
    return q, k, v, sinks, grad


def _run(q, k, v, sinks, grad, features, backend, grads=True):
    seqs = from_lengths(LENGTHS, device=DEVICE)
    seqs = chunked(seqs, features.chunk) if features.chunk else seqs
    q, k, v = (x.detach().clone().requires_grad_(grads) for x in (q, k, v))
    sinks = sinks.detach().clone().requires_grad_(grads) if features.sinks else None
    out = varlen_attention(q, k, v, seqs, scale=0.11, window=features.window, softcap=features.softcap, sinks=sinks,
                           backend=backend)
    if not grads:
        return [out.detach().float()]
    leaves = [x for x in (q, k, v, sinks) if x is not None]
    return [out.detach().float(), *(g.float() for g in torch.autograd.grad(out, leaves, grad.to(out.dtype)))]


def _compare(got, ref, low, backend, softcap=False):
    for name, r, lo, g in zip(("out", "dq", "dk", "dv", "dsinks"), ref, low, got):
        err, err_sdpa = float((g - r).abs().max()), float((lo - r).abs().max())
        bound = TOL if name == "out" else GRAD_TOL
        if name == "out":
            assert torch.allclose(g, r, atol=TOL, rtol=TOL), f"out: max error {err:.3e} vs fp32 sdpa"
        else:
            limit = bound * max(1.0, float(r.abs().max()))
            assert err <= limit, f"{name}: max error {err:.3e} > {limit:.3e} vs fp32 sdpa"
        # the sinks' gradient sums over every token; a backend that rounds its output to bf16 before the fp32 sink
        # correction (flex) rounds once more than the sdpa path (H200, torch 2.11: 2.25x). With a softcap the sdpa
        # path is the explicit fp32 softmax (one rounding, of the output), while flex rounds the capped scores'
        # gradient to bf16 before its dq / dk matmuls (H200, torch 2.11: dk 2.47x)
        factor = 3 if name == "dsinks" or (softcap and backend == "flex" and name in ("dq", "dk")) else 2
        assert err <= factor * err_sdpa + bound / 4, (
            f"{name}: {backend} error {err:.3e} is over {factor}x the bf16 sdpa backend's {err_sdpa:.3e}")


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize(("name", "features", "dqk", "dv"), CASES, ids=[c[0] for c in CASES])
def test_backend_runs_features_exactly(backend, name, features, dqk, dv):
    """Rule: each fast backend either runs a feature set as the reference does (forward and backward where it has
    a backward) or `unsupported()` names why not, and then an explicit request raises."""
    q, k, v, sinks, grad = _inputs(dqk, dv, seed=dqk + dv)
    reason = unsupported(backend, features, qk_dim=dqk, v_dim=dv, device=q.device)
    grads = backend != "cudnn"  # forward only
    probe = q.detach().requires_grad_(grads)
    if backend not in available_backends(probe, k=k):
        pytest.skip(f"{backend!r} cannot run bf16 head_dim {dqk} here: {available_backends(probe, k=k)}")
    if reason:
        with pytest.raises(tfcompat.InvalidInputError, match="cannot run these attention features"):
            _run(q, k, v, sinks, grad, features, backend, grads)
        pytest.skip(f"{backend!r} refuses {name}: {reason}")
    ref = _run(q.float(), k.float(), v.float(), sinks, grad, features, "sdpa", grads)
    low = _run(q, k, v, sinks, grad, features, "sdpa", grads)
    got = _run(q, k, v, sinks, grad, features, backend, grads)
    assert got[0].shape == (sum(LENGTHS), 8, dv)
    _compare(got, ref, low, backend, softcap=features.softcap is not None)


@pytest.mark.parametrize(("name", "features", "dqk", "dv"), CASES, ids=[c[0] for c in CASES])
def test_auto_picks_a_backend_that_can(name, features, dqk, dv):
    """Rule: "auto" on CUDA bf16 takes a backend whose `unsupported()` is empty, and it gives the reference."""
    q, k, v, sinks, grad = _inputs(dqk, dv, seed=7)
    chosen = select_backend(q.detach().requires_grad_(), k=k, seqs=from_lengths(LENGTHS, device=DEVICE),
                            features=features, v_dim=dv)
    assert unsupported(chosen, features, qk_dim=dqk, v_dim=dv, device=q.device) == ""
    _compare(_run(q, k, v, sinks, grad, features, "auto"), _run(q.float(), k.float(), v.float(), sinks, grad,
                                                                  features, "sdpa"),
             _run(q, k, v, sinks, grad, features, "sdpa"), chosen, softcap=features.softcap is not None)


def test_features_change_the_output():
    """Non-vacuity on the GPU: a window, a softcap and sinks each change the fp32 reference."""
    q, k, v, sinks, grad = _inputs(64, 64, seed=1)
    plain = _run(q.float(), k.float(), v.float(), sinks, grad, AttentionFeatures(), "sdpa", False)[0]
    for features in (AttentionFeatures(window=16), AttentionFeatures(softcap=0.5), AttentionFeatures(sinks=True),
                     AttentionFeatures(chunk=16)):
        other = _run(q.float(), k.float(), v.float(), sinks, grad, features, "sdpa", False)[0]
        assert not torch.allclose(other, plain, atol=1e-2), features
