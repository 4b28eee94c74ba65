"""heads.model_logprobs: a (patched) model returns log-probs and entropy instead of logits."""

from __future__ import annotations

import pytest
import torch

import tfcompat
from tests.helpers import pack
from tfcompat import heads
from tfcompat.selfcheck import sample_sequences, tiny_model

TRITON_USABLE = heads._has_triton() and (torch.cuda.is_available() or heads._triton_interpreted())
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(
        not TRITON_USABLE, reason="backend 'triton' needs triton, and CUDA or TRITON_INTERPRET=1 (nox -s triton)")),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["qwen2_vl", "llama"])
def test_patched_model_logprobs_equal_the_logits_path(family, backend):
    model = tiny_model(family, "sdpa")
    items = [None, (1, 4, 6)] if family == "qwen2_vl" else [None, None]
    inputs = pack(model, sample_sequences(model, [7, 10], items, seed=3))
    labels = torch.roll(inputs["input_ids"], -1, dims=1)
    labels[0, -1] = -100
    if backend == "triton" and not heads._triton_interpreted():  # compiled kernels: on the GPU
        model = model.cuda()
        inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        labels = labels.cuda()
    with tfcompat.patch(model):
        got = tfcompat.heads.model_logprobs(model, labels, 0.7, backend=backend, chunk_size=5, use_cache=False,
                                             **inputs)
        logits = model(**inputs, use_cache=False).logits.float() / 0.7
    logp = torch.log_softmax(logits, -1)
    keep = labels != -100
    expected = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    assert got.logprobs.shape == labels.shape and got.logprobs.dtype == torch.float32
    torch.testing.assert_close(got.logprobs[keep], expected[keep], atol=1e-5, rtol=0)
    torch.testing.assert_close(got.entropy[keep], entropy[keep], atol=1e-5, rtol=0)
    assert float(got.logprobs[~keep].abs().max()) == 0.0
