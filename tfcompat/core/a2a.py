"""The Ulysses all-to-all: trade a sequence split for a head split and back, for one tensor or for several in one
exchange (a layer's q, k and v), over one of two transports.

Per rank, with ``sp`` ranks, ``T`` packed tokens, and tensors ``p`` of ``H_p`` heads of ``D_p``::

    seq_to_heads: (T/sp, H_p, D_p) -> (T, H_p/sp, D_p)        heads_to_seq: (T, H_p/sp, D_p) -> (T/sp, H_p, D_p)

The wire: one exchange moves one ``(sp, T/sp, W)`` buffer, chunk ``j`` for rank ``j``; a token's row of
``W = sum_p (H_p/sp) D_p`` elements holds that token's heads of every tensor side by side (``[q | k | v]``). On the
head side the wire layout is the tensors' layout: seq_to_heads returns one ``(T, H_p/sp, D_p)`` view per tensor
into the received buffer, rows ``W`` apart (no unpack copy). On the sequence side a chunk is strided (a head slice
of every token), so some pass changes the layout, once per tensor, writing straight to its place in the wire (no
concatenation first):

- ``"all_to_all"`` (any backend, gloo included): pack each tensor's chunks into one contiguous send buffer (one
  copy per tensor; none for one contiguous heads_to_seq input), one ``all_to_all_single``, and for heads_to_seq
  unpack (one copy per tensor). The packing is a local copy the exchange has to wait for.
- ``"symm_mem"`` (CUDA ranks that reach each other over NVLink; torch symmetric memory): each rank *pushes* the
  chunk it owes each peer straight into that peer's symmetric workspace, already in wire layout (the strided side
  of the layout change rides on the NVLink write), while a side stream copies the chunk it keeps; one
  device-side barrier; then each rank copies what arrived into its output (one copy per run of peers before and
  after itself; whole rows at once on the head side). The workspace is double-buffered, so no second barrier is
  needed: a rank writes into a half of a peer's workspace again only after the next exchange's barrier, which
  that peer reaches after its last read of it. Fusing tensors changes none of this: one exchange, one barrier.

GQA with fewer KV heads than ranks: seq_to_heads takes a ``repeat`` per tensor; with ``repeat = sp / H_p`` chunk
``j`` reads head ``j // repeat`` (an expanded view: the repeated tensor is never built), so each rank receives the
one copy of the KV head it needs. The backward sums the ``repeat`` gradients of each head.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
from collections.abc import Iterator, Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist

from ..errors import InvalidInputError, TransportError

__all__ = ["Direction", "Transport", "check_heads", "exchange", "group_size", "heads_to_seq", "kv_repeats",
           "qkv_to_heads", "seq_to_heads", "symm_mem_reason"]

Transport = Literal["all_to_all", "symm_mem"]
Direction = Literal["seq_to_heads", "heads_to_seq"]
_INVERSE: dict[Direction, Direction] = {"seq_to_heads": "heads_to_seq", "heads_to_seq": "seq_to_heads"}


def exchange(xs: Sequence[torch.Tensor], direction: Direction, group: dist.ProcessGroup, transport: Transport,
             repeats: Sequence[int] | None = None) -> tuple[torch.Tensor, ...]:
    """The all-to-all of ``direction`` on every tensor of ``xs`` at once: one exchange, differentiable (the
    backward is one exchange of the gradients the other way).

    xs: seq_to_heads: each ``(T/sp, H_p, D_p)``; heads_to_seq: each ``(T, H_p, D_p)``; one dtype, one device, any
    strides. repeats: per tensor, seq_to_heads only: ``1``, or ``sp // H_p`` where ``H_p < sp`` (rank ``j`` gets
    head ``j // repeat``). Returns per tensor, seq_to_heads: ``(T, H_p * repeat / sp, D_p)``, views into one
    received buffer; heads_to_seq: ``(T/sp, H_p * sp, D_p)``.
    """
    repeats = tuple(repeats) if repeats is not None else (1,) * len(xs)
    return _Exchange.apply(direction, group, transport, repeats, *xs)


def check_heads(num_heads: int, num_kv_heads: int, sp: int, *, family: str | None = None,
                transformers_version: str | None = None) -> None:
    """Raise `InvalidInputError` unless ``sp`` divides the query heads and divides or is divided by the KV heads."""
    if num_heads % sp or (num_kv_heads % sp and sp % num_kv_heads):
        sizes = [d for d in range(1, num_heads + 1)
                 if not num_heads % d and (not num_kv_heads % d or not d % num_kv_heads)]
        raise InvalidInputError(
            f"cannot split {num_heads} query / {num_kv_heads} KV heads over a sequence-parallel group of {sp}",
            family=family,
            transformers_version=transformers_version,
            why="Ulysses gives each rank num_heads / sp query heads, and either num_kv_heads / sp KV heads or one "
            "KV head repeated sp / num_kv_heads times",
            supported="sp dividing num_attention_heads, and sp dividing or divided by num_key_value_heads",
            fix=f"use a group size among {sizes}",
        )


def group_size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def kv_repeats(num_kv_heads: int, sp: int) -> int:
    """Copies of each KV head needed for the head split: ``sp // Hkv`` when ``Hkv < sp``, else 1."""
    return sp // num_kv_heads if num_kv_heads < sp else 1


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, transport: Transport = "all_to_all") -> torch.Tensor:
    """``(T/sp, H, D)`` sequence shard -> ``(T, H/sp, D)`` head shard (this rank's heads, every token)."""
    return exchange((x,), "seq_to_heads", group, transport)[0]


