"""Ulysses all-to-all: achieved bandwidth of tfcompat's seq_to_heads / heads_to_seq vs a raw all_to_all_single,
a layer's q, k and v in one exchange (ulysses.qkv_to_heads) vs three separate ones, and the K/V bytes each rank
sends per layer under GQA (tfcompat's kv_repeats rule vs repeating to full MHA).

Spawns ``--world`` processes (default 2) with torch.multiprocessing, init_method tcp://127.0.0.1:PORT; NCCL with
one GPU per rank (needs that many GPUs; otherwise prints SKIPPED and exits 0), gloo on CPU in --smoke.
Bandwidth per rank = bytes of the rank's input tensor / time (the "algorithm bandwidth"; of it, (sp-1)/sp
leaves the rank). The raw baseline moves a contiguous tensor of the same number of bytes. Target ratio >= 0.95.
q/k/v: the forward exchange (q, k, v as transformers hands them: (T/sp, H, D) views of (H, T/sp, D) memory; K/V
repeated sp // Hkv times first where Hkv < sp) and the backward one (three contiguous (T, H/sp, D) gradients, K/V
copies summed), fused vs three exchanges, both checked bit-exact against each other first.

    python bench/ulysses_a2a.py --out ulysses_a2a.json          # 2 GPUs
    python bench/ulysses_a2a.py --smoke                          # CPU, gloo, 2 processes
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import _common as C  # noqa: E402

TARGET = 0.95
QUEUE_CYCLES = 10_000_000  # about 5 ms of GPU sleep: time for the host to queue 8 calls of any transport
# (query heads, KV heads, sp) for the analytic K/V traffic table
GQA_CONFIGS = [(32, 8, 2), (32, 8, 4), (32, 8, 8), (28, 4, 2), (28, 4, 4), (28, 4, 8), (32, 2, 4), (32, 2, 8),
               (64, 8, 16), (32, 1, 8)]


def kv_bytes(hq: int, hkv: int, sp: int, tokens: int, d: int, elem: int) -> dict:
    """Per layer, per rank, forward: K+V bytes handed to seq_to_heads, and the part sent to other ranks."""
    from tfcompat.errors import InvalidInputError
    from tfcompat.ulysses import check_heads, kv_repeats

    try:
        check_heads(hq, hkv, sp)
        valid, why = True, ""
    except InvalidInputError as exc:
        valid, why = False, str(exc).splitlines()[0]
    rep = kv_repeats(hkv, sp)
    short = "" if valid else (f"{hq} % {sp} != 0" if hq % sp else f"{sp} and {hkv} KV heads do not divide each other")
    heads_tf = hkv * rep
    per_head = (tokens // sp) * d * elem * 2  # K and V
    out = {"hq": hq, "hkv": hkv, "sp": sp, "valid": valid, "why_invalid": why, "short_why": short, "kv_repeats": rep,
           "kv_heads_sent_tfcompat": heads_tf, "kv_heads_sent_full_mha": hq,
           "kv_input_bytes_tfcompat": per_head * heads_tf, "kv_input_bytes_full_mha": per_head * hq}
    for k in ("tfcompat", "full_mha"):
        out[f"kv_sent_bytes_{k}"] = out[f"kv_input_bytes_{k}"] * (sp - 1) // sp
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cfg: dict, outdir: str) -> None:
    code = 0
    try:
        smoke = cfg["smoke"]
        if smoke:
            torch.set_num_threads(1)
            device = torch.device("cpu")
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=120))
        else:
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            kw = {"device_id": device} if "device_id" in _init_params() else {}
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=120), **kw)
        result = _measure(rank, world, device, cfg)
        dist.barrier()
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    except BaseException:
        Path(outdir, f"rank{rank}.err").write_text(traceback.format_exc())
        code = 1
    os._exit(code)  # skip interpreter teardown (gloo/NCCL threads can abort there after a clean run)


def _init_params() -> set[str]:
    import inspect

    return set(inspect.signature(dist.init_process_group).parameters)


def _timed(fns: dict, device: torch.device, warmup: int, reps: int, queued: int = 0) -> dict[str, list[float]]:
    """Interleaved; every rep starts after a barrier so no rank's timer includes waiting for a late peer.

    ``queued=0``: a rep times one call, the host's launch work included (nothing is queued ahead of it).
    ``queued=N``: the GPU first sleeps long enough for the host to queue N back-to-back calls, and the rep times
    the GPU from the first to the last (per call): the transfer's own bandwidth, as in a forward where the
    host runs ahead of the GPU.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            dist.barrier()
            C.sync(device)
            if not queued:
                out[name].append(C._one(fn, device))
                continue
            torch.cuda._sleep(QUEUE_CYCLES)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(queued):
                fn()
            end.record()
            end.synchronize()
            out[name].append(start.elapsed_time(end) / queued)
    return out


