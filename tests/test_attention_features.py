"""The attention features of the varlen core (sliding window, softcap, sinks, chunks, q/k head dim != v's, any
scale) against a naive dense reference, on CPU; `unsupported()` per backend; the flash and torch backends' argument
plumbing through fakes that emulate flash-attn's documented semantics; and the checks of the transformers adapter.

The oracle (`naive`) is the definition written once, in float64: a full ``(T, T)`` score matrix over the packed
stream, masked to the same sequence, causal, the window and the chunk, softcapped after scaling, with the sink as
one more column that has no value. Tolerances: fp32 outputs and gradients within 2e-6 absolute and relative of the
float64 reference (a few hundred keys at most; fp32's epsilon is 1.2e-7).
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tfcompat
from tests.helpers import assert_close
from tfcompat.core import attention
from tfcompat.core.attention import AttentionFeatures, select_backend, unsupported, varlen_attention
from tfcompat.core.context import CONTEXT_KWARG, ForwardContext
from tfcompat.core.packing import chunked, from_lengths
from tfcompat.hf.attention import FEATURES_ATTR, packed_attention

TOL = dict(atol=2e-6, rtol=2e-6)
LENGTHS = [37, 1, 90, 128]  # 256 tokens: one shape, so the CPU compiles flex once per feature set


def naive(q, k, v, lengths, *, scale=None, window=None, softcap=None, sinks=None, chunk=None, left=None, right=None):
    """The reference, dense over the whole stream in float64. q ``(T, Hq, Dqk)``, k ``(T, Hkv, Dqk)``,
    v ``(T, Hkv, Dv)`` -> ``(T, Hq, Dv)`` in q's dtype. ``left``/``right``: flash-attn's ``window_size`` instead
    of ``window`` (keys ``t - left .. t + right`` of the same sequence; -1 unbounded), without causality."""
    total, hq, dqk = q.shape
    groups = hq // k.shape[1]
    scale = dqk ** -0.5 if scale is None else scale
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]])
    t = torch.arange(total)
    pos = t - starts[doc]  # position inside its sequence
    lag = t[:, None] - t[None, :]  # (query, key): t - s
    seen = doc[:, None] == doc[None, :]
    if left is None:
        seen &= lag >= 0
    else:
        seen &= (lag <= left if left >= 0 else True) & (-lag <= right if right >= 0 else True)
    if window is not None:
        seen &= lag < window
    if chunk is not None:
        seen &= pos[:, None] // chunk == pos[None, :] // chunk
    kk = k.double().repeat_interleave(groups, 1)  # (T, Hkv, D) -> (T, Hq, D)
    vv = v.double().repeat_interleave(groups, 1)
    x = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    x = x.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        x = torch.cat([x, sinks.double()[:, None, None].expand(hq, total, 1)], dim=-1)
    p = x.softmax(-1)[..., :total]
    return torch.einsum("hts,shd->thd", p, vv).to(q.dtype)


def _qkv(lengths, hq=4, hkv=2, dqk=16, dv=16, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, d, generator=gen) for h, d in ((hq, dqk), (hkv, dqk), (hkv, dv)))
    sinks = torch.randn(hq, generator=gen)
    return [x.requires_grad_(requires_grad) for x in (q, k, v, sinks)]


def _core(q, k, v, lengths, *, chunk=None, backend="sdpa", **features):
    seqs = from_lengths(lengths)
    return varlen_attention(q, k, v, chunked(seqs, chunk) if chunk else seqs, backend=backend, **features)


class TestSdpaAgainstNaive:
    """Rule: the "sdpa" backend equals the dense definition for every feature and combination, forward and
    gradients (q, k, v, sinks)."""

    @settings(max_examples=60, deadline=None)
    @given(
        lengths=st.lists(st.integers(1, 23), min_size=1, max_size=4),
        heads=st.sampled_from([(1, 1), (4, 1), (4, 2), (6, 3), (4, 4)]),
        dims=st.sampled_from([(8, 8), (12, 4), (6, 10)]),
        window=st.none() | st.integers(1, 30),
        softcap=st.none() | st.floats(0.5, 30.0),
        with_sinks=st.booleans(),
        chunk=st.none() | st.integers(1, 30),
        scale=st.none() | st.floats(0.05, 2.0),
        seed=st.integers(0, 2**16),
    )
    def test_forward(self, lengths, heads, dims, window, softcap, with_sinks, chunk, scale, seed):
        q, k, v, sinks = _qkv(lengths, *heads, *dims, seed=seed)
        sinks = sinks if with_sinks else None
        got = _core(q, k, v, lengths, chunk=chunk, scale=scale, window=window, softcap=softcap, sinks=sinks)
        want = naive(q, k, v, lengths, scale=scale, window=window, softcap=softcap, sinks=sinks, chunk=chunk)
        assert got.shape == (sum(lengths), heads[0], dims[1])
        assert_close(got, want, **TOL)

    @pytest.mark.parametrize("features", [
        {}, {"window": 5}, {"softcap": 1.5}, {"sinks": True}, {"chunk": 8}, {"scale": 0.3},
        {"window": 7, "softcap": 2.0, "sinks": True, "chunk": 16, "scale": 0.2},
    ], ids=lambda f: "-".join(f) or "plain")
    def test_gradients(self, features):
        """Gradients of q, k, v (GQA 6/2 heads, Dqk 24 != Dv 8) and the sinks equal the reference's."""
        features = dict(features)
        lengths = [11, 1, 30, 17]
        q, k, v, sinks = _qkv(lengths, 6, 2, 24, 8, seed=1, requires_grad=True)
        kw = {**features, "sinks": sinks if features.pop("sinks", False) else None}
        grad = torch.randn(sum(lengths), 6, 8, generator=torch.Generator().manual_seed(2))
        chunk = kw.pop("chunk", None)
        got = torch.autograd.grad(_core(q, k, v, lengths, chunk=chunk, **kw), (q, k, v, sinks), grad,
                                  allow_unused=True)
        want = torch.autograd.grad(naive(q, k, v, lengths, chunk=chunk, **kw), (q, k, v, sinks), grad,
                                   allow_unused=True)
        for name, g, w in zip(["q", "k", "v", "sinks"], got, want):
            if w is None:
                assert g is None and kw["sinks"] is None, name
                continue
            assert float(w.abs().max()) > 1e-3, f"d{name} is vacuous"
            assert_close(g, w, **TOL, what=f"d{name}")

    @pytest.mark.parametrize("feature", ["window", "softcap", "sinks", "chunk"])
    def test_each_feature_changes_the_result(self, feature):
        """Non-vacuity: with the feature the output differs from plain causal attention (so the tests above can
        tell a dropped feature)."""
        q, k, v, sinks = _qkv(LENGTHS, seed=3)
        kw: dict[str, Any] = {"window": {"window": 9}, "softcap": {"softcap": 0.5}, "sinks": {"sinks": sinks},
                              "chunk": {"chunk": 16}}[feature]
        plain = _core(q, k, v, LENGTHS)
        assert not torch.allclose(_core(q, k, v, LENGTHS, **kw), plain, atol=1e-3)

    def test_window_covering_every_sequence_is_no_window(self):
        q, k, v, _ = _qkv(LENGTHS, seed=4)
        assert torch.equal(_core(q, k, v, LENGTHS, window=max(LENGTHS)), _core(q, k, v, LENGTHS))

    def test_window_of_one_is_each_token_its_own_value(self):
        q, k, v, _ = _qkv(LENGTHS, 4, 4, seed=5)
        assert_close(_core(q, k, v, LENGTHS, window=1), v, **TOL)

    def test_sinks_are_the_sigmoid_of_the_lse(self):
        """out_sinks = out_plain * sigmoid(lse - sink), lse the log-sum-exp of the seen scores."""
        q, k, v, sinks = _qkv([1, 5], 2, 2, seed=6)
        plain, with_sinks = _core(q, k, v, [1, 5]), _core(q, k, v, [1, 5], sinks=sinks)
        # the first token of a sequence sees only itself: lse = its own score
        lse0 = (q[0] * k[0]).sum(-1) * 16 ** -0.5
        assert_close(with_sinks[0], plain[0] * torch.sigmoid(lse0 - sinks)[:, None], **TOL)

    def test_low_precision_inputs_keep_their_dtype(self):
        q, k, v, sinks = _qkv(LENGTHS, seed=7)
        got = _core(q.bfloat16(), k.bfloat16(), v.bfloat16(), LENGTHS, softcap=3.0, sinks=sinks, window=11)
        assert got.dtype == torch.bfloat16
        want = naive(q.bfloat16(), k.bfloat16(), v.bfloat16(), LENGTHS, softcap=3.0, sinks=sinks, window=11)
        assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


