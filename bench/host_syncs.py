"""Host-device synchronizations per forward: tfcompat's patched packed path vs stock transformers' packed path.

Counts with ``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing CUDA op (``.item()``, ``.cpu()``,
``nonzero``, ``bool(tensor)``, ...) raises a warning, recorded with ``warnings.catch_warnings(record=True)``.
Two layer counts separate per-forward syncs (intercept) from per-layer syncs (slope). Also counts the syncs of
transformers' flash-attention kwargs preparation from position ids (``prepare_fa_kwargs_from_position_ids``),
which its flash path runs in every attention layer when no ``cu_seq_lens`` are passed, and times it against
tfcompat's boundaries (one host copy of the text row and ``from_host_positions``, once per forward).

    python bench/host_syncs.py --out host_syncs.json
    python bench/host_syncs.py --smoke            # CPU: no sync counting ("n/a on CPU"), forwards still run
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _common as C  # noqa: E402
import tfcompat  # noqa: E402
from tfcompat.core.packing import from_host_positions  # noqa: E402
from tfcompat.selfcheck import tiny_model  # noqa: E402


def count_syncs(fn, device: torch.device) -> tuple[int | None, Counter]:
    """Synchronizing CUDA ops run by ``fn()`` (None on CPU), and where they were called from."""
    if device.type != "cuda":
        fn()
        return None, Counter()
    C.sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    C.sync(device)
    hits = [w for w in caught if "synchroniz" in str(w.message).lower()]
    return len(hits), Counter(f"{Path(w.filename).parent.name}/{Path(w.filename).name}:{w.lineno}" for w in hits)


def count_steady(fn, device: torch.device, times: int = 3) -> tuple[int | None, list[int | None], Counter]:
    """Median sync count over ``times`` calls (a one-time lazy init in the first call does not count)."""
    counts, sites = [], Counter()
    for _ in range(times):
        n, where = count_syncs(fn, device)
        counts.append(n)
        sites.update(where)
    if counts[0] is None:
        return None, counts, sites
    return sorted(counts)[len(counts) // 2], counts, sites


def fa_prep_fns(pos: torch.Tensor) -> dict[str, object] | None:
    """transformers' per-layer flash-attention kwargs preparation from position ids, split in its steps."""
    try:
        import transformers.modeling_flash_attention_utils as fa
    except ImportError:
        return None
    prepare = getattr(fa, "prepare_fa_kwargs_from_position_ids", None)
    if prepare is None:
        return None
    steps: dict[str, object] = {}
    is_packed = getattr(fa, "_is_packed_sequence", None)
    if is_packed is not None:  # the flash path branches on it (a Python bool of a device tensor)
        steps["_is_packed_sequence (branch)"] = lambda: bool(is_packed(pos, batch_size=pos.shape[0]))
    steps["prepare_fa_kwargs_from_position_ids"] = lambda: prepare(pos)

    def max_to_int() -> int:  # flash_attn_varlen_func takes max_seqlen as a host int
        (_, _), (max_q, _) = prepare(pos)
        return int(max_q)

    steps["... + int(max_seqlen) for the kernel"] = max_to_int
    return steps


