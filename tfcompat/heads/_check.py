"""The heads' input check read on the host without holding the GPU up.

`tfcompat.heads` raises a typed error for an out-of-range label or a bad per-token temperature, so two flags
computed on the device must reach the host. A plain ``.tolist()`` copies them on the compute stream and blocks the
host until that copy is done: the GPU runs dry meanwhile, and the copy waits its turn on the copy engine behind
whatever else is going to the host (activation offload's copies: 11-27 ms of idle GPU per step, bench/RESULTS.md
section 19). On CUDA the flags go to pinned host memory on a side stream instead, and the head reads them once its
own work is queued: the GPU runs the head while the copy waits, and the error is still raised before the head
returns.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["deferred"]

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def deferred(flags: torch.Tensor) -> Callable[[], list[bool]]:
    """``flags`` ``(n,)`` bool -> a function giving them as host bools: on CUDA copied now on a side stream (after
    the compute stream's work so far) and read when called, waiting for that copy alone; elsewhere read now."""
    if flags.device.type != "cuda":
        values = flags.tolist()
        return lambda: values
    device = flags.device
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the flags are computed on the compute stream
    host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
    done = torch.cuda.Event()
    with torch.cuda.stream(stream):
        host.copy_(flags, non_blocking=True)
        done.record(stream)
    flags.record_stream(stream)  # its block is not reused before the copy is done

    def read() -> list[bool]:
        done.synchronize()
        return host.tolist()

    return read
