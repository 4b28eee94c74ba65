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
  tfcompat_fused ``tfcompat.patch(model, backend=B, fused=True)``: tfcompat plus Liger-Kernel's RMSNorm, SwiGLU,
                 RoPE and (``--moe``) fused MoE experts kernels where exact (`tfcompat.hf.fused`); one variant per
                 backend, as tfcompat
  liger_flex     Liger-Kernel's own monkey patch (``apply_liger_kernel_to_qwen2`` / ``_qwen3_vl_moe``: rope,
                 rms_norm, swiglu on the instance; for the MoE its fused MoE experts, autotuned on their first
                 call) + stock flex_packed, with Liger's fused linear cross entropy as
                 the head (mean token CE of the labels at temperature 1, no entropy: what Liger users run)
  liger_flex_tfhead   the same with tfcompat's head (``--head``), as every other variant
  liger_tfcompat Liger's monkey patch + ``tfcompat.patch(model, backend=B)``
Liger's monkey patch cannot be undone: the three liger variants run last, on the same model.

A suffix sets a variant's gradient checkpointing: ``@none`` turns it off for the variant; ``@attention``,
``@mlp``, ``@mlp_in``, ``@attention+mlp`` keep those modules' outputs out of the recompute
(``patch(checkpoint_keep=...)``; a stock variant gets the same through `tfcompat.hf.checkpointing` alone), e.g.
``liger_flex_tfhead@attention+mlp``; ``kind:N`` keeps a kind in the last N layers only (``kind:0.5``: a fraction,
``kind:A..B[..S]``: the layers ``range(A, B, S)``, ``kind:A..B..S/C..D``: the union of ranges), e.g.
``@attention+mlp_in:8`` (``checkpoint_keep={"attention": 1.0, "mlp_in": 8}``);
``offload`` among them moves what those modules keep to host memory (``patch(checkpoint_offload=True)``;
``offload:N`` the first N layers keeping a module, ``offload:0.5`` a fraction), e.g. ``@attention+mlp_in+offload:20``,
and ``fetch:KIND`` (``mlp_in``, ``attention``) fetches the next layers' copies later in each layer's backward
(``patch(checkpoint_fetch=KIND)``);
``logits`` among them (``@logits``, ``@attention+logits``, ``@none+logits``) keeps the head's logits for its
backward (tfcompat's head, ``keep_logits=True``: one lm-head matmul less, ``2 * T * V`` bytes more); ``loss``
(``@loss``, ``@attention+offload+loss``) runs the step's loss inside the head (`tfcompat.heads.fused_loss`: its
gradients in the head's forward, the same matmul less, no logits kept).

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
    python bench/train_step.py --moe --out train_step_moe.json          # Qwen3-30B-A3B-shaped MoE, 4 layers
    python bench/train_step.py --smoke                                  # CPU, tiny Qwen2, fp32

``--memory [VARIANTS]`` adds one more step per variant, or per listed variant, and prints the caching allocator's
peak per phase (each decoder layer's forward, the head, each layer's backward with its recompute and the copies it
fetches, the embedding's backward) and what is allocated at each phase's end: where the step's peak is.

``--moe``: the text stack of a Qwen3-VL-30B-A3B-shaped ``Qwen3VLMoeForConditionalGeneration`` (Qwen3-30B-A3B's
text dims: hidden 2048, 32 query / 4 KV heads of 128 with q/k norms, 128 experts of 768, top 8, vocab 151936,
untied head; mrope; a one-block vision tower that the text-only batch never runs), ``--layers`` (default 4),
experts through transformers' ``grouped_mm`` experts implementation where the release has it (``--experts``).
Model FLOPs count the active parameters: every matmul weight of the text stack and the head, the expert weights
times ``top_k / n_experts``.

``--family gpt_oss`` / ``--family qwen3_moe``: issue 18's derived families at real width (gpt-oss-20b: sinks,
sliding window 128 on every other layer, 32 experts top 4; Qwen3-30B-A3B: 128 experts top 8), built through
``AutoConfig.for_model``, ``--layers`` (default 4); stock padded runs the family's stock attention (eager for
gpt-oss, which has no sdpa path); ``tfcompat_fused`` is ``fused="auto"`` there (what it fused is printed). Attention
FLOPs count about ``L * W`` query-key pairs on a layer with a sliding window ``W``.
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
from tfcompat.heads import IGNORE_INDEX, fused_loss, logprobs_entropy  # noqa: E402

QWEN25_7B = dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                 vocab_size=152064, num_hidden_layers=28, tie_word_embeddings=False, rms_norm_eps=1e-6,
                 rope_theta=1e6, attention_dropout=0.0, use_sliding_window=False)
