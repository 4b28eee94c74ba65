"""Declared upstream bugs (`tfcompat.registry.upstream`): stock models that, on some releases, mix the tokens of a row,
do not build from their published config, or do not run on their processor's inputs.

Rules: every declared bug has a check here that it is real; on the installed release, each bug whose range holds it
shows (the stock model mixes the batch, does not build, or raises), and every derived type it names is refused at
``resolve()`` naming it, with its fix; the bug's model types and extra distribution narrow it (a module's other types
stay patched).
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from importlib import metadata

import pytest
import torch

import tfcompat
from tfcompat.errors import PatchError
from tfcompat.registry.derive import causal_lm_types, module_name
from tfcompat.registry.derive_vision import vision_types
from tfcompat.registry.upstream import UPSTREAM_BUGS, UpstreamBug, bug_in
from tfcompat.registry.versions import VersionRange, installed_transformers

VERSION = str(installed_transformers())
# the causal-LM and vision-language types of the installed release -> their declared bug
DECLARED = {t: b for t in sorted({*causal_lm_types(), *vision_types()})
            if (b := bug_in(module_name(t), VERSION, t)) is not None}


def _types_of(bug: UpstreamBug) -> list[str]:
    types = [t for t, b in DECLARED.items() if b == bug]
    if not types:
        pytest.skip(f"{bug.name} is not on transformers {VERSION} (its releases: {bug.versions}"
                    + (f", with {bug.needs[0]} {bug.needs[1]})" if bug.needs else ")"))
    return types


def _moe_scores_misaligned(bug: UpstreamBug) -> None:
    """Two sequences of one length run as a batch differ from each run alone: the stock text MoE mixes tokens (the
    vision model runs the same text model)."""
    from tests.test_derived import LENGTHS, rel_diff, sequences, tiny

    _types_of(bug)
    model = tiny("llama4_text", "eager")
    seqs = [s[:, :LENGTHS[2]] for s in sequences()[1:]]  # one length: no padding in the batch
    with torch.no_grad():
        alone = [model(input_ids=s).logits[0] for s in seqs]
        batch = model(input_ids=torch.cat(seqs)).logits
    assert rel_diff(batch.flatten(0, 1), alone) > 1e-3


def _pad_token_id_on_composite(bug: UpstreamBug) -> None:
    """The composite built from a config that names pad_token_id in its text config only (as published checkpoints
    do) raises; with the top config given the text config's, it builds, and its forward with an image raises while
    the same forward on text alone runs (control)."""
    from tests.every_type import image_sequence, sample_sequences
    from tfcompat.tiny_models import tiny_config

    for model_type in _types_of(bug):
        config = tiny_config(model_type, "image_text_to_text")
        config.text_config.pad_token_id = 0  # where a published config names it
        cls = importlib.import_module("transformers").Llama4ForConditionalGeneration
        with pytest.raises(AttributeError, match="has no attribute 'pad_token_id'"):
            cls(config)
        config.pad_token_id = config.text_config.pad_token_id
        model = cls(config).float().eval()
        with torch.no_grad():
            ids = sample_sequences(config, lengths=(6,))[0][None]
            assert torch.isfinite(model(input_ids=ids, use_cache=False).logits).all()
            with pytest.raises(AttributeError, match="has no attribute 'pooler_output'"):
                model(**image_sequence(model), use_cache=False)


def _output_image_outputs(bug: UpstreamBug) -> None:
    """The stock forward raises on text alone, also asked for a tuple (its decorators return a model output);
    control: its language model returns finite logits on the same ids, so only the output's construction fails."""
    from tests.every_type import build, sample_sequences

    for model_type in _types_of(bug):
        model = build(model_type, "sdpa", kind="image_text_to_text")
        ids = sample_sequences(model.config, lengths=(6,))[0][None]
        for return_dict in (True, False):
            with torch.no_grad(), pytest.raises(AttributeError, match="has no attribute 'image_outputs'"):
                model(input_ids=ids, use_cache=False, return_dict=return_dict)
        with torch.no_grad():
            assert torch.isfinite(model.language_model(input_ids=ids, use_cache=False).logits).all()


def _bool_config_field_typed_int(bug: UpstreamBug) -> None:
    """Each named type's config class raises on its own defaults, naming a bool value given to an int field."""
    configs = importlib.import_module("transformers.models.auto.configuration_auto").CONFIG_MAPPING
    for model_type in _types_of(bug):
        with pytest.raises(Exception, match=r"Field '\w+' (expected int, got bool|with value (True|False) doesn't "
                                            r"match any type in \(<class 'int'>)") as info:
            configs[model_type]()
        assert type(info.value).__name__ == "StrictDataclassFieldValidationError"


