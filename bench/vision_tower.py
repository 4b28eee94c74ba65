"""A Qwen2.5-VL-7B-shaped vision tower alone: its attention stock against routed through tfcompat
(`patch(model, vision_attention=True)`), forward and forward + backward, with the host syncs per forward.

The tower of `bench/vl_step.py` (32 blocks of 1280, 16 heads of 80, window attention of 8 x 8 patches, full attention
in blocks 7/15/23/31), bf16, train mode, no checkpointing; ``--images`` images of seeded patch grids (each side 16-64
patches, even), in one call as the model's forward makes it. Variants, in one run on the same weights and pixels:

  stock_sdpa           transformers' tower under ``"sdpa"``: a host sync per block (``lengths.tolist()``) and one SDPA
                       call per window or image
  stock_flash          under ``"flash_attention_2"`` (one varlen call per block), where the flash-attn 2 package imports
  tfcompat[B]          routed: one varlen call per block on backend B (``auto``, ``torch``, ``flash``, ``sdpa``: the
                       last one the per-window loop again, without the per-block sync)

Reported: ms (median of ``--reps`` after ``--warmup``), host syncs per forward (``torch.cuda.set_sync_debug_mode``),
the max difference of the tower's output from ``stock_sdpa``'s, and each variant's speed-up over ``stock_sdpa``.

    python bench/vision_tower.py --out vision_tower.json
    python bench/vision_tower.py --smoke      # CPU, tiny, fp32
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from train_step import instantiate  # noqa: E402
from vl_step import SMOKE_TEXT, SMOKE_VISION, VISION_7B  # noqa: E402

import _common as C  # noqa: E402
import tfcompat  # noqa: E402


def build(vision: dict[str, Any], dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = {k: SMOKE_TEXT[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                       "intermediate_size", "vocab_size")}
    text.update(num_hidden_layers=1, hidden_size=vision["out_hidden_size"],
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    cfg._attn_implementation = "sdpa"
    return instantiate(lambda: Qwen2_5_VLForConditionalGeneration(cfg), dtype, device)


def syncs_per_call(fn: Any, device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def main() -> None:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--backends", default="auto,torch,flash,sdpa", help="tfcompat backends to route through")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    smoke = args.smoke
    device = C.device_for(smoke)
    dtype = torch.float32 if smoke else torch.bfloat16
    warmup, reps = (1, 2) if smoke else (2 if args.warmup is None else args.warmup, args.reps or 5)
    vision = SMOKE_VISION if smoke else VISION_7B
    model = build(vision, dtype, device)
    tower = model.model.visual
    gen = torch.Generator().manual_seed(args.seed)
    lo, hi = (4, 8) if smoke else (16, 64)
    grid = torch.tensor([[1, *(2 * torch.randint(lo // 2, hi // 2 + 1, (2,), generator=gen)).tolist()]
                         for _ in range(args.images)], device=device)
    patch_dim = 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    pixels = torch.randn(int(grid.prod(-1).sum()), patch_dim, generator=gen).to(device, dtype)
    info = C.machine(device)
    print(C.machine_line(info))
    print(f"tower: {vision['depth']} blocks of {vision['hidden_size']}, {dtype}; {args.images} images "
          f"{grid[:, 1:].tolist()} = {pixels.shape[0]} patches")

    def forward() -> torch.Tensor:
        out = tower(pixels, grid_thw=grid)
        return out.pooler_output if hasattr(out, "pooler_output") else out

    def train() -> None:
        tower.zero_grad(set_to_none=True)
        forward().float().square().mean().backward()

    variants: list[tuple[str, Any]] = [("stock_sdpa", None)]
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401 -- the flash-attn 2 package (FA4 has no such name)

        variants.append(("stock_flash", "flash_attention_2"))
    except ImportError:
        print("stock_flash: not run (the flash-attn 2 package does not import)")
    variants += [(f"tfcompat[{b}]", b) for b in args.backends.split(",")]
    results: dict[str, Any] = {}
    reference = None
    for name, option in variants:
        try:
            if name.startswith("tfcompat"):
                handle: Any = tfcompat.patch(model, vision_attention=True, backend=option)
            else:
                handle = None
                model.config.vision_config._attn_implementation = option or "sdpa"
            try:
                with torch.no_grad():
                    out = forward().float()
                    fwd = C.time_ms(forward, device, warmup, reps)
                    syncs = syncs_per_call(forward, device)
                bwd = C.time_ms(train, device, warmup, reps)
            finally:
                if handle is not None:
                    handle.undo()
                model.config.vision_config._attn_implementation = "sdpa"
        except Exception as e:  # a backend that cannot run here is reported, the others still run
            print(f"{name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            continue
        reference = out if reference is None else reference
        results[name] = {"forward_ms": C.median(fwd), "train_ms": C.median(bwd), "syncs_per_forward": syncs,
                         "max_diff": float((out - reference).abs().max()),
                         "reference_max_abs": float(reference.abs().max())}
        print(f"{name}: forward {C.median(fwd):.2f} ms, forward+backward {C.median(bwd):.2f} ms, "
              f"syncs/forward {syncs}", flush=True)
    base = results["stock_sdpa"]
    rows = [[n, r["forward_ms"], r["train_ms"], "n/a" if r["syncs_per_forward"] is None else r["syncs_per_forward"],
             f"{r['max_diff']:.2e}", f"{base['forward_ms'] / r['forward_ms']:.2f}x",
             f"{base['train_ms'] / r['train_ms']:.2f}x"] for n, r in results.items() if "error" not in r]
    print(f"\nmedian of {reps} after {warmup} warm-up; speed-ups over stock_sdpa in this run (stock_sdpa's largest "
          f"output entry: {base['reference_max_abs']:.3g}):")
    print(C.table(["variant", "forward ms", "fwd+bwd ms", "syncs/forward", "max diff vs stock_sdpa", "forward x",
                   "fwd+bwd x"], rows))
    C.write_json(args.out, {"benchmark": "vision_tower", "smoke": smoke, "machine": info, "dtype": str(dtype),
                            "grid": grid.tolist(), "patches": pixels.shape[0], "warmup": warmup, "reps": reps,
                            "results": results})


if __name__ == "__main__":
    main()
