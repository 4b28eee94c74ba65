"""PPO heads side by side: tfcompat's backends against Liger-Kernel's and verl's fused heads, in one run.

One step is forward + backward of ``(a * logprobs).sum() + (b * entropy).sum()`` with random per-token ``a, b``
(the entropy term only where the variant computes an entropy), gradients for the hidden states and the lm-head
weight; bf16, V = 152064, H = 3584, temperature 0.7, 10% of the labels ignored; odd and round token counts.

Variants (each peer optional: skipped with a note when its package is absent):

- ``logits``: tfcompat's reference (full float32 logits, autograd), the baseline of every ratio;
- ``torch``, ``triton``: tfcompat's chunked backends at their default tiles (``torch``: 2048 * V float32 logits,
  ``triton``: T * H logits in bf16); ``torch-c512``, ``torch-c2048``: backend ``torch`` with chunk_size 512 and
  2048; ``triton-c256``, ``triton-c512``, ``triton-c1024``: backend ``triton`` with tiles of about 256 * V,
  512 * V and 1024 * V logits; ``triton-t8k``, ``triton-t32k``: backend ``triton`` with token blocks of at most
  8192 / 32768 rows (default 16384);
- ``triton-keep``, ``torch-keep``: those backends with ``keep_logits=True`` (the forward's (T, V) bf16 logits
  kept for backward: three lm-head matmuls instead of four, ``2 * T * V`` bytes more);
- ``triton-loss``, ``torch-loss``: `tfcompat.heads.fused_loss` with the step's loss as its per-token loss
  (``a * logprob + b * entropy``): the gradients computed in the forward, three lm-head matmuls, no logits kept;
- ``liger``: Liger-Kernel's ``LigerFusedLinearCrossEntropyFunction`` with ``reduction="none"`` on
  ``hidden / temperature``: per-token loss = -logprob, no entropy (it computes less); a per-token upstream
  gradient is known only in backward, so Liger recomputes the logits there, as tfcompat does;
- ``liger-mean``: the same with ``reduction="mean"``, what a Liger user's SFT loss runs (and ``bench/train_step.py``'s
  ``liger_flex``): the upstream gradient of a mean is known in the forward, so Liger computes the gradients there
  (three lm-head matmuls, no recompute); its loss is the mean cross-entropy, not the PPO sum (no per-token
  values: no errors reported);
- ``verl-triton``: verl's ``verl.utils.kernel.linear_cross_entropy`` (Triton, logprobs and entropy);
- ``verl-torch``: verl's ``verl.utils.experimental.torch_functional.FusedLinearForPPO`` (torch, chunk 512); it
  has no ignore index, so it gets the labels clamped to >= 0 (same work; its errors are read at the kept tokens).

verl's package pulls in a heavy dependency tree; when ``import verl`` fails, ``--verl-src DIR`` (a folder holding
the unpacked wheel's ``verl/``) loads just the three files these need, with a stand-in ``verl.utils.device``.

Measured per variant and token count:

- time: median of ``--reps`` steps after ``--warmup``, all variants of one T timed round-robin (CUDA events);
- peak extra: ``max_memory_allocated()`` during one step minus ``memory_allocated()`` just before it, every
  gradient set to None first (so each variant starts from the same baseline); "beyond grads" subtracts the
  bytes of the gradients the step leaves behind (``hidden.grad``, ``weight.grad``);
- error: max |logprob - reference| and max |entropy - reference| over the non-ignored tokens, the reference being
  backend ``logits``'s forward computed under no_grad in row chunks (so it exists at every T).

    python bench/heads.py --out results.json                 # the full table on CUDA
    python bench/heads.py --smoke                            # tiny shapes on CPU: checks the script end to end
    python bench/heads.py --tokens 8191 8192 --variants logits triton liger
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import importlib.util
import re
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

import _common
from tfcompat import heads
from tfcompat.heads import IGNORE_INDEX, logprobs_entropy

TOKENS = (1024, 4095, 8191, 8192, 16383, 20205, 32768, 65535)
VARIANTS = ("logits", "torch", "torch-c512", "torch-c2048", "torch-keep", "torch-loss", "triton", "triton-c256",
            "triton-c512", "triton-c1024", "triton-t8k", "triton-t32k", "triton-keep", "triton-loss", "liger",
            "liger-mean", "verl-triton", "verl-torch")
VOCAB, HIDDEN, TEMPERATURE = 152064, 3584, 0.7
SMOKE = dict(tokens=(100, 127, 128), vocab=1000, hidden=64)
# the reference holds about 5 float32 (T, V) tensors at its peak (measured: 22.1 GiB at T=8192)
REFERENCE_BYTES_PER_LOGIT = 20
TARGETS = dict(triton_vs_liger=0.9, torch_vs_logits=1.05, logprob_error=1e-3)


class Inputs(NamedTuple):
    """hidden ``(T, H)`` and weight ``(V, H)`` requiring grad, labels ``(T,)`` (10% ignored), upstream
    gradients ``a, b`` ``(T,)`` float32."""

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    grad_logprobs: torch.Tensor
    grad_entropy: torch.Tensor


class Out(NamedTuple):
    logprobs: torch.Tensor | None  # (T,) float32; None where the variant returns only a loss
    entropy: torch.Tensor | None  # (T,), None where the variant computes none
    loss: torch.Tensor | None = None  # a scalar loss to differentiate instead of the per-token sums


Head = Callable[[Inputs], Out]


def make_inputs(tokens: int, weight: torch.Tensor, seed: int) -> Inputs:
    device, dtype = weight.device, weight.dtype
    gen = torch.Generator(device).manual_seed(seed)
    hidden = torch.randn(tokens, weight.shape[1], generator=gen, device=device).to(dtype).requires_grad_()
    labels = torch.randint(0, weight.shape[0], (tokens,), generator=gen, device=device)
    labels[torch.rand(tokens, generator=gen, device=device) < 0.1] = IGNORE_INDEX
    grads = torch.randn(2, tokens, generator=gen, device=device)
    return Inputs(hidden, weight, labels, grads[0], grads[1])


# ------------------------------------------------------------------------------------------------ variants


def tfcompat_head(backend: str, chunk_size: int | None = None, keep_logits: bool = False,
                  token_block: int | None = None) -> Head:
    """token_block: backend triton's most rows per tile (`_triton.TOKEN_BLOCK`) during the call, when given."""
    def head(x: Inputs) -> Out:
        with override_token_block(token_block):
            out = logprobs_entropy(x.hidden, x.weight, x.labels, TEMPERATURE, backend=backend, chunk_size=chunk_size,
                                   keep_logits=keep_logits)
        return Out(out.logprobs, out.entropy)

    return head


