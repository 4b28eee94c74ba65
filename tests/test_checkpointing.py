"""Gradient checkpointing: recomputation replays the packed boundaries (kwargs, or the 4.53 GLM-4V bridge)."""

from __future__ import annotations

import pytest
import torch

import tfcompat
from tests.helpers import pack, packed_inputs, skip_if_stock_rejects_videos
from tfcompat.registry import installed_families
from tfcompat.selfcheck import sample_case, sample_sequences, tiny_model


@pytest.mark.parametrize("family", sorted(installed_families()))
def test_checkpointed_backward_equals_plain_backward(family):
    lengths, items = sample_case(family)
    skip_if_stock_rejects_videos(family, items)
    grads = []
    for checkpointing in (False, True):
        model = tiny_model(family, "sdpa").train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        inputs = packed_inputs(model, sample_sequences(model, lengths, items, seed=6))  # as this release takes them
        with tfcompat.patch(model):
            model(**inputs, use_cache=False).logits.float().pow(2).mean().backward()
            # a second, differently packed forward before nothing else: boundaries must not leak between calls
            other = pack(model, sample_sequences(model, [3, 4], [None, None], seed=7))
            with torch.no_grad():
                model(**other, use_cache=False)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    plain, checkpointed = grads
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)


def test_checkpoint_recompute_after_another_forward_uses_its_own_boundaries():
    """Two packed forwards, then both backwards: each recomputation must see its own forward's boundaries."""
    def run(interleaved: bool) -> dict[str, torch.Tensor]:
        model = tiny_model("glm4v", "sdpa").train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        a = pack(model, sample_sequences(model, [7, 12, 5], [None, None, None], seed=8))
        b = pack(model, sample_sequences(model, [10, 4], [None, None], seed=9))
        with tfcompat.patch(model):
            if interleaved:
                loss_a = model(**a, use_cache=False).logits.sum()
                loss_b = model(**b, use_cache=False).logits.sum()
                (loss_a + loss_b).backward()
            else:
                model(**a, use_cache=False).logits.sum().backward()
                model(**b, use_cache=False).logits.sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    sequential, interleaved = run(False), run(True)
    for name in sequential:
        torch.testing.assert_close(interleaved[name], sequential[name], atol=1e-5, rtol=1e-5, msg=name)
