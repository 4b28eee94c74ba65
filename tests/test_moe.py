"""MoE families: a packed row routes every token to the experts its sequence alone routes it to, and the
sparse-block bugs a registry entry declares are real."""

from __future__ import annotations

import pytest
import torch

import tfcompat
from tests.helpers import pack, skip_if_stock_rejects_videos
from tfcompat.registry import installed_families
from tfcompat.selfcheck import sample_case, sample_sequences, stock_inputs, tiny_model


def _sparse_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock") and hasattr(m, "gate")]


MOE = [k for k in sorted(installed_families()) if _sparse_blocks(tiny_model(k, "sdpa"))]


def _routes(model: torch.nn.Module, run) -> list[torch.Tensor]:
    """Per sparse block, the ``(T, top_k)`` experts each token of ``run()`` is routed to (sorted), from the
    router's own logits."""
    seen: list[list[torch.Tensor]] = [[] for _ in _sparse_blocks(model)]
    hooks = []
    for i, block in enumerate(_sparse_blocks(model)):
        top_k = getattr(block, "top_k", None) or block.gate.top_k

        def hook(module, args, i=i, top_k=top_k):
            hidden = args[0].reshape(-1, module.weight.shape[1])  # (T, H)
            logits = torch.nn.functional.linear(hidden, module.weight)  # (T, E)
            seen[i].append(logits.topk(top_k, dim=-1).indices.sort(dim=-1).values)

        hooks.append(block.gate.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(per_call) for per_call in seen]


@pytest.mark.parametrize("family", MOE)
def test_packed_routes_each_token_as_its_sequence_alone(family):
    lengths, items = sample_case(family)
    skip_if_stock_rejects_videos(family, items)
    r = tfcompat.resolve(family)
    model = tiny_model(family, "sdpa")
    seqs = sample_sequences(model, lengths, items, seed=11)
    alone = _routes(model, lambda: [model(**stock_inputs(r, model, s), use_cache=False) for s in seqs])
    with tfcompat.patch(model):
        packed = _routes(model, lambda: model(**pack(model, seqs), use_cache=False))
    assert len(alone) == len(packed) == len(_sparse_blocks(model))
    for layer, (a, p) in enumerate(zip(alone, packed)):
        assert a.shape == p.shape and torch.equal(a, p), f"layer {layer}: {int((a != p).any(-1).sum())} tokens rerouted"
        assert a.unique().numel() > 1  # the router does pick different experts for different tokens


@pytest.mark.parametrize("family", MOE)
def test_declared_router_dtype_bug_is_real(family):
    """Rule: where an entry declares ``moe_router_dtype``, the stock sparse block fails under autocast over fp32
    weights (verl replaces its forward for this); where none is declared, it runs."""
    entry = tfcompat.resolve(family).entry
    block = _sparse_blocks(tiny_model(family, "sdpa"))[0]
    x = torch.randn(1, 5, block.gate.weight.shape[1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if "moe_router_dtype" in entry.known_issues:
            with pytest.raises(RuntimeError, match="scatter"):
                block(x)
        else:
            block(x)
