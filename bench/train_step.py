"""One optimizer-free PPO training step of a Qwen2.5-7B-shaped text stack: tfcompat packed against stock paths.

The model is built from config with random weights (Qwen2Config: hidden 3584, 28 query / 4 KV heads,
intermediate 18944, vocab 152064, untied lm head, 28 layers; ``--layers N`` for fewer), bf16 on CUDA, train
mode, gradient checkpointing (non-reentrant; ``--no-checkpointing`` to turn it off). The batch: ``--seqs``
sequences with seeded lengths drawn uniformly from ``[--min-len, --max-len]`` (default 8 of 512-4096; with
``--long`` 4 of 8192-32768 and 4 layers). One step = zero the gradients, forward of the decoder stack to the
last hidden states of the real tokens ``(T, 3584)``, the PPO head (`tfcompat.heads.logprobs_entropy`, the
same backend for every variant, ``--head``), the loss ``-(logprobs * advantage).mean() - 0.01 * entropy.mean()``
(fixed random advantages) and backward. Variants, in the same run on the same weights and tokens:

  tfcompat       ``tfcompat.patch(model, backend=B)``; input_ids ``(1, T)``, position ids restarting at 0 per
                 sequence (``--tfcompat-backends auto,torch,...``: one variant per attention backend)
  padded         stock, attn "sdpa": input_ids ``(S, max_len)`` right-padded with an attention mask; the head
                 sees the real tokens only (``hidden[mask]``), so padding costs only the decoder
  sdpa_packed    stock, attn "sdpa", the packed row with restarting position ids, ``use_cache=False``
                 (transformers detects the packing and builds a ``(T, T)`` mask)
  flex_packed    stock, attn "flex_attention", the packed row, ``use_cache=False`` (transformers builds a
                 document block mask with ``create_block_mask`` and runs compiled flex attention)

Reported per variant: ms per step (median of ``--reps`` after ``--warmup``, CUDA events), real tokens/s, peak
memory, loss (a check: the variants agree to bf16 rounding), speed-up over padded, and model FLOPs utilization
against ``--peak-tflops`` (989, the H200's dense bf16 peak):

    model FLOPs per step = 6 * P * T  +  sum over sequences of 6 * n_layers * Hq * head_dim * L_i**2

where P counts the matmul weights (every nn.Linear of the decoder and the lm head: not the embedding table,
norms or biases), T the real tokens, and the second term is causal attention (QK^T and PV, ``2 * L**2 *
Hq * head_dim`` each per layer, halved by causality, times 3 for forward + backward). Gradient checkpointing's
recomputed forward is not counted (model FLOPs, not hardware FLOPs), nor is padding.

``--profile [VARIANTS]`` adds one profiled step per variant, or per listed variant (torch.profiler, CUDA kernel
time), split into attention (kernels under the attention function, found by wrapping transformers' attention
interface entries, and attention backward ops), matmuls (GEMM kernels outside the head), the PPO head (every
kernel of its forward and backward) and elementwise / other, with each variant's top kernels.

    python bench/train_step.py --out train_step.json                    # 28 layers, 8 x 512-4096 tokens
    python bench/train_step.py --long --out train_step_long.json        # 4 layers, 4 x 8k-32k tokens
    python bench/train_step.py --smoke                                  # CPU, tiny Qwen2, fp32
"""

from __future__ import annotations

import contextlib
import gc
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _common as C  # noqa: E402
import tfcompat  # noqa: E402
from tfcompat import heads  # noqa: E402
from tfcompat.core.attention import select_backend  # noqa: E402
from tfcompat.core.packing import from_lengths  # noqa: E402
from tfcompat.heads import IGNORE_INDEX, logprobs_entropy  # noqa: E402

QWEN25_7B = dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                 vocab_size=152064, num_hidden_layers=28, tie_word_embeddings=False, rms_norm_eps=1e-6,
                 rope_theta=1e6, attention_dropout=0.0, use_sliding_window=False)
SMOKE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=256,
             num_hidden_layers=2, tie_word_embeddings=False, attention_dropout=0.0, use_sliding_window=False)
TEMPERATURE = 0.7
ENTROPY_COEF = 0.01


def build_model(dims: dict[str, Any], layers: int, max_len: int, dtype: torch.dtype,
                device: torch.device) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**{**dims, "num_hidden_layers": layers}, max_position_embeddings=max(32768, max_len))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model = model.to(dtype).train()
    model.config.use_cache = False
    return model


