"""The heads' input check on CUDA (`tfcompat.heads._check`): its flags read through a side stream once the head's
work is queued, so a bad label or temperature still raises `InvalidInputError` before the call returns, and the
head, meanwhile run on labels it can index, leaves the device usable (no device-side assert)."""

from __future__ import annotations

import pytest
import torch

from tfcompat.errors import InvalidInputError
from tfcompat.heads import IGNORE_INDEX, fused_loss, logprobs_entropy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine")]

DEVICE = "cuda"
TOKENS, VOCAB, HIDDEN = 1037, 5003, 64


def _inputs():
    gen = torch.Generator(DEVICE).manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen, device=DEVICE, requires_grad=True)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen, device=DEVICE) / HIDDEN**0.5).requires_grad_()
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=gen, device=DEVICE)
    labels[::7] = IGNORE_INDEX
    return hidden, weight, labels


def _backends():
    out = ["torch", "logits"]
    try:
        import triton  # noqa: F401

        out.append("triton")
    except ImportError:
        pass
    return out


def _loss(lp, ent):
    return -lp - 0.01 * ent


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8])
def test_narrow_label_dtypes_are_read(dtype):
    """Rule: labels of a narrower integer dtype (int32; uint8 with a small vocabulary, which cannot hold
    IGNORE_INDEX) give the int64 labels' values, and a bad one in them still raises."""
    hidden, weight, labels = _inputs()
    small = 200
    labels = labels.clamp(max=small - 1)
    labels[labels < 0] = 3
    want = logprobs_entropy(hidden, weight[:small], labels, 0.7, backend="torch")
    got = logprobs_entropy(hidden, weight[:small], labels.to(dtype), 0.7, backend="torch")
    assert torch.equal(got.logprobs, want.logprobs)
    bad = labels.to(dtype)
    bad[4] = small + 5
    with pytest.raises(InvalidInputError, match="labels must be token ids"):
        logprobs_entropy(hidden, weight[:small], bad, 0.7, backend="torch")


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("head", ["logprobs_entropy", "fused_loss"])
@pytest.mark.parametrize("bad", ["too large", "negative", "temperature"])
def test_a_bad_input_raises_and_the_device_stays_usable(head, backend, bad):
    hidden, weight, labels = _inputs()
    temperature: float | torch.Tensor = 0.7
    if bad == "too large":
        labels[5] = VOCAB + 3
    elif bad == "negative":
        labels[9] = -5
    else:
        temperature = torch.full((TOKENS,), 0.7, device=DEVICE)
        temperature[11] = 0.0
    call = ((lambda lab, t: logprobs_entropy(hidden, weight, lab, t, backend=backend)) if head == "logprobs_entropy"
            else (lambda lab, t: fused_loss(hidden, weight, lab, _loss, temperature=t, backend=backend)))
    match = "temperature" if bad == "temperature" else r"labels must be token ids in \[0, 5003\)"
    with pytest.raises(InvalidInputError, match=match):
        call(labels, temperature)
    torch.cuda.synchronize()  # a device-side assert in the head would surface here
    good = labels.clamp(max=VOCAB - 1)
    good[good < 0] = IGNORE_INDEX
    got = call(good, 0.7)
    ref = logprobs_entropy(hidden.detach(), weight.detach(), good, 0.7, backend="logits")
    torch.testing.assert_close(got.logprobs.detach(), ref.logprobs, rtol=1e-4, atol=1e-4)


def test_good_inputs_equal_the_check_read_at_once(monkeypatch):
    """Rule: the deferred read changes no value: the same call with the flags read at once (as off CUDA) gives the
    same logprobs and entropy bit for bit."""
    import tfcompat.heads as heads

    hidden, weight, labels = _inputs()
    late = logprobs_entropy(hidden, weight, labels, 0.7, backend="torch")
    monkeypatch.setattr(heads, "deferred", lambda flags: (lambda values: lambda: values)(flags.tolist()))
    at_once = logprobs_entropy(hidden, weight, labels, 0.7, backend="torch")
    assert torch.equal(late.logprobs, at_once.logprobs) and torch.equal(late.entropy, at_once.entropy)
