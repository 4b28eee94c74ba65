"""Ulysses for families whose MoE routes each token by its modality (ERNIE-4.5-VL) on CPU with gloo: sp = 2 and 4 equal
sp = 1 and stock per sequence, per token, forward and backward (fp32), two images and a video in the row.

The tiny model (`tfcompat.selfcheck.tiny_model`): layer 0 dense, layer 1 MoE with 4 text and 4 vision experts (top 2)
and a shared expert. The row (`routed_workers.LENGTHS`, `ITEMS`): text, two images, a four-frame video, text, 63 tokens
(the pad segment is exercised at sp = 2 and 4); at sp = 4 one rank's slice holds text alone and another's vision alone.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed import routed_workers
from tests.distributed.harness import run_world
from tfcompat.registry import installed_families

pytestmark = pytest.mark.dist

TOLERANCE = 1e-5
ROUTED = [k for k, f in installed_families().items() if f.moe_token_types is not None]
WORLDS = [(k, w) for k in ROUTED for w in (2, 4)]


@pytest.mark.parametrize("family,world", WORLDS, ids=[f"{k}-sp{w}" for k, w in WORLDS])
def test_sp_equals_single_process_and_stock(family, world, tmp_path, record_property):
    """Rule: on every rank, the gathered logits of every token and every parameter's gradient (summed over the ranks:
    vision tower, resampler, text and vision experts) equal sp = 1 and stock per sequence (relative 1e-5); control:
    the shard without its routing ids differs from stock."""
    run_world(routed_workers.routed_sp_equals_stock, world, family, str(tmp_path))
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(world)]
    worst = {key: max(max(r[key].values()) if isinstance(r[key], dict) else r[key] for r in results)
             for key in results[0] if key.startswith(("logits", "grads", "control"))}
    record_property("max_diffs", worst)
    print(f"{family} sp={world}: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    routed = [r["routed_here"] for r in results]
    assert sum(routed) > 0, "the row must send tokens to the vision experts"
    if world == 4:
        assert 0 in routed and results[1]["local"] in routed, f"vision tokens by rank: {routed}"
    names = results[0]["names"]
    for part in ("vision_tower", "vision_moe", "text_moe"):
        assert any(part in n for n in names), f"no gradient reaches {part}: {names}"
    for rank, r in enumerate(results):
        assert r["names"] == names
        for key in ("logits_sp_vs_sp1", "logits_sp_vs_stock", "logits_sp1_vs_stock"):
            assert r[key] <= TOLERANCE, f"rank {rank}: {key} {r[key]:.3e}"
        for key in ("grads_sp_vs_sp1", "grads_sp_vs_stock", "grads_sp1_vs_stock"):
            name, diff = max(r[key].items(), key=lambda kv: kv[1])
            assert diff <= TOLERANCE, f"rank {rank}: {key}: {name} differs by {diff:.3e}"
        assert r["control"] > 1e-3, f"rank {rank}: control: the shard without routing ids equals stock"