def _image_blocks_of_patch_size(bug: UpstreamBug) -> None:
    """The stock forward raises on text around one image whose token count is not a multiple of the vision patch
    size; control: the image's features themselves are whole rows of the text hidden size (the zoo's image fits)."""
    from tests.every_type import build, image_sequence
    from tfcompat.tiny_models import tiny_image

    for model_type in _types_of(bug):
        model = build(model_type, "sdpa", kind="image_text_to_text")
        image = tiny_image(model)
        assert image.tokens % model.config.vision_config.patch_size != 0
        with torch.no_grad(), pytest.raises(RuntimeError, match="is invalid for input of size|not divisible by patch"):
            model(**image_sequence(model), use_cache=False)


def _dynamic_mask_skipped_by_sdpa(bug: UpstreamBug) -> None:
    """One sequence without padding: the sdpa model and its eager copy (the same weights, the dynamic mask's ``A``
    drawn, not left at its zero init, where the mask is constant) differ; control: on the same release, the sdpa
    model given one padded batch of that sequence and a shorter one agrees with eager on the full sequence."""
    from tests.every_type import sample_sequences
    from tfcompat.tiny_models import tiny_model

    (model_type,) = _types_of(bug)
    model = tiny_model(model_type, attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".A"):
                p.normal_()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    seq = sample_sequences(model.config, lengths=[9], seed=0)[0][None]  # (1, 9)
    padded = torch.cat([seq, torch.cat([seq[:, :5], torch.zeros_like(seq[:, :4])], -1)])  # (2, 9), right padding
    mask = torch.tensor([[1] * 9, [1] * 5 + [0] * 4])
    with torch.no_grad():
        alone, reference = model(input_ids=seq).logits[0], eager(input_ids=seq).logits[0]
        batch = model(input_ids=padded, attention_mask=mask).logits[0]
    assert ((alone - reference).abs().max() / reference.abs().max()) > 1e-2
    assert ((batch - reference).abs().max() / reference.abs().max()) < 1e-5


REAL: dict[str, Callable[[UpstreamBug], None]] = {
    "llama4_moe_scores_misaligned": _moe_scores_misaligned,
    "llama4_pad_token_id_on_composite": _pad_token_id_on_composite,
    "llama4_output_image_outputs": _output_image_outputs,
    "bool_config_field_typed_int": _bool_config_field_typed_int,
    "smolvlm_image_blocks_of_patch_size": _image_blocks_of_patch_size,
    "doge_dynamic_mask_skipped_by_sdpa": _dynamic_mask_skipped_by_sdpa,
}


def test_every_declared_bug_has_a_check():
    assert sorted(REAL) == sorted(b.name for b in UPSTREAM_BUGS)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("bug", UPSTREAM_BUGS, ids=lambda b: b.name)
def test_declared_bug_is_real(bug):
    REAL[bug.name](bug)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("model_type", sorted(DECLARED))
def test_refused_at_resolve_and_patch_naming_the_bug(model_type):
    """At ``resolve()``, and at ``patch()`` of a tiny model where the stock model builds at all."""
    from tests.every_type import build
    from tfcompat.tiny_models import TinyModelError

    bug = DECLARED[model_type]
    with pytest.raises(PatchError, match=rf"upstream bug .*\({bug.name}\)") as info:
        tfcompat.resolve(model_type)
    assert info.value.fix == bug.fix and info.value.why == bug.what
    try:
        model = build(model_type, kind="image_text_to_text" if model_type in vision_types() else "causal_lm")
    except TinyModelError:
        return  # the bug itself, or the zoo's limit: resolve() above already refuses without a model
    with pytest.raises(PatchError, match=rf"\({bug.name}\)"):
        tfcompat.patch(model)


def test_types_and_distributions_narrow_a_bug():
    llama4 = "transformers.models.llama4.modeling_llama4"
    assert bug_in(llama4, "5.24.0", "llama4").name == "llama4_output_image_outputs"
    assert bug_in(llama4, "5.24.0", "llama4_text") is None  # the causal LM's forward is another one
    assert bug_in(llama4, "5.23.0", "llama4") is None
    assert bug_in(llama4, "4.55.4", "llama4_text").name == "llama4_moe_scores_misaligned"  # every type of the module
    bool_typed = next(b for b in UPSTREAM_BUGS if b.name == "bool_config_field_typed_int")
    hub = metadata.version("huggingface_hub")
    shows = hub in VersionRange("1.9")
    assert (bug_in(module_name("cohere2"), "5.4.0", "cohere2") == bool_typed) is shows
