"""The Ulysses all-to-all: trade a sequence split for a head split and back, over one of two transports.

Per rank, with ``sp`` ranks, ``T`` packed tokens and ``H`` heads of ``D``::

    seq_to_heads: (T/sp, H, D) -> (T, H/sp, D)        heads_to_seq: (T, H/sp, D) -> (T/sp, H, D)

A `Layout` names the chunks: ``send(x)[j]`` is what this rank owes rank ``j``, ``recv(out)[i]`` is where rank
``i``'s chunk lands. On the sequence-split side the chunks are strided (a head slice of every token), so some pass
has to change the layout:

- ``"all_to_all"`` (any backend, gloo included): pack the send chunks into one contiguous buffer, one
  ``all_to_all_single``, unpack. The packing is a local copy the exchange has to wait for.
- ``"symm_mem"`` (CUDA ranks that reach each other over NVLink; torch symmetric memory): each rank *pushes* the
  chunk it owes each peer straight into that peer's symmetric workspace, already in the output layout (the
  strided side of the layout change rides on the NVLink write), while a side stream copies the chunk it keeps;
  one device-side barrier; then each rank copies what arrived into its output. The workspace is
  double-buffered, so no second barrier is needed: a rank writes into a half of a peer's workspace again only
  after the next exchange's barrier, which that peer reaches after its last read of it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
from typing import Any, Callable, Iterator, Literal, NamedTuple, Sequence

import torch
import torch.distributed as dist

from .errors import TransportError

__all__ = ["HEADS_TO_SEQ", "SEQ_TO_HEADS", "Layout", "Transport", "collect", "exchange", "keep", "push",
           "symm_mem_reason"]

Transport = Literal["all_to_all", "symm_mem"]


class Layout(NamedTuple):
    """One direction of the exchange. ``out_shape``, ``send`` and ``recv`` take the group size as ``sp``."""

    name: str
    out_shape: Callable[[torch.Size, int], tuple[int, ...]]
    send: Callable[[torch.Tensor, int], torch.Tensor]  # x -> (sp, ...) chunks, chunk j for rank j
    recv: Callable[[torch.Tensor, int], torch.Tensor]  # out -> (sp, ...) chunks, chunk i from rank i
    inverse: str


SEQ_TO_HEADS = Layout(
    "seq_to_heads",
    out_shape=lambda s, sp: (s[0] * sp, s[1] // sp, s[2]),
    send=lambda x, sp: x.unflatten(1, (sp, -1)).transpose(0, 1),  # (T/sp, sp, H/sp, D) -> (sp, T/sp, H/sp, D)
    recv=lambda out, sp: out.unflatten(0, (sp, -1)),  # (T, H/sp, D) -> (sp, T/sp, H/sp, D)
    inverse="heads_to_seq",
)
HEADS_TO_SEQ = Layout(
    "heads_to_seq",
    out_shape=lambda s, sp: (s[0] // sp, s[1] * sp, s[2]),
    send=SEQ_TO_HEADS.recv,
    recv=SEQ_TO_HEADS.send,
    inverse="seq_to_heads",
)
_LAYOUTS = {lay.name: lay for lay in (SEQ_TO_HEADS, HEADS_TO_SEQ)}


def exchange(x: torch.Tensor, layout: Layout, group: dist.ProcessGroup, transport: Transport) -> torch.Tensor:
    """The all-to-all of ``layout`` on ``x``, differentiable (the backward runs the inverse layout)."""
    return _Exchange.apply(x, layout.name, group, transport)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str, group: dist.ProcessGroup, transport: Transport) -> torch.Tensor:
        ctx.args = (_LAYOUTS[name].inverse, group, transport)
        return _run(x, _LAYOUTS[name], group, transport)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        name, group, transport = ctx.args
        return _run(grad, _LAYOUTS[name], group, transport), None, None, None


def _run(x: torch.Tensor, layout: Layout, group: dist.ProcessGroup, transport: Transport) -> torch.Tensor:
    sp = group.size()
    out = x.new_empty(layout.out_shape(x.shape, sp))
    send, recv = layout.send(x, sp), layout.recv(out, sp)
    if transport == "symm_mem":
        _symm_mem(send, recv, _workspace(group, x.device), out.shape, layout)
    else:
        _all_to_all(send, recv, group)
    return out


def _all_to_all(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup) -> None:
    if not send.is_contiguous():
        send = _copy(torch.empty_like(send, memory_format=torch.contiguous_format), send)
    if recv.is_contiguous():
        dist.all_to_all_single(recv, send, group=group)
    else:
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        _copy(recv, received)


def push(send: torch.Tensor, targets: Sequence[torch.Tensor], rank: int) -> None:
    """Write chunk ``send[j]`` straight into ``targets[j]``, its place in peer j's workspace (not j = rank).

    Peers are written in a rotated order, so at any moment each workspace has about one writer.
    """
    sp = len(targets)
    for step in range(1, sp):
        j = (rank + step) % sp
        _copy(targets[j], send[j])


def keep(send: torch.Tensor, recv: torch.Tensor, rank: int) -> None:
    """Copy the chunk this rank keeps to its place in the output."""
    _copy(recv[rank], send[rank])


def collect(recv: torch.Tensor, arrived: torch.Tensor, rank: int) -> None:
    """After the barrier, copy the peers' chunks from this rank's workspace (``arrived``) into the output."""
    for i in range(len(recv)):
        if i != rank:
            _copy(recv[i], arrived[i])


def _symm_mem(send: torch.Tensor, recv: torch.Tensor, ws: _Workspace, out_shape: torch.Size, layout: Layout) -> None:
    """keep (side stream) | push, barrier, collect (current stream)."""
    targets, arrived = ws.next(out_shape, recv.dtype, layout)
    current, side = torch.cuda.current_stream(ws.device_index), ws.side
    ws.follow(side, current)
    with _on(side, current):  # the local copy runs beside the NVLink writes
        keep(send, recv, ws.rank)
    push(send, targets, ws.rank)
    ws.handle.barrier(channel=0)
    collect(recv, arrived, ws.rank)
    ws.follow(current, side)  # send and recv were used on side: freeing them on current waits for it


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

    Each rank's half ``p`` holds, once the exchange's barrier has passed, the chunks its peers pushed, in the
    output's layout. Views into the halves are built once per (shape, dtype, layout, half) and reused.
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

    def next(self, shape: torch.Size, dtype: torch.dtype, layout: Layout) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The next half's ``(push targets by rank, this rank's arrived chunks)``, both ``(sp, ...)`` chunked."""
        key = (shape, dtype, layout.name, self.parity)
        self.parity ^= 1
        if key not in self.views:
            need = -(-math.prod(shape) * dtype.itemsize // self.ALIGN) * self.ALIGN
            if need > self.half_bytes:
                self._grow(need)
                key = (shape, dtype, layout.name, 0)
                self.parity = 1
            offset = key[3] * self.half_bytes // dtype.itemsize
            halves = [layout.recv(self.handle.get_buffer(i, tuple(shape), dtype, offset), self.sp)
                      for i in range(self.sp)]
            self.views[key] = ([h[self.rank] for h in halves], halves[self.rank])
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
