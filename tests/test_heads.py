"""PPO forward heads: backend "torch" (chunked, recomputing) against backend "logits" (the reference)."""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import assert_close
from tfcompat.errors import InvalidInputError
from tfcompat.heads import IGNORE_INDEX, LogprobsEntropy, _tiles, _torch, logprobs_entropy

SETTINGS = settings(max_examples=60, deadline=None)

# fp32: forward values to 1e-5; gradients to 1e-5 of their largest entry (each sums up to V or T terms)
FP32_TOL = 1e-5
# bf16: both backends round the logits the same way; the gradients round each tile's product to bf16
BF16_FORWARD_TOL = 1e-4
BF16_GRAD_TOL = 2e-2


class Case(NamedTuple):
    """Inputs of one call: hidden ``(*S, H)``, weight ``(V, H)``, bias ``(V,)`` or None, labels ``S``,
    temperature (float or tensor ``S``), and upstream gradients ``S`` for logprobs and entropy."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    labels: torch.Tensor
    temperature: float | torch.Tensor
    grad_logprobs: torch.Tensor
    grad_entropy: torch.Tensor


def make_case(
    shape: tuple[int, ...], vocab: int, hidden_size: int, *, seed: int, bias: bool = True,
    per_token_temperature: bool = True, ignored: float = 0.25, dtype: torch.dtype = torch.float32,
) -> Case:
    """Logits of order 1 (weight ~ N(0, 1/H)); temperatures in [0.25, 4]; a fraction of labels ignored."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) / math.sqrt(hidden_size)
    bias_values = torch.randn(vocab, generator=gen)
    labels = torch.randint(0, vocab, shape, generator=gen)
    labels[torch.rand(shape, generator=gen) < ignored] = IGNORE_INDEX
    if per_token_temperature:
        temperature = 0.25 + 3.75 * torch.rand(shape, generator=gen)
    else:
        temperature = float(0.25 + 3.75 * torch.rand((), generator=gen))
    return Case(
        hidden.to(dtype),
        weight.to(dtype),
        bias_values.to(dtype) if bias else None,
        labels,
        temperature,
        torch.randn(shape, generator=gen),
        torch.randn(shape, generator=gen),
    )


class Run(NamedTuple):
    """Outputs and the gradients of ``(a * logprobs).sum() + (b * entropy).sum()``; grad_bias is None
    without a bias."""

    out: LogprobsEntropy
    grad_hidden: torch.Tensor
    grad_weight: torch.Tensor
    grad_bias: torch.Tensor | None


def run(case: Case, backend: str, chunk_size: int = 1024, **transform: float | bool | None) -> Run:
    """transform: ``softcap``, ``logit_scale`` and ``keep_logits`` of `logprobs_entropy`, as given."""
    hidden = case.hidden.detach().requires_grad_()
    weight = case.weight.detach().requires_grad_()
    bias = None if case.bias is None else case.bias.detach().requires_grad_()
    out = logprobs_entropy(
        hidden, weight, case.labels, case.temperature, backend=backend, chunk_size=chunk_size, lm_head_bias=bias,
        **transform,
    )
    loss = (case.grad_logprobs * out.logprobs).sum() + (case.grad_entropy * out.entropy).sum()
    loss.backward()
    return Run(LogprobsEntropy(out.logprobs.detach(), out.entropy.detach()), hidden.grad, weight.grad,
               None if bias is None else bias.grad)


def term_bounds(case: Case) -> dict[str, torch.Tensor]:
    """Per gradient entry, the sum of the absolute values of the terms it sums (float64; no logit transform):
    ``|dZ| @ |W|``, ``|dZ|^T @ |h|``, ``|dZ|.sum(0)`` for the logits' gradient ``dZ (T, V)``. Rounding scales with
    these, not with the gradient: where the terms cancel (one hidden unit, a cold temperature), an entry far below the
    largest one still carries the rounding of its terms."""
    hidden = case.hidden.double().reshape(-1, case.hidden.shape[-1])  # (*S, H) -> (T, H)
    weight = case.weight.double()
    logits = hidden @ weight.T + (0 if case.bias is None else case.bias.double())  # (T, V)
    logits.requires_grad_()
    temperature = torch.as_tensor(case.temperature, dtype=torch.float64).reshape(-1, 1)  # (T, 1) or (1, 1)
    z = torch.log_softmax(logits / temperature, -1)
    labels = case.labels.reshape(-1)
    kept = labels != IGNORE_INDEX
    logprobs = z.gather(-1, labels.clamp_min(0)[:, None])[:, 0] * kept
    entropy = -(z.exp() * z).sum(-1)
    loss = (case.grad_logprobs.double().reshape(-1) * logprobs).sum() + (
        case.grad_entropy.double().reshape(-1) * entropy).sum()
    (dz,) = torch.autograd.grad(loss, logits)
    dz = dz.abs()
    shape = case.hidden.shape
    return {"grad_hidden": (dz @ weight.abs()).reshape(shape), "grad_weight": dz.T @ hidden.abs(),
            "grad_bias": dz.sum(0)}


