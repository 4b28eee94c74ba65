"""Differential tests: packed patched forward/backward against stock per-sequence runs, every family.

The oracle is the stock model of the installed transformers, on the same tiny random weights.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import tfcompat
from tests.helpers import max_token_diff, pack, packed_inputs, skip_if_stock_rejects_videos
from tfcompat.core.context import ForwardContext
from tfcompat.core.packing import from_lengths
from tfcompat.hf import attention as hf_attention
from tfcompat.hf.attention import ATTENTION_KEY, packed_attention
from tfcompat.registry import installed_families
from tfcompat.selfcheck import Sequence, sample_case, sample_sequences, stock_inputs, tiny_model

FAMILY = "glm4v"  # lifecycle and bad-input tests
IMPLS = ["eager", "sdpa"]
# every registered family: a text-only packed row, and the family's vision sample (Family.sample_vision)
CASES = {(key, case): sample_case(key, vision=case == "vision")
         for key, fam in installed_families().items()
         for case in (("text", "vision") if fam.sample_vision else ("text",))}
CASE_IDS = [f"{f}-{c}" for f, c in CASES]


@pytest.fixture(scope="module")
def resolved() -> tfcompat.Resolved:
    return tfcompat.resolve(FAMILY)


def _stock_logits(r, model, seqs):
    return [model(**stock_inputs(r, model, s), use_cache=False).logits[0] for s in seqs]


@torch.no_grad()
def _packed_and_stock(family, case, impl, one_sequence=False):
    """Patched packed logits ``(T, V)`` and the stock per-sequence logits of the same sequences.

    one_sequence: tell the patched forward the whole row is one sequence (the boundary control).
    """
    resolved = tfcompat.resolve(family)
    skip_if_stock_rejects_videos(family, CASES[family, case][1])
    model = tiny_model(family, impl)
    seqs = sample_sequences(model, *CASES[family, case], seed=1)
    expected = _stock_logits(resolved, model, seqs)
    inputs = packed_inputs(model, seqs)
    if one_sequence:
        inputs["tfcompat_context"] = ForwardContext(from_lengths([inputs["position_ids"].shape[-1]]))
    with tfcompat.patch(model, remove_padding=True):
        return model(**inputs, use_cache=False).logits[0], expected


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family,case", list(CASES), ids=CASE_IDS)
class TestPackedEqualsStock:
    """Rule: per token, the patched packed forward returns what the stock model returns per sequence."""

    def test_forward(self, family, case, impl):
        got, expected = _packed_and_stock(family, case, impl)
        assert max_token_diff(got, expected) <= 1e-5

    def test_boundaries_matter(self, family, case, impl):
        """Control: the same patched forward told the row is one sequence leaks across sequences and fails
        the comparison, so the oracle can tell right boundaries from wrong ones."""
        got, expected = _packed_and_stock(family, case, impl, one_sequence=True)
        assert max_token_diff(got, expected) > 1e-3

    def test_backward(self, family, case, impl):
        resolved = tfcompat.resolve(family)
        skip_if_stock_rejects_videos(family, CASES[family, case][1])
        model = tiny_model(family, impl)
        seqs = sample_sequences(model, *CASES[family, case], seed=2)
        vocab = model.config.get_text_config().vocab_size
        weight = torch.randn(vocab, generator=torch.Generator().manual_seed(3))

        for s in seqs:  # stock: each sequence alone, gradients accumulate
            (model(**stock_inputs(resolved, model, s), use_cache=False).logits[0] @ weight).sum().backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)

        with tfcompat.patch(model, remove_padding=True):
            (model(**packed_inputs(model, seqs), use_cache=False).logits[0] @ weight).sum().backward()
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

        assert got.keys() == expected.keys()
        tower = resolved.entry.vision.attr if resolved.entry.vision is not None else "visual"
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "embed_tokens", "experts", tower)
        watched = [n for n in got if any(k in n for k in names)]
        assert any("q_proj" in n for n in watched) and any("embed_tokens" in n for n in watched)
        if case == "vision":
            assert any(tower in n for n in watched)
        for name in watched:
            scale = max(1.0, float(expected[name].abs().max()))
            diff = float((got[name] - expected[name]).abs().max())
            assert diff <= 1e-5 * scale, f"{name}: max abs diff {diff:.3e} (grad scale {scale:.2e})"


class TestPatchLifecycle:
    """Rule: patch() is idempotent, reversible to the identical objects, and records what it changed."""

    def test_undo_restores_identical_objects(self, resolved):
        model = tiny_model(FAMILY, "sdpa")
        text_model = next(m for m in model.modules() if isinstance(m, resolved.text_model_cls))
        configs = {id(m.config): m.config for m in model.modules() if isinstance(m, resolved.attention_cls)}
        before_impl = {k: c._attn_implementation for k, c in configs.items()}
        interface = __import__("transformers.modeling_utils", fromlist=["x"]).AttentionInterface
        before_mapping = dict(interface._global_mapping)
        ids = sample_sequences(model, [9], [None])[0].input_ids
        with torch.no_grad():
            stock = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits

        handle = tfcompat.patch(model, remove_padding=True)
        with torch.no_grad():
            model(input_ids=ids, position_ids=tfcompat.rope_index(model, ids), use_cache=False)
        assert "forward" in vars(text_model)
        assert all(c._attn_implementation == ATTENTION_KEY for c in configs.values())
        assert interface._global_mapping[ATTENTION_KEY] is packed_attention
        handle.undo()

        assert "forward" not in vars(text_model)
        assert type(text_model).forward is resolved.text_model_cls.forward
        assert {k: c._attn_implementation for k, c in configs.items()} == before_impl
        assert interface._global_mapping.keys() == before_mapping.keys()
        assert all(interface._global_mapping[k] is v for k, v in before_mapping.items())
        assert not tfcompat.is_patched(model)
        assert not any(layer._forward_pre_hooks for layer in model.modules()
                       if isinstance(layer, resolved.decoder_layer_cls))
        assert not any("_tfcompat_context" in vars(m) for m in model.modules())
        with torch.no_grad():
            again = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        assert torch.equal(again, stock)

    def test_idempotent_and_recorded(self, resolved):
        model = tiny_model(FAMILY, "sdpa")
        first = tfcompat.patch(model, remove_padding=True)
        n = len(first.records)
        assert tfcompat.patch(model, remove_padding=True) is first
        assert len(first.records) == n
        scopes = {r.scope for r in first.records}
        assert {"process", "config", "instance"} <= scopes
        assert ATTENTION_KEY in first.explain()
        with pytest.raises(tfcompat.PatchError, match="already patched with other options"):
            tfcompat.patch(model, remove_padding=True, backend="sdpa")
        first.undo()
        first.undo()  # idempotent undo
        assert not first.active

    def test_two_models_share_the_key_until_the_last_undo(self, resolved):
        interface = __import__("transformers.modeling_utils", fromlist=["x"]).AttentionInterface
        # models another test of this process keeps patched (module fixtures)
        users = hf_attention._users.get(ATTENTION_KEY, 0)
        a, b = tiny_model(FAMILY, "sdpa"), tiny_model(FAMILY, "eager")
        ha, hb = tfcompat.patch(a), tfcompat.patch(b)
        assert hf_attention._users.get(ATTENTION_KEY, 0) == users + 2
        ha.undo()
        assert ATTENTION_KEY in interface._global_mapping
        hb.undo()
        assert hf_attention._users.get(ATTENTION_KEY, 0) == users
        assert (ATTENTION_KEY in interface._global_mapping) == (users > 0)

    def test_a_dropped_copy_releases_its_use_of_the_key(self):
        users = hf_attention._users.get(ATTENTION_KEY, 0)
        model = tiny_model(FAMILY, "sdpa")
        handle = tfcompat.patch(model)
        clone = copy.deepcopy(model)
        assert tfcompat.is_patched(clone) and hf_attention._users.get(ATTENTION_KEY, 0) == users + 2
        del clone
        gc.collect()  # the copy and its handle hold each other
        assert hf_attention._users.get(ATTENTION_KEY, 0) == users + 1
        handle.undo()
        del model, handle
        gc.collect()  # undone: collecting the model releases nothing twice
        assert hf_attention._users.get(ATTENTION_KEY, 0) == users

    def test_unknown_backend_fails_at_patch_time(self):
        model = tiny_model(FAMILY, "sdpa")
        with pytest.raises(tfcompat.PatchError, match="unknown attention backend 'bogus'"):
            tfcompat.patch(model, backend="bogus")

    def test_nothing_to_patch_is_an_error(self):
        model = tiny_model(FAMILY, "sdpa")
        with pytest.raises(tfcompat.PatchError, match="nothing to patch"):
            tfcompat.patch(model, remove_padding=False)

    def test_dropout_fails_at_patch_time(self, resolved):
        model = tiny_model(FAMILY, "sdpa")
        model.config.text_config.attention_dropout = 0.1
        for m in model.modules():
            if isinstance(m, resolved.attention_cls):
                m.config.attention_dropout = 0.1
        with pytest.raises(tfcompat.PatchError, match="attention_dropout") as info:
            tfcompat.patch(model)
        assert info.value.family == FAMILY
        assert not tfcompat.is_patched(model)


class TestBadInputs:
    """Rule: bad inputs to a patched forward raise a typed error naming the family, before any attention."""

    @pytest.fixture()
    def patched(self):
        model = tiny_model(FAMILY, "sdpa")
        seqs = sample_sequences(model, [6, 8], [None, (1, 4, 6)])
        with tfcompat.patch(model) as handle:
            yield model, pack(model, seqs), handle

    def test_three_row_ids_need_a_text_row(self, patched):
        model, inputs, _ = patched
        inputs["position_ids"] = inputs["position_ids"][1:]
        with pytest.raises(tfcompat.InvalidInputError, match="no text row") as info:
            model(**inputs)
        assert info.value.family == FAMILY

    def test_missing_position_ids_is_an_ordinary_call(self, patched):
        """No position ids: not a packed row, so the stock forward answers (tests/test_ordinary_calls.py)."""
        model, inputs, handle = patched
        ids = inputs["input_ids"][:, :6]
        mask = torch.ones_like(ids)  # GLM-4V's stock mask builder on 4.53-4.55 crashes on 3-row ids without one
        with torch.no_grad():
            got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            handle.undo()
            expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert torch.equal(got, expected)

    def test_length_mismatch(self, patched):
        model, inputs, _ = patched
        inputs["position_ids"] = inputs["position_ids"][..., :-1]
        with pytest.raises(tfcompat.InvalidInputError, match="differ in length"):
            model(**inputs)

    def test_float_position_ids(self, patched):
        model, inputs, _ = patched
        inputs["position_ids"] = inputs["position_ids"].float()
        with pytest.raises(tfcompat.InvalidInputError, match="integer"):
            model(**inputs)

    def test_padding_before_the_end_is_rejected(self, patched):
        model, inputs, _ = patched
        mask = torch.ones_like(inputs["input_ids"])
        mask[0, 1] = 0  # right padding is a batch of packs (tests/test_padded_packs.py), this is not
        with pytest.raises(tfcompat.InvalidInputError, match="padding before its end"):
            model(**inputs, attention_mask=mask)

    def test_mask_of_ones_is_accepted(self, patched):
        model, inputs, _ = patched
        with torch.no_grad():
            a = model(**inputs, use_cache=False).logits
            b = model(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]), use_cache=False).logits
        assert torch.equal(a, b)


def test_rope_index_contract(resolved):
    """Rule: rope_index gives (4, B, L) [text; t; h; w]; text rows restart per sequence; t/h/w match stock."""
    model = tiny_model(FAMILY, "sdpa")
    seq = sample_sequences(model, [10], [(1, 4, 6)])[0]
    pos = tfcompat.rope_index(model, seq.input_ids, image_grid_thw=seq.image_grid_thw)
    length = seq.input_ids.shape[1]
    assert pos.shape == (4, 1, length) and pos.dtype == torch.long
    assert torch.equal(pos[0, 0], torch.arange(length))
    image = seq.input_ids[0] == model.config.image_token_id
    assert not torch.equal(pos[2, 0, image], pos[3, 0, image])  # h and w differ inside the image
    text = ~image
    assert torch.equal(pos[1, 0, text], pos[2, 0, text]) and torch.equal(pos[2, 0, text], pos[3, 0, text])


VIDEO_FAMILIES = [k for k, f in installed_families().items() if any(i and i[0] == "video" for i in f.sample_vision)]


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_declared_stock_video_rejection_is_real(family):
    """Rule: a release declared to reject videos does; one that is not declared accepts them."""
    r = tfcompat.resolve(family)
    model = tiny_model(family, "sdpa")
    seq = sample_sequences(model, [6], [("video", (2, 4, 4))])[0]
    if "videos_rejected" in r.entry.known_issues:
        # 4.54 Qwen2-VL: "Video features and video tokens do not match"; 5.3 Qwen3-VL: StopIteration in get_rope_index
        with pytest.raises((ValueError, StopIteration)):
            model(**stock_inputs(r, model, seq), use_cache=False)
    else:
        model(**stock_inputs(r, model, seq), use_cache=False)


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_declared_stock_mixed_rejection_is_real(family):
    """Rule: a release declared to reject images and videos in one forward does (GLM counts both with the image
    token); one that is not declared accepts them."""
    r = tfcompat.resolve(family)
    model = tiny_model(family, "sdpa")
    seqs = sample_sequences(model, [6, 6], [("image", (1, 2, 4)), ("video", (2, 2, 2))])
    if "videos_rejected" in r.entry.known_issues:
        pytest.skip(f"transformers {r.entry.versions} {family}: the stock forward rejects every video (known issue)")
    joined = pack(model, seqs)
    del joined["position_ids"]
    joined.pop("moe_mm_token_type_ids", None)  # stock_inputs builds them from the ids
    inputs = stock_inputs(r, model, Sequence(**joined))  # one sequence holding an image and a video
    if "images_with_videos_rejected" in r.entry.known_issues:
        with pytest.raises(ValueError, match="[Ii]mage features and image tokens do not match"):
            model(**inputs, use_cache=False)
    else:
        model(**inputs, use_cache=False)


@pytest.mark.parametrize("family", ["llama", FAMILY])
def test_position_ids_split_once_per_forward(family, monkeypatch):
    """Rule: a packed forward splits its position ids once (the top model's decision hands its split to the text
    model), and the logits still equal stock per sequence."""
    from tfcompat.hf import forward as hf_forward

    calls = []
    split = hf_forward.split_positions
    monkeypatch.setattr(hf_forward, "split_positions", lambda *a, **k: calls.append(1) or split(*a, **k))
    r = tfcompat.resolve(family)
    model = tiny_model(family, "sdpa")
    seqs = sample_sequences(model, [5, 7], [None, None])
    with torch.no_grad():
        expected = _stock_logits(r, model, seqs)
        inputs = pack(model, seqs)
        with tfcompat.patch(model):
            got = model(**inputs, use_cache=False).logits[0]
    # 1, not 0: the counted split is the forward's; not 2: the text model reuses the top model's
    assert len(calls) == 1, f"position ids split {len(calls)} times in one forward"
    assert max_token_diff(got, expected) <= 1e-5


@torch.no_grad()
def test_top_forward_without_kwargs_takes_packs_context():
    """A causal LM whose forward takes no ``**kwargs`` (4.x OpenLlama's): `tfcompat.pack`'s inputs, context
    included, run it packed, and the row equals stock per sequence."""
    resolved = tfcompat.resolve("llama")
    stock = tiny_model("llama", "sdpa")

    class NoKwargs(type(stock)):  # type: ignore[misc]
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, use_cache=None):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   labels=labels, use_cache=use_cache)

    model = NoKwargs(stock.config)
    model.load_state_dict(stock.state_dict())
    model.eval()
    seqs = sample_sequences(model, *CASES["llama", "text"], seed=2)
    expected = _stock_logits(resolved, model, seqs)
    packed = tfcompat.pack(model, [{"input_ids": s.input_ids} for s in seqs])
    with tfcompat.patch(model):
        got = model(**packed.model_inputs).logits[0]
    assert max_token_diff(got, expected) <= 1e-5
