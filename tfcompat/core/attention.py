"""The shared varlen attention core: causal attention over packed sequences, with GQA.

One numerics contract for every backend: ``out[t] = softmax(scale * q[t] . k[s]) v[s]`` over the tokens
``s <= t`` of ``t``'s own sequence, query head ``h`` reading KV head ``h // (Hq // Hkv)``; scores and softmax
accumulated in fp32, output in the input dtype. Backends (each imported or probed lazily, once):

- ``"flash"``: flash-attn's varlen kernel, the newest installed that suits the GPU: FlashAttention-3
  (``flash_attn_interface``, Hopper) or FlashAttention-4 (``flash_attn.cute``, Hopper and Blackwell), else
  FlashAttention-2 (``flash_attn``). CUDA, fp16/bf16.
- ``"torch"``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 kernels inside torch; its signature
  differs between torch releases, so it is probed once). CUDA, fp16/bf16.
- ``"cudnn"``: cuDNN's fused attention over the packed stream with ``cu_seqlens``
  (``torch.ops.aten._cudnn_attention_forward``, the kernel behind SDPA's cuDNN backend on jagged nested
  tensors). CUDA, fp16/bf16, head_dim a multiple of 8 up to 128, cuDNN 9 or newer, and **forward only**: on an
  H200 (torch 2.11, cuDNN 9.19) its forward is exact but the gradients torch derives for this op are not
  (NaN and 1e38 entries in dq/dk/dv against the reference), so inputs that need a gradient cannot use it.
- ``"flex"``: ``torch.nn.attention.flex_attention``, compiled, with a document-causal block mask built once per
  forward from the boundaries (cached on the forward's ``cu_seqlens`` tensor, so every layer and the
  checkpointing recompute share it). CUDA in any floating dtype; on CPU forward only (torch has no flex
  backward there). head_dim a power of two, at least 16.
- ``"sdpa"``: ``F.scaled_dot_product_attention`` per sequence with ``is_causal`` (any device and dtype);
  the reference the others are tested against.

``"auto"`` takes the first backend of a decision table that can run the inputs. The table comes from
``bench/attention_backends.py`` (bf16, one H200, torch 2.11, cuDNN 9.19, no flash-attn; seven shapes, the
figures in bench/RESULTS.md section 6). There the per-sequence ``"sdpa"`` loop, which SDPA dispatches to cuDNN's
Hopper kernels, ran at 340-660 TFLOP/s against 260-350 for ``varlen_attn`` and 170-390 for flex wherever
sequences were long (8 x 4k at 28/4 heads: 8.5 ms forward+backward against 11.9 and 13.8), but pays about 0.3 ms
per sequence, so ``varlen_attn`` won at 8 x 1k (1.9 ms against 3.9) and, for forward+backward only, at 8 x 4k
with 16 heads of 64 (4.1 against 4.3). Measured by ``W = Hq * D * mean(L_i ** 2)``, per-sequence SDPA wins
forward+backward from ``W`` of about 2e10 and a forward alone (no gradient: reference and old-policy log-probs)
from about 8e9 (8 x 1k at 28 x 128 is 3.8e9, 8 x 4k at 16 x 64 is 1.7e10):

==========================================================  ================================================
inputs                                                      order
==========================================================  ================================================
CUDA fp16/bf16, compute capability 9.x with cuDNN >= 9,     ``flash`` (if installed), ``sdpa``
``W >= 2e10`` (``W >= 8e9`` without a gradient)
the same GPUs, no gradient, ``W < 5e9``                     ``torch``, ``flash``, ``flex``, ``cudnn``, ``sdpa``
other CUDA fp16/bf16 (shorter sequences, other GPUs, or      ``flash`` (if installed), ``torch``, ``flex``,
no boundaries given)                                        ``cudnn``, ``sdpa``
CUDA fp32, CPU                                              ``sdpa``
==========================================================  ================================================

At every shape of that run the table picked the fastest backend (forward+backward and forward). Reentrant
checkpointing runs a layer's forward without a gradient and its recomputation with one, so between the two
thresholds the two passes may run different (each exact) backends. ``flash`` leads where installed: with
FlashAttention-4 (flash-attn-4 4.0.0b36, CuTe DSL 4.8.1; same H200, bench/RESULTS.md section 10) it was the fastest
forward+backward at all eleven shapes of the script (400-620 TFLOP/s with sequences of 4k or more, 1.1-1.8x faster
than per-sequence SDPA there: 4.5 against 6.3 ms for 8 odd sequences of 20,205 tokens, 28/4 heads) and the fastest
forward from ``W`` of 7.6e9, but ``varlen_attn``'s forward beat it at 8 x 1k (28 x 128, ``W`` 3.8e9: 0.51 against
0.57 ms) and 16 x 1000 (16 x 64, ``W`` 1.0e9: 0.52 against 0.65 ms), hence the no-gradient row (between 3.8e9 and
7.6e9 the threshold is not measured). FlashAttention-3 was not measured. flex attention was exact but never the
fastest; the ``cudnn`` varlen op took 50-76 ms per forward there, nearly all of it on the host, and is forward
only: auto reaches it only when nothing else can run.

No backend syncs the host in a forward: boundaries and ``max_seqlen`` come from the `PackedSeqs`, built once.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

from ..errors import InvalidInputError
from .packing import PackedSeqs

__all__ = ["Backend", "available_backends", "document_block_mask", "select_backend", "varlen_attention"]

Backend = Literal["auto", "flash", "torch", "cudnn", "flex", "sdpa"]
AUTO_ORDER: tuple[str, ...] = ("flash", "torch", "flex", "cudnn", "sdpa")
_LONG_ORDER: tuple[str, ...] = ("flash", "sdpa")
# short sequences without a gradient: varlen_attn's forward beat FlashAttention-4's below W of about 5e9
_SHORT_NO_GRAD_ORDER: tuple[str, ...] = ("torch", "flash", "flex", "cudnn", "sdpa")
# Hq * D * mean(L_i ** 2) above which per-sequence SDPA (cuDNN on Hopper) beats varlen_attn, with and without a
# gradient, and below which varlen_attn's forward beats FlashAttention-4's: the module docstring
_PER_SEQUENCE_MIN_WORK = 2e10
_PER_SEQUENCE_MIN_WORK_NO_GRAD = 8e9
_FLASH_MIN_WORK_NO_GRAD = 5e9
_FAST_DTYPES = (torch.float16, torch.bfloat16)
_FLEX_BLOCK = 128  # flex attention's sparse block size (tokens per block row and column)


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
    return _BACKENDS[select_backend(q, backend, k=k, seqs=seqs)](q, k, v, seqs, scale)


def select_backend(
    q: torch.Tensor, backend: Backend = "auto", *, k: torch.Tensor | None = None, seqs: PackedSeqs | None = None
) -> str:
    """The backend ``varlen_attention`` uses; ``"auto"`` follows the decision table, an explicit choice that
    cannot run these inputs raises `InvalidInputError`.

    q: ``(T, Hq, D)`` (its device, dtype, head_dim and whether it needs a gradient are read); k:
    ``(T, Hkv, D)`` or None; seqs: the boundaries, or None.
    """
    if backend == "auto":
        return next(name for name in _auto_order(q, k, seqs) if _CAN_RUN[name](q, k))
    if backend not in _CAN_RUN or not _CAN_RUN[backend](q, k):
        raise InvalidInputError(
            f"attention backend {backend!r} cannot run these inputs",
            why=f"q is {q.dtype} on {q.device.type} with head_dim {q.shape[-1]}"
            f"{', needing a gradient' if _needs_grad(q, k) else ''}; usable here: {available_backends(q, k=k)}",
            supported=f"{backend!r}: {_REQUIREMENTS[backend]}" if backend in _REQUIREMENTS else ", ".join(_CAN_RUN),
            fix="use backend='auto', or inputs the backend supports (and install flash-attn for 'flash')",
        )
    return backend


def available_backends(q: torch.Tensor, *, k: torch.Tensor | None = None) -> list[str]:
    """Every backend that can run ``q`` (and ``k``), in a fixed order with ``"sdpa"`` (always usable) last;
    the order is not a ranking: `select_backend` ranks.

    q: ``(T, Hq, D)`` or any tensor whose last dimension is the head_dim; k: ``(T, Hkv, D)`` or None.
    """
    return [name for name, can_run in _CAN_RUN.items() if can_run(q, k)]


def _auto_order(q: torch.Tensor, k: torch.Tensor | None, seqs: PackedSeqs | None) -> tuple[str, ...]:
    """The decision table of the module docstring: backends to try, fastest first, ``"sdpa"`` last.

    q: ``(T, Hq, D)``.
    """
    if not _fast_cuda(q):
        return ("sdpa",)
    if seqs is not None and _hopper_cudnn_sdpa(q.device):
        work = q.shape[1] * q.shape[2] * sum(n * n for n in seqs.lengths) / len(seqs.lengths)
        if work >= (_PER_SEQUENCE_MIN_WORK if _needs_grad(q, k) else _PER_SEQUENCE_MIN_WORK_NO_GRAD):
            return _LONG_ORDER
        if work < _FLASH_MIN_WORK_NO_GRAD and not _needs_grad(q, k):
            return _SHORT_NO_GRAD_ORDER
    return AUTO_ORDER


_REQUIREMENTS = {
    "flash": "CUDA fp16/bf16 with flash-attn (2, 3 or 4) installed",
    "torch": "CUDA fp16/bf16 with torch.nn.attention.varlen.varlen_attn",
    "cudnn": "CUDA fp16/bf16 without gradients (forward only), head_dim a multiple of 8 up to 128, cuDNN >= 9, "
             "compute capability >= 8.0",
    "flex": "CUDA (any floating dtype) or CPU without gradients, head_dim a power of two >= 16, torch >= 2.6",
    "sdpa": "any device and dtype",
}


def _needs_grad(q: torch.Tensor, k: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))


def _fast_cuda(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in _FAST_DTYPES


def _can_flash(q: torch.Tensor, k: torch.Tensor | None) -> bool:
    return _fast_cuda(q) and _flash_varlen(q.device) is not None


def _can_torch(q: torch.Tensor, k: torch.Tensor | None) -> bool:
    return _fast_cuda(q) and _torch_varlen() is not None


def _can_cudnn(q: torch.Tensor, k: torch.Tensor | None) -> bool:
    d = q.shape[-1]
    return _fast_cuda(q) and not _needs_grad(q, k) and d % 8 == 0 and d <= 128 and _cudnn_usable(q.device)


def _can_flex(q: torch.Tensor, k: torch.Tensor | None) -> bool:
    d = q.shape[-1]
    if not q.is_floating_point() or d < 16 or d & (d - 1):
        return False
    if not (q.is_cuda or (q.device.type == "cpu" and not _needs_grad(q, k))):
        return False
    return _flex_api() is not None


_CAN_RUN: dict[str, Callable[[torch.Tensor, torch.Tensor | None], bool]] = {
    "flash": _can_flash, "torch": _can_torch, "cudnn": _can_cudnn, "flex": _can_flex, "sdpa": lambda q, k: True,
}


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


# ---------------------------------------------------------------------------------------------- backends


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs, scale: float) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for qs, ks, vs in zip(q.split(seqs.lengths), k.split(seqs.lengths), v.split(seqs.lengths)):
        # (L, H, D) -> (1, H, L, D)
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=gqa,
        )
        outs.append(o[0].transpose(0, 1))  # (1, H, L, D) -> (L, H, D)
    return torch.cat(outs)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs, scale: float) -> torch.Tensor:
    cu = seqs.cu_seqlens
    flash = cast(_VarlenFn, _flash_varlen(q.device))  # _can_flash: found
    out = flash(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seqs.max_seqlen,
                max_seqlen_k=seqs.max_seqlen, softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out  # FA3/FA4 releases that also return the log-sum-exp


def _torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs, scale: float) -> torch.Tensor:
    fn, extra = cast(_TorchVarlen, _torch_varlen())  # _can_torch: found
    cu = seqs.cu_seqlens
    return fn(q, k, v, cu, cu, seqs.max_seqlen, seqs.max_seqlen, scale=scale, **extra(q, k))


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs, scale: float) -> torch.Tensor:
    cu = seqs.cu_seqlens
    out = torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu, cu, seqs.max_seqlen, seqs.max_seqlen, False, 0.0, True, False, scale=scale,
    )
    return out[0]


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs, scale: float) -> torch.Tensor:
    flex = _compiled_flex(q.device.type)
    mask = document_block_mask(seqs)
    # (T, H, D) -> (1, H, T, D) views; flex returns its output in the query's memory layout
    out = flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=mask,
               scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)  # (1, H, T, D) -> (T, H, D)


_BACKENDS: dict[str, Callable[..., torch.Tensor]] = {
    "flash": _flash, "torch": _torch, "cudnn": _cudnn, "flex": _flex, "sdpa": _sdpa,
}


# ------------------------------------------------------------------------------------ flex document mask

_block_masks = WeakTensorKeyDictionary()  # a forward's cu_seqlens tensor -> its BlockMask


def document_block_mask(seqs: PackedSeqs) -> Any:
    """The flex-attention `BlockMask` of causal attention within each packed sequence, built once per forward.

    Block structure from the boundaries alone, on the device and without a host sync: with ``doc[t]`` the
    sequence of token ``t`` (tokens past ``T``, padding the last block, get the sentinel ``N``) and
    ``first[b]``, ``last[b]`` the sequences of block ``b``'s first and last token, block ``(i, j)`` is
    empty for ``j > i``, and for ``j <= i`` computed exactly when ``last[j] >= first[i]``; it needs no mask
    (full) when ``j < i`` and ``first[j] == last[i]`` (one sequence covers both blocks), else the element
    mask ``doc[q] == doc[kv] and q >= kv`` applies. The same blocks as
    ``create_block_mask(mask_mod, None, None, T, T)``, without evaluating the mask on ``(T, T)`` points.

    Cached on ``seqs.cu_seqlens`` (weakly): every layer of the forward and the checkpointing recompute,
    which replays the same `PackedSeqs`, reuse it.
    """
    cached = _block_masks.get(seqs.cu_seqlens)
    if cached is None:
        cached = _build_document_block_mask(seqs)
        _block_masks[seqs.cu_seqlens] = cached
    return cached


def _build_document_block_mask(seqs: PackedSeqs) -> Any:
    _, block_mask_cls = cast(_FlexApi, _flex_api())  # _can_flex: found
    cu, total = seqs.cu_seqlens, seqs.total
    blocks = -(-total // _FLEX_BLOCK)
    tokens = torch.arange(blocks * _FLEX_BLOCK, device=cu.device, dtype=cu.dtype)
    doc = torch.searchsorted(cu[1:], tokens, right=True).to(torch.int32)  # (blocks * 128,)
    per_block = doc.view(blocks, _FLEX_BLOCK)  # (blocks * 128,) -> (blocks, 128)
    first, last = per_block[:, 0], per_block[:, -1]
    row = torch.arange(blocks, device=cu.device)
    below = row[None, :] <= row[:, None]  # (q block i, kv block j): j <= i
    computed = below & (last[None, :] >= first[:, None])
    full = computed & (row[None, :] < row[:, None]) & (first[None, :] == last[:, None])
    partial = computed & ~full

    def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def as_blocks(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (blocks, blocks) bool -> counts (1, 1, blocks), indices (1, 1, blocks, blocks): kept columns first
        counts = keep.sum(-1, dtype=torch.int32)
        order = torch.argsort((~keep).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
        return counts[None, None], order[None, None]

    kv_num, kv_idx = as_blocks(partial)
    full_num, full_idx = as_blocks(full)
    return block_mask_cls.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=_FLEX_BLOCK,
                                         mask_mod=mask_mod, seq_lengths=(total, total))


# ----------------------------------------------------------------------------------------------- probes

# What the probes find; a backend reads its probe's result only after its `_CAN_RUN` check found it (not None).
_VarlenFn = Callable[..., torch.Tensor]
_TorchVarlen = tuple[_VarlenFn, Callable[..., dict]]  # varlen_attn, the builder of its causal/GQA kwargs
_FlexApi = tuple[_VarlenFn, Any]  # flex_attention, BlockMask


@functools.cache
def _flash_varlen(device: torch.device) -> _VarlenFn | None:
    """The newest flash-attn varlen function installed for ``device``'s GPU: FA3/FA4 on Hopper, FA4 on
    Blackwell, else FA2; None if none imports."""
    major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 0
    candidates = []
    if major == 9:
        candidates.append("flash_attn_interface")  # FlashAttention-3 (Hopper only)
    if major >= 9:
        candidates.append("flash_attn.cute")  # FlashAttention-4 (CuTe DSL: Hopper, Blackwell)
    candidates.append("flash_attn")  # FlashAttention-2
    for name in candidates:
        try:
            return importlib.import_module(name).flash_attn_varlen_func
        except (ImportError, AttributeError, OSError):  # not installed, or a build without CUDA kernels
            continue
    return None


@functools.cache
def _torch_varlen() -> _TorchVarlen | None:
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


@functools.cache
def _cudnn_usable(device: torch.device) -> bool:
    """cuDNN 9+ on a GPU of compute capability 8.0+, and a torch with the varlen cuDNN attention op."""
    if not (torch.backends.cudnn.is_available() and hasattr(torch.ops.aten, "_cudnn_attention_forward")):
        return False
    schema = torch.ops.aten._cudnn_attention_forward.default._schema
    if "cum_seq_q" not in {a.name for a in schema.arguments}:
        return False
    version = torch.backends.cudnn.version() or 0
    return version >= 90000 and torch.cuda.get_device_capability(device)[0] >= 8


@functools.cache
def _hopper_cudnn_sdpa(device: torch.device) -> bool:
    """A Hopper GPU (compute capability 9.x) with cuDNN 9+: where SDPA's causal kernel measured fastest."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return (version or 0) >= 90000 and torch.cuda.get_device_capability(device)[0] == 9


@functools.cache
def _flex_api() -> _FlexApi | None:
    """``flex_attention`` and ``BlockMask``, or None where this torch lacks them."""
    try:
        module = importlib.import_module("torch.nn.attention.flex_attention")
        block_mask_cls = module.BlockMask
        flex = module.flex_attention
    except (ImportError, AttributeError):
        return None
    if "seq_lengths" not in inspect.signature(block_mask_cls.from_kv_blocks).parameters:
        return None  # before torch 2.6: no block masks over lengths that are not multiples of the block size
    return flex, block_mask_cls


@functools.cache
def _compiled_flex(device_type: str) -> Callable[..., torch.Tensor]:
    """``flex_attention`` under ``torch.compile`` (without it flex materializes the scores). On CUDA dynamo's
    automatic dynamic shapes recompile once when the token count first changes, then reuse the kernel; on CPU
    each shape compiles statically (torch 2.13's C++ flex template fails to build with dynamic shapes)."""
    flex, _ = cast(_FlexApi, _flex_api())  # _can_flex: found
    return torch.compile(flex, dynamic=False if device_type == "cpu" else None)