def fused_loss_head(backend: str) -> Head:
    """`fused_loss` of ``a * logprob + b * entropy`` per token: the step's loss, differentiated in the forward."""
    def head(x: Inputs) -> Out:
        out = heads.fused_loss(x.hidden, x.weight, x.labels, lambda lp, ent, a, b: a * lp + b * ent, x.grad_logprobs,
                               x.grad_entropy, temperature=TEMPERATURE, backend=backend)
        return Out(out.logprobs, out.entropy, out.loss)

    return head


@contextlib.contextmanager
def override_token_block(rows: int | None) -> Iterator[None]:
    if rows is None:
        yield
        return
    from tfcompat.heads import _triton

    saved, _triton.TOKEN_BLOCK = _triton.TOKEN_BLOCK, rows
    try:
        yield
    finally:
        _triton.TOKEN_BLOCK = saved


def liger_head(reduction: str = "none") -> Head:
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    def head(x: Inputs) -> Out:
        # (input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction)
        loss = LigerFusedLinearCrossEntropyFunction.apply(
            x.hidden / TEMPERATURE, x.weight, x.labels, None, None, IGNORE_INDEX, 0.0, 0.0, reduction
        )[0]
        return Out(-loss, None) if reduction == "none" else Out(None, None, loss)

    return head