def qkv_to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                 transport: Transport = "all_to_all") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`seq_to_heads` of a layer's q, k and v in one exchange (one all-to-all forward, one backward).

    q: ``(T/sp, Hq, D)``; k, v: ``(T/sp, Hkv, D)``. Returns ``(T, Hq/sp, D)`` and twice ``(T, max(Hkv/sp, 1), D)``
    (views into one received buffer). With ``Hkv < sp`` rank ``r`` receives KV head ``r // kv_repeats(Hkv, sp)``,
    read where it lies: no repeated K/V is built, and the backward sums each head's gradients over its copies.
    """
    repeat = kv_repeats(k.shape[1], group_size(group))
    q, k, v = exchange((q, k, v), "seq_to_heads", group, transport, (1, repeat, repeat))
    return q, k, v


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, transport: Transport = "all_to_all") -> torch.Tensor:
    """``(T, H/sp, D)`` head shard -> ``(T/sp, H, D)`` sequence shard; the inverse of `seq_to_heads`."""
    return exchange((x,), "heads_to_seq", group, transport)[0]


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, direction: Direction, group: dist.ProcessGroup, transport: Transport,
                repeats: tuple[int, ...], *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (direction, group, transport, repeats)
        return _run(xs, direction, group, transport, repeats)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        direction, group, transport, repeats = ctx.args
        back = _run(grads, _INVERSE[direction], group, transport, (1,) * len(grads))
        return (None, None, None, None, *sum_repeats(back, repeats))


def sum_repeats(grads: Sequence[torch.Tensor], repeats: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Gradients of the repeated heads ``(T/sp, H * r, D)`` -> of the heads ``(T/sp, H, D)`` (copy ``c`` of head
    ``h`` is head ``h * r + c``, as ``repeat_interleave``)."""
    # (T/sp, H * r, D) -> (T/sp, H, r, D) -> (T/sp, H, D)
    return tuple(g if r == 1 else g.unflatten(1, (-1, r)).sum(2) for g, r in zip(grads, repeats))


