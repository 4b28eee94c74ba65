"""Functions run on every rank by `tests.distributed.harness.run_world` for the attention features under Ulysses
(module level so spawn can import them): the sharded adapter against the single-process core, model-free."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tfcompat.core.attention import AttentionFeatures, varlen_attention
from tfcompat.core.context import CONTEXT_KWARG, ForwardContext
from tfcompat.core.packing import chunked, from_lengths
from tfcompat.hf.attention import FEATURES_ATTR, packed_attention


class _Attention(torch.nn.Module):
    def __init__(self, features: AttentionFeatures, sinks: torch.Tensor) -> None:
        super().__init__()
        setattr(self, FEATURES_ATTR, features)
        self.sinks = torch.nn.Parameter(sinks.clone())


def sharded_equals_single(rank: int, world: int, hq: int, hkv: int, dqk: int, dv: int, lengths: list[int],
                          window: int | None, softcap: float | None, with_sinks: bool, chunk: int | None,
                          via_s_aux: bool) -> None:
    """`packed_attention` over the sp group (this rank's tokens in, heads exchanged, sinks sliced to its heads)
    equals the single-process core on the whole row, per token, forward and backward (q, k, v, sinks)."""
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(5)  # the same global tensors on every rank
    total = sum(lengths)
    assert total % world == 0, "test lengths must divide over the ranks"
    q, k, v = (torch.randn(total, h, d, generator=gen) for h, d in ((hq, dqk), (hkv, dqk), (hkv, dv)))
    sinks = torch.randn(hq, generator=gen)
    grad = torch.randn(total, hq, dv, generator=gen)
    features = AttentionFeatures(window, softcap, with_sinks, chunk)
    seqs = from_lengths(lengths)

    ref_in = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    ref = varlen_attention(*ref_in[:3], chunked(seqs, chunk) if chunk else seqs, scale=0.3, window=window,
                           softcap=softcap, sinks=ref_in[3] if with_sinks else None, backend="sdpa")
    ref.backward(grad)

    n = total // world
    mine = slice(rank * n, (rank + 1) * n)
    module = _Attention(features, sinks)
    # (T, H, D) -> this rank's (1, H, T/sp, D), transformers' layout
    local = [x[mine].transpose(0, 1)[None].clone().requires_grad_() for x in (q, k, v)]
    kwargs = {CONTEXT_KWARG: ForwardContext(seqs, group=group), "sliding_window": window}
    if via_s_aux:
        kwargs["s_aux"] = module.sinks if with_sinks else None
    out, _ = packed_attention(module, *local, None, scaling=0.3, **kwargs)
    assert out.shape == (1, n, hq, dv), out.shape
    torch.testing.assert_close(out[0], ref[mine], atol=1e-6, rtol=1e-6, msg=lambda m: f"rank {rank} out: {m}")
    out[0].backward(grad[mine])
    for name, got, want in zip("qkv", local, ref_in):
        torch.testing.assert_close(got.grad[0].transpose(0, 1), want.grad[mine], atol=1e-6, rtol=1e-6,
                                   msg=lambda m, name=name: f"rank {rank} d{name}: {m}")
    if with_sinks:
        dsinks = module.sinks.grad.clone()
        heads = hq // world  # this rank's heads only: the others' sinks get no gradient here
        others = torch.ones(hq, dtype=torch.bool)
        others[rank * heads:(rank + 1) * heads] = False
        assert torch.equal(dsinks[others], torch.zeros(hq - heads)), f"rank {rank}: sinks grad outside its heads"
        dist.all_reduce(dsinks, group=group)  # what data parallelism over the sp group sums
        torch.testing.assert_close(dsinks, ref_in[3].grad, atol=1e-6, rtol=1e-6,
                                   msg=lambda m: f"rank {rank} dsinks: {m}")
    else:
        assert module.sinks.grad is None
