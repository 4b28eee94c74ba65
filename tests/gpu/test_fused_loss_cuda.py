"""`fused_loss` on CUDA at a real vocabulary and token count: several blocks of whole rows (bf16 logits, float32
grad_weight accumulated by cuBLAS), against the recomputing head followed by the same loss, values, gradients and
memory."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close
from tfcompat.heads import IGNORE_INDEX, fused_loss, logprobs_entropy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine")]
pytest.importorskip("triton", reason="backend 'triton' needs the triton package")

DEVICE = "cuda"
TOKENS, VOCAB, HIDDEN = 19679, 152064, 256  # 3 blocks of 6,656 rows by default
TEMPERATURE = 0.7


def ppo(lp, ent, adv, old, scale):
    ratio = torch.exp(lp - old)
    return (torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) - 0.01 * ent) * scale


def test_fused_loss_equals_the_recomputing_head_then_the_loss():
    """Rule: the loss is the sum of the per-token terms of its own logprobs and entropy (1e-5); these within two
    bf16 rounding steps of the largest scaled logit of the recomputing head's (another matmul shape may round a logit
    differently); gradients within 5e-2 of each one's largest entry, every labelled row's gradient nonzero and every
    ignored one zero; the peak below the recomputing head's plus one block of logits, far below the kept logits."""
    gen = torch.Generator(DEVICE).manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen, device=DEVICE).bfloat16()
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen, device=DEVICE) / HIDDEN**0.5).bfloat16()
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=gen, device=DEVICE)
    labels[torch.rand(TOKENS, generator=gen, device=DEVICE) < 0.1] = IGNORE_INDEX
    valid = labels != IGNORE_INDEX
    adv = torch.randn(TOKENS, generator=gen, device=DEVICE)
    with torch.no_grad():
        old = logprobs_entropy(hidden, weight, labels, TEMPERATURE).logprobs
    old = old + 0.2 * torch.randn(TOKENS, generator=gen, device=DEVICE)
    scale = 1.0 / int(valid.sum())

    def run(fused: bool):
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if fused:
            out = fused_loss(h, w, labels, ppo, adv, old, scale, temperature=TEMPERATURE)
            loss, lp, ent = out
        else:
            lp, ent = logprobs_entropy(h, w, labels, TEMPERATURE)
            loss = torch.where(valid, ppo(lp, ent, adv, old, scale), 0.0).sum()
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), lp.detach(), ent.detach(), h.grad, w.grad, torch.cuda.max_memory_allocated() - base

    got, want = run(True), run(False)
    own = torch.where(valid, ppo(got[1], got[2], adv, old, scale), 0.0).sum()
    assert_close(got[0], own, atol=1e-5 * own.abs().item(), rtol=0.0, what="loss")
    logit_scale = (hidden.float() @ weight.float()[:4096].T).abs().max().item() / TEMPERATURE
    for name, g, w in zip(("logprobs", "entropy"), got[1:3], want[1:3], strict=True):
        assert_close(g, w, atol=2 * torch.finfo(torch.bfloat16).eps * logit_scale, what=name)
    for name, g, w in zip(("grad_hidden", "grad_weight"), got[3:5], want[3:5], strict=True):
        assert g.dtype == torch.bfloat16, name
        assert_close(g.float(), w.float(), atol=5e-2 * w.abs().max().item(), what=name)
    assert (got[3][valid] != 0).any(dim=-1).all() and (got[3][~valid] == 0).all()
    block = 2 * 6656 * VOCAB  # one block of bf16 logits
    assert got[5] < want[5] + 1.25 * block + 4 * VOCAB * HIDDEN  # and the float32 grad_weight accumulator
    assert got[5] < TOKENS * VOCAB  # half of what kept logits would hold (2 * T * V bytes)
