"""Run a function on N gloo ranks on 127.0.0.1: bounded in time, self-terminating, errors re-raised."""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable[..., None], rank: int, world: int, port: int, args: tuple, errors: Any) -> None:
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        code = 1
    # skip interpreter teardown: gloo's threads can abort() there after a clean run
    os._exit(code)


def run_world(fn: Callable[..., None], world: int, *args: Any, timeout: float = 240.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; raise with every rank's traceback on failure."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, errors), daemon=True) for r in range(world)]
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
            f"{len(hung)} rank(s) hung past {timeout} s; exit codes {[p.exitcode for p in procs]}\n" + "\n".join(messages)
        )
