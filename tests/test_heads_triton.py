"""PPO heads, backend "triton" against backend "logits" (the reference): values and gradients.

On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is imported:
``nox -s triton`` does); on a CUDA machine they are compiled, and the same cases also run there in bf16.
Skipped, with the reason, where triton is not installed or neither mode is available.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import assert_close
from tests.test_heads import (
    BF16_FORWARD_TOL,
    BF16_GRAD_TOL,
    FP32_TOL,
    Case,
    assert_runs_close,
    make_case,
    run,
)
from tfcompat import heads
from tfcompat.errors import InvalidInputError
from tfcompat.heads import IGNORE_INDEX, _tiles, logprobs_entropy

pytest.importorskip("triton", reason="backend 'triton' needs the triton package (nox -s triton installs it)")
from tfcompat.heads import _triton as _triton_heads  # noqa: E402

CUDA = torch.cuda.is_available()
if not (CUDA or heads._triton_interpreted()):
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set: the Triton kernels cannot run here",
                allow_module_level=True)
DEVICE = torch.device("cuda" if CUDA else "cpu")


def on_device(case: Case) -> Case:
    return Case(*(x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in case))


def triton_and_reference(case: Case, chunk_size: int, **transform: float | None):
    case = on_device(case)
    return run(case, "triton", chunk_size, **transform), run(case, "logits", **transform)


@pytest.fixture
def unaligned_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of any row and column count, so that small cases are cut into many tiles."""
    monkeypatch.setattr(_tiles, "_ALIGN", 1)


