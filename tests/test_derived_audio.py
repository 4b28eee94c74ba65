"""Derived vision-language families that also take audio (Qwen2.5-Omni's and Qwen3-Omni's thinkers): a packed row
holds sequences with images and sequences with audio clips of different lengths, the clips' features zero-padded
to the longest with their ``feature_attention_mask`` (as the feature extractor batches them); the owner numbers
M-RoPE itself from the audio lengths it computes from that mask (`VisionDerivation.positions_locals`).

Rule: packed equals stock per sequence, per token. Types are picked by the property (a derived entry whose owner
takes ``input_features`` and ``feature_attention_mask`` and has ``get_audio_features``), never by name.
"""

from __future__ import annotations

import importlib.util
import inspect
import pathlib
import warnings

import pytest
import torch

import tfcompat
from tests.every_type import TOLERANCE, build, compare, vlm_examples
from tfcompat.errors import TfcompatError
from tfcompat.hf.vision_attention import towers
from tfcompat.inputs.derived_vision import owner_of
from tfcompat.registry import derive
from tfcompat.tiny_models import model_types

pytestmark = pytest.mark.usefixtures("one_thread")


def _takes_audio(model_type: str) -> bool:
    spec = importlib.util.find_spec(derive.module_name(model_type))
    if spec is None or spec.origin is None or "def get_audio_features" not in pathlib.Path(spec.origin).read_text():
        return False  # the cheap filter first: resolving every vision-language type takes a minute
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = tfcompat.resolve(model_type)
    except TfcompatError:
        return False
    if r.entry.derived_vision is None:
        return False
    owner = r.classes["model"]
    return {"input_features", "feature_attention_mask"} <= set(inspect.signature(owner.forward).parameters) and hasattr(
        owner, "get_audio_features")


def _types() -> list[str]:
    try:
        return [t for t in model_types("image_text_to_text") if _takes_audio(t)]
    except (ImportError, ModuleNotFoundError):
        return []


TYPES = _types()


def _with_audio(model: torch.nn.Module, text: torch.Tensor, frames: int, seed: int) -> dict[str, torch.Tensor]:
    """Text around one random clip of ``frames`` mel frames, its placeholders as many as the tower's output rows."""
    config = model.config
    audio = config.audio_config
    features = torch.randn(1, audio.num_mel_bins, frames, generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(1, frames, dtype=torch.long)
    owner, _ = owner_of(tfcompat.resolve(config.model_type), model)
    with torch.no_grad():
        rows = owner.get_audio_features(features, feature_attention_mask=mask).last_hidden_state.shape[0]
    ids = torch.cat([text[:, :2], torch.full((1, rows), config.audio_token_id), text[:, 2:]], 1)
    return {"input_ids": ids, "input_features": features, "feature_attention_mask": mask}


def _tower_pads_alike(model: torch.nn.Module, clips: list[dict[str, torch.Tensor]]) -> bool:
    """Whether the stock audio tower gives each clip the same features zero-padded in one batch as alone (Qwen3-Omni's
    does not: 1e-4 apart, its chunks padded to the batch's longest), which packing cannot change."""
    owner, _ = owner_of(tfcompat.resolve(model.config.model_type), model)
    frames = max(c["input_features"].shape[-1] for c in clips)
    batch = torch.cat([torch.nn.functional.pad(c["input_features"], (0, frames - c["input_features"].shape[-1]))
                       for c in clips])
    mask = torch.cat([torch.nn.functional.pad(c["feature_attention_mask"], (0, frames - c["input_features"].shape[-1]))
                      for c in clips])
    with torch.no_grad():
        alone = torch.cat([owner.get_audio_features(c["input_features"], feature_attention_mask=c[
            "feature_attention_mask"]).last_hidden_state for c in clips])
        together = owner.get_audio_features(batch, feature_attention_mask=mask).last_hidden_state
    return bool(torch.allclose(alone, together, atol=1e-6, rtol=0))


@pytest.mark.skipif(not TYPES, reason="no derived vision-language family takes audio on this transformers")
@pytest.mark.parametrize("vision_attention", [False, True], ids=["stock_towers", "vision_attention"])
@pytest.mark.parametrize("model_type", TYPES)
def test_images_and_audio_of_other_lengths_pack_exactly(model_type, vision_attention):
    """Clips of 37 and 50 frames; of 50 each where the stock tower pads them otherwise than alone. With
    ``vision_attention=True`` where the towers route their boundaries (transformers 5.x; the audio tower too)."""
    model = build(model_type, "sdpa", kind="image_text_to_text")
    if vision_attention and not towers(model, [model.config.get_text_config()]):
        pytest.skip(f"no tower of {model_type} routes its boundaries on this transformers")
    images = vlm_examples(model)[:3]
    text = images[1]["input_ids"]
    clips = [_with_audio(model, text, 37, 1), _with_audio(model, text, 50, 2)]
    if not _tower_pads_alike(model, clips):
        clips[0] = _with_audio(model, text, 50, 1)
    examples = [images[0], clips[0], images[2], clips[1]]
    with torch.no_grad():
        expected = [model(**ex).logits[0] for ex in examples]
        with tfcompat.patch(model, vision_attention=vision_attention):
            inputs = tfcompat.pack(model, examples).model_inputs
            assert inputs["input_features"].shape[0] == 2
            got = model(**inputs).logits[0]
        unpatched = model(**{k: v for k, v in inputs.items() if not k.startswith("tfcompat") and k != "position_ids"})
    assert compare(got, expected) <= TOLERANCE
    assert compare(unpatched.logits[0], expected) > 1e-3  # control: the row unpatched attends across sequences
