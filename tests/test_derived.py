"""Derived families (`tfcompat.registry.derive`): the named causal LMs without a written table, on the installed release.

Rule: per token, the patched packed forward (and backward) of a tiny random model equals the stock model run on
each sequence alone, with the eager and the sdpa references; control: the stock model on the packed row does not.
Windows and chunks are shorter than the sequences, so sliding and chunked layers matter. What tfcompat cannot prove
it handles is refused at ``patch()`` / ``resolve()`` naming the feature.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

import tfcompat
from tfcompat.errors import PatchError, UnknownFamilyError
from tfcompat.registry import families
from tfcompat.registry.derive import causal_lm_types

LENGTHS = (7, 13, 9)  # three sequences of odd lengths; windows (5) and chunks (6) are shorter
WINDOW = 5
MOE = dict(num_experts_per_tok=2)
# model_type -> the text config keys of a tiny model (sizes shrunk as transformers' own model testers do)
TINY: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, **MOE),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, **MOE),
    "mixtral": dict(num_local_experts=4, sliding_window=WINDOW, **MOE),
    "mistral": dict(sliding_window=WINDOW),
    "gpt_oss": dict(num_local_experts=4, sliding_window=WINDOW, num_hidden_layers=2, **MOE),
    "glm4_moe": dict(n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1,
                     first_k_dense_replace=1, **MOE),
    "deepseek_v3": dict(n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1,
                        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, head_dim=8, v_head_dim=16, num_key_value_heads=4, **MOE),
    "gemma2": dict(sliding_window=WINDOW, query_pre_attn_scalar=16),
    "gemma3_text": dict(sliding_window=WINDOW, num_hidden_layers=3, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128, num_hidden_layers=4,
                        attention_chunk_size=6, attn_temperature_tuning=False),
    "olmo2": {},
    "phi3": dict(sliding_window=WINDOW),
    "ernie4_5": {},
    "seed_oss": dict(attention_dropout=0.0),
    "apertus": {},
    "minimax_m2": dict(num_local_experts=4, **MOE),
}
INSTALLED = [t for t in TINY if t in causal_lm_types()]
# model_type -> (extra tiny keys, what the refusal names), on every release where the type exists
REFUSED = {
    "llama4_text": (dict(attn_temperature_tuning=True), "reads positions from the row index"),
}
# model_type -> what the refusal at resolve() names, on 4.x releases: qwen2_moe picks one of its own attention classes
# per implementation there (QWEN2MOE_ATTENTION_CLASSES), none dispatching through AttentionInterface
REFUSED_ON_4 = {"qwen2_moe": "holds no attention that dispatches through AttentionInterface"}
MAJOR = int(str(tfcompat.registry.versions.installed_transformers()).split(".")[0])
RESOLVE_REFUSED = REFUSED_ON_4 if MAJOR == 4 else {}
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0)


def tiny(model_type: str, impl: str = "eager", seed: int = 0, **extra: Any) -> torch.nn.Module:
    """A tiny random causal LM of ``model_type`` built from config (no download), eval mode, fp32."""
    names = importlib.import_module("transformers.models.auto.configuration_auto").CONFIG_MAPPING_NAMES
    config_cls = getattr(importlib.import_module("transformers"), names[model_type])
    config = config_cls(**{**BASE, **TINY[model_type], **extra})
    torch.manual_seed(seed)
    lm = getattr(importlib.import_module("transformers"),
                 importlib.import_module("transformers.models.auto.modeling_auto")
                 .MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    # .float(): some modules keep parameters in bf16 whatever the config says (apertus' XIELU on 4.57)
    return lm._from_config(config, attn_implementation=impl).float().eval()


def sequences(seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, BASE["vocab_size"], (1, n), generator=gen) for n in LENGTHS]


def packed(seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One row: ids ``(1, T)``, position ids ``(1, T)`` restarting at 0 per sequence."""
    return {"input_ids": torch.cat(seqs, 1), "position_ids": torch.cat([torch.arange(s.shape[1]) for s in seqs])[None]}


def rel_diff(got: torch.Tensor, expected: list[torch.Tensor]) -> float:
    """Max over tokens of the max abs difference at the token over the largest expected value of the row."""
    want = torch.cat(expected)
    return float((got - want).abs().max() / want.abs().max())


def test_written_tables_win():
    for key in families():
        assert key not in tfcompat.registry.derivable_types()
        assert tfcompat.resolve(key).entry.derived is None if key in causal_lm_types() else True


@pytest.mark.parametrize("model_type", [t for t in INSTALLED if t not in RESOLVE_REFUSED])
def test_resolve_and_explain_say_derived(model_type):
    r = tfcompat.resolve(model_type)
    assert r.entry.derived is not None and r.entry.rotary is None
    text = r.explain()
    assert "DERIVED" in text and r.entry.module in text and r.entry.derived.attention.describe() in text
    with pytest.raises(PatchError, match="no rotary convention"):
        r.apply_rotary  # noqa: B018


def test_unknown_type_is_unknown():
    with pytest.raises(UnknownFamilyError, match="unknown model family"):
        tfcompat.resolve("not_a_model_type")


@pytest.mark.parametrize("model_type", [t for t in INSTALLED if t in RESOLVE_REFUSED])
def test_refused_at_resolve(model_type):
    with pytest.raises(PatchError, match=RESOLVE_REFUSED[model_type]):
        tfcompat.resolve(model_type)
    with pytest.raises(PatchError, match=RESOLVE_REFUSED[model_type]):
        tfcompat.patch(tiny(model_type))


@pytest.mark.parametrize("model_type", [t for t in INSTALLED if t not in RESOLVE_REFUSED])
class TestPackedEqualsStock:
    """Rule: per token, packed patched == stock per sequence (eager and sdpa), forward and backward."""

    def test_forward_and_control(self, model_type):
        seqs = sequences()
        inputs = packed(seqs)
        for impl in ("eager", "sdpa"):
            model = tiny(model_type, impl)
            with torch.no_grad():
                expected = [model(input_ids=s).logits[0] for s in seqs]
                control = model(**inputs).logits[0]  # stock on the packed row: attends across sequences
                with tfcompat.patch(model) as handle:
                    got = model(**inputs).logits[0]
            assert any(r.attr == "_tfcompat_features" for r in handle.records)
            assert rel_diff(got, expected) <= 1e-5, impl
            assert rel_diff(control, expected) > 1e-3, impl

    def test_backward(self, model_type):
        model = tiny(model_type, "eager")
        seqs = sequences(seed=2)
        weight = torch.randn(BASE["vocab_size"], generator=torch.Generator().manual_seed(3))
        for s in seqs:
            (model(input_ids=s).logits[0] @ weight).sum().backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        with tfcompat.patch(model):
            (model(**packed(seqs)).logits[0] @ weight).sum().backward()
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert got.keys() == expected.keys()
        for name in got:
            scale = max(1.0, float(expected[name].abs().max()))
            diff = float((got[name] - expected[name]).abs().max())
            assert diff <= 1e-5 * scale, f"{name}: max abs diff {diff:.3e} (grad scale {scale:.2e})"


@pytest.mark.parametrize("model_type", [t for t in REFUSED if t in causal_lm_types()])
def test_refused_at_patch(model_type):
    extra, what = REFUSED[model_type]
    model = tiny(model_type, **extra)
    with pytest.raises(PatchError, match=what):
        tfcompat.patch(model)
    assert not tfcompat.is_patched(model)
