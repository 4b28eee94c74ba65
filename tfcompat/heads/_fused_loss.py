"""`tfcompat.heads.fused_loss`'s autograd function: the loss's gradients computed in the head's forward.

A head that returns log-probs and entropy must recompute its logits in backward (four lm-head matmuls) or keep
them (``2 * T * V`` bytes), because the gradient of the logits depends on the loss, which comes later. When the
loss is a sum of per-token terms ``f(logprob_t, entropy_t, *per-token values)``, as PPO / GRPO / DAPO losses are
(clipped ratio, entropy bonus, per-token KL, any constant per-token weights such as a mean's), the gradient of
token t's logits needs only token t's row: ``df/dlogprob_t * (onehot - p_t) + df/dentropy_t * (-p_t * (lp_t +
H_t))``. So the forward walks blocks of whole rows: the block's logits (one matmul), its row statistics, ``f`` and
its two derivatives by autograd on the ``(R,)`` values, the gradient written over the logits (one Triton kernel or
a few float32 torch ops), then ``grad_hidden[rows] = grad @ W`` and ``grad_W += grad.T @ hidden[rows]``: three
lm-head matmuls, no logits kept (Liger-Kernel's fused linear cross-entropy does this for the mean cross-entropy
alone). Backward only scales the stored gradients by the upstream one.

Memory: one ``(R, V)`` tile in the input dtype, a ``(V, H)`` float32 accumulator for grad_W when there are several
blocks (each block's product is added into it by cuBLAS; its read and write cost about ``220 / R`` of the block's
matmul time on an H200), and the gradients themselves, which backward would hold anyway.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import InvalidInputError
from ._tiles import IGNORE_INDEX, _accumulate_mm, _aligned, _spans
from ._torch import _TORCH_CHUNK_SIZE, _capped, _grad_raw_logits, _RowStats, _torch_row_stats

TokenLoss = Callable[..., torch.Tensor]

# Backend "triton"'s default block: rows of about this many logits (2 GiB in bf16), at most `MAX_ROWS` tokens.
TILE_LOGITS = 2**30
MAX_ROWS = 16384


def default_rows(tokens: int, vocab: int, backend: str, chunk_size: int | None) -> int:
    """Tokens per block: ``chunk_size`` when given; else at most about `TILE_LOGITS` logits (``"triton"``, whose
    tile stays in the input dtype) or the torch backend's chunk (``"torch"``, several float32 copies of a tile),
    split evenly over the blocks that takes (8,191 tokens: two of 4,096, not 7,168 and 1,023 at V = 152,064)."""
    if chunk_size is None:
        most = min(MAX_ROWS, max(1, TILE_LOGITS // vocab)) if backend == "triton" else _TORCH_CHUNK_SIZE
        chunk_size = -(-tokens // -(-tokens // most))
    return _aligned(chunk_size, tokens)


def _torch_block(logits: torch.Tensor, labels: torch.Tensor, temperature: torch.Tensor, pre: float | None,
                 coefficients: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backend ``"torch"`` on one block: logits ``(R, V)`` (the lm head's output), labels ``(R,)``, temperature
    ``(R, 1)``. Calls ``coefficients(logprobs, entropy)`` for the ``(R,)`` label and entropy coefficients, writes
    the gradient over ``logits`` and returns it with the block's logprobs and entropy."""
    lse, logprobs, entropy = _torch_row_stats(_capped(logits, pre), labels.clamp(min=0), temperature)
    label_coef, entropy_coef = coefficients(logprobs, entropy)
    label_coef, entropy_coef = label_coef.unsqueeze(1), entropy_coef.unsqueeze(1)  # (R, 1)
    shift = entropy_coef * entropy.unsqueeze(1) + label_coef
    stats = _RowStats(temperature, lse.neg().unsqueeze(1), label_coef, entropy_coef.neg(), shift.neg_())
    return _grad_raw_logits(logits, stats, labels, 0, pre), logprobs, entropy


