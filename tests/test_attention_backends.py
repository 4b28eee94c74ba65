"""The attention backends on CPU: the flex document block mask, flex against the SDPA reference, selection rules.

On CPU torch runs flex attention forward only (no backward), compiled statically per shape; the CUDA
backends ("flash", "torch", "cudnn") are covered in tests/gpu. Tolerance: fp32 outputs within 1e-5 of the
"sdpa" backend (both accumulate in fp32 over at most a few hundred keys).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tfcompat
from tests.helpers import assert_close, pack
from tfcompat.core import attention
from tfcompat.core.attention import available_backends, document_block_mask, select_backend, varlen_attention
from tfcompat.core.packing import from_lengths
from tfcompat.selfcheck import sample_sequences, stock_inputs, tiny_model

flex_mod = pytest.importorskip("torch.nn.attention.flex_attention", reason="this torch has no flex attention")
needs_flex = pytest.mark.skipif(attention._flex_api() is None, reason="flex attention needs torch >= 2.6")

LENGTHS = [37, 1, 90, 128]  # 256 tokens: one shape, so the CPU compiles flex once for these tests


def _reference_block_mask(lengths: list[int]):
    seqs = from_lengths(lengths)
    doc = torch.searchsorted(seqs.cu_seqlens[1:], torch.arange(seqs.total, dtype=torch.int32), right=True)

    def mask_mod(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    return flex_mod.create_block_mask(mask_mod, None, None, seqs.total, seqs.total, device="cpu")


@needs_flex
class TestDocumentBlockMask:
    """Rule: the block mask built from the boundaries equals create_block_mask's over the document-causal mask."""

    @settings(max_examples=12, deadline=None)
    @given(st.lists(st.integers(1, 300), min_size=1, max_size=6))
    def test_equals_create_block_mask(self, lengths):
        got, ref = document_block_mask(from_lengths(lengths)), _reference_block_mask(lengths)
        for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                                ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
            assert torch.equal(getattr(got, counts), getattr(ref, counts)), (counts, lengths)
            for row, n in enumerate(getattr(got, counts)[0, 0].tolist()):
                mine = getattr(got, indices)[0, 0, row, :n].sort().values
                theirs = getattr(ref, indices)[0, 0, row, :n].sort().values
                assert torch.equal(mine, theirs), (indices, row, lengths)

    def test_cached_per_boundaries(self):
        seqs = from_lengths(LENGTHS)
        assert document_block_mask(seqs) is document_block_mask(seqs)
        assert document_block_mask(from_lengths(LENGTHS)) is not document_block_mask(seqs)


@needs_flex
def test_flex_forward_matches_sdpa_with_gqa():
    """Rule: flex (CPU, no grad) gives the sdpa reference per token; joining the sequences changes it."""
    gen = torch.Generator().manual_seed(0)
    seqs = from_lengths(LENGTHS)
    q, k, v = (torch.randn(seqs.total, h, 16, generator=gen) for h in (4, 2, 2))
    with torch.no_grad():
        got = varlen_attention(q, k, v, seqs, backend="flex")
        ref = varlen_attention(q, k, v, seqs, backend="sdpa")
        joined = varlen_attention(q, k, v, from_lengths([seqs.total]), backend="sdpa")
    assert got.shape == ref.shape == (seqs.total, 4, 16)
    assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(joined[40:], ref[40:], atol=1e-3)  # non-vacuity: the boundaries matter


@needs_flex
def test_patched_model_flex_matches_stock_and_builds_one_mask_per_forward(monkeypatch):
    """Rule: a model patched with backend "flex" gives stock per-sequence logits, building one mask per forward."""
    builds = []
    real = attention._build_document_block_mask
    monkeypatch.setattr(attention, "_build_document_block_mask",
                        lambda seqs, window=None: builds.append(1) or real(seqs, window))
    model = tiny_model("llama", "sdpa", num_hidden_layers=3)
    seqs = sample_sequences(model, LENGTHS, [None] * len(LENGTHS), seed=3)
    r = tfcompat.resolve("llama")
    with torch.no_grad():
        ref = torch.cat([model(**stock_inputs(r, model, s), use_cache=False).logits[0] for s in seqs])
        with tfcompat.patch(model, backend="flex"):
            got = model(**pack(model, seqs), use_cache=False).logits[0]
    assert len(builds) == 1, f"{len(builds)} block masks for one forward of a 3-layer model"
    assert_close(got, ref, atol=1e-5, rtol=1e-5)