class TestChunked:
    """Rule: `chunked` cuts each sequence into chunks of ``size`` from its start; built once per boundaries."""

    @settings(max_examples=50, deadline=None)
    @given(st.lists(st.integers(1, 50), min_size=1, max_size=6), st.integers(1, 20))
    def test_definition(self, lengths, size):
        got = chunked(from_lengths(lengths), size)
        want = [c for n in lengths for c in [size] * (n // size) + ([n % size] if n % size else [])]
        assert list(got.lengths) == want
        assert got.cu_seqlens.tolist() == [0, *torch.tensor(want).cumsum(0).tolist()]
        assert got.max_seqlen == max(want) and got.total == sum(lengths)

    def test_cached_per_boundaries_and_size(self):
        seqs = from_lengths(LENGTHS)
        assert chunked(seqs, 16) is chunked(seqs, 16)
        assert chunked(seqs, 8) is not chunked(seqs, 16)
        assert chunked(from_lengths(LENGTHS), 16) is not chunked(seqs, 16)

    @pytest.mark.parametrize("size", [0, -3, 2.5, True])
    def test_bad_size_raises(self, size):
        with pytest.raises(tfcompat.InvalidInputError, match="chunk size must be a positive int"):
            chunked(from_lengths([4]), size)


flex_mod = pytest.importorskip("torch.nn.attention.flex_attention", reason="this torch has no flex attention")
needs_flex = pytest.mark.skipif(attention._flex_api() is None, reason="flex attention needs torch >= 2.6")


@needs_flex
class TestFlexOnCpu:
    """Rule: flex (CPU, forward only) equals the reference with windows, softcaps, chunks and Dqk != Dv; its block
    mask with a window equals create_block_mask's; sinks, which it cannot run on CPU, are refused by name."""

    @pytest.mark.parametrize("features", [
        {"window": 9}, {"window": 200, "softcap": 0.7}, {"chunk": 32, "dv": 32},
    ], ids=lambda f: "-".join(f))  # few feature sets: each compiles its own CPU kernel (10-30 s)
    def test_forward_matches_naive(self, features):
        features = dict(features)
        q, k, v, _ = _qkv(LENGTHS, 4, 2, 16, features.pop("dv", 16), seed=8)
        with torch.no_grad():
            got = _core(q, k, v, LENGTHS, backend="flex", **features)
        assert_close(got, naive(q, k, v, LENGTHS, **features), atol=1e-5, rtol=1e-5)

    @settings(max_examples=10, deadline=None)
    @given(st.lists(st.integers(1, 300), min_size=1, max_size=5), st.integers(1, 400))
    def test_window_block_mask_equals_create_block_mask(self, lengths, window):
        seqs = from_lengths(lengths)
        doc = torch.searchsorted(seqs.cu_seqlens[1:], torch.arange(seqs.total, dtype=torch.int32), right=True)

        def mask_mod(b, h, q, kv):
            return (doc[q] == doc[kv]) & (q >= kv) & (q - kv < window)

        ref = flex_mod.create_block_mask(mask_mod, None, None, seqs.total, seqs.total, device="cpu")
        got = attention.document_block_mask(seqs, window)
        for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
            assert torch.equal(getattr(got, counts), getattr(ref, counts)), (counts, lengths, window)
            for row, n in enumerate(getattr(got, counts)[0, 0].tolist()):
                mine = getattr(got, indices)[0, 0, row, :n].sort().values
                theirs = getattr(ref, indices)[0, 0, row, :n].sort().values
                assert torch.equal(mine, theirs), (indices, row, lengths, window)

    def test_one_mask_per_window_and_boundaries(self):
        seqs = from_lengths(LENGTHS)
        assert attention.document_block_mask(seqs, 8) is attention.document_block_mask(seqs, 8)
        assert attention.document_block_mask(seqs, 8) is not attention.document_block_mask(seqs, None)

    def test_sinks_on_cpu_are_refused(self):
        q, k, v, sinks = _qkv(LENGTHS, seed=9)
        with torch.no_grad(), pytest.raises(tfcompat.InvalidInputError, match="cannot run these attention features"):
            _core(q, k, v, LENGTHS, backend="flex", sinks=sinks)


class TestUnsupported:
    """Rule: `unsupported` says per backend which features it cannot run ("" when it can); "auto" and "sdpa" run
    all; "auto" never selects a backend that cannot run the features."""

    ALL = AttentionFeatures(window=4, softcap=30.0, sinks=True, chunk=8)

    @pytest.mark.parametrize("backend", ["auto", "sdpa"])
    def test_reference_runs_everything(self, backend):
        assert unsupported(backend, self.ALL, qk_dim=192, v_dim=128) == ""

    @pytest.mark.parametrize("backend", ["auto", "sdpa", "flash", "torch", "cudnn", "flex"])
    @pytest.mark.parametrize("bad", [{"window": 0}, {"chunk": -1}, {"softcap": 0.0}, {"softcap": float("inf")},
                                     {"window": 2.5}])
    def test_invalid_values_are_refused_everywhere(self, backend, bad):
        assert "must be a positive" in unsupported(backend, AttentionFeatures(**bad), qk_dim=64, v_dim=64)

    def test_cudnn_runs_plain_attention_only(self):
        assert unsupported("cudnn", AttentionFeatures(chunk=8), qk_dim=64, v_dim=64) == ""
        assert "not a sliding window or attention sinks" in unsupported(
            "cudnn", AttentionFeatures(window=4, sinks=True), qk_dim=64, v_dim=64)
        assert "one head dim" in unsupported("cudnn", AttentionFeatures(), qk_dim=192, v_dim=128)

    def test_torch_varlen(self):
        assert "no softcap" in unsupported("torch", AttentionFeatures(softcap=5.0), qk_dim=64, v_dim=64)
        assert "no attention sinks" in unsupported("torch", AttentionFeatures(sinks=True), qk_dim=64, v_dim=64)
        window = unsupported("torch", AttentionFeatures(window=4), qk_dim=192, v_dim=128)
        probe = attention._torch_varlen()
        assert window == ("" if probe is not None and "window_size" in probe[1] else
                          "this torch's varlen_attn has no window_size")

    def test_flex(self):
        assert "powers of two" in unsupported("flex", AttentionFeatures(), qk_dim=192, v_dim=128)
        assert unsupported("flex", AttentionFeatures(window=4, softcap=2.0, chunk=3), qk_dim=64, v_dim=32) == ""
        cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
        assert "no sinks" in unsupported("flex", AttentionFeatures(sinks=True), qk_dim=64, v_dim=64, device=cpu)
        assert unsupported("flex", AttentionFeatures(sinks=True), qk_dim=64, v_dim=64, device=cuda) == ""

    def test_unknown_backend(self):
        assert "unknown attention backend 'nope'" in unsupported("nope", AttentionFeatures(), qk_dim=8, v_dim=8)

    @pytest.mark.parametrize("kind", ["fa2", "fa3", "fa3-s_aux", "fa4", "none"])
    def test_flash_by_installed_signature(self, kind, monkeypatch):
        """Sinks only through FA4's learnable_sink (it has a backward for them); vLLM's FA3 s_aux is not taken."""
        fake = {"fa2": _fa2, "fa3": _fa3, "fa3-s_aux": _fa3_s_aux, "fa4": _fa4, "none": None}[kind]
        monkeypatch.setattr(attention, "_flash_varlen", lambda device: fake)
        attention._gap.cache_clear()
        try:
            plain = unsupported("flash", AttentionFeatures(window=4, softcap=2.0, chunk=5), qk_dim=192, v_dim=128)
            sinks = unsupported("flash", AttentionFeatures(sinks=True), qk_dim=64, v_dim=64)
        finally:
            attention._gap.cache_clear()
        assert plain == ""
        assert (sinks == "") == (kind == "fa4"), sinks
        assert kind == "fa4" or "learnable_sink" in sinks

    @pytest.mark.parametrize(("module", "capability", "dims", "refused"), [
        ("flash_attn.cute.interface", (9, 0), (80, 80), True),
        ("flash_attn.cute.interface", (9, 0), (112, 112), True),
        ("flash_attn.cute.interface", (9, 0), (64, 80), True),  # v padded to 80
        ("flash_attn.cute.interface", (9, 0), (96, 96), False),
        ("flash_attn.cute.interface", (9, 0), (192, 128), False),
        ("flash_attn.cute.interface", (10, 0), (80, 80), False),  # Blackwell: not measured wrong
        ("flash_attn.flash_attn_interface", (9, 0), (80, 80), False),  # FlashAttention-2
    ], ids=["fa4-h100-80", "fa4-h100-112", "fa4-h100-v80", "fa4-h100-96", "fa4-h100-192-128", "fa4-b200-80",
            "fa2-h100-80"])
    def test_fa4_on_hopper_runs_multiples_of_32(self, module, capability, dims, refused, monkeypatch):
        """FlashAttention-4 4.0.0b36's backward on Hopper is wrong at head dims 80 and 112 (bench/flash_head_dims.py):
        "flash" there is refused, naming the head dim, so "auto" skips it and an explicit choice raises."""
        def fake(*args, **kwargs):
            raise AssertionError("not called")

        fake.__module__ = module
        monkeypatch.setattr(attention, "_flash_varlen", lambda device: fake)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        cuda = torch.device("cuda", 0)
        attention._gap.cache_clear()
        attention._flash_head_dim_gap.cache_clear()
        try:
            reason = unsupported("flash", AttentionFeatures(window=4), qk_dim=dims[0], v_dim=dims[1], device=cuda)
            plain_gap = attention._flash_head_dim_gap(cuda, dims[0])
        finally:
            attention._gap.cache_clear()
            attention._flash_head_dim_gap.cache_clear()
        assert (f"head dim {max(dims)}" in reason) == refused, reason
        assert not refused or reason.startswith("FlashAttention-4 on Hopper")
        assert bool(plain_gap) == (refused and dims[0] % 32 != 0)

    def test_auto_skips_backends_that_cannot(self, monkeypatch):
        """On a (pretended) fast GPU with flex and torch varlen available, auto picks past backends that cannot
        run a layer's features; an explicit one raises naming why."""
        monkeypatch.setattr(attention, "_fast_cuda", lambda q: True)
        monkeypatch.setattr(attention, "_flash_varlen", lambda device: None)
        attention._gap.cache_clear()
        q = torch.empty(8, 4, 64)
        try:
            with torch.no_grad():
                assert select_backend(q, features=AttentionFeatures(window=4)) == "torch"
                assert select_backend(q, features=AttentionFeatures(softcap=5.0)) == "flex"
                assert select_backend(q, features=AttentionFeatures(softcap=5.0), v_dim=48) == "sdpa"
                with pytest.raises(tfcompat.InvalidInputError, match="(?s)cannot run these attention features.*no "
                                   "softcap"):
                    select_backend(q, "torch", features=AttentionFeatures(softcap=5.0))
        finally:
            attention._gap.cache_clear()

    def test_features_turn_off_the_long_sequence_rule(self, monkeypatch):
        monkeypatch.setattr(attention, "_fast_cuda", lambda q: True)
        monkeypatch.setattr(attention, "_hopper_cudnn_sdpa", lambda device: True)
        q = torch.empty(1, 28, 128, requires_grad=True)
        long = from_lengths([4096] * 4)
        assert attention._auto_order(q, None, long) == ("flash", "sdpa")
        assert attention._auto_order(q, None, long, plain=False) == attention.AUTO_ORDER


# ------------------------------------------------------- flash and torch varlen plumbing, through fakes on CPU


def _fa_emulator(q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                 softcap=0.0, sinks=None):
    """flash-attn's documented varlen semantics (equal q and k lengths): keys ``[i - left, i + right]`` of the
    sequence, ``causal`` forcing ``right = 0``; softcap 0 means none; q/k/v of one head dim."""
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], "flash-attn takes one head dim"
    assert cu_q is cu_k and cu_q.dtype == torch.int32
    lengths = torch.diff(cu_q).tolist()
    assert max_q == max_k == max(lengths)
    left, right = (-1 if w is None else w for w in window_size)
    right = 0 if causal else right
    return naive(q, k, v, lengths, scale=softmax_scale, softcap=softcap or None, sinks=sinks, left=left,
                 right=right)


def _fa2(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
         causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
         return_attn_probs=False, block_table=None):
    return _fa_emulator(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
                        causal=causal, window_size=window_size, softcap=softcap)


def _fa3(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
         softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
         window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
         sm_margin=0, return_attn_probs=False):
    out = _fa_emulator(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
                       causal=causal, window_size=window_size, softcap=softcap)
    return out, torch.zeros(q.shape[1], q.shape[0])  # some FA3 releases also return the log-sum-exp


def _fa3_s_aux(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False,
               window_size=(-1, -1), softcap=0.0, s_aux=None):
    raise AssertionError("never called: sinks through s_aux are refused")


def _fa4(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
         min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None, page_table=None,
         softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1,
         pack_gqa=None, deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
         block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False, scheduler_metadata=None,
         seqlen_k_per_split=None, disable_scheduler_metadata=False):
    out = _fa_emulator(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
                       causal=causal, window_size=window_size, softcap=softcap, sinks=learnable_sink)
    return out, None


def _torch_varlen_fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                       window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.13's varlen_attn: ``is_causal = window_size == (-1, 0)``, FA2 windows otherwise."""
    assert enable_gqa == (query.shape[1] != key.shape[1])
    assert isinstance(window_size, tuple)
    return _fa_emulator(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, softmax_scale=scale,
                        causal=window_size == (-1, 0), window_size=window_size)


class TestKernelPlumbing:
    """Rule: the flash and torch backends hand each kernel the window, softcap, sinks, scale and one head dim as its
    signature wants them; checked on CPU against emulators of the kernels' documented semantics (the kernels
    themselves run in tests/gpu/test_attention_features_cuda.py)."""

    FEATURES = [{}, {"window": 6}, {"softcap": 1.5}, {"sinks": True}, {"window": 3, "softcap": 0.8, "sinks": True},
                {"chunk": 7, "window": 4}]

    @pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f) or "plain")
    @pytest.mark.parametrize("kind", ["fa2", "fa3", "fa4"])
    def test_flash(self, kind, features, monkeypatch):
        features = dict(features)
        fake = {"fa2": _fa2, "fa3": _fa3, "fa4": _fa4}[kind]
        if features.get("sinks") and kind != "fa4":
            pytest.skip(f"{kind} takes no sinks: refused by unsupported() (TestUnsupported)")
        self._check(monkeypatch, "flash", features, flash=fake)

    @pytest.mark.parametrize("features", [f for f in FEATURES if not {"softcap", "sinks"} & f.keys()],
                             ids=lambda f: "-".join(f) or "plain")
    def test_torch_varlen(self, features, monkeypatch):
        params = frozenset(inspect.signature(_torch_varlen_fake).parameters)
        self._check(monkeypatch, "torch", dict(features), torch_varlen=(_torch_varlen_fake, params))

    @staticmethod
    def _check(monkeypatch, backend, features, flash=None, torch_varlen=None):
        monkeypatch.setattr(attention, "_fast_cuda", lambda q: True)
        monkeypatch.setattr(attention, "_flash_varlen", lambda device: flash)
        monkeypatch.setattr(attention, "_torch_varlen", lambda: torch_varlen)
        attention._gap.cache_clear()
        lengths = [9, 1, 20, 14]
        q, k, v, sinks = _qkv(lengths, 6, 2, 24, 8, seed=10)
        kw = {**features, "sinks": sinks if features.pop("sinks", False) else None, "scale": 0.3}
        chunk = kw.pop("chunk", None)
        try:
            got = _core(q, k, v, lengths, chunk=chunk, backend=backend, **kw)
        finally:
            attention._gap.cache_clear()
        assert got.shape == (sum(lengths), 6, 8)
        assert_close(got, naive(q, k, v, lengths, chunk=chunk, **kw), **TOL)


