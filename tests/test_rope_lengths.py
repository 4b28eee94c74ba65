"""Length-dependent ropes on packed rows (`tfcompat.hf.rope_lengths`, issue 26 item 3): dynamic and longrope rotate
by the longest position of the call, so a packed batch is answered per sequence where every sequence takes the
frequencies it takes alone, and refused otherwise (a typed error, not a wrong answer). Llama runs the packed core;
Falcon's decoder layers run per sequence (`tfcompat.hf.mixers`) on the rope its text model computes for the row."""

from __future__ import annotations

import copy

import pytest
import torch

import tfcompat
from tests.every_type import compare, packed_inputs, sample_sequences
from tfcompat.tiny_models import tiny_config, tiny_model

pytestmark = pytest.mark.broad  # a derived type (llama) with drawn rope settings, not a registry entry

ORIGINAL = 8  # sequences of 5 and 6 tokens are below it, of 12 and 10 past it


def _model(rope_type: str, model_type: str = "llama") -> torch.nn.Module:
    config = tiny_config(model_type)
    key = tfcompat.resolve(model_type).entry.rope_config_key  # rope_scaling (4.x, rope_theta beside it) or
    theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]  # rope_parameters (5.x)
    settings = {"rope_theta": theta} if key == "rope_parameters" else {}
    if rope_type == "longrope":
        half = (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads) // 2
        settings |= {"rope_type": "longrope", "short_factor": [1.0] * half,
                     "long_factor": [float(2 + i % 3) for i in range(half)],
                     "original_max_position_embeddings": ORIGINAL}
    else:
        settings |= {"rope_type": "dynamic", "factor": 4.0}
        config.max_position_embeddings = ORIGINAL
    values = {k: v for k, v in config.to_dict().items() if k not in ("transformers_version", "model_type")}
    if rope_type == "longrope" and key == "rope_scaling":  # 4.x reads the original length from the config itself
        values["original_max_position_embeddings"] = ORIGINAL
    # built anew, so that the config class standardizes and checks the rope settings as from a checkpoint
    return tiny_model(model_type, attn_implementation="sdpa", config=type(config)(**{**values, key: settings}))


def _per_sequence(model: torch.nn.Module, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each sequence alone on a fresh copy (dynamic rope caches the longest length it saw)."""
    return [copy.deepcopy(model)(input_ids=s[None], use_cache=False).logits[0] for s in seqs]


@pytest.mark.parametrize("model_type", ["llama", "falcon"])
@pytest.mark.parametrize(("rope_type", "lengths"), [
    ("longrope", (5, 6)), ("longrope", (12, 10)), ("dynamic", (5, 6)), ("dynamic", (12, 12))])
@torch.no_grad()
def test_answers_packed_rows_of_one_side_per_sequence(rope_type, lengths, model_type):
    """All at most the original length (either rope), all past it (longrope), or of one length (dynamic)."""
    model = _model(rope_type, model_type)
    seqs = sample_sequences(model.config, lengths=lengths)
    expected = _per_sequence(model, seqs)
    with tfcompat.patch(model):
        got = model(**packed_inputs(seqs), use_cache=False).logits[0]
    assert compare(got, expected) <= 1e-5


@pytest.mark.parametrize("model_type", ["llama", "falcon"])
@pytest.mark.parametrize("via", ["raw", "pack"])
@pytest.mark.parametrize(("rope_type", "lengths", "alone"), [
    ("longrope", (5, 12), "the one of 5 takes the short factors"),
    ("dynamic", (12, 10), "the one of 10 takes frequencies scaled for its own length")])
@torch.no_grad()
def test_refuses_packed_rows_whose_sequences_rotate_otherwise_alone(rope_type, lengths, alone, via, model_type,
                                                                    monkeypatch):
    """Sequences on both sides of the switch (longrope) or of several lengths past it (dynamic): a typed error naming
    the longest and the other, from a raw packed call and from tfcompat.pack's context alike. The control: without
    the check the patched row is not stock per sequence."""
    import tfcompat.hf.forward as forward

    model = _model(rope_type, model_type)
    seqs = sample_sequences(model.config, lengths=lengths)
    expected = _per_sequence(model, seqs)
    raw = packed_inputs(seqs)
    inputs = raw if via == "raw" else tfcompat.pack(model, [{"input_ids": s} for s in seqs]).model_inputs
    with monkeypatch.context() as m, tfcompat.patch(copy.deepcopy(model)) as handle:
        m.setattr(forward, "check_lengths", lambda *args: None)
        assert compare(handle.model(**raw, use_cache=False).logits[0], expected) > 1e-4
    with tfcompat.patch(model), pytest.raises(tfcompat.InvalidInputError, match=(
            rf"(?s)other {rope_type} rope frequencies alone.*family: {model_type}.*longest \({max(lengths)} "
            rf"positions\); alone, {alone}.*fix: pack sequences of one side of {ORIGINAL} positions")):
        model(**inputs, use_cache=False)


def test_the_proof_packs_lengths_each_rope_answers():
    """Rule: `answered_lengths` keeps lengths every rule answers packed, moves them past a longrope switch, and makes
    them one length past a dynamic one (the patch-time proof's sequences, `tfcompat.hf.proof`)."""
    from tfcompat.hf.rope_lengths import LengthRule, answered_lengths

    longrope, dynamic = LengthRule("longrope", 8), LengthRule("dynamic", 8)
    assert answered_lengths(set(), (7, 12, 5)) == (7, 12, 5)
    assert answered_lengths({LengthRule("longrope", 64)}, (7, 12, 5)) == (7, 12, 5)
    assert answered_lengths({longrope}, (7, 12, 5)) == (15, 20, 13)
    assert answered_lengths({dynamic}, (7, 12, 5)) == (20, 20, 20)
    assert answered_lengths({longrope, dynamic}, (7, 12, 5)) == (20, 20, 20)
