"""Kernels behind `tfcompat.linear_attention`: exact torch implementations and lazy wrappers of the optional ones.

Torch (any device, any floating dtype, differentiable through autograd):

- `torch_conv`: the depthwise causal conv of a packed stream. Each sequence gets ``W - 1`` zeros in front of it
  (one scatter into a longer stream), one ``F.conv1d`` runs over the whole stream, and each token's output is
  gathered back: no tap reads the previous sequence, and the arithmetic is the stock ``F.conv1d`` of transformers'
  torch path (``causal_conv1d_fn`` fallback, or ``self.conv1d`` before 5.15).
- `torch_gated_delta_rule`: transformers' ``torch_chunk_gated_delta_rule`` (5.17+ form: fp32 cast, then l2norm,
  then ``solve_triangular``), per sequence, batched over sequences. Each sequence is cut into its own chunks (the
  last one zero-padded, as the stock function pads), the intra-chunk phase runs over every chunk at once, and the
  scan over chunks runs once for all sequences: step ``j`` updates the state of every sequence that has a chunk
  ``j``. Sequences are ordered by chunk count, so at each step the active sequences are a prefix of the state
  batch and their chunks one contiguous block (a slice, no gather, no padding chunks).

Every index map comes from the host lengths of `PackedSeqs`, built once per distinct lengths and device (cached,
copied with ``non_blocking``): no device-to-host sync on any layer.

Optional kernels (CUDA; imported on first use, their signatures read once):

- flash-linear-attention's ``chunk_gated_delta_rule(q, k, v, g, beta, ..., cu_seqlens=...)`` (``fla`` 0.1.2 to
  0.6.0 read; ``head_first`` exists up to 0.3.x, ``cu_seqlens_cpu`` from 0.4.0; grouped value heads only from 0.5,
  so q/k are repeated to the value heads first).
- flash-linear-attention's ``fla.modules.convolution.causal_conv1d(x, weight, bias, ..., activation, cu_seqlens)``
  (``x`` ``(B, T, D)``; returns ``y`` up to 0.2.x, ``(y, final_state)`` from 0.3.0).
- causal-conv1d's ``causal_conv1d_fn(x, weight, bias, seq_idx=..., activation=...)`` (``x`` ``(B, D, T)``
  channel-last when ``seq_idx`` is given; 1.6.1 read).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F

from .packing import PackedSeqs

CONV_ACTIVATIONS = (None, "silu", "swish")


# ---------------------------------------------------------------------------------------------- index maps


class ConvLayout(NamedTuple):
    """Where each token sits in a stream that has ``W - 1`` zeros before every sequence.

    dest: ``(T,)`` long, the token's row in that stream (``T + N * (W - 1)`` rows).
    out: ``(T,)`` long, the row of the valid conv output (no padding) that belongs to the token (``dest - (W - 1)``).
    """

    dest: torch.Tensor
    out: torch.Tensor
    rows: int


class ChunkLayout(NamedTuple):
    """Each sequence cut into chunks of ``C`` tokens, chunks stored scan-step major.

    slots: ``(T,)`` long, the token's row in the ``(chunks * C)`` chunked stream (a sequence's last chunk is
        zero-padded).
    chunks: ``K = sum(ceil(L_i / C))``.
    steps: per scan step ``j``, ``(first chunk, active sequences)``: the chunks ``j`` of the sequences that have
        one are the rows ``first .. first + active`` of the chunk batch, and those sequences are the first
        ``active`` of the state batch (sequences ordered by chunk count, longest first).
    """

    slots: torch.Tensor
    chunks: int
    steps: tuple[tuple[int, int], ...]


def cached_maps(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Cache an index-map builder by its (hashable) arguments. The maps are built outside inference mode: a map
    first built under ``torch.inference_mode()`` (a log-prob pass) is reused by a training step, where autograd
    saves it for backward, which inference tensors refuse."""

    @functools.lru_cache(maxsize=32)
    @functools.wraps(fn)
    def build(*args: Any) -> Any:
        with torch.inference_mode(False):
            return fn(*args)

    return build