@pytest.fixture(params=[None, 16], ids=["one-token-block", "token-blocks-of-16"])
def token_block(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """One token block (grad_weight written once per vocabulary tile), or blocks of 16 tokens (grad_weight
    summed over the blocks in a float32 buffer)."""
    if request.param is not None:
        monkeypatch.setattr(_triton_heads, "TOKEN_BLOCK", request.param)


@pytest.mark.usefixtures("unaligned_tiles", "token_block")
class TestTritonMatchesReference:
    """Backend "triton" computes what backend "logits" computes, values and gradients, in float32."""

    @pytest.mark.parametrize(
        ("shape", "vocab", "hidden_size", "chunk_size"),
        [
            ((37,), 301, 16, 5),  # T < V, odd tile widths
            ((2, 19), 300, 8, 7),  # (B, L) labels
            ((150,), 97, 12, 32),  # T > V
            ((1,), 9000, 4, 2),  # one token, tiles longer than a stats block
            ((9,), 2, 3, 4),  # a two-word vocabulary
        ],
        ids=["few-tokens", "batched", "many-tokens", "long-row", "tiny-vocab"],
    )
    @pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
    @pytest.mark.parametrize("per_token_temperature", [False, True], ids=["float-tau", "tensor-tau"])
    def test_values_and_gradients(self, shape, vocab, hidden_size, chunk_size, bias, per_token_temperature):
        case = make_case(shape, vocab, hidden_size, seed=vocab + len(shape), bias=bias,
                         per_token_temperature=per_token_temperature, ignored=0.3)
        assert_runs_close(*triton_and_reference(case, chunk_size), forward_tol=FP32_TOL, grad_tol=FP32_TOL)

    @pytest.mark.parametrize(("softcap", "logit_scale"), [(None, 0.25), (0.5, 1.0), (2.0, 3.0), (30.0, 1.0)],
                             ids=["scale", "hard-cap", "cap-and-scale", "gemma2-cap"])
    @pytest.mark.parametrize(("shape", "vocab", "chunk_size"), [((37,), 301, 5), ((150,), 97, 32)],
                             ids=["few-tokens", "many-tokens"])
    def test_softcap_and_scale(self, shape, vocab, chunk_size, softcap, logit_scale):
        """The kernels' tanh (from exp) and its derivative: the reference's values and gradients."""
        case = make_case(shape, vocab, 12, seed=vocab, ignored=0.3)
        assert_runs_close(*triton_and_reference(case, chunk_size, softcap=softcap, logit_scale=logit_scale),
                          forward_tol=FP32_TOL, grad_tol=FP32_TOL)

    def test_all_ignored(self) -> None:
        case = make_case((12,), 50, 8, seed=7, ignored=1.0)
        triton_run, reference = triton_and_reference(case, 4)
        assert (triton_run.out.logprobs == 0).all() and (triton_run.out.entropy == 0).all()
        assert (triton_run.grad_hidden == 0).all() and (triton_run.grad_weight == 0).all()
        assert_runs_close(triton_run, reference, forward_tol=FP32_TOL, grad_tol=FP32_TOL)

    def test_ignored_positions_get_no_gradient(self) -> None:
        case = make_case((24,), 60, 8, seed=1, ignored=0.5)
        ignored = case.labels == IGNORE_INDEX
        assert ignored.any() and not ignored.all()
        result, _ = triton_and_reference(case, 5)
        ignored = ignored.to(DEVICE)
        assert (result.out.logprobs[ignored] == 0).all() and (result.out.entropy[ignored] == 0).all()
        assert (result.out.entropy[~ignored] > 0).all()
        assert (result.grad_hidden[ignored] == 0).all()
        assert (result.grad_hidden[~ignored] != 0).any(dim=-1).all()

    def test_uniform_logits(self) -> None:
        vocab = 37
        labels = torch.tensor([0, 5, 36, 12], device=DEVICE)
        out = logprobs_entropy(torch.randn(4, 8, device=DEVICE), torch.zeros(vocab, 8, device=DEVICE), labels, 0.3,
                               backend="triton", chunk_size=3)
        assert_close(out.logprobs.cpu(), torch.full((4,), -math.log(vocab)), atol=1e-6)
        assert_close(out.entropy.cpu(), torch.full((4,), math.log(vocab)), atol=1e-6)

    def test_frozen_weight_and_one_output(self) -> None:
        """Only hidden requires grad and only the entropy is used: no weight gradient, hidden's as the reference's."""
        case = on_device(make_case((20,), 50, 8, seed=4))
        grads = []
        for backend in ("triton", "logits"):
            hidden = case.hidden.clone().requires_grad_()
            weight = case.weight.clone()
            logprobs_entropy(hidden, weight, case.labels, case.temperature, backend=backend,
                             chunk_size=6).entropy.sum().backward()
            assert weight.grad is None
            grads.append(hidden.grad)
        assert_close(grads[0], grads[1], atol=FP32_TOL, what="grad_hidden")


class TestTritonKeptLogits:
    """``keep_logits=True``: one (T, V) tile kept from the forward, the gradient written over it, then one
    matmul per gradient; values and gradients are the reference's."""

    @pytest.mark.parametrize(
        ("shape", "vocab", "transform"),
        [((37,), 301, {}), ((2, 19), 300, {}), ((150,), 97, {}), ((1,), 3000, {}),
         ((37,), 301, dict(softcap=2.0, logit_scale=3.0))],
        ids=["few-tokens", "batched", "many-tokens", "long-row", "softcap"],
    )
    def test_matches_reference(self, shape, vocab, transform) -> None:
        case = on_device(make_case(shape, vocab, 12, seed=vocab, ignored=0.3))
        assert_runs_close(run(case, "triton", keep_logits=True, **transform), run(case, "logits", **transform),
                          forward_tol=FP32_TOL, grad_tol=FP32_TOL)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_half_precision_within_stated_tolerance(self, dtype: torch.dtype) -> None:
        case = make_case((129,), 700, 32, seed=129, dtype=dtype)
        kept, reference = run(on_device(case), "triton", keep_logits=True), run(on_device(case), "logits")
        assert kept.grad_hidden.dtype == kept.grad_weight.dtype == kept.grad_bias.dtype == dtype
        forward_tol, grad_tol = BF16_FORWARD_TOL, BF16_GRAD_TOL
        if CUDA:  # as in TestTritonHalfPrecision
            logits = (case.hidden.float() @ case.weight.float().T + case.bias.float()) / case.temperature[:, None]
            forward_tol, grad_tol = 2 * torch.finfo(dtype).eps * logits.abs().max().item(), 2.5 * BF16_GRAD_TOL
        assert_runs_close(kept, reference, forward_tol=forward_tol, grad_tol=grad_tol)

    def test_second_backward_raises(self) -> None:
        case = on_device(make_case((16,), 40, 8, seed=6))
        hidden = case.hidden.clone().requires_grad_()
        out = logprobs_entropy(hidden, case.weight, case.labels, case.temperature, backend="triton", keep_logits=True)
        loss = (case.grad_logprobs * out.logprobs).sum()
        loss.backward(retain_graph=True)
        with pytest.raises(InvalidInputError, match=r"(?s)one backward per forward.*keep_logits=False"):
            loss.backward()


class TestTritonHalfPrecision:
    """bf16 and fp16 inputs: the kernels read the logits as the matmul rounded them to the input dtype, as the
    reference does. On CPU both round identically, so the values agree to float32 rounding; cuBLAS may round a
    tile's logits differently from the whole matrix's (another kernel; the bias added before or after
    rounding), so on CUDA the values agree to one rounding step of the largest scaled logit. Gradients agree to
    the rounding of each tile's product."""

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("tokens", [129, 200], ids=["odd", "round"])
    def test_within_stated_tolerance(self, dtype: torch.dtype, tokens: int) -> None:
        case = make_case((tokens,), 700, 32, seed=tokens, dtype=dtype)
        triton_run, reference = triton_and_reference(case, 64)
        assert triton_run.grad_hidden.dtype == triton_run.grad_weight.dtype == triton_run.grad_bias.dtype == dtype
        forward_tol, grad_tol = BF16_FORWARD_TOL, BF16_GRAD_TOL
        if CUDA:  # a row whose logits round differently has a slightly different p, hence gradient
            logits = (case.hidden.float() @ case.weight.float().T + case.bias.float()) / case.temperature[:, None]
            forward_tol, grad_tol = 2 * torch.finfo(dtype).eps * logits.abs().max().item(), 2.5 * BF16_GRAD_TOL
        assert_runs_close(triton_run, reference, forward_tol=forward_tol, grad_tol=grad_tol)


class TestAlignedTiles:
    @pytest.mark.parametrize("chunk_size", [None, 512])
    @pytest.mark.parametrize("tokens", [1, 127, 1000, 8191, 20205, 65535])
    def test_tiles_are_aligned(self, tokens: int, chunk_size: int | None) -> None:
        """Rows are a multiple of 128 (or all tokens), at most TOKEN_BLOCK; columns a multiple of the kernels'
        column block (or the whole vocabulary); the tile holds about max(T * H, MIN_TILE) logits, or chunk_size * V."""
        vocab, hidden_size, block = 152064, 3584, _triton_heads.COLUMN_BLOCK
        rows, columns = _triton_heads._triton_tiles(tokens, hidden_size, vocab, chunk_size)
        assert rows == tokens or (rows % 128 == 0 and rows <= _triton_heads.TOKEN_BLOCK)
        assert columns == vocab or columns % block == 0
        budget = max(tokens * hidden_size, _triton_heads.MIN_TILE) if chunk_size is None else chunk_size * vocab
        assert columns == vocab or budget <= rows * columns < budget + block * rows


class TestAuto:
    def test_auto_is_triton_on_cuda_only(self) -> None:
        assert heads._resolve_backend("auto", torch.zeros(1)) == "torch"
        if CUDA:
            assert heads._resolve_backend("auto", torch.zeros(1, device="cuda")) == "triton"

    def test_triton_off_cuda_without_interpreter(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(InvalidInputError, match=r'(?s)backend="triton" runs on CUDA tensors.*hidden is on cpu'):
            logprobs_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, 4]), backend="triton")

    def test_triton_not_installed(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(heads, "_has_triton", lambda: False)
        with pytest.raises(InvalidInputError, match=r"(?s)needs the triton package.*tfcompat\[triton\]"):
            logprobs_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, 4]), backend="triton")
        assert heads._resolve_backend("auto", torch.zeros(1, device=DEVICE)) == "torch"


