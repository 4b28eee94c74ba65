"""One PPO training step of a Qwen2.5-VL-7B-shaped model with images: tfcompat packed against stock padded.

The model is built from config with random weights: Qwen2.5-VL-7B's text stack (hidden 3584, 28 query / 4 KV heads,
intermediate 18944, vocab 152064, M-RoPE sections 16/24/24; ``--layers`` decoder layers, default 28) and its vision
tower (32 blocks of 1280, window attention with full attention in blocks 7/15/23/31, 2x2 patch merger to 3584),
bf16 on CUDA, train mode, gradient checkpointing (non-reentrant) in both towers, everything trained. The batch:
``--seqs`` sequences (default 8) of seeded text lengths in ``[--min-len, --max-len]`` (512-4,096), each with one
image of a seeded patch grid (each side 16-64 patches of 14 px: 64-1,024 merged image tokens) placed at a random
point between ``<|vision_start|>`` and ``<|vision_end|>``; random pixel values. One step = zero the gradients,
the model's text stack to the last hidden states of every real token ``(T, 3584)`` (the vision tower runs inside),
the PPO head of `bench/train_step.py` (log-probs and entropy at temperature 0.7; image tokens carry no label) and
backward. Variants, in one run on the same weights and sequences:

  tfcompat_fused  ``tfcompat.pack`` of the sequences (one row, 3-row M-RoPE position ids per sequence) and
                  ``tfcompat.patch(model, fused=True)``: the shared varlen core (FA4 where installed), Liger's
                  RMSNorm / SwiGLU / RoPE kernels where exact; ``@...`` suffixes as in `bench/train_step.py`
                  (``@logits``, ``@loss``, ``@attention+offload:18+logits``), and ``vision``:
                  ``vision_attention=True``, the tower's attention one varlen call per block (``@vision+logits``)
                  instead of one SDPA call per window after a host sync (stock without flash-attn 2; every other
                  variant)
  padded          stock, attn "sdpa", the sequences right-padded with an attention mask
  liger_padded    Liger-Kernel's ``apply_liger_kernel_to_qwen2_5_vl`` (rope, rms_norm, swiglu) on the instance +
                  stock padded sdpa, with Liger's fused linear cross entropy as the head (what its users run; stock
                  transformers cannot pack M-RoPE rows, so there is no Liger + flex packed peer here)

Reported per variant: ms per step (median of ``--reps`` after ``--warmup``), peak memory, loss, and ratios.

    python bench/vl_step.py --out vl_step.json
    python bench/vl_step.py --smoke          # CPU, tiny, fp32
"""

from __future__ import annotations

import gc
import inspect
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from train_step import QWEN25_7B, checkpointing, head_loss, instantiate  # noqa: E402

import _common as C  # noqa: E402
import tfcompat  # noqa: E402
from tfcompat.heads import IGNORE_INDEX  # noqa: E402

VISION_7B = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                 patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                 fullatt_block_indexes=[7, 15, 23, 31])
SMOKE_TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                  vocab_size=152064, num_hidden_layers=2, attention_dropout=0.0)
SMOKE_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])