SMOKE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=256,
             num_hidden_layers=2, tie_word_embeddings=False, attention_dropout=0.0, use_sliding_window=False)
QWEN3_30B_A3B = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                     vocab_size=151936, num_hidden_layers=4, tie_word_embeddings=False, rms_norm_eps=1e-6,
                     attention_dropout=0.0, decoder_sparse_step=1, mlp_only_layers=[], mrope_section=[24, 20, 20])
SMOKE_MOE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, vocab_size=256, num_hidden_layers=2,
                 tie_word_embeddings=False, attention_dropout=0.0, decoder_sparse_step=1, mlp_only_layers=[],
                 mrope_section=[4, 2, 2])
# issue 18's derived families at real width (few layers): gpt-oss-20b (sinks, sliding windows of 128 on every other
# layer, 32 experts top 4, yarn rope) and Qwen3-30B-A3B (q/k norms, 128 experts top 8); built through AutoConfig
DERIVED = {
    "gpt_oss": dict(hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                    intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
                    sliding_window=128, tie_word_embeddings=False, attention_dropout=0.0),
    "qwen3_moe": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                      vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6, attention_dropout=0.0,
                      decoder_sparse_step=1, mlp_only_layers=[]),
}
SMOKE_DERIVED = {
    "gpt_oss": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
                    num_local_experts=4, num_experts_per_tok=2, vocab_size=256, sliding_window=4,
                    tie_word_embeddings=False, attention_dropout=0.0),
    "qwen3_moe": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                      moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, vocab_size=256,
                      tie_word_embeddings=False, attention_dropout=0.0, decoder_sparse_step=1, mlp_only_layers=[]),
}
STOCK_ATTENTION = {"gpt_oss": "eager"}  # gpt-oss has no sdpa path in transformers (its sinks)
TEMPERATURE = 0.7
ENTROPY_COEF = 0.01
HEAD_MODES = ("logits", "loss")  # suffix tokens that choose the head: kept logits, the loss inside the head


def instantiate(make: Callable[[], torch.nn.Module], dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """``make()`` under seed 0, built in ``dtype`` on ``device``; in train mode, without the cache."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = make()
    finally:
        torch.set_default_dtype(default)
    model = model.to(dtype).train()
    model.config.use_cache = False
    return model


def build_model(dims: dict[str, Any], layers: int, max_len: int, dtype: torch.dtype,
                device: torch.device) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**{**dims, "num_hidden_layers": layers}, max_position_embeddings=max(32768, max_len))
    cfg._attn_implementation = "sdpa"
    return instantiate(lambda: Qwen2ForCausalLM(cfg), dtype, device)


def build_moe(dims: dict[str, Any], layers: int, max_len: int, dtype: torch.dtype, device: torch.device,
              experts: str) -> torch.nn.Module:
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    text = {**{k: v for k, v in dims.items() if k != "mrope_section"}, "num_hidden_layers": layers,
            "max_position_embeddings": max(32768, max_len),
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": dims["mrope_section"],
                                "mrope_interleaved": True}}
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=dims["hidden_size"],
                  patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0])
    cfg = Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    if experts and hasattr(cfg.text_config, "_experts_implementation"):
        cfg.text_config._experts_implementation = experts
    model = instantiate(lambda: Qwen3VLMoeForConditionalGeneration(cfg), dtype, device)
    with torch.no_grad():  # the constructor leaves the 3-d expert weights uninitialized
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0.0, 0.02)
    return model


def build_derived(family: str, dims: dict[str, Any], layers: int, max_len: int, dtype: torch.dtype,
                  device: torch.device, experts: str) -> torch.nn.Module:
    """A causal LM of a family tfcompat derives (issue 18) from its config class, random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **{**dims, "num_hidden_layers": layers},
                               max_position_embeddings=max(131072 if family == "gpt_oss" else 32768, max_len))
    if experts and hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = experts
    model = instantiate(lambda: AutoModelForCausalLM.from_config(
        cfg, attn_implementation=STOCK_ATTENTION.get(family, "sdpa")), dtype, device)
    with torch.no_grad():  # the constructor may leave 3-d expert weights (and gpt-oss' sinks) uninitialized
        for name, p in model.named_parameters():
            if "experts" in name or "sinks" in name:
                p.normal_(0.0, 0.02)
    return model


def stack_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack the step runs: ``model.model`` (Qwen2) or the VLM's text model (MoE)."""
    inner = model.model
    return getattr(inner, "language_model", inner)