@pytest.mark.usefixtures("unaligned_tiles")
class TestTritonFusedLoss:
    """`fused_loss` through the two kernels (whole rows per block, the gradient written in the forward): the
    reference's loss, metrics and gradients, in float32 (and bf16 on CUDA)."""

    @pytest.mark.parametrize(
        ("shape", "vocab", "chunk_size"),
        [((37,), 301, 5), ((2, 19), 300, 7), ((150,), 97, 150), ((1,), 3000, 1)],
        ids=["blocks-of-5", "batched", "one-block", "long-row"],
    )
    @pytest.mark.parametrize("transform", [{}, {"softcap": 2.0, "logit_scale": 3.0}], ids=["plain", "cap-and-scale"])
    def test_values_and_gradients(self, shape, vocab, chunk_size, transform) -> None:
        from tests.test_fused_loss import Result, ppo_args

        case = make_case(shape, vocab, 12, seed=vocab, ignored=0.3)
        args = ppo_args(case, seed=vocab)
        case, args = on_device(case), tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)
        got = Result(case, args, "triton", 0.5, chunk_size=chunk_size, **transform)
        got.assert_close_to(Result(case, args, "logits", 0.5, **transform), FP32_TOL, FP32_TOL)

    @pytest.mark.skipif(not CUDA, reason="bf16 matmuls of the interpreter's CPU tensors are not the GPU's")
    def test_bf16(self) -> None:
        from tests.test_fused_loss import Result, ppo_args

        case = make_case((4, 300), 1000, 64, seed=2, dtype=torch.bfloat16)
        args = ppo_args(case, seed=2)
        case, args = on_device(case), tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)
        got = Result(case, args, "triton", chunk_size=256)
        got.assert_close_to(Result(case, args, "logits"), BF16_FORWARD_TOL, BF16_GRAD_TOL)
