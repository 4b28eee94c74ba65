"""The shared packed core of Gated DeltaNet linear-attention layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next).

A Gated DeltaNet layer mixes tokens in two steps that carry information along the sequence: a short depthwise
causal conv over the projected q/k/v channels, then the gated delta-rule recurrence. On a packed row both must
restart at every sequence start. The contract, per sequence, is transformers' torch path with no cache:

- `packed_causal_conv1d`: ``out[t] = act(bias + sum_j weight[:, j] * x[t - (W - 1) + j])`` with the taps that
  fall before ``t``'s sequence start reading zero (transformers' ``causal_conv1d_fn`` fallback, or
  ``F.silu(self.conv1d(x)[..., :L])`` before 5.15).
- `packed_gated_delta_rule`: transformers' ``torch_chunk_gated_delta_rule(q, k, v, g, beta,
  use_qk_l2norm_in_kernel=True)``, the state starting at zero at each sequence start; value head ``h`` reads
  query/key head ``h // (Hv // Hk)``; fp32 inside, output in ``q.dtype``. (5.2 to 5.16's fallback l2-normalizes
  q/k before its fp32 cast; 5.17+ and fla after it, as here: identical in fp32, a rounding apart in bf16.)
- `linear_attention`: everything between the layer's projections and its gated RMSNorm: gates
  ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``, the conv, the q/k/v split, the rule, and
  under Ulysses the all-to-alls.

Backends, chosen per call like `tfcompat.attention`'s (``"auto"`` takes the first usable; an explicit one that
cannot run raises `InvalidInputError`):

- rule: ``"fla"`` (flash-linear-attention's ``chunk_gated_delta_rule`` with ``cu_seqlens``; CUDA, fp16/bf16),
  ``"torch"`` (any device and dtype; chunked, batched over sequences; the reference).
- conv: ``"causal_conv1d"`` (causal-conv1d's kernel with ``seq_idx``), ``"fla"`` (fla's Triton conv with
  ``cu_seqlens``), both CUDA fp16/bf16; ``"torch"`` (one ``F.conv1d`` over a stream with ``W - 1`` zeros
  before each sequence; any device).
Boundaries come from `PackedSeqs` (host lengths): no per-layer host sync on any backend.

Ulysses (``group`` given): the layer's tokens are split over the ranks (``T/sp`` each); `qkv_seq_to_heads` trades
the conv input for a head split over the whole sequence in one all-to-all (each rank gets the q/k channels of
its key heads and the v channels of its value heads), `gates_seq_to_heads` does the same for ``g``/``beta``, the
depthwise conv runs with this rank's channels of the weight (`shard_conv_weight`: channels shard with their
heads), the conv and the recurrence run over full sequences, and ``heads_to_seq`` restores the sequence split.
Needs ``sp | Hv`` and ``sp | Hk`` or ``Hk | sp`` (then each key head's channels are repeated ``sp // Hk`` times
before the exchange, never more).

Wiring into the stock ``GatedDeltaNet`` module (read in every minor release 5.2..5.24, latest patch of each; the
three families share the module's attribute names: ``num_k_heads``, ``num_v_heads``, ``head_k_dim``,
``head_v_dim``, ``conv1d``, ``activation``, ``A_log``, ``dt_bias``, ``norm``, ``out_proj``):

- What to replace: the instance ``forward`` of each linear-attention module, on every release. Its kernels are
  instance attributes up to 5.14 (``self.causal_conv1d_fn``, ``self.chunk_gated_delta_rule``) but module-level
  functions from 5.15 (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, wrapped by the hub-kernel
  decorator, which from 5.20 raises on ``seq_idx``/``cu_seqlens`` without the package), so swapping kernels
  cannot work across the range; and the stock forward does the conv before the q/k/v split, where Ulysses must
  exchange first. The new forward: projections as the family lays them out (Qwen3.5: ``in_proj_qkv``,
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; Qwen3-Next: ``in_proj_qkvz``/``in_proj_ba`` through
  ``fix_query_key_value_ordering``, then ``cat(q, k, v)`` flattened), then
  ``linear_attention(mixed_qkv, a, b, linear_attention_params(module), ctx.seqs, group=ctx.group,
  transport=ctx.transport)`` on ``(B L, ...)`` flattened tokens, then ``module.norm(core, z)`` per head and
  ``module.out_proj``. It must accept the names the decoder layer passes: ``hidden_states``, ``cache_params``
  (``cache`` from 5.24), ``cache_position`` (5.2-5.3 only), ``attention_mask`` and, from 5.9, ``**kwargs``.
- How the boundaries arrive: from 5.9 the decoder layer forwards ``**kwargs`` to ``linear_attn``, so the
  ``tfcompat_context`` kwarg reaches the new forward; 5.2-5.8's decoder layer calls ``linear_attn`` without
  kwargs and its forward takes none: use the bridge (a forward pre-hook on each decoder layer stores the
  context on the module under ``BRIDGE_ATTR``), as for 4.53's attention.
- GQA: ``linear_attention`` takes unrepeated q/k (5.23+ layout); modules up to 5.22 repeat inside the stock
  forward, which the new forward replaces, so nothing changes per release.
- Cache: the packed path has no recurrent cache; a patched forward with a cache should fail at ``patch()`` or
  fall back to the stock forward (the family's choice).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..errors import InvalidInputError
from . import _linear_kernels as _k
from . import a2a
from .a2a import Transport
from .packing import PackedSeqs

__all__ = [
    "ConvBackend",
    "LinearAttentionParams",
    "LinearHeads",
    "RuleBackend",
    "available_conv_backends",
    "available_rule_backends",
    "check_linear_heads",
    "gates_seq_to_heads",
    "linear_attention",
    "linear_attention_params",
    "local_heads",
    "packed_causal_conv1d",
    "packed_gated_delta_rule",
    "qkv_seq_to_heads",
    "select_conv_backend",
    "select_rule_backend",
    "shard_conv_weight",
]

RuleBackend = Literal["auto", "fla", "torch"]
ConvBackend = Literal["auto", "causal_conv1d", "fla", "torch"]
_FAST_DTYPES = (torch.float16, torch.bfloat16)


class LinearHeads(NamedTuple):
    """Head layout of a Gated DeltaNet layer: ``Hk`` query/key heads of ``Dk``, ``Hv`` value heads of ``Dv``.

    The conv input has ``conv_dim = 2 Hk Dk + Hv Dv`` channels, ordered ``[q | k | v]``, each head's dims together.
    """

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


class LinearAttentionParams(NamedTuple):
    """What `linear_attention` reads from a layer: heads, conv weight ``(C, W)`` and bias ``(C,)`` or None, conv
    activation, ``A_log`` and ``dt_bias`` ``(Hv,)``."""

    heads: LinearHeads
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    activation: str | None
    A_log: torch.Tensor
    dt_bias: torch.Tensor


def linear_attention_params(module: torch.nn.Module) -> LinearAttentionParams:
    """The `LinearAttentionParams` of a stock GatedDeltaNet module (attribute names shared by qwen3_5,
    qwen3_5_moe and qwen3_next on 5.2..5.24); the tensors are the module's own parameters (gradients flow)."""
    gdn: Any = module  # its attributes are read by name
    heads = LinearHeads(gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)
    return LinearAttentionParams(heads, gdn.conv1d.weight.squeeze(1), gdn.conv1d.bias, gdn.activation,
                                 gdn.A_log, gdn.dt_bias)


