"""Text-only Qwen3.5 models (`Family.text_only`): ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` on the text config
alone (``config.model_type`` ``qwen3_5_text`` / ``qwen3_5_moe_text``), built from config or, as
``AutoModelForCausalLM.from_pretrained`` builds it, from a Qwen3.5 (vision-language) checkpoint. The oracle is the
stock model per sequence: the patched packed forward and every gradient equal it, per token.

Test ids start with the parent family's key, so the CI subset (tests/conftest.py) runs them with the parent's entries.
"""

from __future__ import annotations

import pytest
import torch

import tfcompat
from tests.helpers import max_token_diff, pack
from tfcompat.core.context import ForwardContext
from tfcompat.core.packing import from_lengths
from tfcompat.registry import families, family, installed_families, match, resolve_model
from tfcompat.selfcheck import sample_case, sample_sequences, stock_inputs, tiny_model

TEXT_ONLY = [(key, fam.text_only.key) for key, fam in sorted(installed_families().items()) if fam.text_only is not None]
IDS = [f"{parent}-{text}" for parent, text in TEXT_ONLY]
SOURCES = ["config", "checkpoint"]
pytestmark = pytest.mark.skipif(not TEXT_ONLY, reason="no family with a text-only model in this transformers "
                                "(Qwen3.5 from 5.2)")


def _model(parent: str, text: str, source: str, impl: str, tmp_path) -> torch.nn.Module:
    """A tiny text-only model: from its own config, or loaded by ``AutoModelForCausalLM`` from a saved tiny
    checkpoint of the parent (vision-language) family, as a user loads a Qwen3.5 checkpoint for text-only training."""
    if source == "config":
        return tiny_model(text, impl)
    from transformers import AutoModelForCausalLM

    tiny_model(parent, impl).save_pretrained(tmp_path)
    return AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation=impl).eval()


@pytest.mark.parametrize("parent", sorted(k for k, f in families().items() if f.text_only is not None))
def test_table_is_the_parent_text_half(parent):
    """Rule: on every release of the parent's table (each entry boundary of either table), the text-only entry takes
    the parent entry's text model as it is (module, text classes, rotary, cache kwarg, kwargs flow, Gated DeltaNet
    layout) and no vision half; both tables span the same releases. Version-independent: a table check."""
    fam = families()[parent]
    text = fam.text_only
    assert text.key == f"{parent}_text" and not text.is_vision and not text.sample_vision
    assert (text.entries[0].versions.low, text.entries[-1].versions.high) == (
        fam.entries[0].versions.low, fam.entries[-1].versions.high)
    roles = ("attention", "linear_attention", "rotary", "text_model", "decoder_layer")
    for version in sorted({e.versions.low for e in (*fam.entries, *text.entries)}):
        (p, _), (t, _) = match(parent, version), match(text.key, version)
        assert t.family == text.key and t.vision is None and "model" not in t.classes, version
        assert t.classes["for_causal_lm"].endswith("ForCausalLM"), version
        assert {r: t.classes[r] for r in roles} == {r: p.classes[r] for r in roles}, version
        same = ("module", "rotary", "rope_config_key", "text_model_positions", "layer_forwards_kwargs", "cache_kwarg",
                "linear_attention", "text_module")
        assert {f: getattr(t, f) for f in same} == {f: getattr(p, f) for f in same}, version


def test_found_by_its_key_with_a_did_you_mean():
    parent, text = TEXT_ONLY[0]
    assert family(text) is families()[parent].text_only
    with pytest.raises(tfcompat.UnknownFamilyError, match=f"did you mean {text!r}"):
        tfcompat.resolve(text.replace("_", "").upper())


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("parent,text", TEXT_ONLY, ids=IDS)
def test_resolves_as_its_own_text_only_family(parent, text, source, tmp_path):
    """Rule: a text-only model resolves by its ``config.model_type`` to the parent's text classes on this release,
    with its ``*ForCausalLM`` and no vision tower."""
    model = _model(parent, text, source, "sdpa", tmp_path)
    assert model.config.model_type == text
    r, p = resolve_model(model), tfcompat.resolve(parent)
    assert r.family == text and type(model) is r.classes["for_causal_lm"]
    assert all(r.classes[role] is p.classes[role] for role in ("attention", "linear_attention", "text_model"))
    assert r.entry.vision is None and not r.spec.is_vision
    assert isinstance(model.model, r.text_model_cls)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("parent,text", TEXT_ONLY, ids=IDS)
class TestPackedEqualsStock:
    """Rule: per token, the patched packed forward of a text-only model returns what the stock model returns per
    sequence (1e-5 of the logit scale), and so do every parameter's gradients; controls: the stock model on the same
    packed row, and the patched one told the row is one sequence, both leak across sequences."""

    def test_forward_and_controls(self, parent, text, source, impl, tmp_path):
        model = _model(parent, text, source, impl, tmp_path)
        r = tfcompat.resolve(text)
        seqs = sample_sequences(model, *sample_case(text), seed=1)
        inputs = pack(model, seqs)
        assert inputs["position_ids"].shape == inputs["input_ids"].shape  # (1, T): text-only position ids
        with torch.no_grad():
            expected = [model(**stock_inputs(r, model, s), use_cache=False).logits[0] for s in seqs]
            stock = model(**inputs, use_cache=False).logits[0]
            with tfcompat.patch(model):
                got = model(**inputs, use_cache=False).logits[0]
                one = ForwardContext(from_lengths([inputs["input_ids"].shape[1]]))
                leaked = model(**inputs, tfcompat_context=one, use_cache=False).logits[0]
        scale = float(torch.cat(expected).abs().max())
        assert max_token_diff(got, expected) <= 1e-5 * scale
        assert max_token_diff(stock, expected) > 1e-3
        assert max_token_diff(leaked, expected) > 1e-3

    def test_every_gradient(self, parent, text, source, impl, tmp_path):
        model = _model(parent, text, source, impl, tmp_path)
        r = tfcompat.resolve(text)
        seqs = sample_sequences(model, *sample_case(text), seed=2)
        weight = torch.randn(model.config.vocab_size, generator=torch.Generator().manual_seed(3))
        for s in seqs:  # stock: each sequence alone, gradients accumulate
            (model(**stock_inputs(r, model, s), use_cache=False).logits[0] @ weight).sum().backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        with tfcompat.patch(model):
            (model(**pack(model, seqs), use_cache=False).logits[0] @ weight).sum().backward()
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert got.keys() == expected.keys()
        assert any("linear_attn.A_log" in n for n in got) and any("self_attn.q_proj" in n for n in got)
        for name, g in got.items():
            ref = expected[name]
            diff = float((g - ref).abs().max())
            assert diff <= 1e-5 * max(1.0, float(ref.abs().max())), f"{name}: max abs diff {diff:.3e}"


@pytest.mark.parametrize("parent,text", TEXT_ONLY, ids=IDS)
@torch.no_grad()
def test_ordinary_calls_run_stock(parent, text):
    """Rule: on a patched text-only model, a padded batch and generate() (cache and all) return what they return
    unpatched (tfcompat.hf.forward sends them to the stock path)."""
    model = tiny_model(text, "sdpa")
    ids = torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    plain = model(input_ids=ids, attention_mask=mask).logits
    generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    with tfcompat.patch(model):
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, plain)
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False),
                           generated)
