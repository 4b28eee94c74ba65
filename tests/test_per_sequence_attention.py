"""Attention the packed core cannot express runs per sequence: the decoder layers, with the model's own attention.

Rule: on a packed row, a derived family whose attention dispatches through no ``AttentionInterface`` (GPT-Neo,
Bloom's ALiBi, MVP), passes what the core does not implement (DeepSeek-V3.2's sparse indexer), or that has no
attention at all (Mamba: the boundaries come from position ids it does not take) returns per token what the stock
model returns on each sequence alone, forward and backward (fp32, the tolerances of `tests.every_type`), against the
eager and sdpa references; control: with the layers' stock forwards back, the packed row differs; under Ulysses,
and for a layer argument whose role cannot be proved, `patch()` / `resolve()` refuse, naming it.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

import tfcompat
from tests.every_type import (
    GRAD_TOLERANCE,
    TOLERANCE,
    build,
    compare,
    compare_gradients,
    gradients,
    logits_of,
    packed_inputs,
    projection,
    sample_sequences,
    stock_per_sequence,
    two_rows_checkpointed,
)
from tfcompat.errors import PatchError
from tfcompat.hf import mixers as hf_mixers
from tfcompat.registry.mixers import layer_call
from tfcompat.tiny_models import attention_implementations, model_types

pytestmark = pytest.mark.broad  # derived families: CI runs them on its newest release (tests/conftest.py)
MAJOR = int(str(tfcompat.registry.versions.installed_transformers()).split(".")[0])

# no AttentionInterface (absolute positions), ALiBi, a sparse indexer, no attention and no position ids, learned
# positions its decoder counts over the row (handed the row's own)
TYPES = ("gpt_neo", "bloom", "deepseek_v32", "mamba", "mvp")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls (see tests/test_every_causal_lm.py)
    yield
    torch.set_num_threads(threads)


def _model(model_type: str, impl: str = "eager") -> torch.nn.Module:
    if model_type not in model_types("causal_lm"):
        pytest.skip(f"{model_type} is not a causal LM of this transformers")
    if impl not in attention_implementations(model_type):
        pytest.skip(f"{model_type} offers no {impl} attention")
    try:
        tfcompat.resolve(model_type)
        model = build(model_type, impl)
        tfcompat.patch(model).undo()
    except PatchError as exc:  # refused on this release: tests/test_every_causal_lm.py checks the refusal is typed
        pytest.skip(f"{model_type} is refused on this transformers: {exc.what}")
    return model


def _per_sequence(handle: tfcompat.PatchHandle) -> list[torch.nn.Module]:
    return [r.target for r in handle.records if r.attr == "forward" and r.note.startswith((hf_mixers.NOTE,
                                                                                          hf_mixers.LAYER_NOTE))]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", TYPES)
def test_packed_equals_stock_per_sequence_forward_and_backward(model_type, impl):
    model = _model(model_type, impl)
    seqs = sample_sequences(model.config)
    with torch.no_grad():
        expected = stock_per_sequence(model, seqs)
    w = projection(expected[0].shape[-1])
    expected_grads = gradients(model, lambda: sum((o @ w).sum() for o in stock_per_sequence(model, seqs)))
    inputs = packed_inputs(seqs)
    with tfcompat.patch(model) as handle:
        assert _per_sequence(handle), "nothing runs per sequence: the test would not test it"
        with torch.no_grad():
            diff = compare(logits_of(model, **inputs), expected)
        grad_diff = compare_gradients(gradients(model, lambda: (logits_of(model, **inputs) @ w).sum()),
                                      expected_grads)
    assert diff <= TOLERANCE, diff
    assert grad_diff <= GRAD_TOLERANCE, grad_diff


@pytest.mark.parametrize("model_type", TYPES[1:])  # GPT-Neo on 5.x: its stock mask finds the packed sequences
def test_control_stock_layers_on_the_packed_row_differ(model_type):
    """Non-vacuity: the layers' stock forwards back over the whole row (the stock mask spans it)."""
    model = _model(model_type)
    seqs = sample_sequences(model.config)
    with torch.no_grad():
        expected = stock_per_sequence(model, seqs)
        with tfcompat.patch(model) as handle:
            for module in _per_sequence(handle):
                del module.forward
            diff = compare(logits_of(model, **packed_inputs(seqs)), expected)
    assert diff > 10 * TOLERANCE, diff


def test_two_rows_and_gradient_checkpointing():
    """Two rows of two sequences each; under non-reentrant checkpointing the recomputation finds the boundaries in
    the layer's kwargs again."""
    model = _model("gpt_neo")
    diff, grads = two_rows_checkpointed(model)
    assert diff <= TOLERANCE and grads <= GRAD_TOLERANCE, (diff, grads)


def test_records_explain_and_undo():
    model = _model("bloom")
    handle = tfcompat.patch(model)
    layers = _per_sequence(handle)
    assert layers and all(type(m).__name__ == "BloomBlock" for m in layers)
    text = handle.explain()
    assert "BloomBlock.forward: runs per sequence on packed rows with the model's own attention" in text
    assert "a Python loop over the row's sequences per layer" in text and "no varlen kernel" in text
    assert model.config._attn_implementation == "eager"  # the model's own attention and masks, not tfcompat's key
    handle.undo()
    assert not any("forward" in vars(m) for m in model.modules())


def test_ulysses_is_refused():
    model = _model("gpt_neo")
    resolved = tfcompat.registry.resolve_model(model)
    with pytest.raises(PatchError, match="GPTNeoBlock cannot run sequence parallel"):
        hf_mixers.plan_layers(model, resolved, object(), "test")  # any group: refused before it is used


