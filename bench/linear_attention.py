"""One Gated DeltaNet layer, packed sequences: tfcompat's packed path (torch, fla) vs the stock layer, padded batch.

A stock ``Qwen3_5GatedDeltaNet`` of Qwen3.5's shape (hidden 4096, 16 key / 32 value heads of 128, conv width 4;
transformers' defaults) runs the same ``N`` sequences two ways:

- stock padded: the unpatched layer on a right-padded ``(N, L_max, hidden)`` batch with its 2-D attention mask,
  with whatever kernels the installed transformers picked at import (fla's rule when installed; the conv's
  torch fallback unless causal-conv1d is installed): the per-sequence answer, padding included in the work;
- tfcompat packed: the layer's own projections, `tfcompat.core.linear_attention.linear_attention` on the ``(T, ...)``
  packed stream, the layer's gated norm and output projection; once with the torch backends (rule and conv),
  once with the fastest installed ones (``"auto"``: fla's rule, causal-conv1d's or fla's conv), if any.

Forward (no grad) and forward+backward (``torch.autograd.grad`` of the input and every parameter with a fixed
output gradient), interleaved, median of ``--reps``; host syncs of one packed layer call after warm-up, counted
with ``torch.cuda.set_sync_debug_mode("warn")`` as in ``host_syncs.py`` (target 0), and of the stock call;
max difference of each packed output from the stock one on the real tokens.

    python bench/linear_attention.py --out linear_attention.json                   # GPU, bf16, 16k and 32k tokens
    python bench/linear_attention.py --smoke                                        # CPU, tiny, fp32

Run it twice on the GPU machine to see the stock layer with and without fla: once as installed, once with
the wheels of /work/wheels/fla/ (fla-core, flash-linear-attention, einops) on ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from host_syncs import count_steady  # noqa: E402

import _common as C  # noqa: E402
from tfcompat.core.linear_attention import (  # noqa: E402
    available_conv_backends,
    available_rule_backends,
    linear_attention,
    linear_attention_params,
    select_conv_backend,
    select_rule_backend,
)
from tfcompat.core.packing import from_lengths  # noqa: E402

FULL = dict(hidden_size=4096, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4)
SMOKE = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=6, linear_conv_kernel_dim=4)


def build_layer(shape: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    config = m.Qwen3_5TextConfig(vocab_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=16, layer_types=["linear_attention"],
                                 hidden_act="silu", rms_norm_eps=1e-6, **shape)
    torch.manual_seed(0)
    layer = m.Qwen3_5GatedDeltaNet(config, 0)
    with torch.no_grad():  # trained-like magnitudes: small projections, decays spread over (0.5, 3.5)
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.rand_like(p).mul(3).add(0.5).log())
            elif p.ndim > 1:
                p.normal_(0, p.shape[-1] ** -0.5)
    return layer.to(device, dtype)


def packed_forward(layer: torch.nn.Module, hidden: torch.Tensor, seqs, **backends) -> torch.Tensor:
    """What a family patch runs: the layer's projections, the packed core, its gated norm and out projection.

    hidden: ``(T, hidden)``; returns ``(T, hidden)``.
    """
    core = linear_attention(layer.in_proj_qkv(hidden), layer.in_proj_a(hidden), layer.in_proj_b(hidden),
                            linear_attention_params(layer), seqs, **backends)  # (T, Hv, Dv)
    z = layer.in_proj_z(hidden).unflatten(-1, (layer.num_v_heads, layer.head_v_dim))  # (T, Hv Dv) -> (T, Hv, Dv)
    out = layer.norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))  # (T Hv, Dv)
    return layer.out_proj(out.reshape(hidden.shape[0], -1))  # (T Hv, Dv) -> (T, Hv Dv) -> (T, hidden)


def padded(hidden: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(T, H)`` -> right-padded ``(N, L_max, H)``, its ``(N, L_max)`` mask, and the flat index of real tokens."""
    n, longest = len(lengths), max(lengths)
    mask = torch.zeros(n, longest, dtype=torch.long)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    real = mask.flatten().nonzero().flatten().to(hidden.device)
    batch = hidden.new_zeros(n * longest, hidden.shape[1]).index_copy(0, real, hidden).view(n, longest, -1)
    return batch, mask.to(hidden.device), real


