"""Non-causal attention over packed sequences: each sequence's queries attend to all of its own keys, none of another's.

Two users. The decoder of an encoder-decoder model reads the encoder's states of its own sequence: packed, the decoder
tokens of ``N`` sequences lie back to back in one stream (boundaries ``q_seqs``) and so do the encoder states
(boundaries ``k_seqs``, ``N`` too). A vision tower's attention (`tfcompat.hf.vision_attention`) reads the patches of
its own image or window: there ``q_seqs`` is ``k_seqs``. Sequence ``i``'s queries see exactly sequence ``i``'s keys
(varlen attention with ``cu_seqlens_q`` / ``cu_seqlens_k``, non-causal). Reference: stock attention of each sequence
alone (``softmax(scale * q k^T) v`` over all its keys), which transformers' SDPA and eager paths compute per image,
window or sequence.

Backends, as `tfcompat.core.attention`'s where they exist for non-causal attention:

- ``"flash"``: flash-attn's varlen function (FA2, FA3 or FA4, the newest installed that suits the GPU) with
  ``causal=False``; CUDA fp16/bf16.
- ``"torch"``: ``torch.nn.attention.varlen.varlen_attn`` without causality; CUDA fp16/bf16.
- ``"sdpa"``: ``F.scaled_dot_product_attention`` per sequence (any device and dtype): the numerics of stock SDPA
  per image, window or sequence, and the reference the others are tested against.

``"auto"`` takes the first of ``flash``, ``torch``, ``sdpa`` that can run the inputs, except where the causal
core's table sends long sequences to per-sequence SDPA (Hopper with cuDNN 9, ``Hq * D * mean(L_i ** 2)`` from 2e10
with a gradient: `tfcompat.core.attention`'s thresholds, measured for causal attention). ``"flex"`` and ``"cudnn"``
have no non-causal path here: asked for them (the text model's backend), this runs per-sequence SDPA, which is exact.
The varlen kernels need no host sync; per-sequence SDPA splits on the host lengths of the `PackedSeqs`.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F

from ..errors import InvalidInputError
from .attention import (
    Backend,
    _auto_order,
    _can_flash,
    _can_torch,
    _flash_head_dim_gap,
    _flash_varlen,
    _pad_dims,
    _torch_varlen,
    _TorchVarlen,
    _VarlenFn,
)
from .packing import PackedSeqs

__all__ = ["cross_attention"]


def cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_seqs: PackedSeqs, k_seqs: PackedSeqs, *,
                    scale: float | None = None, backend: Backend = "auto") -> torch.Tensor:
    """Per-sequence, non-causal attention of packed queries to packed keys.

    q: ``(Tq, Hq, D)``, the queries of ``q_seqs``; k: ``(Tk, Hkv, D)`` and v: ``(Tk, Hkv, Dv)``, the keys and values of
    ``k_seqs`` (``Hq`` a multiple of ``Hkv``: query head ``h`` reads KV head ``h // (Hq // Hkv)``). backend: as the
    module docstring. Returns ``(Tq, Hq, Dv)`` in q's dtype. `InvalidInputError` where the shapes and boundaries
    disagree, or an explicit ``"flash"`` / ``"torch"`` cannot run the inputs.
    """
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
        raise InvalidInputError("cross-attention takes q (Tq, Hq, D), k (Tk, Hkv, D) and v (Tk, Hkv, Dv)",
                                why=f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise InvalidInputError("the query heads are not a multiple of the key heads",
                                why=f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype or not q.is_floating_point():
        raise InvalidInputError("q, k and v must share one floating dtype", why=f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if len(q_seqs.lengths) != len(k_seqs.lengths) or q.shape[0] != q_seqs.total or k.shape[0] != k_seqs.total:
        raise InvalidInputError(
            "the packed boundaries of the queries and of the keys do not match the tokens",
            why=f"{len(q_seqs.lengths)} query sequences over {q.shape[0]} tokens (boundaries: {q_seqs.total}), "
            f"{len(k_seqs.lengths)} key sequences over {k.shape[0]} tokens (boundaries: {k_seqs.total})",
            fix="pass one encoder state sequence per packed decoder sequence (tfcompat.pack)")
    name = _backend(q, k, v, q_seqs, backend)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if name == "sdpa":
        return _sdpa(q, k, v, q_seqs, k_seqs, scale)
    v_dim = v.shape[-1]
    q, k, v = _pad_dims(q, k, v)
    if name == "flash":
        flash = cast(_VarlenFn, _flash_varlen(q.device))  # _backend: found
        out = flash(q, k, v, cu_seqlens_q=q_seqs.cu_seqlens, cu_seqlens_k=k_seqs.cu_seqlens,
                    max_seqlen_q=q_seqs.max_seqlen, max_seqlen_k=k_seqs.max_seqlen, softmax_scale=scale, causal=False)
        out = out[0] if isinstance(out, tuple) else out  # FA3/FA4 releases that also return the log-sum-exp
    else:
        fn, params = cast(_TorchVarlen, _torch_varlen())  # _backend: found
        kwargs: dict[str, Any] = {"is_causal": False} if "is_causal" in params else {"window_size": (-1, -1)}
        if "enable_gqa" in params:  # torch 2.11: GQA is native, no flag
            kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
        out = fn(q, k, v, q_seqs.cu_seqlens, k_seqs.cu_seqlens, q_seqs.max_seqlen, k_seqs.max_seqlen, scale=scale,
                 **kwargs)
    return out[..., :v_dim]


def _backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_seqs: PackedSeqs, backend: str) -> str:
    """The backend that runs these inputs: an explicit ``"flash"`` / ``"torch"`` if it can (else
    `InvalidInputError`), ``"sdpa"`` for ``"sdpa"``, ``"flex"`` and ``"cudnn"``, else the first of ``"auto"``'s."""
    dim_gap = _flash_head_dim_gap(q.device, max(q.shape[-1], v.shape[-1]))  # flash runs q/k and v padded to one
    runs = {"flash": _can_flash(q, k) and not dim_gap, "torch": _can_torch(q, k), "sdpa": True}
    if backend in ("flash", "torch"):
        if not runs[backend]:
            raise InvalidInputError(
                f"attention backend {backend!r} cannot run this non-causal attention",
                why=f"q {q.dtype} on {q.device}, head dim {q.shape[-1]}" + (f": {dim_gap}" if dim_gap else ""),
                supported="flash: CUDA fp16/bf16 with flash-attn installed (FlashAttention-4 on Hopper: head dims that "
                "are multiples of 32); torch: CUDA fp16/bf16 with torch.nn.attention.varlen.varlen_attn",
                fix="use backend='auto' or 'sdpa'")
        return backend
    if backend != "auto":
        return "sdpa"
    return next(name for name in _auto_order(q, k, q_seqs) if runs.get(name))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_seqs: PackedSeqs, k_seqs: PackedSeqs, scale: float
          ) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for qs, ks, vs in zip(q.split(q_seqs.lengths), k.split(k_seqs.lengths), v.split(k_seqs.lengths)):
        # (L, H, D) -> (1, H, L, D)
        o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                           vs.transpose(0, 1)[None], scale=scale, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))  # (1, H, Lq, Dv) -> (Lq, H, Dv)
    return torch.cat(outs)