def _host_ids(lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T,)`` sequence id and ``(T,)`` position inside its sequence of every token (host tensors)."""
    n = torch.tensor(lengths)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), n)
    starts = torch.cumsum(n, 0) - n
    return seq, torch.arange(int(n.sum())) - starts[seq]


@cached_maps
def conv_layout(lengths: tuple[int, ...], width: int, device: torch.device) -> ConvLayout:
    seq, _ = _host_ids(lengths)
    out = torch.arange(seq.numel()) + (width - 1) * seq
    rows = seq.numel() + len(lengths) * (width - 1)
    return ConvLayout((out + width - 1).to(device, non_blocking=True), out.to(device, non_blocking=True), rows)


@cached_maps
def chunk_layout(lengths: tuple[int, ...], chunk: int, device: torch.device) -> ChunkLayout:
    counts = (torch.tensor(lengths) + chunk - 1) // chunk  # (N,) chunks per sequence
    order = torch.sort(counts, descending=True, stable=True).indices  # ties keep packing order
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(lengths))
    active = (counts[None, :] > torch.arange(int(counts.max()))[:, None]).sum(1)  # (steps,) sequences with chunk j
    first = torch.cumsum(active, 0) - active
    seq, pos = _host_ids(lengths)
    slots = (first[pos // chunk] + rank[seq]) * chunk + pos % chunk
    steps = tuple(zip(first.tolist(), active.tolist()))
    return ChunkLayout(slots.to(device, non_blocking=True), int(active.sum()), steps)


@cached_maps
def seq_index(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``(1, T)`` int32 sequence id of every token (causal-conv1d's ``seq_idx``)."""
    seq, _ = _host_ids(lengths)
    return seq.to(torch.int32)[None].to(device, non_blocking=True)


@cached_maps
def long_cu_seqlens(lengths: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N + 1,)`` int64 boundaries on ``device`` and on the host; the same objects for every layer (fla caches
    its chunk indices by tensor identity, and builds them from the host copy without a sync)."""
    host = F.pad(torch.cumsum(torch.tensor(lengths), 0), (1, 0))
    return host.to(device, non_blocking=True), host


# ---------------------------------------------------------------------------------------------- torch


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    return x if activation is None else F.silu(x)  # "silu" and "swish" are the same function


def torch_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
               seqs: PackedSeqs) -> torch.Tensor:
    """x ``(T, C)``, weight ``(C, W)``, bias ``(C,)`` or None -> ``(T, C)`` in ``x.dtype`` (computed in
    ``weight.dtype``, as transformers' torch path does)."""
    channels, width = weight.shape
    lay = conv_layout(seqs.lengths, width, x.device)
    stream = x.new_zeros(lay.rows, channels).index_copy(0, lay.dest, x)  # (T + N (W - 1), C)
    # (rows, C) -> (1, C, rows): the conv's layout; no padding, the zeros are in the stream
    y = F.conv1d(stream.t()[None].to(weight.dtype), weight[:, None, :], bias, groups=channels)
    y = y[0].index_select(1, lay.out).t()  # (C, rows - W + 1) -> (C, T) -> (T, C)
    return _activate(y, activation).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, written as transformers' (and fla's) ``l2norm``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def torch_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           seqs: PackedSeqs, scale: float, use_qk_l2norm: bool, chunk_size: int = 64) -> torch.Tensor:
    """q, k ``(T, Hk, Dk)``, v ``(T, Hv, Dv)``, g, beta ``(T, Hv)`` -> ``(T, Hv, Dv)`` in ``q.dtype``; fp32 inside.

    The state of each sequence starts at zero. Value head ``h`` reads query/key head ``h // (Hv // Hk)``.
    """
    out_dtype = q.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if k.shape[1] != v.shape[1]:
        reps = v.shape[1] // k.shape[1]
        q, k = q.repeat_interleave(reps, dim=1), k.repeat_interleave(reps, dim=1)  # (T, Hk, Dk) -> (T, Hv, Dk)
    q = q * scale
    lay = chunk_layout(seqs.lengths, chunk_size, q.device)

    def chunked(x: torch.Tensor) -> torch.Tensor:
        rows = x.new_zeros(lay.chunks * chunk_size, *x.shape[1:]).index_copy(0, lay.slots, x)
        return rows.unflatten(0, (lay.chunks, chunk_size)).transpose(1, 2)  # (K C, H, ...) -> (K, H, C, ...)

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))  # (K, H, C, D) and (K, H, C)
    cum = g.cumsum(-1)  # (K, H, C): log decay from the chunk start
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # (K, H, C, C)
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    decay = cum[..., -1].exp()[..., None, None]  # (K, H, 1, 1)

    state = q.new_zeros(lay.steps[0][1], q.shape[1], q.shape[-1], v.shape[-1])  # (N, H, Dk, Dv)
    outs = []
    for first, active in lay.steps:
        rows = slice(first, first + active)
        state = state[:active]
        v_step = new_v[rows] - k_cum[rows] @ state
        outs.append(q[rows] @ state + intra[rows] @ v_step)
        state = state * decay[rows] + k[rows].transpose(-1, -2) @ v_step
    out = torch.cat(outs).transpose(1, 2).flatten(0, 1)  # (K, H, C, Dv) -> (K, C, H, Dv) -> (K C, H, Dv)
    return out.index_select(0, lay.slots).to(out_dtype)


# ---------------------------------------------------------------------------------------------- optional kernels