# ---------------------------------------------------------------------------------------------- packed ops


def packed_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seqs: PackedSeqs,
    *,
    activation: str | None = "silu",
    backend: ConvBackend = "auto",
) -> torch.Tensor:
    """Depthwise causal conv of a packed stream, restarting at every sequence start.

    x: ``(T, C)`` with ``T == seqs.total``; weight: ``(C, W)``; bias: ``(C,)`` or None; activation: None, "silu"
    or "swish". Returns ``(T, C)`` in ``x.dtype``.
    """
    if x.ndim != 2 or weight.ndim != 2 or weight.shape[0] != x.shape[1]:
        raise InvalidInputError("the packed conv takes x (T, C) and weight (C, W)",
                                why=f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (x.shape[1],):
        raise InvalidInputError("the conv bias must be (C,)", why=f"got {tuple(bias.shape)} for C = {x.shape[1]}")
    if activation not in _k.CONV_ACTIVATIONS:
        raise InvalidInputError(f"conv activation {activation!r} is not supported",
                                supported=", ".join(map(repr, _k.CONV_ACTIVATIONS)),
                                fix="use a layer whose hidden_act is silu (Qwen3.5, Qwen3-Next)")
    _check_tokens(x, seqs)
    return _CONV[select_conv_backend(x, backend)](x, weight, bias, activation, seqs)


def packed_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    seqs: PackedSeqs,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    backend: RuleBackend = "auto",
) -> torch.Tensor:
    """The gated delta rule over a packed stream, the state restarting at zero at every sequence start.

    q, k: ``(T, Hk, Dk)``; v: ``(T, Hv, Dv)`` with ``Hv % Hk == 0``; g (log decay, <= 0), beta: ``(T, Hv)``;
    ``T == seqs.total``. scale: applied to q after the l2norm, default ``Dk ** -0.5``.
    Returns ``(T, Hv, Dv)`` in ``q.dtype``.
    """
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[0] != q.shape[0] or v.shape[1] % q.shape[1]:
        raise InvalidInputError("the gated delta rule takes q, k (T, Hk, Dk) and v (T, Hv, Dv) with Hk | Hv",
                                why=f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if g.shape != v.shape[:2] or beta.shape != v.shape[:2]:
        raise InvalidInputError("g and beta must be (T, Hv)",
                                why=f"got g {tuple(g.shape)}, beta {tuple(beta.shape)} for v {tuple(v.shape)}")
    if not all(t.is_floating_point() for t in (q, k, v, g, beta)):
        raise InvalidInputError("q, k, v, g and beta must be floating point",
                                why=f"got {[t.dtype for t in (q, k, v, g, beta)]}")
    _check_tokens(q, seqs)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RULE[select_rule_backend(q, backend)](q, k, v, g, beta, seqs, scale, use_qk_l2norm)


def _check_tokens(x: torch.Tensor, seqs: PackedSeqs) -> None:
    if x.shape[0] != seqs.total:
        raise InvalidInputError("the packed boundaries do not cover the tokens",
                                why=f"{x.shape[0]} tokens but the sequences sum to {seqs.total}")


# ---------------------------------------------------------------------------------------------- backends


def available_rule_backends(q: torch.Tensor) -> list[str]:
    """Rule backends that can run ``q``'s device and dtype, fastest first (``"torch"`` always last)."""
    fla = q.is_cuda and q.dtype in _FAST_DTYPES and _k.fla_rule() is not None and _k.fla_rule_refusal() is None
    return ["fla", "torch"] if fla else ["torch"]


def available_conv_backends(x: torch.Tensor) -> list[str]:
    """Conv backends that can run ``x``'s device and dtype, fastest first (``"torch"`` always last)."""
    usable = []
    if x.is_cuda and x.dtype in _FAST_DTYPES:
        if _k.causal_conv1d() is not None:
            usable.append("causal_conv1d")
        if _k.fla_conv() is not None:
            usable.append("fla")
    return [*usable, "torch"]


def select_rule_backend(q: torch.Tensor, backend: RuleBackend = "auto") -> str:
    """The backend `packed_gated_delta_rule` uses for ``q``; an explicit choice that cannot run raises."""
    refusal = _k.fla_rule_refusal() if _k.fla_rule() is not None else None
    fix = ("upgrade Triton to >= 3.7.1 or install tilelang for 'fla' (" + refusal + ")" if refusal else
           "install flash-linear-attention (fla-core) and pass fp16/bf16 CUDA tensors for 'fla'")
    return _select("gated delta rule", backend, available_rule_backends(q), q, fix)


def select_conv_backend(x: torch.Tensor, backend: ConvBackend = "auto") -> str:
    """The backend `packed_causal_conv1d` uses for ``x``; an explicit choice that cannot run raises."""
    return _select("causal conv1d", backend, available_conv_backends(x), x,
                   "install causal-conv1d (for 'causal_conv1d') or flash-linear-attention (for 'fla') and pass "
                   "fp16/bf16 CUDA tensors")


def _select(what: str, backend: str, usable: list[str], x: torch.Tensor, fix: str) -> str:
    if backend == "auto":
        return usable[0]
    if backend not in usable:
        raise InvalidInputError(f"{what} backend {backend!r} cannot run these inputs",
                                why=f"inputs are {x.dtype} on {x.device.type}; usable here: {usable}",
                                fix=f"use backend='auto', or {fix}")
    return backend


_RULE = {"fla": _k.fla_gated_delta_rule, "torch": _k.torch_gated_delta_rule}
_CONV = {"causal_conv1d": _k.cuda_causal_conv, "fla": _k.fla_causal_conv, "torch": _k.torch_conv}


# ---------------------------------------------------------------------------------------------- Ulysses


def check_linear_heads(heads: LinearHeads, sp: int, *, family: str | None = None,
                       transformers_version: str | None = None) -> None:
    """Raise `InvalidInputError` unless ``sp`` divides the value heads and divides or is divided by the key heads."""
    hk, hv = heads.num_k_heads, heads.num_v_heads
    if hv % sp or (hk % sp and sp % hk):
        sizes = [d for d in range(1, hv + 1) if not hv % d and (not hk % d or not d % hk)]
        raise InvalidInputError(
            f"cannot split a linear-attention layer of {hk} key / {hv} value heads over a sequence-parallel group "
            f"of {sp}",
            family=family,
            transformers_version=transformers_version,
            why="Ulysses gives each rank num_v_heads / sp value heads with the key heads they read, and the conv "
            "channels of both",
            supported="sp dividing linear_num_value_heads, and sp dividing or divided by linear_num_key_heads",
            fix=f"use a group size among {sizes}",
        )


def local_heads(heads: LinearHeads, sp: int) -> LinearHeads:
    """One rank's heads under the head split (one key head, repeated, when ``Hk < sp``)."""
    return heads._replace(num_k_heads=max(heads.num_k_heads // sp, 1), num_v_heads=heads.num_v_heads // sp)


def qkv_seq_to_heads(x: torch.Tensor, heads: LinearHeads, group: dist.ProcessGroup,
                     transport: Transport = "all_to_all") -> torch.Tensor:
    """The conv input ``(T/sp, 2 Hk Dk + Hv Dv)`` of this rank's tokens -> ``(T, C_r)``: every token, the channels
    ``[q | k | v]`` of this rank's heads (``C_r`` = `local_heads`' ``conv_dim``). One all-to-all."""
    sp = a2a.group_size(group)
    tokens = x.shape[0]
    q, k, v = x.split([heads.key_dim, heads.key_dim, heads.value_dim], dim=-1)
    reps = sp // heads.num_k_heads if heads.num_k_heads < sp else 1

    def by_rank(t: torch.Tensor) -> torch.Tensor:
        t = t.unflatten(-1, (heads.num_k_heads, heads.head_k_dim))  # (T/sp, Hk Dk) -> (T/sp, Hk, Dk)
        if reps > 1:
            t = t.repeat_interleave(reps, dim=1)  # (T/sp, Hk, Dk) -> (T/sp, sp, Dk)
        return t.reshape(tokens, sp, -1)  # (T/sp, max(Hk, sp), Dk) -> (T/sp, sp, Hk_r Dk)

    chunks = torch.cat([by_rank(q), by_rank(k), v.reshape(tokens, sp, -1)], dim=-1)  # (T/sp, sp, C_r)
    return a2a.seq_to_heads(chunks, group, transport)[:, 0]  # (T, 1, C_r) -> (T, C_r)


def gates_seq_to_heads(g: torch.Tensor, beta: torch.Tensor, group: dist.ProcessGroup,
                       transport: Transport = "all_to_all") -> tuple[torch.Tensor, torch.Tensor]:
    """g ``(T/sp, Hv)`` (fp32) and beta ``(T/sp, Hv)`` -> both ``(T, Hv/sp)``, dtypes kept. One all-to-all."""
    both = torch.stack([g, beta.to(g.dtype)], dim=-1)  # (T/sp, Hv, 2)
    g, beta_out = a2a.seq_to_heads(both, group, transport).unbind(-1)  # (T, Hv/sp, 2) -> 2 x (T, Hv/sp)
    return g, beta_out.to(beta.dtype)


def shard_conv_weight(weight: torch.Tensor, bias: torch.Tensor | None, heads: LinearHeads, sp: int,
                      rank: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's channels of the depthwise conv: weight ``(C, W)`` -> ``(C_r, W)``, bias ``(C,)`` -> ``(C_r,)``,
    in the order `qkv_seq_to_heads` delivers them. Differentiable (an index_select of the full parameter)."""
    index = _conv_channels(heads, sp, rank, weight.device)
    return weight.index_select(0, index), None if bias is None else bias.index_select(0, index)


@_k.cached_maps
def _conv_channels(heads: LinearHeads, sp: int, rank: int, device: torch.device) -> torch.Tensor:
    hk, dk = heads.num_k_heads, heads.head_k_dim
    key_heads = torch.arange(rank * hk // sp, (rank + 1) * hk // sp) if hk >= sp else torch.tensor([rank * hk // sp])
    q = (key_heads[:, None] * dk + torch.arange(dk)).flatten()
    width = heads.value_dim // sp
    v = 2 * heads.key_dim + torch.arange(rank * width, (rank + 1) * width)
    return torch.cat([q, heads.key_dim + q, v]).to(device, non_blocking=True)


# ---------------------------------------------------------------------------------------------- the layer core


def linear_attention(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    params: LinearAttentionParams,
    seqs: PackedSeqs,
    *,
    group: dist.ProcessGroup | None = None,
    transport: Transport = "all_to_all",
    backend: RuleBackend = "auto",
    conv_backend: ConvBackend = "auto",
) -> torch.Tensor:
    """A Gated DeltaNet layer between its projections and its gated norm, over packed sequences.

    mixed_qkv: ``(T_r, 2 Hk Dk + Hv Dv)`` the conv input (channels ``[q | k | v]``); a, b: ``(T_r, Hv)`` the gate
    projections; ``T_r = T`` in one process, ``T / sp`` under Ulysses (``group``; ``seqs`` then holds the global
    boundaries). Returns the core output ``(T_r, Hv, Dv)`` in ``mixed_qkv.dtype``, before ``norm(core, z)``.
    """
    heads, weight, bias = params.heads, params.conv_weight, params.conv_bias
    if mixed_qkv.ndim != 2 or mixed_qkv.shape[1] != heads.conv_dim:
        raise InvalidInputError("mixed_qkv must be (T, 2 Hk Dk + Hv Dv)",
                                why=f"got {tuple(mixed_qkv.shape)} for {heads}")
    if a.shape != (mixed_qkv.shape[0], heads.num_v_heads) or b.shape != a.shape:
        raise InvalidInputError("a and b must be (T, Hv)", why=f"got a {tuple(a.shape)}, b {tuple(b.shape)}")
    beta = b.sigmoid()
    g = -params.A_log.float().exp() * F.softplus(a.float() + params.dt_bias)  # as the stock forward: fp32
    if group is not None:
        sp, rank = a2a.group_size(group), dist.get_rank(group)
        check_linear_heads(heads, sp)
        if mixed_qkv.shape[0] * sp != seqs.total:
            raise InvalidInputError("a rank's tokens times the group size must be the packed row",
                                    why=f"{mixed_qkv.shape[0]} tokens x {sp} ranks vs {seqs.total} in the boundaries",
                                    fix="shard with tfcompat.ulysses.shard_inputs")
        mixed_qkv = qkv_seq_to_heads(mixed_qkv, heads, group, transport)
        g, beta = gates_seq_to_heads(g, beta, group, transport)
        weight, bias = shard_conv_weight(weight, bias, heads, sp, rank)
        heads = local_heads(heads, sp)
    x = packed_causal_conv1d(mixed_qkv, weight, bias, seqs, activation=params.activation, backend=conv_backend)
    q, k, v = x.split([heads.key_dim, heads.key_dim, heads.value_dim], dim=-1)
    q = q.unflatten(-1, (heads.num_k_heads, heads.head_k_dim))  # (T, Hk Dk) -> (T, Hk, Dk)
    k = k.unflatten(-1, (heads.num_k_heads, heads.head_k_dim))  # (T, Hk Dk) -> (T, Hk, Dk)
    v = v.unflatten(-1, (heads.num_v_heads, heads.head_v_dim))  # (T, Hv Dv) -> (T, Hv, Dv)
    out = packed_gated_delta_rule(q, k, v, g, beta, seqs, use_qk_l2norm=True, backend=backend)
    if group is not None:
        out = a2a.heads_to_seq(out, group, transport)  # (T, Hv/sp, Dv) -> (T/sp, Hv, Dv)
    return out
