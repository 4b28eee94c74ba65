"""Property tests for packed-sequence boundaries, the varlen attention core, and position-id splitting."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tfcompat
from tfcompat.core.attention import varlen_attention
from tfcompat.core.labels import mask_ends, mask_starts, shift_labels
from tfcompat.core.packing import PackedSeqs, check_text_positions, from_host_positions, from_lengths
from tfcompat.core.position_ids import split_positions
from tfcompat.hf.forward import to_text_model_layout

SETTINGS = settings(max_examples=100, deadline=None)

LENGTHS = st.lists(st.integers(1, 40), min_size=1, max_size=6)


def packed_row(lengths: list[int]) -> torch.Tensor:
    """The text position row of sequences of ``lengths`` packed back to back: ``(T,)`` int64."""
    return torch.cat([torch.arange(n) for n in lengths])


def expected_cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


@st.composite
def packed_batches(draw: st.DrawFn) -> list[list[int]]:
    """B rows of one common length L, each row cut into sequences: the per-row sequence lengths."""
    length = draw(st.integers(1, 60))
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        cuts = sorted(draw(st.sets(st.integers(1, length - 1), max_size=5))) if length > 1 else []
        bounds = [0, *cuts, length]
        rows.append([b - a for a, b in zip(bounds, bounds[1:])])
    return rows


# ---------------------------------------------------------------------------------------------- boundaries


def from_text_positions(text: torch.Tensor) -> PackedSeqs:
    """The boundaries a patched forward takes from a ``(B, L)`` text row: checked, copied to the host once
    (`tfcompat.hf.forward.Router.decide`), then `from_host_positions`."""
    check_text_positions(text)
    return from_host_positions(text.long().cpu(), device=text.device)


class TestFromTextPositions:
    """A sequence starts at every row start and wherever the text position is 0; inside one, positions count up by 1."""

    @SETTINGS
    @given(LENGTHS)
    def test_single_row(self, lengths: list[int]) -> None:
        seqs = from_text_positions(packed_row(lengths)[None])
        assert seqs.cu_seqlens.dtype == torch.int32
        assert torch.equal(seqs.cu_seqlens, expected_cu(lengths))
        assert seqs.max_seqlen == max(lengths)
        assert type(seqs.max_seqlen) is int
        assert seqs.lengths == tuple(lengths)
        assert seqs.total == sum(lengths)

    @SETTINGS
    @given(packed_batches())
    def test_batch_rows_flatten_in_order(self, rows: list[list[int]]) -> None:
        positions = torch.stack([packed_row(r) for r in rows])
        flat = [n for r in rows for n in r]
        seqs = from_text_positions(positions)
        assert seqs.lengths == tuple(flat)
        assert torch.equal(seqs.cu_seqlens, expected_cu(flat))
        assert seqs.max_seqlen == max(flat)
        assert seqs.total == positions.numel()

    @SETTINGS
    @given(packed_batches(), st.integers(1, 1000))
    def test_every_row_start_starts_a_sequence(self, rows: list[list[int]], offset: int) -> None:
        # rows that start mid-sequence (e.g. a shard of a longer sequence) never merge with the previous row
        positions = torch.stack([packed_row(r) for r in rows])
        for b, r in enumerate(rows):
            positions[b, : r[0]] += offset
        assert from_text_positions(positions).lengths == tuple(n for r in rows for n in r)

    def test_row_continuing_the_previous_one_still_splits(self) -> None:
        assert from_text_positions(torch.tensor([[0, 1, 2], [3, 4, 5]])).lengths == (3, 3)

    @SETTINGS
    @given(LENGTHS, st.data())
    def test_jump_inside_a_sequence_rejected(self, lengths: list[int], data: st.DataObject) -> None:
        row = packed_row(lengths)
        inner = [i for i in range(1, row.numel()) if row[i] != 0]
        if not inner:
            row = torch.cat([row, torch.tensor([1])])
            inner = [row.numel() - 1]
        i = data.draw(st.sampled_from(inner))
        jump = data.draw(st.sampled_from([-1, 2, 3, 17]))
        row[i] = row[i - 1] + jump if row[i - 1] + jump != 0 else row[i - 1] + 2
        match = rf"(not packed sequences|negative position ids)(?s:.*)at flat index {i} "
        with pytest.raises(tfcompat.InvalidInputError, match=match):
            from_text_positions(row[None])

    def test_jump_example(self) -> None:
        with pytest.raises(tfcompat.InvalidInputError, match=r"(?s)not packed sequences.*1 -> 3"):
            from_text_positions(torch.tensor([[0, 1, 3]]))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.bool])
    def test_non_integer_rejected(self, dtype: torch.dtype) -> None:
        with pytest.raises(tfcompat.InvalidInputError, match=r"integer \(batch, seq_len\)"):
            from_text_positions(torch.tensor([[0, 1, 2]]).to(dtype))

    @pytest.mark.parametrize("shape", [(3,), (1, 1, 3), (4, 1, 3)])
    def test_not_2d_rejected(self, shape: tuple[int, ...]) -> None:
        with pytest.raises(tfcompat.InvalidInputError, match=r"(?s)\(batch, seq_len\).*shape " + re_shape(shape)):
            from_text_positions(torch.zeros(shape, dtype=torch.long))

    def test_from_lengths_rejects_empty_sequences(self) -> None:
        with pytest.raises(tfcompat.InvalidInputError, match="must be positive"):
            from_lengths([3, 0, 2])
        with pytest.raises(tfcompat.InvalidInputError, match="must be positive"):
            from_lengths([])


def re_shape(shape: tuple[int, ...]) -> str:
    return re.escape(str(tuple(shape)))


# ---------------------------------------------------------------------------------------------- attention


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                    scale: float) -> torch.Tensor:
    """float64 reference: per sequence, repeat KV heads, explicit causal softmax."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    out = []
    start = 0
    for n in lengths:
        qs = q[start : start + n].transpose(0, 1)  # (Hq, n, D)
        ks = k[start : start + n].repeat_interleave(rep, dim=1).transpose(0, 1)
        vs = v[start : start + n].repeat_interleave(rep, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(-1, -2) * scale
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        weights = scores.exp() / scores.exp().sum(-1, keepdim=True)
        out.append((weights @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


@st.composite
def attention_inputs(draw: st.DrawFn):
    lengths = draw(LENGTHS)
    hq = draw(st.sampled_from([2, 4, 8]))
    hkv = draw(st.sampled_from([h for h in (1, 2, 4, 8) if hq % h == 0]))
    d = draw(st.sampled_from([4, 8, 16]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    t = sum(lengths)
    q = torch.randn(t, hq, d, generator=gen)
    k = torch.randn(t, hkv, d, generator=gen)
    v = torch.randn(t, hkv, d, generator=gen)
    return lengths, q, k, v, gen


class TestVarlenAttention:
    """out[t] = softmax(scale * q[t] . k[s]) v[s] over s <= t in t's own sequence; query head h reads KV head
    h // (Hq // Hkv)."""

    @settings(max_examples=40, deadline=None)
    @given(attention_inputs(), st.one_of(st.none(), st.floats(0.05, 1.0)))
    def test_sdpa_matches_naive_reference(self, inputs, scale: float | None) -> None:
        lengths, q, k, v, _ = inputs
        seqs = from_lengths(lengths)
        out = varlen_attention(q, k, v, seqs, scale=scale, backend="sdpa")
        assert out.shape == q.shape
        assert out.dtype == torch.float32
        ref = naive_attention(q, k, v, lengths, q.shape[-1] ** -0.5 if scale is None else scale)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)

    @settings(max_examples=40, deadline=None)
    @given(attention_inputs(), st.data())
    def test_sequences_do_not_see_each_other(self, inputs, data: st.DataObject) -> None:
        lengths, q, k, v, gen = inputs
        seqs = from_text_positions(packed_row(lengths)[None])
        j = data.draw(st.integers(0, len(lengths) - 1))
        start, end = sum(lengths[:j]), sum(lengths[: j + 1])
        k2, v2 = k.clone(), v.clone()
        k2[start:end] += torch.randn(end - start, *k.shape[1:], generator=gen)
        v2[start:end] += 1.0 + torch.rand(end - start, *v.shape[1:], generator=gen)
        before = varlen_attention(q, k, v, seqs, backend="sdpa").split(lengths)
        after = varlen_attention(q, k2, v2, seqs, backend="sdpa").split(lengths)
        for i, (b, a) in enumerate(zip(before, after)):
            if i == j:
                assert not torch.equal(b, a)  # the perturbation reached sequence j
            else:
                assert torch.equal(b, a), f"sequence {i} changed when sequence {j}'s k/v changed"

    def test_tokens_not_covered_rejected(self) -> None:
        q = torch.randn(5, 2, 4)
        with pytest.raises(tfcompat.InvalidInputError, match="do not cover the tokens"):
            varlen_attention(q, q, q, from_lengths([2, 2]), backend="sdpa")

    def test_heads_not_multiple_rejected(self) -> None:
        q, k = torch.randn(4, 3, 4), torch.randn(4, 2, 4)
        with pytest.raises(tfcompat.InvalidInputError, match="multiple of Hkv"):
            varlen_attention(q, k, k, from_lengths([4]), backend="sdpa")


# ---------------------------------------------------------------------------------------------- position ids


class TestSplitPositions:
    """Position ids are (4, B, L) [text; t; h; w] or (B, L) (all four rows equal); (3, B, L) has no text row."""

    @settings(max_examples=30, deadline=None)
    @given(st.integers(1, 3), st.integers(1, 20), st.integers(0, 2**31 - 1))
    def test_four_rows(self, batch: int, length: int, seed: int) -> None:
        ids = torch.randint(0, 100, (4, batch, length), generator=torch.Generator().manual_seed(seed))
        pos = split_positions(ids, seq_len=length)
        assert torch.equal(pos.text, ids[0])
        assert pos.mrope.shape == (3, batch, length)
        assert torch.equal(pos.mrope, ids[1:])
        assert torch.equal(to_text_model_layout(pos, "text+mrope"), ids)
        assert torch.equal(to_text_model_layout(pos, "mrope"), ids[1:])
        assert torch.equal(to_text_model_layout(pos, "text"), ids[0])
        # every layout that keeps the text row gives back the contract ids
        back = split_positions(to_text_model_layout(pos, "text+mrope"), seq_len=length)
        assert torch.equal(back.text, pos.text) and torch.equal(back.mrope, pos.mrope)

    @settings(max_examples=30, deadline=None)
    @given(st.integers(1, 3), st.integers(1, 20), st.integers(0, 2**31 - 1))
    def test_two_d_gives_three_identical_mrope_rows(self, batch: int, length: int, seed: int) -> None:
        ids = torch.randint(0, 100, (batch, length), generator=torch.Generator().manual_seed(seed))
        pos = split_positions(ids, seq_len=length)
        assert torch.equal(pos.text, ids)
        assert pos.mrope.shape == (3, batch, length)
        for row in pos.mrope:
            assert torch.equal(row, ids)

    def test_three_rows_rejected(self) -> None:
        with pytest.raises(tfcompat.InvalidInputError, match="text row"):
            split_positions(torch.zeros(3, 1, 5, dtype=torch.long), seq_len=5)

    @pytest.mark.parametrize("shape", [(4, 1, 5), (1, 5)])
    def test_length_mismatch_rejected(self, shape: tuple[int, ...]) -> None:
        with pytest.raises(tfcompat.InvalidInputError, match="differ in length"):
            split_positions(torch.zeros(shape, dtype=torch.long), seq_len=6)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool, torch.uint8])
    def test_non_integer_rejected(self, dtype: torch.dtype) -> None:
        with pytest.raises(tfcompat.InvalidInputError, match="integer"):
            split_positions(torch.zeros(4, 1, 5).to(dtype), seq_len=5)

    @pytest.mark.parametrize("shape", [(5,), (2, 1, 5), (4, 1, 1, 5)])
    def test_other_shapes_rejected(self, shape: tuple[int, ...]) -> None:
        with pytest.raises(tfcompat.InvalidInputError, match="unsupported shape"):
            split_positions(torch.zeros(shape, dtype=torch.long), seq_len=5)

    def test_family_named_in_error(self) -> None:
        with pytest.raises(tfcompat.InvalidInputError, match=r"(?s)text row.*family: glm4v"):
            split_positions(torch.zeros(3, 1, 5, dtype=torch.long), seq_len=5, family="glm4v")

    @settings(max_examples=20, deadline=None)
    @given(st.integers(1, 6), st.integers(1, 3), st.integers(1, 12), st.integers(0, 2**31 - 1))
    def test_a_text_row_in_front_of_every_number_of_axes(self, axes: int, batch: int, length: int, seed: int
                                                         ) -> None:
        """(1 + A, B, L) is [text; A rows] for a text model of A M-RoPE axes (HunYuan-VL's XD-RoPE: 4); (A, B, L) has
        no text row; (B, L) is the row of every axis; with axes unknown (None), R >= 4 rows are [text; R - 1]."""
        ids = torch.randint(0, 100, (axes + 1, batch, length), generator=torch.Generator().manual_seed(seed))
        pos = split_positions(ids, seq_len=length, axes=axes)
        assert torch.equal(pos.text, ids[0]) and torch.equal(pos.mrope, ids[1:])
        assert torch.equal(to_text_model_layout(pos, "text+mrope"), ids)
        assert split_positions(ids[0], seq_len=length, axes=axes).mrope.shape == (axes, batch, length)
        with pytest.raises(tfcompat.InvalidInputError, match=f"{axes}-row position ids have no text row"):
            split_positions(ids[1:], seq_len=length, axes=axes)
        if axes >= 3:
            assert torch.equal(split_positions(ids, seq_len=length, axes=None).mrope, ids[1:])


class TestLabelsPerSequence:
    """The labels rule (`tfcompat.core.labels`): no target crosses a sequence boundary."""

    @SETTINGS
    @given(LENGTHS, st.integers(0, 2**31 - 1))
    def test_shifted_labels_are_each_sequence_shifted_alone(self, lengths: list[int], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        parts = [torch.randint(0, 50, (n,), generator=gen) for n in lengths]
        row = torch.cat(parts)[None]  # (1, T)
        seqs = from_lengths(lengths)
        alone = torch.cat([torch.cat([p[1:], p.new_full((1,), -100)]) for p in parts])[None]
        assert torch.equal(shift_labels(row, seqs), alone)
        assert torch.equal(mask_ends(torch.roll(row, -1, 1), seqs), alone)  # a whole-row shift, ends masked
        starts = mask_starts(row, seqs)
        assert torch.equal(starts, torch.cat([torch.cat([p.new_full((1,), -100), p[1:]]) for p in parts])[None])
