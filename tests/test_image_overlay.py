"""Token-typed packed rows whose images sit at different positions in each sequence (Gemma 3 / Gemma 4: images
bidirectional within themselves).

From 5.23 transformers remaps a packed row's mask functions to per-sequence positions, and Gemma 3 / 4 hand their
image overlay to the sliding-window mask as such a function: the stock packed row then reads each later sequence's
tokens at the first sequence's image positions (`tfcompat.hf.vision.overlay_remapped`), and PaliGemma's prefix
blocks span a row's sequences on older releases. The patch lays the owner's own mask of each sequence alone on the
row's diagonal. Rule: patched packed == stock per sequence, forward and backward, on every release; where the remap
is, the stock packed row differs (the bug is real).
"""

from __future__ import annotations

import pytest
import torch

import tfcompat
from tests.every_type import (
    GRAD_TOLERANCE,
    TOLERANCE,
    build,
    compare,
    compare_gradients,
    gradients,
    projection,
    vlm_examples,
)
from tfcompat.errors import TfcompatError
from tfcompat.hf.vision import overlay_remapped
from tfcompat.tiny_models import model_types

pytestmark = pytest.mark.usefixtures("one_thread")


def _token_typed() -> list[str]:
    found = []
    for model_type in model_types("image_text_to_text"):
        try:
            v = tfcompat.resolve(model_type).entry.derived_vision
        except TfcompatError:
            continue
        if v is not None and v.mask_inputs:
            found.append(model_type)
    return found


TYPES = _token_typed()


def _shifted(model_type: str) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]], str]:
    """An image, text, and an image three tokens later than the first's, each with token types marking images."""
    try:
        model = build(model_type, "sdpa", kind="image_text_to_text")
        examples = vlm_examples(model)[:3]
        # PaliGemma's stock sdpa attends both ways without token types (the patch-time proof refuses there)
        if not causal_without_types(model, examples[1]):
            model = build(model_type, "eager", kind="image_text_to_text")
        if not causal_without_types(model, examples[1]):  # 4.x PaliGemma: eager too, over its whole prompt
            pytest.skip(f"{model_type}: the stock model attends both ways without token types; patch() refuses")
    except Exception as exc:  # noqa: BLE001 -- the zoo's limit, named
        pytest.xfail(f"{model_type}: tiny model cannot be built or run with an image: {exc}")
    image_id = getattr(model.config, tfcompat.resolve(model_type).entry.derived_vision.placeholder)
    name = tfcompat.resolve(model_type).entry.derived_vision.mask_inputs[0]
    examples[2] = {**examples[2], "input_ids": torch.cat([examples[1]["input_ids"][:, :3], examples[2]["input_ids"]],
                                                         dim=1)}  # (1, L) -> (1, 3 + L)
    for ex in examples:
        for key in [k for k in ex if k.endswith("token_type_ids")]:
            del ex[key]
        ex[name] = (ex["input_ids"] == image_id).long()
    return model, examples, name


def causal_without_types(model: torch.nn.Module, example: dict[str, torch.Tensor]) -> bool:
    """Whether the stock model's logits of a text prefix are those of the whole text's first tokens."""
    with torch.no_grad():
        whole = model(**example).logits[0]
        prefix = model(input_ids=example["input_ids"][:, :-2]).logits[0]
    return bool(torch.allclose(whole[: prefix.shape[0]], prefix, atol=1e-5))


@pytest.mark.skipif(not TYPES, reason="no derived type builds its mask from token types on this transformers")
@pytest.mark.parametrize("model_type", TYPES)
def test_images_at_other_positions_pack_exactly(model_type):
    model, examples, _ = _shifted(model_type)
    with torch.no_grad():
        expected = [model(**ex).logits[0] for ex in examples]
    w = projection(expected[0].shape[-1])
    expected_grads = gradients(model, lambda: sum((model(**ex).logits[0] @ w).sum() for ex in examples))
    with tfcompat.patch(model):
        inputs = tfcompat.pack(model, examples).model_inputs
        with torch.no_grad():
            assert compare(model(**inputs).logits[0], expected) <= TOLERANCE
        got_grads = gradients(model, lambda: (model(**inputs).logits[0] @ w).sum())
    grads = compare_gradients(got_grads, expected_grads)
    if GRAD_TOLERANCE < grads <= 10 * GRAD_TOLERANCE and "use_bidirectional_attention" in vars(
            model.config.get_text_config()):
        # the tiny Gemma 4's diffuse fp32 gradient noise (tests/test_derived.py: 2.3e-5 to 3.4e-5 with the zoo's rows;
        # 4.5e-5 to 1.1e-4 on 5.3 and 5.5 with these), the forward exact above
        pytest.xfail(f"{model_type}: gradients {grads:.1e} over the {GRAD_TOLERANCE} tolerance, the forward exact")
    assert grads <= GRAD_TOLERANCE


@pytest.mark.skipif(not TYPES or not any(overlay_remapped(tfcompat.resolve(t).entry.module) for t in TYPES),
                    reason="this transformers builds packed rows' image overlays at the row's own positions")
def test_the_stock_packed_row_reads_the_wrong_images_where_remapped():
    """Non-vacuity: where `overlay_remapped` holds, some such type's stock packed row differs from stock per
    sequence (what the patch would give if it left the mask to transformers)."""
    worst = 0.0
    for model_type in [t for t in TYPES if overlay_remapped(tfcompat.resolve(t).entry.module)]:
        model, examples, _ = _shifted(model_type)
        with torch.no_grad():
            expected = [model(**ex).logits[0] for ex in examples]
            with tfcompat.patch(model):
                inputs = tfcompat.pack(model, examples).model_inputs
            stock = {k: v for k, v in inputs.items() if not k.startswith("tfcompat")}
            worst = max(worst, compare(model(**stock).logits[0], expected))
    assert worst > 1e-3, "the stock packed row equals per sequence: the remap does not bite on these models"