def build(text: dict[str, Any], vision: dict[str, Any], layers: int, dtype: torch.dtype,
          device: torch.device, mrope: list[int]) -> torch.nn.Module:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
            "rms_norm_eps", "attention_dropout")
    t = {k: text[k] for k in keys if k in text}
    t.update(num_hidden_layers=layers, max_position_embeddings=32768,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope})
    cfg = Qwen2_5_VLConfig(text_config=t, vision_config=vision, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return instantiate(lambda: Qwen2_5_VLForConditionalGeneration(cfg), dtype, device)


class Batch:
    """The sequences as examples (for ``tfcompat.pack``) and right-padded, with labels and advantages per token in
    packed order (image tokens: no label)."""

    def __init__(self, model: torch.nn.Module, n: int, lo: int, hi: int, sides: tuple[int, int],
                 device: torch.device, seed: int) -> None:
        cfg, vcfg = model.config, model.config.vision_config
        gen = torch.Generator().manual_seed(seed)
        patch = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size ** 2
        merge = vcfg.spatial_merge_size
        self.examples: list[dict[str, torch.Tensor]] = []
        labels, ids_all = [], []
        for _ in range(n):
            h, w = (int(torch.randint(sides[0] // 2, sides[1] // 2 + 1, (1,), generator=gen)) * 2 for _ in "hw")
            n_img = h * w // merge ** 2
            length = max(int(torch.randint(lo, hi + 1, (1,), generator=gen)), n_img + 4)
            text = torch.randint(0, 151643, (length - n_img - 2,), generator=gen)
            at = int(torch.randint(0, text.numel() + 1, (1,), generator=gen))
            image = torch.tensor([cfg.vision_start_token_id, *[cfg.image_token_id] * n_img, cfg.vision_end_token_id])
            ids = torch.cat([text[:at], image, text[at:]])
            lab = torch.cat([ids[1:], torch.tensor([IGNORE_INDEX])])
            lab[(lab == cfg.image_token_id) | (lab == cfg.vision_end_token_id)] = IGNORE_INDEX
            labels.append(lab)
            ids_all.append(ids)
            self.examples.append({"input_ids": ids.to(device),
                                  "pixel_values": torch.randn(h * w, patch, generator=gen).to(device),
                                  "image_grid_thw": torch.tensor([[1, h, w]], device=device)})
        self.lengths = [x.numel() for x in ids_all]
        self.total, self.max_len = sum(self.lengths), max(self.lengths)
        self.patches = sum(int(e["image_grid_thw"].prod()) for e in self.examples)
        padded = torch.zeros(n, self.max_len, dtype=torch.long)
        mask = torch.zeros(n, self.max_len, dtype=torch.long)
        for i, ids in enumerate(ids_all):
            padded[i, : ids.numel()] = ids
            mask[i, : ids.numel()] = 1
        self.padded = {"input_ids": padded.to(device), "attention_mask": mask.to(device),
                       "pixel_values": torch.cat([e["pixel_values"] for e in self.examples]),
                       "image_grid_thw": torch.cat([e["image_grid_thw"] for e in self.examples])}
        if "mm_token_type_ids" in inspect.signature(model.model.forward).parameters:
            # as the processor returns them: without, the stock forward falls back to 1-d positions (5.17+)
            self.padded["mm_token_type_ids"] = (self.padded["input_ids"] == cfg.image_token_id).int()
        self.keep = mask.bool().to(device)
        self.labels = torch.cat(labels).to(device)  # (T,)
        self.advantage = torch.randn(self.total, generator=gen).to(device)  # (T,)
        self.n_labels = int((self.labels != IGNORE_INDEX).sum())


def make_step(model: torch.nn.Module, batch: Batch, packed: dict[str, Any] | None, head: str, keep_logits: bool,
              fused: bool = False):
    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        if packed is None:
            hidden = model.model(**batch.padded, use_cache=False).last_hidden_state[batch.keep]  # (T, H)
        else:
            hidden = model.model(**packed, use_cache=False).last_hidden_state[0]  # (1, T, H) -> (T, H)
        loss = head_loss(hidden, model, batch, head, keep_logits, fused)  # type: ignore[arg-type]
        loss.backward()
        return loss.detach()

    return step


def main() -> None:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=None, help="text decoder layers (default 28; smoke 2)")
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--min-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--variants", default="tfcompat_fused[auto],tfcompat_fused[auto]@logits,"
                   "tfcompat_fused[auto]@vision+logits,padded,liger_padded")
    p.add_argument("--head", default="auto", help="tfcompat.heads backend (default auto)")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    smoke = args.smoke
    device = C.device_for(smoke)
    dtype = torch.float32 if smoke else torch.bfloat16
    warmup, reps = (1, 2) if smoke else (1 if args.warmup is None else args.warmup, args.reps or 3)
    layers = args.layers or (2 if smoke else 28)
    lo, hi, sides = (40, 120, (4, 8)) if smoke else (args.min_len, args.max_len, (16, 64))
    model = build(SMOKE_TEXT if smoke else QWEN25_7B, SMOKE_VISION if smoke else VISION_7B, layers, dtype, device,
                  [2, 3, 3] if smoke else [16, 24, 24])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = Batch(model, args.seqs, lo, hi, sides, device, args.seed + 1)
    info = C.machine(device)
    print(C.machine_line(info))
    p_text = sum(x.numel() for n, x in model.model.language_model.named_parameters() if x.ndim == 2
                 and "embed" not in n) + model.lm_head.weight.numel()
    p_vis = sum(x.numel() for x in model.model.visual.parameters() if x.ndim == 2)
    flops = 6.0 * p_text * batch.total + 6.0 * p_vis * batch.patches  # matmuls only: attention not counted
    print(f"model: Qwen2.5-VL {layers} text layers, {sum(x.numel() for x in model.parameters()) / 1e9:.3f} B params, "
          f"{dtype}; batch: {args.seqs} sequences {batch.lengths} = {batch.total} tokens, {batch.patches} patches; "
          f"padded {args.seqs} x {batch.max_len}; model matmul FLOPs/step {flops:.4g}")
    results: dict[str, Any] = {}
    variants = sorted(args.variants.split(","), key=lambda v: v.startswith("liger"))  # Liger's patch is for good
    liger = None
    for name in variants:
        base, _, mode = name.partition("@")
        if base.startswith("liger") and liger is None:
            from importlib.metadata import version

            from liger_kernel.transformers.monkey_patch import apply_liger_kernel_to_qwen2_5_vl

            apply_liger_kernel_to_qwen2_5_vl(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                             fused_linear_cross_entropy=False, model=model)
            liger = version("liger-kernel")
        keep_logits, fused = "logits" in mode.split("+"), "loss" in mode.split("+")
        vision = "vision" in mode.split("+")
        # the head's and the tower's, not the checkpointing's
        mode = "+".join(k for k in mode.split("+") if k not in ("logits", "loss", "vision"))
        tf = base.startswith("tfcompat")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            with checkpointing(model, mode, stock=not tf) as keep:
                if tf:
                    backend = base[base.index("[") + 1:-1] if "[" in base else "auto"
                    with tfcompat.patch(model, backend=backend, fused=base.startswith("tfcompat_fused"), **keep,
                                        vision_attention=vision):
                        packed = tfcompat.pack(model, batch.examples).model_inputs
                        step = make_step(model, batch, packed, args.head, keep_logits, fused)
                        loss = float(step())
                        ms = C.time_ms(step, device, warmup, reps)
                else:
                    step = make_step(model, batch, None, "liger" if base == "liger_padded" else args.head, keep_logits)
                    loss = float(step())
                    ms = C.time_ms(step, device, warmup, reps)
        except Exception as e:  # an out-of-memory or an unsupported path: reported, the others still run
            print(f"{name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            model.zero_grad(set_to_none=True)
            continue
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        model.zero_grad(set_to_none=True)
        med = C.median(ms)
        results[name] = {"ms": med, "all_ms": ms, "loss": loss, "peak_memory_bytes": peak,
                         "mfu": flops / (med * 1e-3) / (args.peak_tflops * 1e12)}
        print(f"{name}: {med:.1f} ms/step, loss {loss:.6g}", flush=True)
    rows = [[n, r["ms"], f"{100 * r['mfu']:.1f}%", "n/a" if r["peak_memory_bytes"] is None
             else f"{r['peak_memory_bytes'] / 2**30:.1f}", f"{r['loss']:.6g}"]
            for n, r in results.items() if "error" not in r]
    print(f"\nforward + head + backward, median of {reps} after {warmup} warm-up:")
    print(C.table(["variant", "ms/step", "MFU (matmuls)", "peak GiB", "loss"], rows))
    ratios = {f"{t} / {o}": results[o]["ms"] / results[t]["ms"] for t in results for o in results
              if t.startswith("tfcompat") and not o.startswith("tfcompat") and "error" not in results[t]
              and "error" not in results[o]}
    for k, v in ratios.items():
        print(f"speed-up {k}: {v:.2f}x")
    C.write_json(args.out, {"benchmark": "vl_step", "smoke": smoke, "machine": info, "dtype": str(dtype),
                            "liger_kernel": liger, "layers": layers, "lengths": batch.lengths,
                            "real_tokens": batch.total, "patches": batch.patches, "flops": flops,
                            "warmup": warmup, "reps": reps, "results": results, "speedups": ratios})


if __name__ == "__main__":
    main()
