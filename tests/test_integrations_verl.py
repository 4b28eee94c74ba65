"""`tfcompat.integrations.verl.apply_monkey_patch` at patch time: typed errors, idempotence, undo (no verl needed)."""

from __future__ import annotations

import sys

import pytest
import torch

import tfcompat
from tfcompat.integrations.verl import VerlPatch, apply_monkey_patch
from tfcompat.selfcheck import tiny_model


@pytest.fixture()
def model() -> torch.nn.Module:
    return tiny_model("qwen2", "sdpa")


@pytest.mark.parametrize("kwargs,match", [
    ({"use_remove_padding": False}, "remove-padding batches only"),
    ({"use_fused_kernels": True}, "unknown fused_kernels_backend None"),
    ({"use_fused_kernels": True, "fused_kernels_backend": "cuda"}, "unknown fused_kernels_backend 'cuda'"),
    ({"ulysses_sp_size": 0}, "positive int"),
    ({"keep_logits": True}, "keep_logits=True keeps the fused head's logits"),
    ({"vision_attention": True}, "no tower of Qwen2ForCausalLM hands its attention boundaries"),
])
def test_bad_options_raise_patch_error(model, kwargs, match):
    with pytest.raises(tfcompat.PatchError, match=match):
        apply_monkey_patch(model, **kwargs)
    assert "forward" not in vars(model)


def test_heads_not_divisible_raise(model):
    with pytest.raises(tfcompat.PatchError,
                       match="cannot split 4 query / 2 KV heads over a sequence-parallel group of 3"):
        apply_monkey_patch(model, ulysses_sp_size=3)


def test_sp_without_verl_raises(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "verl.utils.ulysses", None)  # import of it raises ImportError
    with pytest.raises(tfcompat.PatchError, match="verl is not importable"):
        apply_monkey_patch(model, ulysses_sp_size=2)


def test_idempotent_then_undo_restores_the_forward(model):
    ids, pos = torch.randint(0, 100, (1, 9)), torch.cat([torch.arange(4), torch.arange(5)])[None]
    vp = apply_monkey_patch(model)
    assert isinstance(vp, VerlPatch) and apply_monkey_patch(model) is vp
    with pytest.raises(tfcompat.PatchError, match="other options"):
        apply_monkey_patch(model, use_fused_kernels=True, fused_kernels_backend="torch")
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        with pytest.raises(tfcompat.InvalidInputError, match="fused-kernel arguments"):
            model(input_ids=ids, position_ids=pos, temperature=0.5)
        vp.undo()
        vp.undo()
        assert "forward" not in vars(model) and "_tfcompat_verl" not in vars(model)
        first = model(input_ids=ids[:, :4], use_cache=False).logits
    assert float((packed[:, :4] - first).abs().max()) <= 1e-5


def test_kept_logits_give_the_recomputing_heads_logprobs_and_gradients(model):
    """The fused forward with keep_logits=True: the same log-probs, entropies and gradients as the head that
    recomputes its logits in the backward."""
    ids, pos = torch.randint(0, 100, (1, 9)), torch.cat([torch.arange(4), torch.arange(5)])[None]
    labels = torch.roll(ids, -1, -1)
    runs = []
    for keep in (False, True):
        model.zero_grad()
        with apply_monkey_patch(model, use_fused_kernels=True, fused_kernels_backend="torch", keep_logits=keep):
            out = model(input_ids=ids, position_ids=pos, temperature=0.7, shift_labels=labels)
            loss = out.log_probs.sum() + 0.1 * out.entropy.sum()
            loss.backward(retain_graph=True)
            if keep:  # the kept logits were overwritten by their gradient: the head really kept them
                with pytest.raises(tfcompat.InvalidInputError, match="backward"):
                    loss.backward()
        runs.append((out.log_probs.detach(), out.entropy.detach(), model.lm_head.weight.grad.clone(),
                     model.model.embed_tokens.weight.grad.clone()))
    for got, want in zip(runs[1], runs[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)



def test_a_derived_vision_language_model_takes_its_own_vision_inputs():
    """verl's remove-padding call on a derived VLM (LLaVA): the model's own vision keywords go to its forward (through
    `tfcompat.embed_inputs`), the logits equal stock per sequence; a keyword its forward does not take is refused,
    typed, naming it."""
    from tests.every_type import build, vlm_examples

    model = build("llava", "sdpa", kind="image_text_to_text")
    examples = vlm_examples(model)[:3]
    inputs = {k: v for k, v in tfcompat.pack(model, examples).model_inputs.items() if not k.startswith("tfcompat")}
    assert "pixel_values" in inputs
    with torch.no_grad():
        expected = torch.cat([model(**ex, use_cache=False).logits[0] for ex in examples])
        with apply_monkey_patch(model):
            got = model(**inputs, attention_mask=None, use_cache=False).logits[0]
            with pytest.raises(tfcompat.InvalidInputError, match=r"embed_inputs got \['not_a_vision_input'\]"):
                model(**inputs, not_a_vision_input=torch.zeros(1))
        control = model(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"]).logits[0]
    assert float((got - expected).abs().max()) <= 1e-5 * max(1.0, float(expected.abs().max()))
    assert float((control - expected).abs().max()) > 1e-3


def test_vision_attention_routes_the_tower_and_undoes():
    from packaging.version import Version

    from tfcompat.registry.versions import installed_transformers

    if Version(installed_transformers()) < Version("5.0"):
        pytest.skip("the towers of 4.x hand boundaries only to flash_attention_2")
    vlm = tiny_model("qwen2_5_vl", "sdpa")
    with apply_monkey_patch(vlm, vision_attention=True) as vp:
        assert vp.options["vision_attention"]
        assert vlm.config.vision_config._attn_implementation == "tfcompat_flash_varlen"
    assert vlm.config.vision_config._attn_implementation == "sdpa"
