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
  one device-side barrier; then each rank copies what arrived into its output (contiguous blocks). The
  workspace is double-buffered, so one barrier per exchange is enough: a rank writes into a half of a peer's
  workspace again only after the next exchange's barrier, which that peer reaches after its last read of it.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable, Literal, NamedTuple

import torch
import torch.distributed as dist
from packaging.version import Version

from .errors import TransportError

__all__ = ["HEADS_TO_SEQ", "SEQ_TO_HEADS", "Layout", "Transport", "collect", "exchange", "keep", "push", "symm_mem_reason"]

Transport = Literal["all_to_all", "symm_mem"]
SYMM_MEM_TORCH = (2, 11)  # run on the GPU machine with 2.11 and checked in 2.13's source


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
    sp = dist.get_world_size(group)
    out = x.new_empty(layout.out_shape(x.shape, sp))
    if transport == "symm_mem":
        _symm_mem(x, out, layout, group, sp)
    else:
        _all_to_all(x, out, layout, group, sp)
    return out


def _all_to_all(x: torch.Tensor, out: torch.Tensor, layout: Layout, group: dist.ProcessGroup, sp: int) -> None:
    send = layout.send(x, sp)
    if not send.is_contiguous():
        send = _copy(torch.empty_like(send, memory_format=torch.contiguous_format), send)
    recv = layout.recv(out, sp)
    if recv.is_contiguous():
        dist.all_to_all_single(recv, send, group=group)
    else:
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        _copy(recv, received)


def push(x: torch.Tensor, peers: Callable[[int], torch.Tensor], layout: Layout, rank: int, sp: int) -> None:
    """Write the chunk owed to each peer straight into its place in that peer's workspace (shaped like the output).

    Peers are written in a rotated order, so at any moment each workspace has about one writer.
    """
    send = layout.send(x, sp)
    for step in range(1, sp):
        j = (rank + step) % sp
        _copy(layout.recv(peers(j), sp)[rank], send[j])


def keep(x: torch.Tensor, out: torch.Tensor, layout: Layout, rank: int, sp: int) -> None:
    """Copy the chunk this rank keeps from ``x`` to its place in ``out``."""
    _copy(layout.recv(out, sp)[rank], layout.send(x, sp)[rank])


def collect(out: torch.Tensor, local: torch.Tensor, layout: Layout, rank: int, sp: int) -> None:
    """Copy the peers' chunks from this rank's workspace ``local`` into ``out`` (after the barrier)."""
    recv, arrived = layout.recv(out, sp), layout.recv(local, sp)
    for i in range(sp):
        if i != rank:
            _copy(recv[i], arrived[i])


def _symm_mem(x: torch.Tensor, out: torch.Tensor, layout: Layout, group: dist.ProcessGroup, sp: int) -> None:
    rank = dist.get_rank(group)
    workspace = _workspace(group, x.device)
    peers = workspace.half(out.shape, out.dtype)
    current, side = torch.cuda.current_stream(x.device), workspace.side
    side.wait_stream(current)
    with torch.cuda.stream(side):  # the local copy overlaps the NVLink writes
        keep(x, out, layout, rank, sp)
    push(x, peers, layout, rank, sp)
    workspace.handle.barrier(channel=0)
    collect(out, peers(rank), layout, rank, sp)
    current.wait_stream(side)  # x and out are used on side: freeing them on current waits for it


class _Workspace:
    """Two equal halves of symmetric memory for one group on one device, grown to the largest exchange."""

    ALIGN = 256

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group, self.device = group, device
        self.handle: Any = None
        self.tensor: torch.Tensor | None = None
        self.half_bytes = 0
        self.parity = 0
        self.side = torch.cuda.Stream(device)

    def half(self, shape: torch.Size, dtype: torch.dtype) -> Callable[[int], torch.Tensor]:
        """Rank -> that rank's next half, viewed as ``shape``; alternates halves on every call."""
        elem = dtype.itemsize
        need = -(-math.prod(shape) * elem // self.ALIGN) * self.ALIGN
        if need > self.half_bytes:
            self._grow(need)
        offset = self.parity * self.half_bytes // elem
        self.parity ^= 1
        return lambda rank: self.handle.get_buffer(rank, tuple(shape), dtype, offset)

    def _grow(self, half_bytes: int) -> None:
        symm = _symm_mem_module()
        if self.handle is not None:
            # every peer must be done reading the old workspace before anyone unmaps it (a host sync, once per growth)
            self.handle.barrier(channel=0)
            torch.cuda.synchronize(self.device)
        try:
            self.tensor = symm.empty(2 * half_bytes, dtype=torch.uint8, device=self.device)
            self.handle = symm.rendezvous(self.tensor, self.group.group_name)
        except RuntimeError as exc:
            raise TransportError(
                "could not set up the symm_mem workspace", why=f"{type(exc).__name__}: {exc}",
                supported="symm_mem: CUDA tensors, nccl, every rank on one host with peer access (NVLink)",
                fix='shard_inputs(..., transport="all_to_all")',
            ) from exc
        self.half_bytes, self.parity = half_bytes, 0


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
    if Version(torch.__version__).release < SYMM_MEM_TORCH:
        return (f"torch {torch.__version__} predates {'.'.join(map(str, SYMM_MEM_TORCH))}, the first release whose "
                "symmetric memory tfcompat has run (earlier ones need each group enabled by hand)")
    return None


def _copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` moving whole rows in the widest words their alignment allows.

    The layouts here move rows of ``H/sp * D`` elements between strided places; an element-wise copy of bf16
    moves 2 bytes a thread, 8- or 16-byte words take a fraction of the time (bench/ulysses_a2a.py). Integer
    views carry no autograd history: call it only inside autograd Functions.
    """
    word = _word(dst, src)
    if word is not None:
        dst.view(word).copy_(src.view(word))
    else:
        dst.copy_(src)
    return dst


_WORDS = (torch.complex128, torch.int64, torch.int32, torch.int16)  # 16-byte words: measured in bench/ulysses_a2a.py


def _word(*tensors: torch.Tensor) -> torch.dtype | None:
    elem = tensors[0].element_size()
    for word in _WORDS:
        size = word.itemsize
        if size > elem and all(
            t.stride(-1) == 1 and t.shape[-1] * elem % size == 0
            and all(s * elem % size == 0 for s in (*t.stride()[:-1], t.storage_offset()))
            and t.data_ptr() % size == 0
            for t in tensors
        ):
            return word
    return None
