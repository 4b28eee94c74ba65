"""Host offload of what `checkpoint_keep` keeps: to pinned host memory in the forward, back ahead of its layer.

A kept module (`tfcompat.hf.checkpointing`) holds its saved tensors and its outputs from the forward to its layer's
backward: the GPU memory that buys the skipped recompute. Under ``patch(checkpoint_offload=...)`` those tensors of
the chosen layers are copied to pinned host memory as they are saved, on a side stream that waits for the compute
stream (an event, not the host); their GPU blocks are freed once the copy is done (the caching allocator's
``record_stream``), so the compute stream never waits for the copy. When a layer's recompute starts, its tensors
(`Stash.fetch`) and those of the next layers of the backward (`Stash.fetch_ahead`; with ``checkpoint_fetch=
"mlp_in"`` or ``"attention"`` later, when the gradient reaches the layer's kept module of that kind, in as many
parts as it has such outputs) are copied back on a second side stream, and the backward waits for them on an
event. Ahead goes at least the next offloading
layer, and more while the bytes ahead stay within the largest layer's: the link stays busy through layers that
offload little (a light layer's backward is the time a heavy one's copy needs), and the memory held ahead is at
most one layer's, as with one layer ahead. No host sync in the forward or the backward. The bytes come back as they
left, so the gradients are those of the kept path without offload, bit for bit.

Per storage: the views of one storage saved in a layer (q/k/v projections' common input, an output and its
reshape) share one copy and come back as views of one block. Offloaded: strided plain tensors of at least
`MIN_BYTES` whose storage is not a parameter's (the parameters stay on the GPU anyway). Not offloaded, held as
without offload: parameters, views of them, tensors that require grad as leaves, smaller tensors. On CPU the copy
is a plain clone (tests).

The link bounds it: each offloaded byte crosses it twice (a layer of the 28-layer Qwen2.5-7B-shaped step of 19,679
tokens: about 0.46 GB for its attention, 1.5 GB more for ``"mlp_in"``, the modules' inputs not counted: those are
recomputed, `tfcompat.hf.kept_inputs`); the first layers are the ones to offload, since
their copies have the whole forward to go out and the backward of the later layers to come back, and their kept
tensors are the ones alive at the step's peak (late in the backward).

Host memory: PyTorch's pinned allocator rounds each block up to a power of two (a 141 MB storage takes 256 MB);
``PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:64`` stops that above 64 MiB in releases that take the key
(torch 2.11 refuses it). The blocks are cached from step to step.

The method of torchao's and torchtitan's activation offloading (saved-tensor hooks, a side stream, ``record_stream``),
applied to the kept modules only.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, cast

import torch

__all__ = ["MIN_BYTES", "Offloader", "Stash", "View", "unpack"]

MIN_BYTES = 1 << 20
"""Smaller storages stay where they are: their copies would cost more in launches than they free."""


@dataclass(eq=False)
class _Copy:
    """One storage's bytes: ``host`` ``(nbytes,)`` uint8 (pinned on CUDA) until fetched, then ``back`` on the
    device. ``saved``: the copy to the host is done; ``ready``: the copy back is."""

    host: torch.Tensor | None
    nbytes: int
    device: torch.device
    streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None  # (to the host, back); None on CPU
    saved: torch.cuda.Event | None
    back: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None


@dataclass(frozen=True)
class View:
    """Where a saved tensor lies in its storage (dtype, size, stride, offset), to rebuild it on another storage of
    the same bytes: a copy brought back, or the same tensor recomputed (`tfcompat.hf.kept_inputs`)."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, t: torch.Tensor) -> View:
        return cls(t.dtype, tuple(t.shape), t.stride(), int(t.storage_offset()))

    def on(self, storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=device).set_(storage, self.offset, self.size, self.stride)


@dataclass(frozen=True, eq=False)
class _Packed:
    """A saved tensor as a view of its storage's copy (a pytree leaf, unlike a NamedTuple)."""

    copy: _Copy
    view: View

    def unpack(self) -> torch.Tensor:
        c = self.copy
        if c.back is None:  # not prefetched (a kept module's tensor unpacked before its layer's recompute)
            _fetch([c])
        back = cast(torch.Tensor, c.back)  # _fetch set it
        if c.ready is not None:
            torch.cuda.current_stream(c.device).wait_event(c.ready)
        # (nbytes,) uint8 -> the saved view: same dtype, size, stride and offset, on the copied-back block
        return self.view.on(back.untyped_storage(), c.device)


def _is_offloadable(t: torch.Tensor, min_bytes: int) -> bool:
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.device.type not in ("cuda", "cpu"):
        return False  # parameters, subclasses (DTensor, fake tensors), sparse and meta tensors: held
    base = t._base
    for x in (t,) if base is None else (t, base):
        if isinstance(x, torch.nn.Parameter) or (x.is_leaf and x.requires_grad):
            return False
    return t.untyped_storage().nbytes() >= min_bytes


