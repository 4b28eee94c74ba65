"""Shared helpers of the benchmark scripts: machine description, timing, tables, JSON output.

Not a benchmark itself. The scripts import it as ``_common`` (``python bench/x.py`` puts ``bench/`` first on
``sys.path``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Multi-GPU hosts of the lab machines must keep NVLink multicast off; spawned workers inherit these.
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on CPU (sdpa backend, fp32, gloo): checks the script end to end")
    p.add_argument("--out", default=None, help="write the results as JSON to this path")
    p.add_argument("--warmup", type=int, default=None, help="warm-up iterations per measurement")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement (median reported)")
    return p


def device_for(smoke: bool) -> torch.device:
    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on the GPU machine, or pass --smoke for the CPU check")
    return torch.device("cuda", torch.cuda.current_device())


def machine(device: torch.device | None = None) -> dict[str, Any]:
    """What ran the benchmark: GPU name, library versions, date."""
    import transformers

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
    }
    if device is not None and device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_count"] = torch.cuda.device_count()
    else:
        info["gpu"] = "none (CPU)"
        info["cpu_threads"] = torch.get_num_threads()
    info["flash_attn"] = None
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("flash-attn-4", "flash-attn-3", "flash-attn"):  # FA4 installs flash_attn.cute, FA2 flash_attn
        try:
            info["flash_attn"] = f"{dist} {version(dist)}"
            break
        except PackageNotFoundError:
            continue
    return info


def machine_line(info: dict[str, Any]) -> str:
    return (f"machine: {info['gpu']} | torch {info['torch']} (cuda {info['cuda']}) | transformers "
            f"{info['transformers']} | flash_attn {info['flash_attn']} | {info['date']}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> list[float]:
    """Per-repetition wall time of ``fn`` in ms: CUDA events on GPU, perf_counter + synchronize on CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(reps):
        out.append(_one(fn, device))
    return out


def _one(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_interleaved(fns: dict[str, Callable[[], Any]], device: torch.device, warmup: int,
                     reps: int) -> dict[str, list[float]]:
    """Time several variants round-robin (one rep of each in turn), so drift hits them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(device)
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            out[name].append(_one(fn, device))
    return out


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _fmt(c: Any) -> str:
    if isinstance(c, float):
        return f"{c:.4g}" if abs(c) < 1e4 else f"{c:,.0f}"
    return str(c)


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {path}")


def random_lengths(total: int, n: int, seed: int, min_len: int = 1) -> list[int]:
    """``n`` seeded random positive lengths summing exactly to ``total`` (each at least ``min_len``)."""
    if n * min_len > total:
        raise ValueError(f"cannot split {total} into {n} lengths of at least {min_len}")
    gen = torch.Generator().manual_seed(seed)
    spare = total - n * min_len
    cuts = sorted(torch.randint(0, spare + 1, (n - 1,), generator=gen).tolist())
    parts = [b - a for a, b in zip([0, *cuts], [*cuts, spare])]
    return [p + min_len for p in parts]
