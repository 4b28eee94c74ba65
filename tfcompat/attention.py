"""The shared varlen attention core: causal attention over packed sequences, with GQA.

One numerics contract for every backend: ``out[t] = softmax(scale * q[t] . k[s]) v[s]`` over the tokens
``s <= t`` of ``t``'s own sequence, query head ``h`` reading KV head ``h // (Hq // Hkv)``; softmax
accumulated in fp32, output in the input dtype. Backends:

- ``"flash"``: flash-attn's ``flash_attn_varlen_func`` (CUDA, fp16/bf16; imported lazily).
- ``"torch"``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16; its signature differs between
  torch releases, so it is probed once).
- ``"sdpa"``: ``F.scaled_dot_product_attention`` per sequence with ``is_causal`` (any device and dtype);
  the reference the others are tested against.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Callable, Literal

import torch
import torch.nn.functional as F

from .errors import InvalidInputError
from .packing import PackedSeqs

__all__ = ["Backend", "varlen_attention", "available_backends", "select_backend"]

Backend = Literal["auto", "flash", "torch", "sdpa"]
_FAST_DTYPES = (torch.float16, torch.bfloat16)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqs: PackedSeqs,
    *,
    scale: float | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Causal attention within each packed sequence.

    q: ``(T, Hq, D)``; k, v: ``(T, Hkv, D)`` with ``Hq % Hkv == 0``; ``T == seqs.total``.
    Returns ``(T, Hq, D)`` in ``q.dtype``.
    """
    _check(q, k, v, seqs)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _BACKENDS[select_backend(q, backend)](q, k, v, seqs, scale)


def select_backend(q: torch.Tensor, backend: Backend = "auto") -> str:
    """The backend ``varlen_attention`` uses for ``q``; an explicit choice that cannot run raises."""
    usable = available_backends(q)
    if backend == "auto":
        return usable[0]
    if backend not in usable:
        raise InvalidInputError(
            f"attention backend {backend!r} cannot run these inputs",
            why=f"q is {q.dtype} on {q.device.type}; usable here: {usable}",
            fix="use backend='auto', or fp16/bf16 CUDA tensors for 'flash'/'torch' (and install flash-attn for 'flash')",
        )
    return backend


def available_backends(q: torch.Tensor) -> list[str]:
    """Backends that can run ``q``'s device and dtype, fastest first (``"sdpa"`` always last)."""
    usable = []
    if q.is_cuda and q.dtype in _FAST_DTYPES:
        if _flash_varlen() is not None:
            usable.append("flash")
        if _torch_varlen() is not None:
            usable.append("torch")
    return [*usable, "sdpa"]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs) -> None:
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape:
        raise InvalidInputError(
            "varlen attention takes q (T, Hq, D) and k, v (T, Hkv, D)",
            why=f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}",
        )
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise InvalidInputError(
            "q and k/v disagree on tokens or head_dim, or Hq is not a multiple of Hkv",
            why=f"q {tuple(q.shape)}, k {tuple(k.shape)}",
        )
    if q.dtype != k.dtype or q.dtype != v.dtype or not q.is_floating_point():
        raise InvalidInputError(
            "q, k and v must share one floating dtype", why=f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if q.shape[0] != seqs.total:
        raise InvalidInputError(
            "the packed boundaries do not cover the tokens",
            why=f"{q.shape[0]} tokens but the sequences sum to {seqs.total}",
        )


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs, scale: float) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for qs, ks, vs in zip(q.split(seqs.lengths), k.split(seqs.lengths), v.split(seqs.lengths)):
        # (L, H, D) -> (1, H, L, D)
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=gqa,
        )
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs, scale: float) -> torch.Tensor:
    fn = _flash_varlen()
    cu = seqs.cu_seqlens
    return fn(q, k, v, cu, cu, seqs.max_seqlen, seqs.max_seqlen, softmax_scale=scale, causal=True)


def _torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs, scale: float) -> torch.Tensor:
    fn, extra = _torch_varlen()
    cu = seqs.cu_seqlens
    return fn(q, k, v, cu, cu, seqs.max_seqlen, seqs.max_seqlen, scale=scale, **extra(q, k))


_BACKENDS: dict[str, Callable[..., torch.Tensor]] = {"flash": _flash, "torch": _torch, "sdpa": _sdpa}


@functools.cache
def _flash_varlen() -> Callable[..., torch.Tensor] | None:
    try:
        return importlib.import_module("flash_attn").flash_attn_varlen_func
    except (ImportError, AttributeError, OSError):  # not installed, or a build without CUDA kernels
        return None


@functools.cache
def _torch_varlen() -> tuple[Callable[..., torch.Tensor], Callable[..., dict]] | None:
    """``varlen_attn`` and a builder of its causal/GQA kwargs, from its signature on this torch."""
    try:
        fn = importlib.import_module("torch.nn.attention.varlen").varlen_attn
    except (ImportError, AttributeError):
        return None
    params = inspect.signature(fn).parameters
    if "scale" not in params or not ({"is_causal", "window_size"} & params.keys()):
        return None  # a varlen_attn this code does not know how to make causal and scaled: not usable
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        return fn, lambda q, k: {**causal, "enable_gqa": q.shape[1] != k.shape[1]}
    return fn, lambda q, k: causal  # torch 2.11: GQA is native, no flag
