"""Overhead of tfcompat's attention layers over a direct call of the same varlen kernel (forward+backward).

Variants, on the same packed q/k/v (GQA: 32 query heads, 8 KV heads, head_dim 128, bf16):
  (a) direct:  torch.nn.attention.varlen.varlen_attn(q, k, v, cu, cu, max, max, scale=..., <causal kwarg>)
  (b) core:    tfcompat.core.attention.varlen_attention(q, k, v, seqs, backend="torch")
  (c) adapter: tfcompat.hf.attention.packed_attention(module, q4, k4, v4, None, scaling=...,
               tfcompat_context=ForwardContext(seqs, "torch")) on (1, H, T, D) views, as transformers passes them
Ratios b/a and c/a are measured in the same run (variants interleaved); the target is <= 1.03.
With flash-attn installed, the same three against flash_attn_varlen_func (backend "flash").

    python bench/attention_overhead.py --out attention_overhead.json
    python bench/attention_overhead.py --smoke    # CPU, fp32, backend "sdpa" vs a per-sequence SDPA loop
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _common as C  # noqa: E402
from tfcompat.core.attention import varlen_attention  # noqa: E402
from tfcompat.core.context import ForwardContext  # noqa: E402
from tfcompat.core.packing import from_lengths  # noqa: E402
from tfcompat.hf.attention import packed_attention  # noqa: E402

TARGET = 1.03


def direct_torch_varlen(scale: float, gqa: bool) -> tuple[Callable, dict, str]:
    """``varlen_attn`` and the kwargs this torch's signature takes for causal GQA attention."""
    fn = importlib.import_module("torch.nn.attention.varlen").varlen_attn
    params = inspect.signature(fn).parameters
    kw: dict = {}
    if "is_causal" in params:
        kw["is_causal"] = True
    elif "window_size" in params:
        kw["window_size"] = (-1, 0)
    else:
        raise SystemExit(f"varlen_attn{inspect.signature(fn)} has neither is_causal nor window_size")
    if "scale" in params:
        kw["scale"] = scale
    if "enable_gqa" in params:
        kw["enable_gqa"] = gqa
    return fn, kw, f"varlen_attn{inspect.signature(fn)}"


def direct_flash() -> Callable | None:
    try:
        return importlib.import_module("flash_attn").flash_attn_varlen_func
    except Exception:  # not installed, or a build without CUDA kernels
        return None