def matmul_params(model: torch.nn.Module, active: float = 1.0) -> int:
    """Matrix weights of the decoder stack (every 2-d parameter but the embedding table: projections, MLPs,
    routers), ``active`` (top_k / n_experts) of the 3-d expert weights, and the lm head: the P of 6 * P * T."""
    stack = stack_of(model)
    dense = sum(p.numel() for n, p in stack.named_parameters() if p.ndim == 2 and "embed" not in n and "bias" not in n)
    routed = sum(p.numel() for n, p in stack.named_parameters() if p.ndim == 3)
    return int(dense + active * routed + model.lm_head.weight.numel())


def model_flops(p_matmul: int, lengths: list[int], windows: list[int | None], hq: int, head_dim: int
                ) -> dict[str, float]:
    """windows: per layer, None (causal over the sequence: ``L**2 / 2`` query-key pairs) or W (about ``L * W``)."""
    dense = 6.0 * p_matmul * sum(lengths)

    def pairs(n: int, w: int | None) -> float:
        return n * n / 2 if w is None or w >= n else w * (w + 1) / 2 + (n - w) * w

    attention = sum(12.0 * hq * head_dim * pairs(n, w) for n in lengths for w in windows)
    return {"dense": dense, "attention": attention, "total": dense + attention}


def layer_windows(model: torch.nn.Module, layers: int) -> list[int | None]:
    """Each decoder layer's sliding window (None: full causal), from the config's ``layer_types``."""
    cfg = stack_of(model).config
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * layers
    return [cfg.sliding_window if t == "sliding_attention" else None for t in types[:layers]]


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


def token_loss(logprobs: torch.Tensor, entropy: torch.Tensor, advantage: torch.Tensor, scale: float
               ) -> torch.Tensor:
    """The step's loss per token, for `fused_loss`: ``-(logprobs * advantage) - ENTROPY_COEF * entropy``, over
    the count of labelled tokens (``scale``)."""
    return (-(logprobs * advantage) - ENTROPY_COEF * entropy) * scale


def head_loss(hidden: torch.Tensor, model: torch.nn.Module, batch: Batch, head: str,
              keep_logits: bool = False, fused: bool = False) -> torch.Tensor:
    """hidden: ``(T, H)`` last hidden states of the real tokens in packed order. Returns the scalar loss.
    head "liger": Liger-Kernel's fused linear cross entropy (mean over labelled tokens), else a tfcompat backend
    (``keep_logits``: keep its logits for backward; ``fused``: the loss inside the head, `fused_loss`)."""
    with torch.profiler.record_function("bench_head"):
        if head == "liger":
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            return liger_fused_linear_cross_entropy(hidden, model.lm_head.weight, batch.labels,
                                                    ignore_index=IGNORE_INDEX, reduction="mean")
        if fused:
            return fused_loss(hidden, model.lm_head.weight, batch.labels, token_loss, batch.advantage,
                              1.0 / batch.n_labels, temperature=TEMPERATURE, backend=head).loss
        lp, ent = logprobs_entropy(hidden, model.lm_head.weight, batch.labels, TEMPERATURE, backend=head,
                                   keep_logits=keep_logits)
    return -(lp * batch.advantage).sum() / batch.n_labels - ENTROPY_COEF * ent.sum() / batch.n_labels


def make_step(model: torch.nn.Module, batch: Batch, kind: str, head: str,
              keep_logits: bool = False, fused: bool = False) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        stack = stack_of(model)
        if kind == "padded":
            hidden = stack(input_ids=batch.padded_ids, attention_mask=batch.mask, use_cache=False)
            hidden = hidden.last_hidden_state[batch.keep]  # (S, max_len, H) -> (T, H)
        else:
            hidden = stack(input_ids=batch.packed_ids, position_ids=batch.packed_pos, use_cache=False)
            hidden = hidden.last_hidden_state[0]  # (1, T, H) -> (T, H)
        loss = head_loss(hidden, model, batch, head, keep_logits, fused)
        loss.backward()
        return loss.detach()

    return step


class _Changes:
    """What `tfcompat.hf.checkpointing.apply` changes on a stock (unpatched) model, undone afterwards: the peer
    stacks under the same kept outputs as tfcompat."""

    def __init__(self) -> None:
        self.undo: list[Callable[[], None]] = []

    def _set(self, scope: str, target: Any, attr: str, new: Any, note: str) -> None:
        had, old = attr in vars(target), vars(target).get(attr)
        setattr(target, attr, new)
        self.undo.append(lambda: setattr(target, attr, old) if had else delattr(target, attr))