class TestSelection:
    """Rule: "auto" on CPU is "sdpa"; an explicit backend that cannot run raises a typed error naming why."""

    def test_cpu_choices(self):
        q = torch.empty(8, 4, 16, requires_grad=True)
        assert select_backend(q) == "sdpa"
        assert available_backends(q) == ["sdpa"]
        with torch.no_grad():
            assert select_backend(q) == "sdpa"
            assert available_backends(q) == (["flex", "sdpa"] if attention._flex_api() else ["sdpa"])

    @pytest.mark.parametrize("backend", ["flash", "torch", "cudnn"])
    def test_cuda_backends_raise_on_cpu(self, backend):
        q = torch.zeros(8, 4, 16, dtype=torch.bfloat16)
        with pytest.raises(tfcompat.InvalidInputError, match=f"backend '{backend}' cannot run these inputs"):
            varlen_attention(q, q[:, :2], q[:, :2], from_lengths([8]), backend=backend)

    def test_flex_with_gradient_on_cpu_raises(self):
        q = torch.zeros(8, 4, 16, requires_grad=True)
        with pytest.raises(tfcompat.InvalidInputError, match="needing a gradient"):
            varlen_attention(q, q[:, :2], q[:, :2], from_lengths([8]), backend="flex")

    def test_flex_needs_power_of_two_head_dim(self):
        q = torch.zeros(8, 4, 24)
        with torch.no_grad(), pytest.raises(tfcompat.InvalidInputError, match="head_dim 24"):
            varlen_attention(q, q, q, from_lengths([8]), backend="flex")

    def test_unknown_backend_raises(self):
        q = torch.zeros(8, 4, 16)
        with pytest.raises(tfcompat.InvalidInputError, match="'nope' cannot run"):
            varlen_attention(q, q, q, from_lengths([8]), backend="nope")  # type: ignore[arg-type]

    def test_auto_table_switches_to_per_sequence_sdpa_for_long_sequences(self, monkeypatch):
        """The decision table on a (pretended) Hopper GPU: per-sequence SDPA from Hq * D * mean(L^2) >= 2e10 with a
        gradient, 8e9 without."""
        monkeypatch.setattr(attention, "_fast_cuda", lambda q: True)
        monkeypatch.setattr(attention, "_hopper_cudnn_sdpa", lambda device: True)
        q = torch.empty(1, 28, 128, requires_grad=True)  # 28 * 128 = 3584: the break-even RMS length is about 2362
        assert attention._auto_order(q, None, from_lengths([2300] * 8)) == attention.AUTO_ORDER
        with torch.no_grad():  # without a gradient from about 1494
            assert attention._auto_order(q, None, from_lengths([2300] * 8)) == ("flash", "sdpa")
            assert attention._auto_order(q, None, from_lengths([1400] * 8)) == attention.AUTO_ORDER
        assert attention._auto_order(q, None, from_lengths([2400] * 8)) == ("flash", "sdpa")
        assert attention._auto_order(q, None, from_lengths([615, 3789])) == ("flash", "sdpa")
        assert attention._auto_order(q, None, None) == attention.AUTO_ORDER
        monkeypatch.setattr(attention, "_hopper_cudnn_sdpa", lambda device: False)
        assert attention._auto_order(q, None, from_lengths([32768] * 2)) == attention.AUTO_ORDER

    def test_patch_accepts_every_backend_name(self):
        model = tiny_model("llama", "sdpa")
        for backend in ("flex", "cudnn"):
            with tfcompat.patch(model, backend=backend) as handle:
                assert handle.options["backend"] == backend
