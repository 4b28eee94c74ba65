"""Ulysses for linear-attention layers on CPU with gloo: sp = 2 and 4 equal sp = 1 per token, forward and backward."""

from __future__ import annotations

import pytest

from tests.distributed import linear_workers
from tests.distributed.harness import run_world

pytestmark = pytest.mark.dist

# (key heads, value heads, key head dim, value head dim); totals not multiples of sp, so a pad sequence is exercised
CASES = [
    ("even-sp2", 2, [7, 70, 1, 19], (2, 4, 8, 6)),
    ("key-heads-repeated-sp4", 4, [7, 70, 1, 19], (2, 4, 8, 6)),
    ("even-sp4", 4, [33, 5, 66], (4, 8, 4, 3)),
    ("one-key-head-sp2", 2, [9, 40], (1, 2, 4, 5)),
]


@pytest.mark.parametrize("world,lengths,heads", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_linear_sp_equals_single_process(world, lengths, heads):
    """Rule: the head split (conv channels with their heads, gates, recurrence over full sequences) and the way
    back give the single-process output, input gradients and summed parameter gradients.

    "key-heads-repeated-sp4" has fewer key heads than ranks: each key head's conv channels go to sp // Hk ranks.
    """
    run_world(linear_workers.linear_sp_equals_single, world, lengths, heads)
