"""Ulysses for derived families (no written table) on CPU with gloo: sp = 2 and 4 equal sp = 1 per token.

Tiny models from `tfcompat.tiny_models.tiny_config` (2 layers, hidden 64, 4 query heads of 16, vocab 256): MoE
routing (qwen3_moe, mixtral), attention sinks with sliding and full layers (gpt_oss), multi-head latent attention
with q/k head dim 24 and v head dim 16 (deepseek_v3, 4 KV heads), a sliding/full layer pattern with final-logit
softcapping (gemma3_text). Windows (8) are shorter than most sequences; at sp = 4 every type but deepseek_v3 has
fewer KV heads (2) than ranks. The row holds sequences of odd lengths (35 tokens: the pad segment is exercised at
sp = 2 and 4) and sequences cut across ranks.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed import derived_workers
from tests.distributed.harness import run_world
from tfcompat.registry.derive import causal_lm_types

pytestmark = pytest.mark.dist

LENGTHS = [13, 1, 9, 7, 5]
TOLERANCE = 1e-5
# model_type -> (config overrides of the tiny config, a parameter whose gradient must be compared)
CASES = {
    "qwen3_moe": ({}, "mlp.experts"),
    "gpt_oss": ({}, "self_attn.sinks"),
    "deepseek_v3": ({}, "self_attn.kv_a_proj_with_mqa"),
    "gemma3_text": ({"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
                     "final_logit_softcapping": 5.0}, "self_attn.q_norm"),
    "mixtral": ({"sliding_window": 8}, "mlp.experts"),
}
WORLDS = [(t, w) for t in CASES if t in causal_lm_types() for w in (2, 4)]


@pytest.mark.parametrize("model_type,world", WORLDS, ids=[f"{t}-sp{w}" for t, w in WORLDS])
def test_sp_equals_single_process(model_type, world, tmp_path, record_property):
    """Rule: on every rank, the gathered logits of every token and every parameter's gradient (summed over the
    ranks) equal the single-process patched packed run (relative 1e-5); control: the stock model on the row as one
    sequence (positions running on, attending across sequences) differs from it."""
    overrides, watched = CASES[model_type]
    run_world(derived_workers.derived_sp_equals_single, world, model_type, overrides, LENGTHS, str(tmp_path))
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(world)]
    record_property("max_diffs", {"logits": max(r["logits"] for r in results),
                                  "grads": max(max(r["grads"].values()) for r in results)})
    for rank, r in enumerate(results):
        assert r["names"] == r["ref_names"], f"rank {rank}: {sorted(set(r['names']) ^ set(r['ref_names']))}"
        assert any(watched in n for n in r["names"]), f"no gradient of {watched}"
        assert r["logits"] <= TOLERANCE, f"rank {rank}: sp={world} logits differ from sp=1 by {r['logits']:.3e}"
        name, worst = max(r["grads"].items(), key=lambda kv: kv[1])
        assert worst <= TOLERANCE, f"rank {rank}: grad {name} differs by {worst:.3e}"
        assert r["control"] > 1e-3, f"rank {rank}: control: the row as one sequence equals sp=1 ({r['control']:.1e})"


@pytest.mark.skipif("gpt_oss" not in causal_lm_types(), reason="gpt_oss is not in this transformers release")
def test_heads_checked_at_patch():
    """Rule: a derived type whose query heads the group does not divide (gpt-oss, 3 heads, sinks) is refused at
    patch()."""
    run_world(derived_workers.heads_refused_at_patch, 2, "gpt_oss",
              {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1})