# ---------------------------------------------------------------------------- the transformers adapter


def eager_attention_forward(module, query, key, value, attention_mask, row_bias=None, **kwargs):
    """This module's eager function, as a modeling file holds one: it reads ``row_bias``, which no attention
    implementation of transformers does (`_Attention`'s module is this one)."""
    raise NotImplementedError  # pragma: no cover - only its source is read


class _Attention(torch.nn.Module):
    """A stand-in attention module: what packed_attention reads from one (features, sinks)."""

    def __init__(self, features: AttentionFeatures | None = None, hq: int = 4):
        super().__init__()
        if features is not None:
            setattr(self, FEATURES_ATTR, features)
        if features is not None and features.sinks:
            self.sinks = torch.nn.Parameter(torch.randn(hq, generator=torch.Generator().manual_seed(11)))


def _call(module, lengths=(5, 8, 3), dv=16, **kwargs):
    q, k, v, _ = _qkv(list(lengths), 4, 2, 16, dv, seed=12)
    # (T, H, D) -> (1, H, T, D): transformers' layout
    query, key, value = (x.transpose(0, 1)[None] for x in (q, k, v))
    kwargs.setdefault(CONTEXT_KWARG, ForwardContext(from_lengths(list(lengths))))
    out, weights = packed_attention(module, query, key, value, None, **kwargs)
    assert weights is None
    return out[0], (q, k, v)  # (1, T, H, Dv) -> (T, H, Dv)


