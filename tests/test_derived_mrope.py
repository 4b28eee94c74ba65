"""Derived vision-language families whose model numbers M-RoPE itself (the 5.x descendants of Qwen-VL: GLM-OCR,
PaddleOCR-VL, Cosmos-3 Edge, HunYuan-VL 4, ...): their owner's ``compute_3d_position_ids``, called per sequence,
numbers a packed row; packed with images equals stock per sequence, forward and backward.

The types are picked by the property (a derived entry whose owner numbers M-RoPE positions), never by name.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import warnings

import pytest
import torch

import tfcompat
from tests.every_type import build, vlm_check, vlm_examples
from tfcompat.errors import InvalidInputError, TfcompatError
from tfcompat.registry import derive
from tfcompat.tiny_models import attention_implementations, model_types


def _numbers_mrope(model_type: str) -> bool:
    spec = importlib.util.find_spec(derive.module_name(model_type))
    if spec is None or spec.origin is None or "position_ids = self." not in pathlib.Path(spec.origin).read_text():
        return False  # the cheap filter first: resolving every vision-language type takes a minute
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            derived = tfcompat.resolve(model_type).entry.derived_vision
    except TfcompatError:
        return False
    return derived is not None and bool(derived.positions_call)


def _types() -> list[str]:
    try:
        return [t for t in model_types("image_text_to_text") if _numbers_mrope(t)]
    except (ImportError, ModuleNotFoundError):
        return []


TYPES = _types()
needs_types = pytest.mark.skipif(not TYPES, reason="no derived vision-language family numbers M-RoPE itself on "
                                 "this transformers (compute_3d_position_ids came with 5.x)")


def _impl(model_type: str) -> str:
    return attention_implementations(model_type, "image_text_to_text")[-1]  # sdpa where the class offers it


@functools.cache
def _runnable() -> tuple[str, torch.nn.Module] | None:
    """The first of `TYPES` whose tiny model runs the zoo's image sequence stock."""
    for model_type in TYPES:
        try:
            model = build(model_type, _impl(model_type), kind="image_text_to_text")
            with torch.no_grad():
                model(**vlm_examples(model)[0])
        except Exception:  # noqa: BLE001 -- the zoo's limit: the next type
            continue
        return model_type, model
    return None


def _first() -> tuple[str, torch.nn.Module]:
    found = _runnable()
    if found is None:
        pytest.xfail(f"the zoo runs none of {TYPES} with an image")
    return found


@needs_types
@pytest.mark.parametrize("model_type", TYPES)
def test_packed_with_images_equals_stock_per_sequence(model_type):
    """Rule: two images and a text-only sequence in one packed row equal stock per sequence, forward and backward
    (and through embed_inputs); the unpatched packed row differs (the control)."""
    outcome = vlm_check(model_type, _impl(model_type))
    if outcome.status == "unbuildable":
        pytest.xfail(f"the zoo cannot build a tiny {model_type} with an image: {outcome.reason}")
    assert outcome.status == "pass", outcome.reason


@needs_types
def test_rope_index_is_what_the_stock_forward_hands_its_language_model():
    """Rule: rows 1-3 of rope_index are the M-RoPE positions the stock forward computes for the same sequence (read
    at its language model), and they differ from the text row at the image tokens; the model's own rope_deltas are
    left as they were."""
    model_type, model = _first()
    example = vlm_examples(model)[0]
    r = tfcompat.resolve(model_type)
    owner = next(m for m in model.modules() if type(m).__name__ == r.entry.derived_vision.owner)
    seen: dict[str, torch.Tensor] = {}
    hook = owner.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(kwargs), with_kwargs=True)
    with torch.no_grad():
        model(**example)
    hook.remove()
    before = getattr(owner, "rope_deltas", None)
    grids = {k: example[k] for k in ("image_grid_thw", "video_grid_thw") if k in example}
    positions = tfcompat.rope_index(model, example["input_ids"], **grids)
    stock = seen["position_ids"]
    assert positions.shape == (4, *example["input_ids"].shape)
    assert torch.equal(positions[-3:], stock[-3:].to(positions.dtype))
    assert bool((positions[1:] != positions[0]).any()), "an image must get positions other than the text row's"
    assert getattr(owner, "rope_deltas", None) is before


@needs_types
def test_each_packed_sequence_starts_at_zero_and_text_counts_like_text():
    """Rule: in a packed row every row of the positions restarts at 0 at each sequence, and a text-only sequence's
    M-RoPE rows equal its text row."""
    _, model = _first()
    examples = vlm_examples(model)[:3]  # image, text only, image
    packed = tfcompat.pack(model, examples)
    positions = packed.model_inputs["position_ids"]  # (4, 1, T)
    starts = packed.seqs.cu_seqlens[:-1].tolist()
    assert positions.shape[0] == 4 and bool((positions[:, 0, starts] == 0).all())
    lo, hi = packed.seqs.cu_seqlens[1].item(), packed.seqs.cu_seqlens[2].item()
    text = positions[:, 0, lo:hi]
    assert bool((text == text[0]).all()) and torch.equal(text[0], torch.arange(hi - lo, dtype=text.dtype))


@needs_types
def test_rope_index_misuse_is_typed():
    """Rule: seconds per grid step (Qwen2.5-VL's) and ids that are not an integer (B, L) tensor raise typed errors."""
    _, model = _first()
    example = vlm_examples(model)[0]
    with pytest.raises(InvalidInputError, match="takes no second_per_grid_ts"):
        tfcompat.rope_index(model, example["input_ids"], second_per_grid_ts=torch.tensor([1.0]))
    with pytest.raises(InvalidInputError):
        tfcompat.rope_index(model, example["input_ids"].float())
