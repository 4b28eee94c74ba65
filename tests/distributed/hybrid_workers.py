"""Rank functions for the hybrid families (Gated DeltaNet + gated attention) under Ulysses (spawned by run_world)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import tfcompat
from tests.distributed.workers import assert_summed_grads_equal, sharded_logits
from tests.helpers import pack
from tfcompat.selfcheck import sample_sequences, tiny_model


def _all_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def hybrid_sp_equals_single(rank: int, world: int, family: str, lengths: list[int], items: list) -> None:
    """SP logits and every parameter's gradient (linear-attention, MoE and vision tower included) equal the
    single-process packed run; the tower runs whole images first (embed_inputs), then the row is sliced."""
    warnings.simplefilter("ignore")
    model = tiny_model(family, "sdpa")
    inputs = pack(model, sample_sequences(model, lengths, items, seed=5))
    weight = torch.randn(model.config.get_text_config().vocab_size, generator=torch.Generator().manual_seed(9))
    assert "pixel_values" in inputs or not any(items), "the sample must hold an image"

    with tfcompat.patch(model):  # SP = 1 reference, on every rank
        ref = model(**inputs, use_cache=False).logits[0]
        (ref @ weight).sum().backward()
    ref_grads = _all_grads(model)
    model.zero_grad(set_to_none=True)

    with tfcompat.patch(model, ulysses_group=dist.group.WORLD):
        logits = sharded_logits(model, inputs, dist.group.WORLD)
        (logits @ weight).sum().backward()

    scale = max(1.0, float(ref.abs().max()))
    diff = float((logits - ref).abs().max())
    assert diff <= 1e-5 * scale, f"rank {rank}: SP={world} logits differ from SP=1 by {diff:.3e}"
    grads = _all_grads(model)
    assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
    assert any("linear_attn.conv1d" in n for n in grads)
    assert_summed_grads_equal(rank, grads, ref_grads)


def linear_heads_checked_at_patch(rank: int, world: int, family: str) -> None:
    """3 value heads cannot split over 2 ranks: patch() says so, naming the family, before changing anything."""
    model = tiny_model(family, "sdpa", linear_num_key_heads=1, linear_num_value_heads=3)
    try:
        tfcompat.patch(model, ulysses_group=dist.group.WORLD)
    except tfcompat.PatchError as exc:
        assert "1 key / 3 value heads" in str(exc) and family in str(exc), str(exc)
    else:
        raise AssertionError("3 linear-attention value heads over 2 ranks were not rejected at patch()")
    assert not tfcompat.is_patched(model)