def _fetch(copies: list[_Copy]) -> None:
    """Copy ``copies`` (of one device, at least one) back to it, each into a block of its compute stream."""
    device, streams = copies[0].device, copies[0].streams
    hosts = [cast(torch.Tensor, c.host) for c in copies]  # not fetched yet: still on the host
    backs = [torch.empty(h.numel(), dtype=torch.uint8, device=device) for h in hosts]
    if streams is None:
        for c, host, back in zip(copies, hosts, backs):
            back.copy_(host)
            c.back, c.host = back, None
        return
    stream = streams[1]
    stream.wait_stream(torch.cuda.current_stream(device))  # the new blocks' earlier users on the compute stream
    with torch.cuda.stream(stream):
        for c, host, back in zip(copies, hosts, backs):
            stream.wait_event(cast(torch.cuda.Event, c.saved))
            back.copy_(host, non_blocking=True)  # records its event on the pinned block: freed after the copy
            back.record_stream(stream)  # a block fetched but never unpacked is not reused before the copy is done
    ready = torch.cuda.Event()
    ready.record(stream)
    for c, back in zip(copies, backs):
        c.back, c.host, c.ready = back, None, ready


class Stash:
    """One checkpointed layer call's offloaded storages (`Offloader.stash`): `pack` in the forward, `close` at its
    end, `fetch` when its recompute starts. A layer keeping modules without offloading has one that offloads
    nothing (``offloads=False``): its recompute still fetches the next layers' ahead."""

    def __init__(self, offloader: Offloader, offloads: bool) -> None:
        self._offloader = offloader
        self._offloads = offloads
        self._copies: list[weakref.ref[_Copy]] = []  # a copy lives as long as a saved tensor or kept output uses it
        self._open: dict[int, tuple[torch.Tensor, _Copy]] = {}  # storage address -> (its bytes, its copy)
        self.nbytes = 0  # copied to the host

    def pack(self, t: torch.Tensor) -> Any:
        """A saved tensor or kept output: its storage's copy (the same for every view of it), or the tensor itself
        detached where it is not offloaded."""
        if not (self._offloads and _is_offloadable(t, self._offloader.min_bytes)):
            return t.detach()
        storage = t.untyped_storage()
        key = storage.data_ptr()
        found = self._open.get(key)
        if found is None:
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)  # (nbytes,) the storage's bytes
            found = (src, self._save(src))
            self._open[key] = found  # held to the forward's end: the address names this storage until then
            self._copies.append(weakref.ref(found[1]))
        return _Packed(found[1], View.of(t))

    def _save(self, src: torch.Tensor) -> _Copy:
        self.nbytes += src.numel()
        if src.device.type != "cuda":
            return _Copy(src.clone(), src.numel(), src.device, None, None)
        streams = self._offloader.streams(src.device)
        host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
        out = streams[0]
        out.wait_stream(torch.cuda.current_stream(src.device))  # the bytes are written on the compute stream
        with torch.cuda.stream(out):
            host.copy_(src, non_blocking=True)
        src.record_stream(out)  # the block is not reused before the copy is done
        saved = torch.cuda.Event()
        saved.record(out)
        return _Copy(host, src.numel(), src.device, streams, saved)

    def close(self) -> None:
        """The forward of the layer is done: its blocks are the allocator's once copied."""
        self._open.clear()

    def fetch(self) -> None:
        """Copy this layer's storages back (those not fetched ahead yet)."""
        _fetch_each_device(self._pending())

    def fetch_ahead(self, share: float = 1.0) -> None:
        """Copy back those of the layers next in the backward: the next that offloads, and more while the bytes
        ahead stay within the largest layer's. ``share`` < 1: of their copies not back yet, only the first to have
        left (whole storages, at least one) while the bytes before each stay under that share of theirs; a later
        call brings more."""
        ahead, largest, pending = 0, self._offloader.largest(), []
        for stash in self._offloader.before(self):
            if not stash.nbytes:
                continue
            if ahead and ahead + stash.nbytes > largest:
                break
            ahead += stash.nbytes
            pending += stash._pending()
        limit, before = share * sum(c.nbytes for c in pending), 0
        for i, c in enumerate(pending):
            if i and before >= limit:
                pending = pending[:i]
                break
            before += c.nbytes
        _fetch_each_device(pending)

    def _pending(self) -> list[_Copy]:
        """This layer's copies not fetched yet, in the order they left (and the list pruned to them)."""
        copies = [c for r in self._copies if (c := r()) is not None and c.back is None]
        self._copies = [weakref.ref(c) for c in copies]
        return copies


def _fetch_each_device(copies: list[_Copy]) -> None:
    for device in dict.fromkeys(c.device for c in copies):  # one layer is on one device, as a rule
        _fetch([c for c in copies if c.device == device])


class Offloader:
    """The side streams of one patch and its live stashes in forward order (the order the backward reverses)."""

    def __init__(self, min_bytes: int | None = None) -> None:
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self._stashes: list[weakref.ref[Stash]] = []

    def stash(self, offloads: bool) -> Stash:
        """A new stash, for one checkpointed call of a layer keeping modules (``offloads``: whether it offloads)."""
        s = Stash(self, offloads)
        self._stashes = [r for r in self._stashes if r() is not None] + [weakref.ref(s)]
        return s

    def largest(self) -> int:
        """The most bytes one live stash (a layer call of this step) has offloaded."""
        return max((s.nbytes for r in self._stashes if (s := r()) is not None), default=0)

    def before(self, stash: Stash) -> list[Stash]:
        """The live stashes made before ``stash``, the nearest first (the order the backward reaches them)."""
        live = [s for r in self._stashes if (s := r()) is not None]
        i = next(i for i, s in enumerate(live) if s is stash)
        return live[:i][::-1]

    def streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The device's two side streams: copies to the host, copies back."""
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]


def unpack(x: Any) -> Any:
    """`Stash.pack`'s result back as a tensor on its device."""
    return x.unpack() if isinstance(x, _Packed) else x