def load_verl(source: Path | None) -> tuple[types.ModuleType, types.ModuleType]:
    """``verl.utils.kernel.linear_cross_entropy`` and ``verl.utils.experimental.torch_functional``: imported
    normally when verl imports, else loaded from ``source/verl`` with a stand-in ``verl.utils.device``."""
    names = ("verl.utils.kernel.linear_cross_entropy", "verl.utils.experimental.torch_functional")
    if "verl" in sys.modules or importlib.util.find_spec("verl") is not None:
        try:
            return tuple(importlib.import_module(name) for name in names)  # type: ignore[return-value]
        except ImportError as exc:
            if source is None:
                raise
            print(f"note: import verl failed ({exc}); loading its kernel files from {source}")
    if source is None:
        raise ImportError("verl is not installed (pass --verl-src DIR with the unpacked wheel)")
    for name in ("verl", "verl.utils", "verl.utils.kernel", "verl.utils.experimental"):
        package = types.ModuleType(name)
        package.__path__ = [str(source.joinpath(*name.split(".")))]  # submodules load, __init__ files do not
        sys.modules[name] = package
    device = types.ModuleType("verl.utils.device")
    device.is_cuda_available = torch.cuda.is_available()
    device.get_device_name = lambda: "cuda"
    device.get_torch_device = lambda: torch.cuda
    device.get_device_capability = lambda device_id=0: torch.cuda.get_device_capability(device_id)
    sys.modules["verl.utils.device"] = device
    return tuple(importlib.import_module(name) for name in names)  # type: ignore[return-value]


@functools.cache
def verl_heads(source: Path | None) -> dict[str, Head]:
    linear_cross_entropy, torch_functional = load_verl(source)
    ppo = torch_functional.FusedLinearForPPO(chunk_size=512)

    def triton_head(x: Inputs) -> Out:
        logprobs, entropy = linear_cross_entropy.linear_cross_entropy(x.hidden, x.weight, x.labels, TEMPERATURE,
                                                                      "none")
        return Out(logprobs, entropy)

    def torch_head(x: Inputs) -> Out:
        # it gathers the label column without an ignore index: -100 would index out of bounds
        logprobs, entropy = ppo(x.hidden, x.weight, x.labels.clamp(min=0), TEMPERATURE)
        return Out(logprobs, entropy)

    return {"verl-triton": triton_head, "verl-torch": torch_head}


def available_variants(wanted: tuple[str, ...], device: torch.device, verl_src: Path | None) -> tuple[dict, dict]:
    """The variants that can run here, and a note for each that cannot."""
    found: dict[str, Head] = {}
    notes: dict[str, str] = {}
    triton_ok = heads._has_triton() and (device.type == "cuda" or heads._triton_interpreted())
    for name in wanted:
        if name in ("logits", "torch"):
            found[name] = tfcompat_head(name)
        elif name == "torch-keep":
            found[name] = tfcompat_head("torch", keep_logits=True)
        elif name == "torch-loss":
            found[name] = fused_loss_head("torch")
        elif name == "triton-loss" and triton_ok:
            found[name] = fused_loss_head("triton")
        elif name.startswith("torch-c"):
            found[name] = tfcompat_head("torch", int(name[len("torch-c"):]))
        elif name.startswith("triton"):
            if triton_ok:
                found[name] = tfcompat_head(
                    "triton", int(name[len("triton-c"):]) if "-c" in name else None, keep_logits=name.endswith("-keep"),
                    token_block=int(name[len("triton-t"):-1]) * 1024 if name.startswith("triton-t") else None)
            else:
                notes[name] = "skipped: needs triton, and CUDA or TRITON_INTERPRET=1"
        elif device.type != "cuda":
            notes[name] = "skipped: the peers' kernels run on CUDA only"
        elif name in ("liger", "liger-mean"):
            try:
                found[name] = liger_head("mean" if name == "liger-mean" else "none")
            except ImportError as exc:
                notes[name] = f"skipped: liger-kernel not importable ({exc})"
        elif name.startswith("verl"):
            try:
                found[name] = verl_heads(verl_src)[name]
            except ImportError as exc:
                notes[name] = f"skipped: verl not importable ({exc})"
    return found, notes


# ------------------------------------------------------------------------------------------------ measuring


def clear_grads(x: Inputs) -> None:
    x.hidden.grad = x.weight.grad = None


def step(head: Head, x: Inputs) -> Out:
    clear_grads(x)
    out = head(x)
    if out.loss is not None:
        loss = out.loss
    else:
        assert out.logprobs is not None
        loss = (x.grad_logprobs * out.logprobs).sum()
        if out.entropy is not None:
            loss = loss + (x.grad_entropy * out.entropy.float()).sum()
    loss.backward()
    return Out(None if out.logprobs is None else out.logprobs.detach(),
               None if out.entropy is None else out.entropy.detach().float())


