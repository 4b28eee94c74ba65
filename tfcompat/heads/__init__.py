"""PPO forward heads: per-token log-probabilities of the taken tokens and the entropy of the policy.

The plain computation materializes the ``(T, V)`` logits in float32 and keeps several ``(T, V)`` tensors
alive for backward; at ``T = 8192`` tokens and a 152k vocabulary that is tens of GiB. Backends ``"torch"`` and
``"triton"`` compute the same two values in tiles of about ``chunk_size * V`` logits and keep only ``(T,)`` row
statistics for backward, where they recompute each tile's logits (reference: backend ``"logits"`` below,
i.e. ``log_softmax`` + ``gather`` and ``-(p * log p).sum(-1)`` on the full logits, differentiated by
autograd; the recompute scheme follows Liger-Kernel's fused linear cross-entropy and Apple's Cut Cross
Entropy). Both run the lm-head matmuls through cuBLAS on 128-aligned tiles; ``"torch"`` does the softmax,
entropy and gradient arithmetic of a tile in float32 torch ops, ``"triton"`` in two Triton kernels that read
each tile once (`tfcompat._triton_heads`). ``"auto"`` is ``"triton"`` on CUDA when Triton is installed, else
``"torch"``.

Conventions shared by all backends:

- the lm-head matmul runs in the input dtype; its output is upcast to float32 when divided by the
  temperature, and everything after (softmax, logprobs, entropy) is float32, outputs included;
- positions whose label is ``IGNORE_INDEX`` (-100) get logprob 0 and entropy 0 and contribute no gradient;
- the temperature (a float or one value per token) divides the logits and is a constant: no gradient
  flows to it.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F

from ..errors import InvalidInputError

__all__ = ["IGNORE_INDEX", "BACKENDS", "LogprobsEntropy", "logprobs_entropy", "model_logprobs"]

IGNORE_INDEX = -100
BACKENDS = ("auto", "torch", "triton", "logits")


class LogprobsEntropy(NamedTuple):
    """Per-token results, float32, shaped like ``labels``: ``(T,)`` or ``(B, L)``.

    logprobs: ``log softmax(z)[label]`` with ``z = (hidden @ W.T + bias) / temperature``; 0 where ignored.
    entropy: ``-sum_v p_v log p_v`` of ``p = softmax(z)``; 0 where ignored.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor


def logprobs_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    *,
    backend: str = "auto",
    chunk_size: int | None = None,
    lm_head_bias: torch.Tensor | None = None,
) -> LogprobsEntropy:
    """Log-probability of each label and entropy of each token's distribution under the lm head.

    hidden: ``(T, H)`` or ``(B, L, H)`` floating, the last hidden states.
    lm_head_weight: ``(V, H)``, same dtype and device as ``hidden``.
    labels: ``(T,)`` or ``(B, L)`` integer token ids in ``[0, V)``, or ``IGNORE_INDEX``.
    temperature: a float > 0, or a floating tensor shaped like ``labels`` with every entry > 0; constant.
    backend: ``"torch"`` or ``"triton"`` (chunked, never hold the ``(T, V)`` logits), ``"auto"`` (``"triton"``
      on CUDA when Triton is installed, else ``"torch"``) or ``"logits"`` (the reference).
    chunk_size: the size of a tile of the chunked backends, about ``chunk_size * V`` logits (rows and columns
      rounded up to aligned counts): float32 (a few copies) for ``"torch"`` (default 2048: about
      3 GiB at V = 152064; 1024 halves that for a few percent more time); in the input dtype
      for ``"triton"``, whose default tile is about ``T * H`` logits (the size of ``hidden``, at least 2**24; it
      also keeps a ``(T, H)`` float32 accumulator), so that its memory grows with T like the hidden states'.
    lm_head_bias: ``(V,)`` or None.
    Returns `LogprobsEntropy`, each field float32 and shaped like ``labels``.

    Validation reads the labels (and a tensor temperature) on the host once: one device sync per call.
    Raises `InvalidInputError` on a bad shape, dtype, device, label, temperature, backend or chunk size, and
    for backend ``"triton"`` without Triton installed or with tensors off CUDA (unless ``TRITON_INTERPRET=1``).
    """
    temperature = _validate(hidden, lm_head_weight, labels, temperature, backend, chunk_size, lm_head_bias)
    backend = _resolve_backend(backend, hidden)
    tokens = hidden.reshape(-1, hidden.shape[-1])  # (B, L, H) -> (T, H)
    flat_labels = labels.reshape(-1).long()  # (B, L) -> (T,)
    # (T, 1) float32 column: one temperature per token, constant for autograd
    column = torch.as_tensor(temperature, dtype=torch.float32, device=hidden.device).detach()
    column = column.reshape(-1, 1).expand(tokens.shape[0], 1)
    if backend == "logits":
        logprobs, entropy = _reference(tokens, lm_head_weight, lm_head_bias, flat_labels, column)
    elif backend == "torch":
        logprobs, entropy = _ChunkedLogprobsEntropy.apply(
            tokens, lm_head_weight, lm_head_bias, flat_labels, column, chunk_size or _TORCH_CHUNK_SIZE
        )
    else:
        from ._triton import TritonLogprobsEntropy

        token_count, hidden_size = tokens.shape
        tile_rows, tile_columns = _triton_tiles(token_count, hidden_size, lm_head_weight.shape[0], chunk_size)
        logprobs, entropy = TritonLogprobsEntropy.apply(
            tokens, lm_head_weight, lm_head_bias, flat_labels, column, tile_rows, tile_columns
        )
    return LogprobsEntropy(logprobs.view(labels.shape), entropy.view(labels.shape))


