"""Backend ``"torch"`` of `tfcompat.heads`: tiles of about ``chunk_size * V`` logits whose softmax, entropy and
gradient arithmetic runs in float32 torch ops; backward recomputes each tile's logits."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._tiles import IGNORE_INDEX, _accumulate_mm, _aligned, _spans, kept_logits_consumed

# Backend "torch"'s default tile, chunk_size * V logits: on an H200 (bf16, V = 152064, H = 3584) fwd+bwd took
# 0.94-0.97x the reference's time at 1k-33k tokens with 2048, 0.96-1.01x with 1024 (same run, interleaved),
# for up to 1.5 GiB more peak memory (gradients included: 2.5-4.4 GiB against 2.5-2.9 GiB; the reference: 2.9-93 GiB).
_TORCH_CHUNK_SIZE = 2048


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


def _capped(logits: torch.Tensor, pre: float | None) -> torch.Tensor:
    """``tanh(pre * logits)`` in float32 ``(R, C)``, or ``logits`` as they are without a softcap (``pre`` None):
    the chunked backends' g, whose output the temperature column (already divided by the cap) scales."""
    return logits if pre is None else torch.tanh(logits.float() * pre)


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


def _grad_raw_logits(
    logits: torch.Tensor, stats: _RowStats, labels: torch.Tensor, first_column: int, pre: float | None
) -> torch.Tensor:
    """`_torch_grad_logits` with respect to the lm head's output ``logits`` ``(R, C)``, in their dtype: with a
    softcap, through ``t = tanh(pre * x)`` (``dt/dx = pre * (1 - t**2)``), in float32 then rounded."""
    if pre is None:
        return _torch_grad_logits(logits, stats, labels, first_column)
    capped = _capped(logits, pre)  # (R, C) float32
    slope = capped.square().neg_().add_(1.0).mul_(pre)  # (R, C) dt/dx
    grad = _torch_grad_logits(capped, stats, labels, first_column).mul_(slope)  # over capped's storage
    return logits.copy_(grad)


class _ChunkedLogprobsEntropy(torch.autograd.Function):
    """Backend ``"torch"``: forward in token chunks of ``(chunk_size, V)`` logits; backward recomputes tiles.

    Saved for backward: hidden, weight, bias, labels, the ``(T, 1)`` temperature, and per token the
    logsumexp and entropy. Backward walks tiles of about ``chunk_size * V`` logits along whichever axis
    needs the smaller float32 accumulator: the vocabulary when ``T < V`` (tiles ``(T, C)``, grad_weight rows
    written once, grad_hidden ``(T, H)`` accumulated in float32), else the tokens (tiles ``(R, V)``,
    grad_hidden rows written once, grad_weight ``(V, H)`` accumulated in float32). Every tile's row and column
    counts are multiples of `_ALIGN` (or the whole axis). Gradients come back in the dtype of their inputs.

    ``keep``: the forward computes the ``(T, V)`` logits in one matmul and keeps them (saved for backward); backward
    writes the gradient over them in token chunks and runs one matmul per gradient over all of V.
    """

    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
        temperature: torch.Tensor, chunk_size: int, pre: float | None = None, keep: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden ``(T, H)``, weight ``(V, H)``, bias ``(V,)`` or None, labels ``(T,)`` int64, temperature
        ``(T, 1)`` float32; with a softcap the logits are ``tanh(pre * x) / temperature`` (see `_capped`).
        Returns logprobs ``(T,)`` and entropy ``(T,)``, float32."""
        tokens = hidden.shape[0]
        lse = hidden.new_empty(tokens, dtype=torch.float32)
        entropy = hidden.new_empty(tokens, dtype=torch.float32)
        logprobs = hidden.new_empty(tokens, dtype=torch.float32)
        label_columns = labels.clamp(min=0)  # (T,), ignored tokens read column 0
        kept = [F.linear(hidden, weight, bias)] if keep else []  # (T, V) in the input dtype
        for rows in _spans(tokens, _aligned(chunk_size, tokens)):
            raw = kept[0][rows] if keep else F.linear(hidden[rows], weight, bias)  # (R, V)
            logits = _capped(raw, pre)  # (R, V) in the input dtype or float32
            lse[rows], logprobs[rows], entropy[rows] = _torch_row_stats(logits, label_columns[rows], temperature[rows])
            del raw, logits
        ctx.save_for_backward(hidden, weight, bias, labels, temperature, lse.unsqueeze(1), entropy.unsqueeze(1),
                              *kept)
        ctx.chunk_size, ctx.pre, ctx.keep, ctx.consumed = chunk_size, pre, keep, False
        valid = labels != IGNORE_INDEX
        return torch.where(valid, logprobs, 0.0), torch.where(valid, entropy, 0.0)

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor):
        """grad_logprobs, grad_entropy ``(T,)``. Returns grad_hidden ``(T, H)``, grad_weight ``(V, H)``,
        grad_bias ``(V,)`` (None where not needed) and None for the other inputs."""
        if ctx.keep and ctx.consumed:  # before autograd unpacks the overwritten logits
            raise kept_logits_consumed()
        hidden, weight, bias, labels, temperature, lse, entropy, *kept = ctx.saved_tensors
        valid = (labels != IGNORE_INDEX).unsqueeze(1)  # (T, 1)
        label_coef = grad_logprobs.unsqueeze(1) * valid / temperature  # (T, 1)
        entropy_coef = grad_entropy.unsqueeze(1) * valid / temperature  # (T, 1)
        shift = entropy_coef * entropy + label_coef  # (T, 1)
        stats = _RowStats(temperature, lse.neg(), label_coef, entropy_coef.neg(), shift.neg_())
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        tokens, vocab = hidden.shape[0], weight.shape[0]
        if ctx.keep:
            ctx.consumed = True
            for rows in _spans(tokens, _aligned(ctx.chunk_size, tokens)):  # (R, V) gradients over the kept logits
                _grad_raw_logits(kept[0][rows], stats.rows(rows), labels[rows], 0, ctx.pre)
            grad = kept[0]  # (T, V)
            return (
                grad @ weight if need_hidden else None,
                grad.T @ hidden if need_weight else None,
                grad.sum(0, dtype=torch.float32).to(weight.dtype) if need_bias else None,
                None, None, None, None, None,
            )
        grad_bias = weight.new_zeros(vocab, dtype=torch.float32) if need_bias else None
        if tokens < vocab:
            grad_hidden = hidden.new_zeros(hidden.shape, dtype=torch.float32) if need_hidden else None
            grad_weight = torch.empty_like(weight) if need_weight else None
            # tiles of about chunk_size * V logits, an aligned number of columns
            for columns in _spans(vocab, _aligned(-(-ctx.chunk_size * vocab // max(tokens, 1)), vocab)):
                logits = F.linear(hidden, weight[columns], None if bias is None else bias[columns])  # (T, C)
                grad = _grad_raw_logits(logits, stats, labels, columns.start, ctx.pre)  # (T, C) in the input dtype
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
                grad = _grad_raw_logits(logits, stats.rows(rows), labels[rows], 0, ctx.pre)  # (R, V), input dtype
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
            None,
            None,
        )
