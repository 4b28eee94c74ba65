"""Every varlen attention backend of tfcompat on the same packed inputs: forward and forward+backward time.

Per shape (sequence lengths, query / KV heads, head_dim; bf16 on CUDA) and for each backend that can run it
(`tfcompat.core.attention.available_backends`: "flash" when flash-attn 2/3/4 is installed, "torch" = torch's
varlen_attn, "cudnn" = cuDNN varlen attention, "flex" = compiled flex attention with the document block mask,
"sdpa" = per-sequence SDPA, the reference loop):

  1. exactness: output and dq/dk/dv for a fixed random output gradient against the fp32 "sdpa" reference on
     the same rounded inputs; a backend is exact when its max error is within twice the bf16 "sdpa" backend's
     plus tol / 4 (tol 1e-2 forward, 2e-2 backward, scaled by max(1, max|ref|)), the rule of tests/gpu;
  2. time: forward (no grad) and forward+backward (`torch.autograd.grad`), backends interleaved, median of
     --reps after --warmup (CUDA events), and TFLOP/s of the causal attention FLOPs
     (forward 4 * sum(L_i^2) / 2 * Hq * D; backward 2.5x forward).
The flex backend's block mask is built once per forward in a model (shared by every layer); its build time is
reported separately ("mask ms") and is not in the per-call time. The table names the fastest exact backend
per row and what "auto" picks for that pass (`select_backend` without and with a gradient), with auto's time
over the fastest's.

    python bench/attention_backends.py --out attention_backends.json
    python bench/attention_backends.py --smoke     # CPU, fp32, tiny shapes: sdpa, and flex forward only
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _common as C  # noqa: E402
from tfcompat.core import attention as A  # noqa: E402
from tfcompat.core.packing import PackedSeqs, from_lengths  # noqa: E402

TOL, GRAD_TOL = 1e-2, 2e-2


def shapes(smoke: bool) -> list[tuple[str, list[int], int, int, int]]:
    """(name, lengths, query heads, KV heads, head_dim)."""
    if smoke:
        return [("3 odd", [37, 1, 90], 4, 2, 32), ("2x64", [64, 64], 4, 4, 16)]
    odd = C.random_lengths(20205, 8, seed=11, min_len=64)
    return [
        ("8x1k", [1024] * 8, 28, 4, 128),
        ("8 odd (8191)", C.random_lengths(8191, 8, seed=12, min_len=32), 28, 4, 128),
        ("8x4k", [4096] * 8, 28, 4, 128),
        ("8 odd (20205)", odd, 28, 4, 128),
        ("2x32k", [32768] * 2, 28, 4, 128),
        ("4 odd (70703)", [13320, 30077, 15934, 11372], 28, 4, 128),
        ("8x4k", [4096] * 8, 32, 8, 128),
        ("8 odd (20205)", odd, 32, 4, 128),
        ("16x1000", [1000] * 16, 16, 16, 64),
        ("8x4k", [4096] * 8, 16, 16, 64),
        ("4x16k", [16384] * 4, 32, 8, 64),
    ]


def causal_flops(lengths: list[int], hq: int, d: int) -> float:
    """Forward FLOPs of causal attention: QK^T and PV, 2 * L^2 * D each per head, halved by causality."""
    return 4.0 * sum(n * n for n in lengths) / 2 * hq * d


def run_shape(name: str, lengths: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype,
              device: torch.device, warmup: int, reps: int) -> dict[str, Any]:
    seqs = from_lengths(lengths, device=device)
    total = seqs.total
    gen = torch.Generator().manual_seed(total + hq + d)
    q0, k0, v0 = (torch.randn(total, h, d, generator=gen).to(device, dtype) for h in (hq, hkv, hkv))
    grad = torch.randn(total, hq, d, generator=gen).to(device, dtype)
    needs_grad_probe = q0.detach().requires_grad_()
    backends = A.available_backends(needs_grad_probe, k=k0)
    with torch.no_grad():
        fwd_only = [b for b in A.available_backends(q0, k=k0) if b not in backends]
    auto = {"forward+backward": A.select_backend(needs_grad_probe, "auto", k=k0, seqs=seqs)}
    with torch.no_grad():  # auto's pick per pass: the table ranks forwards without a gradient apart
        auto["forward"] = A.select_backend(q0, "auto", k=k0, seqs=seqs)

    ref = _reference(q0.float(), k0.float(), v0.float(), seqs, grad.float())
    low = _reference(q0, k0, v0, seqs, grad)
    errors: dict[str, Any] = {}
    exact: dict[str, bool] = {}
    for b in [*backends, *fwd_only]:
        try:
            got = _outputs(q0, k0, v0, seqs, grad, b, backward=b in backends)
        except Exception as e:  # a backend this torch/GPU cannot run for this shape: reported, not timed
            errors[b] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            exact[b] = False
            continue
        errs, ok = {}, True
        for key, g in got.items():
            r, lo = ref[key], low[key]
            tol = (TOL if key == "out" else GRAD_TOL) * max(1.0, float(r.abs().max()))
            err, err_low = float((g - r).abs().max()), float((lo - r).abs().max())
            errs[key] = err
            ok = ok and err <= tol and err <= 2 * err_low + tol / 4
        errors[b] = errs
        exact[b] = ok
    del ref, low

    timed = [b for b in [*backends, *fwd_only] if exact[b]]
    q, k, v = (x.detach().clone().requires_grad_() for x in (q0, k0, v0))

    def forward(b: str) -> Callable[[], Any]:
        def fn() -> Any:
            with torch.no_grad():
                return A.varlen_attention(q0, k0, v0, seqs, backend=b)
        return fn

    def forward_backward(b: str) -> Callable[[], Any]:
        def fn() -> Any:
            out = A.varlen_attention(q, k, v, seqs, backend=b)
            return torch.autograd.grad(out, (q, k, v), grad)
        return fn

    fwd = C.time_interleaved({b: forward(b) for b in timed}, device, warmup, reps)
    fb = C.time_interleaved({b: forward_backward(b) for b in timed if b in backends}, device, warmup, reps)
    mask_ms = None
    if "flex" in timed:
        mask_ms = C.median(C.time_ms(lambda: A._build_document_block_mask(seqs), device, warmup, reps))
    flops = causal_flops(lengths, hq, d)
    result: dict[str, Any] = {"name": name, "lengths": lengths, "tokens": total, "hq": hq, "hkv": hkv,
                              "head_dim": d, "backends": [*backends, *fwd_only], "auto": auto,
                              "exact": exact, "errors": errors, "flex_mask_ms": mask_ms, "passes": {}}
    for pass_name, times, factor in (("forward", fwd, 1.0), ("forward+backward", fb, 3.5)):
        per = {b: {"ms": C.median(t), "all_ms": t, "tflops": flops * factor / (C.median(t) * 1e-3) / 1e12}
               for b, t in times.items()}
        fastest = min(per, key=lambda b: per[b]["ms"]) if per else None
        pick = auto[pass_name]
        result["passes"][pass_name] = {
            "backends": per, "fastest": fastest, "auto": pick,
            "auto_over_fastest": per[pick]["ms"] / per[fastest]["ms"] if pick in per and fastest else None,
        }
    return result


def _reference(q0: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, seqs: PackedSeqs,
               grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """The "sdpa" backend on K/V repeated to every query head (SDPA's memory-efficient kernel runs fp32 without
    GQA; with it, fp32 falls back to the math kernel and its (H, L, L) scores); gradients flow back to the
    KV heads through the repeat."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q0, k0, v0))
    group = q.shape[1] // k.shape[1]
    # (T, Hkv, D) -> (T, Hq, D)
    out = A.varlen_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), seqs, backend="sdpa")
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return {"out": out.detach().float(), "dq": dq.float(), "dk": dk.float(), "dv": dv.float()}


