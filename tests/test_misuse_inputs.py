"""Inputs a patched model must not ignore (issue 18, item 7): a custom 4-D attention mask with a packed row, and
an empty row. ``test_refuses_*`` end in a typed error, ``test_answers_*`` in the stock answer."""

from __future__ import annotations

import pytest
import torch

import tfcompat
from tfcompat import heads
from tfcompat.selfcheck import tiny_model

FAMILY = "qwen2"


def _block_mask(lengths: list[int], hidden: tuple[int, int] | None = None) -> torch.Tensor:
    """A ``(1, 1, T, T)`` additive causal mask of the packed ``lengths``; ``hidden = (query, key)`` also hides
    that key from that query (what no packed boundary expresses)."""
    total = sum(lengths)
    allowed = torch.zeros(total, total, dtype=torch.bool)
    start = 0
    for n in lengths:
        allowed[start:start + n, start:start + n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
        start += n
    if hidden is not None:
        allowed[hidden] = False
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]  # (T, T) -> (1, 1, T, T)


def _packed():
    ids = torch.randint(0, 100, (1, 11), generator=torch.Generator().manual_seed(0))
    position_ids = torch.cat([torch.arange(5), torch.arange(6)])[None]  # (1, 11)
    return ids, position_ids, _block_mask([5, 6], hidden=(4, 2))


@torch.no_grad()
def test_answers_raw_packed_row_with_a_4d_mask_as_stock():
    """A raw packed row with a 4-D mask runs stock attention and honours the mask, as the unpatched model does."""
    model = tiny_model(FAMILY, "sdpa")
    ids, position_ids, mask = _packed()
    expected = model(input_ids=ids, position_ids=position_ids, attention_mask=mask).logits
    plain = model(input_ids=ids, position_ids=position_ids, attention_mask=_block_mask([5, 6])).logits
    assert (plain - expected).abs().max() > 1e-3  # control: the hidden key changes the answer
    with tfcompat.patch(model):
        got = model(input_ids=ids, position_ids=position_ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_kind", ["4-D", "dict"])
def test_refuses_a_custom_mask_with_pack_inputs(mask_kind):
    """tfcompat.pack's context decides the boundaries: a 4-D (or per-layer-type dict) mask would be dropped."""
    model = tiny_model(FAMILY, "sdpa")
    ids, _, mask = _packed()
    packed = tfcompat.pack(model, [{"input_ids": ids[0, :5]}, {"input_ids": ids[0, 5:]}])
    given = mask if mask_kind == "4-D" else {"full_attention": mask}
    with tfcompat.patch(model), pytest.raises(tfcompat.InvalidInputError,
                                              match="(?s)a custom attention mask with packed inputs.*fix: drop") as i:
        model(**packed.model_inputs, attention_mask=given)
    assert i.value.family == FAMILY


def test_answers_pack_inputs_with_an_all_ones_mask():
    """Control: the 2-D all-ones mask trainers pass along with packed inputs is still accepted."""
    model = tiny_model(FAMILY, "sdpa")
    ids, _, _ = _packed()
    packed = tfcompat.pack(model, [{"input_ids": ids[0, :5]}, {"input_ids": ids[0, 5:]}])
    with tfcompat.patch(model), torch.no_grad():
        expected = model(**packed.model_inputs).logits
        got = model(**packed.model_inputs, attention_mask=torch.ones_like(ids)).logits
    assert torch.equal(got, expected)


def test_refuses_an_empty_packed_row():
    """input_ids of shape (1, 0) with position ids: a typed error, not a slicing ValueError."""
    model = tiny_model(FAMILY, "sdpa")
    empty = torch.zeros(1, 0, dtype=torch.long)
    with tfcompat.patch(model), pytest.raises(tfcompat.InvalidInputError, match=r"(?s)no tokens.*\(1, 0\)") as i:
        model(input_ids=empty, position_ids=empty)
    assert i.value.family == FAMILY and i.value.fix


@pytest.mark.parametrize("backend", ["auto", "torch", "logits"])
def test_refuses_an_empty_row_in_the_heads(backend):
    """logprobs_entropy on a (1, 0) row: a typed error, not range()'s ValueError."""
    model = tiny_model(FAMILY, "sdpa")
    hidden = torch.zeros(1, 0, model.config.hidden_size)
    with pytest.raises(tfcompat.InvalidInputError, match=r"(?s)at least one token.*\(1, 0, "):
        heads.logprobs_entropy(hidden, model.lm_head.weight, torch.zeros(1, 0, dtype=torch.long), backend=backend)


@pytest.mark.broad  # one family's compile: dynamo's trace of tfcompat's boundaries, not an entry's tables
def test_refuses_compile_fullgraph_of_a_raw_packed_call_naming_pack():
    """fullgraph=True cannot trace boundaries read on the host; the error (dynamo's, at the one graph break of a
    raw packed call) says to pass tfcompat.pack's inputs, which trace whole (tests/test_misuse.py)."""
    model = tiny_model(FAMILY, "sdpa")
    ids, position_ids, _ = _packed()
    with tfcompat.patch(model), torch.no_grad(), pytest.raises(torch._dynamo.exc.Unsupported,
                                                               match=r"(?s)raw packed call.*tfcompat\.pack\(model"):
        torch._dynamo.reset()
        torch.compile(model, fullgraph=True)(input_ids=ids, position_ids=position_ids)


@pytest.mark.broad  # as above; the slowest test of a per-entry release (~10 s of compiling)
def test_answers_compile_of_a_raw_packed_call_with_graph_breaks():
    """Without fullgraph the raw packed call compiles with graph breaks and answers what eager answers."""
    model = tiny_model(FAMILY, "sdpa")
    ids, position_ids, _ = _packed()
    with tfcompat.patch(model), torch.no_grad():
        eager = model(input_ids=ids, position_ids=position_ids).logits
        torch._dynamo.reset()
        compiled = torch.compile(model)(input_ids=ids, position_ids=position_ids).logits
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
