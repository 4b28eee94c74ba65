"""Second exploration for backend "torch" (issue 11, item 2): the rewritten tile arithmetic of tfcompat.heads
(float32 copy of the logits, then vectorized or per-row float32 ops, exp fused into products) against the
reference and the code before it, plus its variants, and the bandwidth of each elementwise op on one tile.

Full-step variants (fwd + bwd, bf16, V = 152064, H = 3584, temperature 0.7, 10% ignored labels):
- ``logits``: the reference; ``old``: backend "torch" before this work (``heads_before.py``, made with
  ``git show 6e0affd~1:tfcompat/heads.py > heads_before.py``);
- ``new``: backend "torch" as it stood at this run (an intermediate of commit 6e0affd: forward
  ``logits.float().div_(temperature)`` with a float temperature passed through, backward ``logits.float()`` then
  an in-place addcdiv; the op table showed both slower than reading the bf16 logits in the first op, which 6e0affd
  does); ``new-expmul``: its backward with exp_ then a float32 x float32 -> bf16 product instead of `_times_exp` +
  copy; ``new-elu16``: `_times_exp` written straight into the bf16 logits (it computes in bf16: rejected);
- ``new-c512`` / ``new-c2048``: chunk_size 512 / 2048; ``new-tensor-temp``: a per-token temperature tensor.

    python bench/results/2026-12-01-h200-torch-head/explore2.py --out $OUT/explore2.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from tfcompat import heads  # noqa: E402
from tfcompat.heads import IGNORE_INDEX  # noqa: E402

VOCAB, HIDDEN, TAU = 152064, 3584, 0.7


def load_before():
    spec = importlib.util.spec_from_file_location("tfcompat._heads_before", HERE / "heads_before.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grad_expmul(logits, stats, labels, first_column):
    z = logits.float()
    logp = torch.addcdiv(stats.neg_lse, z, stats.temperature, out=z)
    factor = torch.addcmul(stats.neg_shift, logp, stats.neg_entropy_coef)
    grad = torch.mul(logp.exp_(), factor, out=logits)
    return finish(grad, stats, labels, first_column)


def grad_elu16(logits, stats, labels, first_column):
    z = logits.float()
    logp = torch.addcdiv(stats.neg_lse, z, stats.temperature, out=z)
    factor = torch.addcmul(stats.neg_shift, logp, stats.neg_entropy_coef)
    grad = heads._times_exp(factor, logp, out=logits)
    return finish(grad, stats, labels, first_column)


def finish(grad, stats, labels, first_column):
    columns = labels - first_column
    in_tile = ((columns >= 0) & (columns < grad.shape[1])).unsqueeze(1)
    onehot = (stats.label_coef * in_tile).to(grad.dtype)
    return grad.scatter_add_(1, columns.clamp(0, grad.shape[1] - 1).unsqueeze(1), onehot)


@contextlib.contextmanager
def patched(name, value):
    saved = getattr(heads, name)
    setattr(heads, name, value)
    try:
        yield
    finally:
        setattr(heads, name, saved)


def make_variants(before):
    def lib(module, backend, chunk=None, tensor_temp=False, patch=None):
        def run(x):
            hidden, weight, labels, a, b, temps = x
            ctx = patched(*patch) if patch else contextlib.nullcontext()
            with ctx:
                out = module.logprobs_entropy(hidden, weight, labels, temps if tensor_temp else TAU, backend=backend,
                                              chunk_size=chunk)
                ((a * out.logprobs).sum() + (b * out.entropy).sum()).backward()
            return out.logprobs.detach(), out.entropy.detach()

        return run

    return {
        "logits": lib(heads, "logits"),
        "old": lib(before, "torch"),
        "new": lib(heads, "torch"),
        "new-expmul": lib(heads, "torch", patch=("_torch_grad_logits", grad_expmul)),
        "new-elu16": lib(heads, "torch", patch=("_torch_grad_logits", grad_elu16)),
        "new-c512": lib(heads, "torch", chunk=512),
        "new-c2048": lib(heads, "torch", chunk=2048),
        "new-tensor-temp": lib(heads, "torch", tensor_temp=True),
        "old-tensor-temp": lib(before, "torch", tensor_temp=True),
    }


def step(fn, x):
    x[0].grad = x[1].grad = None
    return fn(x)


def event_ms(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    return start.elapsed_time(end), host


def measure(tokens, weight, variants, reps, device):
    gen = torch.Generator(device).manual_seed(tokens)
    hidden = torch.randn(tokens, HIDDEN, generator=gen, device=device).bfloat16().requires_grad_()
    labels = torch.randint(0, VOCAB, (tokens,), generator=gen, device=device)
    labels[torch.rand(tokens, generator=gen, device=device) < 0.1] = IGNORE_INDEX
    a, b = torch.randn(2, tokens, generator=gen, device=device)
    x = (hidden, weight, labels, a, b, torch.full((tokens,), TAU, device=device))
    keep = labels != IGNORE_INDEX
    ref_lp, ref_ent = step(variants["logits"], x)
    ref_gh, ref_gw = hidden.grad.float(), weight.grad.float()
    out = {}
    for name, fn in variants.items():
        lp, ent = step(fn, x)
        out[name] = dict(
            logprob_err=(lp - ref_lp)[keep].abs().max().item(),
            entropy_err=(ent - ref_ent)[keep].abs().max().item(),
            grad_hidden_rel=((hidden.grad.float() - ref_gh).abs().max() / ref_gh.abs().max()).item(),
            grad_weight_rel=((weight.grad.float() - ref_gw).abs().max() / ref_gw.abs().max()).item(),
        )
    del ref_gh, ref_gw
    for fn in variants.values():
        step(fn, x)
    times = {name: [] for name in variants}
    hosts = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            ms, host = event_ms(lambda: step(fn, x))
            times[name].append(ms)
            hosts[name].append(host)
    for name in variants:
        out[name].update(ms=statistics.median(times[name]), times=times[name], host_ms=statistics.median(hosts[name]))
    hidden.grad = weight.grad = None
    return out, x


def op_bandwidth(device):
    """GB/s of each elementwise op of the tile arithmetic on a (1024, V) and a (20205, 7680) bf16 tile."""
    found = {}
    for rows, cols in ((1024, VOCAB), (20205, 7680)):
        gen = torch.Generator(device).manual_seed(0)
        logits = torch.randn(rows, cols, generator=gen, device=device).bfloat16()
        col = torch.full((rows, 1), TAU, device=device)
        neg = -torch.rand(rows, 1, generator=gen, device=device) - 12
        z = logits.float()
        lp = torch.log_softmax(z / TAU, -1)
        y = torch.empty_like(z)
        n = rows * cols
        ops = {
            "float() copy [6 B]": (lambda: logits.float(), 6),
            "float().div_(0.7) [6+8 B]": (lambda: logits.float().div_(TAU), 14),
            "bf16 / (R,1) column -> f32 [6 B]": (lambda: logits / col, 6),
            "f32.div_(0.7) [8 B]": (lambda: z.div_(TAU), 8),
            "f32.div_((R,1)) [8 B]": (lambda: z.div_(col), 8),
            "log_softmax f32 [~16 B]": (lambda: torch.log_softmax(z, -1), 16),
            "argmax bf16 [2 B]": (lambda: logits.argmax(-1, keepdim=True), 2),
            "max f32 with index [4 B]": (lambda: lp.max(-1, keepdim=True), 4),
            "sum f32 [4 B]": (lambda: lp.sum(-1), 4),
            "times_exp(lp, lp) -> f32 [8 B]": (lambda: heads._times_exp(lp, lp, out=y), 8),
            "exp f32 -> new [8 B]": (lambda: torch.exp(lp), 8),
            "mul f32 f32 -> new [12 B]": (lambda: lp * z, 12),
            "addcdiv((R,1), f32, (R,1)) in place [8 B]": (lambda: torch.addcdiv(neg, y, col, out=y), 8),
            "addcdiv((R,1), bf16, (R,1)) -> f32 [6 B]": (lambda: torch.addcdiv(neg, logits, col), 6),
            "addcmul((R,1), f32, (R,1)) -> new [8 B]": (lambda: torch.addcmul(neg, lp, col), 8),
            "times_exp(y, lp) in place [12 B]": (lambda: heads._times_exp(y, lp, out=y), 12),
            "bf16.copy_(f32) [6 B]": (lambda: logits.copy_(z), 6),
            "mul(f32, f32, out=bf16) [10 B]": (lambda: torch.mul(lp, z, out=logits), 10),
            "times_exp(f32, f32, out=bf16) [10 B]": (lambda: heads._times_exp(z, lp, out=logits), 10),
        }
        table = {}
        for name, (fn, nbytes) in ops.items():
            fn()
            torch.cuda.synchronize()
            ts = [event_ms(fn)[0] for _ in range(5)]
            ms = statistics.median(ts)
            table[name] = dict(ms=round(ms, 3), gb_s=round(n * nbytes / ms / 1e6, 1))
        found[f"{rows}x{cols}"] = table
        ops.clear()  # frees the tile's tensors before the next shape
        torch.cuda.empty_cache()
    # does times_exp into a bf16 output compute in float32? compare with the float32 product rounded once
    x = -torch.rand(4096, 4096, device=device) * 30
    f = torch.randn(4096, 4096, device=device)
    direct = heads._times_exp(f, x, out=torch.empty(4096, 4096, device=device, dtype=torch.bfloat16))
    once = (f * x.exp()).bfloat16()
    found["times_exp_bf16_out_mismatches"] = int((direct != once).sum().item())
    return found


def profile(x, variants, names):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    found = {}
    for name in names:
        step(variants[name], x)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(variants[name], x)
            torch.cuda.synchronize()
        rows = [dict(kernel=e.key[:110], ms=round(e.device_time_total / 1e3, 3), calls=e.count)
                for e in prof.key_averages() if e.device_time_total > 0]
        rows.sort(key=lambda r: -r["ms"])
        found[name] = rows[:18]
    return found


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[8191, 8192, 20205, 32768])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile-tokens", type=int, default=20205)
    p.add_argument("--out")
    args = p.parse_args()
    device = torch.device("cuda")
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    report = dict(torch=torch.__version__, results={})
    report["ops"] = op_bandwidth(device)
    for shape, table in report["ops"].items():
        print(shape, json.dumps(table, indent=0) if isinstance(table, dict) else table, flush=True)
    variants = make_variants(load_before())
    weight = (torch.randn(VOCAB, HIDDEN, device=device) / HIDDEN**0.5).bfloat16().requires_grad_()
    t_start = time.time()
    for tokens in args.tokens:
        res, x = measure(tokens, weight, variants, args.reps, device)
        report["results"][tokens] = res
        ref = res["logits"]["ms"]
        print(f"T={tokens} ({time.time() - t_start:.0f}s)", flush=True)
        for name, r in res.items():
            print(f"  {name:16s} {r['ms']:8.1f} ms  x{r['ms'] / ref:.3f}  host {r['host_ms']:6.1f} ms  "
                  f"lp {r['logprob_err']:.1e} ent {r['entropy_err']:.1e} gh {r['grad_hidden_rel']:.1e} "
                  f"gw {r['grad_weight_rel']:.1e}", flush=True)
        if tokens == args.profile_tokens:
            report["profile"] = profile(x, variants, ["old", "new"])
        del x
        torch.cuda.empty_cache()
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