class TestPackedAttention:
    """Rule: packed_attention runs the layer's recorded features (window, softcap, sinks from s_aux or the module,
    chunks, Dv) exactly; a kwarg that disagrees with them, dropout, non-causal attention or an unknown kwarg with a
    value raises PatchedModelError naming it."""

    def test_features_from_the_module(self):
        features = AttentionFeatures(window=3, softcap=2.0, sinks=True, chunk=4)
        module = _Attention(features)
        out, (q, k, v) = _call(module, dv=8, scaling=0.4, sliding_window=3, softcap=2.0, position_ids=torch.ones(1))
        want = naive(q, k, v, [5, 8, 3], scale=0.4, window=3, softcap=2.0, sinks=module.sinks, chunk=4)
        assert out.shape == (16, 4, 8)
        assert_close(out, want, **TOL)
        out.sum().backward()
        assert module.sinks.grad is not None and float(module.sinks.grad.abs().max()) > 0

    def test_sinks_from_s_aux(self):
        module = _Attention(AttentionFeatures(sinks=True))
        s_aux = torch.randn(4)
        out, (q, k, v) = _call(module, s_aux=s_aux)
        assert_close(out, naive(q, k, v, [5, 8, 3], sinks=s_aux), **TOL)

    def test_no_attribute_is_plain_causal(self):
        out, (q, k, v) = _call(_Attention(), sliding_window=None, softcap=None, s_aux=None, is_causal=True)
        assert_close(out, naive(q, k, v, [5, 8, 3]), **TOL)

    @pytest.mark.parametrize("harmless", [
        {"position_ids": torch.arange(16)[None]}, {"use_cache": False}, {"output_attentions": True},
        {"cache_position": torch.arange(16)}, {"past_key_values": None}, {"cache": None},
        {"cu_seq_lens_q": torch.tensor([0, 16])}, {"num_items_in_batch": torch.tensor(3)}, {"position_bias": None},
        {"output_router_logits": True},
    ], ids=lambda h: next(iter(h)))
    def test_harmless_kwargs_pass(self, harmless):
        out, (q, k, v) = _call(_Attention(), **harmless)
        assert_close(out, naive(q, k, v, [5, 8, 3]), **TOL)

    @pytest.mark.parametrize("name", ["mm_token_type_ids", "second_per_grid_ts"])
    def test_kwargs_no_attention_implementation_reads_pass(self, name):
        # LLaVA-OneVision-1.5 (5.25) lets its processor's outputs run down to the attention in **kwargs
        out, (q, k, v) = _call(_Attention(), **{name: torch.ones(1, 16, dtype=torch.long)})
        assert_close(out, naive(q, k, v, [5, 8, 3]), **TOL)

    def test_kwarg_read_only_by_the_models_eager_function_is_refused(self):
        with pytest.raises(tfcompat.PatchedModelError, match="passed row_bias to the packed attention"):
            _call(_Attention(), row_bias=torch.zeros(1))

    @pytest.mark.parametrize(("features", "kwargs", "match"), [
        (None, {"sliding_window": 8}, r"sliding_window=8 .* patch\(\) recorded None"),
        (AttentionFeatures(window=4), {"sliding_window": 8}, r"sliding_window=8 .* recorded 4"),
        (AttentionFeatures(window=4), {"sliding_window": None}, r"sliding_window=None .* recorded 4"),
        (None, {"softcap": 50.0}, r"softcap=50.0 .* recorded None"),
        (None, {"s_aux": torch.zeros(4)}, r"passed attention sinks \(s_aux\), but patch\(\) recorded none"),
        (AttentionFeatures(sinks=True), {"dropout": 0.1}, r"attention dropout 0.1"),
        (None, {"is_causal": False}, r"non-causal"),
        (None, {"position_bias": torch.zeros(1)}, r"passed position_bias to the packed attention"),
        (None, {"indices": torch.zeros(1), "sinks": torch.zeros(4)}, r"passed indices, sinks .* implement them"),
    ], ids=["window-none", "window-other", "window-dropped", "softcap", "s_aux", "dropout", "causal", "unknown",
            "unknowns"])
    def test_refusals(self, features, kwargs, match):
        with pytest.raises(tfcompat.PatchedModelError, match=f"(?s)_Attention .*{match}"):
            _call(_Attention(features), **kwargs)

    def test_recorded_sinks_missing_raises(self):
        module = _Attention(AttentionFeatures(sinks=True))
        del module.sinks
        with pytest.raises(tfcompat.PatchedModelError, match="has no attention sinks, but patch"):
            _call(module)


