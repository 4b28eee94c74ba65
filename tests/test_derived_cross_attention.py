"""Derived vision-language types whose images reach the text model as cross-attention states (Mllama), packed.

Rule: per token, the patched model on one packed row (`tfcompat.pack` of the processor-style examples) equals the
stock model on each sequence alone, forward and backward (with and without gradient checkpointing), for a row whose
sequences hold different numbers of images of different tile counts, a text-only sequence (stock skips its
cross-attention layers) and tokens before their sequence's first image (stock attends them uniformly over their
own sequence's image keys and gates their MLP off). Controls: the unpatched packed row differs; so does the patched
row with either per-sequence rule switched off, at exactly the tokens that rule is for.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tfcompat
from tests.every_type import GRAD_TOLERANCE, TOLERANCE, build, compare, compare_gradients, gradients, logits_of
from tfcompat.core.context import CONTEXT_KWARG
from tfcompat.hf import cross_states
from tfcompat.registry import derive_vision

pytestmark = pytest.mark.skipif("mllama" not in derive_vision.vision_types(),
                                reason="transformers has no mllama on this release")


def _model(attn: str) -> torch.nn.Module:
    """The zoo's tiny Mllama with its tanh gates (zero-initialized, drawn at 0.02 by the zoo) at 1: the images'
    cross-attention and its MLP then weigh as much as the text's layers."""
    model = build("mllama", attn, kind="image_text_to_text")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                p.fill_(1.0)
    return model


def _example(model: torch.nn.Module, length: int, images: list[tuple[int, int]], seed: int) -> dict[str, Any]:
    """What the processor returns for one sample: ``length`` text tokens with an image token at each ``(position,
    tiles)`` of ``images``, each image ``tiles`` real tiles of the row's ``max_num_tiles`` (the rest zeros,
    ``aspect_ratio_mask`` 0), and the processor's ``cross_attention_mask`` (1, L, images, tiles): each image seen
    from its token up to the next image's (`processing_mllama.get_cross_attention_token_mask`)."""
    config: Any = model.config
    vision = config.vision_config
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 200, (1, length), generator=g)
    if not images:
        return {"input_ids": ids}
    n, tiles = len(images), vision.max_num_tiles
    pixels = torch.zeros(1, n, tiles, 3, vision.image_size, vision.image_size)
    aspect_mask = torch.zeros(1, n, tiles, dtype=torch.long)
    aspect_ids = torch.zeros(1, n, dtype=torch.long)
    cross = torch.zeros(1, length, n, tiles, dtype=torch.long)
    for j, (at, real) in enumerate(images):
        ids[0, at] = config.image_token_id
        pixels[0, j, :real] = torch.randn(real, 3, vision.image_size, vision.image_size, generator=g)
        aspect_mask[0, j, :real] = 1
        aspect_ids[0, j] = vision.supported_aspect_ratios.index([1, real]) + 1
        cross[0, at:images[j + 1][0] if j + 1 < n else length, j, :real] = 1
    return {"input_ids": ids, "pixel_values": pixels, "aspect_ratio_ids": aspect_ids,
            "aspect_ratio_mask": aspect_mask, "cross_attention_mask": cross}


