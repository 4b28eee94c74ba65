"""heads.model_logprobs: a (patched) model returns log-probs and entropy instead of logits."""

from __future__ import annotations

import types

import pytest
import torch

import tfcompat
from tests.helpers import pack
from tfcompat import heads
from tfcompat.selfcheck import sample_sequences, tiny_model

TRITON_USABLE = heads._has_triton() and (torch.cuda.is_available() or heads._triton_interpreted())
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(
        not TRITON_USABLE, reason="backend 'triton' needs triton, and CUDA or TRITON_INTERPRET=1 (nox -s triton)")),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["qwen2_vl", "llama"])
def test_patched_model_logprobs_equal_the_logits_path(family, backend):
    model = tiny_model(family, "sdpa")
    items = [None, (1, 4, 6)] if family == "qwen2_vl" else [None, None]
    inputs = pack(model, sample_sequences(model, [7, 10], items, seed=3))
    labels = torch.roll(inputs["input_ids"], -1, dims=1)
    labels[0, -1] = -100
    if backend == "triton" and not heads._triton_interpreted():  # compiled kernels: on the GPU
        model = model.cuda()
        inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        labels = labels.cuda()
    with tfcompat.patch(model):
        got = tfcompat.heads.model_logprobs(model, labels, 0.7, backend=backend, chunk_size=5, use_cache=False,
                                             **inputs)
        logits = model(**inputs, use_cache=False).logits.float() / 0.7
    logp = torch.log_softmax(logits, -1)
    keep = labels != -100
    expected = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    assert got.logprobs.shape == labels.shape and got.logprobs.dtype == torch.float32
    torch.testing.assert_close(got.logprobs[keep], expected[keep], atol=1e-5, rtol=0)
    torch.testing.assert_close(got.entropy[keep], entropy[keep], atol=1e-5, rtol=0)
    assert float(got.logprobs[~keep].abs().max()) == 0.0


# ------------------------------------------------------------------ what the forward applies to the head's output

# each type's transform, set so that it bends the tiny model's logits (of order 1) hard enough to tell
TRANSFORMED = {
    "gemma2": lambda m: setattr(m.config, "final_logit_softcapping", 0.5),  # c * tanh(x / c)
    "gemma3_text": lambda m: setattr(m.config, "final_logit_softcapping", 0.5),
    "granite": lambda m: setattr(m.config, "logits_scaling", 0.25),  # x / 0.25
    "cohere": lambda m: setattr(m, "logit_scale", 4.0),  # x * 4 (read from the config at build time)
}
TRANSFORMED_BACKENDS = ["logits", *BACKENDS]


def own_and_head(model_type: str, backend: str, transform: bool = True):
    """The model's own logits' log-probs and entropy (fp32), and model_logprobs', with the gradients of the same
    loss with respect to every parameter."""
    from tfcompat.tiny_models import tiny_model as tiny_from_config

    model = tiny_from_config(model_type, attn_implementation="eager")
    if transform:
        TRANSFORMED[model_type](model)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    weights = torch.randn(2, 2, 9, generator=gen)
    params = [p for p in model.parameters() if p.requires_grad]
    logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float() / 0.7, -1)  # (B, L, V)
    keep = labels != -100
    own = (torch.where(keep, logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0], 0.0),
           torch.where(keep, -(logp.exp() * logp).sum(-1), 0.0))
    own_grads = torch.autograd.grad((weights[0] * own[0] + weights[1] * own[1]).sum(), params, allow_unused=True)
    got = tfcompat.heads.model_logprobs(model, labels, 0.7, backend=backend, chunk_size=5, input_ids=ids,
                                        use_cache=False)
    got_grads = torch.autograd.grad((weights[0] * got.logprobs + weights[1] * got.entropy).sum(), params,
                                    allow_unused=True)
    return own, got, own_grads, got_grads, model


@pytest.mark.parametrize("backend", TRANSFORMED_BACKENDS)
@pytest.mark.parametrize("model_type", sorted(TRANSFORMED))
def test_model_logprobs_equal_the_models_own_logits(model_type, backend):
    """Final-logit softcap (gemma2, gemma3_text) and logit scales (granite divides, cohere multiplies): the
    head's log-probs and entropy are those of the model's own logits, and so are the gradients of every
    parameter (fp32, 1e-5)."""
    if backend == "triton" and not heads._triton_interpreted():
        pytest.skip("compiled Triton needs the model on CUDA; this test runs the interpreter (nox -s triton)")
    own, got, own_grads, got_grads, _ = own_and_head(model_type, backend)
    torch.testing.assert_close(got.logprobs, own[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.entropy, own[1], atol=1e-5, rtol=1e-5)
    for want, have in zip(own_grads, got_grads, strict=True):
        if want is None:
            assert have is None
            continue
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(have, want, atol=1e-5 * scale, rtol=1e-5)


@pytest.mark.parametrize("model_type", sorted(TRANSFORMED))
def test_the_transform_is_not_vacuous(model_type):
    """Control: the plain head on the same hidden states is far from the model's own log-probs."""
    own, _, _, _, model = own_and_head(model_type, "logits")
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=gen)  # own_and_head's ids
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    plain = heads.logprobs_entropy(hidden, model.lm_head.weight, labels, 0.7, backend="logits")
    assert (plain.logprobs - own[0]).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [("gemma2", lambda c: (c.final_logit_softcapping, 1.0)), ("granite", lambda c: (None, 1.0 / c.logits_scaling)),
     ("cohere", lambda c: (None, c.logit_scale)), ("llama", lambda c: (None, 1.0))],
    ids=["gemma2", "granite", "cohere", "llama"],
)
def test_final_logits_read_from_the_config(model_type, expected):
    """Each config's defaults, as its forward reads them: gemma2 caps, granite divides, cohere multiplies, llama
    does nothing; the backbone is ``model.model``."""
    from tfcompat.tiny_models import tiny_model as tiny_from_config

    model = tiny_from_config(model_type, attn_implementation="eager")
    assert heads.final_logits(model) == (*expected(model.config), "model")


