"""A Qwen3.5-shaped decoder stack, packed sequences: tfcompat.patch (linear_backend torch / auto) vs stock padded.

A ``Qwen3_5ForConditionalGeneration`` with Qwen3.5-9B's text shape (hidden 4096, 16 query / 4 KV heads of 256 with
partial rotary 0.25 and an output gate; Gated DeltaNet with 16 key / 32 value heads of 128, conv width 4; MLP
12288) but ``--layers`` decoder layers (default 4: three Gated DeltaNet, one gated attention, Qwen3.5's 3:1
pattern), a 32k vocabulary and a 1-layer vision tower (text-only rows: the tower is not run). Its text stack
(``model.model``, up to the final norm; no LM head) runs the same ``N`` sequences as:

- stock padded: the unpatched model on a right-padded ``(N, L_max)`` batch with its attention mask, SDPA, with
  whatever Gated DeltaNet kernels the installed transformers picked (fla's rule when installed, causal-conv1d's
  conv when installed, else its torch fallbacks);
- tfcompat packed: ``tfcompat.patch(model, linear_backend=...)`` on one ``(1, T)`` row with restarting position
  ids, ``"torch"`` (exact torch kernels) and, where usable, ``"auto"`` (fla's rule, causal-conv1d's or fla's conv);
  attention through the shared varlen core (``backend="auto"``).

Forward (no grad) and forward+backward (``backward`` of a fixed projection of the hidden states), interleaved,
median of ``--reps``. Host syncs after warm-up (``torch.cuda.set_sync_debug_mode("warn")``): of a packed
forward+backward given the boundaries up front (``tfcompat_context``; target 0 for every layer count), and of
one given only position ids (the one device-to-host copy of the boundaries per forward). Max difference of each
packed output from the stock one on the real tokens, relative to the output scale.

    python bench/qwen3_5_stack.py --out qwen3_5_stack.json                # GPU, bf16, 16k and 32k tokens in 8
    PYTHONPATH=/path/to/fla-wheels python bench/qwen3_5_stack.py ...       # the same with flash-linear-attention
    python bench/qwen3_5_stack.py --smoke                                 # CPU, tiny, fp32
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from host_syncs import count_steady  # noqa: E402
from linear_attention import stock_kernels  # noqa: E402

import _common as C  # noqa: E402
import tfcompat  # noqa: E402
from tfcompat.core.context import ForwardContext  # noqa: E402
from tfcompat.core.linear_attention import available_conv_backends, available_rule_backends  # noqa: E402
from tfcompat.core.packing import from_lengths  # noqa: E402

FULL = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
            mrope_section=[11, 11, 10])
SMOKE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             mrope_section=[2, 1, 1])


def build_model(shape: dict, layers: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Qwen3.5 with ``layers`` decoder layers, every fourth one gated attention; trained-like decay magnitudes."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    shape = dict(shape)
    rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
            "mrope_section": shape.pop("mrope_section"), "mrope_interleaved": True}
    text = dict(vocab_size=32768, num_hidden_layers=layers, linear_conv_kernel_dim=4, rope_parameters=rope,
                layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
                max_position_embeddings=65536, pad_token_id=0, **shape)
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=shape["hidden_size"], num_position_embeddings=64)
    config = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=32000, video_token_id=32001,
                           vision_start_token_id=32002, vision_end_token_id=32003)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration._from_config(config, attn_implementation="sdpa")  # fp32 on the host
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand_like(p).mul(3).add(0.5).log())
    return model.to(device, dtype).train()


def main() -> None:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--tokens", default=None,
                   help="comma-separated packed token counts (default 16384,32768; smoke 300)")
    p.add_argument("--seqs", type=int, default=8, help="sequences per packed row (default 8)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers, every fourth gated attention (default 4)")
    args = p.parse_args()
    smoke = args.smoke
    device = C.device_for(smoke)
    dtype = torch.float32 if smoke else torch.bfloat16
    warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
    reps = args.reps if args.reps is not None else (2 if smoke else 10)
    totals = [int(t) for t in (args.tokens or ("300" if smoke else "16384,32768")).split(",")]
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()

    info = C.machine(device)
    model = build_model(SMOKE if smoke else FULL, args.layers, device, dtype)
    probe = torch.zeros(1, device=device, dtype=dtype)
    info["linear_backends"] = {"rule": available_rule_backends(probe), "conv": available_conv_backends(probe)}
    info["stock_kernels"] = stock_kernels()
    print(C.machine_line(info))
    print(f"stock kernels: {info['stock_kernels']}; tfcompat usable: {info['linear_backends']}; "
          f"{args.layers} layers: {model.config.text_config.layer_types}")
    backends = ["torch"] + (["auto"] if info["linear_backends"]["rule"][0] != "torch"
                            or info["linear_backends"]["conv"][0] != "torch" else [])
    variants = {"stock padded": model}
    for backend in backends:  # one patched copy per backend, same weights; the stock model stays unpatched
        variants[f"packed linear_backend={backend}"] = copy.deepcopy(model)
        tfcompat.patch(variants[f"packed linear_backend={backend}"], linear_backend=backend)

    rows, results = [], []
    for total in totals:
        lengths = C.random_lengths(total, args.seqs, seed=total, min_len=min(256, total // args.seqs))
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(1, 32000, (1, total), generator=gen).to(device)
        pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)  # (1, T), restarting per sequence
        ctx = ForwardContext(from_lengths(lengths, device))
        longest = max(lengths)
        mask = torch.zeros(len(lengths), longest, dtype=torch.long)
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        real = mask.flatten().nonzero().flatten().to(device)
        mask = mask.to(device)
        batch = ids.new_zeros(len(lengths) * longest).index_copy(0, real, ids[0]).view(len(lengths), longest)
        readout = torch.randn(model.config.text_config.hidden_size, generator=gen).to(device, dtype)

        def stock() -> torch.Tensor:
            out = model.model(input_ids=batch, attention_mask=mask, use_cache=False).last_hidden_state
            return out.flatten(0, 1)[real]  # (N, L_max, H) -> (T, H), real tokens in packing order

        def step(fn, m: torch.nn.Module) -> None:
            (fn().float() @ readout.float()).sum().backward()
            for q in m.parameters():
                q.grad = None

        with torch.no_grad():
            ref = stock().float()
        scale = float(ref.abs().max())
        fwd, bwd, diffs, syncs = {"stock padded": stock}, {"stock padded": lambda: step(stock, model)}, {}, {}
        for name, m in list(variants.items())[1:]:
            def packed(m=m, context=True) -> torch.Tensor:
                extra = {"tfcompat_context": ctx} if context else {}
                return m.model(input_ids=ids, position_ids=pos, use_cache=False, **extra).last_hidden_state[0]

            fwd[name], bwd[name] = packed, (lambda packed=packed, m=m: step(packed, m))
            with torch.no_grad():
                diffs[name] = float((packed().float() - ref).abs().max()) / scale
            syncs[name] = (count_steady(lambda packed=packed, m=m: step(packed, m), device)[0],
                           count_steady(lambda packed=packed, m=m: step(lambda: packed(context=False), m), device)[0])
        with torch.no_grad():
            t_fwd = C.time_interleaved(fwd, device, warmup, reps)
        t_bwd = C.time_interleaved(bwd, device, warmup, reps)
        for name in fwd:
            f, b = C.median(t_fwd[name]), C.median(t_bwd[name])
            given, derived = syncs.get(name, (None, None))
            rows.append([total, name, f, b, C.median(t_bwd["stock padded"]) / b, given, derived, diffs.get(name, 0.0)])
            results.append({"tokens": total, "lengths": lengths, "variant": name, "fwd_ms": f, "fwd_bwd_ms": b,
                            "host_syncs_fwd_bwd_context_given": given, "host_syncs_fwd_bwd_from_position_ids": derived,
                            "max_rel_diff_vs_stock": diffs.get(name)})
    print(C.table(["tokens", "variant", "fwd ms", "fwd+bwd ms", "speed-up fwd+bwd", "syncs (ctx given)",
                   "syncs (from pos)", "max rel |diff|"], rows))
    print(f"host syncs: one forward+backward of the {args.layers}-layer stack after warm-up (None on CPU), boundaries "
          "given up front / derived from the position ids; max rel |diff|: packed vs stock padded on the real tokens, "
          "over the output scale")
    C.write_json(args.out, {"machine": info, "shape": SMOKE if smoke else FULL, "layers": args.layers,
                            "dtype": str(dtype), "results": results})


if __name__ == "__main__":
    main()