def main() -> None:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--layers", default=None, help="comma-separated layer counts (default 2,8; smoke 1,2)")
    p.add_argument("--tokens", type=int, default=None, help="packed tokens (default 4096; smoke 48)")
    p.add_argument("--seqs", type=int, default=None, help="sequences in the packed row (default 8; smoke 4)")
    args = p.parse_args()
    smoke = args.smoke
    device = C.device_for(smoke)
    dtype = torch.float32 if smoke else torch.bfloat16
    layers = [int(x) for x in (args.layers or ("1,2" if smoke else "2,8")).split(",")]
    total = args.tokens or (48 if smoke else 4096)
    n_seq = args.seqs or (4 if smoke else 8)
    warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
    reps = args.reps if args.reps is not None else (3 if smoke else 20)
    dims = (dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=256)
            if smoke else
            dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, intermediate_size=2816,
                 vocab_size=4096))

    info = C.machine(device)
    lengths = C.random_lengths(total, n_seq, seed=0, min_len=2)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, dims["vocab_size"], (1, total), generator=gen).to(device)
    print(C.machine_line(info))
    print(f"packed row: {total} tokens, {n_seq} sequences {lengths}; {dtype}; model {dims}")

    rows, results = [], []
    for n_layers in layers:
        model = tiny_model("llama", "sdpa", num_hidden_layers=n_layers, max_position_embeddings=max(8192, total),
                           **dims)
        model = model.to(device=device, dtype=dtype)
        model.requires_grad_(True)

        def fwd() -> torch.Tensor:
            with torch.no_grad():
                return model(input_ids=ids, position_ids=pos, use_cache=False).logits  # noqa: F821 (see `del model`)

        def fwd_bwd() -> None:
            model.zero_grad(set_to_none=True)  # noqa: F821 (as above)
            model(input_ids=ids, position_ids=pos, use_cache=False).logits.float().mean().backward()  # noqa: F821

        res: dict[str, object] = {"layers": n_layers}
        for path in ("patched", "stock"):
            handle = tfcompat.patch(model, backend="auto") if path == "patched" else None
            try:
                logits = fwd()  # warm-up (lazy inits), and the logits for the sanity check below
                fwd_bwd()
                n_fwd, all_fwd, where_fwd = count_steady(fwd, device)
                n_step, all_step, where_step = count_steady(fwd_bwd, device)
                ms = C.median(C.time_ms(fwd, device, warmup, reps))
            finally:
                if handle is not None:
                    handle.undo()
            res[path] = {"syncs_forward": n_fwd, "syncs_forward_backward": n_step, "forward_ms": ms,
                         "syncs_forward_each_call": all_fwd, "syncs_forward_backward_each_call": all_step,
                         "sync_sites_forward": dict(where_fwd), "sync_sites_forward_backward": dict(where_step)}
            res[f"{path}_logits"] = logits
        # stock must detect the packing from the position ids for the comparison to be fair
        stock_logits, patched_logits = res.pop("stock_logits").float(), res.pop("patched_logits").float()
        res["stock_vs_patched_max_abs_logit_diff"] = float((stock_logits - patched_logits).abs().max())
        res["max_abs_logit"] = float(patched_logits.abs().max())
        results.append(res)
        del model
        for path in ("patched", "stock"):
            r = res[path]
            per_layer = "n/a on CPU" if r["syncs_forward"] is None else f"{r['syncs_forward'] / n_layers:.2f}"
            rows.append([path, n_layers, _n(r["syncs_forward"]), per_layer, _n(r["syncs_forward_backward"]),
                         r["forward_ms"]])

    print()
    print("syncs per forward (no_grad) and per forward+backward (median of 3 counted calls after warm-up; "
          "sites summed over those calls):")
    print(C.table(["path", "layers", "syncs/fwd", "syncs/fwd/layer", "syncs/fwd+bwd", "fwd ms (median)"], rows))
    fit = {}
    if device.type == "cuda" and len(layers) >= 2:
        lo, hi = results[0], results[-1]
        for path in ("patched", "stock"):
            slope = (hi[path]["syncs_forward"] - lo[path]["syncs_forward"]) / (hi["layers"] - lo["layers"])
            fit[path] = {"per_layer": slope, "per_forward": lo[path]["syncs_forward"] - slope * lo["layers"]}
        print("fit over layer counts (syncs = per_forward + per_layer * layers):")
        print(C.table(["path", "per forward", "per layer"],
                      [[k, v["per_forward"], v["per_layer"]] for k, v in fit.items()]))
        for path in ("patched", "stock"):
            sites = Counter()
            for r in results:
                sites.update(r[path]["sync_sites_forward"])
            if sites:
                print(f"  {path} sync sites (forward, all layer counts): {dict(sites.most_common(6))}")
    for r in results:
        print(f"  layers {r['layers']}: stock packed vs patched max |logit diff| = "
              f"{r['stock_vs_patched_max_abs_logit_diff']:.3g}, max |logit| {r['max_abs_logit']:.3g} ({dtype}; a "
              "difference of the order of the logits would mean stock did not detect the packing)")

    # transformers' FA2-style per-layer preparation vs tfcompat's once-per-forward boundaries
    print()
    fa_rows, fa = [], {}
    steps = fa_prep_fns(pos)

    def boundaries() -> object:  # what a packed forward does once: one host copy of the text row, then the cuts
        return from_host_positions(pos.cpu(), device=pos.device)

    boundaries_ms = C.median(C.time_ms(boundaries, device, warmup * 3, reps * 5))
    n_bound, _, _ = count_steady(boundaries, device)
    fa_rows.append(["tfcompat boundaries (once per forward)", _n(n_bound), boundaries_ms * 1e3])
    if steps is None:
        print("note: transformers.modeling_flash_attention_utils.prepare_fa_kwargs_from_position_ids is missing "
              "on this transformers; FA2-style comparison skipped")
    else:
        for name, fn in steps.items():
            fn()
            n, _, _ = count_steady(fn, device)
            us = C.median(C.time_ms(fn, device, warmup * 3, reps * 5)) * 1e3
            fa[name] = {"syncs": n, "us": us}
            fa_rows.append([f"stock {name} (every layer)", _n(n), us])
    print("boundary preparation from the packed position ids:")
    print(C.table(["step", "syncs per call", "us per call (median)"], fa_rows))
    if steps is not None:
        per_layer_syncs = None
        if device.type == "cuda":
            per_layer_syncs = sum(v["syncs"] for k, v in fa.items() if not k.startswith("prepare"))
            print(f"stock FA2-style: {per_layer_syncs} syncs per layer (branch check + prepare + int(max_seqlen)); "
                  f"tfcompat: {n_bound} per forward")
        else:
            print("stock FA2-style: syncs per layer n/a on CPU")
        prep_us = fa["... + int(max_seqlen) for the kernel"]["us"]
        branch_us = fa.get("_is_packed_sequence (branch)", {"us": 0.0})["us"]
        for n_layers in layers:
            print(f"  {n_layers} layers: stock FA2-style boundary work {n_layers * (prep_us + branch_us):.1f} us per "
                  f"forward vs tfcompat {boundaries_ms * 1e3:.1f} us once")
        fa["per_layer_syncs_total"] = per_layer_syncs

    C.write_json(args.out, {
        "benchmark": "host_syncs", "smoke": smoke, "machine": info, "dtype": str(dtype), "tokens": total,
        "lengths": lengths, "model": dims, "results": results, "fit": fit,
        "from_text_positions": {"syncs": n_bound, "us": boundaries_ms * 1e3},
        "stock_fa_prep": fa if steps is not None else "prepare_fa_kwargs_from_position_ids not found",
    })


def _n(x: int | None) -> str:
    return "n/a on CPU" if x is None else str(x)


if __name__ == "__main__":
    main()