def _run(xs: Sequence[torch.Tensor], direction: Direction, group: dist.ProcessGroup, transport: Transport,
         repeats: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    p = plan(xs, direction, group.size(), repeats)
    if transport == "symm_mem":
        _symm_mem(p, _workspace(group, xs[0].device))
    else:
        _all_to_all(p, group)
    return p.outputs


class Part(NamedTuple):
    """Where one tensor sits in the wire: ``heads`` of ``dim`` per rank (head side), elements
    ``[offset, offset + heads * dim)`` of each token's row; ``repeat``: copies of each head sent (sequence side)."""

    heads: int
    dim: int
    repeat: int
    offset: int


class Plan(NamedTuple):
    """One rank's exchange: where each chunk it sends comes from, where each chunk it receives goes.

    src, dst: per tensor, its chunks as ``(sp / repeat, repeat, T/sp, heads, dim)``; chunk ``j`` is
    ``[j // repeat, j % repeat]`` (`chunk`); ``repeat > 1`` only on a sending sequence side, as an expanded
    dimension. src_wire, dst_wire: that side as one contiguous ``(sp, T/sp, W)`` wire buffer, where it is one.
    outputs: what the exchange returns once ``dst`` is filled.
    """

    parts: tuple[Part, ...]
    rows: int  # T/sp
    width: int  # W
    src: tuple[torch.Tensor, ...]
    dst: tuple[torch.Tensor, ...]
    src_wire: torch.Tensor | None
    dst_wire: torch.Tensor | None
    outputs: tuple[torch.Tensor, ...]


def plan(xs: Sequence[torch.Tensor], direction: Direction, sp: int, repeats: Sequence[int]) -> Plan:
    """The `Plan` of exchanging ``xs`` (as `exchange` takes them) over ``sp`` ranks; allocates the outputs.

    Every view is one ``as_strided`` from the strides at hand (this runs per exchange, on the host's clock).
    """
    _check(xs, direction, sp, repeats)
    to_heads = direction == "seq_to_heads"
    parts, offset = [], 0
    for x, r in zip(xs, repeats):
        heads = x.shape[1] * r // sp if to_heads else x.shape[1]
        parts.append(Part(heads, x.shape[2], r, offset))
        offset += heads * x.shape[2]
    if to_heads:
        rows = xs[0].shape[0]
        wire = xs[0].new_empty(sp, rows, offset)  # what arrives is the output
        outputs = tuple(_head_view(wire, p) for p in parts)
        return Plan(tuple(parts), rows, offset, tuple(_seq_chunks(x, p, sp) for x, p in zip(xs, parts)),
                    tuple(wire_chunks(wire, p) for p in parts), None, wire, outputs)
    rows = xs[0].shape[0] // sp
    outputs = tuple(x.new_empty(rows, x.shape[1] * sp, x.shape[2]) for x in xs)
    src_wire = xs[0].view(sp, rows, offset) if len(xs) == 1 and xs[0].is_contiguous() else None
    return Plan(tuple(parts), rows, offset, tuple(_head_chunks(x, sp) for x in xs),
                tuple(_seq_chunks(o, p, sp) for o, p in zip(outputs, parts)), src_wire, None, outputs)


def _seq_chunks(x: torch.Tensor, part: Part, sp: int) -> torch.Tensor:
    """``(T/sp, H, D)`` sequence side -> its chunks ``(sp / r, r, T/sp, h, D)``: chunk ``j`` is heads
    ``[(j // r) h, (j // r + 1) h)`` (with ``r > 1``, ``h = 1``: head ``j // r``, the copies a stride-0 dim)."""
    s_t, s_h, s_d = x.stride()
    # (T/sp, H, D) -> (T/sp, sp / r, h, D) -> (sp / r, T/sp, h, D) -> (sp / r, r, T/sp, h, D)
    return x.as_strided((sp // part.repeat, part.repeat, x.shape[0], part.heads, part.dim),
                        (part.heads * s_h, 0, s_t, s_h, s_d))


def _head_chunks(y: torch.Tensor, sp: int) -> torch.Tensor:
    """``(T, h, D)`` head side -> its chunks ``(sp, 1, T/sp, h, D)``: chunk ``i`` is rank i's tokens."""
    s_t, s_h, s_d = y.stride()
    # (T, h, D) -> (sp, T/sp, h, D) -> (sp, 1, T/sp, h, D)
    return y.as_strided((sp, 1, y.shape[0] // sp, *y.shape[1:]), (y.shape[0] // sp * s_t, 0, s_t, s_h, s_d))


def wire_chunks(wire: torch.Tensor, part: Part) -> torch.Tensor:
    """``(sp, T/sp, W)`` wire -> the chunks of ``part`` in it, ``(sp / r, r, T/sp, h, D)``."""
    s_c, s_t, s_w = wire.stride()
    r = part.repeat
    # (sp, T/sp, W) -> (sp, T/sp, h * D) -> (sp, T/sp, h, D) -> (sp / r, r, T/sp, h, D)
    return wire.as_strided((wire.shape[0] // r, r, wire.shape[1], part.heads, part.dim),
                           (r * s_c, s_c, s_t, part.dim * s_w, s_w), wire.storage_offset() + part.offset * s_w)


def _head_view(wire: torch.Tensor, part: Part) -> torch.Tensor:
    """A contiguous ``(sp, T/sp, W)`` wire -> ``part``'s head-side tensor in it, ``(T, h, D)`` with rows ``W`` apart."""
    # (sp, T/sp, W) -> (T, W) -> (T, h * D) -> (T, h, D)
    return wire.as_strided((wire.shape[0] * wire.shape[1], part.heads, part.dim), (wire.shape[2], part.dim, 1),
                           wire.storage_offset() + part.offset)


def chunk(chunks: torch.Tensor, j: int) -> torch.Tensor:
    """Chunk ``j`` ``(T/sp, h, D)`` of ``(sp / r, r, T/sp, h, D)`` chunks."""
    return chunks[j // chunks.shape[1], j % chunks.shape[1]]


def _slot(row: torch.Tensor, part: Part) -> torch.Tensor:
    """One wire chunk ``(T/sp, W)`` -> the place of ``part`` in it, ``(T/sp, h, D)``."""
    s_t, s_w = row.stride()
    # (T/sp, W) -> (T/sp, h * D) -> (T/sp, h, D)
    return row.as_strided((row.shape[0], part.heads, part.dim), (s_t, part.dim * s_w, s_w),
                          row.storage_offset() + part.offset * s_w)


def _check(xs: Sequence[torch.Tensor], direction: Direction, sp: int, repeats: Sequence[int]) -> None:
    shapes = [tuple(x.shape) for x in xs]
    why = None
    if not xs or len(repeats) != len(xs):
        why = f"{len(xs)} tensors, {len(repeats)} repeats"
    elif any(len(s) != 3 for s in shapes) or len({s[0] for s in shapes}) != 1:
        why = f"shapes {shapes}: each (tokens, heads, head_dim), one token count"
    elif len({(x.dtype, x.device) for x in xs}) != 1:
        why = f"dtypes and devices {[(str(x.dtype), str(x.device)) for x in xs]} differ"
    elif direction == "heads_to_seq" and (shapes[0][0] % sp or any(r != 1 for r in repeats)):
        why = f"shapes {shapes} with repeats {tuple(repeats)}: T must divide by {sp}, nothing is repeated"
    elif direction == "seq_to_heads" and any((s[1] * r) % sp or (r != 1 and s[1] * r != sp)
                                             for s, r in zip(shapes, repeats)):
        why = f"shapes {shapes} with repeats {tuple(repeats)}: heads x repeat must be a multiple of {sp}, " \
              f"and exactly {sp} where repeat > 1"
    if why is not None:
        raise InvalidInputError(f"cannot run the {direction} all-to-all over {sp} ranks", why=why,
                                supported="tensors (T/sp, H, D) for seq_to_heads, (T, H/sp, D) for heads_to_seq, "
                                "sharing a dtype and a device",
                                fix="exchange q, k and v of one layer together, or each tensor alone")


def _all_to_all(p: Plan, group: dist.ProcessGroup) -> None:
    send = pack(p, group.size())
    recv = p.dst_wire if p.dst_wire is not None else torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    if p.dst_wire is None:
        unpack(p, recv)


def pack(p: Plan, sp: int) -> torch.Tensor:
    """The send buffer ``(sp, T/sp, W)``: the source side itself where it is one, else one copy per tensor."""
    if p.src_wire is not None:
        return p.src_wire
    wire = torch.empty(sp, p.rows, p.width, dtype=p.src[0].dtype, device=p.src[0].device)
    for part, chunks in zip(p.parts, p.src):
        _copy(wire_chunks(wire, part), chunks)
    return wire


def unpack(p: Plan, recv: torch.Tensor) -> None:
    """Copy the received wire ``(sp, T/sp, W)`` to the destination side, one copy per tensor."""
    for part, chunks in zip(p.parts, p.dst):
        _copy(chunks, wire_chunks(recv, part))


def push(p: Plan, targets: Sequence[torch.Tensor], rank: int) -> None:
    """Write what this rank owes peer ``j`` straight into ``targets[j]``, its ``(T/sp, W)`` chunk of peer j's
    workspace (not j = rank): one copy per tensor, or one per peer from a wire source.

    Peers are written in a rotated order, so at any moment each workspace has about one writer.
    """
    sp = len(targets)
    for step in range(1, sp):
        j = (rank + step) % sp
        if p.src_wire is not None:
            _copy(targets[j], p.src_wire[j])
            continue
        for part, chunks in zip(p.parts, p.src):
            _copy(_slot(targets[j], part), chunk(chunks, j))


def keep(p: Plan, rank: int) -> None:
    """Copy the chunks this rank keeps to their place in the output, one copy per tensor."""
    for src, dst in zip(p.src, p.dst):
        _copy(chunk(dst, rank), chunk(src, rank))


def collect(p: Plan, arrived: torch.Tensor, rank: int) -> None:
    """After the barrier, copy the peers' chunks from this rank's workspace ``arrived`` ``(sp, T/sp, W)`` into the
    output: per run of peers (those before this rank, those after), whole rows to a wire output, else one copy per
    tensor."""
    for a, b in ((0, rank), (rank + 1, len(arrived))):
        if a == b:
            continue
        if p.dst_wire is not None:
            _copy(p.dst_wire[a:b], arrived[a:b])
            continue
        for part, dst in zip(p.parts, p.dst):  # a destination is never repeated: (sp, 1, ...) chunks
            _copy(dst.flatten(0, 1)[a:b], wire_chunks(arrived, part).flatten(0, 1)[a:b])


def _symm_mem(p: Plan, ws: _Workspace) -> None:
    """keep (side stream) | push, barrier, collect (current stream)."""
    targets, arrived = ws.next(p.rows, p.width, p.outputs[0].dtype)
    current, side = torch.cuda.current_stream(ws.device_index), ws.side
    ws.follow(side, current)
    with _on(side, current):  # the local copies run beside the NVLink writes
        keep(p, ws.rank)
    push(p, targets, ws.rank)
    ws.handle.barrier(channel=0)
    collect(p, arrived, ws.rank)
    ws.follow(current, side)  # sources and outputs were used on side: freeing them on current waits for it


@contextlib.contextmanager
def _on(stream: torch.cuda.Stream, current: torch.cuda.Stream) -> Iterator[None]:
    """``torch.cuda.stream(stream)`` without its checks (this runs several times per exchange)."""
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(current)


class _Workspace:
    """Two equal halves of symmetric memory for one group on one device, grown to the largest exchange.

    Each rank's half ``p`` holds, once the exchange's barrier has passed, the chunks its peers pushed, as a
    ``(sp, T/sp, W)`` wire. Views into the halves are built once per (rows, width, dtype, half) and reused.
    """

    ALIGN = 256

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group, self.device = group, device
        self.rank, self.sp = group.rank(), group.size()
        self.device_index = device.index
        self.side = torch.cuda.Stream(device)
        self.event = torch.cuda.Event()
        self.handle: Any = None
        self.tensor: torch.Tensor | None = None
        self.half_bytes = 0
        self.parity = 0
        self.views: dict[tuple, tuple[list[torch.Tensor], torch.Tensor]] = {}

    def next(self, rows: int, width: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The next half's ``(push targets by rank, each (T/sp, W); this rank's wire (sp, T/sp, W))``."""
        key = (rows, width, dtype, self.parity)
        self.parity ^= 1
        if key not in self.views:
            shape = (self.sp, rows, width)
            need = -(-math.prod(shape) * dtype.itemsize // self.ALIGN) * self.ALIGN
            if need > self.half_bytes:
                self._grow(need)
                key = (rows, width, dtype, 0)
                self.parity = 1
            offset = key[3] * self.half_bytes // dtype.itemsize
            wires = [self.handle.get_buffer(i, shape, dtype, offset) for i in range(self.sp)]
            self.views[key] = ([w[self.rank] for w in wires], wires[self.rank])
        return self.views[key]

    def follow(self, waiting: torch.cuda.Stream, done: torch.cuda.Stream) -> None:
        """``waiting.wait_stream(done)`` reusing one event (no event creation per call)."""
        self.event.record(done)
        waiting.wait_event(self.event)

    def _grow(self, half_bytes: int) -> None:
        symm = _symm_mem_module()
        if self.handle is not None:
            # every peer must be done with the old workspace before anyone frees it (a host sync, once per growth)
            self.handle.barrier(channel=0)
            torch.cuda.synchronize(self.device)
            self.views.clear()
        try:
            self.tensor = symm.empty(2 * half_bytes, dtype=torch.uint8, device=self.device)
            self.handle = symm.rendezvous(self.tensor, self.group.group_name)
        except RuntimeError as exc:
            raise TransportError(
                "could not set up the symm_mem workspace", why=f"{type(exc).__name__}: {exc}",
                supported="symm_mem: CUDA tensors, nccl, every rank on one host with peer access (NVLink)",
                fix='shard_inputs(..., transport="all_to_all")',
            ) from exc
        self.half_bytes = half_bytes


_workspaces: dict[tuple[str, torch.device], _Workspace] = {}


def _workspace(group: dist.ProcessGroup, device: torch.device) -> _Workspace:
    key = (group.group_name, device)
    if key not in _workspaces:
        _workspaces[key] = _Workspace(group, device)
    return _workspaces[key]


def _symm_mem_module() -> Any:
    return importlib.import_module("torch.distributed._symmetric_memory")


def symm_mem_reason(group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Why this rank cannot use the ``"symm_mem"`` transport, or None if it can (local checks only)."""
    if device.type != "cuda":
        return f"the tensors are on {device.type}, symmetric memory needs CUDA"
    if dist.get_backend(group) != "nccl":
        return f"the group's backend is {dist.get_backend(group)}, symmetric memory needs nccl"
    try:
        params = inspect.signature(_symm_mem_module().rendezvous).parameters
    except (ImportError, AttributeError) as exc:
        return f"torch {torch.__version__} has no symmetric memory ({exc})"
    if "group" not in params:  # earlier releases take a group name and need each group enabled by hand
        return f"torch {torch.__version__}'s symmetric memory predates rendezvous(tensor, group) (torch 2.11 has it)"
    return None


def _copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` moving whole rows in the widest words their alignment allows.

    The layouts here move rows of ``H/sp * D`` elements between strided places; an element-wise copy of bf16
    moves 2 bytes a thread, 16-byte words take under half the time (bench/ulysses_a2a.py). ``view(dtype)``
    checks sizes, strides and offsets; the pointers are checked here. Integer and complex views carry no
    autograd history: call it only inside autograd Functions.
    """
    wide = _wide(dst, src)
    if wide is None:
        return dst.copy_(src)
    wide[0].copy_(wide[1])
    return dst


def _wide(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``dst`` and ``src`` viewed as the widest word both allow, or None."""
    for word in _WORDS:
        if word.itemsize > src.element_size() and not (dst.data_ptr() | src.data_ptr()) % word.itemsize:
            try:
                return dst.view(word), src.view(word)
            except RuntimeError:
                continue
    return None


_WORDS = (torch.complex128, torch.int64, torch.int32)  # 16-byte words: measured in bench/ulysses_a2a.py