def _outputs(q0: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, seqs: PackedSeqs, grad: torch.Tensor,
             backend: str, backward: bool) -> dict[str, torch.Tensor]:
    if not backward:
        with torch.no_grad():
            return {"out": A.varlen_attention(q0, k0, v0, seqs, backend=backend).float()}
    q, k, v = (x.detach().clone().requires_grad_() for x in (q0, k0, v0))
    out = A.varlen_attention(q, k, v, seqs, backend=backend)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return {"out": out.detach().float(), "dq": dq.float(), "dk": dk.float(), "dv": dv.float()}


def main() -> None:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="comma-separated shape indices to run (default all)")
    args = p.parse_args()
    smoke = args.smoke
    device = C.device_for(smoke)
    dtype = torch.float32 if smoke else torch.bfloat16
    warmup = args.warmup if args.warmup is not None else (1 if smoke else 2)
    reps = args.reps if args.reps is not None else (2 if smoke else 5)
    # the sweep changes shapes, dtypes and grad mode more often than a training run does
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    info = C.machine(device)
    info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    flash = A._flash_varlen(device) if device.type == "cuda" else None
    info["flash_function"] = None if flash is None else f"{flash.__module__}.{flash.__name__}"
    print(C.machine_line(info), f"| cudnn {info['cudnn']} | flash {info['flash_function']}")
    todo = shapes(smoke)
    if args.only:
        todo = [todo[int(i)] for i in args.only.split(",")]
    results = []
    for spec in todo:
        r = run_shape(*spec, dtype=dtype, device=device, warmup=warmup, reps=reps)
        results.append(r)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        payload = {"benchmark": "attention_backends", "smoke": smoke, "machine": info, "dtype": str(dtype),
                   "warmup": warmup, "reps": reps, "results": results}
        C.write_json(args.out, payload)  # after every shape: a run cut short keeps what it measured
        bad = {b: e for b, e in r["errors"].items() if isinstance(e, str) or not r["exact"][b]}
        print(f"{spec[0]} {spec[2]}/{spec[3]} hd{spec[4]}: auto -> {r['auto']}; not exact or failed: {bad or 'none'}",
              flush=True)

    names = ["flash", "torch", "cudnn", "flex", "sdpa"]
    names = [n for n in names if any(n in r["exact"] for r in results)]
    rows = []
    for r in results:
        for pass_name, pr in r["passes"].items():
            cells = []
            for n in names:
                if n in pr["backends"]:
                    cells.append(f"{pr['backends'][n]['ms']:.3f} ({pr['backends'][n]['tflops']:.0f})")
                else:
                    cells.append("failed" if isinstance(r["errors"].get(n), str) else
                                 "inexact" if n in r["exact"] and not r["exact"][n] else "-")
            ratio = pr["auto_over_fastest"]
            rows.append([f"{r['name']} {r['hq']}/{r['hkv']} hd{r['head_dim']}", pass_name, *cells, pr["fastest"],
                         pr["auto"], "-" if ratio is None else f"{ratio:.3f}",
                         "-" if r["flex_mask_ms"] is None else f"{r['flex_mask_ms']:.3f}"])
    print(f"\n{dtype}, ms (TFLOP/s), median of {reps} after {warmup} warm-up, backends interleaved:")
    print(C.table(["shape", "pass", *names, "fastest", "auto", "auto/fastest", "mask ms"], rows))


if __name__ == "__main__":
    main()
