"""Which head dims the installed flash-attn gets right, forward and backward, causal and not: a probe, not a timing.

For each head dim and causal / non-causal, bf16 inputs through tfcompat's "flash" backend (`varlen_attention` for
causal, `cross_attention` for non-causal) against the "sdpa" backend in fp32 on the same rounded inputs; the
bf16 "sdpa" backend's error is the yardstick. Printed per case: each of out, dq, dk, dv as its max error over the
largest reference entry, and whether it is within ``2 * sdpa_bf16 + 1e-2 / 4`` (tests/gpu/test_varlen_cuda.py's
rule). Two shapes: many 64-token windows (a vision tower's) and a few long sequences; 16 query heads over 4 KV heads.

    python bench/flash_head_dims.py --out flash_head_dims.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from tfcompat.core import attention  # noqa: E402
from tfcompat.core.attention import varlen_attention  # noqa: E402
from tfcompat.core.cross_attention import cross_attention  # noqa: E402
from tfcompat.core.packing import from_lengths  # noqa: E402

HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 256)
SHAPES = {"windows": [64] * 37 + [20, 48], "long": [1810, 967, 2401]}
TOL = 1e-2


def run(q, k, v, lengths, causal: bool, backend: str) -> list[torch.Tensor]:
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    seqs = from_lengths(lengths, q.device)
    if causal:
        out = varlen_attention(q, k, v, seqs, scale=0.11, backend=backend)
    else:
        out = cross_attention(q, k, v, seqs, seqs, scale=0.11, backend=backend)
    grad = torch.randn(out.shape, generator=torch.Generator(q.device).manual_seed(7), device=q.device).to(out.dtype)
    out.backward(grad)
    return [out.float(), *(t.grad.float() for t in (q, k, v))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    device = torch.device("cuda")
    fn = attention._flash_varlen(device)
    info = C.machine(device)
    print(C.machine_line(info))
    print("flash:", None if fn is None else fn.__module__)
    rows = []
    for d in HEAD_DIMS:
        for causal in (False, True):
            for shape, lengths in SHAPES.items():
                gen = torch.Generator(device).manual_seed(d)
                total = sum(lengths)
                q = torch.randn(total, 16, d, generator=gen, device=device).bfloat16()
                k = torch.randn(total, 4, d, generator=gen, device=device).bfloat16()
                v = torch.randn(total, 4, d, generator=gen, device=device).bfloat16()
                row = {"head_dim": d, "causal": causal, "shape": shape}
                try:
                    ref = run(q.float(), k.float(), v.float(), lengths, causal, "sdpa")
                    low = run(q, k, v, lengths, causal, "sdpa")
                    got = run(q, k, v, lengths, causal, "flash")
                except Exception as e:  # a head dim the kernel refuses: reported
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                    rows.append(row)
                    print(row)
                    continue
                ok = True
                for name, g, lo, r in zip(("out", "dq", "dk", "dv"), got, low, ref, strict=True):
                    scale = max(1.0, float(r.abs().max()))
                    err, base = float((g - r).abs().max()) / scale, float((lo - r).abs().max()) / scale
                    row[name] = err
                    ok &= err <= 2 * base + TOL / 4
                row["ok"] = ok
                rows.append(row)
                print(f"d={d:3d} causal={causal!s:5} {shape:7s} ok={ok!s:5} " +
                      " ".join(f"{n}={row[n]:.1e}" for n in ("out", "dq", "dk", "dv")))
    if args.out:
        args.out.write_text(json.dumps({"machine": info, "flash": None if fn is None else fn.__module__,
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
