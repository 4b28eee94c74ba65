"""Every image-text-to-text type the installed transformers ships (`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`), as
a tiny model with one fake image per sequence.

Rule: `tfcompat.patch(model)` either refuses with a typed error (the type passes as "refused", the reason recorded;
asked even where the zoo has no fake image for the type) or `tfcompat.pack` of three sequences (text around an image,
text alone, text around another image; and text around a video where the model takes videos) equals stock per
sequence per token, forward and backward (fp32, relative 1e-5), also through `tfcompat.embed_inputs`; the unpatched
packed row must differ (control). Items are laid out and typed as the processor does (`mm_token_type_ids`; a written
M-RoPE family's start/end tokens). Patched and wrong fails. A type whose tiny model cannot be built or run with an
image is an xfail that names why.

`python -m tests.every_type_report --kind image_text_to_text` prints the counts per release.
"""

from __future__ import annotations

import re

import pytest
import torch

import tfcompat
from tests.every_type import build, compare, image_sequence, vlm_check, vlm_examples
from tfcompat.errors import InvalidInputError, PatchError
from tfcompat.registry.derive import module_name
from tfcompat.registry.upstream import bug_in
from tfcompat.registry.versions import installed_transformers
from tfcompat.tiny_models import model_types

pytestmark = [pytest.mark.broad, pytest.mark.usefixtures("one_thread")]
TYPES = model_types("image_text_to_text")
VERSION = str(installed_transformers())


@pytest.mark.sweep
@pytest.mark.ci_sweep  # one reference per type already (sdpa, else eager): CI runs it on its newest release
@pytest.mark.parametrize("model_type", TYPES)
def test_packed_with_images_equals_stock_or_is_refused(request, model_type):
    outcome = vlm_check(model_type, "sdpa")
    if outcome.status == "skipped":
        outcome = vlm_check(model_type, "eager")
    request.node.user_properties.append(("outcome", f"{outcome.status}: {outcome.reason}"))
    if outcome.status == "skipped":
        pytest.skip(f"{model_type}: {outcome.reason}")
    if outcome.status == "unbuildable":
        pytest.xfail(f"{model_type}: tiny model cannot be built or run with an image: {outcome.reason}")
    assert outcome.status in ("pass", "refused"), outcome.reason


def _model(model_type: str) -> torch.nn.Module:
    _skip_unless_patched(model_type)
    return build(model_type, "sdpa", kind="image_text_to_text")


def _skip_unless_patched(model_type: str) -> None:
    """Skip where transformers ships no ``model_type``, or tfcompat refuses it for a declared upstream bug of the
    release (tests/test_upstream.py checks those)."""
    if model_type not in TYPES:
        pytest.skip(f"transformers ships no {model_type}")
    bug = bug_in(module_name(model_type), VERSION, model_type)
    if bug is not None:
        pytest.skip(f"{model_type} is refused on transformers {VERSION} for the upstream bug {bug.name}")


def test_resolve_says_derived_and_from_what():
    if "llava" not in TYPES:
        pytest.skip("transformers ships no llava")
    text = tfcompat.resolve("llava").explain()
    assert "DERIVED" in text
    assert "LlavaModel.language_model patched as llama" in text
    assert "vision tower vision_tower" in text
    assert "placeholder token id config.image_token_id" in text


def test_a_language_model_tfcompat_cannot_patch_is_refused_at_patch():
    refused = "its language model .* (is not a text family tfcompat patches|cannot be patched|takes M-RoPE)"

    def refused_for_its_language_model(model_type: str) -> bool:
        try:
            tfcompat.resolve(model_type)
        except PatchError as exc:
            return re.search(refused, exc.what) is not None
        except tfcompat.TfcompatError:
            return False
        return False

    found = [t for t in TYPES if refused_for_its_language_model(t)]
    if not found:
        pytest.skip("no image-text-to-text type of this release has a language model tfcompat cannot patch")
    for model_type in found:  # the first the zoo builds: patch() of the instance refuses alike
        try:
            model = _model(model_type)
        except Exception:  # noqa: BLE001 -- the zoo's limit: the next one
            continue
        with pytest.raises(PatchError, match="its language model"):
            tfcompat.patch(model)
        return
    pytest.xfail(f"the zoo builds none of {found}")


