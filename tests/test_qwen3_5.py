"""Hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): Gated DeltaNet layers through tfcompat's packed path.

The oracle is stock transformers per sequence, on the same tiny random model (one Gated DeltaNet layer, then one
gated-attention layer). `tests/test_packed.py` runs these families too (its watched gradients are the attention
and embedding ones); here every parameter's gradient is compared, linear-attention and MoE ones included, and the
failure modes of a hybrid model are checked at `patch()`.
"""

from __future__ import annotations

import pytest
import torch

import tfcompat
from tests.helpers import max_token_diff, pack
from tfcompat.core import _linear_kernels
from tfcompat.core.context import BRIDGE_ATTR, ForwardContext
from tfcompat.core.packing import from_lengths
from tfcompat.registry import installed_families
from tfcompat.selfcheck import sample_case, sample_sequences, stock_inputs, tiny_model

HYBRID = sorted(k for k, f in installed_families().items() if any(e.linear_attention for e in f.entries))
pytestmark = pytest.mark.skipif(not HYBRID, reason="no hybrid family in this transformers (Qwen3-Next from 4.57)")


def _linear_modules(model: torch.nn.Module, family: str) -> list[torch.nn.Module]:
    cls = tfcompat.resolve(family).classes["linear_attention"]
    return [m for m in model.modules() if isinstance(m, cls)]


def _per_sequence(family: str, model, seqs, weight):
    """Stock logits ``(L_i, V)`` per sequence, and every parameter's gradient of ``sum(logits @ weight)``."""
    r = tfcompat.resolve(family)
    logits = []
    for s in seqs:
        out = model(**stock_inputs(r, model, s), use_cache=False).logits[0]
        (out @ weight).sum().backward()
        logits.append(out.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits, grads


def _sample_case(family: str):
    """The family's packed sample (text, images, a video), without the video where the stock forward rejects it."""
    lengths, items = sample_case(family)
    if "videos_rejected" in tfcompat.resolve(family).entry.known_issues:  # the stock oracle cannot run them here
        items = [None if item and item[0] == "video" else item for item in items]
    return lengths, items


@pytest.fixture(params=HYBRID)
def case(request):
    """(family, tiny model, the family's packed sample (`_sample_case`), a readout vector over the vocabulary)."""
    family = request.param
    model = tiny_model(family, "sdpa")
    seqs = sample_sequences(model, *_sample_case(family), seed=1)
    weight = torch.randn(model.config.get_text_config().vocab_size, generator=torch.Generator().manual_seed(3))
    return family, model, seqs, weight


class TestPackedEqualsPerSequence:
    """Rule: per token, the patched packed forward and backward equal the stock forward of each sequence alone,
    to 1e-5 of the logit (gradient) scale, every parameter included."""

    def test_forward_and_every_gradient(self, case):
        family, model, seqs, weight = case
        expected, expected_grads = _per_sequence(family, model, seqs, weight)
        with tfcompat.patch(model):
            got = model(**pack(model, seqs), use_cache=False).logits[0]
            (got @ weight).sum().backward()
        scale = float(torch.cat(expected).abs().max())  # the logit scale (about 0.6 on these tiny models)
        assert max_token_diff(got.detach(), expected) <= 1e-5 * scale
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads.keys() == expected_grads.keys()
        assert any("linear_attn.conv1d" in n for n in grads) and any("linear_attn.A_log" in n for n in grads)
        for name, g in grads.items():
            ref = expected_grads[name]
            gscale = max(1.0, float(ref.abs().max()))
            assert float((g - ref).abs().max()) <= 1e-5 * gscale, name

    @pytest.mark.broad  # a control of stock, not of an entry
    def test_stock_packed_leaks_across_sequences(self, case):
        """What transformers does alone on the same packed row (position ids given, use_cache=False): the first
        sequence matches, later ones take the previous sequences' conv window and recurrent state. Handed the
        flattening collator's ``cu_seq_lens_*``/``seq_idx``, releases before 5.20 ignore them (same leak) and
        later ones raise without causal-conv1d. If this starts to pass, transformers packs on its own."""
        family, model, seqs, weight = case
        expected, _ = _per_sequence(family, model, seqs, weight)
        inputs = pack(model, seqs)
        with torch.no_grad():
            stock = model(**inputs, use_cache=False).logits[0]
        first = expected[0].shape[0]
        assert float((stock[:first] - expected[0]).abs().max()) <= 1e-5
        assert max_token_diff(stock[first:], expected[1:]) > 1e-3
        lengths = torch.tensor([e.shape[0] for e in expected])
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
        longest = int(lengths.max())
        flat = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest,
                    seq_idx=torch.repeat_interleave(torch.arange(len(expected), dtype=torch.int32), lengths)[None])
        try:
            with torch.no_grad():
                flattened = model(**inputs, **flat, use_cache=False).logits[0]
        except ValueError as exc:
            assert "causal_conv1d" in str(exc)
        else:
            assert max_token_diff(flattened[first:], expected[1:]) > 1e-3

    def test_boundaries_matter(self, case):
        """Control: told the row is one sequence, the patched forward leaks too; so the comparison above can
        tell right boundaries from wrong ones."""
        family, model, seqs, weight = case
        expected, _ = _per_sequence(family, model, seqs, weight)
        inputs = pack(model, seqs)
        inputs["tfcompat_context"] = ForwardContext(from_lengths([inputs["input_ids"].shape[1]]))
        with tfcompat.patch(model), torch.no_grad():
            got = model(**inputs, use_cache=False).logits[0]
        assert max_token_diff(got, expected) > 1e-3

    def test_a_cache_changes_nothing(self, case):
        """The config's use_cache default gives the same logits (a packed row is whole sequences, no cache is
        built); asking for a cache on a packed row is refused (tests/test_ordinary_calls.py)."""
        family, model, seqs, _ = case
        inputs = pack(model, seqs)
        with tfcompat.patch(model), torch.no_grad():
            plain = model(**inputs, use_cache=False).logits
            default = model(**inputs)
            assert default.past_key_values is None
            with pytest.raises(tfcompat.InvalidInputError, match="cannot build a KV cache"):
                model(**inputs, use_cache=True)
        assert torch.equal(plain, default.logits)