def assert_runs_close(actual: Run, expected: Run, *, forward_tol: float, grad_tol: float,
                      case: Case | None = None) -> None:
    """Forward values to ``forward_tol`` (absolute and relative); gradients to ``grad_tol`` of their largest
    entry (at least 1), or per entry of the sum of its terms' magnitudes where ``case`` is given (`term_bounds`)."""
    for name in ("logprobs", "entropy"):
        assert_close(getattr(actual.out, name), getattr(expected.out, name), atol=forward_tol, rtol=forward_tol,
                     what=name)
    bounds = term_bounds(case) if case is not None else {}
    for name in ("grad_hidden", "grad_weight", "grad_bias"):
        got, want = getattr(actual, name), getattr(expected, name)
        if want is None:
            assert got is None, name
            continue
        scale = max(1.0, want.abs().max().item())
        if name in bounds:
            tolerance = grad_tol * bounds[name].float().clamp_min(scale)  # per entry
            worst = float(((got.float() - want.float()).abs() - tolerance).max())
            assert worst <= 0, f"{name}: over its rounding bound by {worst:.2e}"
            continue
        assert_close(got.float(), want.float(), atol=grad_tol * scale, what=name)


@st.composite
def chunked_cases(draw: st.DrawFn) -> tuple[Case, int]:
    """Flat or batched tokens, vocabularies on both sides of T, chunk sizes of 1, not dividing T, and >= T."""
    if draw(st.booleans()):
        shape = (draw(st.integers(1, 3)), draw(st.integers(1, 24)))
    else:
        shape = (draw(st.integers(1, 64)),)
    tokens = math.prod(shape)
    case = make_case(
        shape,
        vocab=draw(st.integers(2, 300)),
        hidden_size=draw(st.integers(1, 24)),
        seed=draw(st.integers(0, 2**31 - 1)),
        bias=draw(st.booleans()),
        per_token_temperature=draw(st.booleans()),
        ignored=draw(st.sampled_from([0.0, 0.3, 1.0])),
    )
    chunk_size = draw(st.one_of(st.just(1), st.integers(2, tokens + 2), st.integers(tokens, 4 * tokens)))
    return case, chunk_size


@pytest.fixture
def unaligned_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of any row and column count (the default rounds them up to multiples of 128), so that small
    cases are cut into many tiles."""
    monkeypatch.setattr(_tiles, "_ALIGN", 1)


@pytest.mark.usefixtures("unaligned_tiles")
class TestChunkedMatchesReference:
    """Backend "torch" computes what backend "logits" computes, values and gradients, at any chunking."""

    @SETTINGS
    @given(chunked_cases())
    def test_values_and_gradients(self, case_and_chunk: tuple[Case, int]) -> None:
        case, chunk_size = case_and_chunk
        assert_runs_close(run(case, "torch", chunk_size), run(case, "logits"), forward_tol=FP32_TOL,
                          grad_tol=FP32_TOL, case=case)

    @pytest.mark.parametrize(("tokens", "vocab"), [(40, 300), (300, 40)], ids=["walk-vocab", "walk-tokens"])
    def test_both_backward_walks(self, tokens: int, vocab: int) -> None:
        """Backward tiles along the vocabulary when T < V and along the tokens otherwise."""
        case = make_case((tokens,), vocab, 16, seed=tokens)
        assert_runs_close(run(case, "torch", chunk_size=7), run(case, "logits"), forward_tol=FP32_TOL,
                          grad_tol=FP32_TOL)

    def test_bf16_within_stated_tolerance(self) -> None:
        case = make_case((4, 48), 256, 32, seed=5, dtype=torch.bfloat16)
        chunked, reference = run(case, "torch", chunk_size=20), run(case, "logits")
        assert chunked.grad_hidden.dtype == chunked.grad_weight.dtype == chunked.grad_bias.dtype == torch.bfloat16
        assert_runs_close(chunked, reference, forward_tol=BF16_FORWARD_TOL, grad_tol=BF16_GRAD_TOL)

    @pytest.mark.parametrize("backend", ["torch", "logits"])
    def test_one_output_used(self, backend: str) -> None:
        """Only entropy in the loss: logprobs' upstream gradient is None, the gradients match the reference."""
        case = make_case((30,), 90, 8, seed=3)
        results = []
        for name in (backend, "logits"):
            hidden = case.hidden.clone().requires_grad_()
            logprobs_entropy(hidden, case.weight, case.labels, case.temperature, backend=name,
                             chunk_size=4).entropy.sum().backward()
            results.append(hidden.grad)
        assert_close(results[0], results[1], atol=FP32_TOL, what="grad_hidden")