def matmul_params(model: torch.nn.Module) -> int:
    """Weights of every nn.Linear (decoder projections, MLP, lm head): the P of 6 * P * T."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def model_flops(p_matmul: int, lengths: list[int], layers: int, hq: int, head_dim: int) -> dict[str, float]:
    dense = 6.0 * p_matmul * sum(lengths)
    attention = sum(6.0 * layers * hq * head_dim * n * n for n in lengths)
    return {"dense": dense, "attention": attention, "total": dense + attention}


def set_attn(model: torch.nn.Module, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


class Batch:
    """The same sequences packed and padded, with per-token labels and advantages in packed order."""

    def __init__(self, lengths: list[int], vocab: int, device: torch.device, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
        self.lengths = lengths
        self.total = sum(lengths)
        self.max_len = max(lengths)
        self.packed_ids = torch.cat(seqs)[None].to(device)  # (1, T)
        self.packed_pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)  # (1, T)
        padded = torch.zeros(len(lengths), self.max_len, dtype=torch.long)
        mask = torch.zeros(len(lengths), self.max_len, dtype=torch.long)
        for i, s in enumerate(seqs):
            padded[i, : len(s)] = s
            mask[i, : len(s)] = 1
        self.padded_ids, self.mask = padded.to(device), mask.to(device)  # (S, max_len)
        self.keep = self.mask.bool()
        # next token within each sequence; the last token of each sequence has none
        labels = torch.cat([torch.cat([s[1:], torch.tensor([IGNORE_INDEX])]) for s in seqs])
        self.labels = labels.to(device)  # (T,)
        self.advantage = torch.randn(self.total, generator=gen).to(device)  # (T,)
        self.n_labels = int((labels != IGNORE_INDEX).sum())


def head_loss(hidden: torch.Tensor, model: torch.nn.Module, batch: Batch, head: str) -> torch.Tensor:
    """hidden: ``(T, H)`` last hidden states of the real tokens in packed order. Returns the scalar loss."""
    with torch.profiler.record_function("bench_head"):
        lp, ent = logprobs_entropy(hidden, model.lm_head.weight, batch.labels, TEMPERATURE, backend=head)
    return -(lp * batch.advantage).sum() / batch.n_labels - ENTROPY_COEF * ent.sum() / batch.n_labels


def make_step(model: torch.nn.Module, batch: Batch, kind: str, head: str) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        if kind == "padded":
            hidden = model.model(input_ids=batch.padded_ids, attention_mask=batch.mask, use_cache=False)
            hidden = hidden.last_hidden_state[batch.keep]  # (S, max_len, H) -> (T, H)
        else:
            hidden = model.model(input_ids=batch.packed_ids, position_ids=batch.packed_pos, use_cache=False)
            hidden = hidden.last_hidden_state[0]  # (1, T, H) -> (T, H)
        loss = head_loss(hidden, model, batch, head)
        loss.backward()
        return loss.detach()

    return step


@contextlib.contextmanager
def variant(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Put the model in the variant's configuration, and back to stock sdpa afterwards."""
    if name.startswith("tfcompat"):
        with tfcompat.patch(model, backend=name[len("tfcompat["):-1]):
            yield
        return
    set_attn(model, "flex_attention" if name == "flex_packed" else "sdpa")
    try:
        yield
    finally:
        set_attn(model, "sdpa")


# ------------------------------------------------------------------------------------------------ profile

ATTN_OPS = re.compile(r"bench_attention|attention|attn|flex|varlen|cudnn|sdpa|CompiledFunction", re.I)
ATTN_KERNELS = re.compile(r"flash|fmha|attention|attn|flex|cudnn|sdpa", re.I)
MATMUL_KERNELS = re.compile(r"gemm|cutlass|xmma|nvjet|wgmma|cublas|s16816|s1688|splitk|sm90_|sm80_", re.I)


def head_markers() -> re.Pattern:
    functions = [n for n, o in vars(heads).items() if isinstance(o, type) and issubclass(o, torch.autograd.Function)]
    try:
        import tfcompat.heads._triton as th

        functions += [n for n, o in vars(th).items() if isinstance(o, type) and issubclass(o, torch.autograd.Function)]
    except Exception:  # the triton head module is optional
        pass
    names = ["bench_head", *(re.escape(f"{n}Backward") for n in functions)]
    return re.compile("|".join(names))


@contextlib.contextmanager
def marked_attention() -> Iterator[None]:
    """Wrap every entry of transformers' attention interface in a ``bench_attention`` profiler range."""
    from transformers.modeling_utils import AttentionInterface

    mapping = AttentionInterface._global_mapping
    saved = dict(mapping)

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function("bench_attention"):
                return fn(*args, **kwargs)
        return wrapped

    for key, fn in saved.items():
        mapping[key] = wrap(fn)
    try:
        yield
    finally:
        mapping.clear()
        mapping.update(saved)


