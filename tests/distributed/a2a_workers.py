"""Functions run on every rank by `tests.distributed.harness.run_world` for the fused q/k/v exchange (module level so
spawn can import them). The backend is whatever the harness started: gloo on CPU, NCCL on ``cuda:rank``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tfcompat import ulysses


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def fused_equals_separate(rank: int, world: int, hq: int, hkv: int, dim: int, t_local: int, dtype_name: str,
                          strided: bool, transport: str = "all_to_all") -> None:
    """`ulysses.qkv_to_heads` (one exchange) equals the definition and three `seq_to_heads` after
    repeat_interleave, forward and backward; `heads_to_seq` of its q gives the shard back."""
    group, device, dtype = dist.group.WORLD, _device(), getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(7)  # the same global tensors on every rank
    if strided:  # (T, H, D) views of (H, T, D) memory, as transformers hands attention its tensors
        fulls = [torch.randn(h, world * t_local, dim, generator=gen).to(device, dtype).transpose(0, 1)
                 for h in (hq, hkv, hkv)]
    else:
        fulls = [torch.randn(world * t_local, h, dim, generator=gen).to(device, dtype) for h in (hq, hkv, hkv)]
    mine = slice(rank * t_local, (rank + 1) * t_local)
    repeat = ulysses.kv_repeats(hkv, world)

    fused_in = [f[mine].detach().requires_grad_() for f in fulls]
    fused = ulysses.qkv_to_heads(*fused_in, group, transport)
    separate_in = [f[mine].detach().requires_grad_() for f in fulls]
    separate = [ulysses.seq_to_heads(x if i == 0 else x.repeat_interleave(repeat, dim=1), group, transport)
                for i, x in enumerate(separate_in)]
    for i, (got, want, full) in enumerate(zip(fused, separate, fulls)):
        full = full if i == 0 else full.repeat_interleave(repeat, dim=1)
        h = full.shape[1] // world
        assert torch.equal(got, full[:, rank * h:(rank + 1) * h]), f"rank {rank}: tensor {i} is not the definition"
        assert torch.equal(got, want), f"rank {rank}: tensor {i} differs from its separate exchange"
    assert torch.equal(ulysses.heads_to_seq(fused[0], group, transport), fulls[0][mine])

    weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(rank + 11 * i)).to(device, dtype)
               for i, o in enumerate(fused)]
    torch.autograd.backward(list(fused), weights)
    torch.autograd.backward(separate, weights)
    for i, (a, b) in enumerate(zip(fused_in, separate_in)):
        if i == 0 or repeat <= 2:  # at most two addends per KV head: the sum's order cannot matter
            assert torch.equal(a.grad, b.grad), f"rank {rank}: grad {i} differs"
        else:
            bound = repeat * torch.finfo(dtype).eps * float(b.grad.abs().max()) * repeat
            diff = float((a.grad.float() - b.grad.float()).abs().max())
            assert diff <= bound, f"rank {rank}: grad {i} differs by {diff:.3e} (bound {bound:.3e})"


def fused_transports_agree(rank: int, world: int) -> None:
    """NCCL: the fused exchange over symm_mem is bit-identical to all_to_all, forward and backward, on a burst.

    Shapes grow, shrink and grow again (workspace growth), with KV heads below, at and above the group size;
    the burst is issued without syncs, and rank 0 stalls its stream before every other exchange, so a rank that
    rewrote a workspace half too early would corrupt a peer's read.
    """
    group, device = dist.group.WORLD, _device()
    # (T/sp, Hq/sp, Hkv, D)
    shapes = [(16, 2, 1, 8), (1024, 4, 2, 128), (8, 1, 1, 64), (4096, 8, 1, 128), (3, 2, 2, 16)]
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator().manual_seed(rank)
        cases = []
        for t, hq, hkv, d in shapes:
            hkv = hkv * world if hkv > 1 else hkv  # > sp (2 per rank) or 1 (< sp: repeated)
            qkv = [torch.randn(h, t, d, generator=gen).to(device, dtype).transpose(0, 1)
                   for h in (hq * world, hkv, hkv)]
            rep = ulysses.kv_repeats(hkv, world)
            grads = [torch.randn(t * world, h * rep // world if i else hq, d, generator=gen).to(device, dtype)
                     for i, h in enumerate((hq * world, hkv, hkv))]
            cases.append((qkv, grads))
        results = {}
        for transport in ("all_to_all", "symm_mem"):
            outs = []
            for i, (qkv, grads) in enumerate(cases):
                if rank == 0 and i % 2 == 0:
                    torch.cuda._sleep(2_000_000)  # about a millisecond
                inputs = [x.detach().requires_grad_() for x in qkv]
                heads = ulysses.qkv_to_heads(*inputs, group, transport)
                back = ulysses.heads_to_seq(heads[0], group, transport)
                torch.autograd.backward([*heads, back], [*grads, torch.ones_like(back)])
                outs += [h.detach().clone() for h in heads] + [back.detach()] + [x.grad for x in inputs]
            results[transport] = outs
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(results["all_to_all"], results["symm_mem"])):
            assert torch.equal(a, b), f"rank {rank} {dtype}: tensor {i} differs between the transports"