class TestPatch:
    """Rule: patch() replaces every linear-attention forward (and, where the decoder layer drops kwargs, bridges
    the context), undo() restores the identical objects, and what cannot apply fails at patch() time."""

    def test_lifecycle(self, case):
        family, model, seqs, _ = case
        linear = _linear_modules(model, family)
        layer_cls = tfcompat.resolve(family).decoder_layer_cls
        assert linear
        with tfcompat.patch(model) as handle:
            assert all("forward" in vars(m) for m in linear)
            assert "Gated DeltaNet" in handle.explain()
            with torch.no_grad():
                model(**pack(model, seqs), use_cache=False)
        assert not any("forward" in vars(m) or BRIDGE_ATTR in vars(m) for m in linear)
        assert not any(layer._forward_pre_hooks for layer in model.modules() if isinstance(layer, layer_cls))

    def test_layer_outside_the_patched_forward(self, case):
        family, model, _, _ = case
        module = _linear_modules(model, family)[0]
        with tfcompat.patch(model), pytest.raises(tfcompat.PatchedModelError, match="without packed boundaries"):
            module(torch.zeros(1, 3, model.config.get_text_config().hidden_size))

    def test_unknown_mixer(self, case):
        """A decoder layer whose mixer tfcompat does not pack is named, with its layer type."""
        family, model, _, _ = case
        layer = next(m for m in model.modules() if isinstance(m, tfcompat.resolve(family).decoder_layer_cls))
        layer.linear_attn = torch.nn.Identity()
        with pytest.raises(tfcompat.PatchError, match=r"decoder layer 0 \(layer type 'linear_attention'\)") as info:
            tfcompat.patch(model)
        assert "Identity" in str(info.value) and "GatedDeltaNet" in str(info.value)
        assert info.value.family == family
        assert not tfcompat.is_patched(model)

    def test_unknown_linear_backend(self, case):
        family, model, _, _ = case
        with pytest.raises(tfcompat.PatchError, match="unknown linear-attention backend 'bogus'"):
            tfcompat.patch(model, linear_backend="bogus")

    @pytest.mark.skipif(_linear_kernels.fla_rule() is not None, reason="flash-linear-attention is installed here")
    def test_fla_requested_without_fla(self, case):
        family, model, _, _ = case
        with pytest.raises(tfcompat.PatchError, match="flash-linear-attention is not installed") as info:
            tfcompat.patch(model, linear_backend="fla")
        assert "GatedDeltaNet" in str(info.value)
        assert not tfcompat.is_patched(model)

    def test_torch_backend_equals_auto(self, case):
        family, model, seqs, _ = case
        inputs = pack(model, seqs)
        outs = []
        for backend in ("auto", "torch"):
            with tfcompat.patch(model, linear_backend=backend), torch.no_grad():
                outs.append(model(**inputs, use_cache=False).logits)
        assert torch.equal(*outs)