def _triton_block(logits: torch.Tensor, labels: torch.Tensor, temperature: torch.Tensor, pre: float | None,
                  coefficients: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_torch_block` through backend ``"triton"``'s two kernels (each reads the tile once)."""
    from ._triton import _grad_logits, _tile_stats

    rows = logits.shape[0]
    running = torch.zeros(4, rows, dtype=torch.float32, device=logits.device)  # max, sum exp, sum exp * z, label z
    running[0] = float("-inf")
    _tile_stats(logits, 0, labels, temperature, running, pre)
    lse = running[0] + running[1].log()  # (R,)
    entropy = lse - running[2] / running[1]
    logprobs = running[3] - lse
    label_coef, entropy_coef = coefficients(logprobs, entropy)
    coefs = torch.stack([lse, label_coef, entropy_coef, torch.addcmul(label_coef, entropy_coef, entropy)])
    return _grad_logits(logits, 0, labels, temperature, coefs, pre), logprobs, entropy


def token_total(token_loss: TokenLoss, logprobs: torch.Tensor, entropy: torch.Tensor, args: Sequence[Any],
                valid: torch.Tensor) -> torch.Tensor:
    """``token_loss(logprobs, entropy, *args)`` summed over the ``valid`` tokens of a block of ``R``, checked to be
    one floating value per token: a float32 scalar. logprobs, entropy ``(R,)`` float32."""
    per_token = token_loss(logprobs, entropy, *args)
    if not (isinstance(per_token, torch.Tensor) and per_token.shape == logprobs.shape
            and per_token.is_floating_point()):
        got = (f"{tuple(per_token.shape)} {per_token.dtype}" if isinstance(per_token, torch.Tensor)
               else type(per_token).__name__)
        raise InvalidInputError(
            "token_loss must return one floating loss per token",
            why=f"for a block of {logprobs.shape[0]} tokens it returned {got}",
            fix="return the per-token terms (shaped like the logprobs it is given), not their sum or mean: the head "
            "sums them; fold a mean's 1 / count into a per-token weight",
        )
    return torch.where(valid, per_token.float(), 0.0).sum()


def token_coefficients(token_loss: TokenLoss, logprobs: torch.Tensor, entropy: torch.Tensor,
                       args: Sequence[Any], valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`token_total` on a block and its derivatives: the block's loss (a float32 scalar, detached) and
    ``d/dlogprobs``, ``d/dentropy`` ``(R,)`` float32, 0 at ignored tokens (not ``valid``), whose values token_loss
    sees as 0 and the sum leaves out."""
    lp = torch.where(valid, logprobs, 0.0).requires_grad_()
    ent = torch.where(valid, entropy, 0.0).requires_grad_()
    with torch.enable_grad():
        total = token_total(token_loss, lp, ent, args, valid)
        if not total.requires_grad:  # a loss that reads neither value
            return total.detach(), torch.zeros_like(lp), torch.zeros_like(ent)
        d_lp, d_ent = torch.autograd.grad(total, (lp, ent), allow_unused=True)
    return (total.detach(), torch.zeros_like(lp) if d_lp is None else d_lp,
            torch.zeros_like(ent) if d_ent is None else d_ent)


def _block_coefficients(token_loss: TokenLoss, args: Sequence[Any], valid: torch.Tensor, tau: torch.Tensor,
                        loss: torch.Tensor, logprobs: torch.Tensor, entropy: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's label and entropy coefficients (the derivatives divided by the block's ``(R,)`` temperatures,
    as the gradient kernels take them); adds the block's loss into ``loss``."""
    total, d_lp, d_ent = token_coefficients(token_loss, logprobs, entropy, args, valid)
    loss.add_(total)
    return d_lp / tau, d_ent / tau


class FusedLossFunction(torch.autograd.Function):
    """hidden ``(T, H)``, weight ``(V, H)``, bias ``(V,)`` or None, labels ``(T,)`` int64, temperature ``(T, 1)``
    float32 (with a softcap, already divided by the cap), blocks of ``rows`` tokens, ``pre`` the softcap's input
    scale (None without one), backend ``"torch"`` or ``"triton"``, the per-token loss and its ``(T,)``-sliceable
    arguments (``token_args[i]`` a ``(T,)`` tensor when ``per_token[i]``, else passed whole).

    Returns the summed loss ``()`` float32 and the ``(T,)`` float32 logprobs and entropy (0 at ignored tokens).
    Only the loss is differentiable: a gradient reaching logprobs or entropy raises in backward, since the head
    kept no logits to send it through.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, rows: int, pre: float | None, backend: str,
                token_loss: TokenLoss, token_args: tuple[Any, ...], per_token: tuple[bool, ...]):
        tokens = hidden.shape[0]
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        blocks = _spans(tokens, rows)
        grad_hidden = hidden.new_empty(hidden.shape) if need_hidden else None
        grad_weight = None
        if need_weight:  # written once by one block, else summed over the blocks in float32
            one = len(blocks) == 1
            grad_weight = torch.empty_like(weight) if one else torch.zeros_like(weight, dtype=torch.float32)
        grad_bias = weight.new_zeros(weight.shape[0], dtype=torch.float32) if need_bias else None
        logprobs = hidden.new_empty(tokens, dtype=torch.float32)
        entropy = hidden.new_empty(tokens, dtype=torch.float32)
        loss = hidden.new_zeros((), dtype=torch.float32)
        valid = labels != IGNORE_INDEX
        tau = temperature.squeeze(1)  # (T,)
        block_fn = _triton_block if backend == "triton" else _torch_block
        for span in blocks:
            args = [a[span] if sliced else a for a, sliced in zip(token_args, per_token, strict=True)]
            coefficients = functools.partial(_block_coefficients, token_loss, args, valid[span], tau[span], loss)
            logits = F.linear(hidden[span], weight, bias)  # (R, V) in the input dtype
            grad, logprobs[span], entropy[span] = block_fn(logits, labels[span], temperature[span], pre, coefficients)
            if grad_bias is not None:
                grad_bias += grad.sum(0, dtype=torch.float32)
            if grad_hidden is not None:
                torch.mm(grad, weight, out=grad_hidden[span])
            if grad_weight is not None:
                if len(blocks) == 1:
                    torch.mm(grad.T, hidden[span], out=grad_weight)
                else:
                    _accumulate_mm(grad_weight, grad.T, hidden[span])
            del logits, grad
        # saved as intermediates: released by the backward (unless the graph is retained), not held by the loss
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                              None if grad_bias is None else grad_bias.to(weight.dtype))
        ctx.set_materialize_grads(False)
        return loss, torch.where(valid, logprobs, 0.0), torch.where(valid, entropy, 0.0)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor | None, grad_logprobs: torch.Tensor | None,
                 grad_entropy: torch.Tensor | None):
        if grad_logprobs is not None or grad_entropy is not None:
            raise InvalidInputError(
                "fused_loss's logprobs and entropy carry no gradient",
                why="a loss term outside token_loss reads them, and the head computed its gradients in the forward",
                fix="put that term into token_loss (a per-token function of logprobs and entropy), or detach() "
                "the logprobs / entropy you use outside it, or use logprobs_entropy for a loss of another form",
            )
        grads = [None if g is None or grad_loss is None else _scaled(g, grad_loss) for g in ctx.saved_tensors]
        return (*grads, None, None, None, None, None, None, None, None)


def _scaled(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``grad * scale`` (a float32 scalar tensor) computed in float32 and rounded once to ``grad``'s dtype (a bf16
    multiply would round the scale first: 1/3 by 0.2%), in slices of 2**26 elements to bound the float32 copy."""
    if grad.dtype == scale.dtype:
        return grad * scale
    out = torch.empty_like(grad)
    flat, flat_out = grad.reshape(-1), out.view(-1)
    for span in _spans(flat.numel(), 2**26):
        torch.mul(flat[span].float(), scale, out=flat_out[span])
    return out
