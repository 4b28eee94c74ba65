"""FlashAttention-4 (``flash_attn.cute``, the CuTe DSL kernels) as tfcompat's "flash" backend, on a Hopper or
newer GPU where it is installed.

Reference: the "sdpa" backend (per-sequence SDPA) in fp32 on the same bf16/fp16-rounded inputs, the rule of
tests/gpu/test_varlen_cuda.py: forward and dq/dk/dv within tol (1e-2 bf16, 2e-3 fp16; gradients 2e-2 / 4e-3,
scaled by max(1, max|ref|)), and FA4's error at most twice the same-dtype "sdpa" backend's plus tol / 4. Lengths
are odd and include 1 (sequences shorter than one kernel tile, and boundaries inside tiles).

FA4's own features, called directly (tfcompat maps its sliding windows to ``window_size=(window - 1, 0)`` with
``causal=True``, sinks to ``learnable_sink``, softcapping to ``softcap``): each against an explicit fp32 softmax
per sequence, forward and backward, so the mapping's meaning is checked on the kernel itself.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from tfcompat.core import attention
from tfcompat.core.attention import select_backend, varlen_attention
from tfcompat.core.packing import from_lengths

DEVICE = "cuda"
LENGTHS = [1, 37, 300, 5, 1, 129, 64, 1000]


def _fa4():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: run on the GPU machine")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FlashAttention-4 needs compute capability 9.0 or newer")
    try:
        return importlib.import_module("flash_attn.cute")
    except ImportError as e:
        pytest.skip(f"flash_attn.cute (flash-attn-4) is not installed: {e}")


pytestmark = [pytest.mark.gpu]


def _grads(fn, q, k, v, grad, extra=()):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, *extra)]
    out = fn(*leaves)
    return [out.detach().float(), *(g.float() for g in torch.autograd.grad(out, leaves, grad.to(out.dtype)))]


def _check(got, ref, low, dtype, names=("out", "dq", "dk", "dv", "dsink")):
    """Each of ``got`` within tol of ``ref`` (fp32), and, where ``low`` (the same-dtype reference) is given, at
    most twice its error plus tol / 4."""
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    for name, g, r, lo in zip(names, got, ref, low or ref):
        bound = tol if name == "out" else 2 * tol
        err, err_low = float((g - r).abs().max()), float((lo - r).abs().max())
        assert torch.isfinite(g).all(), f"{name}: non-finite values"
        assert err <= bound * max(1.0, float(r.abs().max())), f"{name}: max error {err:.3e} vs fp32 reference"
        assert low is None or err <= 2 * err_low + bound / 4, (
            f"{name}: FA4 error {err:.3e} over twice the {dtype} reference's {err_low:.3e}")


def test_flash_backend_is_fa4():
    """Rule: with flash-attn-4 installed (and no FlashAttention-3), backend "flash" resolves to FA4's varlen
    function, and "auto" ranks it as the module table says."""
    _fa4()
    fn = attention._flash_varlen(torch.device(DEVICE))
    if fn is not None and fn.__module__.startswith("flash_attn_interface"):
        pytest.skip("FlashAttention-3 is installed: it leads on Hopper")
    assert fn is not None and fn.__module__.startswith("flash_attn.cute"), fn
    q = torch.empty(8, 8, 128, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    assert select_backend(q, "flash", k=q[:, :2]) == "flash"


@pytest.mark.parametrize("hq,hkv,d,dtype", [(8, 2, 128, torch.bfloat16), (4, 4, 64, torch.bfloat16),
                                            (8, 1, 128, torch.float16)], ids=["gqa4-hd128-bf16", "mha-hd64-bf16",
                                                                               "mqa-hd128-fp16"])
def test_fa4_matches_sdpa_forward_and_backward(hq, hkv, d, dtype):
    """Rule: backend "flash" (FA4) agrees with the fp32 SDPA reference per token, forward and backward, with GQA
    and odd lengths (1 included)."""
    _fa4()
    gen = torch.Generator().manual_seed(hq * d)
    seqs = from_lengths(LENGTHS, device=DEVICE)
    q, k, v = (torch.randn(seqs.total, h, d, generator=gen).to(DEVICE, dtype) for h in (hq, hkv, hkv))
    grad = torch.randn(seqs.total, hq, d, generator=gen).to(DEVICE)

    def run(backend):
        return lambda q_, k_, v_: varlen_attention(q_, k_, v_, seqs, backend=backend)

    ref = _grads(run("sdpa"), q.float(), k.float(), v.float(), grad)
    low = _grads(run("sdpa"), q, k, v, grad)
    got = _grads(run("flash"), q, k, v, grad)
    _check(got, ref, low, dtype)
    # non-vacuity: FA4 over one sequence of every token differs from the per-sequence answer
    with torch.no_grad():
        joined = varlen_attention(q, k, v, from_lengths([seqs.total], device=DEVICE), backend="flash")
    assert float((joined.float() - got[0]).abs().max()) > 0.1


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("d", [64, 80, 96, 112, 128])
def test_every_head_dim_auto_is_right_and_flash_right_or_refused(d, causal):
    """Rule: at every head dim, "auto" agrees with the fp32 SDPA reference, forward and backward (FA4 4.0.0b36's
    backward on Hopper is wrong at 80 and 112, bench/flash_head_dims.py: "auto" must not run it there), and an
    explicit "flash" agrees too or raises `InvalidInputError` naming the head dim. A vision tower's 64-token windows
    and long sequences, causal (`varlen_attention`) and not (`cross_attention`)."""
    from tfcompat.core.cross_attention import cross_attention
    from tfcompat.errors import InvalidInputError

    _fa4()
    gen = torch.Generator().manual_seed(d)
    seqs = from_lengths([64] * 20 + [20, 48, 1300], device=DEVICE)
    q, k, v = (torch.randn(seqs.total, h, d, generator=gen).to(DEVICE, torch.bfloat16) for h in (16, 4, 4))
    grad = torch.randn(seqs.total, 16, d, generator=gen).to(DEVICE)

    def run(backend):
        if causal:
            return lambda q_, k_, v_: varlen_attention(q_, k_, v_, seqs, backend=backend)
        return lambda q_, k_, v_: cross_attention(q_, k_, v_, seqs, seqs, backend=backend)

    ref = _grads(run("sdpa"), q.float(), k.float(), v.float(), grad)
    low = _grads(run("sdpa"), q, k, v, grad)
    _check(_grads(run("auto"), q, k, v, grad), ref, low, torch.bfloat16)
    if d % 32:
        with pytest.raises(InvalidInputError, match=f"head dim {d}"):
            _grads(run("flash"), q, k, v, grad)
    else:
        _check(_grads(run("flash"), q, k, v, grad), ref, low, torch.bfloat16)


def _explicit(q, k, v, seqs, scale, window=None, softcap=None, sinks=None):
    """fp32 softmax per sequence: causal, a window of the last ``window`` keys, softcap, a sink column."""
    outs = []
    group = q.shape[1] // k.shape[1]
    for qs, ks, vs in zip(q.split(seqs.lengths), k.split(seqs.lengths), v.split(seqs.lengths)):
        n = qs.shape[0]
        x = torch.einsum("qhd,khd->hqk", qs.float(), ks.float().repeat_interleave(group, 1)) * scale
        if softcap is not None:
            x = softcap * torch.tanh(x / softcap)
        i = torch.arange(n, device=q.device)
        seen = i[None, :] <= i[:, None]
        if window is not None:
            seen &= i[None, :] > i[:, None] - window
        x = x.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            x = torch.cat([x, sinks.float()[:, None, None].expand(-1, n, 1)], -1)
        p = x.softmax(-1)[..., :n]
        outs.append(torch.einsum("hqk,khd->qhd", p, vs.float().repeat_interleave(group, 1)))
    return torch.cat(outs)


@pytest.mark.parametrize("feature", ["window", "softcap", "sinks"])
def test_fa4_features_mean_what_tfcompat_maps_them_to(feature):
    """Rule: FA4's ``window_size=(w - 1, 0)`` with ``causal=True`` is the window of the last ``w`` keys,
    ``softcap`` is ``softcap * tanh(x / softcap)``, and ``learnable_sink`` is one more softmax logit per head
    with no value (gradient included), per sequence of a packed row."""
    fa4 = _fa4()
    dtype, hq, hkv, d = torch.bfloat16, 8, 2, 128
    gen = torch.Generator().manual_seed(7)
    seqs = from_lengths(LENGTHS, device=DEVICE)
    q, k, v = (torch.randn(seqs.total, h, d, generator=gen).to(DEVICE, dtype) for h in (hq, hkv, hkv))
    grad = torch.randn(seqs.total, hq, d, generator=gen).to(DEVICE)
    scale = d ** -0.5
    window, softcap = (100 if feature == "window" else None), (5.0 if feature == "softcap" else None)
    sinks = (torch.randn(hq, generator=gen).to(DEVICE) if feature == "sinks" else None)
    extra = () if sinks is None else (sinks,)
    kwargs = {"window": window, "softcap": softcap}

    def flash(q_, k_, v_, *s):
        fa_kwargs = {}
        if window is not None:
            fa_kwargs["window_size"] = (window - 1, 0)
        if softcap is not None:
            fa_kwargs["softcap"] = softcap
        if s:
            fa_kwargs["learnable_sink"] = s[0]
        out = fa4.flash_attn_varlen_func(q_, k_, v_, cu_seqlens_q=seqs.cu_seqlens, cu_seqlens_k=seqs.cu_seqlens,
                                         max_seqlen_q=seqs.max_seqlen, max_seqlen_k=seqs.max_seqlen,
                                         softmax_scale=scale, causal=True, **fa_kwargs)
        return out[0] if isinstance(out, tuple) else out

    def explicit(q_, k_, v_, *s):
        return _explicit(q_, k_, v_, seqs, scale, sinks=s[0] if s else None, **kwargs)

    ref = _grads(explicit, q.float(), k.float(), v.float(), grad, tuple(x.float() for x in extra))
    got = _grads(flash, q, k, v, grad, extra)
    _check(got, ref, None, dtype)  # the explicit reference computes in fp32 at any input dtype: no low one
    # non-vacuity: the feature changes the output
    plain = _explicit(q.float(), k.float(), v.float(), seqs, scale)
    assert float((plain - ref[0]).abs().max()) > 1e-2


def test_auto_table_orders_fa4_as_measured(monkeypatch):
    """Rule (the table of tfcompat.core.attention, from bench/RESULTS.md section 10; runs on CPU with a pretended
    Hopper GPU): "flash" leads with a gradient at every length and without one from W = Hq * D * mean(L^2) of
    5e9; below that varlen_attn's forward ("torch") leads."""
    monkeypatch.setattr(attention, "_fast_cuda", lambda q: True)
    monkeypatch.setattr(attention, "_hopper_cudnn_sdpa", lambda device: True)
    q = torch.empty(1, 28, 128, requires_grad=True)
    short, odd = from_lengths([1024] * 8), from_lengths([107, 216, 1550, 433, 36, 1333, 1154, 3362])  # W 3.8e9, 7.6e9
    assert attention._auto_order(q, None, short)[0] == "flash"
    assert attention._auto_order(q, None, odd)[0] == "flash"
    with torch.no_grad():
        assert attention._auto_order(q, None, short)[:2] == ("torch", "flash")
        assert attention._auto_order(q, None, odd)[0] == "flash"
        assert attention._auto_order(q, None, from_lengths([4096] * 8))[0] == "flash"
    monkeypatch.setattr(attention, "_hopper_cudnn_sdpa", lambda device: False)  # not measured elsewhere
    with torch.no_grad():
        assert attention._auto_order(q, None, short) == attention.AUTO_ORDER