def stock_kernels() -> str:
    """Which optional packages the stock layer can use: transformers takes fla's rule and causal-conv1d's conv
    whenever they import (5.2-5.14 through ``is_*_available()`` at import, 5.15+ through the hub-kernel decorator)."""
    found = {name: importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d")}
    return (f"rule {'fla' if found['fla'] else 'torch fallback'}, "
            f"conv {'causal_conv1d' if found['causal_conv1d'] else 'torch'}")


def main() -> None:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--tokens", default=None,
                   help="comma-separated packed token counts (default 16384,32768; smoke 300)")
    p.add_argument("--seqs", type=int, default=8, help="sequences per packed row (default 8)")
    args = p.parse_args()
    smoke = args.smoke
    device = C.device_for(smoke)
    dtype = torch.float32 if smoke else torch.bfloat16
    warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
    reps = args.reps if args.reps is not None else (2 if smoke else 10)
    totals = [int(t) for t in (args.tokens or ("300" if smoke else "16384,32768")).split(",")]
    warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch.*")
    import transformers

    transformers.logging.set_verbosity_error()  # the stock fallback notices

    info = C.machine(device)
    layer = build_layer(SMOKE if smoke else FULL, device, dtype)
    probe = torch.zeros(1, device=device, dtype=dtype)
    info["linear_backends"] = {"rule": available_rule_backends(probe), "conv": available_conv_backends(probe)}
    info["stock_kernels"] = stock_kernels()
    print(C.machine_line(info))
    print(f"stock layer kernels: {info['stock_kernels']}; tfcompat usable: {info['linear_backends']}")
    variants = {"packed torch": {"backend": "torch", "conv_backend": "torch"}}
    fast = {"backend": select_rule_backend(probe), "conv_backend": select_conv_backend(probe)}
    if fast != {"backend": "torch", "conv_backend": "torch"}:
        variants[f"packed {fast['backend']}+{fast['conv_backend']}"] = {"backend": "auto", "conv_backend": "auto"}

    params = list(layer.parameters())
    rows, results = [], []
    for total in totals:
        lengths = C.random_lengths(total, args.seqs, seed=total, min_len=min(256, total // args.seqs))
        seqs = from_lengths(lengths, device)
        gen = torch.Generator().manual_seed(1)
        hidden = torch.randn(total, layer.hidden_size, generator=gen).to(device, dtype).requires_grad_()
        batch, mask, real = padded(hidden.detach(), lengths)
        batch.requires_grad_()
        grad_out = torch.randn(total, layer.hidden_size, generator=gen).to(device, dtype)
        grad_batch = grad_out.new_zeros(batch.numel() // batch.shape[-1], batch.shape[-1]).index_copy(
            0, real, grad_out).view_as(batch)

        fwd = {"stock padded": lambda: layer(batch, attention_mask=mask)}
        bwd = {"stock padded": lambda: torch.autograd.grad(layer(batch, attention_mask=mask), [batch, *params],
                                                           grad_batch)}
        for name, kw in variants.items():
            fwd[name] = lambda kw=kw: packed_forward(layer, hidden, seqs, **kw)
            bwd[name] = lambda kw=kw: torch.autograd.grad(packed_forward(layer, hidden, seqs, **kw),
                                                          [hidden, *params], grad_out)
        with torch.no_grad():
            ref = layer(batch, attention_mask=mask).flatten(0, 1).index_select(0, real).float()
            diffs = {name: float((fn().float() - ref).abs().max())
                     for name, fn in fwd.items() if name != "stock padded"}
            t_fwd = C.time_interleaved(fwd, device, warmup, reps)
        t_bwd = C.time_interleaved(bwd, device, warmup, reps)
        syncs = {name: count_steady(fn, device)[0] for name, fn in bwd.items()}
        for name in fwd:
            f, b = C.median(t_fwd[name]), C.median(t_bwd[name])
            rows.append([total, name, f, b, C.median(t_bwd["stock padded"]) / b, syncs[name],
                         diffs.get(name, 0.0)])
            results.append({"tokens": total, "lengths": lengths, "variant": name, "fwd_ms": f, "fwd_bwd_ms": b,
                            "host_syncs_fwd_bwd": syncs[name], "max_abs_diff_vs_stock": diffs.get(name)})
    print(C.table(["tokens", "variant", "fwd ms", "fwd+bwd ms", "speed-up fwd+bwd", "host syncs", "max |diff|"],
                  rows))
    print("host syncs: one layer's forward+backward after warm-up (None on CPU); max |diff|: packed output vs "
          "stock padded on the real tokens")
    C.write_json(args.out, {"machine": info, "shape": SMOKE if smoke else FULL, "dtype": str(dtype),
                            "results": results})


if __name__ == "__main__":
    main()
