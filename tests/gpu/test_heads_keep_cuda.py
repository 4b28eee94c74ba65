"""`logprobs_entropy(..., keep_logits=True)` on CUDA at a size the CPU tests cannot reach: one kept (T, V) tile of
more than 2**31 logits (int64 row offsets in both Triton kernels, cuBLAS on the whole matrices), against the
recomputing tiles of the default backend, values and gradients; and the kept logits are the extra memory.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close
from tfcompat.heads import IGNORE_INDEX, logprobs_entropy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine")]
pytest.importorskip("triton", reason="backend 'triton' needs the triton package")

DEVICE = "cuda"
TOKENS, VOCAB, HIDDEN = 16500, 131072, 64  # 2.16e9 logits > 2**31: the last rows sit past int32 offsets


def _step(hidden, weight, labels, upstream, keep_logits):
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    out = logprobs_entropy(hidden, weight, labels, 0.7, backend="triton", keep_logits=keep_logits)
    ((upstream[0] * out.logprobs).sum() + (upstream[1] * out.entropy).sum()).backward()
    return out.logprobs.detach(), out.entropy.detach(), hidden.grad, weight.grad


def test_kept_logits_beyond_int32_offsets_match_recompute():
    """Rule: the kept path's logprobs and entropy within two bf16 rounding steps of the largest scaled logit of the
    recomputing path's (the two may round a logit differently: another matmul shape), gradients within 5e-2 of
    each one's largest entry (bf16 products summed in another order), and every row's gradient nonzero where its
    label is kept (a row past the int32 offsets that the kernels skipped would be 0)."""
    assert TOKENS * VOCAB > 2**31
    gen = torch.Generator(DEVICE).manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen, device=DEVICE).bfloat16()
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen, device=DEVICE) / HIDDEN**0.5).bfloat16()
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=gen, device=DEVICE)
    labels[torch.rand(TOKENS, generator=gen, device=DEVICE) < 0.1] = IGNORE_INDEX
    upstream = torch.randn(2, TOKENS, generator=gen, device=DEVICE)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    kept = _step(hidden, weight, labels, upstream, keep_logits=True)
    kept_peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    recomputed = _step(hidden, weight, labels, upstream, keep_logits=False)
    recomputed_peak = torch.cuda.max_memory_allocated() - base
    scale = (hidden.float() @ weight.float()[:4096].T).abs().max().item() / 0.7  # order of the largest logit
    for name, got, want in zip(("logprobs", "entropy"), kept[:2], recomputed[:2], strict=True):
        assert_close(got, want, atol=2 * torch.finfo(torch.bfloat16).eps * scale, what=name)
    for name, got, want in zip(("grad_hidden", "grad_weight"), kept[2:], recomputed[2:], strict=True):
        assert_close(got.float(), want.float(), atol=5e-2 * want.abs().max().item(), what=name)
    valid = labels != IGNORE_INDEX
    assert (kept[2][valid] != 0).any(dim=-1).all(), "a kept row got no gradient"
    assert (kept[2][~valid] == 0).all()
    # the kept (T, V) bf16 logits are the extra memory; the recomputing tiles hold about T * H logits at a time
    assert kept_peak >= 2 * TOKENS * VOCAB > 4 * recomputed_peak