# ------------------------------------------------------------------- the oracle: stock transformers models

TINY = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, head_dim=16)
# model type -> (config overrides, the features of one attention module, overrides that turn the features off)
STOCK = {
    "gpt_oss": ({"sliding_window": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
                 "layer_types": ["sliding_attention", "full_attention"]},
                lambda mod: AttentionFeatures(window=mod.sliding_window, sinks=True), {"sliding_window": 64}),
    "gemma2": ({"sliding_window": 5, "attn_logit_softcapping": 0.5, "query_pre_attn_scalar": 7},
               lambda mod: AttentionFeatures(window=mod.sliding_window, softcap=mod.config.attn_logit_softcapping),
               {"sliding_window": 64, "attn_logit_softcapping": None}),
    "llama4_text": ({"attention_chunk_size": 4, "num_local_experts": 2, "interleave_moe_layer_step": 1,
                     "intermediate_size_mlp": 64},
                    lambda mod: AttentionFeatures(chunk=mod.config.attention_chunk_size if mod.use_rope else None),
                    {"attention_chunk_size": 64}),
    # MLA: q/k head dim 16 + 8 = 24, v head dim 12
    "deepseek_v3": ({"n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                     "moe_intermediate_size": 32, "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8,
                     "qk_nope_head_dim": 16, "v_head_dim": 12, "first_k_dense_replace": 1, "head_dim": 8,
                     "num_key_value_heads": 4},
                    lambda mod: AttentionFeatures(), None),
}
STOCK_LENGTHS = [9, 1, 14, 6]


