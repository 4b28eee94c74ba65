"""Inputs a patched model must not ignore (issue 18, item 7; issue 26, item 5): a custom 4-D attention mask with a
packed row, and an empty row. ``test_refuses_*`` end in a typed error, ``test_answers_*`` in the stock answer (per
sequence for a packed row)."""

from __future__ import annotations

import re

import pytest
import torch

import tfcompat
from tfcompat import heads
from tfcompat.registry.versions import installed_transformers
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


def _stock_per_sequence(model, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """``(B * T, V)``: each sequence of each row of ``ids`` ``(B, T)`` alone through ``model`` (stock)."""
    return torch.cat([model(input_ids=part[None]).logits[0] for row in ids for part in row.split(lengths)])


# a 4-D mask of the boundaries in each form transformers takes: bool, and additive with the dtype's minimum (what
# transformers writes), -inf, and the -1e4 of older code
FORMS = {"bool": None, "min": torch.finfo(torch.float32).min, "-inf": float("-inf"), "-1e4": -1e4}


def _form(mask: torch.Tensor, form: str) -> torch.Tensor:
    """The additive ``mask`` ``(..., T, T)`` (0 / the dtype's minimum) in ``form``."""
    allowed = mask == 0
    return allowed if FORMS[form] is None else torch.where(allowed, 0.0, FORMS[form])


@pytest.mark.parametrize("form", list(FORMS))
@torch.no_grad()
def test_answers_raw_packed_row_with_the_boundaries_4d_mask_per_sequence(form):
    """A raw packed row with the 4-D mask of its own boundaries runs packed and answers stock per sequence."""
    model = tiny_model(FAMILY, "sdpa")
    ids, position_ids, _ = _packed()
    expected = _stock_per_sequence(model, ids, [5, 6])
    with tfcompat.patch(model):
        got = model(input_ids=ids, position_ids=position_ids, attention_mask=_form(_block_mask([5, 6]), form)).logits
    torch.testing.assert_close(got[0], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("broadcast", [False, True])
@torch.no_grad()
def test_answers_two_packed_rows_with_their_4d_masks(broadcast):
    """(B, 1, T, T), or one (1, 1, T, T) mask for rows of the same boundaries: each row compared with its own."""
    model = tiny_model(FAMILY, "sdpa")
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    lengths = [[5, 6], [5, 6]] if broadcast else [[5, 6], [3, 8]]
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in lengths])  # (2, 11)
    mask = _block_mask(lengths[0]) if broadcast else torch.cat([_block_mask(r) for r in lengths])
    expected = torch.cat([_stock_per_sequence(model, ids[b:b + 1], r) for b, r in enumerate(lengths)])
    with tfcompat.patch(model):
        got = model(input_ids=ids, position_ids=position_ids, attention_mask=mask).logits
    torch.testing.assert_close(got.flatten(0, 1), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.broad  # a derived type (mistral), not a registry entry
@torch.no_grad()
def test_answers_windowed_packed_row_with_its_4d_mask_per_sequence():
    """A sliding window (mistral's 8 tokens) within each sequence, which the stock forward drops under a 4-D mask:
    the patched row answers per sequence, the unpatched one (the control) does not."""
    from tests.every_type import build

    model = build("mistral", "sdpa")
    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(2))
    position_ids = torch.cat([torch.arange(14), torch.arange(10)])[None]  # (1, 24): the first longer than the window
    mask = _block_mask([14, 10])
    expected = _stock_per_sequence(model, ids, [14, 10])
    unpatched = model(input_ids=ids, position_ids=position_ids, attention_mask=mask).logits[0]
    assert (unpatched - expected).abs().max() > 1e-3  # control: stock takes the mask whole, without the window
    with tfcompat.patch(model):
        got = model(input_ids=ids, position_ids=position_ids, attention_mask=mask).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _entry(mask: torch.Tensor, query: int, key: int, value: float) -> torch.Tensor:
    mask = mask.clone()
    mask[..., query, key] = value
    return mask


