"""Ulysses sequence parallelism over torch.distributed (gloo on CPU, NCCL on GPU).

One packed row of ``T`` tokens is split into ``sp`` contiguous shards, one per rank of the group. Around
each attention, an all-to-all trades the sequence split for a head split (``(T/sp, H, D)`` ->
``(T, H/sp, D)``), every rank runs the varlen core on its heads over the whole sequence, and a second
all-to-all trades back. Boundaries come from the *global* text row, computed once in `shard_inputs` and
handed to every layer in the forward's kwargs: no per-layer gather of position ids, no per-layer sync.
(Reference: DeepSpeed-Ulysses, Jacobs et al. 2023.)

GQA: K/V are split by heads too. With ``Hkv % sp == 0`` nothing is repeated; with ``sp % Hkv == 0`` each KV
head is repeated ``sp // Hkv`` times, just enough for one KV head per rank, never to full multi-head.

The exchange verbs the attention cores call (`seq_to_heads`, `qkv_to_heads`, `heads_to_seq`, `kv_repeats`,
`check_heads`) live beside the exchange, in `tfcompat.core.a2a`, and are re-exported here.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

import torch
import torch.distributed as dist

from .core import a2a
from .core.a2a import Transport, check_heads, group_size, heads_to_seq, kv_repeats, qkv_to_heads, seq_to_heads
from .core.context import CONTEXT_KWARG, ForwardContext
from .core.extras import VISUAL_KWARG, Embedded
from .core.labels import shift_labels
from .core.packing import PackedSeqs, check_text_positions, from_host_positions
from .core.position_ids import split_positions
from .errors import InvalidInputError

__all__ = [
    "Shard",
    "Transport",
    "check_heads",
    "gather_outputs",
    "group_size",
    "heads_to_seq",
    "kv_repeats",
    "qkv_to_heads",
    "seq_to_heads",
    "shard_inputs",
]


@dataclass
class Shard:
    """This rank's slice of a packed row, and what is needed to put outputs back together.

    model_inputs: kwargs for the patched model: the local ``input_ids`` or ``inputs_embeds`` ``(1, T/sp[, H])``,
        the local ``position_ids`` (last dim sliced), the forward context (global boundaries, group) and, from an
        `tfcompat.embed_inputs` result, this rank's share of its extras (`tfcompat.extras.VisualExtras`), and this
        rank's slice ``(1, T/sp, ...)`` of each per-token input (``per_token``, the embed_inputs result's token types).
    labels: the local labels ``(1, T/sp)``, shifted on the global sequence (``labels[t] = ids[t + 1]``) before
        slicing, with ``ignore_index`` at each sequence's last token and on the pad; None if none given.
    total: tokens before padding; padded: after padding to a multiple of ``sp``.
    """

    model_inputs: dict[str, Any]
    labels: torch.Tensor | None
    group: dist.ProcessGroup
    rank: int
    sp: int
    total: int
    padded: int
    seqs: PackedSeqs = field(repr=False)

    @property
    def local_slice(self) -> slice:
        n = self.padded // self.sp
        return slice(self.rank * n, (self.rank + 1) * n)


def shard_inputs(
    input_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    labels: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | Embedded | None = None,
    group: dist.ProcessGroup | None = None,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    transport: Literal["auto"] | Transport = "auto",
    per_token: Mapping[str, torch.Tensor] | None = None,
) -> Shard:
    """Pad a packed row to a multiple of the group size and take this rank's slice.

    input_ids: ``(1, T)``; or inputs_embeds: ``(1, T, H)``, or for VLMs the result of `tfcompat.embed_inputs`
    (whole images go through the vision tower first; its per-token extras are sliced to this rank too: the visual
    mask by token, the DeepStack rows by the visual tokens inside this rank's slice); position_ids: ``(4, 1, T)``
    or ``(1, T)``, each sequence's text row from 0;
    labels: ``(1, T)`` next-token targets are taken from it after a global shift (pass ``input_ids`` with
    ignored positions set to ``ignore_index``). The pad forms its own sequence. Computes the global
    boundaries here, checks that every rank holds the same ``T`` and agrees on the transport (one small
    all-gather), all from one host copy: the forward's one host sync.
    transport: how the attention layers' all-to-alls move data (`tfcompat.a2a`): ``"symm_mem"`` (CUDA, every
    rank on one host with peer access), ``"all_to_all"`` (any backend), or ``"auto"``, which takes ``"symm_mem"``
    where every rank can. The choice travels in the forward context.
    per_token: the forward's other inputs with one entry per token of the row, by name, each ``(1, T, ...)``: token
    types (``mm_token_type_ids``, ``token_type_ids``; ``moe_mm_token_type_ids``, by which ERNIE-4.5-VL's MoE sends
    each token to text or vision experts). Padded with 0 (text) and sliced to this rank's tokens like the ids; an
    `tfcompat.embed_inputs` result brings its own (`Embedded.model_inputs`).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidInputError("shard_inputs needs an initialized torch.distributed",
                                why="it gathers every rank's length and boundaries over the sequence-parallel group",
                                fix="call torch.distributed.init_process_group(...) first (and patch with "
                                "ulysses_group)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise InvalidInputError("shard_inputs: group is not a torch.distributed ProcessGroup",
                                why=f"got {type(group).__name__}",
                                fix="pass the group given to patch(ulysses_group=...)")
    if (input_ids is None) == (inputs_embeds is None):
        raise InvalidInputError("shard_inputs takes exactly one of input_ids and inputs_embeds",
                                fix="pass input_ids (1, T), or inputs_embeds (1, T, H) / the embed_inputs result")
    if per_token is not None and not isinstance(per_token, Mapping):
        raise InvalidInputError("shard_inputs: per_token is not a mapping", why=f"got {type(per_token).__name__}",
                                fix="pass {name: (1, T) tensor}, e.g. per_token={'mm_token_type_ids': types}")
    visual = None
    extras = dict(per_token or {})
    if isinstance(inputs_embeds, Embedded):
        carried = {k: v for k, v in inputs_embeds.model_inputs().items() if k not in ("inputs_embeds", VISUAL_KWARG)}
        if set(carried) & set(extras):
            raise InvalidInputError(f"per-token inputs given twice: {sorted(set(carried) & set(extras))}",
                                    why="the embed_inputs result carries them and per_token names them too",
                                    fix="leave them out of per_token (the embed_inputs result brings its own)")
        extras.update(carried)
        # visual first: mypy retypes inputs_embeds as it binds the targets
        visual, inputs_embeds = inputs_embeds.visual, inputs_embeds.inputs_embeds
    if transport not in ("auto", *get_args(Transport)):
        raise InvalidInputError(f"unknown Ulysses transport {transport!r}",
                                supported=", ".join(("auto", *get_args(Transport))),
                                fix="pass one of the supported transports")
    tokens = cast(torch.Tensor, input_ids if input_ids is not None else inputs_embeds)  # exactly one (checked)
    if tokens.shape[0] != 1:
        raise InvalidInputError(
            "Ulysses shards one packed row", why=f"got batch size {tokens.shape[0]}",
            fix="pack the batch into one row (B = 1) before sharding",
        )
    if position_ids is None:
        raise InvalidInputError("shard_inputs needs position_ids",
                                fix="pass tfcompat.rope_index per sequence, concatenated")
    group = group if group is not None else cast(dist.ProcessGroup, dist.group.WORLD)  # initialized: not None
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    total = tokens.shape[1]
    positions = split_positions(position_ids, seq_len=total, family=None, axes=None)
    if labels is not None and tuple(labels.shape) != (1, total):
        raise InvalidInputError("labels and the packed row differ in shape",
                                why=f"labels {tuple(labels.shape)}, row (1, {total})",
                                fix="pass one label per token of the row, (1, T) like input_ids (unshifted)")
    _check_per_token(extras, total)
    if visual is not None and tuple(visual.visual_pos_masks.shape) != (1, total):
        raise InvalidInputError("the visual extras do not match the packed row",
                                why=f"visual_pos_masks {tuple(visual.visual_pos_masks.shape)}, row (1, {total})",
                                fix="pass the embed_inputs result of this row")

    pad = -total % sp
    padded = total + pad
    pad_pos = torch.arange(pad, device=tokens.device, dtype=positions.text.dtype)
    text = torch.cat([positions.text, pad_pos[None]], dim=-1)
    check_text_positions(text)
    reason = a2a.symm_mem_reason(group, tokens.device) if transport != "all_to_all" else "not asked for"
    table = _gather_rank_rows(total, reason is None, tokens.device, group, _boundary_checksum(text))
    rows = [table.flatten().to(text.device), text.flatten().long()]
    if visual is not None:  # the visual mask rides along: DeepStack rows are sliced by visual counts
        rows.append(visual.visual_pos_masks.flatten().to(text.device, torch.long))
    host = torch.cat(rows).cpu()  # the forward's one host sync
    transport = _agree(host[: table.numel()].view(sp, -1).tolist(), transport, reason, rank)
    seqs = from_host_positions(host[table.numel(): table.numel() + padded].view(1, -1), device=text.device)
    local = slice(rank * padded // sp, (rank + 1) * padded // sp)

    if position_ids.ndim == 3:  # (4, 1, T): the pad's rows all count from 0 too
        full_pos = torch.cat([position_ids, pad_pos.expand(position_ids.shape[0], 1, pad)], dim=-1)
    else:
        full_pos = text
    inputs: dict[str, Any] = {"position_ids": full_pos[..., local]}
    if input_ids is not None:
        ids = torch.cat([input_ids, input_ids.new_full((1, pad), pad_token_id)], dim=1)
        inputs["input_ids"] = ids[:, local]
    else:
        embeds = torch.cat([tokens, tokens.new_zeros(1, pad, tokens.shape[-1])], dim=1)  # tokens: inputs_embeds
        inputs["inputs_embeds"] = embeds[:, local]
    if visual is not None:
        counts = host[table.numel() + padded:]
        before = int(counts[: local.start].sum())
        inside = int(counts[local.start: min(local.stop, total)].sum())
        inputs[VISUAL_KWARG] = visual.pad_and_slice(pad, local, before, inside)
    for name, x in extras.items():  # the pad's entries are 0: text
        row = torch.cat([x, x.new_zeros(1, pad, *x.shape[2:])], dim=1)  # (1, T, ...) -> (1, T + pad, ...)
        inputs[name] = row[:, local]
    inputs[CONTEXT_KWARG] = ForwardContext(seqs, group=group, transport=transport)

    local_labels = None
    if labels is not None:  # shifted on the whole row, within each sequence (the pad is one of its own)
        row = torch.cat([labels, labels.new_full((1, pad), ignore_index)], dim=1)  # (1, T) -> (1, T + pad)
        local_labels = shift_labels(row, seqs, ignore_index)[:, local]
    return Shard(inputs, local_labels, group, rank, sp, total, padded, seqs)


def _check_per_token(extras: dict[str, Any], total: int) -> None:
    """Each of ``extras`` is a ``(1, total, ...)`` tensor, named apart from the inputs `shard_inputs` builds itself."""
    for name, x in extras.items():
        if name in ("input_ids", "inputs_embeds", "position_ids", "labels", CONTEXT_KWARG, VISUAL_KWARG):
            raise InvalidInputError(f"shard_inputs: per_token names {name!r}, which shard_inputs builds itself",
                                    supported="token types and other inputs of the forward with one entry per token",
                                    fix=f"pass {name} as shard_inputs' own argument, or leave it out")
        if not isinstance(x, torch.Tensor) or x.ndim < 2 or tuple(x.shape[:2]) != (1, total):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise InvalidInputError(f"per-token input {name} does not match the packed row",
                                    why=f"{name} {got}, row (1, {total})",
                                    fix=f"pass one {name} entry per token of the whole row, (1, T) like input_ids "
                                    "(shard_inputs slices it to this rank)")


def gather_outputs(x: torch.Tensor, shard: Shard, dim: int = 1) -> torch.Tensor:
    """All ranks' slices of ``x`` concatenated on ``dim`` with the pad removed (differentiable).

    x: this rank's output, ``T/sp`` long on ``dim`` (e.g. logits ``(1, T/sp, V)``); returns ``T`` long.
    """
    if x.shape[dim] * shard.sp != shard.padded:
        raise InvalidInputError(
            "output length does not match the shard",
            why=f"dim {dim} has {x.shape[dim]} tokens, expected {shard.padded // shard.sp}",
        )
    parts = _AllGather.apply(x.contiguous(), shard.group, dim)
    return parts.narrow(dim, 0, shard.total)


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's tensor on ``dim``; backward hands each rank the gradient of its own slice.

    Every rank is expected to compute the same loss of the gathered tensor; parameter gradients are then
    partial per rank and sum to the full gradient over the group (as data-parallel reduction does).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        ctx.rank, ctx.n = dist.get_rank(group), x.shape[dim]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.contiguous().narrow(ctx.dim, ctx.rank * ctx.n, ctx.n), None, None


def _boundary_checksum(text: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 hash of where the sequences of the ``(1, T)`` text row start, computed on its device (no sync):
    the sum of fixed pseudo-random weights at the starts. Equal boundaries give equal sums."""
    flat = text.reshape(-1)  # (1, T) -> (T,)
    starts = flat == 0
    starts[0] = True
    weights = (torch.arange(flat.numel(), device=flat.device, dtype=torch.long) * 2654435761 + 12345) % 2147483647
    return (weights * starts).sum()


def _gather_rank_rows(total: int, usable: bool, device: torch.device, group: dist.ProcessGroup,
                      checksum: torch.Tensor) -> torch.Tensor:
    """``(sp, 5)`` rows ``[T, host id, symm_mem usable, GPU index, boundary checksum]`` of every rank, left on the
    device (no sync, except a CUDA row gathered over gloo)."""
    host = int.from_bytes(hashlib.blake2b(socket.gethostname().encode(), digest_size=6).digest(), "little")
    index = device.index if device.type == "cuda" and device.index is not None else -1
    gather_on = device if dist.get_backend(group) != "gloo" else torch.device("cpu")
    mine = torch.tensor([total, host, usable, index]).to(gather_on, non_blocking=True)  # as from_lengths: no sync
    mine = torch.cat([mine, checksum.view(1).to(gather_on)])
    everyone = mine.new_empty(dist.get_world_size(group), mine.numel())
    dist.all_gather(list(everyone.unbind()), mine, group=group)
    return everyone


def _agree(table: list[list[int]], transport: str, reason: str | None, rank: int) -> Transport:
    """Check that every rank holds the same ``T`` and return the transport all of them can use.

    reason: why this rank cannot use symm_mem (None if it can).
    """
    lengths = [row[0] for row in table]
    if len(set(lengths)) != 1:
        raise InvalidInputError(
            "ranks disagree on the packed sequence length",
            why=f"lengths by rank: {lengths}",
            fix="give every rank of the sequence-parallel group the same packed row",
        )
    if len({row[4] for row in table}) != 1:
        raise InvalidInputError(
            "ranks agree on the packed length but not on the sequence boundaries",
            why="the text rows of the position ids restart at different tokens on different ranks "
            f"(boundary checksums by rank: {[row[4] for row in table]})",
            fix="give every rank of the sequence-parallel group the same packed row and position ids (the same "
            "tfcompat.pack output)",
        )
    if transport == "all_to_all":
        return "all_to_all"
    reason = reason or _symm_mem_peers(table, rank)
    if reason is None:
        return "symm_mem"
    if transport == "symm_mem":
        raise InvalidInputError("the symm_mem transport cannot run on this group", why=reason,
                                supported="symm_mem: CUDA tensors, nccl, every rank on one host with peer access",
                                fix='shard_inputs(..., transport="all_to_all") (or "auto", which picks it here)')
    return "all_to_all"


def _symm_mem_peers(table: list[list[int]], rank: int) -> str | None:
    """Why the gathered ``[T, host, symm_mem ok, device index]`` rows rule symmetric memory out, or None."""
    if len({row[1] for row in table}) != 1:
        return "the group spans more than one host"
    if not all(row[2] for row in table):
        return f"ranks {[r for r, row in enumerate(table) if not row[2]]} cannot use symmetric memory"
    devices = [row[3] for row in table]
    if len(set(devices)) != len(devices):
        return f"ranks see their GPUs under clashing indices {devices} (a CUDA_VISIBLE_DEVICES per rank?)"
    mine = devices[rank]
    blocked = [d for d in devices if d != mine and not torch.cuda.can_device_access_peer(mine, d)]
    return f"GPU {mine} has no peer access to GPUs {blocked}" if blocked else None
