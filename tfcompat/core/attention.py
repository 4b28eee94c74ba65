"""The shared varlen attention core: causal attention over packed sequences, with GQA and the attention
features decoder models use (`AttentionFeatures`: sliding windows, logit softcapping, attention sinks, chunked
attention; q/k head dim different from v's; any scale).

One numerics contract for every backend: ``out[t] = softmax(x[t, s]) v[s]`` over the keys ``s`` that ``t`` sees
(``s <= t`` in ``t``'s own sequence, and ``s > t - window`` with a window), with ``x = scale * q[t] . k[s]``,
``x -> softcap * tanh(x / softcap)`` with a softcap, and with sinks one more logit ``sinks[h]`` in the softmax
that has no value (``out = out_plain * sigmoid(lse - sinks[h])``, ``lse`` the log-sum-exp of ``x`` over the seen
keys); query head ``h`` reads KV head ``h // (Hq // Hkv)``; scores and softmax accumulated in fp32, output in the
input dtype. Chunked attention needs nothing here: its chunks are sequences (`tfcompat.core.packing.chunked`).
Backends (each imported or probed lazily, once; `unsupported` says which features each cannot run):

- ``"flash"``: flash-attn's varlen kernel, the newest installed that suits the GPU: FlashAttention-3
  (``flash_attn_interface``, Hopper) or FlashAttention-4 (``flash_attn.cute``, Hopper and Blackwell), else
  FlashAttention-2 (``flash_attn``). CUDA, fp16/bf16. Windows and softcaps where the installed function takes
  ``window_size`` / ``softcap``; sinks only where it takes ``learnable_sink`` (FlashAttention-4, with a backward
  for it; vLLM's FA3 ``s_aux`` is not taken: no backward is known for it; the log-sum-exp FA2/FA3 return carries no
  gradient, so sinks cannot be derived from it exactly);
  v of another head dim than q/k is zero-padded to the larger dim and the output sliced, as transformers does.
  FlashAttention-4 on Hopper runs only head dims that are multiples of 32: its 4.0.0b36 backward is wrong at 80 and
  112 (every gradient off by about its own size, causal or not; 112 non-causal does not compile) and right at 32,
  64, 96, 128, 160, 192 and 256 (H100, ``bench/flash_head_dims.py``); a vision tower of head dim 80 (Qwen2-VL's,
  Qwen2.5-VL's) takes another backend there.
- ``"torch"``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 kernels inside torch; its signature
  differs between torch releases, so it is probed once). CUDA, fp16/bf16. Windows where it takes
  ``window_size``; no softcap; no sinks (its backward drops the log-sum-exp's gradient); v padded as for flash.
- ``"cudnn"``: cuDNN's fused attention over the packed stream with ``cu_seqlens``
  (``torch.ops.aten._cudnn_attention_forward``, the kernel behind SDPA's cuDNN backend on jagged nested
  tensors). CUDA, fp16/bf16, head_dim a multiple of 8 up to 128, cuDNN 9 or newer, and **forward only**: on an
  H200 (torch 2.11, cuDNN 9.19) its forward is exact but the gradients torch derives for this op are not
  (NaN and 1e38 entries in dq/dk/dv against the reference), so inputs that need a gradient cannot use it.
  Plain causal attention only: no window, softcap or sinks, one head dim for q/k and v.
- ``"flex"``: ``torch.nn.attention.flex_attention``, compiled, with a document-causal block mask built once per
  forward from the boundaries (cached on the forward's ``cu_seqlens`` tensor, so every layer and the
  checkpointing recompute share it). CUDA in any floating dtype; on CPU forward only (torch has no flex
  backward there). q/k and v head dims powers of two, at least 16. Windows in the block mask (one mask per
  window size per forward), softcaps as a ``score_mod``, sinks from the log-sum-exp it returns (differentiable;
  CUDA only: torch's CPU flex template returns none).
- ``"sdpa"``: ``F.scaled_dot_product_attention`` per sequence with ``is_causal`` (any device and dtype), with a
  boolean window mask where there is a window, and an explicit fp32 softmax per sequence (the sink as one more
  column) where there is a softcap or sinks; every feature, exactly: the reference the others are tested against.

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
``W >= 2e10`` (``W >= 8e9`` without a gradient), plain
causal attention (no window, softcap or sinks)
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
only: auto reaches it only when nothing else can run. Each backend in the order is taken only if it can run the
layer's features (`unsupported`); "sdpa" can run all of them. A window at least as long as the longest sequence is
no window and is dropped first, so it does not steer the choice.

No backend syncs the host in a forward: boundaries and ``max_seqlen`` come from the `PackedSeqs`, built once.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

from ..errors import InvalidInputError
from .packing import PackedSeqs

__all__ = [
    "AttentionFeatures",
    "Backend",
    "available_backends",
    "document_block_mask",
    "select_backend",
    "unsupported",
    "varlen_attention",
]

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


class AttentionFeatures(NamedTuple):
    """What one attention layer does beyond causal attention within each sequence (all off by default).

    window: sliding window: query ``t`` sees key ``s`` of its sequence iff ``t - window < s <= t`` (the last
        ``window`` tokens, itself included). This is transformers' ``sliding_window`` in the masks of eager and
        sdpa: ``masking_utils.sliding_window_overlay`` is ``kv_idx > q_idx - sliding_window`` (with
        ``causal_mask_function``'s ``kv_idx <= q_idx``) in 4.53.3, 4.57.6 and 5.24.0 alike; its flash-attention
        path gives ``window_size = (sliding_window - 1, sliding_window - 1)`` (the same window) from 4.57, but
        ``(sliding_window, sliding_window)`` (one token more) in 4.53.3, where stock flash and stock eager differ.
    softcap: logit softcapping after the scaling: ``x -> softcap * tanh(x / softcap)`` (gemma2's eager).
    sinks: a learnable sink logit per query head (gpt-oss ``s_aux``): one more softmax column with no value.
    chunk: chunked attention (llama4): a query sees only keys of its own chunk, chunks of ``chunk`` tokens counted
        from the start of its sequence (transformers' ``chunked_overlay``: ``kv_idx // chunk == q_idx // chunk``
        on positions from the sequence start). The caller cuts the boundaries at the chunk edges
        (`tfcompat.core.packing.chunked`); `varlen_attention` has no chunk argument.
    """

    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    chunk: int | None = None


_PLAIN = AttentionFeatures()


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqs: PackedSeqs,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Causal attention within each packed sequence, with the features of the module docstring.

    q: ``(T, Hq, Dqk)``; k: ``(T, Hkv, Dqk)``; v: ``(T, Hkv, Dv)``, ``Hq % Hkv == 0``, ``T == seqs.total``.
    scale: default ``Dqk ** -0.5``. window, softcap: as `AttentionFeatures`. sinks: ``(Hq,)`` sink logits (any
    floating dtype; differentiable), or None.
    Returns ``(T, Hq, Dv)`` in ``q.dtype``.
    """
    _check(q, k, v, seqs, sinks)
    reason = _invalid(AttentionFeatures(window, softcap))
    if reason:
        raise InvalidInputError("invalid attention features", why=reason,
                                fix="pass a positive int window and a positive finite softcap, or None")
    if window is not None and window >= seqs.max_seqlen:
        window = None  # every key of every sequence is inside it: plain causal attention
    call = _Call(q.shape[-1] ** -0.5 if scale is None else scale, window, softcap, sinks)
    features = AttentionFeatures(window, softcap, sinks is not None)
    name = select_backend(q, backend, k=k, seqs=seqs, features=features, v_dim=v.shape[-1])
    return _BACKENDS[name](q, k, v, seqs, call)


class _Call(NamedTuple):
    """One call's scalars and sinks, as the backends take them (window None when it covers every sequence)."""

    scale: float
    window: int | None
    softcap: float | None
    sinks: torch.Tensor | None


def select_backend(
    q: torch.Tensor,
    backend: Backend = "auto",
    *,
    k: torch.Tensor | None = None,
    seqs: PackedSeqs | None = None,
    features: AttentionFeatures | None = None,
    v_dim: int | None = None,
) -> str:
    """The backend ``varlen_attention`` uses; ``"auto"`` follows the decision table and skips backends that
    cannot run ``features``; an explicit choice that cannot run these inputs or features raises
    `InvalidInputError`.

    q: ``(T, Hq, Dqk)`` (its device, dtype, head_dim and whether it needs a gradient are read); k:
    ``(T, Hkv, Dqk)`` or None; seqs: the boundaries, or None; features: default none; v_dim: v's head dim
    (default q's).
    """
    features = _PLAIN if features is None else features
    qk_dim = q.shape[-1]
    v_dim = qk_dim if v_dim is None else v_dim
    plain = features == _PLAIN and v_dim == qk_dim  # every backend that can run the inputs runs these
    if backend == "auto":
        return next(name for name in _auto_order(q, k, seqs, features == _PLAIN)
                    if _CAN_RUN[name](q, k) and (plain or not _gap(name, features, qk_dim, v_dim, q.device)))
    if backend not in _CAN_RUN or not _CAN_RUN[backend](q, k):
        dim_gap = _flash_head_dim_gap(q.device, qk_dim) if backend == "flash" else ""
        raise InvalidInputError(
            f"attention backend {backend!r} cannot run these inputs",
            why=f"q is {q.dtype} on {q.device.type} with head_dim {q.shape[-1]}"
            f"{', needing a gradient' if _needs_grad(q, k) else ''}; usable here: {available_backends(q, k=k)}"
            + (f"; {dim_gap}" if dim_gap else ""),
            supported=f"{backend!r}: {_REQUIREMENTS[backend]}" if backend in _REQUIREMENTS else ", ".join(_CAN_RUN),
            fix="use backend='auto', or inputs the backend supports (and install flash-attn for 'flash')",
        )
    reason = "" if plain else _gap(backend, features, qk_dim, v_dim, q.device)
    if reason:
        raise InvalidInputError(
            f"attention backend {backend!r} cannot run these attention features",
            why=reason,
            supported="'sdpa' runs every feature; see tfcompat.core.attention.unsupported",
            fix="use backend='auto' (it skips backends that cannot run a layer's features), or 'sdpa'",
        )
    return backend


def unsupported(
    backend: str, features: AttentionFeatures, *, qk_dim: int, v_dim: int, device: torch.device | None = None
) -> str:
    """Why ``backend`` cannot run attention with ``features`` and these head dims, or ``""`` if it can.

    Read at patch time, before any forward: it judges the features against what is installed (for "flash" the
    flash-attn that `varlen_attention` would import on ``device``, default the current CUDA device), not whether
    the backend can run on a device or dtype at all (that is `select_backend`'s question per call). "auto" can
    run every valid feature set ("sdpa" can); invalid values (a window below 1, a softcap not positive and finite,
    a chunk below 1) are refused by every backend.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return _gap(backend, features, qk_dim, v_dim, device)


def available_backends(q: torch.Tensor, *, k: torch.Tensor | None = None) -> list[str]:
    """Every backend that can run ``q`` (and ``k``), in a fixed order with ``"sdpa"`` (always usable) last;
    the order is not a ranking: `select_backend` ranks.

    q: ``(T, Hq, D)`` or any tensor whose last dimension is the head_dim; k: ``(T, Hkv, D)`` or None.
    """
    return [name for name, can_run in _CAN_RUN.items() if can_run(q, k)]


def _auto_order(
    q: torch.Tensor, k: torch.Tensor | None, seqs: PackedSeqs | None, plain: bool = True
) -> tuple[str, ...]:
    """The decision table of the module docstring: backends to try, fastest first, ``"sdpa"`` last.

    q: ``(T, Hq, D)``. plain: no window, softcap or sinks (per-sequence SDPA is fast only for plain causal
    attention; with a feature it takes a mask or the fp32 math path).
    """
    if not _fast_cuda(q):
        return ("sdpa",)
    if plain and seqs is not None and _hopper_cudnn_sdpa(q.device):
        work = q.shape[1] * q.shape[2] * sum(n * n for n in seqs.lengths) / len(seqs.lengths)
        if work >= (_PER_SEQUENCE_MIN_WORK if _needs_grad(q, k) else _PER_SEQUENCE_MIN_WORK_NO_GRAD):
            return _LONG_ORDER
        if work < _FLASH_MIN_WORK_NO_GRAD and not _needs_grad(q, k):
            return _SHORT_NO_GRAD_ORDER
    return AUTO_ORDER


_REQUIREMENTS = {
    "flash": "CUDA fp16/bf16 with flash-attn (2, 3 or 4) installed; FlashAttention-4 on Hopper: head dims that are "
             "multiples of 32",
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
    return _fast_cuda(q) and _flash_varlen(q.device) is not None and not _flash_head_dim_gap(q.device, q.shape[-1])


@functools.cache
def _flash_head_dim_gap(device: torch.device, head_dim: int) -> str:
    """Why the installed flash-attn cannot run ``head_dim`` (q/k and v padded to one) on ``device``, or ``""``:
    FlashAttention-4 on Hopper at a head dim that is not a multiple of 32 (the module docstring's measurement)."""
    fn = _flash_varlen(device)
    if fn is None or device.type != "cuda" or not fn.__module__.startswith("flash_attn.cute"):
        return ""
    if torch.cuda.get_device_capability(device)[0] == 9 and head_dim % 32:
        return (f"FlashAttention-4 on Hopper computes wrong gradients at head dim {head_dim} (4.0.0b36: at 80 and "
                "112; right at multiples of 32)")
    return ""


def _can_torch(q: torch.Tensor, k: torch.Tensor | None) -> bool:
    return _fast_cuda(q) and _torch_varlen() is not None


def _can_cudnn(q: torch.Tensor, k: torch.Tensor | None) -> bool:
    d = q.shape[-1]
    return _fast_cuda(q) and not _needs_grad(q, k) and d % 8 == 0 and d <= 128 and _cudnn_usable(q.device)


def _can_flex(q: torch.Tensor, k: torch.Tensor | None) -> bool:
    if not q.is_floating_point() or not _pow2_dim(q.shape[-1]):
        return False
    if not (q.is_cuda or (q.device.type == "cpu" and not _needs_grad(q, k))):
        return False
    return _flex_api() is not None


def _pow2_dim(d: int) -> bool:
    return d >= 16 and not d & (d - 1)


_CAN_RUN: dict[str, Callable[[torch.Tensor, torch.Tensor | None], bool]] = {
    "flash": _can_flash, "torch": _can_torch, "cudnn": _can_cudnn, "flex": _can_flex, "sdpa": lambda q, k: True,
}


# ---------------------------------------------------------------------------------- features per backend


def _invalid(features: AttentionFeatures) -> str:
    """Why ``features`` are not a valid feature set, or ``""``."""
    for name in ("window", "chunk"):
        value = getattr(features, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"{name} must be a positive int or None, got {value!r}"
    cap = features.softcap
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf):
        return f"softcap must be a positive finite number or None, got {cap!r}"
    return ""


@functools.cache
def _gap(backend: str, features: AttentionFeatures, qk_dim: int, v_dim: int, device: torch.device) -> str:
    """`unsupported` with every argument given (cached: `select_backend` asks it per layer call)."""
    reason = _invalid(features)
    if reason or backend in ("auto", "sdpa"):
        return reason
    if backend not in _FEATURE_GAPS:
        return f"unknown attention backend {backend!r} (one of {', '.join(_CAN_RUN)}, or 'auto')"
    return _FEATURE_GAPS[backend](features, qk_dim, v_dim, device)


def _flash_gaps(features: AttentionFeatures, qk_dim: int, v_dim: int, device: torch.device) -> str:
    fn = _flash_varlen(device)
    if fn is None:  # not installed: whether it can run at all is select_backend's question; sinks need FA4
        return "no installed flash-attn takes attention sinks (FlashAttention-4's learnable_sink)" \
            if features.sinks else ""
    params = _params(fn)
    name = f"{fn.__module__}.flash_attn_varlen_func"
    dim_gap = _flash_head_dim_gap(device, max(qk_dim, v_dim))  # q/k and v run padded to the larger dim
    if dim_gap:
        return dim_gap
    if features.window is not None and "window_size" not in params:
        return f"{name} has no window_size (sliding windows need flash-attn >= 2.3)"
    if features.softcap is not None and "softcap" not in params:
        return f"{name} has no softcap (softcapping needs flash-attn >= 2.6)"
    if features.sinks and "learnable_sink" not in params:
        return f"{name} takes no attention sinks and its log-sum-exp carries no gradient (FlashAttention-4's " \
               "learnable_sink does)"
    return ""


def _torch_gaps(features: AttentionFeatures, qk_dim: int, v_dim: int, device: torch.device) -> str:
    probe = _torch_varlen()
    if features.softcap is not None:
        return "torch's varlen_attn has no softcap"
    if features.sinks:
        return "torch's varlen_attn takes no attention sinks and its backward drops the log-sum-exp's gradient"
    if features.window is not None and (probe is None or "window_size" not in probe[1]):
        return "this torch's varlen_attn has no window_size"
    return ""


def _cudnn_gaps(features: AttentionFeatures, qk_dim: int, v_dim: int, device: torch.device) -> str:
    named = [n for n, on in (("a sliding window", features.window is not None),
                             ("a softcap", features.softcap is not None), ("attention sinks", features.sinks))
             if on]
    if named:
        return f"the cuDNN varlen op runs plain causal attention only, not {' or '.join(named)}"
    if qk_dim != v_dim:
        return f"the cuDNN varlen op takes one head dim for q/k and v, not {qk_dim} and {v_dim}"
    return ""


def _flex_gaps(features: AttentionFeatures, qk_dim: int, v_dim: int, device: torch.device) -> str:
    if _flex_api() is None:
        return "this torch has no flex attention with block masks over any length (torch >= 2.6)"
    if not (_pow2_dim(qk_dim) and _pow2_dim(v_dim)):
        return f"flex attention takes head dims that are powers of two >= 16, not q/k {qk_dim} and v {v_dim}"
    if features.sinks and device.type != "cuda":
        return "flex attention compiled on CPU returns no log-sum-exp (torch's CPU flex template), so no sinks"
    if features.softcap is not None and features.window is not None and device.type == "cuda":
        # measured on an H200 with torch 2.11: the compile fails ("all unwrapped values must be FakeTensor")
        return "compiled flex attention fails on a softcap score_mod beside a windowed block mask (torch 2.11, CUDA)"
    return ""


_FEATURE_GAPS: dict[str, Callable[[AttentionFeatures, int, int, torch.device], str]] = {
    "flash": _flash_gaps, "torch": _torch_gaps, "cudnn": _cudnn_gaps, "flex": _flex_gaps,
}


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs, sinks: torch.Tensor | None) -> None:
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or v.shape[:2] != k.shape[:2]:
        raise InvalidInputError(
            "varlen attention takes q (T, Hq, Dqk), k (T, Hkv, Dqk) and v (T, Hkv, Dv)",
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
    if sinks is not None and (tuple(sinks.shape) != (q.shape[1],) or not sinks.is_floating_point()):
        raise InvalidInputError(
            "attention sinks are one floating logit per query head",
            why=f"sinks {tuple(sinks.shape)} {sinks.dtype} for {q.shape[1]} query heads",
            fix="pass the layer's sinks (Hq,), sliced to this rank's heads under Ulysses",
        )


# ---------------------------------------------------------------------------------------------- backends


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs, c: _Call) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for qs, ks, vs in zip(q.split(seqs.lengths), k.split(seqs.lengths), v.split(seqs.lengths)):
        if c.softcap is not None or c.sinks is not None:
            outs.append(_math(qs, ks, vs, c))
            continue
        mask = None if c.window is None else _seen(qs.shape[0], c.window, q.device)
        # (L, H, D) -> (1, H, L, D)
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=c.scale, enable_gqa=gqa,
        )
        outs.append(o[0].transpose(0, 1))  # (1, H, L, D) -> (L, H, D)
    return torch.cat(outs)


def _seen(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``(L, L)`` bool: query ``t`` (row) sees key ``s`` (column): ``s <= t``, and ``s > t - window``."""
    pos = torch.arange(length, device=device)
    lag = pos[:, None] - pos[None, :]  # t - s
    return (lag >= 0) & (lag < window) if window is not None else lag >= 0


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: _Call) -> torch.Tensor:
    """One sequence's attention as an explicit fp32 softmax (softcap, then mask, then the sink column: the order
    of gemma2's and gpt-oss' eager forwards). q: ``(L, Hq, Dqk)``; k: ``(L, Hkv, Dqk)``; v: ``(L, Hkv, Dv)``.
    Returns ``(L, Hq, Dv)`` in q's dtype."""
    groups = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)  # (L, Hq, D) -> (Hq, L, D)
    kf = k.float().transpose(0, 1).repeat_interleave(groups, 0)  # (L, Hkv, D) -> (Hq, L, D)
    vf = v.float().transpose(0, 1).repeat_interleave(groups, 0)  # (L, Hkv, Dv) -> (Hq, L, Dv)
    x = qf @ kf.transpose(1, 2) * c.scale  # (Hq, L, L)
    if c.softcap is not None:
        x = torch.tanh(x / c.softcap) * c.softcap
    x = x.masked_fill(~_seen(q.shape[0], c.window, q.device), float("-inf"))
    if c.sinks is not None:
        sink = c.sinks.float()[:, None, None].expand(-1, q.shape[0], 1)  # (Hq,) -> (Hq, L, 1)
        x = torch.cat([x, sink], dim=-1)  # (Hq, L, L + 1)
    p = x.softmax(-1)[..., : q.shape[0]]  # the sink column has no value
    return (p @ vf).transpose(0, 1).to(q.dtype)  # (Hq, L, Dv) -> (L, Hq, Dv)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs, c: _Call) -> torch.Tensor:
    cu = seqs.cu_seqlens
    flash = cast(_VarlenFn, _flash_varlen(q.device))  # _can_flash: found
    kwargs: dict[str, Any] = {}  # _flash_gaps: the installed function takes each one given
    if c.window is not None:
        kwargs["window_size"] = (c.window - 1, 0)  # keys t - (window - 1) .. t
    if c.softcap is not None:
        kwargs["softcap"] = c.softcap
    if c.sinks is not None:
        kwargs["learnable_sink"] = c.sinks
    v_dim = v.shape[-1]
    q, k, v = _pad_dims(q, k, v)
    out = flash(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seqs.max_seqlen,
                max_seqlen_k=seqs.max_seqlen, softmax_scale=c.scale, causal=True, **kwargs)
    out = out[0] if isinstance(out, tuple) else out  # FA3/FA4 releases that also return the log-sum-exp
    return out[..., :v_dim]