def profile_step(step: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """Kernel time of one (already warm) step by category: attention, matmul, head, elementwise/other; and the
    top kernels."""
    from torch.profiler import ProfilerActivity, profile

    with marked_attention(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        C.sync(device)
    head_re = head_markers()
    cats = {"attention": 0.0, "matmul": 0.0, "head": 0.0, "elementwise/other": 0.0}
    kernels: dict[str, float] = {}
    for evt in prof.events():
        if not evt.kernels:
            continue
        chain, e = [], evt
        while e is not None:
            chain.append(e.name)
            e = e.cpu_parent
        names = " | ".join(chain)
        for k in evt.kernels:
            us = float(k.duration)
            if head_re.search(names):
                cat = "head"
            elif ATTN_OPS.search(names) or ATTN_KERNELS.search(k.name):
                cat = "attention"
            elif MATMUL_KERNELS.search(k.name):
                cat = "matmul"
            else:
                cat = "elementwise/other"
            cats[cat] += us
            kernels[k.name] = kernels.get(k.name, 0.0) + us
    total = sum(cats.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
    return {"gpu_ms": total / 1e3, "ms": {c: v / 1e3 for c, v in cats.items()},
            "share": {c: (v / total if total else 0.0) for c, v in cats.items()},
            "top_kernels": [(n[:120], us / 1e3) for n, us in top]}


# --------------------------------------------------------------------------------------------------- main


def main() -> None:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 28; --long 4; smoke 2)")
    p.add_argument("--seqs", type=int, default=None, help="sequences (default 8; --long 4; smoke 3)")
    p.add_argument("--min-len", type=int, default=None, help="shortest sequence (default 512; --long 8192)")
    p.add_argument("--max-len", type=int, default=None, help="longest sequence (default 4096; --long 32768)")
    p.add_argument("--long", action="store_true", help="long context: 4 sequences of 8k-32k tokens, 4 layers")
    p.add_argument("--no-checkpointing", action="store_true", help="turn gradient checkpointing off")
    p.add_argument("--variants", default=None,
                   help="comma list of tfcompat, padded, sdpa_packed, flex_packed (default all; --long: "
                        "tfcompat,flex_packed)")
    p.add_argument("--tfcompat-backends", default="auto", help="attention backends of the tfcompat variant, "
                   "comma-separated (one variant each)")
    p.add_argument("--head", default="auto", help="tfcompat.heads backend for every variant (default auto)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H200: 989)")
    p.add_argument("--profile", nargs="?", const="all", default=None,
                   help="one profiled step per variant (or per variant of a comma list): where the time goes")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    smoke = args.smoke
    device = C.device_for(smoke)
    dtype = torch.float32 if smoke else torch.bfloat16
    long = args.long
    warmup = args.warmup if args.warmup is not None else 1
    reps = args.reps if args.reps is not None else (2 if smoke else 3)
    layers = args.layers or (SMOKE["num_hidden_layers"] if smoke else 4 if long else 28)
    n_seq = args.seqs or (3 if smoke else 4 if long else 8)
    lo = args.min_len or (5 if smoke else 8192 if long else 512)
    hi = args.max_len or (40 if smoke else 32768 if long else 4096)
    dims = SMOKE if smoke else QWEN25_7B
    default_variants = "tfcompat,flex_packed" if long else "tfcompat,padded,sdpa_packed,flex_packed"
    names = (args.variants or default_variants).split(",")
    if smoke and "flex_packed" in names:
        names.remove("flex_packed")
        print("smoke: flex_packed skipped (torch has no flex attention backward on CPU)")
    variants = []
    for n in names:
        if n == "tfcompat":
            variants += [f"tfcompat[{b}]" for b in args.tfcompat_backends.split(",")]
        elif n in ("padded", "sdpa_packed", "flex_packed"):
            variants.append(n)
        else:
            raise SystemExit(f"unknown variant {n!r}")

    info = C.machine(device)
    print(C.machine_line(info))
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(lo, hi + 1, (n_seq,), generator=gen).tolist()
    batch = Batch(lengths, dims["vocab_size"], device, seed=args.seed + 1)
    model = build_model(dims, layers, hi, dtype, device)
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    p_all = sum(x.numel() for x in model.parameters())
    p_mm = matmul_params(model)
    hq, head_dim = dims["num_attention_heads"], dims["hidden_size"] // dims["num_attention_heads"]
    flops = model_flops(p_mm, lengths, layers, hq, head_dim)
    padded_tokens = n_seq * batch.max_len
    padding = 1 - batch.total / padded_tokens
    probe = torch.empty(1, hq, head_dim, device=device, dtype=dtype, requires_grad=True)
    auto_attention = select_backend(probe, "auto", k=probe[:, : dims["num_key_value_heads"]],
                                    seqs=from_lengths(lengths, device=device))
    print(f"model: Qwen2 {layers} layers, {p_all / 1e9:.3f} B params ({p_mm / 1e9:.3f} B in matmuls), {dtype}, "
          f"gradient checkpointing {'off' if args.no_checkpointing else 'on'}; head backend {args.head!r}; "
          f"tfcompat attention 'auto' -> {auto_attention!r}")
    print(f"batch: {n_seq} sequences {lengths}: {batch.total} real tokens; padded {n_seq} x {batch.max_len} = "
          f"{padded_tokens} ({100 * padding:.1f}% padding)")
    print(f"model FLOPs/step = 6 * {p_mm} * {batch.total} + attention {flops['attention']:.4g} "
          f"= {flops['total']:.4g}")

    results: dict[str, Any] = {}
    ratios: dict[str, float] = {}

    def save() -> None:  # after every variant: a run cut short keeps what it measured
        C.write_json(args.out, {
            "benchmark": "train_step", "smoke": smoke, "long": long, "machine": info, "dtype": str(dtype),
            "model": {**dims, "num_hidden_layers": layers}, "params": p_all, "matmul_params": p_mm,
            "gradient_checkpointing": not args.no_checkpointing, "head": args.head, "attention_auto": auto_attention,
            "lengths": lengths, "real_tokens": batch.total, "padded_tokens": padded_tokens, "padding": padding,
            "flops": flops, "peak_tflops": args.peak_tflops, "warmup": warmup, "reps": reps,
            "results": results, "speedups": ratios,
        })

    for name in variants:
        kind = "padded" if name == "padded" else "packed"
        step = make_step(model, batch, kind, args.head)
        with variant(model, name):
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            try:
                loss = float(step())
                ms = C.time_ms(step, device, warmup, reps)
            except Exception as e:  # an out-of-memory or unsupported stock path: reported, the others still run
                print(f"{name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
                results[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                model.zero_grad(set_to_none=True)
                save()
                continue
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            profiled = args.profile is not None and (args.profile == "all" or name in args.profile.split(","))
            prof = profile_step(step, device) if profiled and device.type == "cuda" else None
        model.zero_grad(set_to_none=True)
        med = C.median(ms)
        results[name] = {"ms": med, "all_ms": ms, "loss": loss, "real_tokens_per_s": batch.total / (med * 1e-3),
                         "tflops": flops["total"] / (med * 1e-3) / 1e12,
                         "mfu": flops["total"] / (med * 1e-3) / (args.peak_tflops * 1e12),
                         "peak_memory_bytes": peak, "profile": prof}
        print(f"{name}: {med:.1f} ms/step, loss {loss:.6g}", flush=True)
        save()

    base = results.get("padded", {}).get("ms")
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "failed", "-", "-", "-", "-", "-", "-"])
            continue
        rows.append([name, r["ms"], r["real_tokens_per_s"], r["tflops"], f"{100 * r['mfu']:.1f}%",
                     "n/a" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.1f}",
                     "-" if base is None else f"{base / r['ms']:.2f}x", f"{r['loss']:.6g}"])
    print(f"\nforward + head + backward, median of {reps} after {warmup} warm-up:")
    print(C.table(["variant", "ms/step", "real tokens/s", "model TFLOP/s", "MFU", "peak GiB", "vs padded", "loss"],
                  rows))
    tf = [n for n in results if n.startswith("tfcompat") and "error" not in results[n]]
    for t in tf:
        for other in ("padded", "sdpa_packed", "flex_packed"):
            if other in results and "error" not in results[other]:
                ratios[f"{t} / {other}"] = results[other]["ms"] / results[t]["ms"]
    for k, v in ratios.items():
        print(f"speed-up {k}: {v:.2f}x")
    if any(r.get("profile") for r in results.values()):
        cats = ["attention", "matmul", "head", "elementwise/other"]
        prow = [[n, r["profile"]["gpu_ms"], *(f"{r['profile']['ms'][c]:.0f} ({100 * r['profile']['share'][c]:.0f}%)"
                                              for c in cats)]
                for n, r in results.items() if r.get("profile")]
        print("\nprofile of one step: GPU kernel ms (share)")
        print(C.table(["variant", "GPU ms", *cats], prow))
        for n, r in results.items():
            if r.get("profile"):
                print(f"top kernels, {n}: " + "; ".join(f"{k} {ms:.0f} ms" for k, ms in r["profile"]["top_kernels"]))
    save()
if __name__ == "__main__":
    main()
