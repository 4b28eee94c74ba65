"""Gradient checkpointing: recomputation replays the packed boundaries (kwargs, or a decoder layer's pre-hook)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import tfcompat
from tests import every_type
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


@pytest.mark.parametrize("model_type", ["mllama", "mamba", "qwen2"])
def test_layers_called_without_kwargs_under_checkpointing(model_type):
    """Rule: where the text model calls its decoder layers with positional arguments alone under gradient
    checkpointing (Mllama's on transformers 4.53-4.54; Mamba's, whose mixers take the context from the layer), the
    layer's pre-hook hands the module the forward's context, and finds it again in the recompute by the layer's
    input: two packed rows equal stock per sequence, logits and gradients (qwen2: the kwargs path, the control)."""
    model = every_type.build(model_type, "eager")
    diff, grads = every_type.two_rows_checkpointed(model)
    assert diff <= every_type.TOLERANCE and grads <= every_type.GRAD_TOLERANCE, (diff, grads)


@pytest.mark.parametrize("model_type", ["mllama", "mamba", "qwen2"])
def test_an_ordinary_call_recomputed_runs_stock(model_type):
    """Rule: an ordinary (padded, unpacked) call of a patched model under non-reentrant checkpointing recomputes
    with the stock attention and mixers, also where the layers get no kwargs (the pre-hook remembers the stock
    context by the layer's input): the gradients equal the unpatched model's."""
    model = every_type.build(model_type, "eager")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    seqs = every_type.sample_sequences(model.config, lengths=(7, 5))
    ids = torch.stack([seqs[0], torch.cat([seqs[1], seqs[1][:2]])])  # (2, 7): the second right-padded by 2
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    w = every_type.projection(model.config.vocab_size)

    def grads(patched: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with tfcompat.patch(model) if patched else contextlib.nullcontext():
            ((model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float() @ w) * mask).sum().backward()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    stock, patched = grads(False), grads(True)
    assert stock.keys() == patched.keys()
    assert every_type.compare_gradients(patched, stock) <= every_type.GRAD_TOLERANCE