def keep_policy(mode: str) -> dict[str, Any]:
    """`tfcompat.patch`'s ``checkpoint_keep``, ``checkpoint_offload`` and ``checkpoint_fetch`` of a suffix:
    "attention+mlp_in:8+offload:4" -> {"checkpoint_keep": {"attention": 1.0, "mlp_in": 8}, "checkpoint_offload": 4,
    "checkpoint_fetch": "recompute"} ("kind:0.5": a fraction of the layers; "kind:1..17..2": range(1, 17, 2);
    "kind:1..17..2/24..28": the union of those ranges; "offload" alone: True; "fetch:mlp_in": checkpoint_fetch)."""
    policy: dict[str, int | float | range | set[int]] = {}
    offload: bool | int | float = False
    fetch = "recompute"
    for token in mode.split("+") if mode else []:
        kind, _, n = token.partition(":")
        if kind == "fetch":
            fetch = n
            continue
        layers: int | float | range | set[int] = (
            {i for part in n.split("/") for i in range(*map(int, part.split("..")))} if "/" in n
            else range(*map(int, n.split(".."))) if ".." in n else float(n) if "." in n else int(n) if n else 1.0)
        if kind == "offload":
            offload = layers if n else True
        else:
            policy[kind] = layers
    return {"checkpoint_keep": policy, "checkpoint_offload": offload, "checkpoint_fetch": fetch}


NO_KEEP = {"checkpoint_keep": {}, "checkpoint_offload": False, "checkpoint_fetch": "recompute"}


@contextlib.contextmanager
def checkpointing(model: torch.nn.Module, mode: str, stock: bool) -> Iterator[dict[str, Any]]:
    """A variant's checkpointing (the part of its name after ``@``): "" = full (as built), "none" = off for the
    variant, else kinds kept out of the recompute joined by ``+`` ("attention+mlp", "attention+mlp_in:8", with
    "offload[:N]" and "fetch:KIND"); yields `keep_policy`'s arguments for `tfcompat.patch`, or applies them
    itself to a stock variant (and yields `NO_KEEP`)."""
    if mode == "none":
        model.gradient_checkpointing_disable()
        try:
            yield NO_KEEP
        finally:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    kw = keep_policy(mode)
    if not stock or not kw["checkpoint_keep"]:
        yield kw
        return
    from tfcompat.errors import PatchError
    from tfcompat.hf import checkpointing as ckpt

    layer = stack_of(model).layers[0]
    attention_cls = type(next(c for c in layer.children() if type(c).__name__.endswith("Attention")))
    keep_plan = ckpt.plan(model, ckpt.policy_of(kw["checkpoint_keep"]), attention_cls,
                          lambda cls, what, **k: PatchError(what, **k), ckpt.offload_of(kw["checkpoint_offload"]),
                          ckpt.fetch_of(kw["checkpoint_fetch"]))
    changes = _Changes()
    ckpt.apply(changes, keep_plan)
    try:
        yield NO_KEEP
    finally:
        for fn in reversed(changes.undo):
            fn()


@contextlib.contextmanager
def variant(model: torch.nn.Module, name: str, stock_attention: str, fused: Any) -> Iterator[None]:
    """Put the model in the variant's configuration, and back to stock attention afterwards (Liger's monkey patch,
    applied before the first liger variant, stays)."""
    base, _, mode = name.partition("@")
    mode = "+".join(k for k in mode.split("+") if k not in HEAD_MODES)  # the head's, not the checkpointing's
    tf = base.startswith(("tfcompat", "liger_tfcompat"))
    with checkpointing(model, mode, stock=not tf) as keep:
        if tf:
            backend = base[base.index("[") + 1:-1]
            with tfcompat.patch(model, backend=backend, fused=fused if base.startswith("tfcompat_fused") else False,
                                **keep):
                yield
            return
        set_attn(model, "flex_attention" if base in ("flex_packed", "liger_flex", "liger_flex_tfhead")
                 else stock_attention)
        try:
            yield
        finally:
            set_attn(model, stock_attention)