def _stock_model(model_type, overrides):
    mapping = pytest.importorskip("transformers.models.auto.configuration_auto").CONFIG_MAPPING
    if model_type not in mapping:
        pytest.skip(f"{model_type} is not in this transformers release")
    config = mapping[model_type](**{**TINY, **overrides})
    config._attn_implementation = "eager"  # the oracle: softcapping and sinks are eager-only on some releases
    torch.manual_seed(0)
    return pytest.importorskip("transformers").AutoModelForCausalLM.from_config(config).float().eval()


@pytest.fixture
def packed_key():
    from tfcompat.hf import attention as hf_attention

    hf_attention.register()
    yield hf_attention.ATTENTION_KEY
    hf_attention.unregister()


@pytest.mark.parametrize("model_type", sorted(STOCK))
def test_stock_model_with_features_recorded_by_hand(model_type, packed_key):
    """Rule: a stock model whose attention modules carry their features (as patch() records them) gives, packed
    through the adapter, the stock eager model's per-sequence logits and parameter gradients (gpt-oss sinks and
    windows, gemma2 softcaps and windows, llama4 chunks, DeepSeek MLA head dims), on the installed release."""
    overrides, features_of, off = STOCK[model_type]
    model = _stock_model(model_type, overrides)
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 128, (1, n), generator=gen) for n in STOCK_LENGTHS]
    weights = torch.randn(sum(STOCK_LENGTHS), 128, generator=gen)

    ref = torch.cat([model(input_ids=i, use_cache=False).logits[0] for i in ids])
    (ref * weights).sum().backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            setattr(module, FEATURES_ATTR, features_of(module))
    model.config._attn_implementation = packed_key
    positions = torch.cat([torch.arange(n) for n in STOCK_LENGTHS])[None]
    got = model(input_ids=torch.cat(ids, 1), position_ids=positions, use_cache=False,
                **{CONTEXT_KWARG: ForwardContext(from_lengths(STOCK_LENGTHS))}).logits[0]
    (got * weights).sum().backward()
    assert_close(got, ref, atol=1e-5, rtol=1e-5, what="logits")
    assert ref_grads, "no gradients"
    for name, p in model.named_parameters():
        if name in ref_grads:  # sums over tokens in another order: 1e-5 of the largest entry
            scale = max(1.0, float(ref_grads[name].abs().max()))
            assert_close(p.grad, ref_grads[name], atol=1e-5 * scale, rtol=1e-5, what=f"grad {name}")

    if off is not None:  # non-vacuity: the features change the stock model at these sizes
        plain = _stock_model(model_type, {**overrides, **off})
        joined = torch.cat([plain(input_ids=i, use_cache=False).logits[0] for i in ids])
        assert not torch.allclose(joined, ref, atol=1e-3), "the features do nothing here: the test cannot fail"
