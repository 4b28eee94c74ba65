"""heads.fused_loss: a per-token loss whose gradients the head computes in its forward, against the reference
(backend "logits": the full logits, differentiated by autograd) and against `logprobs_entropy` followed by the same
loss outside the head."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import assert_close
from tests.test_heads import BF16_FORWARD_TOL, BF16_GRAD_TOL, FP32_TOL, Case, make_case
from tfcompat import heads
from tfcompat.errors import InvalidInputError
from tfcompat.heads import IGNORE_INDEX, FusedLoss, _fused_loss, _tiles, fused_loss, logprobs_entropy

SETTINGS = settings(max_examples=50, deadline=None)


def ppo(lp: torch.Tensor, ent: torch.Tensor, adv: torch.Tensor, old: torch.Tensor, ref: torch.Tensor,
        weight: torch.Tensor, clip: float) -> torch.Tensor:
    """A PPO token loss as verl writes it: clipped ratio, entropy bonus, low-variance KL to a reference policy,
    a per-token weight (a mean's 1 / count)."""
    ratio = torch.exp(lp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip))
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    return (pg - 0.01 * ent + 0.1 * kl) * weight


def ppo_args(case: Case, seed: int) -> tuple[Any, ...]:
    """advantages, old and reference log-probs near the policy's (so that the clip bites both ways), weights."""
    gen = torch.Generator().manual_seed(seed)
    shape = case.labels.shape
    with torch.no_grad():
        lp = logprobs_entropy(case.hidden.float(), case.weight.float(), case.labels, case.temperature,
                              backend="logits", lm_head_bias=None if case.bias is None else case.bias.float()).logprobs
    old = lp + 0.3 * torch.randn(shape, generator=gen)
    ref = lp + 0.3 * torch.randn(shape, generator=gen)
    weight = torch.rand(shape, generator=gen) / max(1, int((case.labels != IGNORE_INDEX).sum()))
    return torch.randn(shape, generator=gen), old, ref, weight, 0.2


class Result:
    """The loss, the metrics and the gradients of ``upstream * loss``."""

    def __init__(self, case: Case, args: tuple[Any, ...], backend: str, upstream: float = 1.0,
                 **options: Any) -> None:
        hidden = case.hidden.detach().requires_grad_()
        weight = case.weight.detach().requires_grad_()
        bias = None if case.bias is None else case.bias.detach().requires_grad_()
        if backend == "outside":  # logprobs_entropy, then the loss by hand: an oracle that shares no code path
            options.pop("chunk_size", None)
            out = logprobs_entropy(hidden, weight, case.labels, case.temperature, backend="logits", lm_head_bias=bias,
                                   **options)
            valid = case.labels != IGNORE_INDEX
            loss = torch.where(valid, ppo(out.logprobs, out.entropy, *args), 0.0).sum()
            self.out = FusedLoss(loss, out.logprobs, out.entropy)
        else:
            self.out = fused_loss(hidden, weight, case.labels, ppo, *args, temperature=case.temperature,
                                  backend=backend, lm_head_bias=bias, **options)
        (upstream * self.out.loss).backward()
        self.grads = {"hidden": hidden.grad, "weight": weight.grad, "bias": None if bias is None else bias.grad}

    def assert_close_to(self, other: Result, forward_tol: float, grad_tol: float,
                        bounds: dict[str, torch.Tensor] | None = None) -> None:
        """Values to ``forward_tol``; gradients to ``grad_tol`` of their largest entry, or per entry of the sum of
        its terms' magnitudes where ``bounds`` are given (`term_bounds`: rounding scales with those)."""
        assert_close(self.out.loss.detach(), other.out.loss.detach(), atol=forward_tol,
                     rtol=forward_tol, what="loss")
        for name in ("logprobs", "entropy"):
            assert_close(getattr(self.out, name).detach(), getattr(other.out, name).detach(), atol=forward_tol,
                         rtol=forward_tol, what=name)
        for name, want in other.grads.items():
            got = self.grads[name]
            if want is None:
                assert got is None, name
                continue
            assert got.dtype == want.dtype, name
            scale = max(1e-3, want.abs().max().item())  # the loss is a weighted mean: gradients of order 1e-2
            if bounds is None:
                assert_close(got.float(), want.float(), atol=grad_tol * scale, what=f"grad_{name}")
                continue
            tolerance = grad_tol * bounds[name].float().clamp_min(scale)
            worst = float(((got.float() - want.float()).abs() - tolerance).max())
            assert worst <= 0, f"grad_{name}: over its rounding bound by {worst:.2e}"


