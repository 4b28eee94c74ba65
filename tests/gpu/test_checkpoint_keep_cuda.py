"""`patch(model, checkpoint_keep=...)` on CUDA with the backends and kernels users run there (attention "auto", which
is FlashAttention-4 where installed, and Liger's fused kernels where installed), against the same patch with full
recompute: the loss and every gradient within fp32 tolerance, and no attention call in the backward.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import tfcompat
from tests.helpers import pack
from tfcompat.hf import attention as hf_attention
from tfcompat.selfcheck import sample_sequences, tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine")]

DEVICE = "cuda"
DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
            head_dim=64)


def _fused() -> str | bool:
    try:
        importlib.import_module("liger_kernel.ops")
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_kept_outputs_equal_full_recompute(family, dtype, monkeypatch):
    """Rule: kept attention and MLP outputs (every layer's, and a per-layer policy with "mlp_in") change no
    gradient (fp32: rel 1e-5 of each tensor's scale; bf16, where the backend may pick other kernels per call: within
    the bf16 difference of two full-recompute runs x2 + 1e-2) and the attention core runs only in the forward of the
    layers keeping attention."""
    fused = _fused()
    calls = [0, 0]
    core = hf_attention.varlen_attention

    def counted(*args, **kwargs):
        calls[int(torch._C._current_graph_task_id() != -1)] += 1
        return core(*args, **kwargs)

    monkeypatch.setattr(hf_attention, "varlen_attention", counted)
    model = tiny_model(family, "sdpa", **DIMS).to(DEVICE, dtype).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seqs = sample_sequences(model, [7, 130, 1, 61, 300], [None] * 5, seed=4)
    inputs = {k: v.to(DEVICE) for k, v in pack(model, seqs).items()}

    def step(keep):
        model.zero_grad(set_to_none=True)
        calls[:] = [0, 0]
        with tfcompat.patch(model, fused=fused, checkpoint_keep=keep):
            loss = model(**inputs, use_cache=False).logits[0].float().square().mean()
            loss.backward()
        grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
        return float(loss), grads, list(calls)

    loss_full, full, calls_full = step(())
    loss_again, again, _ = step(())
    layers = DIMS["num_hidden_layers"]
    assert calls_full == [layers, layers], calls_full
    # every layer's attention and MLP; then attention in the last 2 layers, the MLP in the last, gate/up elsewhere
    for keep, recomputed in ((("attention", "mlp"), 0), ({"attention": 2, "mlp": 1, "mlp_in": 1.0}, 1)):
        loss_kept, kept, calls_kept = step(keep)
        assert calls_kept == [layers, recomputed], (keep, calls_kept)
        assert kept.keys() == full.keys()
        for n, g in kept.items():
            scale = float(full[n].abs().max())
            noise = float((again[n] - full[n]).abs().max())
            bound = 1e-5 * max(scale, 1e-6) if dtype == torch.float32 else 2 * noise + 1e-2 * scale
            assert float((g - full[n]).abs().max()) <= bound, (keep, n)
        assert abs(loss_kept - loss_full) <= max(2 * abs(loss_again - loss_full), 1e-5 * abs(loss_full)), keep


@pytest.mark.parametrize("keep", ["attention", {"attention": 2}])
def test_a_kept_module_that_draws_random_numbers_leaves_the_later_draws_as_in_the_forward(keep, monkeypatch):
    """Rule: with a dropout inside the kept module (Starcoder2's residual dropout in its attention) the recompute
    skips the module but the layer's later draws on the CUDA generator get the forward's numbers: the gradients equal
    full checkpointing's with the same seed (within twice the difference of two full runs). The control (the CUDA
    generator not moved past the skipped module) gives other masks, so the test can fail."""
    from tfcompat.hf import checkpointing

    model = tiny_model("starcoder2", "sdpa", num_hidden_layers=3, residual_dropout=0.1, **{
        k: v for k, v in DIMS.items() if k != "num_hidden_layers"}).to(DEVICE).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seqs = sample_sequences(model, [7, 130, 61], [None] * 3, seed=4)
    inputs = {k: v.to(DEVICE) for k, v in pack(model, seqs).items()}

    def grads(keep, restore=True):
        model.zero_grad(set_to_none=True)
        if not restore:
            monkeypatch.setattr(checkpointing._Rng, "restore", lambda self: None)
        with tfcompat.patch(model, checkpoint_keep=keep):
            torch.manual_seed(7)
            model(**inputs, use_cache=False).logits.float().pow(2).mean().backward()
        monkeypatch.undo()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    full, again, kept = grads(()), grads(()), grads(keep)
    for n in full:
        noise = float((again[n] - full[n]).abs().max())
        assert float((kept[n] - full[n]).abs().max()) <= 2 * noise + 1e-5 * float(full[n].abs().max()), n
    control = grads(keep, restore=False)
    assert any(float((control[n] - full[n]).abs().max()) > 1e-2 * float(full[n].abs().max()) for n in full)