def _measure(rank: int, world: int, device: torch.device, cfg: dict) -> dict:
    from tfcompat import ulysses
    from tfcompat.core import a2a
    from tfcompat.core.context import ForwardContext
    from tfcompat.core.packing import from_lengths
    from tfcompat.hf import attention as hf_attention

    group = dist.group.WORLD
    dtype = getattr(torch, cfg["dtype"])
    elem = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(rank)
    transports = cfg["transports"]
    bandwidth = []
    with torch.no_grad():
        for tokens, heads, d in cfg["sizes"]:
            x = torch.randn(tokens // world, heads, d, generator=gen).to(device, dtype)  # sequence shard
            y = torch.randn(tokens, heads // world, d, generator=gen).to(device, dtype)  # head shard
            raw_in = torch.randn(x.numel(), generator=gen).to(device, dtype)
            raw_out = torch.empty_like(raw_in)
            chunks = x.view(x.shape[0], world, heads // world, d).transpose(0, 1)
            packed = torch.empty_like(chunks, memory_format=torch.contiguous_format)
            fns = {"raw": lambda: dist.all_to_all_single(raw_out, raw_in, group=group)}
            for t in transports:
                fns[f"seq_to_heads {t}"] = lambda t=t: ulysses.seq_to_heads(x, group, t)
                fns[f"heads_to_seq {t}"] = lambda t=t: ulysses.heads_to_seq(y, group, t)
            # the pack copy of the all_to_all transport alone, moving 2-, 8- and 16-byte words
            for word in cfg["copy_words"]:
                w = getattr(torch, word)
                fns[f"pack copy {word}"] = lambda w=w: packed.view(w).copy_(chunks.view(w))
            for t in transports:  # the exchange must be exact, not just fast
                ref = torch.cat([c[rank] for c in _all_gather(chunks, group)], 0)
                assert torch.equal(ulysses.seq_to_heads(x, group, t), ref), t
                assert torch.equal(ulysses.heads_to_seq(ulysses.seq_to_heads(x, group, t), group, t), x), t
            nbytes = x.numel() * elem
            for queued in cfg["queued"]:
                timed = fns if not queued else {k: f for k, f in fns.items() if not k.startswith("pack copy")}
                ms = {k: C.median(v) for k, v in _timed(timed, device, cfg["warmup"], cfg["reps"], queued).items()}
                bandwidth.append({"tokens": tokens, "heads": heads, "head_dim": d, "bytes_per_rank": nbytes,
                                  "queued": queued, "ms": ms,
                                  "gbps": {k: nbytes / (v * 1e-3) / 1e9 for k, v in ms.items()}})

    qkv = [_measure_qkv(cfg_qkv, world, device, dtype, gen, group, cfg) for cfg_qkv in cfg["qkv_sizes"]]

    # GQA: what packed_attention's one q/k/v exchange delivers to each rank, per layer
    sent: list[tuple[str, tuple, int]] = []
    original = a2a.qkv_to_heads  # packed_attention calls it from tfcompat.core.a2a

    def recording(*args: object) -> tuple[torch.Tensor, ...]:
        outs = original(*args)
        sent.extend((str(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for t in outs)
        return outs

    verify = []
    tokens, d = cfg["verify_tokens"], cfg["verify_head_dim"]
    lengths = C.random_lengths(tokens, 4, seed=3, min_len=2)
    seqs = from_lengths(lengths, device=device)
    a2a.qkv_to_heads = recording
    try:
        for hq, hkv in cfg["verify_heads"]:
            sent.clear()
            q, k, v = (torch.randn(1, h, tokens // world, d, generator=gen).to(device, dtype) for h in (hq, hkv, hkv))
            ctx = ForwardContext(seqs, cfg["backend"], group)
            out, _ = hf_attention.packed_attention(torch.nn.Module(), q, k, v, None, scaling=d ** -0.5,
                                                   tfcompat_context=ctx)
            assert out.shape == (1, tokens // world, hq, d), out.shape
            expect = kv_bytes(hq, hkv, world, tokens, d, elem)
            verify.append({"hq": hq, "hkv": hkv, "sp": world, "tokens": tokens, "head_dim": d,
                           "received_shapes": {"q": sent[0][1], "k": sent[1][1], "v": sent[2][1]},
                           "kv_input_bytes_measured": sent[1][2] + sent[2][2],
                           "kv_input_bytes_expected": expect["kv_input_bytes_tfcompat"],
                           "kv_input_bytes_full_mha": expect["kv_input_bytes_full_mha"]})
    finally:
        a2a.qkv_to_heads = original
    return {"rank": rank, "bandwidth": bandwidth, "qkv": qkv, "verify": verify}


def _measure_qkv(size: list[int], world: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator,
                 group: dist.ProcessGroup, cfg: dict) -> dict:
    """One q/k/v shape: the fused exchange vs three, forward and backward, per transport (``_timed``'s modes)."""
    from tfcompat import ulysses
    from tfcompat.core import a2a

    tokens, hq, hkv, d = size
    rep = ulysses.kv_repeats(hkv, world)
    # (H, T/sp, D) memory seen as (T/sp, H, D), as transformers hands attention its q, k, v
    q, k, v = (torch.randn(h, tokens // world, d, generator=gen).to(device, dtype).transpose(0, 1)
               for h in (hq, hkv, hkv))
    grads = [torch.randn(tokens, h, d, generator=gen).to(device, dtype) for h in (hq // world, hkv * rep // world,
                                                                               hkv * rep // world)]

    def three_fwd(t: str) -> list[torch.Tensor]:  # the previous packed_attention: repeat, then one exchange each
        ks, vs = (k, v) if rep == 1 else (k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1))
        return [ulysses.seq_to_heads(x, group, t) for x in (q, ks, vs)]

    def three_bwd(t: str) -> list[torch.Tensor]:  # three exchanges, then repeat_interleave's backward (a sum)
        return list(a2a.sum_repeats([ulysses.heads_to_seq(g, group, t) for g in grads], (1, rep, rep)))

    def fused_bwd(t: str) -> tuple[torch.Tensor, ...]:  # what the fused exchange's backward runs
        return a2a.sum_repeats(a2a._run(grads, "heads_to_seq", group, t, (1, 1, 1)), (1, rep, rep))

    fns = {}
    for t in cfg["transports"]:
        fused, three = ulysses.qkv_to_heads(q, k, v, group, t), three_fwd(t)
        assert all(torch.equal(a, b) for a, b in zip(fused, three)), f"fused forward differs ({t})"
        fb, tb = fused_bwd(t), three_bwd(t)
        assert all(torch.equal(a, b) if rep <= 2 else torch.allclose(a, b) for a, b in zip(fb, tb)), t
        fns.update({f"fwd fused {t}": lambda t=t: ulysses.qkv_to_heads(q, k, v, group, t),
                    f"fwd three {t}": lambda t=t: three_fwd(t),
                    f"bwd fused {t}": lambda t=t: fused_bwd(t), f"bwd three {t}": lambda t=t: three_bwd(t)})
    nbytes = sum(x.numel() for x in (q, k, v)) * q.element_size()
    out = {"tokens": tokens, "hq": hq, "hkv": hkv, "head_dim": d, "kv_repeats": rep, "qkv_bytes_per_rank": nbytes,
           "ms": {}}
    with torch.no_grad():
        for queued in cfg["queued"]:
            ms = _timed(fns, device, cfg["warmup"], cfg["reps"], queued)
            out["ms"][str(queued)] = {name: C.median(v) for name, v in ms.items()}
    return out


def _all_gather(t: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    parts = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def main() -> None:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="processes (one GPU each): the sequence-parallel size")
    p.add_argument("--timeout", type=float, default=480.0, help="kill the workers after this many seconds")
    args = p.parse_args()
    smoke, world = args.smoke, args.world
    device = torch.device("cpu") if smoke else torch.device("cuda", 0) if torch.cuda.is_available() else None
    info = C.machine(device if device is not None else torch.device("cpu"))
    print(C.machine_line(info))
    dtype = "float32" if smoke else "bfloat16"

    # analytic K/V traffic (always printed)
    t_an, d_an = 32768, 128
    analytic = [kv_bytes(hq, hkv, sp, t_an, d_an, 2) for hq, hkv, sp in GQA_CONFIGS]
    mib = 2 ** 20
    print(f"\nK+V bytes each rank sends to other ranks per layer, forward (the backward sends as much again), "
          f"{t_an} tokens, head_dim {d_an}, bf16:")
    print(C.table(["q heads", "kv heads", "sp", "kv_repeats", "tfcompat MiB", "full-MHA MiB", "full/tfcompat", "note"],
                  [[a["hq"], a["hkv"], a["sp"], a["kv_repeats"], a["kv_sent_bytes_tfcompat"] / mib,
                    a["kv_sent_bytes_full_mha"] / mib,
                    f"{a['kv_sent_bytes_full_mha'] / a['kv_sent_bytes_tfcompat']:.1f}x",
                    "ok" if a["valid"] else "rejected by check_heads: " + a["short_why"]] for a in analytic]))

    payload = {"benchmark": "ulysses_a2a", "smoke": smoke, "machine": info, "world": world, "dtype": dtype,
               "target": TARGET, "analytic_kv": analytic}
    if not smoke and (not torch.cuda.is_available() or torch.cuda.device_count() < world):
        reason = f"needs {world} CUDA GPUs, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}"
        print(f"\nSKIPPED measurement: {reason}")
        payload["skipped"] = reason
        C.write_json(args.out, payload)
        return

    cfg = {
        "smoke": smoke, "dtype": dtype, "backend": "sdpa" if smoke else "auto",
        "warmup": args.warmup if args.warmup is not None else (2 if smoke else 10),
        "reps": args.reps if args.reps is not None else (5 if smoke else 50),
        "sizes": ([(64, 4, 8), (64, 2, 8)] if smoke else
                  [(32768, 32, 128), (32768, 8, 128), (8192, 32, 128), (131072, 8, 128), (131072, 32, 128)]),
        "verify_tokens": 64 if smoke else 4096, "verify_head_dim": 8 if smoke else 128,
        # (q, kv): kv divisible by sp (no repeat), and kv < sp (repeated sp // kv times)
        "verify_heads": [(4, 2), (4, 1)] if smoke else [(32, 8), (32, 1)],
        "transports": ["all_to_all"] if smoke else ["all_to_all", "symm_mem"],
        "queued": [0] if smoke else [0, 8],
        "copy_words": ["float32", "int64", "complex128"] if smoke else ["bfloat16", "int64", "complex128"],
        # (global tokens, q heads, KV heads, head_dim): GQA with Hkv >= sp and with Hkv < sp (K/V repeated)
        "qkv_sizes": ([(64, 4, 2, 8), (64, 4, 1, 8)] if smoke else
                      [(8192, 32, 8, 128), (32768, 32, 8, 128), (32768, 28, 4, 128), (131072, 32, 8, 128),
                       (32768, 32, 1, 128)]),
    }
    cfg["verify_heads"] = [(hq, hkv) for hq, hkv in cfg["verify_heads"] if hq % world == 0
                           and (hkv % world == 0 or world % hkv == 0)]
    cfg["qkv_sizes"] = [(t, hq, hkv, d) for t, hq, hkv, d in cfg["qkv_sizes"] if hq % world == 0
                        and (hkv % world == 0 or world % hkv == 0)]
    with tempfile.TemporaryDirectory() as outdir:
        _spawn(world, cfg, outdir, args.timeout)
        ranks = [json.loads(Path(outdir, f"rank{r}.json").read_text()) for r in range(world)]

    bw_out = []
    for i, b0 in enumerate(ranks[0]["bandwidth"]):
        per_rank = [r["bandwidth"][i] for r in ranks]
        gbps = {k: min(r["gbps"][k] for r in per_rank) for k in b0["gbps"]}  # the slowest rank
        ms = {k: max(r["ms"][k] for r in per_rank) for k in b0["ms"]}
        ratios = {f"{way} {t}": gbps[f"{way} {t}"] / gbps["raw"] for t in cfg["transports"]
                  for way in ("seq_to_heads", "heads_to_seq")}
        bw_out.append({**{k: b0[k] for k in ("tokens", "heads", "head_dim", "bytes_per_rank", "queued")},
                       "ms_slowest_rank": ms,
                       "gbps_slowest_rank": gbps, "per_rank": per_rank, "ratio_to_raw": ratios})
    backend = "gloo (CPU)" if smoke else "NCCL"
    print(f"\nall-to-all bandwidth per rank, sp={world}, {dtype}, GB/s = rank input bytes / time (slowest rank; median "
          f"of {cfg['reps']} reps after {cfg['warmup']} warm-up, interleaved, barrier before each); raw = "
          f"all_to_all_single over {backend} of a contiguous tensor of the same bytes:")
    for queued in cfg["queued"]:
        rows = [e for e in bw_out if e["queued"] == queued]
        for t in cfg["transports"]:
            print(f"transport {t!r}, " + ("one call per timing, the host's launch work included" if not queued else
                                          f"GPU time of {queued} calls queued ahead (the transfer's own bandwidth)"))
            print(C.table(["tokens x heads x dim (global)", "MiB/rank", "raw GB/s", "seq_to_heads GB/s",
                           "heads_to_seq GB/s", "s2h/raw", "h2s/raw", f">= {TARGET}"],
                          [[f"{e['tokens']}x{e['heads']}x{e['head_dim']}", e["bytes_per_rank"] / mib,
                            e["gbps_slowest_rank"]["raw"], e["gbps_slowest_rank"][f"seq_to_heads {t}"],
                            e["gbps_slowest_rank"][f"heads_to_seq {t}"], e["ratio_to_raw"][f"seq_to_heads {t}"],
                            e["ratio_to_raw"][f"heads_to_seq {t}"],
                            "yes" if min(e["ratio_to_raw"][f"{w} {t}"] for w in ("seq_to_heads", "heads_to_seq"))
                            >= TARGET else "NO"] for e in rows]))
    bw_out1 = [e for e in bw_out if not e["queued"]]
    names = [k for k in bw_out1[0]["ms_slowest_rank"] if k != "raw"]
    print("time per call, ms (slowest rank, one call per timing); 'pack copy W' is the all_to_all transport's "
          "layout copy alone, moving words of type W:")
    print(C.table(["tokens x heads x dim (global)", "raw a2a", *names],
                  [[f"{e['tokens']}x{e['heads']}x{e['head_dim']}", e["ms_slowest_rank"]["raw"],
                    *(e["ms_slowest_rank"][k] for k in names)] for e in bw_out1]))

    qkv_out = _qkv_report(ranks, cfg, world, dtype)

    print(f"\nmeasured: K+V bytes packed_attention's q/k/v exchange delivers, per layer per rank (sp={world}):")
    vrows = []
    for v in ranks[0]["verify"]:
        ok = v["kv_input_bytes_measured"] == v["kv_input_bytes_expected"]
        v["matches_analytic"] = ok
        vrows.append([v["hq"], v["hkv"], v["sp"], v["tokens"], str(v["received_shapes"]["k"]),
                      v["kv_input_bytes_measured"], v["kv_input_bytes_expected"], v["kv_input_bytes_full_mha"],
                      "yes" if ok else "NO"])
    print(C.table(["q heads", "kv heads", "sp", "tokens", "k shape received", "measured B", "analytic B",
                   "full-MHA B", "match"], vrows))
    payload.update(bandwidth=bw_out, qkv=qkv_out, verify=ranks[0]["verify"], config=cfg)
    C.write_json(args.out, payload)
    if not all(v["matches_analytic"] for v in ranks[0]["verify"]):
        raise SystemExit("measured K/V bytes differ from the analytic rule")


def _qkv_report(ranks: list[dict], cfg: dict, world: int, dtype: str) -> list[dict]:
    """Print and return the fused vs three-exchange q/k/v times (slowest rank)."""
    out = []
    for i, e in enumerate(ranks[0]["qkv"]):
        ms = {queued: {k: max(r["qkv"][i]["ms"][queued][k] for r in ranks) for k in e["ms"][queued]}
              for queued in e["ms"]}
        out.append({**{k: e[k] for k in ("tokens", "hq", "hkv", "head_dim", "kv_repeats", "qkv_bytes_per_rank")},
                    "ms_slowest_rank": ms, "per_rank": [r["qkv"][i] for r in ranks]})
    print(f"\nq, k, v of one layer in one exchange (fused) vs three, sp={world}, {dtype}, ms (slowest rank, median); "
          f"fwd: seq_to_heads of strided q/k/v (K/V repeat_interleave first in 'three' where kv_repeats > 1); "
          f"bwd: heads_to_seq of the three gradients, K/V copies summed; three/fused > 1: fused is faster")
    for queued in cfg["queued"]:
        for t in cfg["transports"]:
            print(f"transport {t!r}, " + ("one call per timing, the host's launch work included" if not queued else
                                          f"GPU time of {queued} calls queued ahead"))
            rows = []
            for e in out:
                ms = e["ms_slowest_rank"][str(queued)]
                rows.append([f"{e['tokens']}x{e['hq']}/{e['hkv']}x{e['head_dim']}", e["kv_repeats"],
                             e["qkv_bytes_per_rank"] / 2 ** 20,
                             *(ms[f"{way} {kind} {t}"] for way in ("fwd", "bwd") for kind in ("three", "fused")),
                             *(ms[f"{way} three {t}"] / ms[f"{way} fused {t}"] for way in ("fwd", "bwd"))])
            print(C.table(["tokens x q/kv heads x dim", "kv_repeats", "q+k+v MiB/rank", "fwd three", "fwd fused",
                           "bwd three", "bwd fused", "fwd three/fused", "bwd three/fused"], rows))
    return out


def _spawn(world: int, cfg: dict, outdir: str, timeout: float) -> None:
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cfg, outdir), daemon=True) for r in range(world)]
    for pr in procs:
        pr.start()
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    for pr in procs:
        pr.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
    hung = [pr for pr in procs if pr.is_alive()]
    for pr in hung:
        pr.kill()
        pr.join(5)
    errors = [Path(outdir, f"rank{r}.err").read_text() for r in range(world) if Path(outdir, f"rank{r}.err").exists()]
    if hung or errors or any(pr.exitcode for pr in procs):
        raise SystemExit(f"{len(hung)} worker(s) hung past {timeout} s; exit codes {[pr.exitcode for pr in procs]}\n"
                         + "\n".join(errors))


if __name__ == "__main__":
    main()