def _torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs, c: _Call) -> torch.Tensor:
    fn, params = cast(_TorchVarlen, _torch_varlen())  # _can_torch: found
    cu = seqs.cu_seqlens
    kwargs: dict[str, Any] = {}
    if c.window is not None:  # _torch_gaps: window_size is taken
        kwargs["window_size"] = (c.window - 1, 0)
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    if "enable_gqa" in params:  # torch 2.11: GQA is native, no flag
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    v_dim = v.shape[-1]
    q, k, v = _pad_dims(q, k, v)
    return fn(q, k, v, cu, cu, seqs.max_seqlen, seqs.max_seqlen, scale=c.scale, **kwargs)[..., :v_dim]


def _pad_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero-pad q/k or v to one head dim for kernels that take one (the scale is already fixed, and zeros add
    nothing to a score or an output column); the caller slices the output back to v's dim."""
    d = max(q.shape[-1], v.shape[-1])
    q, k, v = (x if x.shape[-1] == d else F.pad(x, (0, d - x.shape[-1])) for x in (q, k, v))  # (T, H, D') -> (T, H, d)
    return q, k, v


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs, c: _Call) -> torch.Tensor:
    cu = seqs.cu_seqlens
    out = torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu, cu, seqs.max_seqlen, seqs.max_seqlen, False, 0.0, True, False, scale=c.scale,
    )
    return out[0]


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs, c: _Call) -> torch.Tensor:
    flex = _compiled_flex(q.device.type)
    mask = document_block_mask(seqs, c.window)
    score_mod = None if c.softcap is None else _softcap_mod(c.softcap)
    lse_kwargs = _flex_lse_kwargs() if c.sinks is not None else {}
    # (T, H, D) -> (1, H, T, D) views; flex returns its output in the query's memory layout
    result = flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], score_mod=score_mod,
                  block_mask=mask, scale=c.scale, enable_gqa=q.shape[1] != k.shape[1], **lse_kwargs)
    if c.sinks is None:
        return result[0].transpose(0, 1)  # (1, H, T, Dv) -> (T, H, Dv)
    out, aux = result
    lse = aux.lse if hasattr(aux, "lse") else aux  # AuxOutput (torch >= 2.9) or the bare lse
    return _sink_scaled(out[0].transpose(0, 1), lse[0].transpose(0, 1), c.sinks)  # (1, H, T, .) -> (T, H, .)