# a tiny hybrid model without softmax-attention layers, as users build for small experiments: every layer_types entry
# linear, or no layer_types and a full_attention_interval beyond the 2 layers (the config derives all-linear types)
ALL_LINEAR = {"layer_types": dict(layer_types=["linear_attention", "linear_attention"]),
              "interval": dict(layer_types=None, full_attention_interval=4)}


@pytest.mark.broad  # a config variant of the per-entry tests above
@pytest.mark.parametrize("config", list(ALL_LINEAR))
@pytest.mark.parametrize("family", HYBRID)
class TestAllLinear:
    """Rule: a hybrid model whose layers are all linear attention patches (its Gated DeltaNet layers still need the
    packed core), and per token its packed forward and every gradient equal the stock forward of each sequence alone;
    control: told the row is one sequence, the patched forward leaks."""

    def test_packed_equals_per_sequence(self, family, config):
        model = tiny_model(family, "sdpa", **ALL_LINEAR[config])
        r = tfcompat.resolve(family)
        assert model.config.get_text_config().layer_types == ["linear_attention", "linear_attention"]
        assert not any(isinstance(m, r.attention_cls) for m in model.modules())
        assert len(_linear_modules(model, family)) == 2
        seqs = sample_sequences(model, *_sample_case(family), seed=1)
        weight = torch.randn(model.config.get_text_config().vocab_size, generator=torch.Generator().manual_seed(3))
        expected, expected_grads = _per_sequence(family, model, seqs, weight)
        inputs = pack(model, seqs)
        one = ForwardContext(from_lengths([inputs["input_ids"].shape[1]]))
        with tfcompat.patch(model):
            got = model(**inputs, use_cache=False).logits[0]
            (got @ weight).sum().backward()
            with torch.no_grad():
                leaked = model(**inputs, tfcompat_context=one, use_cache=False).logits[0]
        scale = float(torch.cat(expected).abs().max())
        assert max_token_diff(got.detach(), expected) <= 1e-5 * scale
        assert max_token_diff(leaked, expected) > 1e-3
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads.keys() == expected_grads.keys() and any("linear_attn.conv1d" in n for n in grads)
        for name, g in grads.items():
            ref = expected_grads[name]
            assert float((g - ref).abs().max()) <= 1e-5 * max(1.0, float(ref.abs().max())), name


@pytest.mark.parametrize("family", ["qwen3", *HYBRID])
def test_no_mixer_at_all_is_refused(family):
    """Rule: a model with neither softmax- nor linear-attention modules (dense here: qwen3) has nothing to pack and is
    refused at patch() with a PatchError saying what it found; nothing is changed."""
    model = tiny_model(family, "sdpa")
    r = tfcompat.resolve(family)
    mixers = tuple(c for c in (r.attention_cls, r.classes.get("linear_attention")) if c is not None)
    for layer in [m for m in model.modules() if isinstance(m, r.decoder_layer_cls)]:
        for name, child in list(layer.named_children()):
            if isinstance(child, mixers):
                setattr(layer, name, torch.nn.Identity())
    with pytest.raises(tfcompat.PatchError, match=f"cannot patch {type(model).__name__}") as info:
        tfcompat.patch(model)
    names = " or ".join(c.__name__ for c in mixers)
    assert f"found 1 {r.text_model_cls.__name__} and 0 {names}" in str(info.value)
    assert info.value.family == family and not tfcompat.is_patched(model)
