"""Ordinary calls on a patched model return what the unpatched model returns: padded batches with an attention
mask, KV-cache decoding and generate() (images included), with gradient checkpointing; packed rows still run
through the packed core in the same process. Oracle: the same model before patch() (and after undo())."""

from __future__ import annotations

import pytest
import torch

import tfcompat
from tfcompat.registry import installed_families
from tfcompat.selfcheck import sample_sequences, stock_inputs, tiny_model

FAMILIES = list(installed_families())


def _padded_batch(r, model, family):
    """Two sequences of different lengths, left-padded (generation style), with an image on vision families."""
    vision = installed_families()[family].is_vision
    a, b = sample_sequences(model, [5, 9], [(1, 4, 6) if vision else None, (1, 2, 4) if vision else None], seed=3)
    width = max(a.input_ids.shape[1], b.input_ids.shape[1])
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, s in enumerate((a, b)):
        n = s.input_ids.shape[1]
        ids[i, width - n:], mask[i, width - n:] = s.input_ids[0], 1
    inputs = {"input_ids": ids, "attention_mask": mask}
    if vision:
        inputs["pixel_values"] = torch.cat([a.pixel_values, b.pixel_values])
        inputs["image_grid_thw"] = torch.cat([a.image_grid_thw, b.image_grid_thw])
        if r.entry.rope_index_mm_token_types:
            inputs["mm_token_type_ids"] = r.spec.mm_token_types(model.config, ids)
    return inputs


def _generate(model, inputs):
    vocab = model.config.get_text_config().vocab_size
    return model.generate(**inputs, max_new_tokens=6, do_sample=False, suppress_tokens=list(range(vocab - 16, vocab)))


@pytest.mark.parametrize("family", FAMILIES)
class TestOrdinaryCalls:
    """Rule: every call that is not a packed row runs the stock attention and gives the stock answer."""

    @torch.no_grad()
    def test_padded_batch_and_generate_equal_unpatched(self, family):
        r = tfcompat.resolve(family)
        model = tiny_model(family, "sdpa")
        inputs = _padded_batch(r, model, family)
        single = stock_inputs(r, model, sample_sequences(model, [7], [None], seed=4)[0])
        expected = (model(**inputs, use_cache=False).logits, _generate(model, inputs), _generate(model, single))
        with tfcompat.patch(model):
            got = (model(**inputs, use_cache=False).logits, _generate(model, inputs), _generate(model, single))
        attended = inputs["attention_mask"].bool()
        assert torch.equal(got[0][attended], expected[0][attended])
        assert torch.equal(got[1], expected[1]), (got[1], expected[1])
        assert torch.equal(got[2], expected[2])
        assert got[1].shape[1] > inputs["input_ids"].shape[1]  # it generated

    @torch.no_grad()
    def test_packed_row_builds_no_cache(self, family):
        model = tiny_model(family, "sdpa")
        packed = tfcompat.pack(model, [{"input_ids": torch.arange(3, 9)}, {"input_ids": torch.arange(4, 9)}])
        with tfcompat.patch(model):
            out = model(**packed.model_inputs)  # use_cache left at its default (True)
        assert out.past_key_values is None

    @pytest.mark.broad  # the padded batch takes the stock path: not entry-specific
    def test_gradient_checkpointing_of_a_padded_batch(self, family):
        """Recomputation in the backward runs after the forward restored tfcompat's key: it still runs stock."""
        r = tfcompat.resolve(family)
        model = tiny_model(family, "sdpa")
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        inputs = _padded_batch(r, model, family)

        def grads():
            model.zero_grad(set_to_none=True)
            out = model(**inputs, use_cache=False).logits
            out[inputs["attention_mask"].bool()].square().mean().backward()
            return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and "q_proj" in n}

        expected = grads()
        with tfcompat.patch(model):
            got = grads()
        assert got.keys() == expected.keys() and got
        for name in got:
            assert torch.allclose(got[name], expected[name], atol=1e-6, rtol=0), name


def test_packed_row_with_use_cache_true_is_refused():
    """A cache continues one sequence per row: asking for one on a packed row is an error, not a silent cache."""
    model = tiny_model("qwen2", "sdpa")
    packed = tfcompat.pack(model, [{"input_ids": torch.arange(3, 9)}, {"input_ids": torch.arange(4, 9)}])
    inputs = {k: v for k, v in packed.model_inputs.items() if k != "tfcompat_context"}
    with tfcompat.patch(model), pytest.raises(tfcompat.InvalidInputError, match="cannot build a KV cache") as info:
        model(**inputs, use_cache=True)
    assert "use_cache=False" in info.value.fix
