"""The fused SwiGLU MLP's last part, ``down_proj(silu(a) * b)``, as two autograd nodes that hold ``a`` and ``b`` only.

``a = gate_proj(x)`` and ``b = up_proj(x)`` come from the module's own projections (run as they are). Liger's
SiLUMul followed by the down projection holds ``a``, ``b`` and the activation ``c = silu(a) * b`` (each ``T x I``)
from the forward to the backward, and its backward holds ``c`` and ``dc`` (the down projection's input gradient)
whole at once: at 70,703 tokens and I = 18,944, 5 GiB at the layer's backward peak. Here:

- `_Saved` holds ``a``, ``b`` and the down projection's weight, and computes nothing;
- `_Down` computes ``c`` (Liger's kernel) and ``y = c @ W.T (+ bias)`` and holds nothing. Its backward takes
  ``a``, ``b``, ``W`` from `_Saved` and, over blocks of rows (about `BLOCK_ELEMENTS` of ``c`` each), recomputes
  the block's ``c``, adds ``dy.T @ c`` into the weight's gradient (float32 when there are several blocks, rounded
  once), computes ``dc = dy @ W`` and overwrites the block of ``a`` and ``b`` with their gradients (Liger's
  backward kernel, in place as Liger's SiLUMul does).

Why two nodes: under gradient checkpointing a layer's recompute stops once it has rebuilt the last tensor the
layer saved, here `_Saved`'s, so it runs neither the activation nor the down matmul; one autograd Function saves
only after its forward has run, so its recompute would run the down matmul too. The activation is computed once
in the forward and once in the backward, as with SiLUMul under checkpointing (once more without it).

In one block every gradient is what Liger's SiLUMul + linear compute, with the same kernels on the same shapes. In
several, each block's ``dy @ W`` may take another cuBLAS kernel than the whole one (another summation order) and
the weight's gradient is summed over the blocks in float32, rounded once. One backward per forward: the first
overwrites ``a`` and ``b``, and a second raises.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch.nn.modules import module as _module

from ..errors import PatchedModelError

__all__ = ["BLOCK_ELEMENTS", "swiglu_down", "usable"]

BLOCK_ELEMENTS = 2**29
"""Elements of ``c`` per backward block (1 GiB in bf16, as its gradient): the backward's transient memory, against
a float32 accumulator for the weight's gradient, read and written once per block. A Qwen2.5-7B-shaped layer
(I = 18,944) takes one block up to 28,339 tokens, so the 28-layer step of 19,679 tokens pays no accumulator:
with 2**28 it ran 1.2% slower (two blocks), and at 70,703 tokens 2**27 lowered the peak by 0.03 GiB only
(bench/RESULTS.md section 21)."""


def swiglu_down(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                kernels: types.SimpleNamespace) -> torch.Tensor:
    """``F.linear(silu(a) * b, weight, bias)``. a, b ``(..., I)`` of one dtype and shape, weight ``(H, I)`` and
    bias ``(H,)`` of that dtype; ``kernels``: Liger's ``swiglu_forward(a, b) -> (a, b, c)`` and
    ``swiglu_backward(a, b, dc)`` (overwrites ``a``, ``b`` with their gradients). Returns ``(..., H)``."""
    a, b = a.contiguous(), b.contiguous()
    token = _Saved.apply(a, b, weight)
    return _Down.apply(token, a, b, weight, bias, kernels)


class _Saved(torch.autograd.Function):
    """Holds a, b and the weight for `_Down`'s backward; its output is an empty tensor that carries its node."""

    @staticmethod
    def forward(ctx, a, b, weight):
        ctx.save_for_backward(a, b, weight)
        ctx.set_materialize_grads(False)
        return a.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        return None, None, None  # `_Down` returns the gradients of a, b and the weight


class _Down(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, a, b, weight, bias, kernels):
        ctx.saved = token.grad_fn  # `_Saved`'s node: its saved tensors are this node's
        ctx.kernels = kernels
        ctx.used = False
        return F.linear(kernels.swiglu_forward(a, b)[2], weight, bias)

    @staticmethod
    def backward(ctx, dy):
        if ctx.used:
            raise PatchedModelError(
                "the fused SwiGLU MLP allows one backward per forward",
                why="its first backward wrote the gradients of gate_proj's and up_proj's outputs over them",
                fix="run the forward again before another backward, or patch with fused=False (or without "
                    "'swiglu') for retain_graph / double backward")
        ctx.used = True
        a, b, weight = ctx.saved.saved_tensors
        need_a, need_b, need_w, need_bias = ctx.needs_input_grad[1:5]
        width = a.shape[-1]
        a2, b2, dy2 = a.view(-1, width), b.view(-1, width), dy.reshape(-1, weight.shape[0])  # (T, I), (T, H)
        step = max(1, BLOCK_ELEMENTS // width)
        blocks = [slice(r, r + step) for r in range(0, a2.shape[0], step)]
        grad_w = None
        if need_w:
            grad_w = (torch.empty_like(weight) if len(blocks) == 1
                      else torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)))
        for rows in blocks:
            if grad_w is not None:
                c = ctx.kernels.swiglu_forward(a2[rows], b2[rows])[2]  # (R, I)
                if len(blocks) == 1:
                    torch.mm(dy2[rows].T, c, out=grad_w)
                else:
                    _add_product(grad_w, dy2[rows].T, c)
                del c
            if need_a or need_b:
                ctx.kernels.swiglu_backward(a2[rows], b2[rows], dy2[rows] @ weight)  # a, b <- da, db
        grad_bias = dy2.sum(0) if need_bias else None
        return (None, a if need_a else None, b if need_b else None,
                None if grad_w is None else grad_w.to(weight.dtype), grad_bias, None)


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` wider than a and b: on CUDA cuBLAS adds the float32 product into ``acc``
    (``out_dtype``), elsewhere a and b are widened first."""
    if acc.is_cuda and acc.dtype != a.dtype:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def usable(down: torch.nn.Module, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `swiglu_down` computes what ``down(silu(a) * b)`` would: a plain ``nn.Linear`` without hooks or an
    instance forward (a LoRA or a quantized layer is not), plain weights of a and b's dtype, no autocast, not under
    torch.compile (`_Down` reads `_Saved`'s node, which a traced graph has not), and a gradient to compute (else the
    caller's path holds nothing anyway)."""
    if type(down) is not torch.nn.Linear or "forward" in vars(down) or torch.compiler.is_compiling():
        return False
    hooks = (down._forward_hooks, down._forward_pre_hooks, _module._global_forward_hooks,
             _module._global_forward_pre_hooks)
    plain = (torch.Tensor, torch.nn.Parameter)
    weight, bias = down.weight, down.bias
    return (not any(hooks) and type(weight) in plain and (bias is None or type(bias) in plain)
            and torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or weight.requires_grad)
            and a.shape == b.shape and a.dtype == b.dtype == weight.dtype
            and not torch.is_autocast_enabled(a.device.type))
