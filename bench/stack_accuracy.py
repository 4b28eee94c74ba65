"""Per-token accuracy of the bf16 paths `train_step.py` times, against an fp32 stock reference, on a derived stack.

The same model as ``train_step.py --family F`` (real width, ``--layers``, random weights), the same kind of batch
(``--lengths``, odd by default). Reference: the model in fp32, stock attention of the family (eager for gpt-oss),
each sequence right-padded with a mask, no gradient. Compared in bf16: tfcompat packed (``patch(model, backend=B)``),
stock padded, stock flex attention on the packed row. Per variant: the max and mean absolute difference of each real
token's log-probability of its next token (temperature 1) and of its last hidden state's norm-relative error, against
the reference. The train-step losses are signed means of log-probabilities times random advantages, near zero; a
difference there says little by itself, this table says how far each path is from the fp32 model per token.

    python bench/stack_accuracy.py --family gpt_oss --out stack_accuracy_gpt_oss.json
    python bench/stack_accuracy.py --family qwen3_moe --smoke
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from train_step import DERIVED, SMOKE_DERIVED, STOCK_ATTENTION, Batch, build_derived, set_attn, stack_of  # noqa: E402

import _common as C  # noqa: E402
import tfcompat  # noqa: E402


def token_logprobs(model: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """hidden ``(T, H)``, labels ``(T,)`` (-100 at each sequence's last token); returns ``(T,)`` fp32 log-probs
    (0 where there is no label), computed in chunks of 2048 tokens in fp32."""
    w = model.lm_head.weight.float()
    out = torch.zeros(hidden.shape[0], device=hidden.device)
    for s in range(0, hidden.shape[0], 2048):
        logits = hidden[s:s + 2048].float() @ w.T  # (t, V)
        lab = labels[s:s + 2048]
        lp = torch.log_softmax(logits, -1).gather(-1, lab.clamp(min=0)[:, None])[:, 0]
        out[s:s + 2048] = torch.where(lab >= 0, lp, 0.0)
    return out


def hidden_of(model: torch.nn.Module, batch: Batch, kind: str) -> torch.Tensor:
    stack = stack_of(model)
    with torch.no_grad():
        if kind == "padded":
            h = stack(input_ids=batch.padded_ids, attention_mask=batch.mask, use_cache=False).last_hidden_state
            return h[batch.keep]  # (S, L, H) -> (T, H)
        return stack(input_ids=batch.packed_ids, position_ids=batch.packed_pos, use_cache=False).last_hidden_state[0]


def main() -> None:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--family", required=True, choices=sorted(DERIVED))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lengths", default="1405,615,2501,777", help="sequence lengths, comma-separated")
    p.add_argument("--backend", default="auto", help="tfcompat attention backend")
    p.add_argument("--experts", default="grouped_mm")
    args = p.parse_args()
    device = C.device_for(args.smoke)
    dims = (SMOKE_DERIVED if args.smoke else DERIVED)[args.family]
    lengths = [int(x) for x in args.lengths.split(",")] if not args.smoke else [5, 13, 9]
    info = C.machine(device)
    print(C.machine_line(info))
    ref_model = build_derived(args.family, dims, args.layers, max(lengths), torch.float32, device, args.experts).eval()
    batch = Batch(lengths, min(dims["vocab_size"], 151643), device, seed=1)
    stock = STOCK_ATTENTION.get(args.family, "sdpa")
    ref_hidden = hidden_of(ref_model, batch, "padded")
    ref_lp = token_logprobs(ref_model, ref_hidden, batch.labels)
    low = copy.deepcopy(ref_model).to(torch.bfloat16)
    del ref_model
    variants = ["tfcompat", "padded"] + ([] if args.smoke else ["flex_packed"])
    results: dict[str, Any] = {}
    for name in variants:
        try:
            if name == "tfcompat":
                with tfcompat.patch(low, backend=args.backend):
                    h = hidden_of(low, batch, "packed")
            else:
                set_attn(low, "flex_attention" if name == "flex_packed" else stock)
                h = hidden_of(low, batch, "packed" if name == "flex_packed" else "padded")
                set_attn(low, stock)
        except Exception as e:  # a stock path that cannot run this model: reported
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name}: failed: {results[name]['error']}", flush=True)
            continue
        lp = token_logprobs(low, h, batch.labels)
        d = (lp - ref_lp).abs()[batch.labels >= 0]
        rel = ((h.float() - ref_hidden).norm(dim=-1) / ref_hidden.norm(dim=-1)).max()
        results[name] = {"logprob_max_abs": float(d.max()), "logprob_mean_abs": float(d.mean()),
                         "hidden_max_rel": float(rel)}
        print(f"{name}: log-prob |diff| max {float(d.max()):.4f} mean {float(d.mean()):.5f}; "
              f"hidden max rel {float(rel):.4f}", flush=True)
    print(f"\n{args.family}, {args.layers} layers, lengths {lengths}, bf16 against fp32 stock ({stock}) padded:")
    print(C.table(["variant", "log-prob max |diff|", "log-prob mean |diff|", "hidden max rel"],
                  [[n, *(("failed", "-", "-") if "error" in r else
                         (f"{r['logprob_max_abs']:.4f}", f"{r['logprob_mean_abs']:.5f}", f"{r['hidden_max_rel']:.4f}"))]
                   for n, r in results.items()]))
    C.write_json(args.out, {"benchmark": "stack_accuracy", "machine": info, "family": args.family,
                            "layers": args.layers, "lengths": lengths, "backend": args.backend,
                            "stock_attention": stock, "results": results})


if __name__ == "__main__":
    main()