def _examples(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Two images (3 tiles, 1 tile) after two text tokens; text alone; one image of 4 tiles at the first token; one
    of 2 tiles after three text tokens."""
    return [_example(model, 11, [(2, 3), (6, 1)], 0), _example(model, 6, [], 1), _example(model, 5, [(0, 4)], 2),
            _example(model, 8, [(3, 2)], 3)]


def _worst_tokens(got: torch.Tensor, expected: list[torch.Tensor]) -> set[int]:
    """The packed tokens whose relative difference (as `compare`) exceeds 1e-3."""
    want = torch.cat(expected)
    scale = want.abs().amax(-1).clamp_min(1e-6)
    return {int(i) for i in (((got - want).abs().amax(-1) / scale) > 1e-3).nonzero()[:, 0]}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_with_images_equals_stock_per_sequence(attn, monkeypatch):
    model = _model(attn)
    examples = _examples(model)
    with torch.no_grad():
        expected = [logits_of(model, **ex) for ex in examples]
    w = torch.randn(expected[0].shape[-1], generator=torch.Generator().manual_seed(3))
    expected_grads = gradients(model, lambda: sum((logits_of(model, **ex) @ w).sum() for ex in examples))
    with tfcompat.patch(model) as handle:
        assert handle.proof is not None and handle.proof.status == "proven"
        packed = tfcompat.pack(model, examples)
        inputs = packed.model_inputs
        assert inputs["pixel_values"].shape[:3] == (1, 4, model.config.vision_config.max_num_tiles)
        assert inputs["cross_attention_mask"].shape == (1, 30, 4, 4)
        assert inputs[CONTEXT_KWARG].cross.counts == (2, 0, 1, 1)
        with torch.no_grad():
            diff = compare(logits_of(model, **inputs), expected)
        grads = compare_gradients(gradients(model, lambda: (logits_of(model, **inputs) @ w).sum()), expected_grads)
        # each per-sequence rule off in turn: wrong at the tokens it is for, and only there
        before_images = {0, 1, 22, 23, 24}  # sequence 0's and sequence 3's tokens before their first image
        text_only = set(range(11, 17))
        own = cross_states.per_sequence_mask
        with monkeypatch.context() as m, torch.no_grad():  # the owner's mask over the whole row
            m.setattr(cross_states, "per_sequence_mask", lambda r, mask, ctx, name: mask)
            row_wide = _worst_tokens(logits_of(model, **inputs), expected)
        with monkeypatch.context() as m, torch.no_grad():  # a token of a sequence without images attends every key
            m.setattr(cross_states, "per_sequence_mask", lambda r, mask, ctx, name: (lambda x: x.masked_fill(
                (x == torch.finfo(x.dtype).min).all(-1, keepdim=True), 0.0))(own(r, mask, ctx, name)))
            not_skipped = _worst_tokens(logits_of(model, **inputs), expected)
    with torch.no_grad():
        control = compare(logits_of(model, **{k: v for k, v in inputs.items()
                                              if not k.startswith("tfcompat") and k != "position_ids"}), expected)
    assert diff <= TOLERANCE and grads <= GRAD_TOLERANCE, (diff, grads)
    assert control > 1e-3
    assert row_wide == before_images | text_only, row_wide
    assert not_skipped == text_only, not_skipped


def test_checkpointed_backward_equals_stock_per_sequence():
    """Under non-reentrant gradient checkpointing (train mode) the recomputation keeps both rules."""
    model = _model("sdpa")
    examples = _examples(model)
    w = torch.randn(model.config.text_config.vocab_size, generator=torch.Generator().manual_seed(3))
    expected = gradients(model, lambda: sum((logits_of(model, **ex) @ w).sum() for ex in examples))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with tfcompat.patch(model):
        inputs = tfcompat.pack(model, examples).model_inputs
        text = tfcompat.pack(model, [{"input_ids": ex["input_ids"]} for ex in examples]).model_inputs
        try:
            gradients(model, lambda: logits_of(model, **text).sum())
        except tfcompat.PatchedModelError as exc:  # 4.x's text model checkpoints its layers without **kwargs
            pytest.skip(f"checkpointed packed rows fail on this release without images too: {exc.what}")
        got = gradients(model, lambda: (logits_of(model, **inputs) @ w).sum())
    assert compare_gradients(got, expected) <= GRAD_TOLERANCE


def test_derivation_reads_the_cross_attention_states():
    v = tfcompat.resolve("mllama").entry.derived_vision
    assert v is not None and v.batched_images and v.cross_states is not None
    c = v.cross_states
    assert (c.states, c.mask, c.row_mask, c.items) == (
        "cross_attention_states", "cross_attention_mask", "full_text_row_masked_out_mask", "cross_attention_mask")
    assert c.prepare == "_prepare_cross_attention_mask"
    assert c.layers == ("MllamaCrossAttentionDecoderLayer",) and c.attentions == ("MllamaTextCrossAttention",)
    assert "cross_attention_states" not in v.token_inputs


def test_refusals_are_typed():
    """A raw packed call with images (no pack context: whose images are whose?), an example with pixel values but no
    cross-attention mask, one whose mask does not match its images, and embeddings computed outside the forward."""
    model = _model("sdpa")
    examples = _examples(model)
    with tfcompat.patch(model, prove=False):
        inputs = tfcompat.pack(model, examples).model_inputs
        raw = {k: v for k, v in inputs.items() if not k.startswith("tfcompat")}
        with pytest.raises(tfcompat.InvalidInputError, match="images are not known by sequence"):
            model(**raw, use_cache=False)
        bare = [{k: v for k, v in ex.items() if k != "cross_attention_mask"} for ex in examples]
        with pytest.raises(tfcompat.InvalidInputError, match="has pixel_values but no cross_attention_mask"):
            tfcompat.pack(model, bare)
        wrong = [dict(ex) for ex in examples]
        wrong[0]["cross_attention_mask"] = wrong[0]["cross_attention_mask"][:, :, :1]
        with pytest.raises(tfcompat.InvalidInputError, match="does not match its tokens and images"):
            tfcompat.pack(model, wrong)
        with pytest.raises(tfcompat.InvalidInputError, match="cannot take embeddings computed outside its forward"):
            tfcompat.embed_inputs(model, inputs["input_ids"], pixel_values=inputs["pixel_values"])
