"""Run a function on N ranks on 127.0.0.1 (gloo on CPU, or NCCL with one GPU per rank): bounded in time,
self-terminating, every rank's traceback re-raised.

A gloo world is spawned once per world size and kept for the next call (`_World`): each spawn imports torch,
transformers and tfcompat on every rank (~9 s on two cores), which was most of the dist tests' time. A call that
fails or hangs takes its world down with it (a rank left inside a collective cannot be reused); the next call spawns
a fresh one. ``TFCOMPAT_FRESH_WORLDS=1`` spawns one world per call, as NCCL always does. Worker functions patch
only the models they build (tfcompat's changes are per instance), so one call leaves nothing the next one reads.

With ``backend="nccl"`` each rank uses ``cuda:rank``. Children leave through ``os._exit`` after a barrier:
communicator threads can abort() during interpreter teardown after a clean run, which would turn a pass into
a crash.
"""

from __future__ import annotations

import datetime
import inspect
import os
import queue
import socket
import time
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


def _init(rank: int, world: int, port: int, backend: str) -> None:
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), **kwargs)


def _entry(fn: Callable[..., None], rank: int, world: int, port: int, backend: str, args: tuple, errors: Any) -> None:
    code = 0
    try:
        _init(rank, world, port, backend)
        fn(rank, world, *args)
        dist.barrier()
        if backend == "nccl":
            torch.cuda.synchronize()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        code = 1
    os._exit(code)


def _serve(rank: int, world: int, port: int, tasks: Any, results: Any) -> None:
    """A kept gloo rank: run each ``(fn, args)`` from ``tasks``, then a barrier; report ``(rank, traceback or
    None)``; leave on ``None`` or after a failure."""

    def leave(code: int, error: str | None = None) -> None:
        if error is not None:
            results.put((rank, error))
        results.close()
        results.join_thread()  # the queue's feeder thread flushes before the process ends
        os._exit(code)

    try:
        _init(rank, world, port, "gloo")
    except BaseException:
        leave(1, traceback.format_exc())
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            fn(rank, world, *args)
            dist.barrier()
        except BaseException:
            leave(1, traceback.format_exc())
        results.put((rank, None))
    leave(0)


class _World:
    """``world`` gloo ranks spawned once, each running the calls sent to it in turn (`_serve`)."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.tasks = [ctx.SimpleQueue() for _ in range(world)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_serve, args=(r, world, port, self.tasks[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., None], args: tuple, timeout: float) -> str:
        """Run ``fn(rank, world, *args)`` on every rank; "" on success, else what went wrong (every rank's
        traceback, the ranks that died or hung)."""
        for q in self.tasks:
            q.put((fn, args))
        done: dict[int, str | None] = {}
        deadline = time.monotonic() + timeout
        while len(done) < len(self.procs) and time.monotonic() < deadline:
            try:
                rank, error = self.results.get(timeout=1.0)
                done[rank] = error
            except queue.Empty:
                if any(not p.is_alive() for r, p in enumerate(self.procs) if r not in done):
                    time.sleep(1.0)  # a dying rank's traceback may still be in flight
                    while not self.results.empty():
                        rank, error = self.results.get()
                        done[rank] = error
                    break
        missing = [r for r in range(len(self.procs)) if r not in done]
        errors = [f"rank {r}:\n{e}" for r, e in sorted(done.items()) if e]
        if missing:
            errors.append(f"rank(s) {missing} died or hung past {timeout} s; exit codes "
                          f"{[p.exitcode for p in self.procs]}")
        return "\n".join(errors)

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.join(5)


_worlds: dict[int, _World] = {}


def run_world(fn: Callable[..., None], world: int, *args: Any, backend: str = "gloo", timeout: float = 300.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; raise with every rank's traceback on failure.
    ``fn`` must be importable by name (a module-level function of a workers module)."""
    if backend == "gloo" and os.environ.get("TFCOMPAT_FRESH_WORLDS") != "1":
        kept = _worlds.pop(world, None) or _World(world)
        error = kept.run(fn, args, timeout)
        if error:
            kept.close()
            raise AssertionError(error)
        _worlds[world] = kept
        return
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
