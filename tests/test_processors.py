"""Real processors' outputs, as they come, through `tfcompat.pack` and `tfcompat.embed_inputs`.

For each family of `tests.processors.RECIPES`: the family's processor (built offline) processes three samples one
at a time (an odd-sized image, text alone, two images); the samples' outputs go to `tfcompat.pack` unchanged; the
patched packed forward must equal the stock forward on each output alone, per token (fp32, forward and backward),
and the unpatched packed row (positions running on) must not (the control).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import pytest
import torch

import tfcompat
from tests import every_type, processors
from tfcompat.tiny_models import TinyModelError, tiny_model

needs_pillow = pytest.mark.skipif(importlib.util.find_spec("PIL") is None,
                                  reason="real image processors need Pillow (not installed)")


def _logits(model: torch.nn.Module, inputs: Any) -> torch.Tensor:
    return model(**inputs, use_cache=False).logits[0].float()  # (L, V)


def _per_token(inputs: dict[str, Any]) -> dict[str, Any]:
    """The packed row's per-token and context inputs (what a forward on ``inputs_embeds`` still takes)."""
    return {k: v for k, v in inputs.items() if k.startswith(("tfcompat", "token_type_ids", "mm_token_type_ids",
                                                             "moe_mm_token_type_ids"))}


@needs_pillow
@pytest.mark.parametrize("model_type", sorted(processors.RECIPES))
def test_processor_outputs_pack_as_they_come(model_type: str) -> None:
    try:
        model = tiny_model(model_type, "image_text_to_text", attn_implementation="sdpa")
    except TinyModelError as exc:  # the type is not on this release, or its tower needs timm (not installed)
        pytest.skip(f"{str(exc).splitlines()[0]} ({exc.why})" if getattr(exc, "why", "") else str(exc))
    needs = processors.torchvision_classes(model_type)
    if needs and importlib.util.find_spec("torchvision") is None:
        pytest.skip(f"{model_type}: {', '.join(needs)} exists only with torchvision, not installed (nox -s vision)")
    try:
        processor = processors.build(model)
    except ImportError as exc:  # transformers' own requirement of the processor class (torchvision, num2words)
        pytest.skip(f"{model_type}: {str(exc).strip().splitlines()[0]}")
    # in the model's dtype, as users move a processor's output (Llama 4's returns bfloat16 pixel values)
    samples = [{k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in s.items()}
               for s in processors.samples(processor, model_type)]
    if any("labels" not in s for s in samples):  # PaliGemma's BC labels (all -100 without a suffix) come with its
        samples = [{k: v for k, v in s.items() if k != "labels"} for s in samples]  # images only: logits compared
    if any("token_type_ids" in s for s in samples):  # the text alone comes from the tokenizer (images required):
        # the processor's token types of a prompt without a suffix
        samples = [{"token_type_ids": torch.zeros_like(s["input_ids"]), **s} for s in samples]
    assert any("pixel_values" in s for s in samples) and any("pixel_values" not in s for s in samples)
    try:
        with torch.no_grad():
            expected = [_logits(model, s) for s in samples]
    except Exception as exc:  # noqa: BLE001 -- no oracle: the stock forward refuses the processor's output
        pytest.skip(f"{model_type}: the stock tiny model raises on its processor's output on this release (4.53: "
                    f"Qwen2.5-VL's config lacks vision_start_token_id, GLM-4.1V's patch layout): {exc}"[:300])
    w = every_type.projection(expected[0].shape[-1])
    expected_grads = every_type.gradients(model, lambda: sum((_logits(model, s) @ w).sum() for s in samples))
    try:
        handle = tfcompat.patch(model)
    except every_type.REFUSALS as exc:  # a typed refusal is an outcome of its own (tests/test_every_vlm.py)
        pytest.skip(f"{model_type}: patch() refuses it: {str(exc).splitlines()[0]}")
    with handle:
        inputs = tfcompat.pack(model, samples).model_inputs
        if not any("token_type_ids" in s for s in samples) and every_type.token_types_needed(model):
            # PaliGemma's 4.x processor returns no token types without a suffix, and stock sdpa then attends both
            # ways over a sequence alone, causally in a padded batch: packed rows without them are refused, typed
            with pytest.raises(tfcompat.InvalidInputError, match="a packed row without token_type_ids"):
                _logits(model, inputs)
            return
        with torch.no_grad():
            diff = every_type.compare(_logits(model, inputs), expected)
        got_grads = every_type.gradients(model, lambda: (_logits(model, inputs) @ w).sum())
        vision = {k: v for k, v in inputs.items() if k not in _per_token(inputs) and k not in ("input_ids",
                                                                                                 "position_ids")}
        try:
            embedded = tfcompat.embed_inputs(model, inputs["input_ids"], **vision)
        except tfcompat.errors.InvalidInputError as exc:  # a forward that takes no embeddings alone: said, typed
            embedded_diff = None
            assert "cannot take embeddings" in str(exc)
        else:
            with torch.no_grad():
                embedded_diff = every_type.compare(_logits(model, {**_per_token(inputs), **embedded.model_inputs(),
                                                                   "position_ids": inputs["position_ids"]}), expected)
    grad_diff = every_type.compare_gradients(got_grads, expected_grads)
    with torch.no_grad():  # the control: the same row unpatched, positions running on
        unpatched = {k: v for k, v in inputs.items() if not k.startswith("tfcompat") and k != "position_ids"}
        unpatched["attention_mask"] = torch.ones_like(inputs["input_ids"])  # 4.x M-RoPE forwards need one
        control = every_type.compare(_logits(model, unpatched), expected)
    print(f"{model_type}: logits {diff:.1e}, embedded {embedded_diff}, gradients {grad_diff:.1e}, "
          f"control {control:.1e}")
    assert diff <= every_type.TOLERANCE
    assert embedded_diff is None or embedded_diff <= every_type.TOLERANCE
    assert grad_diff <= every_type.GRAD_TOLERANCE
    assert control > 1e-3


def test_blank_segment_ids_dropped_where_the_forward_takes_none() -> None:
    """Rule: a generic tokenizer's ``token_type_ids`` (all zeros; 4.x ``PreTrainedTokenizerFast`` returns them) pack
    as nothing for a forward without them, as the stock forward swallows them; other values stay an unknown key."""
    model = tiny_model("llava_next", "image_text_to_text", attn_implementation="sdpa")
    ids = torch.arange(1, 6)[None]
    packed = tfcompat.pack(model, [{"input_ids": ids, "token_type_ids": torch.zeros_like(ids)}, {"input_ids": ids}])
    assert "token_type_ids" not in packed.model_inputs
    with pytest.raises(tfcompat.InvalidInputError, match=r"example 0 has unknown keys \['token_type_ids'\]"):
        tfcompat.pack(model, [{"input_ids": ids, "token_type_ids": torch.ones_like(ids)}])
