"""Attention features under Ulysses on CPU with gloo at sp = 2 and 4, model-free: the sharded adapter (q/k/v
exchanged to a head split, sinks sliced to each rank's heads) equals the single-process core per token, forward
and backward, with sinks, windows, softcaps, chunks and MLA head dims (q/k 192, v 128)."""

from __future__ import annotations

import pytest

from tests.distributed import features_workers
from tests.distributed.harness import run_world

pytestmark = pytest.mark.dist

# (world, Hq, Hkv, Dqk, Dv, lengths, window, softcap, sinks, chunk, sinks via s_aux): Hkv < sp (KV repeated), = sp,
# > sp; lengths sum to a multiple of 4 with sequences of 1 and sequences cut across ranks
CASES = {
    "sinks-window-s_aux": (2, 4, 2, 16, 16, [7, 1, 12, 4], 5, None, True, None, True),
    "mla-softcap-chunk-kv1": (2, 4, 1, 192, 128, [13, 1, 10], None, 2.5, False, 4, False),
    "all-kv1": (4, 8, 1, 24, 16, [11, 1, 9, 3], 6, 3.0, True, 5, False),
    "mla-sinks-window-s_aux": (4, 4, 2, 192, 128, [5, 10, 1], 4, None, True, None, True),
}


@pytest.mark.parametrize("case", sorted(CASES), ids=sorted(CASES))
def test_sharded_equals_single_process(case):
    """Rule: under Ulysses each rank takes its heads' sinks; windows, softcaps, chunks and Dqk != Dv work as on one
    process, forward and backward (the sinks' gradient summed over the ranks)."""
    run_world(features_workers.sharded_equals_single, *CASES[case])
