"""Training-step throughput: tfcompat packed (one row, varlen attention) vs stock transformers padded (SDPA + mask).

A llama decoder stack built from config (hidden 2048, 16 heads, 4 KV heads, intermediate 5632, 4 layers, vocab
32000) in bf16 on CUDA, and a batch of 8 sequences with seeded random lengths in [256, 4096]:
  (a) patched packed: input_ids (1, T), position ids restarting per sequence, tfcompat.patch(model, backend="auto")
  (b) stock padded:   input_ids (8, max_len) right-padded, attention_mask, the unpatched model (attn "sdpa")
Forward + backward with the same loss on both: the mean over real tokens of the fp32 logits (pad positions
excluded). Tokens/s counts real (non-pad) tokens only; speedup = packed tokens/s / padded tokens/s, same run.

    python bench/packed_vs_padded.py --out packed_vs_padded.json
    python bench/packed_vs_padded.py --smoke      # CPU, tiny model, fp32, a few short sequences
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _common as C  # noqa: E402
import tfcompat  # noqa: E402
from tfcompat.core.attention import select_backend  # noqa: E402
from tfcompat.selfcheck import tiny_model  # noqa: E402


def main() -> None:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=None, help="sequences in the batch (default 8; smoke 3)")
    p.add_argument("--min-len", type=int, default=None, help="shortest sequence (default 256; smoke 3)")
    p.add_argument("--max-len", type=int, default=None, help="longest sequence (default 4096; smoke 20)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    smoke = args.smoke
    device = C.device_for(smoke)
    dtype = torch.float32 if smoke else torch.bfloat16
    warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
    reps = args.reps if args.reps is not None else (3 if smoke else 10)
    n_seq = args.seqs or (3 if smoke else 8)
    lo, hi = args.min_len or (3 if smoke else 256), args.max_len or (20 if smoke else 4096)
    dims = (dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                 num_hidden_layers=2, vocab_size=256)
            if smoke else
            dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=4, intermediate_size=5632,
                 num_hidden_layers=4, vocab_size=32000))

    info = C.machine(device)
    print(C.machine_line(info))
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(lo, hi + 1, (n_seq,), generator=gen).tolist()
    seqs = [torch.randint(1, dims["vocab_size"], (n,), generator=gen) for n in lengths]
    real, max_len = sum(lengths), max(lengths)

    model = tiny_model("llama", "sdpa", max_position_embeddings=max(8192, hi), **dims)
    model = model.to(device=device, dtype=dtype).train()
    model.requires_grad_(True)
    n_params = sum(p.numel() for p in model.parameters())

    # (a) packed: one row, position ids restart at 0 per sequence
    packed_ids = torch.cat(seqs)[None].to(device)
    packed_pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    # (b) padded: right padding, attention mask, default positions
    padded_ids = torch.zeros(n_seq, max_len, dtype=torch.long)
    mask = torch.zeros(n_seq, max_len, dtype=torch.long)
    for i, s in enumerate(seqs):
        padded_ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    padded_ids, mask = padded_ids.to(device), mask.to(device)
    keep = mask.bool()

    def packed_step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=packed_ids, position_ids=packed_pos, use_cache=False).logits.float().mean()
        loss.backward()
        return loss.detach()

    def padded_step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=padded_ids, attention_mask=mask, use_cache=False).logits
        loss = logits[keep].float().mean()  # real tokens only, as in the packed loss
        loss.backward()
        return loss.detach()

    with tfcompat.patch(model, backend="auto"):
        backend = select_backend(torch.empty(1, device=device, dtype=dtype), "auto")
        loss_packed = float(packed_step())
        packed_ms = C.time_ms(packed_step, device, warmup, reps)
        peak_packed = _peak(device)
    loss_padded = float(padded_step())
    padded_ms = C.time_ms(padded_step, device, warmup, reps)
    peak_padded = _peak(device)

    res = {}
    for name, ms, tokens_in, peak in (("packed", packed_ms, real, peak_packed),
                                      ("padded", padded_ms, n_seq * max_len, peak_padded)):
        med = C.median(ms)
        res[name] = {"ms": med, "all_ms": ms, "tokens_processed": tokens_in, "real_tokens": real,
                     "real_tokens_per_s": real / (med * 1e-3), "peak_memory_bytes": peak}
    speedup = res["packed"]["real_tokens_per_s"] / res["padded"]["real_tokens_per_s"]
    print(f"model: llama {dims} ({n_params / 1e6:.1f} M params), {dtype}; patched backend 'auto' -> {backend!r}")
    print(f"batch: {n_seq} sequences, lengths {lengths}: {real} real tokens; padded {n_seq} x {max_len} = "
          f"{n_seq * max_len} ({100 * (1 - real / (n_seq * max_len)):.0f}% padding)")
    print(f"loss check (same loss on real tokens): packed {loss_packed:.6g}, padded {loss_padded:.6g}")
    print(f"forward+backward, median of {reps} after {warmup} warm-up:")
    rows = [["(a) patched packed", res["packed"]["tokens_processed"], res["packed"]["ms"],
             res["packed"]["real_tokens_per_s"], _gib(peak_packed), f"{speedup:.2f}x"],
            ["(b) stock padded sdpa", res["padded"]["tokens_processed"], res["padded"]["ms"],
             res["padded"]["real_tokens_per_s"], _gib(peak_padded), "1.00x"]]
    print(C.table(["variant", "tokens in", "ms/step", "real tokens/s", "peak GiB", "speedup"], rows))
    C.write_json(args.out, {"benchmark": "packed_vs_padded", "smoke": smoke, "machine": info, "dtype": str(dtype),
                            "model": dims, "params": n_params, "backend": backend, "lengths": lengths,
                            "warmup": warmup, "reps": reps, "loss": {"packed": loss_packed, "padded": loss_padded},
                            "results": res, "speedup": speedup})


def _peak(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def _gib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / 2**30:.1f}"


if __name__ == "__main__":
    main()
