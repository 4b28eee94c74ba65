"""Peak extra memory and time of `tfcompat.heads.logprobs_entropy`, backend "torch" against "logits".

One step is forward + backward of ``(a * logprobs).sum() + (b * entropy).sum()`` with random ``a, b``,
gradients for hidden and the lm-head weight. Measured per backend:

- time: median wall-clock of ``--repeats`` steps after ``--warmup`` steps (synchronized on CUDA);
- peak extra (CUDA only): ``max_memory_allocated()`` during one step minus ``memory_allocated()`` just
  before it, when only the inputs are held; it includes the step's own gradients ``hidden.grad`` and
  ``weight.grad``, the same for both backends;
- saved: bytes that autograd keeps alive between forward and backward beyond the inputs' own storages
  (recorded with ``torch.autograd.graph.saved_tensors_hooks``; any device).

Targets: peak extra of "torch" <= 1/8 of "logits", time within 1.3x.

    python bench/heads_memory.py                       # T=8192, V=152064, H=3584, bf16 on CUDA
    python bench/heads_memory.py --device cpu --small  # T=1024, V=32000,  H=512,  fp32 on CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tfcompat.heads import IGNORE_INDEX, logprobs_entropy  # noqa: E402

# chunk_size defaults to T / 8: eight chunks, as in the full shape with logprobs_entropy's default 1024
FULL = dict(tokens=8192, vocab=152064, hidden=3584, dtype="bfloat16", chunk_size=1024)
SMALL = dict(tokens=1024, vocab=32000, hidden=512, dtype="float32", chunk_size=128)
BACKENDS = ("logits", "torch")
TEMPERATURE = 0.7
MEMORY_TARGET = 1 / 8
TIME_TARGET = 1.3


class Inputs(NamedTuple):
    """hidden ``(T, H)`` and weight ``(V, H)`` requiring grad, labels ``(T,)`` (10% ignored), and the
    upstream gradients ``a, b`` ``(T,)`` float32."""

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    grad_logprobs: torch.Tensor
    grad_entropy: torch.Tensor


def make_inputs(tokens: int, vocab: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> Inputs:
    gen = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=gen, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen, device=device) / hidden_size**0.5).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    labels[torch.rand(tokens, generator=gen, device=device) < 0.1] = IGNORE_INDEX
    grads = torch.randn(2, tokens, generator=gen, device=device)
    return Inputs(hidden, weight.requires_grad_(), labels, grads[0], grads[1])


def step(inputs: Inputs, backend: str, chunk_size: int) -> torch.Tensor:
    """One forward + backward; returns the detached ``(2, T)`` outputs [logprobs; entropy]."""
    inputs.hidden.grad = inputs.weight.grad = None
    out = logprobs_entropy(inputs.hidden, inputs.weight, inputs.labels, TEMPERATURE, backend=backend,
                           chunk_size=chunk_size)
    ((inputs.grad_logprobs * out.logprobs).sum() + (inputs.grad_entropy * out.entropy).sum()).backward()
    return torch.stack([out.logprobs, out.entropy]).detach()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def saved_bytes(inputs: Inputs, backend: str, chunk_size: int) -> int:
    """Bytes of the distinct storages saved for backward, not counting the inputs' storages."""
    own = {t.untyped_storage().data_ptr() for t in inputs}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step(inputs, backend, chunk_size)
    return sum(storages.values())


def peak_extra_bytes(inputs: Inputs, backend: str, chunk_size: int, device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    inputs.hidden.grad = inputs.weight.grad = None
    gc.collect()
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step(inputs, backend, chunk_size)
    sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def measure(
    inputs: Inputs, backend: str, args: argparse.Namespace, device: torch.device
) -> tuple[dict, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Timings, memory, and the outputs and gradients of the last step (for the agreement check)."""
    for _ in range(args.warmup):
        step(inputs, backend, args.chunk_size)
    times = []
    for _ in range(args.repeats):
        sync(device)
        start = time.perf_counter()
        step(inputs, backend, args.chunk_size)
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    result = dict(
        time_ms=statistics.median(times),
        times_ms=times,
        peak_extra_bytes=peak_extra_bytes(inputs, backend, args.chunk_size, device),
        saved_bytes=saved_bytes(inputs, backend, args.chunk_size),
    )
    outputs = step(inputs, backend, args.chunk_size)
    return result, (outputs, inputs.hidden.grad, inputs.weight.grad)


def agreement(chunked: tuple[torch.Tensor, ...], reference: tuple[torch.Tensor, ...]) -> dict:
    """Max abs difference of the outputs, and of each gradient relative to the reference's largest entry."""
    (out, grad_hidden, grad_weight), (ref_out, ref_hidden, ref_weight) = chunked, reference
    return dict(
        logprobs_max_abs=(out[0] - ref_out[0]).abs().max().item(),
        entropy_max_abs=(out[1] - ref_out[1]).abs().max().item(),
        grad_hidden_max_rel=max_relative(grad_hidden, ref_hidden),
        grad_weight_max_rel=max_relative(grad_weight, ref_weight),
    )


def max_relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="T=1024, V=32000, H=512, fp32")
    parser.add_argument("--chunk-size", type=int, help="tokens per chunk (default: T / 8)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()

    device = torch.device(args.device)
    shape = SMALL if args.small else FULL
    args.chunk_size = args.chunk_size or shape["chunk_size"]
    inputs = make_inputs(shape["tokens"], shape["vocab"], shape["hidden"], getattr(torch, shape["dtype"]), device)
    results, last = {}, {}
    for backend in BACKENDS:
        results[backend], last[backend] = measure(inputs, backend, args, device)
        inputs.hidden.grad = inputs.weight.grad = None

    ref, new = results["logits"], results["torch"]
    time_ratio = new["time_ms"] / ref["time_ms"]
    memory_ratio = None if ref["peak_extra_bytes"] is None else new["peak_extra_bytes"] / ref["peak_extra_bytes"]
    report = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        **{**shape, "chunk_size": args.chunk_size},
        temperature=TEMPERATURE,
        results=results,
        time_ratio=time_ratio,
        peak_extra_ratio=memory_ratio,
        saved_ratio=new["saved_bytes"] / ref["saved_bytes"],
        targets=dict(peak_extra_ratio=MEMORY_TARGET, time_ratio=TIME_TARGET),
        agreement=agreement(last["torch"], last["logits"]),
    )

    print(f"{report['device']}, torch {torch.__version__}: T={shape['tokens']} V={shape['vocab']} "
          f"H={shape['hidden']} {shape['dtype']}, chunk_size={args.chunk_size}, temperature={TEMPERATURE}")
    print(f"{'backend':<8} {'time (median)':>14} {'peak extra':>14} {'saved':>14}")
    for backend in BACKENDS:
        r = results[backend]
        print(f"{backend:<8} {r['time_ms']:>11.1f} ms {mib(r['peak_extra_bytes']):>14} {mib(r['saved_bytes']):>14}")
    print(f"time ratio torch/logits: {time_ratio:.2f} (target <= {TIME_TARGET}: {verdict(time_ratio <= TIME_TARGET)})")
    if memory_ratio is None:
        print("peak extra ratio: n/a (peak memory is measured on CUDA only)")
    else:
        print(f"peak extra ratio torch/logits: {memory_ratio:.3f} "
              f"(target <= {MEMORY_TARGET:.3f}: {verdict(memory_ratio <= MEMORY_TARGET)})")
    print(f"saved-for-backward ratio torch/logits: {report['saved_ratio']:.4f}")
    print("agreement: " + ", ".join(f"{k}={v:.2e}" for k, v in report["agreement"].items()))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