class Probed(NamedTuple):
    fn: Callable[..., Any]
    params: frozenset[str]


def _probe(module: str, name: str, needs: set[str]) -> Probed | None:
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, OSError, RuntimeError):  # absent, or a build without usable kernels
        return None
    params = frozenset(inspect.signature(fn).parameters)
    return Probed(fn, params) if needs <= params else None


@functools.cache
def fla_rule() -> Probed | None:
    return _probe("fla.ops.gated_delta_rule", "chunk_gated_delta_rule",
                  {"scale", "cu_seqlens", "use_qk_l2norm_in_kernel", "output_final_state"})


@functools.cache
def fla_rule_refusal() -> str | None:
    """Why fla's gated backward would refuse to run here, by fla's own guard, or None.

    fla 0.6 raises in the backward of the gated chunk kernel on Hopper with Triton >= 3.4, < 3.7.1 (wrong results,
    fla issue #640) unless tilelang serves that kernel; its flags live in ``fla.utils.env`` / ``fla.utils.hardware``.
    Versions without the flags have no such guard.
    """
    try:
        env = importlib.import_module("fla.utils.env")
        hardware = importlib.import_module("fla.utils.hardware")
    except ImportError:
        return None
    broken = (getattr(hardware, "IS_NVIDIA_HOPPER", False) and getattr(env, "TRITON_ABOVE_3_4_0", False)
              and not getattr(env, "TRITON_ABOVE_3_7_1", True))
    if broken and importlib.util.find_spec("tilelang") is None:
        return "fla refuses its gated chunk backward on Hopper with Triton >= 3.4, < 3.7.1 (fla issue #640)"
    return None


@functools.cache
def fla_conv() -> Probed | None:
    return _probe("fla.modules.convolution", "causal_conv1d", {"weight", "bias", "activation", "cu_seqlens"})


@functools.cache
def causal_conv1d() -> Probed | None:
    return _probe("causal_conv1d", "causal_conv1d_fn", {"weight", "bias", "seq_idx", "activation"})


def fla_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         seqs: PackedSeqs, scale: float, use_qk_l2norm: bool) -> torch.Tensor:
    """Same contract as `torch_gated_delta_rule`, through fla's chunked kernel with ``cu_seqlens``."""
    probed = cast(Probed, fla_rule())  # select_rule_backend: found
    if k.shape[1] != v.shape[1]:
        reps = v.shape[1] // k.shape[1]
        q, k = q.repeat_interleave(reps, dim=1), k.repeat_interleave(reps, dim=1)  # (T, Hk, Dk) -> (T, Hv, Dk)
    cu, cu_host = long_cu_seqlens(seqs.lengths, q.device)
    kwargs: dict[str, Any] = {"scale": scale, "initial_state": None, "output_final_state": False,
                              "use_qk_l2norm_in_kernel": use_qk_l2norm, "cu_seqlens": cu}
    if "head_first" in probed.params:
        kwargs["head_first"] = False
    if "cu_seqlens_cpu" in probed.params:
        kwargs["cu_seqlens_cpu"] = cu_host
    # (T, H, D) -> (1, T, H, D): one "batch" row holding every sequence
    out, _ = probed.fn(q[None], k[None], v[None], g[None], beta[None], **kwargs)
    return out[0]


def fla_causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                    seqs: PackedSeqs) -> torch.Tensor:
    """Same contract as `torch_conv`, through fla's Triton conv with ``cu_seqlens``."""
    probed = cast(Probed, fla_conv())  # select_conv_backend: found
    cu, cu_host = long_cu_seqlens(seqs.lengths, x.device)
    kwargs: dict[str, Any] = {"weight": weight, "bias": bias, "activation": activation, "cu_seqlens": cu}
    if "cu_seqlens_cpu" in probed.params:
        kwargs["cu_seqlens_cpu"] = cu_host
    if "backend" in probed.params:
        kwargs["backend"] = "triton"
    out = probed.fn(x[None], **kwargs)  # (T, C) -> (1, T, C)
    out = out[0] if isinstance(out, tuple) else out  # (y, final_state) from fla 0.3.0
    return out[0]


def cuda_causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                     seqs: PackedSeqs) -> torch.Tensor:
    """Same contract as `torch_conv`, through causal-conv1d's kernel with ``seq_idx``."""
    probed = cast(Probed, causal_conv1d())  # select_conv_backend: found
    idx = seq_index(seqs.lengths, x.device)
    # (T, C) -> (1, C, T) channel-last view, the layout causal-conv1d takes with seq_idx
    out = probed.fn(x.contiguous().t()[None], weight, bias, seq_idx=idx, activation=activation)
    return out[0].t()  # (1, C, T) -> (T, C)
