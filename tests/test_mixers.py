"""Token mixers without a packed kernel (Mamba, short convolutions, lightning attention) run per sequence.

Rule: on a packed row, a derived hybrid patched by tfcompat returns per token what the stock model returns on each
sequence alone, forward and backward (fp32, the tolerances of `tests.every_type`); the per-sequence forwards are
what makes it so (control: with the mixers' stock forwards back, the packed row differs); a mixer whose forward could
carry state across the per-sequence calls is refused at `patch()` naming the argument or attribute.
"""

from __future__ import annotations

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
from tfcompat.registry.mixers import mixer_call
from tfcompat.tiny_models import model_types

# a short convolution (lfm2), Mamba beside attention layers (jamba), lightning attention returning its state
# (minimax), Mamba-2 in blocks beside MLP-only blocks (nemotron_h)
TYPES = ("lfm2", "jamba", "minimax", "nemotron_h")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls (see tests/test_every_causal_lm.py)
    yield
    torch.set_num_threads(threads)


def _model(model_type: str) -> torch.nn.Module:
    """The tiny eager model of ``model_type``; skipped (naming why) where it does not exist or derives no mixer."""
    if model_type not in model_types("causal_lm"):
        pytest.skip(f"{model_type} is not a causal LM of this transformers")
    try:
        derived = tfcompat.resolve(model_type).entry.derived
    except PatchError as exc:  # refused on this release: tests/test_every_causal_lm.py checks the refusal is typed
        pytest.skip(f"{model_type} is refused on this transformers: {exc.what}")
    assert derived is not None and derived.mixers, f"{model_type} derives no per-sequence mixer"
    return build(model_type, "eager")


def _wrapped(model: torch.nn.Module, handle: tfcompat.PatchHandle) -> list[torch.nn.Module]:
    return [r.target for r in handle.records if r.attr == "forward" and r.note == hf_mixers.NOTE]


@pytest.mark.parametrize("model_type", TYPES)
def test_packed_equals_stock_per_sequence_forward_and_backward(model_type):
    model = _model(model_type)
    seqs = sample_sequences(model.config)
    with torch.no_grad():
        expected = stock_per_sequence(model, seqs)
    w = projection(expected[0].shape[-1])
    expected_grads = gradients(model, lambda: sum((o @ w).sum() for o in stock_per_sequence(model, seqs)))
    inputs = packed_inputs(seqs)
    with tfcompat.patch(model) as handle:
        assert _wrapped(model, handle), "no mixer runs per sequence: the test would not test it"
        with torch.no_grad():
            diff = compare(logits_of(model, **inputs), expected)
        grad_diff = compare_gradients(gradients(model, lambda: (logits_of(model, **inputs) @ w).sum()),
                                      expected_grads)
    assert diff <= TOLERANCE, diff
    assert grad_diff <= GRAD_TOLERANCE, grad_diff


@pytest.mark.parametrize("model_type", TYPES[:2])
def test_control_stock_mixers_on_the_packed_row_differ(model_type):
    """Non-vacuity: the attention still packed, the mixers' stock forwards back: state crosses the boundaries."""
    model = _model(model_type)
    seqs = sample_sequences(model.config)
    with torch.no_grad():
        expected = stock_per_sequence(model, seqs)
        with tfcompat.patch(model) as handle:
            for module in _wrapped(model, handle):
                del module.forward  # the class's stock forward over the whole row
            diff = compare(logits_of(model, **packed_inputs(seqs)), expected)
    assert diff > 10 * TOLERANCE, diff  # a short convolution leaks only into the first tokens of the next sequence


@pytest.mark.parametrize("model_type", ["lfm2", "mamba", "mamba2"])
def test_two_packed_rows_and_gradient_checkpointing(model_type):
    """Two rows of two sequences each; under non-reentrant checkpointing the recomputation finds the boundaries
    again (the decoder layer's pre-hook replays), also where the mixer gets a tensor the recompute makes anew
    (Mamba's: its block's norm output) and the text model passes its layers no context (the hook finds it by the
    layer's input)."""
    model = _model(model_type)
    diff, grads = two_rows_checkpointed(model)
    assert diff <= TOLERANCE and grads <= GRAD_TOLERANCE, (diff, grads)


def test_records_explain_and_undo():
    model = _model("lfm2")
    handle = tfcompat.patch(model)
    wrapped = _wrapped(model, handle)
    assert wrapped and all(type(m).__name__ == "Lfm2ShortConv" for m in wrapped)
    text = handle.explain()
    assert "Lfm2ShortConv.forward: runs per sequence on packed rows" in text
    assert "token mixers run per sequence on packed rows" in text
    handle.undo()
    assert not any("forward" in vars(m) or m._forward_pre_hooks for m in model.modules())


def test_ulysses_is_refused():
    model = _model("lfm2")
    resolved = tfcompat.registry.resolve_model(model)
    with pytest.raises(PatchError, match="Lfm2ShortConv cannot run sequence parallel"):
        hf_mixers.plan(model, resolved, group=object())  # any group: refused before it is used


def test_called_outside_the_patched_forward_is_an_error():
    model = _model("lfm2")
    with tfcompat.patch(model) as handle:
        conv = _wrapped(model, handle)[0]
        conv.__dict__.pop("_tfcompat_context", None)
        with pytest.raises(tfcompat.errors.PatchedModelError, match="got no packed boundaries"):
            conv(torch.zeros(1, 3, model.config.hidden_size))


def test_state_on_the_module_is_refused_at_patch():
    if "recurrent_gemma" not in model_types("causal_lm"):
        pytest.skip("recurrent_gemma is not a causal LM of this transformers")
    refusal = r"(?s)RecurrentGemmaRecurrentBlock cannot run per sequence.*writes self\.conv1d_state"
    with pytest.raises(PatchError, match=refusal):
        tfcompat.resolve("recurrent_gemma")


class _Unknown(torch.nn.Module):
    def forward(self, hidden_states: torch.Tensor, offset: int = 0) -> torch.Tensor:
        return hidden_states


class _Stateful(torch.nn.Module):
    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None) -> torch.Tensor:
        return self._step(hidden_states)

    def _step(self, x: torch.Tensor) -> torch.Tensor:
        self.last = x[:, -1]
        return x


class _Mutating(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(3))

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.state.add_(hidden_states.sum())
        return hidden_states


class _Plain(torch.nn.Module):
    def forward(self, x: torch.Tensor, cache: Any = None, cache_position: Any = None, seq_idx: Any = None,
                **kwargs: Any) -> torch.Tensor:
        return x


@pytest.mark.parametrize(("cls", "match"), [
    (_Unknown, "takes 'offset'"), (_Stateful, r"writes self\.last"), (_Mutating, r"writes self\.state\.add_"),
])
def test_mixer_call_refuses_what_could_carry_state(cls, match):
    with pytest.raises(ValueError, match=match):
        mixer_call(cls)


def test_mixer_call_roles():
    call = mixer_call(_Plain)
    assert call.params == (("x", "tokens"), ("cache", "state"), ("cache_position", "cache_position"),
                           ("seq_idx", "none"))
    assert call.takes_kwargs