def term_bounds(case: Case, args: tuple[Any, ...], upstream: float, softcap: float | None = None,
                logit_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Per gradient entry, the sum of the magnitudes of the terms it sums (float64): ``|dX| @ |W|``, ``|dX|^T @ |h|``,
    ``|dX|.sum(0)`` for the gradient ``dX (T, V)`` of ``upstream * loss`` with respect to the lm head's output."""
    hidden = case.hidden.double().reshape(-1, case.hidden.shape[-1])
    weight = case.weight.double()
    x = (hidden @ weight.T + (0 if case.bias is None else case.bias.double())).requires_grad_()  # (T, V)
    z = x * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z / torch.as_tensor(case.temperature, dtype=torch.float64).reshape(-1, 1), -1)
    labels = case.labels.reshape(-1)
    valid = labels != IGNORE_INDEX
    lp = torch.where(valid, logp.gather(-1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    flat = [a.double().reshape(-1) if isinstance(a, torch.Tensor) else a for a in args]
    loss = upstream * torch.where(valid, ppo(lp, ent, *flat), 0.0).sum()
    (dx,) = torch.autograd.grad(loss, x)
    dx = dx.abs()
    return {"hidden": (dx @ weight.abs()).reshape(case.hidden.shape), "weight": dx.T @ hidden.abs(),
            "bias": dx.sum(0)}


@pytest.fixture
def unaligned_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of any token count (the default rounds them up to multiples of 128)."""
    monkeypatch.setattr(_tiles, "_ALIGN", 1)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Case, int, dict[str, Any]]:
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 20))) if draw(st.booleans()) else (draw(st.integers(1, 60)),)
    case = make_case(shape, vocab=draw(st.integers(2, 200)), hidden_size=draw(st.integers(1, 16)),
                     seed=draw(st.integers(0, 2**31 - 1)), bias=draw(st.booleans()),
                     per_token_temperature=draw(st.booleans()), ignored=draw(st.sampled_from([0.0, 0.3, 1.0])))
    tokens = math.prod(shape)
    transform = draw(st.sampled_from([{}, {"softcap": 2.0, "logit_scale": 1.5}, {"logit_scale": 0.5}]))
    return case, draw(st.one_of(st.just(1), st.integers(2, tokens + 2))), transform


@pytest.mark.usefixtures("unaligned_tiles")
class TestMatchesReference:
    @SETTINGS
    @given(cases(), st.sampled_from([1.0, 1 / 3, -2.0]))
    def test_values_and_gradients_at_any_blocks(self, drawn: tuple[Case, int, dict[str, Any]], upstream: float):
        """Blocks of 1 token to all of them, softcap and scale, per-token temperatures, ignored labels, an upstream
        gradient other than 1: the reference's loss, metrics and gradients (fp32)."""
        case, chunk_size, transform = drawn
        args = ppo_args(case, seed=chunk_size)
        got = Result(case, args, "torch", upstream, chunk_size=chunk_size, **transform)
        got.assert_close_to(Result(case, args, "logits", upstream, **transform), FP32_TOL, FP32_TOL,
                            term_bounds(case, args, upstream, **transform))

    @pytest.mark.parametrize("chunk_size", [4, 1000], ids=["many-blocks", "one-block"])
    def test_equals_logprobs_entropy_then_the_loss(self, chunk_size: int) -> None:
        case = make_case((3, 17), 150, 12, seed=11, ignored=0.2)
        args = ppo_args(case, seed=1)
        got = Result(case, args, "torch", chunk_size=chunk_size)
        got.assert_close_to(Result(case, args, "outside"), FP32_TOL, FP32_TOL)

    def test_bf16_within_stated_tolerance(self) -> None:
        case = make_case((4, 48), 256, 32, seed=5, dtype=torch.bfloat16)
        args = ppo_args(case, seed=2)
        got = Result(case, args, "torch", chunk_size=20)
        assert got.grads["hidden"].dtype == got.grads["weight"].dtype == torch.bfloat16
        got.assert_close_to(Result(case, args, "logits"), BF16_FORWARD_TOL, BF16_GRAD_TOL)

    def test_upstream_scale_is_not_rounded_to_bf16(self) -> None:
        """backward multiplies the kept bf16 gradients by 1/3 in float32: within one rounding of the float32 product."""
        case = make_case((40,), 64, 16, seed=3, dtype=torch.bfloat16)
        args = ppo_args(case, seed=3)
        one, third = Result(case, args, "torch", 1.0, chunk_size=8), Result(case, args, "torch", 1 / 3, chunk_size=8)
        for name, grad in one.grads.items():
            exact = (grad.float() / 3).to(torch.bfloat16)
            assert torch.equal(third.grads[name], exact), name

    def test_ignored_tokens_add_nothing(self) -> None:
        """token_loss sees 0 at ignored tokens and their terms are left out: a loss that is 1 per token counts the
        labelled ones, and their hidden states get no gradient."""
        case = make_case((30,), 40, 8, seed=4, ignored=0.5)
        hidden = case.hidden.clone().requires_grad_()
        out = fused_loss(hidden, case.weight, case.labels, lambda lp, ent: 1.0 + 0.0 * lp + (lp - lp.detach()),
                         chunk_size=7)
        out.loss.backward()
        ignored = case.labels == IGNORE_INDEX
        assert out.loss.item() == float((~ignored).sum())
        assert (out.logprobs[ignored] == 0).all() and (out.entropy[ignored] == 0).all()
        assert (hidden.grad[ignored] == 0).all() and (hidden.grad[~ignored] != 0).any(-1).all()

    def test_a_loss_reading_neither_value(self) -> None:
        case = make_case((12,), 30, 8, seed=5, ignored=0.0)
        hidden = case.hidden.clone().requires_grad_()
        out = fused_loss(hidden, case.weight, case.labels, lambda lp, ent, w: w, torch.full((12,), 0.5), chunk_size=5)
        out.loss.backward()
        assert out.loss.item() == 6.0 and (hidden.grad == 0).all()

    def test_frozen_weight(self) -> None:
        case = make_case((20,), 50, 8, seed=6)
        grads = []
        for backend in ("torch", "logits"):
            hidden = case.hidden.clone().requires_grad_()
            weight = case.weight.clone()
            fused_loss(hidden, weight, case.labels, lambda lp, ent: -lp - 0.1 * ent, backend=backend,
                       chunk_size=6).loss.backward()
            assert weight.grad is None
            grads.append(hidden.grad)
        assert_close(grads[0], grads[1], atol=FP32_TOL, what="grad_hidden")


class _Matmuls(TorchDispatchMode):
    """Counts the matmuls with an operand that has the vocabulary as a dimension (the lm head's)."""

    MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default,
               torch.ops.aten.addmm.out, torch.ops.aten.addmm_.default)

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.count = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.MATMULS:
            self.count += any(isinstance(a, torch.Tensor) and self.vocab in a.shape for a in args)
        return func(*args, **(kwargs or {}))


def test_three_lm_head_matmuls_per_block_none_in_backward() -> None:
    """The point of the head: per block the logits, grad_hidden and grad_weight, all in the forward; the
    backward only scales (logprobs_entropy recomputes the logits there: a fourth matmul per tile)."""
    case = make_case((600,), 256, 16, seed=7, bias=False)
    hidden, weight = case.hidden.clone().requires_grad_(), case.weight.clone().requires_grad_()
    with _Matmuls(weight.shape[0]) as forward:
        out = fused_loss(hidden, weight, case.labels, lambda lp, ent: -lp, chunk_size=128)
    with _Matmuls(weight.shape[0]) as backward:
        out.loss.backward()
    assert (forward.count, backward.count) == (3 * 5, 0)  # 600 tokens in blocks of 128
    with _Matmuls(weight.shape[0]) as recomputing:
        logprobs_entropy(hidden, weight, case.labels, chunk_size=128).logprobs.sum().backward()
    assert recomputing.count == 4 * 5  # the control: the counter sees the recomputing head's fourth matmul


class TestContract:
    def test_metrics_carry_no_gradient(self) -> None:
        case = make_case((10,), 20, 4, seed=8)
        hidden = case.hidden.clone().requires_grad_()
        out = fused_loss(hidden, case.weight, case.labels, lambda lp, ent: -lp)
        with pytest.raises(InvalidInputError, match="carry no gradient"):
            (out.loss + out.entropy.sum()).backward()

    def test_detached_metrics_are_fine(self) -> None:
        case = make_case((10,), 20, 4, seed=8)
        hidden = case.hidden.clone().requires_grad_()
        out = fused_loss(hidden, case.weight, case.labels, lambda lp, ent: -lp)
        (out.loss + 0 * out.logprobs.detach().sum()).backward()
        assert hidden.grad is not None

    def test_no_grad_computes_the_loss(self) -> None:
        case = make_case((10,), 20, 4, seed=8)
        with torch.no_grad():
            out = fused_loss(case.hidden, case.weight, case.labels, lambda lp, ent: -lp, chunk_size=3)
        reference = fused_loss(case.hidden, case.weight, case.labels, lambda lp, ent: -lp, backend="logits")
        assert_close(out.loss, reference.loss, atol=1e-5, rtol=1e-5, what="loss")
        assert not out.loss.requires_grad
        with torch.no_grad(), _Matmuls(case.weight.shape[0]) as matmuls:
            fused_loss(case.hidden, case.weight, case.labels, lambda lp, ent: -lp)
        assert matmuls.count == 1  # the logits only: no gradient is computed

    def test_gradients_released_by_backward(self) -> None:
        """The gradients are saved tensors: held until backward, not for as long as the loss tensor lives."""
        case = make_case((10,), 20, 4, seed=8)
        hidden = case.hidden.clone().requires_grad_()
        out = fused_loss(hidden, case.weight, case.labels, lambda lp, ent: -lp)
        out.loss.backward()
        with pytest.raises(RuntimeError, match="second time|already been freed"):
            out.loss.backward()

    def test_shape_of_labels(self) -> None:
        case = make_case((2, 9), 30, 4, seed=9)
        out = fused_loss(case.hidden, case.weight, case.labels, lambda lp, ent: -lp)
        assert out.logprobs.shape == out.entropy.shape == (2, 9) and out.loss.shape == ()


class TestInvalidInput:
    @pytest.fixture
    def case(self) -> Case:
        return make_case((2, 6), 20, 4, seed=10)

    @pytest.mark.parametrize(
        ("token_loss", "args", "match"),
        [
            ("ppo", (), "must be callable"),
            (lambda lp, ent: (-lp).mean(), (), "one floating loss per token"),
            (lambda lp, ent: (lp > 0).long(), (), "one floating loss per token"),
            (lambda lp, ent, a: -lp * a, (torch.ones(3),), r"token_args\[0\] must be shaped like labels"),
            (lambda lp, ent, a: -lp * a[0], ([1.0],), r"token_args\[0\] must be a tensor"),
            (lambda lp, ent, a: -lp * a, (torch.ones(2, 6, requires_grad=True),), r"token_args\[0\] requires grad"),
        ],
        ids=["not-callable", "a-mean", "integer", "wrong-shape", "a-list", "requires-grad"],
    )
    def test_refused(self, case: Case, token_loss: Any, args: tuple[Any, ...], match: str) -> None:
        with pytest.raises(InvalidInputError, match=match):
            fused_loss(case.hidden, case.weight, case.labels, token_loss, *args, chunk_size=4)

    @pytest.mark.usefixtures("unaligned_tiles")
    def test_scalars_pass_whole(self, case: Case) -> None:
        seen = []
        fused_loss(case.hidden.requires_grad_(), case.weight, case.labels,
                   lambda lp, ent, a, b: seen.append((a, b)) or -lp * a * b,
                   2.0, torch.tensor(3.0), chunk_size=4)
        assert len(seen) == 3 and all(a == 2.0 and float(b) == 3.0 for a, b in seen)

    def test_the_heads_checks_apply(self, case: Case) -> None:
        with pytest.raises(InvalidInputError, match="unknown logprobs/entropy backend"):
            fused_loss(case.hidden, case.weight, case.labels, lambda lp, ent: -lp, backend="fast")
        with pytest.raises(InvalidInputError, match="labels must be token ids"):
            fused_loss(case.hidden, case.weight, case.labels + 100, lambda lp, ent: -lp)


def test_default_blocks() -> None:
    """Backend "triton": at most about 2**30 logits per block (7,061 tokens at a 152k vocabulary) and 16,384 tokens;
    torch: at most its chunk; split evenly over the blocks that takes; a given chunk_size wins; all rounded up to
    the tile alignment and capped at T."""
    assert _fused_loss.default_rows(70_703, 152_064, "triton", None) == 6_528  # 11 blocks of at most 7,061
    assert _fused_loss.default_rows(8_191, 152_064, "triton", None) == 4_096
    assert _fused_loss.default_rows(7_000, 152_064, "triton", None) == 7_000
    assert _fused_loss.default_rows(70_703, 32_000, "triton", None) == 14_208  # 5 blocks of at most 16,384
    assert _fused_loss.default_rows(500, 152_064, "triton", None) == 500
    assert _fused_loss.default_rows(70_703, 152_064, "torch", None) == heads._TORCH_CHUNK_SIZE
    assert _fused_loss.default_rows(70_703, 152_064, "triton", 1000) == 1024


@pytest.mark.parametrize("model_type", ["gemma2", "llama"])
def test_model_fused_loss_equals_the_models_own_logits(model_type: str) -> None:
    """gemma2's final-logit softcap is read from the model: the loss and every parameter's gradient are those of
    the same loss on the model's own logits (fp32)."""
    from tfcompat.tiny_models import tiny_model

    model = tiny_model(model_type, attn_implementation="eager")
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    adv = torch.randn(2, 9, generator=gen)
    params = [p for p in model.parameters() if p.requires_grad]
    logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float() / 0.7, -1)  # (B, L, V)
    keep = labels != IGNORE_INDEX
    own_lp = torch.where(keep, logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0], 0.0)
    own_ent = torch.where(keep, -(logp.exp() * logp).sum(-1), 0.0)
    own = torch.where(keep, -adv * own_lp - 0.01 * own_ent, 0.0).sum()
    own_grads = torch.autograd.grad(own, params, allow_unused=True)
    got = heads.model_fused_loss(model, labels, lambda lp, ent, a: -a * lp - 0.01 * ent, adv, temperature=0.7,
                                 chunk_size=5, input_ids=ids, use_cache=False)
    got_grads = torch.autograd.grad(got.loss, params, allow_unused=True)
    assert_close(got.loss, own, atol=1e-5, rtol=1e-5, what="loss")
    for want, have in zip(own_grads, got_grads, strict=True):
        if want is None:
            assert have is None
            continue
        assert_close(have, want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=1e-5, what="grad")