@torch.no_grad()
def reference(x: Inputs, rows: int = 4096) -> Out:
    """Backend ``logits``'s forward values, computed in row chunks (every row is independent)."""
    logprobs, entropy = [], []
    column = torch.full((x.hidden.shape[0], 1), TEMPERATURE, device=x.hidden.device)
    for start in range(0, x.hidden.shape[0], rows):
        part = slice(start, start + rows)
        lp, ent = heads._reference(x.hidden[part], x.weight, None, x.labels[part], column[part])
        logprobs.append(lp)
        entropy.append(ent)
    return Out(torch.cat(logprobs), torch.cat(entropy))


def errors(out: Out, ref: Out, labels: torch.Tensor) -> dict[str, float | None]:
    keep = labels != IGNORE_INDEX
    assert ref.logprobs is not None
    return dict(
        logprob_max_abs=None if out.logprobs is None else (out.logprobs - ref.logprobs)[keep].abs().max().item(),
        entropy_max_abs=None if out.entropy is None else (out.entropy - ref.entropy)[keep].abs().max().item(),
    )


def peak_extra(head: Head, x: Inputs, device: torch.device) -> tuple[int | None, int | None]:
    """Peak bytes above the baseline during one step, and that minus the gradients' bytes (CUDA only)."""
    if device.type != "cuda":
        return None, None
    clear_grads(x)
    gc.collect()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step(head, x)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (x.hidden, x.weight) if t.grad is not None)
    clear_grads(x)
    return peak, peak - grads