def test_an_argument_whose_role_cannot_be_proved_is_refused():
    if "xlnet" not in model_types("causal_lm"):
        pytest.skip("xlnet is not a causal LM of this transformers")
    with pytest.raises(PatchError, match=r"(?s)nor can its decoder layers run per sequence.*'output_g'"):
        tfcompat.resolve("xlnet")  # its query stream, which tfcompat cannot prove per token


class _Layer(torch.nn.Module):
    def forward(self, hidden_states: torch.Tensor, alibi: torch.Tensor, attention_mask: torch.Tensor,
                head_mask: Any = None, offset: int = 0) -> torch.Tensor:
        return hidden_states


def test_layer_call_roles_and_refusal():
    with pytest.raises(ValueError, match="takes 'offset'"):
        layer_call(_Layer)


def test_alibi_cut_per_sequence_is_the_sequences_own_up_to_a_constant_per_row():
    """Bloom's ALiBi ``slope * j`` over the row, cut at a sequence's keys and re-based, is ``slope * (j - start)``:
    the sequence's own; softmax of scores plus either is the same (a constant per query row)."""
    slopes = torch.tensor([0.5, 0.25])[:, None, None]  # (H, 1, 1)
    row = slopes * torch.arange(20.0)  # (H, 1, L): one row, B = 1
    at = hf_mixers._Span(1, 20, 7, 20, torch.device("cpu"), 1)
    cut = hf_mixers._key_bias(row, at, "alibi")
    torch.testing.assert_close(cut, slopes * torch.arange(13.0), rtol=0, atol=1e-6)
    scores = torch.randn(2, 13, 13)
    torch.testing.assert_close(torch.softmax(scores + cut, -1), torch.softmax(scores + row[..., 7:], -1))
    mpt = torch.randn(2, 1, 64)  # MPT's, built for max_seq_len: no dim of the row's length, unchanged
    assert hf_mixers._key_bias(mpt, at, "position_bias") is mpt


def test_mask_of_the_row_cut_to_its_diagonal_block():
    causal = torch.ones(20, 20).tril().bool()[None, None]  # (1, 1, L, L)
    at = hf_mixers._Span(1, 20, 7, 20, torch.device("cpu"), 1)
    assert torch.equal(hf_mixers._block(causal, at, "attention_mask"), torch.ones(13, 13).tril().bool()[None, None])
    with pytest.raises(tfcompat.errors.InvalidInputError, match="is not a mask over the packed row"):
        hf_mixers._block(torch.ones(1, 1, 20, 13), at, "attention_mask")


def test_positions_counted_over_the_row_without_position_ids_are_refused():
    """TrOCR's decoder takes no position ids: its learned positions module takes the row's own (tested with the other
    types in tests/test_every_causal_lm.py), its sinusoidal one counts them over the row and takes none: refused at
    patch(); CPM-Ant's segment positions, at resolve()."""
    if "trocr" not in model_types("causal_lm"):
        pytest.skip("trocr is not a causal LM of this transformers")
    model = _model("trocr")
    config = model.config
    config.use_learned_position_embeddings = False
    sinusoidal = type(model)(config)
    with pytest.raises(PatchError, match=r"TrOCRDecoder\.embed_positions counts positions over the row"):
        tfcompat.patch(sinusoidal)
    with pytest.raises(PatchError, match="CpmAntModel.forward builds CpmAntSegmentPositionEmbedding"):
        tfcompat.resolve("cpmant")

@pytest.mark.parametrize("model_type", ["bloom", "mamba"])
def test_an_ordinary_call_runs_stock(model_type):
    """No position ids: the stock forward over the row, as unpatched (the layers' per-sequence forwards step aside)."""
    model = _model(model_type)
    ids = torch.cat(sample_sequences(model.config))[None]
    with torch.no_grad():
        expected = logits_of(model, input_ids=ids)
        with tfcompat.patch(model) as handle:
            assert _per_sequence(handle)
            got = logits_of(model, input_ids=ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_table_at_the_row_index_takes_its_first_rows():
    """RoFormer's sinusoidal positions, counted over the packed row: a sequence takes the rows of 0, 1, ..."""
    table = torch.randn(1, 1, 20, 8)  # (1, 1, L, D)
    at = hf_mixers._Span(1, 20, 7, 20, torch.device("cpu"), 1)
    assert torch.equal(hf_mixers._slice("sinusoidal_pos", "row_prefix", table, at), table[..., :13, :])


def test_checkpoint_keep_is_refused():
    model = _model("gpt_neo")
    with pytest.raises(PatchError, match="checkpoint_keep where the decoder layers run per sequence"):
        tfcompat.patch(model, checkpoint_keep="attention")
    assert not tfcompat.is_patched(model)


@pytest.mark.skipif(MAJOR < 5, reason="BERT-style attention dispatches through AttentionInterface from 5.0")
def test_a_layer_the_core_refuses_runs_per_sequence():
    """BERT as an encoder (is_decoder=False: not causal, which the packed core refuses): at patch() its decoder
    layers run per sequence instead, and the packed row equals stock per sequence (attending both ways within each)."""
    from tfcompat.tiny_models import tiny_config

    config = tiny_config("bert")
    config.is_decoder = False
    torch.manual_seed(0)
    model = importlib.import_module("transformers").BertLMHeadModel(config).eval()
    seqs = sample_sequences(model.config)
    with torch.no_grad():
        expected = stock_per_sequence(model, seqs)
        with tfcompat.patch(model) as handle:
            assert _per_sequence(handle) and "is not causal" in handle.explain()
            diff = compare(logits_of(model, **packed_inputs(seqs)), expected)
    assert diff <= TOLERANCE, diff
