"""tfcompat.pack: per-sequence examples -> one packed row, every registered family, images and videos.

Oracle: the stock model of the installed transformers on each example alone (logits per token, and the
causal-LM loss per sequence), against the patched model on `pack`'s output.
"""

from __future__ import annotations

import pytest
import torch

import tfcompat
from tests.helpers import max_token_diff, skip_if_stock_rejects_videos
from tfcompat.registry import installed_families
from tfcompat.selfcheck import sample_case, sample_sequences, stock_inputs, tiny_model

FAMILIES = list(installed_families())


def _examples(model, seqs, labels: bool = True):
    out = []
    for s in seqs:
        ex = {"input_ids": s.input_ids[0], **s.vision_inputs()}
        if labels:
            ex["labels"] = s.input_ids[0].clone()
        out.append(ex)
    return out


def _top_vocab(model) -> None:
    """4.53's Qwen-VL loss reads config.vocab_size, which real checkpoints carry and the tiny config does not."""
    if not hasattr(model.config, "vocab_size"):
        model.config.vocab_size = model.config.get_text_config().vocab_size


def _stock_loss_sum(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross entropy of one sequence alone, and its number of targets."""
    return torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum"), ids.shape[0] - 1


@pytest.mark.parametrize("family", FAMILIES)
class TestPackEqualsStock:
    """Rule: the patched forward of pack()'s row returns, per token, the stock logits of each example alone, and
    its loss is the per-sequence loss (no target across a boundary)."""

    @torch.no_grad()
    def test_logits_and_loss(self, family):
        r = tfcompat.resolve(family)
        lengths, items = sample_case(family)
        skip_if_stock_rejects_videos(family, items)
        model = tiny_model(family, "sdpa")
        _top_vocab(model)
        seqs = sample_sequences(model, lengths, items, seed=4)
        stock = [model(**stock_inputs(r, model, s), use_cache=False).logits[0] for s in seqs]
        sums = [_stock_loss_sum(lg, s.input_ids[0]) for lg, s in zip(stock, seqs)]
        expected_loss = sum(x for x, _ in sums) / sum(n for _, n in sums)

        packed = tfcompat.pack(model, _examples(model, seqs))
        with tfcompat.patch(model):
            out = model(**packed.model_inputs)
            plain = dict(packed.model_inputs, labels=torch.cat([s.input_ids for s in seqs], dim=1))
            plain.pop("tfcompat_context")
            again = model(**plain)  # raw labels: the patched forward masks the boundaries itself
        assert max_token_diff(out.logits[0], stock) <= 1e-5
        assert abs(float(out.loss) - float(expected_loss)) <= 1e-5
        assert abs(float(again.loss) - float(expected_loss)) <= 1e-5
        if packed.seqs.lengths and len(packed.seqs.lengths) > 1:  # control: the whole-row shift differs
            row = torch.cat([s.input_ids[0] for s in seqs])
            crossing = torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), row[1:])
            assert abs(float(crossing) - float(expected_loss)) > 1e-4

    def test_shift_labels_are_per_sequence(self, family):
        lengths, items = sample_case(family)
        skip_if_stock_rejects_videos(family, items)  # pack() takes the installed rope index, refused there
        model = tiny_model(family, "sdpa")
        seqs = sample_sequences(model, lengths, items, seed=5)
        packed = tfcompat.pack(model, _examples(model, seqs))
        expected = torch.cat([torch.cat([s.input_ids[0, 1:], torch.tensor([-100])]) for s in seqs])
        assert torch.equal(packed.shift_labels[0], expected)
        starts = packed.seqs.cu_seqlens[:-1].long()
        assert bool((packed.model_inputs["labels"][0, starts] == -100).all())

    def test_position_ids_restart_per_sequence(self, family):
        lengths, items = sample_case(family)
        skip_if_stock_rejects_videos(family, items)
        model = tiny_model(family, "sdpa")
        seqs = sample_sequences(model, lengths, items, seed=6)
        pos = tfcompat.pack(model, _examples(model, seqs, labels=False)).model_inputs["position_ids"]
        text = pos[0, 0] if pos.ndim == 3 else pos[0]
        starts = torch.cumsum(torch.tensor([0, *[s.input_ids.shape[1] for s in seqs[:-1]]]), 0)
        assert bool((text[starts] == 0).all()) and int((text == 0).sum()) == len(seqs)


class TestPackRefuses:
    """Rule: pack() names the example and the fix for what it cannot pack."""

    def test_labels_for_some_examples_only(self):
        model = tiny_model("qwen2", "sdpa")
        ex = [{"input_ids": torch.arange(5), "labels": torch.arange(5)}, {"input_ids": torch.arange(4)}]
        with pytest.raises(tfcompat.InvalidInputError, match="labels for some examples only") as info:
            tfcompat.pack(model, ex)
        assert info.value.fix

    def test_padding(self):
        model = tiny_model("qwen2", "sdpa")
        with pytest.raises(tfcompat.InvalidInputError, match="example 0 has padding"):
            tfcompat.pack(model, [{"input_ids": torch.arange(5), "attention_mask": torch.tensor([1, 1, 1, 0, 0])}])

    def test_unknown_key(self):
        model = tiny_model("qwen2", "sdpa")
        with pytest.raises(tfcompat.InvalidInputError, match=r"unknown keys \['token_type_ids'\]"):
            tfcompat.pack(model, [{"input_ids": torch.arange(5), "token_type_ids": torch.zeros(5)}])

    def test_text_family_with_pixels(self):
        model = tiny_model("llama", "sdpa")
        with pytest.raises(tfcompat.InvalidInputError, match="text only"):
            tfcompat.pack(model, [{"input_ids": torch.arange(5), "pixel_values": torch.zeros(4, 8),
                                   "image_grid_thw": torch.tensor([[1, 2, 2]])}])

    def test_empty(self):
        with pytest.raises(tfcompat.InvalidInputError, match="no examples"):
            tfcompat.pack(tiny_model("qwen2", "sdpa"), [])


def test_seconds_as_a_list_equal_seconds_as_a_tensor():
    """A processor called without return_tensors="pt" gives second_per_grid_ts as a list of floats."""
    if "qwen2_5_vl" not in installed_families():
        pytest.skip("qwen2_5_vl is not in this transformers")
    model = tiny_model("qwen2_5_vl", "sdpa")
    seqs = sample_sequences(model, [7, 12], [None, ("video", (2, 4, 4))], seed=3)
    as_tensor = [dict(ex, second_per_grid_ts=torch.tensor([2.0])) if "video_grid_thw" in ex else ex
                 for ex in _examples(model, seqs, labels=False)]
    as_list = [dict(ex, second_per_grid_ts=[2.0]) if "video_grid_thw" in ex else ex for ex in as_tensor]
    a, b = tfcompat.pack(model, as_tensor), tfcompat.pack(model, as_list)
    assert torch.equal(a.model_inputs["position_ids"], b.model_inputs["position_ids"])
    assert torch.equal(a.model_inputs["second_per_grid_ts"], b.model_inputs["second_per_grid_ts"])
    default = tfcompat.pack(model, _examples(model, seqs, labels=False))  # control: 2 s per grid step, not 1
    assert not torch.equal(a.model_inputs["position_ids"], default.model_inputs["position_ids"])


def test_seconds_that_are_not_numbers_are_refused():
    if "qwen2_5_vl" not in installed_families():
        pytest.skip("qwen2_5_vl is not in this transformers")
    model = tiny_model("qwen2_5_vl", "sdpa")
    seq = sample_sequences(model, [12], [("video", (2, 4, 4))], seed=3)[0]
    with pytest.raises(tfcompat.InvalidInputError, match="second_per_grid_ts must be numbers") as info:
        tfcompat.rope_index(model, seq.input_ids, video_grid_thw=seq.vision_inputs()["video_grid_thw"],
                            second_per_grid_ts=["two seconds"])
    assert "family: qwen2_5_vl" in str(info.value)