def _sink_scaled(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The output with the sink column in the softmax: ``out * Z / (Z + exp(sink)) = out * sigmoid(lse - sink)``.

    out: ``(T, H, Dv)`` without sinks; lse: ``(T, H)`` natural-log sum-exp of the scores; sinks: ``(H,)``.
    """
    return (out.float() * torch.sigmoid(lse.float() - sinks.float())[..., None]).to(out.dtype)


@functools.cache
def _softcap_mod(cap: float) -> Callable[..., torch.Tensor]:
    """flex's ``score_mod`` for softcapping (after the scaling); one function per cap, so compiled flex reuses it."""
    def softcap(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
        return torch.tanh(score / cap) * cap

    return softcap


_BACKENDS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PackedSeqs, _Call], torch.Tensor]] = {
    "flash": _flash, "torch": _torch, "cudnn": _cudnn, "flex": _flex, "sdpa": _sdpa,
}


# ------------------------------------------------------------------------------------ flex document mask

_block_masks = WeakTensorKeyDictionary()  # a forward's cu_seqlens tensor -> {window: its BlockMask}


def document_block_mask(seqs: PackedSeqs, window: int | None = None) -> Any:
    """The flex-attention `BlockMask` of causal attention within each packed sequence (within the last
    ``window`` tokens if given), built once per forward and window.

    Block structure from the boundaries alone, on the device and without a host sync: with ``doc[t]`` the
    sequence of token ``t`` (tokens past ``T``, padding the last block, get the sentinel ``N``) and
    ``first[b]``, ``last[b]`` the sequences of block ``b``'s first and last token, block ``(i, j)`` is
    empty for ``j > i``, and for ``j <= i`` computed exactly when ``last[j] >= first[i]``; it needs no mask
    (full) when ``j < i`` and ``first[j] == last[i]`` (one sequence covers both blocks), else the element
    mask ``doc[q] == doc[kv] and q >= kv`` applies. With a window ``w`` and blocks of ``B``, block ``(i, j)`` is
    also empty when its nearest pair is ``w`` or more apart (``(i - j - 1) B + 1 >= w``), full only when its
    farthest pair is closer (``(i - j + 1) B - 1 < w``), and the element mask adds ``q - kv < w``. The same
    blocks as ``create_block_mask(mask_mod, None, None, T, T)``, without evaluating the mask on ``(T, T)`` points.

    Cached on ``seqs.cu_seqlens`` (weakly): every layer of the forward and the checkpointing recompute,
    which replays the same `PackedSeqs`, reuse it.
    """
    per_window = _block_masks.get(seqs.cu_seqlens)
    if per_window is None:
        per_window = _block_masks[seqs.cu_seqlens] = {}
    if window not in per_window:
        per_window[window] = _build_document_block_mask(seqs, window)
    return per_window[window]