def sdpa_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float) -> torch.Tensor:
    """The plain per-sequence SDPA a user would write (the smoke-mode 'direct' variant)."""
    outs = []
    for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                           vs.transpose(0, 1)[None], is_causal=True, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def run_case(total: int, n_seq: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device,
             kernel: str, warmup: int, reps: int) -> dict:
    lengths = C.random_lengths(total, n_seq, seed=total + n_seq, min_len=max(1, min(64, total // (4 * n_seq))))
    seqs = from_lengths(lengths, device=device)
    scale = d ** -0.5
    gen = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(total, h, d, generator=gen).to(device, dtype) for h in (hq, hkv, hkv))
    grad = torch.randn(total, hq, d, generator=gen).to(device, dtype)
    q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
    # what transformers hands the attention function: (1, H, T, D) transposes of contiguous (1, T, H, D)
    q4l, k4l, v4l = (x.clone()[None].requires_grad_() for x in (q0, k0, v0))
    q4, k4, v4 = (x.transpose(1, 2) for x in (q4l, k4l, v4l))
    module = torch.nn.Module()
    backend = {"torch": "torch", "flash": "flash", "sdpa": "sdpa"}[kernel]
    ctx = ForwardContext(seqs, backend)

    if kernel == "torch":
        fn, kw, described = direct_torch_varlen(scale, hq != hkv)
        direct = lambda: fn(q, k, v, seqs.cu_seqlens, seqs.cu_seqlens, seqs.max_seqlen, seqs.max_seqlen, **kw)  # noqa: E731
    elif kernel == "flash":
        fa = direct_flash()
        described = "flash_attn_varlen_func(..., softmax_scale=scale, causal=True)"
        direct = lambda: fa(q, k, v, seqs.cu_seqlens, seqs.cu_seqlens, seqs.max_seqlen, seqs.max_seqlen,  # noqa: E731
                            softmax_scale=scale, causal=True)
    else:
        described = "per-sequence F.scaled_dot_product_attention(is_causal=True) loop"
        direct = lambda: sdpa_loop(q, k, v, lengths, scale)  # noqa: E731
    core = lambda: varlen_attention(q, k, v, seqs, scale=scale, backend=backend)  # noqa: E731
    adapter = lambda: packed_attention(module, q4, k4, v4, None, scaling=scale, tfcompat_context=ctx)[0]  # noqa: E731

    def step(f: Callable, leaves: tuple) -> Callable:
        def run() -> None:
            out = f()
            torch.autograd.grad(out, leaves, grad.view_as(out))
        return run

    with torch.no_grad():  # same kernel: the outputs must agree exactly (up to kernel nondeterminism: none in fwd)
        oa, ob, oc = direct(), core(), adapter()
        diffs = {"b_vs_a": float((ob - oa).abs().max()), "c_vs_a": float((oc.reshape_as(oa) - oa).abs().max())}
    fwd = C.time_interleaved({"a": lambda: _nograd(direct), "b": lambda: _nograd(core),
                              "c": lambda: _nograd(adapter)}, device, warmup, reps)
    both = C.time_interleaved({"a": step(direct, (q, k, v)), "b": step(core, (q, k, v)),
                               "c": step(adapter, (q4l, k4l, v4l))}, device, warmup, reps)
    res = {"kernel": kernel, "direct_call": described, "tokens": total, "lengths": lengths, "hq": hq, "hkv": hkv,
           "head_dim": d, "dtype": str(dtype), "max_abs_output_diff": diffs}
    for name, times in (("forward", fwd), ("forward_backward", both)):
        ms = {k: C.median(v) for k, v in times.items()}
        res[name] = {"ms": ms, "ratio_b_over_a": ms["b"] / ms["a"], "ratio_c_over_a": ms["c"] / ms["a"],
                     "all_ms": times}
    return res


def _nograd(f: Callable) -> None:
    with torch.no_grad():
        f()


def main() -> None:
    p = C.base_parser(__doc__.splitlines()[0])
    args = p.parse_args()
    smoke = args.smoke
    device = C.device_for(smoke)
    warmup = args.warmup if args.warmup is not None else (2 if smoke else 10)
    reps = args.reps if args.reps is not None else (5 if smoke else 50)
    info = C.machine(device)
    print(C.machine_line(info))
    if smoke:
        dtype, hq, hkv, d = torch.float32, 8, 2, 16
        cases = [(96, 3), (256, 4)]
        kernels = ["sdpa"]
    else:
        dtype, hq, hkv, d = torch.bfloat16, 32, 8, 128
        cases = [(8192, 4), (32768, 8)]
        kernels = []
        try:
            importlib.import_module("torch.nn.attention.varlen").varlen_attn  # noqa: B018
            kernels.append("torch")
        except (ImportError, AttributeError):
            print("note: torch.nn.attention.varlen.varlen_attn is missing on this torch; torch kernel skipped")
        if direct_flash() is not None:
            kernels.append("flash")
        else:
            print("note: flash_attn is not importable; flash_attn_varlen_func comparison skipped")
    print(f"{dtype}, {hq} query heads / {hkv} KV heads, head_dim {d}; median of {reps} reps after {warmup} warm-up, "
          "variants interleaved")

    results, rows = [], []
    for kernel in kernels:
        for total, n_seq in cases:
            r = run_case(total, n_seq, hq, hkv, d, dtype, device, kernel, warmup, reps)
            results.append(r)
            for name in ("forward", "forward_backward"):
                m = r[name]
                ok = max(m["ratio_b_over_a"], m["ratio_c_over_a"]) <= TARGET
                rows.append([kernel, total, n_seq, name.replace("_", "+"), m["ms"]["a"], m["ms"]["b"], m["ms"]["c"],
                             f"{m['ratio_b_over_a']:.3f}", f"{m['ratio_c_over_a']:.3f}",
                             ("yes" if ok else "NO") if name == "forward_backward" else "-"])
    for r in results:
        print(f"  {r['kernel']} T={r['tokens']}: direct = {r['direct_call']}")
        print(f"    lengths {r['lengths']}; max |out diff| b-a {r['max_abs_output_diff']['b_vs_a']:.3g}, "
              f"c-a {r['max_abs_output_diff']['c_vs_a']:.3g}")
    print()
    print("(a) direct kernel, (b) tfcompat varlen_attention, (c) tfcompat packed_attention (transformers adapter)")
    print(C.table(["kernel", "tokens", "seqs", "pass", "a ms", "b ms", "c ms", "b/a", "c/a", f"<= {TARGET}"], rows))
    C.write_json(args.out, {"benchmark": "attention_overhead", "smoke": smoke, "machine": info, "target": TARGET,
                            "warmup": warmup, "reps": reps, "results": results})


if __name__ == "__main__":
    main()