class _Head(torch.nn.Module):
    """A causal LM's outline: a backbone, an nn.Linear lm head; subclasses write the forward under test."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Identity()
        self.lm_head = torch.nn.Linear(4, 8)
        self.norm = torch.nn.Identity()
        self.config = types.SimpleNamespace(model_type="outline", cap=2.0, scaling=4.0, none=None)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head


class _Walrus(_Head):
    def forward(self, hidden_states, labels=None):
        hidden_states = self.model(hidden_states)
        logits = self.lm_head(hidden_states[:, -3:, :]).float() / self.config.scaling
        if (cap := getattr(self.config, "cap", None)) is not None:
            logits = torch.tanh(logits / cap) * cap
        if self.config.none is not None:
            logits = logits * 100.0
        loss = None
        if labels is not None:
            logits = logits.float()
            loss = logits.sum()
        return loss, logits


class _Masked(_Head):
    def forward(self, hidden_states):
        hidden_states = self.model(hidden_states)
        logits = self.lm_head(hidden_states)
        logits[..., 0] = -1e9
        return logits


class _NormedHidden(_Head):
    def forward(self, hidden_states):
        hidden_states = self.norm(self.model(hidden_states))
        logits = self.lm_head(hidden_states)
        return logits


class _ModuleOnLogits(_Head):
    def forward(self, hidden_states):
        hidden_states = self.model(hidden_states)
        logits = self.lm_head(hidden_states)
        logits = self.norm(logits)
        return logits


class _Branch(_Head):
    def forward(self, hidden_states):
        hidden_states = self.model(hidden_states)
        if self.config.cap:
            return self.lm_head(hidden_states)
        return None


class _TwoTanh(_Head):
    def forward(self, hidden_states):
        hidden_states = self.model(hidden_states)
        logits = torch.tanh(torch.tanh(self.lm_head(hidden_states)))
        return logits


class TestFinalLogits:
    """What final_logits reads from a forward: values through getattr / get_text_config-like paths, walrus and
    ``is not None`` blocks, casts in the loss branch; everything else refused, the statement quoted."""

    def test_reads_scale_then_cap(self) -> None:
        # logits = 2 * tanh((x / 4) / 2): softcap 2 with the scale 1/4 inside it; the None block does nothing
        assert heads.final_logits(_Walrus()) == (2.0, 0.25, "model")

    def test_equals_the_forward(self) -> None:
        model = _Walrus()
        hidden = torch.randn(1, 3, 4)
        applied = heads.final_logits(model)
        labels = torch.tensor([[1, 7, 3]])
        got = heads.logprobs_entropy(hidden, model.lm_head.weight, labels, backend="logits",
                                     lm_head_bias=model.lm_head.bias, softcap=applied.softcap,
                                     logit_scale=applied.logit_scale)
        expected = torch.log_softmax(model(hidden)[1], -1).gather(-1, labels[..., None])[..., 0]
        torch.testing.assert_close(got.logprobs, expected)

    @pytest.mark.parametrize(("cls", "match"), [
        (_Masked, r"logits\[\.\.\., 0\] = -1000000000\.0"),
        (_NormedHidden, r"runs \['norm', 'model'\] submodule\(s\) before the lm head"),
        (_ModuleOnLogits, r"logits = self\.norm\(logits\)"),
        (_Branch, r"has `if self\.config\.cap: return self\.lm_head\(hidden_states\)`"),
        (_TwoTanh, r"applies tanh twice"),
    ], ids=["masked-columns", "module-on-hidden", "module-on-logits", "branch", "two-tanh"])
    def test_refused(self, cls: type[_Head], match: str) -> None:
        with pytest.raises(tfcompat.InvalidInputError, match=f"(?s)cannot compute the logits of {cls.__name__}.*"
                           f"{match}") as info:
            heads.model_logprobs(cls(), torch.zeros(1, 3, dtype=torch.long), hidden_states=torch.randn(1, 3, 4))
        assert info.value.family == "outline" and info.value.fix

    def test_refuses_a_head_that_is_not_the_output_embeddings(self) -> None:
        model = _Walrus()
        model.get_output_embeddings = lambda: None  # type: ignore[method-assign]
        with pytest.raises(tfcompat.InvalidInputError, match="not the nn.Linear of get_output_embeddings"):
            heads.final_logits(model)

    def test_refuses_a_non_number_scale(self) -> None:
        model = _Walrus()
        model.config.scaling = "4"
        with pytest.raises(tfcompat.InvalidInputError, match=r"scaled by '4' \(self\.config\.scaling\)"):
            heads.final_logits(model)