def _build_document_block_mask(seqs: PackedSeqs, window: int | None = None) -> Any:
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
    if window is not None:
        apart = row[:, None] - row[None, :]  # i - j
        computed &= (apart - 1) * _FLEX_BLOCK + 1 < window
        full &= (apart + 1) * _FLEX_BLOCK - 1 < window
    partial = computed & ~full

    if window is None:
        def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    else:
        def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx) & (q_idx - kv_idx < window)

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
_TorchVarlen = tuple[_VarlenFn, frozenset[str]]  # varlen_attn, its parameter names
_FlexApi = tuple[_VarlenFn, Any]  # flex_attention, BlockMask


@functools.cache
def _params(fn: Callable[..., Any]) -> frozenset[str]:
    """The parameter names of ``fn`` (a probed kernel entry point)."""
    return frozenset(inspect.signature(fn).parameters)


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
    """``varlen_attn`` and its parameter names on this torch, if it can be made causal and scaled."""
    try:
        fn = importlib.import_module("torch.nn.attention.varlen").varlen_attn
    except (ImportError, AttributeError):
        return None
    params = _params(fn)
    if "scale" not in params or not ({"is_causal", "window_size"} & params):
        return None  # a varlen_attn this code does not know how to make causal and scaled: not usable
    return fn, params


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
def _flex_lse_kwargs() -> dict[str, Any]:
    """How this torch's flex_attention returns the log-sum-exp: ``return_aux=AuxRequest(lse=True)`` (torch >= 2.9;
    ``return_lse`` is deprecated there) or ``return_lse=True``."""
    flex, _ = cast(_FlexApi, _flex_api())  # _can_flex: found
    if "return_aux" in _params(flex):
        return {"return_aux": importlib.import_module("torch.nn.attention.flex_attention").AuxRequest(lse=True)}
    return {"return_lse": True}


@functools.cache
def _compiled_flex(device_type: str) -> Callable[..., Any]:
    """``flex_attention`` under ``torch.compile`` (without it flex materializes the scores). On CUDA dynamo's
    automatic dynamic shapes recompile once when the token count first changes, then reuse the kernel; on CPU
    each shape compiles statically (torch 2.13's C++ flex template fails to build with dynamic shapes)."""
    flex, _ = cast(_FlexApi, _flex_api())  # _can_flex: found
    return torch.compile(flex, dynamic=False if device_type == "cpu" else None)