def model_logprobs(
    model: torch.nn.Module,
    labels: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    *,
    backend: str = "auto",
    chunk_size: int | None = None,
    **inputs: Any,
) -> LogprobsEntropy:
    """`logprobs_entropy` of a causal LM instead of its logits: the backbone runs, the lm head never does.

    model: a ``*ForCausalLM`` / ``*ForConditionalGeneration`` (patched or not); its backbone is ``model.model``
    and its head ``model.get_output_embeddings()``. labels: ``(B, L)`` next-token ids aligned with the input
    tokens (already shifted; under Ulysses, ``shard.labels``). inputs: what the model's forward takes.
    """
    # torch types a Module attribute read `Tensor | Module`: name what these are
    head = cast(Callable[[], torch.nn.Module], model.get_output_embeddings)()
    weight, bias = cast(torch.Tensor, head.weight), cast("torch.Tensor | None", head.bias)
    out = cast(torch.nn.Module, model.model)(**inputs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return logprobs_entropy(hidden, weight, labels, temperature, backend=backend, chunk_size=chunk_size,
                            lm_head_bias=bias)


# ------------------------------------------------------------------------------------------- validation


def _validate(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    backend: str,
    chunk_size: int | None,
    bias: torch.Tensor | None,
) -> float | torch.Tensor:
    """Check the contract of `logprobs_entropy`; returns the temperature (a float, or the tensor as given)."""
    if backend not in BACKENDS:
        raise InvalidInputError(
            f"unknown logprobs/entropy backend {backend!r}", supported=", ".join(map(repr, BACKENDS)),
            fix='pass backend="auto", "torch" or "triton" (chunked) or backend="logits" (reference)',
        )
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise InvalidInputError(
            "chunk_size must be a positive int or None", why=f"got {chunk_size!r}", fix="pass e.g. chunk_size=1024"
        )
    if not (hidden.is_floating_point() and hidden.ndim in (2, 3)):
        raise InvalidInputError(
            "hidden must be a floating (T, H) or (B, L, H) tensor",
            why=f"got dtype {hidden.dtype} and shape {tuple(hidden.shape)}",
        )
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise InvalidInputError(
            "lm_head_weight must be (V, H) with the hidden size of hidden",
            why=f"hidden {tuple(hidden.shape)} vs lm_head_weight {tuple(weight.shape)}",
            fix="pass lm_head.weight, shaped (vocab_size, hidden_size)",
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise InvalidInputError(
            "lm_head_weight must have the dtype and device of hidden",
            why=f"hidden {hidden.dtype} on {hidden.device} vs lm_head_weight {weight.dtype} on {weight.device}",
        )
    vocab = weight.shape[0]
    if bias is not None and (bias.shape != (vocab,) or bias.dtype != weight.dtype or bias.device != weight.device):
        raise InvalidInputError(
            "lm_head_bias must be (V,) with the dtype and device of lm_head_weight",
            why=f"lm_head_bias {tuple(bias.shape)} {bias.dtype} on {bias.device} vs "
            f"lm_head_weight {tuple(weight.shape)} {weight.dtype} on {weight.device}",
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise InvalidInputError("labels must be integer token ids", why=f"got dtype {labels.dtype}")
    if labels.shape != hidden.shape[:-1] or labels.device != hidden.device:
        raise InvalidInputError(
            "labels must have one entry per token of hidden, on its device",
            why=f"hidden {tuple(hidden.shape)} on {hidden.device} vs labels {tuple(labels.shape)} on {labels.device}",
            fix="pass labels shaped hidden.shape[:-1], IGNORE_INDEX (-100) where no logprob is wanted",
        )
    bad_label = ((labels < 0) | (labels >= vocab)) & (labels != IGNORE_INDEX)
    if isinstance(temperature, torch.Tensor):
        _check_temperature_tensor(temperature, labels)
        bad_temperature = ~((temperature > 0) & temperature.isfinite())
    else:
        _check_temperature_float(temperature)
        bad_temperature = torch.zeros((), dtype=torch.bool, device=labels.device)
    any_bad_label, any_bad_temperature = torch.stack([bad_label.any(), bad_temperature.any()]).tolist()  # the sync
    if any_bad_label:
        raise InvalidInputError(
            f"labels must be token ids in [0, {vocab}) or {IGNORE_INDEX}",
            why=f"got {labels[bad_label][:8].tolist()!r} among labels {tuple(labels.shape)}",
        )
    if any_bad_temperature and isinstance(temperature, torch.Tensor):  # a float was checked above
        raise InvalidInputError(
            "every per-token temperature must be finite and > 0",
            why=f"got {temperature[bad_temperature][:8].tolist()!r} among temperatures {tuple(temperature.shape)}",
        )
    return temperature


def _check_temperature_float(temperature: object) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise InvalidInputError(
            "temperature must be a float or a per-token tensor",
            why=f"got {type(temperature).__name__} {temperature!r}",
        )
    if not (math.isfinite(temperature) and temperature > 0):
        raise InvalidInputError("temperature must be finite and > 0", why=f"got {temperature!r}")


def _check_temperature_tensor(temperature: torch.Tensor, labels: torch.Tensor) -> None:
    if not temperature.is_floating_point():
        raise InvalidInputError(
            "a temperature tensor must be floating", why=f"got dtype {temperature.dtype}",
            fix="pass temperature.float()",
        )
    if temperature.shape != labels.shape or temperature.device != labels.device:
        raise InvalidInputError(
            "a temperature tensor must hold one value per token, shaped like labels",
            why=f"temperature {tuple(temperature.shape)} on {temperature.device} vs "
            f"labels {tuple(labels.shape)} on {labels.device}",
            fix="pass a float for one temperature, or a tensor shaped like labels",
        )


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_interpreted() -> bool:
    """Triton's interpreter (``TRITON_INTERPRET=1``) runs the kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _resolve_backend(backend: str, hidden: torch.Tensor) -> str:
    """The backend that runs: ``"auto"`` becomes ``"triton"`` or ``"torch"``; ``"triton"`` is checked usable."""
    if backend == "auto":
        return "triton" if hidden.is_cuda and _has_triton() else "torch"
    if backend == "triton":
        if not _has_triton():
            raise InvalidInputError(
                'backend="triton" needs the triton package', why="it is not installed",
                fix='pip install "tfcompat[triton]", or pass backend="auto" (falls back to "torch")',
            )
        if not (hidden.is_cuda or _triton_interpreted()):
            raise InvalidInputError(
                'backend="triton" runs on CUDA tensors', why=f"hidden is on {hidden.device}",
                fix='pass backend="auto" (picks "torch" off CUDA), or set TRITON_INTERPRET=1 to run the kernels '
                "on the CPU (slow; for tests)",
            )
    return backend


# -------------------------------------------------------------------------------------------- reference


def _scaled_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor
) -> torch.Tensor:
    """``(hidden @ weight.T + bias) / temperature`` in float32, for both backends.

    hidden ``(R, H)``, weight ``(C, H)``, bias ``(C,)`` or None, temperature ``(R, 1)`` float32.
    Returns ``(R, C)`` float32: the matmul runs in the input dtype, dividing by the float32 temperature
    promotes half-precision logits to float32.
    """
    return (F.linear(hidden, weight, bias) / temperature).float()


def _reference(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
    temperature: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend ``"logits"``: the full ``(T, V)`` float32 logits, differentiated by autograd.

    hidden ``(T, H)``, weight ``(V, H)``, bias ``(V,)`` or None, labels ``(T,)`` int64, temperature ``(T, 1)``.
    Returns logprobs ``(T,)`` and entropy ``(T,)``, float32.
    """
    logp = torch.log_softmax(_scaled_logits(hidden, weight, bias, temperature), dim=-1)  # (T, V)
    valid = labels != IGNORE_INDEX
    logprobs = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (T,)
    entropy = -(logp.exp() * logp).sum(-1)  # (T,)
    return torch.where(valid, logprobs, 0.0), torch.where(valid, entropy, 0.0)


# ---------------------------------------------------------------------------------------------- chunked


# Backend "torch"'s default tile, chunk_size * V logits: on an H200 (bf16, V = 152064, H = 3584) fwd+bwd took
# 0.94-0.97x the reference's time at 1k-33k tokens with 2048, 0.96-1.01x with 1024 (same run, interleaved),
# for up to 1.5 GiB more peak memory (gradients included: 2.5-4.4 GiB against 2.5-2.9 GiB; the reference: 2.9-93 GiB).
_TORCH_CHUNK_SIZE = 2048

# Rows and columns of every tile are multiples of this. A tile of C vocabulary columns is the leading dimension
# of its logits and of its gradient; when C is not a multiple of 8 (16 bytes of bf16) cuBLAS falls back to
# align-1 kernels, 2-3x slower. Row offsets ``r * H`` of the hidden slices are aligned for any H too.
_ALIGN = 128


def _aligned(count: int, limit: int) -> int:
    """``count`` rounded up to a multiple of `_ALIGN`, at most ``limit`` (a whole axis needs no alignment)."""
    return min(-(-count // _ALIGN) * _ALIGN, limit)


def _spans(total: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, total)) for start in range(0, total, size)]


class _RowStats(NamedTuple):
    """Per-token ``(R, 1)`` float32 columns that a tile's backward needs, negated where its arithmetic
    subtracts them.

    With g_lp, g_ent the upstream gradients (0 at ignored tokens), Hent the entropy and tau the temperature:
    label_coef = g_lp / tau, entropy_coef = g_ent / tau, shift = entropy_coef * Hent + label_coef.
    """

    temperature: torch.Tensor
    neg_lse: torch.Tensor  # minus the logsumexp of the scaled logits
    label_coef: torch.Tensor
    neg_entropy_coef: torch.Tensor
    neg_shift: torch.Tensor

    def rows(self, rows: slice) -> _RowStats:
        return _RowStats(*(column[rows] for column in self))


# The float32 arithmetic of a tile is memory-bound: its cost is the bytes each op moves, at the speed of its
# kernel. On CUDA an elementwise op of contiguous operands of one dtype runs vectorized (H200, torch 2.11:
# ~4.1 TB/s); an (R, 1) operand broadcast over the columns makes it a generic kernel (~2.5 TB/s), and bf16
# operands with a float32 result one slower still (~1.1-1.4 TB/s for 6 bytes per logit). Converting the bf16
# logits to float32 first is itself such a copy (~1.9 TB/s) and adds a pass, so the first op of a tile reads
# the bf16 logits, the per-token columns stay in the ops that need them, and exp is fused into the product
# that follows it (`_times_exp`).


def _times_exp(factor: torch.Tensor, logp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``factor * exp(logp)`` in one elementwise pass (float32 tensors of one shape), written to ``out``.

    ELU's backward with alpha, scale and input scale 1 is exactly ``grad * exp(x)`` where ``x <= 0``, and
    ``grad`` where ``x > 0``: a log-probability is <= 0, or above it by a rounding, where exp is 1 to float32
    precision. (It computes in the dtype of ``out``: float32 only.)
    """
    return torch.ops.aten.elu_backward.grad_input(factor, 1.0, 1.0, 1.0, False, logp, grad_input=out)


def _torch_row_stats(
    logits: torch.Tensor, labels: torch.Tensor, temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backend ``"torch"``'s forward arithmetic on one chunk, in float32 torch ops.

    logits ``(R, V)``: the output of ``F.linear`` in the input dtype (the reference's rounding); labels ``(R,)``
    int64 (ignored tokens clamped to any column); temperature ``(R, 1)``. Returns logsumexp, logprob of the
    label and entropy, each ``(R,)`` float32.
    """
    z = logits / temperature  # (R, V) float32
    logp = torch.log_softmax(z, dim=-1)  # (R, V), as the reference computes it
    top_logp, top = logp.max(dim=-1, keepdim=True)  # (R, 1): where z - logp is exact to ~1 ulp of lse
    lse = z.gather(1, top).sub_(top_logp).squeeze(1)
    logprobs = logp.gather(1, labels.unsqueeze(1)).squeeze(1)
    entropy = _times_exp(logp, logp, out=z).sum(-1).neg_()  # -sum_v p_v lp_v; p * lp in z's storage
    return lse, logprobs, entropy


def _torch_grad_logits(
    logits: torch.Tensor, stats: _RowStats, labels: torch.Tensor, first_column: int
) -> torch.Tensor:
    """Backend ``"torch"``'s backward arithmetic: the loss's gradient with respect to ``logits`` ``(R, C)``
    (vocabulary columns ``first_column ..``), written over ``logits`` and returned. stats columns ``(R, 1)``,
    labels ``(R,)`` int64 (ignored tokens carry ``IGNORE_INDEX``).

    With z the scaled logits, p = softmax(z), lp = log p and Hent = -sum_v p_v lp_v:
      d logprob / dz = onehot(label) - p
      d entropy / dz = -p * (z - sum_v p_v z_v) = -p * (lp + Hent)
    so, with d/d(logits) = d/dz / tau, the gradient is p * (-entropy_coef * lp - shift) + label_coef * onehot,
    rounded to the dtype of ``logits`` as autograd rounds the reference's.
    """
    logp = torch.addcdiv(stats.neg_lse, logits, stats.temperature)  # (R, C) float32: z - lse
    factor = torch.addcmul(stats.neg_shift, logp, stats.neg_entropy_coef)  # (R, C)
    grad = logits.copy_(_times_exp(factor, logp, out=factor))  # (R, C) p * factor, rounded into logits' storage
    del logp, factor
    columns = labels - first_column  # (R,) the labels that fall in this tile's columns get the onehot term
    in_tile = ((columns >= 0) & (columns < grad.shape[1])).unsqueeze(1)  # (R, 1)
    onehot = (stats.label_coef * in_tile).to(grad.dtype)  # (R, 1)
    return grad.scatter_add_(1, columns.clamp(0, grad.shape[1] - 1).unsqueeze(1), onehot)


def _triton_tiles(tokens: int, hidden_size: int, vocab: int, chunk_size: int | None) -> tuple[int, int]:
    """Backend ``"triton"``'s tile ``(rows, columns)``: at most ``TOKEN_BLOCK`` tokens (a multiple of `_ALIGN`)
    by enough columns for about ``max(T * H, MIN_TILE)`` logits (``chunk_size * V`` when given), a multiple of
    the kernels' column block (8 * `_ALIGN` by default)."""
    from ._triton import COLUMN_BLOCK, MIN_TILE, TOKEN_BLOCK

    rows = _aligned(min(tokens, TOKEN_BLOCK), tokens)
    logits = max(tokens * hidden_size, MIN_TILE) if chunk_size is None else chunk_size * vocab
    block = min(COLUMN_BLOCK, 8 * _ALIGN)
    columns = -(-logits // max(rows, 1))  # enough for the budget, rounded up to whole column blocks
    return rows, min(-(-columns // block) * block, vocab)


_HAS_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")


def _accumulate_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` with a float32 ``out``: on CUDA cuBLAS adds the float32 product into ``out`` directly
    (``addmm(out_dtype=float32)``); elsewhere ``a @ b`` is rounded to the inputs' dtype first when lower."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    elif out.is_cuda and _HAS_ADDMM_OUT_DTYPE:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        out += a @ b


class _ChunkedLogprobsEntropy(torch.autograd.Function):
    """Backend ``"torch"``: forward in token chunks of ``(chunk_size, V)`` logits; backward recomputes tiles.

    Saved for backward: hidden, weight, bias, labels, the ``(T, 1)`` temperature, and per token the
    logsumexp and entropy. Backward walks tiles of about ``chunk_size * V`` logits along whichever axis
    needs the smaller float32 accumulator: the vocabulary when ``T < V`` (tiles ``(T, C)``, grad_weight rows
    written once, grad_hidden ``(T, H)`` accumulated in float32), else the tokens (tiles ``(R, V)``,
    grad_hidden rows written once, grad_weight ``(V, H)`` accumulated in float32). Every tile's row and column
    counts are multiples of `_ALIGN` (or the whole axis). Gradients come back in the dtype of their inputs.
    """

    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
        temperature: torch.Tensor, chunk_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden ``(T, H)``, weight ``(V, H)``, bias ``(V,)`` or None, labels ``(T,)`` int64, temperature
        ``(T, 1)`` float32. Returns logprobs ``(T,)`` and entropy ``(T,)``, float32."""
        tokens = hidden.shape[0]
        lse = hidden.new_empty(tokens, dtype=torch.float32)
        entropy = hidden.new_empty(tokens, dtype=torch.float32)
        logprobs = hidden.new_empty(tokens, dtype=torch.float32)
        label_columns = labels.clamp(min=0)  # (T,), ignored tokens read column 0
        for rows in _spans(tokens, _aligned(chunk_size, tokens)):
            logits = F.linear(hidden[rows], weight, bias)  # (R, V) in the input dtype
            lse[rows], logprobs[rows], entropy[rows] = _torch_row_stats(logits, label_columns[rows], temperature[rows])
            del logits
        ctx.save_for_backward(hidden, weight, bias, labels, temperature, lse.unsqueeze(1), entropy.unsqueeze(1))
        ctx.chunk_size = chunk_size
        valid = labels != IGNORE_INDEX
        return torch.where(valid, logprobs, 0.0), torch.where(valid, entropy, 0.0)

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor):
        """grad_logprobs, grad_entropy ``(T,)``. Returns grad_hidden ``(T, H)``, grad_weight ``(V, H)``,
        grad_bias ``(V,)`` (None where not needed) and None for labels, temperature and chunk_size."""
        hidden, weight, bias, labels, temperature, lse, entropy = ctx.saved_tensors
        valid = (labels != IGNORE_INDEX).unsqueeze(1)  # (T, 1)
        label_coef = grad_logprobs.unsqueeze(1) * valid / temperature  # (T, 1)
        entropy_coef = grad_entropy.unsqueeze(1) * valid / temperature  # (T, 1)
        shift = entropy_coef * entropy + label_coef  # (T, 1)
        stats = _RowStats(temperature, lse.neg(), label_coef, entropy_coef.neg(), shift.neg_())
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        tokens, vocab = hidden.shape[0], weight.shape[0]
        grad_bias = weight.new_zeros(vocab, dtype=torch.float32) if need_bias else None
        if tokens < vocab:
            grad_hidden = hidden.new_zeros(hidden.shape, dtype=torch.float32) if need_hidden else None
            grad_weight = torch.empty_like(weight) if need_weight else None
            # tiles of about chunk_size * V logits, an aligned number of columns
            for columns in _spans(vocab, _aligned(-(-ctx.chunk_size * vocab // max(tokens, 1)), vocab)):
                logits = F.linear(hidden, weight[columns], None if bias is None else bias[columns])  # (T, C)
                grad = _torch_grad_logits(logits, stats, labels, columns.start)  # (T, C) in the input dtype
                if grad_bias is not None:
                    grad_bias[columns] = grad.sum(0, dtype=torch.float32)
                if grad_weight is not None:
                    torch.mm(grad.T, hidden, out=grad_weight[columns])
                if grad_hidden is not None:
                    _accumulate_mm(grad_hidden, grad, weight[columns])
                del logits, grad
        else:
            grad_hidden = torch.empty_like(hidden) if need_hidden else None
            grad_weight = weight.new_zeros(weight.shape, dtype=torch.float32) if need_weight else None
            for rows in _spans(tokens, _aligned(ctx.chunk_size, tokens)):
                logits = F.linear(hidden[rows], weight, bias)  # (R, V)
                grad = _torch_grad_logits(logits, stats.rows(rows), labels[rows], 0)  # (R, V) in the input dtype
                if grad_bias is not None:
                    grad_bias += grad.sum(0, dtype=torch.float32)
                if grad_hidden is not None:
                    torch.mm(grad, weight, out=grad_hidden[rows])
                if grad_weight is not None:
                    _accumulate_mm(grad_weight, grad.T, hidden[rows])
                del logits, grad
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(weight.dtype),
            None,
            None,
            None,
        )
