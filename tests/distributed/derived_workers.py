"""Ulysses workers for derived families (`tests.test_derived`'s tiny models), run by `run_world` on every rank."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import tfcompat
from tests.distributed.workers import sharded_logits
from tests.test_derived import BASE, packed, sequences, tiny


def sp_equals_single(rank: int, world: int, model_type: str) -> None:
    """SP forward and backward of a derived type on ``world`` ranks equal the single-process packed run, per token
    and for every parameter's gradient (experts, sinks and MLA projections included)."""
    warnings.simplefilter("ignore")
    model = tiny(model_type, "eager")
    inputs = packed(sequences(seed=5))
    weight = torch.randn(BASE["vocab_size"], generator=torch.Generator().manual_seed(9))

    with tfcompat.patch(model):  # SP = 1 reference, on every rank
        ref_logits = model(**inputs).logits[0]
        (ref_logits @ weight).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    with tfcompat.patch(model, ulysses_group=dist.group.WORLD):
        logits = sharded_logits(model, inputs, dist.group.WORLD)
        (logits @ weight).sum().backward()

    diff = float((logits - ref_logits).abs().max())
    assert diff <= 1e-5, f"rank {rank}: SP={world} logits differ from SP=1 by {diff:.3e}"
    for name, ref in ref_grads.items():
        param = dict(model.named_parameters())[name]
        g = param.grad.clone() if param.grad is not None else torch.zeros_like(ref)  # no tokens routed here
        dist.all_reduce(g)  # each rank holds its tokens' share of the gradient
        scale = max(1.0, float(ref.abs().max()))
        gdiff = float((g - ref).abs().max())
        assert gdiff <= 1e-5 * scale, f"rank {rank}: grad {name} differs by {gdiff:.3e} (scale {scale:.2e})"
