"""The gated MLP of a decoder layer alone, forward and forward + backward: what the activation costs beside its
matmuls, and whether a GEMM with the activation in its epilogue (quack's ``gemm_gated`` / ``gemm_dgated``) pays.

Variants (bf16, ``x (T, H)``, gate / up ``(I, H)`` each, down ``(H, I)``, SwiGLU):

- ``cublas+liger``: what `tfcompat.patch(fused=True)` runs today: two cuBLAS matmuls, Liger's SwiGLU kernel,
  the down matmul; its backward: the down matmul's two, Liger's SwiGLU backward, the input projections' four.
- ``cublas+torch``: the same with ``F.silu(gate) * up`` (stock transformers).
- ``quack``: quack's gated MLP (``mlp_func(..., concat_layout=True)``): one GEMM over ``[gate; up]`` with SwiGLU in
  its epilogue, the down GEMM; the backward's ``gemm_dgated`` computes the activation's gradient and its output in
  the epilogue of ``dout @ down``. The two weights are concatenated per call (the model keeps them apart), and
  ``quack-cat``'s time leaves that copy out (weights stored concatenated).

Each variant's output and gradients are checked against fp32 (``err``: max abs error over the largest entry).
Sizes: ``--tokens`` (default 19,679 and 20,480: the step's odd count beside a round one), Qwen2.5-7B's H / I.

Usage: ``python bench/mlp_kernels.py [--tokens 19679,20480] [--out r.json]``; ``--smoke``: CPU, tiny, no quack.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _common as C  # noqa: E402

Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def reference(x: torch.Tensor, w: Weights) -> torch.Tensor:
    gate, up, down = w
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def liger_mlp(x: torch.Tensor, w: Weights) -> torch.Tensor:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    gate, up, down = w
    return F.linear(LigerSiLUMulFunction.apply(F.linear(x, gate), F.linear(x, up)), down)


def quack_mlp(x: torch.Tensor, w: Weights, cat: torch.Tensor | None = None) -> torch.Tensor:
    from quack.mlp import mlp_func

    gate, up, down = w
    w1 = torch.cat([gate, up]) if cat is None else cat
    return mlp_func(x, w1, down, activation="swiglu", tuned=False, concat_layout=True)


def variants(device: torch.device) -> dict[str, Callable[..., torch.Tensor]]:
    out: dict[str, Callable[..., torch.Tensor]] = {"cublas+torch": reference}
    if device.type != "cuda":
        return out
    try:
        import liger_kernel.ops.swiglu  # noqa: F401

        out["cublas+liger"] = liger_mlp
    except ImportError as e:
        print(f"no Liger-Kernel ({e}): cublas+liger skipped")
    try:
        import quack.mlp  # noqa: F401

        out["quack"] = quack_mlp
        out["quack-cat"] = quack_mlp  # the concatenated weight made once, outside the timing
    except Exception as e:  # quack needs the CUTLASS DSL runtime
        print(f"no quack ({type(e).__name__}: {e}): quack skipped")
    return out


def main() -> None:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--tokens", default=None, help="comma list of token counts (default 19679,20480)")
    p.add_argument("--hidden", type=int, default=3584)
    p.add_argument("--intermediate", type=int, default=18944)
    args = p.parse_args()
    device = C.device_for(args.smoke)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else [37, 64] if args.smoke else [19679, 20480]
    H, inter = (64, 160) if args.smoke else (args.hidden, args.intermediate)
    warmup, reps = args.warmup or (1 if args.smoke else 3), args.reps or (2 if args.smoke else 10)
    info = C.machine(device)
    print(C.machine_line(info))
    fns = variants(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    w = tuple((torch.randn(*s, generator=gen) / s[1] ** 0.5).to(device, dtype).requires_grad_()
              for s in ((inter, H), (inter, H), (H, inter)))
    results: dict[str, Any] = {}
    rows = []
    for T in tokens:
        x = torch.randn(T, H, generator=gen).to(device, dtype).requires_grad_()
        dout = torch.randn(T, H, generator=gen).to(device, dtype)
        cat = torch.cat([w[0], w[1]]).detach().requires_grad_()
        ref_x, ref_w = x.detach().double().requires_grad_(), [t.detach().double().requires_grad_() for t in w]
        ref_out = reference(ref_x, tuple(ref_w))  # type: ignore[arg-type]
        ref_out.backward(dout.double())
        refs = [ref_out, ref_x.grad, *(t.grad for t in ref_w)]

        def call(name: str, fn: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
            return (lambda: fn(x, w, cat)) if name == "quack-cat" else (lambda: fn(x, w))

        fwd: dict[str, Callable[[], Any]] = {}
        step: dict[str, Callable[[], Any]] = {}
        errs: dict[str, float] = {}
        for name, fn in fns.items():
            run = call(name, fn)
            for t in (x, *w, cat):
                t.grad = None
            out = run()
            out.backward(dout)
            got = [out, x.grad, *(w[i].grad for i in range(3))]
            if name == "quack-cat":  # the gate / up gradients come as one
                got[2:4] = list(torch.chunk(cat.grad, 2))  # type: ignore[arg-type]
            errs[name] = max(float((g.detach().double() - r).abs().max() / r.abs().max()) for g, r in zip(got, refs))

            def forward(run: Callable[[], torch.Tensor] = run) -> None:
                with torch.no_grad():
                    run()

            def both(run: Callable[[], torch.Tensor] = run) -> None:
                run().backward(dout)

            fwd[name], step[name] = forward, both
        fwd_ms = C.time_interleaved(fwd, device, warmup, reps)
        step_ms = C.time_interleaved(step, device, warmup, reps)
        flops = 2 * T * H * inter * 3
        for name in fns:
            f, s = C.median(fwd_ms[name]), C.median(step_ms[name])
            results[f"{name} T={T}"] = {"fwd_ms": f, "fwd_bwd_ms": s, "err": errs[name],
                                        "tflops_fwd_bwd": 3 * flops / s / 1e9}
            rows.append([T, name, f, s, 3 * flops / s / 1e9, errs[name]])
    print(C.table(["T", "variant", "fwd ms", "fwd+bwd ms", "TFLOP/s", "err"], rows))
    for T in tokens:
        base = results.get(f"cublas+liger T={T}")
        for name in fns:
            r = results[f"{name} T={T}"]
            if base and name != "cublas+liger":
                print(f"T={T} {name} / cublas+liger: fwd {base['fwd_ms'] / r['fwd_ms']:.3f}x, "
                      f"fwd+bwd {base['fwd_bwd_ms'] / r['fwd_bwd_ms']:.3f}x")
    C.write_json(args.out, {"benchmark": "mlp_kernels", "machine": info, "hidden": H, "intermediate": inter,
                            "dtype": str(dtype), "results": results})


if __name__ == "__main__":
    main()
