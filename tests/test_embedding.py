"""embed_inputs: vision features scattered into text embeddings, and the dummy pass for text-only batches."""

from __future__ import annotations

import copy

import pytest
import torch

import tfcompat
from tests.helpers import max_token_diff, pack, skip_if_stock_rejects_videos
from tfcompat.inputs.embedding import dummy_image, embed_inputs
from tfcompat.registry import installed_families
from tfcompat.selfcheck import sample_case, sample_sequences, stock_inputs, tiny_model

VLMS = [k for k, f in installed_families().items() if f.is_vision]


@pytest.mark.parametrize("family", VLMS)
class TestEmbedInputs:
    """Rule: patched forward on embed_inputs' embeddings equals the stock per-sequence forward."""

    def test_vision_batch(self, family):
        lengths, items = sample_case(family)
        skip_if_stock_rejects_videos(family, items)
        model = tiny_model(family, "sdpa")
        r = tfcompat.resolve(family)
        seqs = sample_sequences(model, lengths, items, seed=4)
        inputs = pack(model, seqs)
        vision = {k: v for k, v in inputs.items() if k not in ("input_ids", "position_ids", "moe_mm_token_type_ids")}
        with torch.no_grad():
            expected = [model(**stock_inputs(r, model, s), use_cache=False).logits[0] for s in seqs]
            embedded = embed_inputs(model, inputs["input_ids"], **vision)
            with tfcompat.patch(model):
                got = model(**embedded.model_inputs(), position_ids=inputs["position_ids"], use_cache=False).logits[0]
                if embedded.visual is not None:  # control: without the extras the visual tokens lose DeepStack
                    bare = model(inputs_embeds=embedded.inputs_embeds, position_ids=inputs["position_ids"],
                                 use_cache=False).logits[0]
        assert max_token_diff(got, expected) <= 1e-5
        assert embedded.visual is None or max_token_diff(bare, expected) > 1e-2

    def test_text_only_batch_gives_stock_logits_and_zero_vision_grads(self, family):
        model = tiny_model(family, "sdpa")
        r = tfcompat.resolve(family)
        seqs = sample_sequences(model, [7, 12], [None, None], seed=4)
        inputs = pack(model, seqs)
        with torch.no_grad():
            expected = [model(**stock_inputs(r, model, s), use_cache=False).logits[0] for s in seqs]
        with tfcompat.patch(model):
            embedded = embed_inputs(model, inputs["input_ids"])
            got = model(**embedded.model_inputs(), position_ids=inputs["position_ids"], use_cache=False).logits[0]
        assert max_token_diff(got.detach(), expected) <= 1e-5
        got.sum().backward()
        vision = [(n, p.grad) for n, p in model.named_parameters() if r.entry.vision.attr in n]
        assert vision and all(g is not None for _, g in vision), [n for n, g in vision if g is None]
        assert all(float(g.abs().max()) == 0.0 for _, g in vision)

    def test_token_feature_mismatch_raises(self, family):
        model = tiny_model(family, "sdpa")
        seq = sample_sequences(model, [6], [(1, 4, 6)])[0]
        ids = seq.input_ids.clone()
        ids[ids == model.config.image_token_id] = torch.tensor([7, *[model.config.image_token_id] * 5])  # 5 of 6
        with pytest.raises(tfcompat.InvalidInputError,
                           match="image placeholder tokens and image(_grid_thw| features) disagree"):
            embed_inputs(model, ids, seq.pixel_values, seq.image_grid_thw)

    def test_pixels_missing_for_placeholders_raises(self, family):
        model = tiny_model(family, "sdpa")
        seq = sample_sequences(model, [6], [(1, 4, 6)])[0]
        with pytest.raises(tfcompat.InvalidInputError, match="hold image tokens but no image pixels"):
            embed_inputs(model, seq.input_ids)


def test_embed_inputs_refuses_a_text_only_family():
    model = tiny_model("llama", "sdpa")
    with pytest.raises(tfcompat.InvalidInputError, match="embed_inputs needs a vision-language family") as info:
        embed_inputs(model, torch.zeros(1, 4, dtype=torch.long))
    assert "text-only" in info.value.why and "qwen2_vl" in info.value.supported


def test_dummy_image_shape_follows_the_vision_config():
    config = copy.deepcopy(tiny_model("qwen2_vl", "sdpa").config.vision_config)
    pixels, grid = dummy_image(config, torch.device("cpu"))
    assert pixels.shape == (4, 3 * 2 * 14 * 14) and grid.tolist() == [[1, 2, 2]]
    config.patch_size, config.spatial_merge_size = 16, 3
    pixels, grid = dummy_image(config, torch.device("cpu"))
    assert pixels.shape == (9, 3 * 2 * 16 * 16) and grid.tolist() == [[1, 3, 3]]
