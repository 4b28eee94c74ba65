"""Exploration for backend "torch" of tfcompat.heads (issue 11, item 2): which float32 arithmetic per tile, and
which elementwise block size, makes the chunked head no slower than the reference at every token count.

Variants (one autograd Function, `Candidate`, configured per variant), against backend "logits" and the
committed backend "torch" ("old"):

- forward per row block: m = max of the bf16 logits / tau, x = z - m (addcdiv, from the bf16 logits), e = exp(x),
  S = sum e, Q = sum x e (``mul`` then sum, or ``elu``: aten.elu_backward(x, x) = x exp(x) for x <= 0, then sum);
  lse = m + log S, logprob = x[label] - log S, entropy = log S - Q / S;
- backward per row block of a tile: x = z - lse (addcdiv), y = the per-row affine factor (``y=logits``: addcmul
  from the bf16 logits; ``y=logp``: addcmul from x), grad = exp(x) * y (``mul``: exp_ then mul into the bf16
  logits; ``elu``: elu_backward(y, x) into the bf16 logits);
- ``block``: elements of one elementwise block (0: the whole tile), float32 scratch reused across blocks, so
  that a block's intermediates can stay in L2; ``chunk``: the matmul tile, chunk * V logits.

    python bench/results/2026-12-01-h200-torch-head/explore.py --out $OUT/explore.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tfcompat import heads  # noqa: E402
from tfcompat.heads import IGNORE_INDEX, _accumulate_mm, _aligned, _spans  # noqa: E402

VOCAB, HIDDEN, TAU = 152064, 3584, 0.7
ELU = torch.ops.aten.elu_backward.grad_input


def forward_stats(logits, labels, tau, cfg, scratch):
    """logits (R, V); labels (R,) clamped; tau (R, 1). Returns lse (R, 1), logprob (R,), entropy (R,)."""
    rows, vocab = logits.shape
    m = logits.amax(1, keepdim=True).float().div_(tau)  # (R, 1) max of z
    neg_m = m.neg()
    s = logits.new_empty((rows, 1), dtype=torch.float32)
    q = torch.empty_like(s)
    lab = torch.empty_like(s)
    per_block = max(1, scratch[0].numel() // vocab)
    for sub in _spans(rows, per_block):
        r = sub.stop - sub.start
        x = torch.addcdiv(neg_m[sub], logits[sub], tau[sub], out=scratch[0][: r * vocab].view(r, vocab))
        torch.gather(x, 1, labels[sub].unsqueeze(1), out=lab[sub])
        e = torch.exp(x, out=scratch[1][: r * vocab].view(r, vocab))
        torch.sum(e, 1, keepdim=True, out=s[sub])
        if cfg["fwd_q"] == "elu":
            xe = ELU(x, 1.0, 1.0, 1.0, False, x, grad_input=e)
        else:
            xe = e.mul_(x)
        torch.sum(xe, 1, keepdim=True, out=q[sub])
    log_s = s.log()
    return m + log_s, (lab - log_s).squeeze(1), (log_s - q / s).squeeze(1)


def grad_logits(logits, coefs, labels, first_column, cfg, scratch):
    """Write the gradient over logits (R, C) (columns first_column..), bf16; coefs: dict of (R, 1) columns."""
    rows, cols = logits.shape
    per_block = max(1, scratch[0].numel() // cols)
    for sub in _spans(rows, per_block):
        r = sub.stop - sub.start
        tile = logits[sub]
        x = torch.addcdiv(coefs["neg_lse"][sub], tile, coefs["tau"][sub], out=scratch[0][: r * cols].view(r, cols))
        yb = scratch[1][: r * cols].view(r, cols)
        if cfg["y"] == "logits":
            y = torch.addcmul(coefs["c0"][sub], tile, coefs["c1"][sub], out=yb)
        else:
            y = torch.addcmul(coefs["neg_shift"][sub], x, coefs["neg_ec"][sub], out=yb)
        if cfg["prod"] == "elu":
            ELU(y, 1.0, 1.0, 1.0, False, x, grad_input=tile)
        else:
            torch.mul(x.exp_(), y, out=tile)
    columns = labels - first_column
    in_tile = ((columns >= 0) & (columns < cols)).unsqueeze(1)
    onehot = (coefs["label_coef"] * in_tile).to(logits.dtype)
    return logits.scatter_add_(1, columns.clamp(0, cols - 1).unsqueeze(1), onehot)


def make_scratch(elements, device):
    return [torch.empty(elements, dtype=torch.float32, device=device) for _ in range(2)]


class Candidate(torch.autograd.Function):
    cfg: dict = {}

    @staticmethod
    def forward(ctx, hidden, weight, labels, tau):
        cfg = Candidate.cfg
        tokens, vocab = hidden.shape[0], weight.shape[0]
        rows = _aligned(cfg["chunk"], tokens)
        block = rows * vocab if not cfg["block"] else max(1, cfg["block"] // vocab) * vocab
        scratch = make_scratch(min(block, rows * vocab), hidden.device)  # whole rows
        lse = hidden.new_empty((tokens, 1), dtype=torch.float32)
        logprobs = hidden.new_empty(tokens, dtype=torch.float32)
        entropy = torch.empty_like(logprobs)
        label_columns = labels.clamp(min=0)
        for sub in _spans(tokens, rows):
            logits = F.linear(hidden[sub], weight)
            lse[sub], logprobs[sub], entropy[sub] = forward_stats(logits, label_columns[sub], tau[sub], cfg, scratch)
            del logits
        del scratch
        ctx.save_for_backward(hidden, weight, labels, tau, lse, entropy.unsqueeze(1))
        valid = labels != IGNORE_INDEX
        return torch.where(valid, logprobs, 0.0), torch.where(valid, entropy, 0.0)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        cfg = Candidate.cfg
        hidden, weight, labels, tau, lse, entropy = ctx.saved_tensors
        valid = (labels != IGNORE_INDEX).unsqueeze(1)
        label_coef = grad_logprobs.unsqueeze(1) * valid / tau
        entropy_coef = grad_entropy.unsqueeze(1) * valid / tau
        shift = entropy_coef * entropy + label_coef
        coefs = dict(tau=tau, neg_lse=lse.neg(), label_coef=label_coef, neg_ec=entropy_coef.neg(),
                     neg_shift=shift.neg(), c1=entropy_coef.neg() / tau, c0=entropy_coef * lse - shift)
        tokens, vocab = hidden.shape[0], weight.shape[0]
        assert tokens < vocab
        grad_hidden = hidden.new_zeros(hidden.shape, dtype=torch.float32)
        grad_weight = torch.empty_like(weight)
        cols = _aligned(-(-cfg["chunk"] * vocab // tokens), vocab)
        block = tokens * cols if not cfg["block"] else max(cols, cfg["block"])
        scratch = make_scratch(min(block, tokens * cols), hidden.device)  # at least one row of a tile
        for columns in _spans(vocab, cols):
            logits = F.linear(hidden, weight[columns])
            grad = grad_logits(logits, coefs, labels, columns.start, cfg, scratch)
            torch.mm(grad.T, hidden, out=grad_weight[columns])
            _accumulate_mm(grad_hidden, grad, weight[columns])
            del logits, grad
        return grad_hidden.to(hidden.dtype), grad_weight, None, None


def candidate_head(cfg):
    def head(hidden, weight, labels, tau_column):
        Candidate.cfg = cfg
        return Candidate.apply(hidden, weight, labels, tau_column)

    return head


def library_head(backend):
    def head(hidden, weight, labels, tau_column):
        out = heads.logprobs_entropy(hidden, weight, labels, TAU, backend=backend)
        return out.logprobs, out.entropy

    return head


VARIANTS = {
    "logits": library_head("logits"),
    "old": library_head("torch"),
    "big": candidate_head(dict(chunk=1024, block=0, fwd_q="mul", y="logits", prod="mul")),
    "b4M": candidate_head(dict(chunk=1024, block=4 << 20, fwd_q="mul", y="logits", prod="mul")),
    "b2M": candidate_head(dict(chunk=1024, block=2 << 20, fwd_q="mul", y="logits", prod="mul")),
    "b512K": candidate_head(dict(chunk=1024, block=1 << 19, fwd_q="mul", y="logits", prod="mul")),
    "b1M": candidate_head(dict(chunk=1024, block=1 << 20, fwd_q="mul", y="logits", prod="mul")),
    "b8M": candidate_head(dict(chunk=1024, block=8 << 20, fwd_q="mul", y="logits", prod="mul")),
    "b2M-elu-fwd": candidate_head(dict(chunk=1024, block=2 << 20, fwd_q="elu", y="logits", prod="mul")),
    "b2M-y-logp": candidate_head(dict(chunk=1024, block=2 << 20, fwd_q="mul", y="logp", prod="mul")),
    "b2M-elu-prod": candidate_head(dict(chunk=1024, block=2 << 20, fwd_q="mul", y="logits", prod="elu")),
    "b2M-c2048": candidate_head(dict(chunk=2048, block=2 << 20, fwd_q="mul", y="logits", prod="mul")),
    "big-c512": candidate_head(dict(chunk=512, block=0, fwd_q="mul", y="logits", prod="mul")),
}


def step(head, x):
    hidden, weight, labels, tau_column, a, b = x
    hidden.grad = weight.grad = None
    lp, ent = head(hidden, weight, labels, tau_column)
    ((a * lp).sum() + (b * ent).sum()).backward()
    return lp.detach(), ent.detach()


def event_ms(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    return start.elapsed_time(end), host


def measure(tokens, weight, names, reps, device):
    gen = torch.Generator(device).manual_seed(tokens)
    hidden = torch.randn(tokens, HIDDEN, generator=gen, device=device).bfloat16().requires_grad_()
    labels = torch.randint(0, VOCAB, (tokens,), generator=gen, device=device)
    labels[torch.rand(tokens, generator=gen, device=device) < 0.1] = IGNORE_INDEX
    a, b = torch.randn(2, tokens, generator=gen, device=device)
    tau_column = torch.full((tokens, 1), TAU, device=device)
    x = (hidden, weight, labels, tau_column, a, b)
    keep = labels != IGNORE_INDEX
    ref_lp, ref_ent = step(VARIANTS["logits"], x)
    ref_gh, ref_gw = hidden.grad.float(), weight.grad.float()
    out = {}
    for name in names:
        lp, ent = step(VARIANTS[name], x)
        out[name] = dict(
            logprob_err=(lp - ref_lp)[keep].abs().max().item(),
            entropy_err=(ent - ref_ent)[keep].abs().max().item(),
            grad_hidden_rel=((hidden.grad.float() - ref_gh).abs().max() / ref_gh.abs().max()).item(),
            grad_weight_rel=((weight.grad.float() - ref_gw).abs().max() / ref_gw.abs().max()).item(),
        )
    del ref_gh, ref_gw
    for name in names:  # warm-up
        step(VARIANTS[name], x)
    times = {name: [] for name in names}
    hosts = {name: [] for name in names}
    for _ in range(reps):
        for name in names:
            ms, host = event_ms(lambda: step(VARIANTS[name], x))
            times[name].append(ms)
            hosts[name].append(host)
    for name in names:
        out[name].update(ms=statistics.median(times[name]), times=times[name],
                         host_ms=statistics.median(hosts[name]))
    hidden.grad = weight.grad = None
    return out, x


def profile(x, names):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    found = {}
    for name in names:
        step(VARIANTS[name], x)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(VARIANTS[name], x)
            torch.cuda.synchronize()
        rows = [dict(kernel=e.key[:110], ms=round(e.device_time_total / 1e3, 3), calls=e.count)
                for e in prof.key_averages() if e.device_time_total > 0]
        rows.sort(key=lambda r: -r["ms"])
        found[name] = rows[:16]
    return found


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[8191, 8192, 20205, 32768])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", nargs="*", default=["logits", "old", "big", "b2M"])
    p.add_argument("--profile-tokens", type=int, default=20205)
    p.add_argument("--out")
    args = p.parse_args()
    device = torch.device("cuda")
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    weight = (torch.randn(VOCAB, HIDDEN, device=device) / HIDDEN**0.5).bfloat16().requires_grad_()
    names = [n for n in args.variants if n != "logits"]
    report = dict(torch=torch.__version__, results={})
    t_start = time.time()
    for tokens in args.tokens:
        res, x = measure(tokens, weight, ["logits", *names], args.reps, device)
        report["results"][tokens] = res
        ref = res["logits"]["ms"]
        print(f"T={tokens} ({time.time() - t_start:.0f}s)", flush=True)
        for name, r in res.items():
            print(f"  {name:14s} {r['ms']:8.1f} ms  x{r['ms'] / ref:.3f}  host {r['host_ms']:6.1f} ms  "
                  f"lp {r['logprob_err']:.1e} ent {r['entropy_err']:.1e} gh {r['grad_hidden_rel']:.1e} "
                  f"gw {r['grad_weight_rel']:.1e}", flush=True)
        if tokens == args.profile_tokens and args.profile:
            report["profile"] = profile(x, args.profile)
            for name, rows in report["profile"].items():
                print(f"  profile {name}:", flush=True)
                for row in rows:
                    print(f"    {row['ms']:8.2f} ms x{row['calls']:4d} {row['kernel']}", flush=True)
        del x
        torch.cuda.empty_cache()
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
