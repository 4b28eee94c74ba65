"""Families whose text model follows the text config (`Family.text_variants`): GLM-4.6V with a GLM-4.5V MoE text
config. The patched packed forward equals the stock model per sequence, per token, forward and backward."""

from __future__ import annotations

import pytest
import torch

import tfcompat
from tests.helpers import max_token_diff, packed_inputs
from tfcompat.core.context import ForwardContext
from tfcompat.core.packing import from_lengths
from tfcompat.registry import installed_families, resolve_model
from tfcompat.selfcheck import sample_case, sample_sequences, stock_inputs, tiny_model

# (family, text config model_type) -> the text-config keys of a tiny model of that variant
VARIANTS = {
    ("glm46v", "glm4v_moe_text"): dict(model_type="glm4v_moe_text", n_routed_experts=4, num_experts_per_tok=2,
                                       n_group=2, topk_group=1, moe_intermediate_size=32, n_shared_experts=1,
                                       first_k_dense_replace=1),
}
CASES = [(f, t) for f, t in VARIANTS if f in installed_families()]
IDS = [f"{f}-{t}" for f, t in CASES]


def _model(family, text_type, impl):
    return tiny_model(family, impl, **VARIANTS[family, text_type])


def test_every_declared_variant_is_tested():
    declared = {(k, t) for k, f in installed_families().items() for t, _ in f.text_variants}
    assert declared <= VARIANTS.keys(), sorted(declared - VARIANTS.keys())


@pytest.mark.parametrize("family,text_type", CASES, ids=IDS)
def test_text_half_comes_from_the_listed_family(family, text_type):
    model = _model(family, text_type, "sdpa")
    r = resolve_model(model)
    other = tfcompat.resolve(dict(r.spec.text_variants)[text_type])
    assert r.text_model_cls is other.text_model_cls and r.attention_cls is other.attention_cls
    assert r.classes["model"] is tfcompat.resolve(family).classes["model"]
    assert isinstance(model.model.language_model, r.text_model_cls)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family,text_type", CASES, ids=IDS)
class TestPackedEqualsStock:
    """Rule: per token, the patched packed forward of the variant returns what the stock model returns per sequence;
    control: told the row is one sequence, it does not."""

    @torch.no_grad()
    def test_forward_and_control(self, family, text_type, impl):
        model = _model(family, text_type, impl)
        r = tfcompat.resolve(family)
        seqs = sample_sequences(model, *sample_case(family), seed=1)
        expected = [model(**stock_inputs(r, model, s), use_cache=False).logits[0] for s in seqs]
        inputs = packed_inputs(model, seqs)
        with tfcompat.patch(model, remove_padding=True):
            got = model(**inputs, use_cache=False).logits[0]
            one = ForwardContext(from_lengths([inputs["position_ids"].shape[-1]]))
            leaked = model(**inputs, tfcompat_context=one, use_cache=False).logits[0]
        assert max_token_diff(got, expected) <= 1e-5
        assert max_token_diff(leaked, expected) > 1e-3

    def test_backward(self, family, text_type, impl):
        model = _model(family, text_type, impl)
        r = tfcompat.resolve(family)
        seqs = sample_sequences(model, *sample_case(family), seed=2)
        weight = torch.randn(model.config.get_text_config().vocab_size, generator=torch.Generator().manual_seed(3))
        for s in seqs:
            (model(**stock_inputs(r, model, s), use_cache=False).logits[0] @ weight).sum().backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        with tfcompat.patch(model, remove_padding=True):
            (model(**packed_inputs(model, seqs), use_cache=False).logits[0] @ weight).sum().backward()
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert got.keys() == expected.keys()
        assert any("experts" in n for n in got) and any("visual" in n for n in got)
        for name in got:
            scale = max(1.0, float(expected[name].abs().max()))
            diff = float((got[name] - expected[name]).abs().max())
            assert diff <= 1e-5 * scale, f"{name}: max abs diff {diff:.3e} (grad scale {scale:.2e})"