def apply_liger(model: torch.nn.Module, moe: bool) -> str:
    """Liger-Kernel's own monkey patch on the instance, as its users apply it (rope, RMSNorm, SwiGLU; no loss
    patch: the head is called separately). Returns liger-kernel's version."""
    from importlib.metadata import version

    from liger_kernel.transformers import monkey_patch

    fn = monkey_patch.apply_liger_kernel_to_qwen3_vl_moe if moe else monkey_patch.apply_liger_kernel_to_qwen2
    fn(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model)
    print(f"applied Liger-Kernel {version('liger-kernel')}: {fn.__name__}(rope, rms_norm, swiglu)", flush=True)
    return version("liger-kernel")


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
    streams = stream_times(prof)
    head_re = head_markers()
    cats = {"attention": 0.0, "matmul": 0.0, "head": 0.0, "elementwise/other": 0.0}
    kernels: dict[str, float] = {}
    others: dict[str, float] = {}  # the kernels of "elementwise/other"
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
            if cat == "elementwise/other":
                others[k.name] = others.get(k.name, 0.0) + us
    total = sum(cats.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
    top_other = sorted(others.items(), key=lambda kv: -kv[1])[:10]
    return {"gpu_ms": total / 1e3, "ms": {c: v / 1e3 for c, v in cats.items()},
            "share": {c: (v / total if total else 0.0) for c, v in cats.items()},
            "top_kernels": [(n[:120], us / 1e3) for n, us in top],
            "top_other_kernels": [(n[:120], us / 1e3) for n, us in top_other],
            "kernels": [(n[:160], us / 1e3) for n, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:60]],
            **streams}


