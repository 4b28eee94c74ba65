"""Run a function on N ranks on 127.0.0.1 (gloo on CPU, or NCCL with one GPU per rank): bounded in time,
self-terminating, every rank's traceback re-raised.

With ``backend="nccl"`` each rank uses ``cuda:rank``. Children leave through ``os._exit`` after a barrier:
communicator threads can abort() during interpreter teardown after a clean run, which would turn a pass into
a crash.
"""

from __future__ import annotations

import datetime
import inspect
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Lab multi-GPU hosts must keep NVLink multicast off; the spawned ranks inherit these.
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable[..., None], rank: int, world: int, port: int, backend: str, args: tuple, errors: Any) -> None:
    code = 0
    try:
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            if "device_id" in inspect.signature(dist.init_process_group).parameters:
                kwargs["device_id"] = torch.device("cuda", rank)
        else:
            torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120), **kwargs)
        fn(rank, world, *args)
        dist.barrier()
        if backend == "nccl":
            torch.cuda.synchronize()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        code = 1
    os._exit(code)


def run_world(fn: Callable[..., None], world: int, *args: Any, backend: str = "gloo", timeout: float = 300.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; raise with every rank's traceback on failure."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, backend, args, errors), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    for p in procs:
        p.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join(5)
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    if hung or messages or any(p.exitcode for p in procs):
        raise AssertionError(
            f"{len(hung)} rank(s) hung past {timeout} s; exit codes {[p.exitcode for p in procs]}\n"
            + "\n".join(messages)
        )
