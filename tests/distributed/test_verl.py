"""verl's calling convention (`tfcompat.integrations.verl.apply_monkey_patch`) on gloo, with verl's own functions.

verl's actor steps (remove padding, ``ulysses_pad`` / ``ulysses_pad_and_slice_inputs``, the model call, log-probs of
the rolled ids, ``gather_outputs_and_unpad``) run on the patched model at sp = 1, 2 and 4 for every family of the
installed transformers and four derived types (`verl_workers.DERIVED`); the gathered log-probs and entropies equal
the stock model's per sequence, per token.
verl itself is only needed as files: its ``utils/ulysses.py`` is pure torch (`verl_workers.load_verl_ulysses`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import pytest

from tests.distributed import verl_workers
from tests.distributed.harness import run_world

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(importlib.util.find_spec("verl") is None,
                       reason="verl is not installed (`nox -s integrations` installs verl --no-deps)"),
]


@pytest.mark.parametrize("sp", [1, 2, 4])
def test_verl_actor_equals_stock_per_sequence(sp, tmp_path):
    """Rule: per family, verl-gathered log-probs, entropies and gradients equal stock per sequence (fp32, 1e-5)."""
    out = tmp_path / "verl.json"
    run_world(verl_workers.verl_convention, sp, str(out), timeout=600)
    report = json.loads(out.read_text())
    print(f"\nverl {importlib.metadata.version('verl')}, sp={sp}:")
    for family, diffs in report["families"].items():
        print(f"  {family}: " + ", ".join(f"{k}={v:.2e}" for k, v in diffs.items()))


def test_group_size_must_match_ulysses_sp_size():
    run_world(verl_workers.group_size_mismatch_raises, 2)


def test_boundaries_gathered_once_per_forward():
    """Rule: no per-layer gather of position ids (verl's own patch gathers them in every attention layer)."""
    run_world(verl_workers.collectives_per_forward, 2)
