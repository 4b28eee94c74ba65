"""Functions run on every rank by `tests.distributed.harness.run_world` (backend nccl) (module level so spawn can
import them).

Same logic as `tests.distributed.workers.sp_equals_single`, on ``cuda:rank`` under NCCL (or CPU under gloo), with a
dtype and a backend: the SP=1 reference is computed on every rank with the same dtype and backend, then the
SP run, `gather_outputs`, loss ``(logits @ w).sum()`` in fp32, gradients all-reduced over the group.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import tfcompat
from tests.distributed.workers import sharded_logits
from tests.helpers import pack
from tfcompat import ulysses
from tfcompat.selfcheck import sample_sequences, tiny_model

WATCHED = ("q_proj", "o_proj", "embed_tokens")


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _loss(logits: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (logits.float() @ weight).sum()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
            if p.grad is not None and any(w in n for w in WATCHED + ("visual",))}


def sp_equals_single(rank: int, world: int, family: str, lengths: list[int], images: list, text: dict,
                     dtype_name: str, backend: str, tol: float, relative_to_max: bool, transport: str = "auto",
                     expect_transport: str | None = None) -> None:
    """SP forward and backward on ``world`` ranks equal the single-process packed run, per token.

    Tolerance: ``|got - ref|.max() <= tol * scale`` with scale ``max(1, |ref|.max())`` (``relative_to_max=False``)
    or ``|ref|.max()`` (``relative_to_max=True``), per tensor (logits, each watched gradient).
    """
    warnings.simplefilter("ignore")
    device, dtype = _device(), getattr(torch, dtype_name)
    # fp32 means IEEE fp32: cuDNN's default TF32 convolutions (the vision tower's patch embedding) round to
    # 10-bit mantissas, and SP sums per-rank partial gradients where SP=1 rounds the full one (seen: 3e-4 relative)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(family, "sdpa", **text)  # built and packed on CPU, then moved
    seqs = sample_sequences(model, lengths, images, seed=5)
    inputs = pack(model, seqs)
    inputs = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in inputs.items()}
    model = model.to(device=device, dtype=dtype)
    vocab = model.config.get_text_config().vocab_size
    weight = torch.randn(vocab, generator=torch.Generator().manual_seed(9)).to(device)

    def scale(ref: torch.Tensor) -> float:
        m = float(ref.abs().max())
        return max(m, 1e-12) if relative_to_max else max(1.0, m)

    with tfcompat.patch(model, remove_padding=True, backend=backend):  # SP = 1 reference, on every rank
        ref_logits = model(**inputs, use_cache=False).logits[0]
        _loss(ref_logits, weight).backward()
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    with tfcompat.patch(model, remove_padding=True, ulysses_group=dist.group.WORLD, backend=backend):
        logits = sharded_logits(model, inputs, dist.group.WORLD, transport, expect_transport)
        _loss(logits, weight).backward()

    diff = float((logits.float() - ref_logits.float()).abs().max())
    bound = tol * scale(ref_logits.float())
    assert diff <= bound, \
        f"rank {rank}: SP={world} {dtype_name} logits differ from SP=1 by {diff:.3e} (bound {bound:.3e})"
    grads = _grads(model)
    assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
    assert grads, "no watched gradients"
    for name, g in grads.items():
        dist.all_reduce(g)  # each rank holds its tokens' share of the gradient
        gdiff = float((g - ref_grads[name]).abs().max())
        bound = tol * scale(ref_grads[name])
        assert gdiff <= bound, f"rank {rank}: {dtype_name} grad {name} differs by {gdiff:.3e} (bound {bound:.3e})"


def exchanges_agree(rank: int, world: int) -> None:
    """symm_mem gives bit-identical results to all_to_all, forward and backward, on bursts of exchanges.

    The shapes grow, shrink and grow again (workspace growth), the burst is issued without syncs, and rank 0
    stalls its stream before every third exchange, so a rank that rewrote a workspace half too early would
    corrupt a peer's read.
    """
    group, device = dist.group.WORLD, _device()
    shapes = [(16, 2, 8), (1024, 4, 128), (8, 2, 64), (4096, 8, 128), (3, 1, 16)]  # (T/sp, H/sp, D)
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator().manual_seed(rank)
        xs = [torch.randn(t, h * world, d, generator=gen).to(device, dtype) for t, h, d in shapes for _ in range(3)]
        weights = [torch.randn(t * world, h, d, generator=gen).to(device, dtype)
                   for t, h, d in shapes for _ in range(3)]
        results = {}
        for transport in ("all_to_all", "symm_mem"):
            outs, grads = [], []
            for i, (x, w) in enumerate(zip(xs, weights)):
                if rank == 0 and i % 3 == 0:
                    torch.cuda._sleep(2_000_000)  # about a millisecond
                x = x.clone().requires_grad_()
                heads = ulysses.seq_to_heads(x, group, transport)
                back = ulysses.heads_to_seq(heads * w, group, transport)
                back.sum().backward()
                outs += [heads.detach(), back.detach()]
                grads.append(x.grad)
            results[transport] = outs + grads
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(results["all_to_all"], results["symm_mem"])):
            assert torch.equal(a, b), f"rank {rank} {dtype}: tensor {i} differs between the transports"
        t, h, d = shapes[1]
        full = [torch.empty_like(xs[3]) for _ in range(world)]  # the definition, for one case
        dist.all_gather(full, xs[3], group=group)
        expect = torch.cat(full)[:, rank * h:(rank + 1) * h]
        assert torch.equal(results["symm_mem"][6], expect), f"rank {rank}: symm_mem seq_to_heads is not the definition"


def shard_inputs_syncs_once(rank: int, world: int) -> None:
    """shard_inputs synchronizes the host with the GPU once (one copy carries the positions and the rank rows)."""
    device = _device()
    lengths = [7, 12, 6]
    ids = torch.randint(3, 100, (1, sum(lengths)), device=device)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    ulysses.shard_inputs(ids, pos, group=dist.group.WORLD)  # warm: workspace-free, but lazy CUDA init
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ulysses.shard_inputs(ids, pos, labels=ids, group=dist.group.WORLD)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, f"rank {rank}: {len(syncs)} host syncs in shard_inputs: {syncs}"