class TestAlignedTiles:
    """Every tile's rows and columns are multiples of 128 (but the last along an axis), whatever T is: a tile's
    column count is the leading dimension of its matmuls, and unaligned ones run cuBLAS's slow align-1
    kernels. The results do not depend on the tiling."""

    VOCAB, HIDDEN = 1024, 8

    @pytest.mark.parametrize("tokens", [129, 300, 383, 1023, 1100])
    def test_tiles_aligned_and_results_unchanged(self, tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
        shapes: list[tuple[int, int, int]] = []  # (rows, first column, columns) of every tile

        def row_stats(logits, labels, temperature):
            shapes.append((logits.shape[0], 0, logits.shape[1]))
            return torch_row_stats(logits, labels, temperature)

        def grad_logits(logits, stats, labels, first_column):
            shapes.append((logits.shape[0], first_column, logits.shape[1]))
            return torch_grad_logits(logits, stats, labels, first_column)

        torch_row_stats, torch_grad_logits = _torch._torch_row_stats, _torch._torch_grad_logits
        monkeypatch.setattr(_torch, "_torch_row_stats", row_stats)
        monkeypatch.setattr(_torch, "_torch_grad_logits", grad_logits)
        case = make_case((tokens,), self.VOCAB, self.HIDDEN, seed=tokens, ignored=0.1)
        chunked = run(case, "torch", chunk_size=50)
        walk_vocab = tokens < self.VOCAB
        assert len(shapes) > 2
        for rows, first_column, columns in shapes:
            assert first_column % 128 == 0
            if walk_vocab and rows == tokens:  # a backward tile (T, C)
                assert columns % 128 == 0 or first_column + columns == self.VOCAB
            else:  # a forward chunk, or a backward tile along the tokens (R, V)
                assert columns == self.VOCAB and (rows % 128 == 0 or rows == tokens % 128)
        assert_runs_close(chunked, run(case, "logits"), forward_tol=FP32_TOL, grad_tol=FP32_TOL)


class TestContract:
    """Shapes, dtypes, ignored positions and the constant temperature, the same for both backends."""

    @pytest.mark.parametrize("backend", ["torch", "logits"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_float32_outputs_shaped_like_labels(self, backend: str, dtype: torch.dtype) -> None:
        case = make_case((2, 5), 40, 8, seed=0, dtype=dtype)
        out = logprobs_entropy(case.hidden, case.weight, case.labels, case.temperature, backend=backend,
                               lm_head_bias=case.bias)
        assert out.logprobs.shape == out.entropy.shape == (2, 5)
        assert out.logprobs.dtype == out.entropy.dtype == torch.float32

    @pytest.mark.parametrize("backend", ["torch", "logits"])
    def test_uniform_logits(self, backend: str) -> None:
        """A zero lm head gives the uniform distribution: logprob -log V and entropy log V at any temperature."""
        vocab = 37
        labels = torch.tensor([0, 5, 36, 12])
        out = logprobs_entropy(torch.randn(4, 8), torch.zeros(vocab, 8), labels, 0.3, backend=backend, chunk_size=3)
        assert_close(out.logprobs, torch.full((4,), -math.log(vocab)), atol=1e-6)
        assert_close(out.entropy, torch.full((4,), math.log(vocab)), atol=1e-6)

    @pytest.mark.parametrize("backend", ["torch", "logits"])
    def test_ignored_positions_are_zero_and_get_no_gradient(self, backend: str) -> None:
        case = make_case((24,), 60, 8, seed=1, ignored=0.5)
        ignored = case.labels == IGNORE_INDEX
        assert ignored.any() and not ignored.all()
        result = run(case, backend, chunk_size=5)
        assert (result.out.logprobs[ignored] == 0).all() and (result.out.entropy[ignored] == 0).all()
        assert (result.out.entropy[~ignored] > 0).all()
        assert (result.grad_hidden[ignored] == 0).all()
        assert (result.grad_hidden[~ignored] != 0).any(dim=-1).all()

    @pytest.mark.parametrize("backend", ["torch", "logits"])
    def test_temperature_gets_no_gradient(self, backend: str) -> None:
        case = make_case((12,), 30, 8, seed=2)
        temperature = case.temperature.clone().requires_grad_()
        hidden = case.hidden.clone().requires_grad_()
        out = logprobs_entropy(hidden, case.weight, case.labels, temperature, backend=backend)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        assert hidden.grad is not None and temperature.grad is None

    def test_frozen_weight(self) -> None:
        """Only hidden requires grad: no weight gradient is made, hidden's matches the reference."""
        case = make_case((20,), 50, 8, seed=4)
        grads = []
        for backend in ("torch", "logits"):
            hidden = case.hidden.clone().requires_grad_()
            weight = case.weight.clone()
            out = logprobs_entropy(hidden, weight, case.labels, case.temperature, backend=backend, chunk_size=6)
            (case.grad_logprobs * out.logprobs + case.grad_entropy * out.entropy).sum().backward()
            assert weight.grad is None
            grads.append(hidden.grad)
        assert_close(grads[0], grads[1], atol=FP32_TOL, what="grad_hidden")


# softcaps that bend logits of order 1 (weight ~ N(0, 1/H)) hard, somewhat, or hardly (gemma2 uses 30)
TRANSFORMS = st.fixed_dictionaries({"softcap": st.sampled_from([None, 0.5, 2.0, 30.0]),
                                    "logit_scale": st.sampled_from([1.0, 0.125, 3.0])})


def by_hand(case: Case, softcap: float | None, logit_scale: float) -> Run:
    """The model's own logits step by step, as gemma2/granite/cohere write them (divide by the cap, tanh, times
    the cap), then log_softmax and autograd: the oracle of the transform, written without tfcompat."""
    hidden, weight = case.hidden.detach().requires_grad_(), case.weight.detach().requires_grad_()
    bias = None if case.bias is None else case.bias.detach().requires_grad_()
    logits = torch.nn.functional.linear(hidden, weight, bias).float() * logit_scale  # (*S, V)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    tau = case.temperature.unsqueeze(-1) if isinstance(case.temperature, torch.Tensor) else case.temperature
    logp = torch.log_softmax(logits / tau, -1)  # (*S, V)
    valid = case.labels != IGNORE_INDEX
    logprobs = torch.where(valid, logp.gather(-1, case.labels.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    entropy = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    ((case.grad_logprobs * logprobs).sum() + (case.grad_entropy * entropy).sum()).backward()
    return Run(LogprobsEntropy(logprobs.detach(), entropy.detach()), hidden.grad, weight.grad,
               None if bias is None else bias.grad)


@pytest.mark.usefixtures("unaligned_tiles")
class TestSoftcapAndScale:
    """softcap c and logit_scale s: every backend computes log_softmax(c * tanh(s * x / c) / tau), values and
    gradients, as the model writes it."""

    @SETTINGS
    @given(chunked_cases(), TRANSFORMS)
    def test_reference_is_the_model_formula(self, case_and_chunk: tuple[Case, int], transform: dict) -> None:
        case, _ = case_and_chunk
        assert_runs_close(run(case, "logits", **transform), by_hand(case, **transform), forward_tol=FP32_TOL,
                          grad_tol=FP32_TOL)

    @SETTINGS
    @given(chunked_cases(), TRANSFORMS)
    def test_chunked_matches_reference(self, case_and_chunk: tuple[Case, int], transform: dict) -> None:
        case, chunk_size = case_and_chunk
        assert_runs_close(run(case, "torch", chunk_size, **transform), run(case, "logits", **transform),
                          forward_tol=FP32_TOL, grad_tol=FP32_TOL)

    @pytest.mark.parametrize(("tokens", "vocab"), [(40, 300), (300, 40)], ids=["walk-vocab", "walk-tokens"])
    def test_both_backward_walks(self, tokens: int, vocab: int) -> None:
        case = make_case((tokens,), vocab, 16, seed=tokens)
        transform = dict(softcap=1.5, logit_scale=2.0)
        assert_runs_close(run(case, "torch", 7, **transform), run(case, "logits", **transform),
                          forward_tol=FP32_TOL, grad_tol=FP32_TOL)

    @pytest.mark.parametrize("backend", ["torch", "logits"])
    def test_changes_the_result(self, backend: str) -> None:
        """Non-vacuity: a cap that bends the logits, or a scale, moves logprobs away from the plain ones."""
        case = make_case((30,), 90, 8, seed=3)
        plain = run(case, backend).out.logprobs
        for transform in (dict(softcap=1.0), dict(logit_scale=2.0)):
            assert (run(case, backend, **transform).out.logprobs - plain).abs().max() > 1e-2, transform

    def test_bf16_within_stated_tolerance(self) -> None:
        case = make_case((4, 48), 256, 32, seed=5, dtype=torch.bfloat16)
        transform = dict(softcap=2.0, logit_scale=0.5)
        assert_runs_close(run(case, "torch", 20, **transform), run(case, "logits", **transform),
                          forward_tol=BF16_FORWARD_TOL, grad_tol=BF16_GRAD_TOL)


class TestSavedForBackward:
    """Backend "torch" keeps no (T, V)-sized tensor alive between forward and backward."""

    TOKENS, VOCAB, HIDDEN, CHUNK = 64, 512, 16, 16

    def saved_numels(self, backend: str, keep_logits: bool = False) -> list[int]:
        case = make_case((self.TOKENS,), self.VOCAB, self.HIDDEN, seed=0)
        hidden = case.hidden.clone().requires_grad_()
        weight = case.weight.clone().requires_grad_()
        numels: list[int] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            numels.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = logprobs_entropy(hidden, weight, case.labels, case.temperature, backend=backend,
                                   chunk_size=self.CHUNK, keep_logits=keep_logits)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        assert hidden.grad is not None and weight.grad is not None
        return numels

    def test_chunked_saves_no_logits(self) -> None:
        numels = self.saved_numels("torch")
        assert numels and max(numels) < self.TOKENS * self.VOCAB

    def test_reference_saves_logits(self) -> None:
        """The detector sees (T, V) tensors where they are saved."""
        assert max(self.saved_numels("logits")) >= self.TOKENS * self.VOCAB


@pytest.mark.usefixtures("unaligned_tiles")
class TestKeptLogits:
    """``keep_logits=True``: the forward's (T, V) logits are kept and backward uses them (no recompute); values
    and gradients are the reference's, and one backward consumes them."""

    @pytest.mark.parametrize(
        ("shape", "vocab", "chunk_size", "transform"),
        [
            ((37,), 301, 5, {}),
            ((2, 19), 300, 7, {}),
            ((150,), 97, 32, {}),
            ((150,), 97, 1024, {}),
            ((40,), 300, 7, dict(softcap=1.5, logit_scale=2.0)),
            ((300,), 40, 7, dict(logit_scale=0.125)),
        ],
        ids=["few-tokens", "batched", "many-tokens", "one-chunk", "softcap", "scale"],
    )
    @pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
    def test_matches_reference(self, shape, vocab, chunk_size, transform, bias) -> None:
        case = make_case(shape, vocab, 12, seed=vocab + len(shape), bias=bias, ignored=0.3)
        assert_runs_close(run(case, "torch", chunk_size, keep_logits=True, **transform),
                          run(case, "logits", **transform), forward_tol=FP32_TOL, grad_tol=FP32_TOL)

    def test_bf16_within_stated_tolerance(self) -> None:
        case = make_case((4, 48), 256, 32, seed=5, dtype=torch.bfloat16)
        kept, reference = run(case, "torch", chunk_size=20, keep_logits=True), run(case, "logits")
        assert kept.grad_hidden.dtype == kept.grad_weight.dtype == kept.grad_bias.dtype == torch.bfloat16
        assert_runs_close(kept, reference, forward_tol=BF16_FORWARD_TOL, grad_tol=BF16_GRAD_TOL)

    def test_saves_the_logits(self) -> None:
        """The (T, V) logits are what is kept (`TestSavedForBackward`'s detector), where the default keeps none."""
        saved = TestSavedForBackward()
        tokens, vocab = saved.TOKENS, saved.VOCAB
        assert max(saved.saved_numels("torch", keep_logits=True)) == tokens * vocab
        assert max(saved.saved_numels("torch")) < tokens * vocab

    def test_frozen_weight_and_one_output(self) -> None:
        case = make_case((20,), 50, 8, seed=4)
        grads = []
        for keep_logits, backend in ((True, "torch"), (False, "logits")):
            hidden = case.hidden.clone().requires_grad_()
            weight = case.weight.clone()
            logprobs_entropy(hidden, weight, case.labels, case.temperature, backend=backend, chunk_size=6,
                             keep_logits=keep_logits).entropy.sum().backward()
            assert weight.grad is None
            grads.append(hidden.grad)
        assert_close(grads[0], grads[1], atol=FP32_TOL, what="grad_hidden")

    def test_model_logprobs_keeps_them(self) -> None:
        """`model_logprobs(keep_logits=True)` is the recomputing head's result, values and every gradient, and it
        holds the (T, V) logits between forward and backward (the detector of `TestSavedForBackward`)."""
        from tests.helpers import pack
        from tfcompat import heads
        from tfcompat.selfcheck import sample_sequences, tiny_model

        model = tiny_model("llama", "sdpa")
        inputs = pack(model, sample_sequences(model, [7, 10], [None, None], seed=3))
        labels = torch.roll(inputs["input_ids"], -1, dims=1)  # (1, T)
        labels[0, -1] = IGNORE_INDEX
        results = []
        for keep_logits in (False, True):
            model.zero_grad(set_to_none=True)
            shapes: list[tuple[int, ...]] = []

            def pack_hook(tensor: torch.Tensor, shapes: list[tuple[int, ...]] = shapes) -> torch.Tensor:
                shapes.append(tuple(tensor.shape))
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda tensor: tensor):
                out = heads.model_logprobs(model, labels, 0.7, backend="torch", keep_logits=keep_logits,
                                           use_cache=False, **inputs)
            (out.logprobs.sum() + out.entropy.sum()).backward()
            results.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
            assert ((labels.numel(), model.config.vocab_size) in shapes) == keep_logits
        (plain, plain_grads), (kept, kept_grads) = results
        assert_close(kept.logprobs, plain.logprobs, atol=FP32_TOL, what="logprobs")
        assert_close(kept.entropy, plain.entropy, atol=FP32_TOL, what="entropy")
        assert kept_grads.keys() == plain_grads.keys() and "lm_head.weight" in kept_grads
        for name, grad in plain_grads.items():
            assert_close(kept_grads[name], grad, atol=FP32_TOL * max(1.0, grad.abs().max().item()), what=name)

    def test_second_backward_raises(self) -> None:
        """The first backward wrote the gradient over the kept logits: a second one through the same graph
        would read gradients as logits, so it raises; without keep_logits it runs (and doubles the gradient)."""
        case = make_case((16,), 40, 8, seed=6)
        for keep_logits in (False, True):
            hidden = case.hidden.clone().requires_grad_()
            out = logprobs_entropy(hidden, case.weight, case.labels, case.temperature, backend="torch",
                                   keep_logits=keep_logits)
            loss = (case.grad_logprobs * out.logprobs).sum()
            loss.backward(retain_graph=True)
            once = hidden.grad.clone()
            if keep_logits:
                with pytest.raises(InvalidInputError, match=r"(?s)one backward per forward.*keep_logits=False"):
                    loss.backward()
            else:
                loss.backward()
                assert_close(hidden.grad, 2 * once, atol=FP32_TOL, what="grad_hidden")


def valid_inputs() -> dict:
    return dict(hidden=torch.randn(4, 8), lm_head_weight=torch.randn(10, 8), labels=torch.tensor([1, 2, -100, 9]))


class TestInvalidInput:
    """Bad inputs raise InvalidInputError naming what was passed."""

    @pytest.mark.parametrize(
        ("change", "match"),
        [
            (dict(backend="fused"), r"unknown logprobs/entropy backend 'fused'"),
            (dict(keep_logits=1), r"(?s)keep_logits must be a bool.*got 1"),
            (dict(chunk_size=0), r"(?s)chunk_size must be a positive int or None.*got 0"),
            (dict(chunk_size=True), r"(?s)chunk_size must be a positive int.*got True"),
            (dict(hidden=torch.randn(4, 6)), r"hidden \(4, 6\) vs lm_head_weight \(10, 8\)"),
            (dict(hidden=torch.randn(8)), r"hidden must be a floating \(T, H\) or \(B, L, H\)"),
            (dict(hidden=torch.randn(4, 8).double()), r"hidden torch.float64 .* vs lm_head_weight torch.float32"),
            (dict(labels=torch.tensor([1, 2, 3])), r"hidden \(4, 8\) on cpu vs labels \(3,\) on cpu"),
            (dict(labels=torch.tensor([1.0, 2.0, 3.0, 4.0])), r"labels must be integer token ids"),
            (dict(labels=torch.tensor([1, 10, -100, -5])), r"(?s)token ids in \[0, 10\) or -100.*got \[10, -5\]"),
            (dict(lm_head_bias=torch.randn(9)), r"lm_head_bias \(9,\)"),
            (dict(temperature=0.0), r"(?s)temperature must be finite and > 0.*got 0.0"),
            (dict(temperature=float("nan")), r"temperature must be finite and > 0"),
            (dict(temperature="hot"), r"(?s)temperature must be a float or a per-token tensor.*got str 'hot'"),
            (dict(temperature=torch.ones(4, dtype=torch.long)), r"(?s)temperature tensor must be floating.*int64"),
            (dict(temperature=torch.ones(3)), r"temperature \(3,\) on cpu vs labels \(4,\) on cpu"),
            (dict(temperature=torch.tensor(1.0)), r"temperature \(\) on cpu vs labels \(4,\)"),
            (dict(temperature=torch.tensor([1.0, 0.5, -0.1, 2.0])), r"(?s)every per-token temperature.*got \[-0.1"),
            (dict(temperature=torch.tensor([1.0, math.nan, 1.0, 1.0])), r"(?s)every per-token temperature.*\[nan\]"),
            (dict(softcap=0.0), r"(?s)softcap must be a finite float > 0.*got 0.0"),
            (dict(softcap=math.inf), r"(?s)softcap must be a finite float > 0.*got inf"),
            (dict(softcap=True), r"(?s)softcap must be a finite float > 0.*got True"),
            (dict(logit_scale=None), r"(?s)logit_scale must be a finite float > 0.*got None"),
            (dict(logit_scale=-1.0), r"(?s)logit_scale must be a finite float > 0.*got -1.0"),
            (dict(hidden=torch.randn(0, 8), labels=torch.zeros(0, dtype=torch.long)),
             r"(?s)hidden must hold at least one token.*got shape \(0, 8\)"),
            (dict(hidden=torch.randn(1, 0, 8), labels=torch.zeros(1, 0, dtype=torch.long)),
             r"(?s)at least one token.*\(1, 0, 8\)"),
        ],
    )
    def test_rejected(self, change: dict, match: str) -> None:
        with pytest.raises(InvalidInputError, match=match):
            logprobs_entropy(**{**valid_inputs(), **change})

    def test_batched_labels_must_match(self) -> None:
        inputs = valid_inputs()
        with pytest.raises(InvalidInputError, match=r"hidden \(2, 3, 8\) on cpu vs labels \(2, 2\)"):
            logprobs_entropy(torch.randn(2, 3, 8), inputs["lm_head_weight"], torch.zeros(2, 2, dtype=torch.long))

    def test_is_a_value_error(self) -> None:
        with pytest.raises(ValueError):
            logprobs_entropy(**valid_inputs(), backend="fused")
