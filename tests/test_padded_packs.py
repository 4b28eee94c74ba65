"""A batch of packed rows padded on the right to the longest (LLaMA-Factory's neat packing: the attention mask holds
each token's sequence number, 0 on padding; or a 0/1 mask), every registered family.

Oracle: the stock model of the installed transformers on each sequence alone, per real token. Control: the stock
model on the same padded batch mixes sequences (it reads the mask as 0/1).
"""

from __future__ import annotations

import pytest
import torch

import tfcompat
from tfcompat.registry import installed_families
from tfcompat.selfcheck import sample_case, sample_sequences, stock_inputs, tiny_model

FAMILIES = list(installed_families())
TOKEN_KEYS = ("input_ids", "position_ids", "mm_token_type_ids", "moe_mm_token_type_ids")  # (..., 1, T) per packed row
PAD = 7  # tokens past each row's end: their position ids and mask are 0, as LLaMA-Factory pads them


def _padded_batch(model, rows: list[list]) -> tuple[dict, torch.Tensor]:
    """Each row ``pack``ed alone, right-padded to the longest and stacked: model inputs ``(B, L)`` and the
    segment-number mask ``(B, L)``."""
    packs = [tfcompat.pack(model, [{"input_ids": s.input_ids[0], **s.vision_inputs()} for s in row]) for row in rows]
    width = max(p.seqs.total for p in packs) + PAD
    inputs: dict = {}
    for key in packs[0].model_inputs:
        if key == "tfcompat_context":
            continue
        values = [p.model_inputs[key] for p in packs]
        if key in TOKEN_KEYS:  # (..., 1, T) -> (..., B, width), zeros on the right
            values = [torch.nn.functional.pad(v, (0, width - v.shape[-1])) for v in values]
            inputs[key] = torch.cat(values, dim=-2)
        else:  # vision inputs, in the order of their placeholders over the batch
            inputs[key] = torch.cat(values)
    segments = torch.zeros(len(rows), width, dtype=torch.long)
    for b, p in enumerate(packs):
        segments[b, : p.seqs.total] = torch.repeat_interleave(
            torch.arange(1, len(p.seqs.lengths) + 1), torch.tensor(p.seqs.lengths))
    return inputs, segments


def _max_diff(logits: torch.Tensor, rows: list[list], stock: list[list[torch.Tensor]]) -> float:
    worst = 0.0
    for b, row in enumerate(stock):
        at = 0
        for expected in row:
            worst = max(worst, float((logits[b, at: at + expected.shape[0]] - expected).abs().max()))
            at += expected.shape[0]
    return worst


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_right_padded_packed_rows_equal_each_sequence_alone(family):
    r = tfcompat.resolve(family)
    lengths, items = sample_case(family)
    # images only: a forward mixing images and videos takes inputs_embeds on some releases (test_pack.py has them)
    items = [None if isinstance(i, tuple) and i[0] == "video" else i for i in items]
    model = tiny_model(family, "sdpa")
    seqs = sample_sequences(model, lengths, items, seed=6)
    rows = [seqs[:2], seqs[2:]] if len(seqs) > 2 else [seqs[:1], seqs[1:]]
    stock = [[model(**stock_inputs(r, model, s), use_cache=False).logits[0] for s in row] for row in rows]
    inputs, segments = _padded_batch(model, rows)
    # the stock forward of the oldest releases reads no text row: [t; h; w] alone
    positions = inputs["position_ids"][1:] if inputs["position_ids"].ndim == 3 else inputs["position_ids"]
    unpatched = model(**dict(inputs, position_ids=positions), attention_mask=segments, use_cache=False).logits
    assert _max_diff(unpatched, rows, stock) > 1e-3  # control: stock reads the mask as 0/1 and mixes sequences
    with tfcompat.patch(model):
        for mask in (segments, (segments > 0).long()):
            logits = model(**inputs, attention_mask=mask).logits
            assert _max_diff(logits, rows, stock) <= 1e-5


def test_padding_before_the_end_of_a_packed_row_is_refused():
    model = tiny_model("qwen2", "sdpa")
    ids = torch.randint(3, 50, (1, 12))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]])
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    with tfcompat.patch(model), pytest.raises(tfcompat.InvalidInputError, match="padding before its end") as info:
        model(input_ids=ids, position_ids=positions, attention_mask=mask)
    assert "family: qwen2" in str(info.value) and "right padding" in str(info.value)