def test_rope_index_is_the_text_row():
    model = _model("llava")
    ids = image_sequence(model)["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    positions = tfcompat.rope_index(model, ids, attention_mask=mask)
    assert positions.shape == ids.shape
    assert positions[0, 2:].tolist() == list(range(ids.shape[1] - 2))
    with pytest.raises(InvalidInputError, match="takes no vision grids"):
        tfcompat.rope_index(model, ids, image_grid_thw=torch.tensor([[1, 2, 2]]))


def _token_typed() -> list[str]:
    """The types whose owner builds its language model's mask from token types (Gemma 3: images bidirectional)."""
    found = []
    for model_type in TYPES:
        try:
            v = tfcompat.resolve(model_type).entry.derived_vision
        except tfcompat.TfcompatError:
            continue
        if v is not None and v.mask_inputs:
            found.append(model_type)
    return found


@pytest.mark.parametrize("model_type", _token_typed())
def test_images_attend_within_themselves_on_packed_rows(model_type):
    """Token types marking images (bidirectional attention within each image): the packed row equals stock per
    sequence with the same token types, forward and backward; the control (no token types) differs."""
    from tests.every_type import compare, compare_gradients, gradients, projection, vlm_examples
    from tests.test_image_overlay import causal_without_types

    try:
        model = build(model_type, "sdpa", kind="image_text_to_text")
        examples = vlm_examples(model)
        if not causal_without_types(model, examples[1]):  # PaliGemma's sdpa: both ways (tests/test_derived.py)
            model = build(model_type, "eager", kind="image_text_to_text")
    except Exception as exc:  # noqa: BLE001 -- the zoo's limit, named
        pytest.xfail(f"{model_type}: tiny model cannot be built or run with an image: {exc}")
    if not causal_without_types(model, examples[1]):
        pytest.skip(f"{model_type}: the stock model attends both ways without token types; packed rows without them "
                    "are refused (tests/test_derived.py)")
    image_id = getattr(model.config, tfcompat.resolve(model_type).entry.derived_vision.placeholder)
    name = tfcompat.resolve(model_type).entry.derived_vision.mask_inputs[0]
    for ex in examples:
        ex[name] = (ex["input_ids"] == image_id).long()
    with torch.no_grad():
        expected = [model(**ex).logits[0] for ex in examples]
        causal = [model(**{k: v for k, v in ex.items() if k != name}).logits[0] for ex in examples]
    # the token types must change the stock result, unless the text config switches image blocks off (Gemma 4's
    # default use_bidirectional_attention=None; its "vision" mode: tests/test_derived.py): then packed == stock still
    # holds, without the control
    typed = compare(torch.cat(causal), expected) > 1e-3
    assert typed or "use_bidirectional_attention" in vars(model.config.get_text_config()), "token types ignored"
    w = projection(expected[0].shape[-1])
    expected_grads = gradients(model, lambda: sum((model(**ex).logits[0] @ w).sum() for ex in examples))
    with tfcompat.patch(model):
        inputs = tfcompat.pack(model, examples).model_inputs
        with torch.no_grad():
            assert compare(model(**inputs).logits[0], expected) <= 1e-5
        got_grads = gradients(model, lambda: (model(**inputs).logits[0] @ w).sum())
        assert compare_gradients(got_grads, expected_grads) <= 2e-5
        plain = {k: v for k, v in inputs.items() if k != name}  # no token types: the packed core, images causal
        with torch.no_grad():
            assert compare(model(**plain).logits[0], causal) <= 1e-5
        padded = {**{k: v for k, v in inputs.items() if not k.startswith("tfcompat")},
                  "attention_mask": torch.ones_like(inputs["input_ids"])}
        padded["attention_mask"][0, -1] = 0
        if typed:  # token types the owner masks causally (Gemma 4's without image blocks) take the packed core
            with pytest.raises(InvalidInputError, match="marks image tokens on a packed row that cannot attend"):
                model(**padded)
        model(**examples[0])  # one sequence, no packed row: the stock forward
    with pytest.raises(PatchError, match="builds its language model's mask from"):
        tfcompat.patch(model.model)  # the owner itself: its token types would come before the packed decision


def test_text_only_batch_runs_the_tower_on_a_dummy_image():
    """embed_inputs without images: every tower parameter an image reaches gets a (zero) gradient rather than none."""
    model = _model("llava")
    tower = dict(model.model.vision_tower.named_parameters())
    with_image = image_sequence(model)
    model(**with_image).logits.sum().backward()
    reached = {n for n, p in tower.items() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    ids = with_image["input_ids"]
    ids = ids[ids != model.config.image_token_id][None]
    embedded = tfcompat.embed_inputs(model, ids)
    assert torch.equal(embedded.inputs_embeds, model.get_input_embeddings()(ids))
    embedded.inputs_embeds.sum().backward()
    assert reached and {n for n, p in tower.items() if p.grad is not None} == reached
    assert all(not tower[n].grad.any() for n in reached)


def test_the_text_model_follows_the_instance_config():
    """A LLaVA built around another text model is patched as that text family (here Qwen2), and packs exactly."""
    if "llava" not in TYPES:
        pytest.skip("transformers ships no llava")
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    from tests.every_type import vlm_examples

    tiny = build("llava", "sdpa", kind="image_text_to_text")
    text = {k: v for k, v in tiny.config.text_config.to_dict().items() if k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "pad_token_id")}
    config = LlavaConfig(vision_config=tiny.config.vision_config.to_dict(),
                         text_config={"model_type": "qwen2", **text}, image_token_id=tiny.config.image_token_id,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).float().eval()
    examples = vlm_examples(model)
    with torch.no_grad():
        expected = torch.cat([model(**ex).logits[0] for ex in examples])
    with tfcompat.patch(model) as handle:
        assert "patched as qwen2" in handle.resolved.explain()
        with torch.no_grad():
            got = model(**tfcompat.pack(model, examples).model_inputs).logits[0]
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_pack_places_images_as_the_owner_reads_them():
    """(images, ...) layouts concatenate on dim 0, (B, images, ...) ones (Idefics3) on dim 1; zero-padded to the
    largest trailing shape as a processor pads a batch."""
    from tfcompat.inputs.derived_vision import _concat

    a, b = torch.ones(1, 2, 3), torch.ones(2, 1, 4)
    joined = _concat([a, b], dim=0)
    assert joined.shape == (3, 2, 4) and joined[0, :, 3].eq(0).all() and joined[1, 1].eq(0).all()
    rows = _concat([torch.ones(1, 1, 2, dtype=torch.bool), torch.ones(1, 2, 3, dtype=torch.bool)], dim=1)
    assert rows.shape == (1, 3, 3) and rows.dtype == torch.bool and not rows[0, 0, 2]
    for model_type, batched in (("idefics3", True), ("llava", False)):
        if model_type in TYPES:
            assert tfcompat.resolve(model_type).entry.derived_vision.batched_images is batched


class _Tower(torch.nn.Module):
    pass


class _SharesKwargs(torch.nn.Module):
    """An owner spreading its **kwargs (position ids in them) into a method of its own, a submodule it builds, and
    a module-level function held as an attribute it does not build."""

    def __init__(self, helper):
        super().__init__()
        self.tower = _Tower()
        self.helper = helper
        self.language_model = torch.nn.Identity()

    def features(self, x, **kwargs):
        return x

    def forward(self, input_ids=None, images=None, **kwargs):
        self.features(images, **kwargs)
        self.tower(images, **kwargs)
        self.helper(images, **kwargs)
        return self.language_model(inputs_embeds=input_ids, **kwargs)


def test_kwargs_shared_with_a_vision_call_are_read_or_refused():
    """A call the owner's **kwargs reach besides its language model packs where a patch can wrap it (a method of
    the owner, a submodule it builds: `VisionDerivation.kwargs_shared`), and is refused, naming it, otherwise."""
    from tfcompat.registry import derive_vision

    assert derive_vision._kwargs_shared(_SharesKwargs, "language_model") == ("features", "helper", "tower")
    assert derive_vision._shared_target(_SharesKwargs, "features")
    assert derive_vision._shared_target(_SharesKwargs, "tower")
    assert not derive_vision._shared_target(_SharesKwargs, "helper")  # assigned a parameter, not built
    why = derive_vision._forwards_to(_SharesKwargs, "language_model", None)
    assert re.search(r"hands its \*\*kwargs, which carry the position ids, to self.helper besides "
                     r"self.language_model, and it is neither a method", why), why


def test_instructblipvideo_keeps_the_row_positions_from_its_video_features(monkeypatch):
    """InstructBLIP-Video's forward hands its **kwargs to get_video_features (vision tower and Q-Former) besides its
    language model: the derivation names that call, and the patch's wrapper is what makes the packed row exact (the
    same check without it fails: the Q-Former reads the row's position ids)."""
    _skip_unless_patched("instructblipvideo")
    entry = tfcompat.resolve("instructblipvideo").entry
    shared = entry.derived_vision.kwargs_shared
    if not shared:  # a release whose forward hands get_video_features no **kwargs
        assert vlm_check("instructblipvideo", "sdpa").status == "pass"
        return
    assert ("get_video_features" in {path for _, path in shared}), shared
    outcome = vlm_check("instructblipvideo", "sdpa")
    assert outcome.status == "pass", outcome.reason
    monkeypatch.setenv("TFCOMPAT_PROVE", "0")  # the control's patch is not proved first (the proof would refuse it)
    monkeypatch.setattr("tfcompat.hf.patching.shared_kwargs", lambda *a, **k: [])  # the row's positions reach it
    without = vlm_check("instructblipvideo", "sdpa")
    assert without.status == "fail", without.reason


@pytest.mark.parametrize("model_type", [
    "cohere_compass", "granite_docling", "granite4_vision", "qwen3_omni_moe_thinker", "qwen2_5_omni_thinker", "blip-2",
    "instructblip", "instructblipvideo", "qwen4_exp", "hunyuan_vl", "chameleon"])
def test_packs_what_the_owner_hands_its_language_model(model_type):
    """DeepStack features added at the visual tokens (read from the text model: by a method, or inline in its loop as
    Granite 4 Vision's per-layer dict, which `embed_inputs` refuses), M-RoPE numbered from locals of the
    owner's forward (Qwen-Omni's audio lengths), the decoder-only call of an owner that can build either kind of
    language model (BLIP-2), per-token lookups the text model would make itself (Qwen4-Exp's ``ple_input_ids``),
    M-RoPE of another number of axes (HunYuan-VL's XD-RoPE, four: ``(5, B, L)`` position ids), a text model that
    embeds its images itself (Chameleon's VQ codes): packed equals stock per sequence, forward and backward, and the
    control differs (`vlm_check`)."""
    _skip_unless_patched(model_type)
    outcome = vlm_check(model_type, "sdpa")
    if outcome.status == "unbuildable":  # the zoo's limit on this release (4.57's BLIP-2 Q-Former: no sdpa), named
        pytest.xfail(f"{model_type}: {outcome.reason}")
    assert outcome.status == "pass", outcome.reason


@pytest.mark.parametrize("model_type", ["minicpm_ocr", "minicpmv4_6", "minicpmv4_7", "molmo2"])
def test_packs_what_the_processor_batches_its_own_way(model_type):
    """Hybrid (Gated DeltaNet) language models behind a tower (MiniCPM-V's Qwen3.5 text model), NaViT-packed patches
    concatenated on the axis the processor batches them along (MiniCPM-V: the last), and pooling indices into the
    whole batch's patches shifted per sequence (Molmo2 where the model does not offset them itself): packed equals
    stock per sequence, forward and backward, and the control differs (`vlm_check`)."""
    _skip_unless_patched(model_type)
    outcome = vlm_check(model_type, "sdpa")
    if outcome.status == "unbuildable":  # the zoo's limit on this release (4.57's BLIP-2 Q-Former: no sdpa), named
        pytest.xfail(f"{model_type}: {outcome.reason}")
    assert outcome.status == "pass", outcome.reason


def test_embed_inputs_refuses_what_the_forward_does_not_take():
    model = _model("llava")
    ids = image_sequence(model)["input_ids"]
    with pytest.raises(InvalidInputError, match=r"embed_inputs got \['image_grid_thw'\]"):
        tfcompat.embed_inputs(model, ids, image_grid_thw=torch.tensor([[1, 2, 2]]))


def test_llama4_is_reached_through_its_causal_lm():
    _skip_unless_patched("llama4")
    text = tfcompat.resolve("llama4").explain()
    assert "Llama4ForConditionalGeneration.language_model -> Llama4ForCausalLM.model" in text


def test_embeddings_are_refused_where_the_forward_takes_none_alone():
    """4.53's Idefics2 / SmolVLM forwards raise for inputs_embeds without input_ids: embed_inputs says so, typed."""
    needy = []
    for model_type in ("idefics2", "smolvlm"):
        if model_type in TYPES and bug_in(module_name(model_type), VERSION, model_type) is None and (
                tfcompat.resolve(model_type).entry.derived_vision.embeds_need_ids):
            needy.append(model_type)
    if not needy:
        pytest.skip("on this transformers every such forward takes inputs_embeds alone")
    model = _model(needy[0])
    with pytest.raises(InvalidInputError, match="cannot take embeddings computed outside its forward"):
        tfcompat.embed_inputs(model, image_sequence(model)["input_ids"])


@pytest.mark.parametrize("tuning", [True, False])
def test_llama4_packs_with_images(tuning):
    """Llama 4's NoPE layers scale queries by their position when ``attn_temperature_tuning`` is on (the default;
    on a packed row rescaled to the position in each sequence); on or off, the packed row with images equals stock
    per sequence, forward and backward."""
    from tests.every_type import compare, compare_gradients, gradients, projection, vlm_examples

    model = _model("llama4")
    for module in model.modules():
        if hasattr(module, "attn_temperature_tuning"):
            module.attn_temperature_tuning = tuning
    model.config.text_config.attn_temperature_tuning = tuning
    examples = vlm_examples(model)
    with torch.no_grad():
        expected = [model(**ex, use_cache=False).logits[0] for ex in examples]
    w = projection(expected[0].shape[-1])
    expected_grads = gradients(model, lambda: sum((model(**ex, use_cache=False).logits[0] @ w).sum()
                                                  for ex in examples))
    with tfcompat.patch(model):
        inputs = tfcompat.pack(model, examples).model_inputs
        with torch.no_grad():
            assert compare(model(**inputs, use_cache=False).logits[0], expected) <= 1e-5
        got = gradients(model, lambda: (model(**inputs, use_cache=False).logits[0] @ w).sum())
    assert compare_gradients(got, expected_grads) <= 2e-5
    control = {k: v for k, v in inputs.items() if not k.startswith("tfcompat") and k != "position_ids"}
    with torch.no_grad():
        assert compare(model(**control, use_cache=False).logits[0], expected) > 1e-3


def test_video_rows_carry_the_processors_token_types():
    """Rule: the sweep's video row of a written M-RoPE family is laid out and typed as its processor does. Control:
    without ``mm_token_type_ids`` the 5.3+ Qwen2.5-VL forward places the video as text (the 6e-3 "difference" of the
    naive video check was this reference, not tfcompat), so the types change the stock logits."""
    from tests.every_type import logits_of, video_sequence

    model = _model("qwen2_5_vl")
    if getattr(model.config, "vision_start_token_id", None) is None:
        pytest.skip("this release's Qwen2.5-VL config names no vision_start_token_id: no processor layout to build")
    row = video_sequence(model, seed=3)
    assert row is not None
    ids = row["input_ids"]
    video = ids == model.config.video_token_id
    start = int(video.long().argmax())
    assert bool(video.any()) and int(ids[0, start - 1]) == model.config.vision_start_token_id
    if not tfcompat.resolve("qwen2_5_vl").entry.rope_index_mm_token_types:  # 4.x finds videos by vision_start
        assert "mm_token_type_ids" not in row
        return
    assert torch.equal(row["mm_token_type_ids"], 2 * video.long())
    with torch.no_grad():
        typed = logits_of(model, **row)
        untyped = logits_of(model, **{k: v for k, v in row.items() if k != "mm_token_type_ids"})
    assert float((typed - untyped).abs().max()) > 1e-4


def _on_other_text(model_type: str) -> torch.nn.Module:
    """The type's tiny model built on another text family (qwen2; llama for a qwen2 one), or an xfail naming why."""
    import transformers

    from tfcompat.tiny_models import model_class_name, shrunk_config, tiny_config

    try:
        base = tiny_config(model_type, "image_text_to_text")
        own = getattr(getattr(base, "text_config", None), "model_type", None)
        if own is None:
            pytest.skip(f"{model_type} has no text config")
        values = {k: v for k, v in base.to_dict().items() if k not in ("model_type", "transformers_version")}
        values["text_config"] = {"model_type": "llama" if own == "qwen2" else "qwen2"}
        config = shrunk_config(type(base)(**values))
        torch.manual_seed(0)
        cls = getattr(transformers, model_class_name(model_type, "image_text_to_text"))
        return cls._from_config(config, attn_implementation="sdpa").eval()
    except Exception as exc:  # noqa: BLE001 -- the config class takes no other text family: named
        pytest.xfail(f"{model_type} does not build on another text family: {type(exc).__name__}: {exc}"[:300])


@pytest.mark.sweep
@pytest.mark.parametrize("model_type", TYPES)
def test_packed_with_images_on_another_text_family(model_type):
    """Rule: a vision-language type built on another text family than its default (the language model its config
    names is the one derived) packs with images exactly or is refused, typed; never patched and wrong."""
    model = _on_other_text(model_type)
    try:
        examples = vlm_examples(model)[:3]
        with torch.no_grad():
            expected = [model(**ex).logits[0] for ex in examples]
    except Exception as exc:  # noqa: BLE001 -- the zoo's limit, named
        pytest.xfail(f"{model_type}: no image sequence runs stock on the other text family: {exc}"[:300])
    try:
        with torch.no_grad(), tfcompat.patch(model):
            got = model(**tfcompat.pack(model, examples).model_inputs).logits[0]
    except tfcompat.TfcompatError:
        return  # refused, typed
    assert compare(got, expected) <= 1e-5


@pytest.mark.parametrize("model_type", ["llava", "internvl", "mistral3"])
def test_packs_on_another_text_family(model_type):
    """The same rule, in every run, for three of the commonest types."""
    if model_type not in TYPES:
        pytest.skip(f"transformers ships no {model_type}")
    test_packed_with_images_on_another_text_family(model_type)


@pytest.mark.parametrize("sections", [[16, 16, 16, 16], [24, 20, 20]])
def test_xd_rope_takes_the_number_of_axes_of_its_config(sections):
    """HunYuan-VL's text model takes exactly as many M-RoPE rows as its config's ``mrope_section`` has axes (its
    forward raises for any other number, also for a text row in front): the derivation reads that expression
    (`VisionDerivation.mrope_axes`), and the contract's ids are ``(1 + A, B, L)``: packed equals stock per sequence,
    on 4 axes and on 3; ``(A, B, L)`` without the text row is refused, typed."""
    if "hunyuan_vl" not in TYPES:
        pytest.skip("transformers ships no hunyuan_vl")
    from tfcompat.tiny_models import shrunk_config, tiny_config

    config = tiny_config("hunyuan_vl", "image_text_to_text")
    rope = {**config.text_config.rope_parameters, "mrope_section": [s * 8 // sum(sections) for s in sections]}
    rope["mrope_section"][-1] += 8 - sum(rope["mrope_section"])  # the tiny head's 8 rotary frequencies
    config.text_config.rope_parameters = rope
    model_cls = getattr(__import__("transformers"), type(build("hunyuan_vl", "sdpa", kind="image_text_to_text"))
                        .__name__)
    torch.manual_seed(0)
    model = model_cls._from_config(shrunk_config(config), attn_implementation="sdpa").eval()
    examples = vlm_examples(model)
    with torch.no_grad():
        expected = [model(**ex).logits[0] for ex in examples]
        with tfcompat.patch(model):
            inputs = tfcompat.pack(model, examples).model_inputs
            assert inputs["position_ids"].shape[0] == 1 + len(sections)
            assert compare(model(**inputs).logits[0], expected) <= 1e-5
            with pytest.raises(InvalidInputError, match=f"{len(sections)}-row position ids have no text row"):
                model(**{**inputs, "position_ids": inputs["position_ids"][1:]})


@pytest.mark.parametrize("swin_norm", [False, True])
def test_a_text_model_that_embeds_its_images_itself(swin_norm):
    """Chameleon's config names no text model: its ``ChameleonModel`` is the text model and scatters its images'
    VQ-code embeddings at the placeholders itself (read: ``inputs_embeds.masked_scatter``, 4.x: into ``input_ids``).
    It derives from that class (both layer classes its ``__init__`` may build: ``swin_norm``), packs with images equal
    to stock per sequence, and refuses embeddings computed outside its forward."""
    if "chameleon" not in TYPES:
        pytest.skip("transformers ships no chameleon")
    from tfcompat.tiny_models import shrunk_config, tiny_config

    entry = tfcompat.resolve("chameleon").entry
    if entry.derived_vision is None:
        pytest.skip("chameleon is not derived here")
    assert entry.derived_vision.language_model_attr == "model" and entry.derived_vision.embeds_need_ids
    config = tiny_config("chameleon", "image_text_to_text")
    config.swin_norm = swin_norm
    model_cls = type(build("chameleon", "eager", kind="image_text_to_text"))
    torch.manual_seed(0)
    model = model_cls._from_config(shrunk_config(config), attn_implementation="eager").eval()
    examples = vlm_examples(model)
    with torch.no_grad():
        expected = [model(**ex).logits[0] for ex in examples]
        with tfcompat.patch(model):
            inputs = tfcompat.pack(model, examples).model_inputs
            assert compare(model(**inputs).logits[0], expected) <= 1e-5
            with pytest.raises(InvalidInputError, match="cannot take embeddings computed outside"):
                tfcompat.embed_inputs(model, inputs["input_ids"], pixel_values=inputs["pixel_values"])


def _sharing_placeholder() -> list[str]:
    """Derived types whose owner finds images and videos at one token id (GLM-OCR's), on the installed release."""
    found = []
    for model_type in ("glm_ocr", "glmga"):
        try:
            v = tfcompat.resolve(model_type).entry.derived_vision
        except (PatchError, tfcompat.UnknownFamilyError, tfcompat.UnsupportedVersionError):
            continue
        if v is not None and v.kinds_share_placeholder:
            found.append(model_type)
    return found


@pytest.mark.parametrize("model_type", _sharing_placeholder() or [pytest.param(
    "", marks=pytest.mark.skip(reason="no derived type finds images and videos at one token id on this release"))])
def test_images_and_a_video_share_a_row_where_the_owner_rejects_the_mix(model_type):
    """GLM-OCR's placeholder mask counts a video's frames as image tokens, so its stock forward rejects a row holding
    images and a video (the control: it raises on the packed ids). `tfcompat.pack` embeds each sequence alone, as
    stock does, and the packed row of embeddings equals stock per sequence, forward and backward."""
    model = build(model_type, "sdpa", kind="image_text_to_text")
    examples = vlm_examples(model)
    assert any("pixel_values_videos" in ex for ex in examples) and any("pixel_values" in ex for ex in examples)
    with torch.no_grad():
        expected = [model(**ex, use_cache=False).logits[0] for ex in examples]
    w = torch.randn(expected[0].shape[-1], generator=torch.Generator().manual_seed(3))
    model.zero_grad()
    sum((model(**ex, use_cache=False).logits[0] @ w).sum() for ex in examples).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with tfcompat.patch(model):
        packed = tfcompat.pack(model, examples).model_inputs
        assert "inputs_embeds" in packed and "input_ids" not in packed and "pixel_values" not in packed
        with torch.no_grad():
            assert compare(model(**packed, use_cache=False).logits[0], expected) <= 1e-5
        (model(**packed, use_cache=False).logits[0] @ w).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    assert max(float((got[n] - g).abs().max()) / max(1.0, float(g.abs().max())) for n, g in want.items()) <= 2e-5
    ids = torch.cat([ex["input_ids"] for ex in examples], dim=1)
    vision = {k: torch.cat([ex[k] for ex in examples if k in ex]) for k in ("pixel_values", "image_grid_thw",
                                                                            "pixel_values_videos", "video_grid_thw")}
    with pytest.raises(Exception, match="do not match"), torch.no_grad():  # the control: stock rejects the mix
        model(input_ids=ids, **vision, use_cache=False)


@pytest.mark.parametrize("model_type", [t for t in ("idefics2", "idefics3", "llava") if t in TYPES])
def test_a_config_asking_for_a_cache_packs_without_one(model_type):
    """Rule: a packed call that leaves ``use_cache`` unset, on a config that says ``use_cache=True``, builds no KV
    cache anywhere (transformers 4.x Idefics2 started a legacy cache above the text model and converted the None the
    packed text model returned: an AttributeError in the forward); the logits equal stock per sequence."""
    model = build(model_type, kind="image_text_to_text")
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.use_cache = True
    examples = vlm_examples(model)[:3]
    with torch.no_grad():
        expected = [model(**ex).logits[0] for ex in examples]
        with tfcompat.patch(model):
            got = model(**tfcompat.pack(model, examples).model_inputs).logits[0]
    assert compare(got, expected) <= 1e-5