def stream_times(prof: Any) -> dict[str, Any]:
    """From the profiled step's trace: its span on the GPU (first kernel or copy to the last), and per stream the
    kernel and copy time and the busy time (their union). ``idle_ms``: the span less the busiest stream's busy time,
    the gaps where that stream (compute) waited for the host, a copy or another stream; split at the backward's
    first kernel (``backward_ms``: its offset, the first kernel launched from another thread than the step's
    first), and the largest gaps with their offsets and the copy streams busy in them."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    events = trace.get("traceEvents", [])
    thread = {e["args"]["correlation"]: e.get("tid") for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    spans: dict[int, list[tuple[float, float]]] = {}
    kinds: dict[int, dict[str, float]] = {}
    launched: list[tuple[float, Any]] = []
    for e in events:
        cat = e.get("cat")
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        sid = int(e.get("args", {}).get("stream", -1))
        spans.setdefault(sid, []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
        kinds.setdefault(sid, {}).setdefault(cat, 0.0)
        kinds[sid][cat] += float(e["dur"])
        if cat == "kernel":
            launched.append((float(e["ts"]), thread.get(e.get("args", {}).get("correlation"))))
    if not spans:
        return {}

    def merged(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
        out: list[tuple[float, float]] = []
        for a, b in sorted(iv):
            if out and a <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        return out

    busy_iv = {sid: merged(iv) for sid, iv in spans.items()}
    busy = {sid: sum(b - a for a, b in iv) for sid, iv in busy_iv.items()}
    start = min(a for iv in spans.values() for a, _ in iv)
    stop = max(b for iv in spans.values() for _, b in iv)
    main = max(busy, key=lambda s: busy[s])
    launched.sort()
    first_thread = launched[0][1] if launched else None
    backward = next((ts for ts, tid in launched if tid is not None and tid != first_thread), stop)
    iv = busy_iv[main]
    gaps = [(b0, a1) for (_, b0), (a1, _) in zip(iv, iv[1:])]
    idle_fwd = sum(min(b, backward) - a for a, b in gaps if a < backward)
    copies = [s for s in busy_iv if s != main]

    def copying(a: float, b: float) -> list[str]:
        return [str(s) for s in copies if any(x < b and y > a for x, y in busy_iv[s])]

    host = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver", "cpu_op") and
            float(e.get("dur", 0)) >= 500]

    def blocking(a: float, b: float) -> list[str]:
        """The host calls of at least 0.5 ms overlapping a gap or the 20 ms before it (the queue drains first)."""
        near = [e for e in host if float(e["ts"]) < b and float(e["ts"]) + float(e["dur"]) > a - 20_000]
        return [f"{e['name'][:60]} {float(e['dur']) / 1e3:.1f} ms" for e in sorted(near, key=lambda e: -e["dur"])[:4]]

    top = sorted(gaps, key=lambda g: g[0] - g[1])[:12]
    return {"span_ms": (stop - start) / 1e3, "idle_ms": (stop - start - busy[main]) / 1e3,
            "backward_ms": (backward - start) / 1e3, "idle_forward_ms": idle_fwd / 1e3,
            "gaps": [{"at_ms": round((a - start) / 1e3, 2), "ms": round((b - a) / 1e3, 3), "copying": copying(a, b),
                      **({"host": blocking(a, b)} if b - a >= 1_000 else {})} for a, b in sorted(top)],
            "streams": {str(s): {"busy_ms": busy[s] / 1e3, **{k: v / 1e3 for k, v in kinds[s].items()}}
                        for s in sorted(busy, key=lambda s: -busy[s])}}


def memory_phases(step: Callable[[], Any], model: torch.nn.Module, device: torch.device) -> list[dict[str, Any]]:
    """One more (warm) step with the caching allocator's peak per phase: each decoder layer's forward, the head
    (the last layer's output to its first gradient: final norm, head, and their backward), each layer's backward
    (its recompute and the copies it fetches included: from its output's gradient to the next layer's), and the
    end (the embedding's backward). The counters are host-side: no sync is added. Returns per phase its name, the
    peak and what is allocated at its end, in GiB."""
    layers = list(stack_of(model).layers)
    phases: list[dict[str, Any]] = []
    state: dict[str, Any] = {"phase": "embedding", "backward": False}

    def mark(name: str) -> None:
        phases.append({"phase": state["phase"], "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                       "end_gib": torch.cuda.memory_allocated(device) / 2**30})
        torch.cuda.reset_peak_memory_stats(device)
        state["phase"] = name

    def on_grad(i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            state["backward"] = True
            mark(f"backward {i}" if i >= 0 else "end")
        return hook

    def pre(i: int) -> Callable[..., None]:
        def hook(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if state["backward"]:
                return  # the recompute
            mark(f"forward {i}")
            if i == 0:  # the embedding's output: its gradient ends the last layer's backward
                x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad),
                         None)
                if x is not None:
                    x.register_hook(on_grad(-1))
        return hook

    def post(i: int) -> Callable[..., None]:
        def hook(_: Any, __: Any, out: Any) -> None:
            hidden = out[0] if isinstance(out, tuple) else out
            if state["backward"] or not isinstance(hidden, torch.Tensor) or not hidden.requires_grad:
                return
            hidden.register_hook(on_grad(i))
            if i == len(layers) - 1:
                mark("head")
        return hook

    handles = [h for i, layer in enumerate(layers) for h in (layer.register_forward_pre_hook(pre(i), with_kwargs=True),
                                                              layer.register_forward_hook(post(i)))]
    try:
        C.sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        C.sync(device)
        mark("")
    finally:
        for h in handles:
            h.remove()
    return [p for p in phases if p["phase"] != "embedding" or p["peak_gib"] > 0]


# --------------------------------------------------------------------------------------------------- main


def main() -> None:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 28; --long 4; smoke 2)")
    p.add_argument("--seqs", type=int, default=None, help="sequences (default 8; --long 4; smoke 3)")
    p.add_argument("--min-len", type=int, default=None, help="shortest sequence (default 512; --long 8192)")
    p.add_argument("--max-len", type=int, default=None, help="longest sequence (default 4096; --long 32768)")
    p.add_argument("--long", action="store_true", help="long context: 4 sequences of 8k-32k tokens, 4 layers")
    p.add_argument("--no-checkpointing", action="store_true", help="turn gradient checkpointing off")
    p.add_argument("--moe", action="store_true", help="Qwen3-30B-A3B-shaped MoE text stack (default 4 layers)")
    p.add_argument("--experts", default="grouped_mm", help="transformers experts implementation (--moe, --family)")
    p.add_argument("--family", default=None, choices=sorted(DERIVED),
                   help="a derived family's stack at real width (issue 18): gpt_oss (gpt-oss-20b), qwen3_moe "
                        "(Qwen3-30B-A3B); default 4 layers; stock padded runs its family's stock attention")
    p.add_argument("--variants", default=None,
                   help="comma list of tfcompat, tfcompat_fused, padded, sdpa_packed, flex_packed, liger_flex, "
                        "liger_flex_tfhead, liger_tfcompat, the first three also as name[backend] (default "
                        "tfcompat,padded,sdpa_packed,flex_packed; --long, --moe: tfcompat,flex_packed)")
    p.add_argument("--tfcompat-backends", default="auto", help="attention backends of the tfcompat variant, "
                   "comma-separated (one variant each)")
    p.add_argument("--head", default="auto", help="tfcompat.heads backend for every variant (default auto)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H200: 989)")
    p.add_argument("--profile", nargs="?", const="all", default=None,
                   help="one profiled step per variant (or per variant of a comma list): where the time goes")
    p.add_argument("--memory", nargs="?", const="all", default=None,
                   help="one more step per variant (or per variant of a comma list): the peak memory of each "
                        "layer's forward, the head and each layer's backward")
    p.add_argument("--lengths", default=None, help="explicit sequence lengths, comma-separated (e.g. round sizes "
                   "2048,2048,...), instead of seeded random ones")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    smoke = args.smoke
    device = C.device_for(smoke)
    dtype = torch.float32 if smoke else torch.bfloat16
    long = args.long
    warmup = args.warmup if args.warmup is not None else 1
    reps = args.reps if args.reps is not None else (2 if smoke else 3)
    layers = args.layers or (SMOKE["num_hidden_layers"] if smoke else 4 if long or args.moe or args.family else 28)
    n_seq = args.seqs or (3 if smoke else 4 if long else 8)
    lo = args.min_len or (5 if smoke else 8192 if long else 512)
    hi = args.max_len or (40 if smoke else 32768 if long else 4096)
    family = args.family
    if family:
        dims = (SMOKE_DERIVED if smoke else DERIVED)[family]
    else:
        dims = (SMOKE_MOE if args.moe else SMOKE) if smoke else QWEN3_30B_A3B if args.moe else QWEN25_7B
    default_variants = ("tfcompat,padded,flex_packed" if family else "tfcompat,flex_packed" if long or args.moe
                        else "tfcompat,padded,sdpa_packed,flex_packed")
    names = (args.variants or default_variants).split(",")
    if smoke and "flex_packed" in names:
        names.remove("flex_packed")
        print("smoke: flex_packed skipped (torch has no flex attention backward on CPU)")
    variants = []
    for full in names:
        n, at, mode = full.partition("@")  # @none: no checkpointing; @attention+mlp: kept out of the recompute
        suffix = at + mode
        kinds = {k.partition(":")[0] for k in mode.split("+")} - {*HEAD_MODES, "offload", "fetch"} if mode else set()
        if kinds and kinds != {"none"} and not kinds <= {"attention", "mlp", "mlp_in"}:
            raise SystemExit(f"unknown checkpointing {mode!r} in {full!r}: none, attention, mlp, mlp_in, "
                             "attention+mlp, kind:N (the last N layers), each with +logits or +loss, +offload[:N], "
                             "+fetch:mlp_in|attention")
        if n == "liger_flex" and set(mode.split("+")) & set(HEAD_MODES):
            raise SystemExit(f"{full!r}: +logits and +loss are tfcompat's head's (Liger's keeps no logits and is "
                             "a fused loss already)")
        if set(HEAD_MODES) <= set(mode.split("+")):
            raise SystemExit(f"{full!r}: +logits or +loss, not both")
        if n.endswith("]") and n[:n.index("[")] in ("tfcompat", "tfcompat_fused", "liger_tfcompat"):
            variants.append(n + suffix)  # one backend named: tfcompat_fused[sdpa]
        elif n in ("tfcompat", "tfcompat_fused", "liger_tfcompat"):
            variants += [f"{n}[{b}]{suffix}" for b in args.tfcompat_backends.split(",")]
        elif n in ("padded", "sdpa_packed", "flex_packed", "liger_flex", "liger_flex_tfhead"):
            variants.append(n + suffix)
        else:
            raise SystemExit(f"unknown variant {n!r}")
    variants.sort(key=lambda v: v.startswith("liger"))  # Liger's monkey patch is for good: its variants last

    info = C.machine(device)
    print(C.machine_line(info))
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(lo, hi + 1, (n_seq,), generator=gen).tolist()
    if args.lengths:
        lengths = [int(x) for x in args.lengths.split(",")]
        n_seq, hi = len(lengths), max(hi, max(lengths))
    # MoE (a VLM's text model): ids below the special tokens, so no vision placeholder is drawn
    batch = Batch(lengths, min(dims["vocab_size"], 151643), device, seed=args.seed + 1)
    if family:
        model = build_derived(family, dims, layers, hi, dtype, device, args.experts)
        active = dims["num_experts_per_tok"] / dims.get("num_experts", dims.get("num_local_experts", 1))
    elif args.moe:
        model = build_moe(dims, layers, hi, dtype, device, args.experts)
        active = dims["num_experts_per_tok"] / dims["num_experts"]
    else:
        model = build_model(dims, layers, hi, dtype, device)
        active = 1.0
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    p_all = sum(x.numel() for x in stack_of(model).parameters()) + model.lm_head.weight.numel()
    p_mm = matmul_params(model, active)
    hq = dims["num_attention_heads"]
    head_dim = dims.get("head_dim") or dims["hidden_size"] // hq
    windows = layer_windows(model, layers)
    flops = model_flops(p_mm, lengths, windows, hq, head_dim)
    stock_attention = STOCK_ATTENTION.get(family or "", "sdpa")
    # fused=True refuses a family whose modules Liger does not compute exactly: "auto" there (what it fused is listed)
    fused: Any = "auto" if family else True
    padded_tokens = n_seq * batch.max_len
    padding = 1 - batch.total / padded_tokens
    probe = torch.empty(1, hq, head_dim, device=device, dtype=dtype, requires_grad=True)
    auto_attention = select_backend(probe, "auto", k=probe[:, : dims["num_key_value_heads"]],
                                    seqs=from_lengths(lengths, device=device))
    experts_impl = getattr(stack_of(model).config, "_experts_implementation", None)
    arch = (f"{family} (derived), experts {experts_impl!r}, windows {windows}, stock attention {stock_attention!r}"
            if family else f"Qwen3-VL-MoE text, experts {experts_impl!r}" if args.moe else "Qwen2")
    print(f"model: {arch} {layers} layers, {p_all / 1e9:.3f} B params ({p_mm / 1e9:.3f} B active in matmuls), {dtype}, "
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
            "benchmark": "train_step", "smoke": smoke, "long": long, "moe": args.moe, "family": family,
            "machine": info, "windows": windows, "stock_attention": stock_attention,
            "dtype": str(dtype), "liger_kernel": liger_version,
            "model": {**dims, "num_hidden_layers": layers}, "params": p_all, "matmul_params": p_mm,
            "gradient_checkpointing": not args.no_checkpointing, "head": args.head, "attention_auto": auto_attention,
            "lengths": lengths, "real_tokens": batch.total, "padded_tokens": padded_tokens, "padding": padding,
            "flops": flops, "peak_tflops": args.peak_tflops, "warmup": warmup, "reps": reps,
            "results": results, "speedups": ratios,
        })

    liger_version = None
    for name in variants:
        base = name.partition("@")[0]
        kind = "padded" if base == "padded" else "packed"
        if base.startswith("liger") and liger_version is None:
            liger_version = apply_liger(model, args.moe)
        head_modes = name.partition("@")[2].split("+")
        step = make_step(model, batch, kind, "liger" if base == "liger_flex" else args.head, "logits" in head_modes,
                         "loss" in head_modes)
        with variant(model, name, stock_attention, fused):
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
            traced = args.memory is not None and (args.memory == "all" or name in args.memory.split(","))
            phases = memory_phases(step, model, device) if traced and device.type == "cuda" else None
            if base.startswith("tfcompat_fused"):
                handle = vars(model).get("_tfcompat_handle")
                records = handle.records if handle is not None else []
                print(f"{name}: fused {sorted({r.note for r in records if 'Liger' in r.note})}", flush=True)
        model.zero_grad(set_to_none=True)
        med = C.median(ms)
        results[name] = {"ms": med, "all_ms": ms, "loss": loss, "real_tokens_per_s": batch.total / (med * 1e-3),
                         "tflops": flops["total"] / (med * 1e-3) / 1e12,
                         "mfu": flops["total"] / (med * 1e-3) / (args.peak_tflops * 1e12),
                         "peak_memory_bytes": peak, "profile": prof, "memory_phases": phases}
        print(f"{name}: {med:.1f} ms/step, loss {loss:.6g}", flush=True)
        if phases:
            print(f"memory by phase, {name} (GiB, peak / at its end): " + "; ".join(
                f"{p['phase']} {p['peak_gib']:.2f} / {p['end_gib']:.2f}" for p in phases), flush=True)
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
    tf = [n for n in results if n.startswith(("tfcompat", "liger_tfcompat")) and "error" not in results[n]]
    for t in tf:
        for other in results:
            if not other.startswith(("tfcompat", "liger_tfcompat")) and "error" not in results[other]:
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
            if (r.get("profile") or {}).get("streams"):
                pr = r["profile"]
                print(f"streams, {n}: span {pr['span_ms']:.1f} ms, backward from {pr['backward_ms']:.1f} ms, compute "
                      f"stream idle {pr['idle_ms']:.1f} ms ({pr['idle_forward_ms']:.1f} before the backward); " +
                      "; ".join(f"stream {s}: " + ", ".join(f"{k} {v:.1f}" for k, v in d.items())
                                for s, d in pr["streams"].items()))
                print(f"largest compute-stream gaps, {n}: " + "; ".join(
                    f"{g['ms']:.2f} ms at {g['at_ms']:.0f}" + (f" (copying: {','.join(g['copying'])})" if g["copying"]
                                                               else "") +
                    (f" [host: {', '.join(g['host'])}]" if g.get("host") else "") for g in pr["gaps"]))
        for n, r in results.items():
            if r.get("profile"):
                print(f"top kernels, {n}: " + "; ".join(f"{k} {ms:.0f} ms" for k, ms in r["profile"]["top_kernels"]))
                print(f"top elementwise/other kernels, {n}: " + "; ".join(
                    f"{k[:90]} {ms:.1f} ms" for k, ms in r["profile"]["top_other_kernels"]))
    save()
if __name__ == "__main__":
    main()