def fits_reference(tokens: int, vocab: int, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return tokens * vocab * REFERENCE_BYTES_PER_LOGIT < 0.85 * free


def measure_tokens(tokens: int, weight: torch.Tensor, variants: dict[str, Head], args: Any,
                   device: torch.device) -> dict[str, dict[str, Any]]:
    x = make_inputs(tokens, weight, seed=tokens)
    ref = reference(x)
    runnable: dict[str, Head] = {}
    results: dict[str, dict[str, Any]] = {}
    for name, head in variants.items():
        if name == "logits" and not fits_reference(tokens, weight.shape[0], device):
            results[name] = dict(note=f"skipped: about {tokens * weight.shape[0] * 20 / 2**30:.0f} GiB, "
                                      "more than the free memory")
            continue
        try:
            out = step(head, x)  # also the warm-up: compiles Triton kernels
            peak, beyond = peak_extra(head, x, device)
        except torch.OutOfMemoryError:
            clear_grads(x)
            gc.collect()
            torch.cuda.empty_cache()
            results[name] = dict(note="out of memory")
            continue
        results[name] = dict(**errors(out, ref, x.labels), peak_extra_bytes=peak, beyond_grads_bytes=beyond,
                             computes_entropy=out.entropy is not None)
        runnable[name] = head
    fns = {name: (lambda head=head: step(head, x)) for name, head in runnable.items()}
    times = _common.time_interleaved(fns, device, args.warmup, args.reps)
    for name, ts in times.items():
        results[name].update(time_ms=_common.median(ts), times_ms=ts)
    clear_grads(x)
    return results


MATMUL_KERNELS = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_", re.I)


def profile(tokens: int, weight: torch.Tensor, variants: dict[str, Head], names: list[str],
            device: torch.device) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, float]]]:
    """The GPU kernels of one step of each named variant, longest first (align-1 kernels show up by name), and
    per variant the kernel ms of matmuls (cuBLAS) and of everything else (the Triton kernels, elementwise)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    x = make_inputs(tokens, weight, seed=tokens)
    found: dict[str, list[dict[str, Any]]] = {}
    split: dict[str, dict[str, float]] = {}
    for name in names:
        if name not in variants:
            continue
        step(variants[name], x)
        torch.cuda.synchronize(device)
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(variants[name], x)
            torch.cuda.synchronize(device)
        rows = [dict(kernel=e.key, ms=e.device_time_total / 1e3, calls=e.count)
                for e in prof.key_averages() if e.device_time_total > 0]
        rows.sort(key=lambda r: -r["ms"])
        found[name] = rows[:12]
        matmul = sum(r["ms"] for r in rows if MATMUL_KERNELS.search(r["kernel"]))
        split[name] = dict(total=sum(r["ms"] for r in rows), matmul=matmul,
                           other=sum(r["ms"] for r in rows) - matmul)
    clear_grads(x)
    return found, split


# ------------------------------------------------------------------------------------------------ report


def gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def print_tables(report: dict[str, Any]) -> None:
    for tokens, results in report["results"].items():
        ref_time = results.get("logits", {}).get("time_ms")
        liger_time = results.get("liger", {}).get("time_ms")
        mean_time = results.get("liger-mean", {}).get("time_ms")
        rows = []
        for name, r in results.items():
            if "time_ms" not in r:
                rows.append([name, r.get("note", "n/a"), "", "", "", "", "", "", ""])
                continue
            rows.append([
                name, f"{r['time_ms']:.1f}",
                f"{r['time_ms'] / ref_time:.2f}" if ref_time else "n/a",
                f"{r['time_ms'] / liger_time:.2f}" if liger_time else "n/a",
                f"{r['time_ms'] / mean_time:.2f}" if mean_time else "n/a",
                gib(r["peak_extra_bytes"]), gib(r["beyond_grads_bytes"]),
                "none" if r["logprob_max_abs"] is None else f"{r['logprob_max_abs']:.1e}",
                "none" if r["entropy_max_abs"] is None else f"{r['entropy_max_abs']:.1e}",
            ])
        print(f"\nT = {tokens}")
        print(_common.table(["variant", "ms", "/ logits", "/ liger", "/ liger-mean", "peak extra GiB",
                             "beyond grads GiB", "logprob err", "entropy err"], rows))
    for name, rows in report.get("profile", {}).items():
        split = report["profile_split"][name]
        print(f"\nprofile, {name}, T = {report['profile_tokens']}: kernels {split['total']:.1f} ms = matmuls "
              f"{split['matmul']:.1f} + other {split['other']:.1f}; " + "; ".join(
                  f"{r['kernel'][:70]} {r['ms']:.1f} ms x{r['calls']}" for r in rows[:8]))


def main() -> None:
    parser = _common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", help=f"token counts (default {TOKENS})")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--verl-src", type=Path, help="folder holding an unpacked verl wheel (its verl/ folder)")
    parser.add_argument("--profile-tokens", type=int, default=20205,
                        help="profile the tfcompat variants at this T (0: no profile; CUDA only)")
    parser.add_argument("--profile-variants", nargs="+", default=["torch", "triton"],
                        help="the variants profiled at --profile-tokens (default torch triton)")
    args = parser.parse_args()
    device = _common.device_for(args.smoke)
    if args.smoke:
        tokens, vocab, hidden, dtype = SMOKE["tokens"], SMOKE["vocab"], SMOKE["hidden"], torch.float32
        args.warmup, args.reps = args.warmup or 0, args.reps or 2
    else:
        tokens, vocab, hidden, dtype = tuple(args.tokens or TOKENS), VOCAB, HIDDEN, torch.bfloat16
        args.warmup, args.reps = args.warmup or 1, args.reps or 3
    info = _common.machine(device)
    print(_common.machine_line(info))
    variants, notes = available_variants(tuple(args.variants), device, args.verl_src)
    for name, note in notes.items():
        print(f"{name}: {note}")
    gen = torch.Generator(device).manual_seed(0)
    weight = (torch.randn(vocab, hidden, generator=gen, device=device) / hidden**0.5).to(dtype).requires_grad_()
    report: dict[str, Any] = dict(
        machine=info, vocab=vocab, hidden=hidden, dtype=str(dtype), temperature=TEMPERATURE,
        warmup=args.warmup, reps=args.reps, notes=notes, targets=TARGETS, results={},
    )
    for t in tokens:
        report["results"][t] = measure_tokens(t, weight, variants, args, device)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _common.write_json(args.out, report)  # what is measured so far survives a run cut short
    if device.type == "cuda" and args.profile_tokens:
        report["profile_tokens"] = args.profile_tokens
        report["profile"], report["profile_split"] = profile(args.profile_tokens, weight, variants,
                                                             args.profile_variants, device)
    print_tables(report)
    _common.write_json(args.out, report)


if __name__ == "__main__":
    main()