MIN = torch.finfo(torch.float32).min
# (the mask, what the error says of its first differing entry)
REFUSED = {
    "hidden-key": (_block_mask([5, 6], hidden=(4, 2)),
                   r"query token 4 \(its sequence starts at token 0\), key token 2: the mask is -3.40282e\+38 "
                   r"\(hides\), but the key is an earlier token of the same sequence, which causal attention within "
                   r"each sequence attends"),
    "across-sequences": (_entry(_block_mask([5, 6]), 7, 1, 0.0),
                         r"query token 7 \(its sequence starts at token 5\), key token 1: the mask is 0 \(attends\), "
                         r"but the key is a token of an earlier sequence, which .* hides"),
    "whole-row-causal": (_form(torch.where(torch.ones(11, 11).tril().bool(), 0.0, MIN)[None, None], "bool"),
                         r"query token 5 \(its sequence starts at token 5\), key token 0: the mask is True"),
    "a-later-key": (_entry(_block_mask([5, 6]), 2, 3, 0.0), r"query token 2 .* key token 3: .* a later token"),
    "neither-value": (_entry(_block_mask([5, 6]), 6, 5, -1.0),
                      r"query token 6 .* key token 5: the mask is -1, which neither attends \(0\) nor hides "
                      r"\(at most -10000\)"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refuses_raw_packed_row_with_another_4d_mask(case):
    """Any other 4-D mask with restarting position ids: a typed error naming the first differing entry (the packed
    attention would not do what the mask says), and the way out."""
    model = tiny_model(FAMILY, "sdpa")
    ids, position_ids, _ = _packed()
    mask, says = REFUSED[case]
    with tfcompat.patch(model), pytest.raises(tfcompat.InvalidInputError, match=(
            rf"(?s)not the block-diagonal causal mask.*why: at row 0, {says}.*fix: pass attention_mask=None")) as i:
        model(input_ids=ids, position_ids=position_ids, attention_mask=mask)
    assert i.value.family == FAMILY and i.value.transformers_version == installed_transformers()


@pytest.mark.parametrize("mask", [torch.ones(1, 1, 11, 11, dtype=torch.long), torch.zeros(1, 2, 11, 11)],
                         ids=["int", "per-head"])
def test_refuses_raw_packed_row_with_a_4d_mask_of_another_form(mask):
    """An integer or per-head 4-D mask with restarting position ids: not compared, refused naming its form."""
    model = tiny_model(FAMILY, "sdpa")
    ids, position_ids, _ = _packed()
    with tfcompat.patch(model), pytest.raises(tfcompat.InvalidInputError, match=(
            rf"(?s)4-D attention_mask of shape {re.escape(str(tuple(mask.shape)))} and dtype {mask.dtype}.*"
            r"supported: a 4-D mask \(B or 1, 1, L, L\)")):
        model(input_ids=ids, position_ids=position_ids, attention_mask=mask)


@torch.no_grad()
def test_answers_one_sequence_per_row_with_a_4d_mask_as_stock():
    """Position ids that do not restart (a left-padded batch, generate()'s positions): the caller's own masking, run
    stock as the unpatched model does, whatever the 4-D mask hides."""
    model = tiny_model(FAMILY, "sdpa")
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(3))
    padding = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    position_ids = (padding.cumsum(-1) - 1).masked_fill(padding == 0, 1)  # (2, 6)
    allowed = torch.ones(6, 6).tril().bool() & padding[:, None, :].bool()  # (2, 6, 6)
    allowed[:, 4, 2] = False  # what no boundary expresses
    mask = torch.where(allowed, 0.0, MIN)[:, None]  # (2, 1, 6, 6)
    expected = model(input_ids=ids, position_ids=position_ids, attention_mask=mask).logits
    with tfcompat.patch(model):
        got = model(input_ids=ids, position_ids=position_ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_compares_a_4d_mask_once_per_forward(monkeypatch):
    """The comparison runs once per forward, where the boundaries are built, in its one host copy: not per layer."""
    import tfcompat.hf.forward as forward

    calls = {"disagreement": 0, "_to_host": 0}

    def counting(name: str):
        original = getattr(forward, name)

        def counted(*args):
            calls[name] += 1
            return original(*args)
        return counted

    for name in calls:
        monkeypatch.setattr(forward, name, counting(name))
    model = tiny_model(FAMILY, "sdpa")
    assert model.config.num_hidden_layers > 1
    ids, position_ids, _ = _packed()
    with tfcompat.patch(model):
        model(input_ids=ids, position_ids=position_ids, attention_mask=_block_mask([5, 6]))
    assert calls == {"disagreement": 1, "_to_host": 1}


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
