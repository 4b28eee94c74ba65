"""Property tests for `tfcompat.core.custom_mask`: a caller's 4-D mask against the packed boundaries' own."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tfcompat.core.custom_mask import HIDDEN_AT_MOST, block_causal, disagreement, is_comparable
from tfcompat.core.packing import has_packed_rows

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def packed_rows(draw: st.DrawFn) -> list[list[int]]:
    """B rows of one common length L, each cut into sequences: the per-row sequence lengths."""
    length = draw(st.integers(1, 24))
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        cuts = sorted(draw(st.sets(st.integers(1, length - 1), max_size=4))) if length > 1 else []
        bounds = [0, *cuts, length]
        rows.append([b - a for a, b in zip(bounds, bounds[1:])])
    return rows


def text_row(rows: list[list[int]]) -> torch.Tensor:
    """``(B, L)``: positions 0, 1, ... per sequence."""
    return torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])


def reference(rows: list[list[int]]) -> torch.Tensor:
    """``(B, L, L)`` bool: a lower triangle per sequence on the diagonal, built from the lengths."""
    length = sum(rows[0])
    out = torch.zeros(len(rows), length, length, dtype=torch.bool)
    for b, r in enumerate(rows):
        start = 0
        for n in r:
            out[b, start:start + n, start:start + n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
            start += n
    return out


def additive(allowed: torch.Tensor, hidden: float) -> torch.Tensor:
    """``(B, 1, L, L)`` float: 0 where ``allowed`` ``(B, L, L)``, ``hidden`` elsewhere."""
    return torch.where(allowed, 0.0, hidden)[:, None]


class TestBlockCausal:
    """A token attends to itself and the earlier tokens of its own sequence, nothing else."""

    @SETTINGS
    @given(packed_rows())
    def test_equals_the_lower_triangles_of_the_sequences(self, rows: list[list[int]]) -> None:
        assert torch.equal(block_causal(text_row(rows)), reference(rows))


class TestDisagreement:
    """-1 per query token where the mask equals the boundaries' (bool or additive); else the first differing key."""

    @SETTINGS
    @given(packed_rows(), st.sampled_from([None, float("-inf"), torch.finfo(torch.float32).min, HIDDEN_AT_MOST]))
    def test_the_boundaries_own_mask_agrees(self, rows: list[list[int]], hidden: float | None) -> None:
        allowed = reference(rows)
        mask = allowed[:, None] if hidden is None else additive(allowed, hidden)
        assert torch.equal(disagreement(mask, text_row(rows)), torch.full(allowed.shape[:2], -1))

    @SETTINGS
    @given(packed_rows(), st.data(), st.sampled_from([None, torch.finfo(torch.float32).min]))
    def test_one_flipped_entry_is_the_first_difference_of_its_query(self, rows: list[list[int]], data: st.DataObject,
                                                                    hidden: float | None) -> None:
        allowed = reference(rows)
        b, length = len(rows), allowed.shape[-1]
        row, query, key = (data.draw(st.integers(0, b - 1)), data.draw(st.integers(0, length - 1)),
                           data.draw(st.integers(0, length - 1)))
        allowed[row, query, key] = ~allowed[row, query, key]
        mask = allowed[:, None] if hidden is None else additive(allowed, hidden)
        expected = torch.full((b, length), -1)
        expected[row, query] = key
        assert torch.equal(disagreement(mask, text_row(rows)), expected)

    @SETTINGS
    @given(packed_rows(), st.sampled_from([-1.0, 1.0, -9e3, float("nan")]))
    def test_values_neither_zero_nor_hiding_disagree(self, rows: list[list[int]], value: float) -> None:
        mask = additive(reference(rows), torch.finfo(torch.float32).min)
        mask[0, 0, -1, 0] = value  # the last query of row 0 and key 0: attended or hidden, this value is neither
        assert int(disagreement(mask, text_row(rows))[0, -1]) == 0

    def test_one_mask_is_compared_with_every_row(self) -> None:
        rows = [[3, 2], [3, 2], [5]]
        got = disagreement(reference(rows[:1])[:, None], text_row(rows))  # (1, 1, L, L) over three rows
        assert got[:2].eq(-1).all() and got[2].tolist() == [-1, -1, -1, 0, 0]  # row 2: one sequence sees key 0


class TestForms:
    """What `is_comparable` takes: (B or 1, 1, L, L), bool or floating."""

    def test_forms(self) -> None:
        assert is_comparable(torch.ones(2, 1, 5, 5, dtype=torch.bool), 2, 5)
        assert is_comparable(torch.zeros(1, 1, 5, 5, dtype=torch.bfloat16), 2, 5)
        assert not is_comparable(torch.zeros(1, 1, 5, 5, dtype=torch.long), 1, 5)  # int: neither meaning
        assert not is_comparable(torch.zeros(1, 4, 5, 5), 1, 5)  # per head
        assert not is_comparable(torch.zeros(3, 1, 5, 5), 2, 5)
        assert not is_comparable(torch.zeros(1, 1, 5, 6), 1, 5)  # keys of a cache


class TestHasPackedRows:
    """Packed sequences (`from_host_positions`' rule) with more than one in some row."""

    @SETTINGS
    @given(packed_rows())
    def test_restarting_rows(self, rows: list[list[int]]) -> None:
        assert has_packed_rows(text_row(rows)) == any(len(r) > 1 for r in rows)

    def test_ids_of_no_packed_sequences(self) -> None:
        assert not has_packed_rows(torch.tensor([[1, 1, 1, 0, 1, 2]]))  # left padding, generate()'s positions
        assert not has_packed_rows(torch.tensor([[0, 1, 0, -1]]))
