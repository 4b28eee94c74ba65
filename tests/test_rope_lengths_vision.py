"""Length-dependent ropes on packed vision-language rows (`tfcompat.hf.rope_lengths`): the rope switches on the
largest position + 1 it is given, which an image keeps below the token count under M-RoPE (Qwen2-VL), and which the
token-typed owners' image-block path (Gemma 3, `tfcompat.hf.vision`) hands the stock rotary whole. A packed row with
sequences on both sides of the switch is refused (a typed error); without the check it is wrong (the control)."""

from __future__ import annotations

import copy

import pytest
import torch

import tfcompat
import tfcompat.hf.forward as forward
from tests.every_type import compare, image_sequence, logits_of, sample_sequences
from tfcompat.tiny_models import tiny_config, tiny_model

pytestmark = pytest.mark.broad  # drawn rope settings on the text config, not a registry entry

KIND = "image_text_to_text"
SCALING = ("rope_type", "type", "factor", "original_max_position_embeddings", "short_factor", "long_factor")


def _config(model_type: str, rope_type: str, original: int):
    """The type's tiny config with ``rope_type`` on its text config (Gemma 3's full-attention layers), switching
    at ``original``: 5.x ``rope_parameters``, 4.x ``rope_scaling`` (whose longrope switches at the text config's own
    ``original_max_position_embeddings``)."""
    base = tiny_config(model_type, KIND)
    text = base.get_text_config().to_dict()
    key = "rope_parameters" if "rope_parameters" in text else "rope_scaling"
    params = text.get(key) or {}
    nested = isinstance(params.get("full_attention"), dict)
    flat = params["full_attention"] if nested else params
    head = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    half = int(head * flat.get("partial_rotary_factor", text.get("partial_rotary_factor") or 1.0)) // 2
    rope = {k: v for k, v in flat.items() if k not in SCALING}
    extra: dict[str, int] = {}
    if rope_type == "dynamic":
        rope |= {"rope_type": "dynamic", "factor": 2.0}
        extra["max_position_embeddings"] = original
    else:
        rope |= {"rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [3.0] * half,
                 "original_max_position_embeddings": original}
        if key == "rope_scaling":
            rope["factor"] = text["max_position_embeddings"] / original
            extra["original_max_position_embeddings"] = original
    if key == "rope_scaling" and "type" in flat:
        rope["type"] = rope["rope_type"]
    return type(base).from_dict({**base.to_dict(), "text_config": {
        **text, key: {**params, "full_attention": rope} if nested else rope, **extra}})


def _seen(model: torch.nn.Module, example: dict[str, torch.Tensor]) -> int:
    """The largest position + 1 the rope is given for ``example`` alone (its M-RoPE rows where it has them)."""
    with tfcompat.patch(model):
        positions = tfcompat.pack(model, [example]).model_inputs["position_ids"]
    return int((positions[1:] if positions.ndim == 3 else positions).max()) + 1


@pytest.mark.parametrize("rope_type", ["longrope", "dynamic"])
@pytest.mark.parametrize("model_type", ["qwen2_vl", "gemma3"])
@torch.no_grad()
def test_refuses_packed_image_rows_whose_sequences_rotate_otherwise_alone(model_type, rope_type, monkeypatch):
    """An image sequence whose positions stay at the switch, beside text past it: under M-RoPE with as many tokens
    as the image sequence (a count of tokens would let it through), else longer (Gemma 3 with the processor's token
    types, whose rows run the stock attention with image blocks)."""
    plain = tiny_model(model_type, KIND, attn_implementation="sdpa")
    tokens, seen = image_sequence(plain)["input_ids"].shape[-1], _seen(plain, image_sequence(plain))
    text = tokens if seen < tokens else tokens + 5
    model = tiny_model(model_type, KIND, attn_implementation="sdpa", config=_config(model_type, rope_type, seen))
    examples = [image_sequence(model, seed=0), {"input_ids": sample_sequences(model.config, (text,), seed=5)[0][None]},
                image_sequence(model, seed=2)]
    if model_type == "gemma3":  # the processor's token types, marking the image tokens: the image-block path
        image = getattr(model.config, "image_token_id", None) or model.config.image_token_index
        for ex in examples:
            ex["token_type_ids"] = (ex["input_ids"] == image).long()
    expected = [logits_of(copy.deepcopy(model), **ex) for ex in examples]
    with monkeypatch.context() as m, tfcompat.patch(copy.deepcopy(model), prove=False) as handle:
        m.setattr(forward, "check_lengths", lambda *args: None)
        got = logits_of(handle.model, **tfcompat.pack(handle.model, examples).model_inputs)
        assert compare(got, expected) > 1e-4
    with tfcompat.patch(model, prove=False), pytest.raises(tfcompat.InvalidInputError, match=(
            rf"(?s)other {rope_type} rope frequencies alone.*family: {model_type}.*alone, the one of {seen} ")):
        model(**tfcompat.pack(model, examples).model_inputs, use_cache=False)


@pytest.mark.parametrize("rope_type", ["longrope", "dynamic"])
def test_the_proof_packs_sequences_the_rope_answers_with_images(rope_type):
    """A switch inside the proof's own rows (images set their lengths): the patch-time proof packs lengths past it,
    or one sequence repeated, and proves the patch rather than failing it."""
    model = tiny_model("gemma3", KIND, attn_implementation="sdpa", config=_config("gemma3", rope_type, 8))
    with tfcompat.patch(model) as handle:
        assert handle.proof is not None and handle.proof.status == "proven", handle.proof
