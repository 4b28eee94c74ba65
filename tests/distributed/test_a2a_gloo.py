"""The fused q/k/v all-to-all on CPU with gloo at sp = 2 and 4: one exchange equals three, forward and backward."""

from __future__ import annotations

import pytest

from tests.distributed import a2a_workers
from tests.distributed.harness import run_world

pytestmark = pytest.mark.dist

# (world, q heads, KV heads, head_dim, tokens per rank, dtype, strided): Hkv < sp (repeated), = sp, > sp
CASES = [
    (2, 4, 1, 5, 3, "float32", True),
    (2, 6, 2, 8, 1, "bfloat16", False),
    (2, 8, 4, 3, 4, "float16", True),
    (4, 4, 1, 8, 2, "float32", True),
    (4, 8, 2, 7, 3, "bfloat16", True),
    (4, 8, 4, 4, 1, "float32", False),
    (4, 16, 8, 1, 2, "float32", True),
]


@pytest.mark.parametrize("case", CASES, ids=[f"sp{c[0]}-q{c[1]}-kv{c[2]}-d{c[3]}-{c[5]}" for c in CASES])
def test_fused_exchange_equals_three(case):
    run_world(a2a_workers.fused_equals_separate, case[0], *case[1:])
