"""Rank functions for the linear-attention Ulysses tests (module level so spawn can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tfcompat.core.linear_attention import LinearAttentionParams, LinearHeads, linear_attention
from tfcompat.core.packing import from_lengths


def _inputs(lengths: list[int], heads: LinearHeads, width: int = 4) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same seeded packed inputs on every rank: [mixed_qkv, a, b] and [conv weight, bias, A_log, dt_bias]."""
    gen = torch.Generator().manual_seed(11)
    t, hv = sum(lengths), heads.num_v_heads
    tokens = [torch.randn(t, heads.conv_dim, generator=gen), torch.randn(t, hv, generator=gen),
              torch.randn(t, hv, generator=gen)]
    params = [torch.randn(heads.conv_dim, width, generator=gen) * 0.5, torch.randn(heads.conv_dim, generator=gen),
              torch.rand(hv, generator=gen).mul(3).add(0.5).log(), torch.randn(hv, generator=gen)]
    return tokens, params


def _leaves(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    return [t.detach().to(device).requires_grad_() for t in tensors]


def linear_sp_equals_single(rank: int, world: int, lengths: list[int], heads: tuple[int, int, int, int]) -> None:
    """`linear_attention` under Ulysses on ``world`` ranks equals the single-process run per token, and so do the
    gradients of its inputs (this rank's tokens) and parameters (summed over ranks). Over NCCL each rank runs on
    ``cuda:rank`` in fp32 with TF32 off."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    heads = LinearHeads(*heads)
    pad = -sum(lengths) % world
    lengths = lengths + ([pad] if pad else [])  # the pad forms its own sequence, as in shard_inputs
    seqs = from_lengths(lengths, device)
    tokens, params = _inputs(lengths, heads)
    out_weight = torch.randn(seqs.total, heads.num_v_heads, heads.head_v_dim,
                             generator=torch.Generator().manual_seed(12)).to(device)

    ref_tokens, ref_params = _leaves(tokens, device), _leaves(params, device)
    ref = linear_attention(*ref_tokens, LinearAttentionParams(heads, *ref_params[:2], "silu", *ref_params[2:]), seqs)
    (ref * out_weight).sum().backward()

    n = seqs.total // world
    local = slice(rank * n, (rank + 1) * n)
    my_tokens, my_params = _leaves([t[local] for t in tokens], device), _leaves(params, device)
    out = linear_attention(*my_tokens, LinearAttentionParams(heads, *my_params[:2], "silu", *my_params[2:]), seqs,
                           group=dist.group.WORLD)
    assert out.shape == (n, heads.num_v_heads, heads.head_v_dim), tuple(out.shape)
    (out * out_weight[local]).sum().backward()

    diff = float((out - ref[local]).detach().abs().max())
    assert diff <= 1e-5, f"rank {rank}: sp={world} output differs from sp=1 by {diff:.3e}"
    for name, mine, theirs in zip(["mixed_qkv", "a", "b"], my_tokens, ref_tokens):
        gdiff = float((mine.grad - theirs.grad[local]).abs().max())
        assert gdiff <= 1e-5, f"rank {rank}: grad {name} differs by {gdiff:.3e}"
    for name, mine, theirs in zip(["conv weight", "conv bias", "A_log", "dt_bias"], my_params, ref_params):
        grad = mine.grad.clone()
        dist.all_reduce(grad)  # each rank holds the gradient of its heads' and tokens' share
        scale = max(1.0, float(theirs.grad.abs().max()))
        gdiff = float((grad - theirs.grad).abs().max())
        assert gdiff <= 1e-5 * scale, f"rank {rank}: grad {name} differs by {gdiff:.3e} (scale {scale:.2e})"
