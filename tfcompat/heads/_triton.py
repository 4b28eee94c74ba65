"""Backend ``"triton"`` of `tfcompat.heads`: cuBLAS matmuls on aligned tiles, Triton kernels between them.

Imported only when the backend is used (triton is an optional dependency).

The four lm-head matmuls of a recomputing head (forward logits; in backward the recomputed logits, grad_hidden
and grad_weight) are ~95% of its FLOPs and stay cuBLAS, which runs them near the GPU's matmul peak on aligned
tiles. What the kernels here replace is the float32 arithmetic between the matmuls, which backend ``"torch"``
does in several passes over float32 copies of each tile: here each tile of logits (in the input dtype, as
cuBLAS rounded it, the reference's rounding) is read once and never copied.

Tiles are ``(R, C)``: ``R`` tokens (a token block, at most `TOKEN_BLOCK`, a multiple of 128 or all of T) by
``C`` vocabulary columns (a multiple of `COLUMN_BLOCK`, or all of V), about ``T * H`` logits by default (the
size of the hidden states, at least `MIN_TILE`) or ``chunk_size * V``. Forward and backward walk the
vocabulary tiles in the outer loop and the token blocks in the inner one:

- forward: `_tile_stats_kernel` (one program per token) streams the token's ``C`` logits and merges them into
  the token's running max, sum of exponentials and sum of ``exp * z`` (an online log-sum-exp across tiles),
  and picks the label's logit when the label falls in the tile; logsumexp, logprob and entropy
  (``lse - E_p[z]``) follow per token;
- backward: the tile's logits are recomputed, `_grad_logits_kernel` (one program per token and block of
  columns) writes the gradient over them in their dtype, then ``grad_weight[C] = grad.T @ hidden[R]`` (written
  once when one token block covers T, else summed in a float32 ``(C, H)`` buffer) and
  ``grad_hidden[R] += grad @ weight[C]`` into a float32 ``(T, H)`` accumulator (cuBLAS adds in float32).

With ``keep_logits`` there is one tile, the whole ``(T, V)``: the forward's logits are kept, and backward is
`_grad_logits_kernel` over them and ``grad @ weight`` and ``grad.T @ hidden`` over all of V: three lm-head
matmuls instead of four, each one cuBLAS call on the whole matrices.

The kernels scale by ``1 / tau`` (a multiply, within an ulp of the reference's division). Why cuBLAS and not
one fused ``tl.dot`` kernel: on an H200 at T = 20205 (bf16, V = 152064, H = 3584) the matmuls take 124 of the
146 ms of a forward + backward and both kernels together 6.9 ms; a fused kernel could save at most the tiles'
write and re-read (a few ms) and would have to match cuBLAS's matmul speed to break even.

Both kernels run under ``TRITON_INTERPRET=1`` on CPU tensors (the tests do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._tiles import _ALIGN, IGNORE_INDEX, _accumulate_mm, _aligned, _spans, kept_logits_consumed

TOKEN_BLOCK = 16384  # the most tokens in a tile: bounds its size when T is large
COLUMN_BLOCK = 1024  # columns per step of both kernels; tile widths are multiples of it, so no lane idles
# the fewest logits in a default tile: below that the host's launches (six per tile) outlast the GPU's work
# (measured on an H200 at T = 1024, H = 3584: tiles of T * H logits, 38 of them, took 15.8 ms; 2 tiles 7.1 ms)
MIN_TILE = 2**24


def _triton_tiles(tokens: int, hidden_size: int, vocab: int, chunk_size: int | None) -> tuple[int, int]:
    """Backend ``"triton"``'s tile ``(rows, columns)``: at most `TOKEN_BLOCK` tokens (a multiple of `_ALIGN`)
    by enough columns for about ``max(T * H, MIN_TILE)`` logits (``chunk_size * V`` when given), a multiple of
    the kernels' column block (8 * `_ALIGN` by default)."""
    rows = _aligned(min(tokens, TOKEN_BLOCK), tokens)
    logits = max(tokens * hidden_size, MIN_TILE) if chunk_size is None else chunk_size * vocab
    block = min(COLUMN_BLOCK, 8 * _ALIGN)
    columns = -(-logits // max(rows, 1))  # enough for the budget, rounded up to whole column blocks
    return rows, min(-(-columns // block) * block, vocab)


@triton.jit
def _tanh(x):
    """tanh in float32 from one exp (Triton's core language has none): within a few ulps of 1 in absolute
    terms, i.e. of the capped logit's own rounding once multiplied by the cap."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _tile_stats_kernel(
    logits_ptr, row_stride, n_cols, first_column, labels_ptr, temperature_ptr, temperature_stride,
    max_ptr, sumexp_ptr, sumexpz_ptr, label_logit_ptr, pre,
    BLOCK: tl.constexpr, SOFTCAP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    inv_tau = 1.0 / tl.load(temperature_ptr + row * temperature_stride)
    m_before = tl.load(max_ptr + row)  # running max of z over the tiles so far (-inf before the first)
    m = m_before
    # per lane: sum exp(z - m) and sum exp(z - m) * z, rescaled when m grows; summed across lanes once, after the
    # loop, so that each block costs one reduction (its max) instead of three
    s_lanes = tl.zeros([BLOCK], dtype=tl.float32)
    w_lanes = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        if SOFTCAP:
            x = _tanh(x * pre)
        z = x * inv_tau  # 0 where masked
        z_max = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z_max, 0))
        scale = tl.exp(m - m_new)
        e = tl.exp(z_max - m_new)  # 0 where masked
        s_lanes = s_lanes * scale + e
        w_lanes = w_lanes * scale + e * z
        m = m_new
    carry = tl.exp(m_before - m)  # the earlier tiles' sums (0 before the first), rescaled to the new max
    tl.store(max_ptr + row, m)
    tl.store(sumexp_ptr + row, tl.load(sumexp_ptr + row) * carry + tl.sum(s_lanes, 0))  # sum exp(z - m)
    tl.store(sumexpz_ptr + row, tl.load(sumexpz_ptr + row) * carry + tl.sum(w_lanes, 0))  # sum exp(z - m) * z
    column = tl.load(labels_ptr + row) - first_column  # ignored labels (-100) fall in no tile
    in_tile = (column >= 0) & (column < n_cols)
    x_label = tl.load(base + tl.where(in_tile, column, 0)).to(tl.float32)
    if SOFTCAP:
        x_label = _tanh(x_label * pre)
    z_label = x_label * inv_tau
    tl.store(label_logit_ptr + row, z_label, mask=in_tile)


@triton.jit
def _grad_logits_kernel(
    logits_ptr, row_stride, n_cols, first_column, labels_ptr, temperature_ptr, temperature_stride,
    lse_ptr, label_coef_ptr, entropy_coef_ptr, shift_ptr, pre,
    BLOCK: tl.constexpr, SOFTCAP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    ptrs = logits_ptr + row * row_stride + cols
    x = tl.load(ptrs, mask=mask, other=0.0)
    inv_tau = 1.0 / tl.load(temperature_ptr + row * temperature_stride)
    lse = tl.load(lse_ptr + row)
    entropy_coef = tl.load(entropy_coef_ptr + row)
    shift = tl.load(shift_ptr + row)
    label_coef = tl.load(label_coef_ptr + row)
    label = tl.load(labels_ptr + row)
    g = x.to(tl.float32)
    if SOFTCAP:
        g = _tanh(g * pre)
    logp = g * inv_tau - lse
    grad = tl.exp(logp) * (-entropy_coef * logp - shift)
    grad = tl.where(cols == label - first_column, grad + label_coef, grad)  # ignored labels match no column
    if SOFTCAP:
        grad = grad * (pre * (1.0 - g * g))  # through tanh
    tl.store(ptrs, grad.to(x.dtype), mask=mask)


def _tile_stats(logits: torch.Tensor, first_column: int, labels: torch.Tensor, temperature: torch.Tensor,
                running: torch.Tensor, pre: float | None) -> None:
    """Merge the tile ``logits`` ``(R, C)`` (columns ``first_column ..``) into ``running`` ``(4, R)`` float32:
    max, sum of exponentials, sum of ``exp * z``, label logit. labels ``(R,)`` int64, temperature ``(R, 1)``;
    with a softcap ``z = tanh(pre * x) / temperature``."""
    rows, columns = logits.shape
    _tile_stats_kernel[(rows,)](
        logits, logits.stride(0), columns, first_column, labels, temperature, temperature.stride(0),
        running[0], running[1], running[2], running[3], 1.0 if pre is None else pre,
        BLOCK=min(COLUMN_BLOCK, triton.next_power_of_2(columns)), SOFTCAP=pre is not None, num_warps=4,
    )


def _grad_logits(logits: torch.Tensor, first_column: int, labels: torch.Tensor, temperature: torch.Tensor,
                 coefs: torch.Tensor, pre: float | None) -> torch.Tensor:
    """The loss's gradient with respect to ``logits`` ``(R, C)``, written over them and returned. coefs
    ``(4, R)`` float32: logsumexp, label_coef, entropy_coef, shift (see `tfcompat.heads._torch._RowStats`)."""
    rows, columns = logits.shape
    block = min(COLUMN_BLOCK, triton.next_power_of_2(columns))
    _grad_logits_kernel[(rows, triton.cdiv(columns, block))](
        logits, logits.stride(0), columns, first_column, labels, temperature, temperature.stride(0),
        coefs[0], coefs[1], coefs[2], coefs[3], 1.0 if pre is None else pre,
        BLOCK=block, SOFTCAP=pre is not None, num_warps=4,
    )
    return logits


class TritonLogprobsEntropy(torch.autograd.Function):
    """hidden ``(T, H)``, weight ``(V, H)``, bias ``(V,)`` or None, labels ``(T,)`` int64, temperature ``(T, 1)``
    float32, tiles of ``tile_rows`` x ``tile_columns``; with a softcap the logits are ``tanh(pre * x) /
    temperature``; ``keep``: one ``(T, V)`` tile, kept for backward. Returns logprobs and entropy ``(T,)`` float32.

    Saved for backward: the inputs and the ``(T,)`` logsumexp and entropy (and the kept logits). Gradients come
    back in the dtype of their inputs; the temporaries are one tile in the input dtype, a ``(T, H)`` float32
    grad_hidden accumulator, and a ``(C, H)`` float32 grad_weight buffer when T spans several token blocks. With
    ``keep``, backward writes the gradient over the kept logits and runs one matmul per gradient over all of V
    (cuBLAS sums in float32 and rounds once): no temporaries.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, tile_rows: int, tile_columns: int,
                pre: float | None = None, keep: bool = False):
        tokens, vocab = hidden.shape[0], weight.shape[0]
        # (4, T) float32: running max, sum of exponentials, sum of exp * z, label logit
        running = torch.zeros(4, tokens, dtype=torch.float32, device=hidden.device)
        running[0] = float("-inf")
        kept = []
        if keep:  # one tile: the whole (T, V) logits in the input dtype, kept for backward
            kept.append(F.linear(hidden, weight, bias))
            _tile_stats(kept[0], 0, labels, temperature, running, pre)
        else:
            for columns in _spans(vocab, tile_columns):
                tile_weight, tile_bias = weight[columns], None if bias is None else bias[columns]
                for rows in _spans(tokens, tile_rows):
                    logits = F.linear(hidden[rows], tile_weight, tile_bias)  # (R, C) in the input dtype
                    _tile_stats(logits, columns.start, labels[rows], temperature[rows], running[:, rows], pre)
                    del logits
        lse = running[0] + running[1].log()  # (T,)
        entropy = lse - running[2] / running[1]
        valid = labels != IGNORE_INDEX
        ctx.save_for_backward(hidden, weight, bias, labels, temperature, lse, entropy, *kept)
        ctx.tile_rows, ctx.tile_columns, ctx.pre, ctx.keep, ctx.consumed = tile_rows, tile_columns, pre, keep, False
        return torch.where(valid, running[3] - lse, 0.0), torch.where(valid, entropy, 0.0)

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor):
        if ctx.keep and ctx.consumed:  # before autograd unpacks the overwritten logits
            raise kept_logits_consumed()
        hidden, weight, bias, labels, temperature, lse, entropy, *kept = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        tokens, vocab = hidden.shape[0], weight.shape[0]
        valid = labels != IGNORE_INDEX
        tau = temperature.squeeze(1)  # (T,)
        coefs = torch.empty(4, tokens, dtype=torch.float32, device=hidden.device)  # lse, label, entropy, shift
        coefs[0] = lse
        torch.div(grad_logprobs * valid, tau, out=coefs[1])
        torch.div(grad_entropy * valid, tau, out=coefs[2])
        torch.addcmul(coefs[1], coefs[2], entropy, out=coefs[3])
        if ctx.keep:
            ctx.consumed = True
            # the gradient over the kept (T, V) logits, then one matmul per gradient over the whole vocabulary
            grad = _grad_logits(kept[0], 0, labels, temperature, coefs, ctx.pre)
            return (
                grad @ weight if need_hidden else None,
                grad.T @ hidden if need_weight else None,
                grad.sum(0, dtype=torch.float32).to(weight.dtype) if need_bias else None,
                None, None, None, None, None, None,
            )
        grad_hidden = hidden.new_zeros(hidden.shape, dtype=torch.float32) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        grad_bias = weight.new_zeros(vocab, dtype=torch.float32) if need_bias else None
        token_blocks = _spans(tokens, ctx.tile_rows)
        weight_sum = None
        if need_weight and len(token_blocks) > 1:
            weight_sum = weight.new_empty(min(ctx.tile_columns, vocab), weight.shape[1], dtype=torch.float32)
        for columns in _spans(vocab, ctx.tile_columns):
            tile_weight, tile_bias = weight[columns], None if bias is None else bias[columns]
            if weight_sum is not None:
                tile_sum = weight_sum[: columns.stop - columns.start].zero_()  # (C, H)
            for rows in token_blocks:
                logits = F.linear(hidden[rows], tile_weight, tile_bias)  # (R, C)
                grad = _grad_logits(logits, columns.start, labels[rows], temperature[rows], coefs[:, rows], ctx.pre)
                if grad_bias is not None:
                    grad_bias[columns] += grad.sum(0, dtype=torch.float32)
                if weight_sum is not None:
                    _accumulate_mm(tile_sum, grad.T, hidden[rows])
                elif grad_weight is not None:
                    torch.mm(grad.T, hidden[rows], out=grad_weight[columns])
                if grad_hidden is not None:
                    _accumulate_mm(grad_hidden[rows], grad, tile_weight)
                del logits, grad
            if weight_sum is not None and grad_weight is not None:  # weight_sum exists only with grad_weight
                grad_weight[columns] = tile_sum
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            grad_weight,
            None if grad_bias is None else grad_bias.to(weight.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )
