"""Triton epilogues of the PPO head (backend ``"triton"`` of `tfcompat.heads`): imported only when used.

The lm-head matmuls stay cuBLAS (through ``F.linear`` / ``torch.mm`` on 128-aligned tiles, near the GPU's
matmul peak); what these kernels replace is the float32 arithmetic between the matmuls, which backend
``"torch"`` does in several passes over float32 copies of each tile. Here each tile of logits (in the input
dtype, as cuBLAS rounds it, the same rounding as the reference) is read once:

- `row_stats`: one program per token streams its row of logits with an online log-sum-exp and returns the
  logsumexp, the label's logprob and the entropy (``lse - E_p[z]``), float32;
- `grad_logits`: one program per (token, block of columns) recomputes ``p`` and ``log p`` from the logits and
  the saved logsumexp and writes the gradient over the logits, in their dtype.

Both run under ``TRITON_INTERPRET=1`` on CPU tensors (the tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_STATS_BLOCK = 4096  # columns per step of a row_stats program
_GRAD_BLOCK = 2048  # columns per grad_logits program


@triton.jit
def _row_stats_kernel(
    logits_ptr, row_stride, labels_ptr, temperature_ptr, temperature_stride,
    lse_ptr, logprobs_ptr, entropy_ptr, n_cols,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    tau = tl.load(temperature_ptr + row * temperature_stride)
    m = float("-inf")  # running max of z
    s = 0.0  # sum exp(z - m)
    w = 0.0  # sum exp(z - m) * z
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        z = tl.math.div_rn(tl.load(base + cols, mask=mask, other=0.0).to(tl.float32), tau)  # 0 where masked
        z_max = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z_max, 0))
        scale = tl.exp(m - m_new)
        e = tl.exp(z_max - m_new)  # 0 where masked
        s = s * scale + tl.sum(e, 0)
        w = w * scale + tl.sum(e * z, 0)
        m = m_new
    lse = m + tl.log(s)
    label = tl.load(labels_ptr + row)
    z_label = tl.math.div_rn(tl.load(base + tl.maximum(label, 0)).to(tl.float32), tau)
    tl.store(lse_ptr + row, lse)
    tl.store(logprobs_ptr + row, z_label - lse)
    tl.store(entropy_ptr + row, lse - w / s)


@triton.jit
def _grad_logits_kernel(
    logits_ptr, row_stride, n_cols, first_column, labels_ptr, temperature_ptr, temperature_stride,
    lse_ptr, label_coef_ptr, entropy_coef_ptr, shift_ptr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    ptrs = logits_ptr + row * row_stride + cols
    x = tl.load(ptrs, mask=mask, other=0.0)
    tau = tl.load(temperature_ptr + row * temperature_stride)
    lse = tl.load(lse_ptr + row)
    entropy_coef = tl.load(entropy_coef_ptr + row)
    shift = tl.load(shift_ptr + row)
    label_coef = tl.load(label_coef_ptr + row)
    label = tl.load(labels_ptr + row)
    logp = tl.math.div_rn(x.to(tl.float32), tau) - lse
    grad = tl.exp(logp) * (-entropy_coef * logp - shift)
    grad = tl.where(cols == label - first_column, grad + label_coef, grad)  # ignored labels match no column
    tl.store(ptrs, grad.to(x.dtype), mask=mask)


def _rows_contiguous(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(1) == 1 else logits.contiguous()


class TritonTiles:
    """Backend ``"triton"``: the per-tile arithmetic of `tfcompat.heads._ChunkedLogprobsEntropy` as Triton
    kernels (same interface as ``_TorchTiles``)."""

    @staticmethod
    def row_stats(
        logits: torch.Tensor, labels: torch.Tensor, temperature: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits ``(R, V)`` in the input dtype, labels ``(R,)`` int64 in ``[0, V)``, temperature ``(R, 1)``
        float32 (any row stride). Returns logsumexp, logprob of the label and entropy, each ``(R,)`` float32."""
        logits = _rows_contiguous(logits)
        rows, vocab = logits.shape
        lse, logprobs, entropy = torch.empty(3, rows, dtype=torch.float32, device=logits.device)
        if rows:
            _row_stats_kernel[(rows,)](
                logits, logits.stride(0), labels, temperature, temperature.stride(0),
                lse, logprobs, entropy, vocab,
                BLOCK=min(_STATS_BLOCK, triton.next_power_of_2(vocab)), num_warps=8,
            )
        return lse, logprobs, entropy

    @staticmethod
    def grad_logits(logits: torch.Tensor, stats, labels: torch.Tensor, first_column: int) -> torch.Tensor:
        """Gradient with respect to ``logits`` ``(R, C)`` (vocabulary columns ``first_column ..``), written over
        ``logits`` in its dtype and returned; stats: ``_RowStats`` with ``(R, 1)`` float32 columns, labels
        ``(R,)`` int64 (ignored tokens carry ``IGNORE_INDEX``)."""
        logits = _rows_contiguous(logits)
        rows, columns = logits.shape
        block = min(_GRAD_BLOCK, triton.next_power_of_2(columns))
        if rows:
            _grad_logits_kernel[(rows, triton.cdiv(columns, block))](
                logits, logits.stride(0), columns, first_column, labels,
                stats.temperature, stats.temperature.stride(0),
                stats.lse.contiguous(), stats.label_coef.contiguous(), stats.entropy_coef.contiguous(),
                stats.shift.contiguous(),
                BLOCK=block, num_warps=8,
            )
        return logits
