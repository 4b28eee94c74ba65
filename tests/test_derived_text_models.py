"""Vision-language models whose language model's type has no causal LM of its own (its ``text_config.model_type`` is
in no ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, nor a family key): the text family is derived from the text model class
itself (`tfcompat.registry.derive.derive_text_model`), or is the written family whose text model it is.

Rules: such a type resolves with a derived text model, or is refused naming the real reason (M-RoPE, an
encoder-decoder, what its attention passes), never as an unknown family; a derived one packs text exactly as stock per
sequence, forward and backward, through the vision-language model (its images are the model's own forward, checked
per type by tests/test_every_vlm.py where the zoo can lay images out); the M-RoPE reading agrees with every written
table on the installed release.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

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
    logits_of,
    packed_inputs,
    projection,
    sample_sequences,
    stock_per_sequence,
)
from tfcompat.errors import PatchError, TfcompatError
from tfcompat.registry import derive, lookup
from tfcompat.registry.derive_vision import default_text_type, vision_types
from tfcompat.registry.versions import installed_transformers
from tfcompat.tiny_models import model_types

pytestmark = [pytest.mark.broad, pytest.mark.usefixtures("one_thread")]
TYPES = model_types("image_text_to_text")
VERSION = installed_transformers() or ""


def _without_causal_lm() -> list[str]:
    """The image-text-to-text types, in mapping order, without a written table or a causal LM of their own, whose
    language model's type is neither a causal LM, a family key (written or a written family's text-only model) nor a
    vision-language type itself."""
    known = {**lookup.families(), **lookup._text_only_families()}
    lms = derive.causal_lm_types()
    return [t for t in TYPES if t not in known and t not in lms and (text := default_text_type(t)) not in (None, t)
            and text not in known and text not in lms and text not in vision_types()]


def _resolution(model_type: str) -> tfcompat.Resolved | TfcompatError:
    try:
        return tfcompat.resolve(model_type)
    except TfcompatError as exc:
        return exc


WITHOUT_CAUSAL_LM = _without_causal_lm()
RESOLUTIONS = {t: _resolution(t) for t in WITHOUT_CAUSAL_LM}
DERIVED = [t for t, r in RESOLUTIONS.items() if isinstance(r, tfcompat.Resolved)
           and r.entry.derived is not None and r.entry.derived_vision is not None]


@pytest.mark.parametrize("model_type", WITHOUT_CAUSAL_LM)
def test_resolves_or_is_refused_naming_the_reason(model_type):
    result = RESOLUTIONS[model_type]
    if isinstance(result, TfcompatError):
        assert isinstance(result, PatchError)
        assert "unknown model family" not in str(result), str(result)
    else:  # a vision-language entry, or an encoder-decoder one (its decoder's family: PP-FormulaNet's)
        derived = result.entry.derived_vision or result.entry.encoder_decoder
        assert derived is not None
        assert derived.text_family == default_text_type(model_type)


def test_some_type_of_this_kind_derives():
    if not WITHOUT_CAUSAL_LM:
        pytest.skip(f"transformers {VERSION} ships no image-text-to-text type whose text type has no causal LM")
    if not DERIVED:
        pytest.skip(f"on transformers {VERSION}, every such type is refused: "
                    + "; ".join(f"{t}: {r}".splitlines()[0] for t, r in RESOLUTIONS.items()))
    r = tfcompat.resolve(DERIVED[0])
    derived = r.entry.derived_vision
    assert r.entry.text_model_positions == "text" or (derived is not None and derived.positions_call)
    text = r.explain()
    assert "DERIVED" in text and f"patched as {default_text_type(DERIVED[0])}" in text


def _or_skip(types: list[str], why: str) -> list[Any]:
    return types or [pytest.param(None, marks=pytest.mark.skip(reason=f"transformers {VERSION}: {why}"))]


@pytest.mark.parametrize("model_type", _or_skip(DERIVED, "no type whose text type has no causal LM derives"))
def test_packed_text_equals_stock_per_sequence(model_type):
    """Text rows through the vision-language model: patched packed == stock per sequence, forward and backward; the
    unpatched packed row differs (control)."""
    try:
        model = build(model_type, "sdpa", kind="image_text_to_text")
        seqs = sample_sequences(model.config)
        with torch.no_grad():
            expected = stock_per_sequence(model, seqs)
    except Exception as exc:  # noqa: BLE001 -- the zoo's limit, named
        pytest.xfail(f"{model_type}: tiny model cannot be built or run: {exc}")
    w = projection(expected[0].shape[-1])
    expected_grads = gradients(model, lambda: sum((o @ w).sum() for o in stock_per_sequence(model, seqs)))
    inputs = packed_inputs(seqs)
    with tfcompat.patch(model) as handle:
        assert handle.resolved.entry.derived_vision is not None
        with torch.no_grad():
            diff = compare(logits_of(model, **inputs), expected)
        got_grads = gradients(model, lambda: (logits_of(model, **inputs) @ w).sum())
    assert got_grads.keys() == expected_grads.keys()
    assert diff <= TOLERANCE
    assert compare_gradients(got_grads, expected_grads) <= GRAD_TOLERANCE
    with torch.no_grad():  # control: the same row unpatched, positions running on, attends across sequences
        running = torch.arange(inputs["input_ids"].shape[1])[None]
        control = compare(logits_of(model, input_ids=inputs["input_ids"], position_ids=running), expected)
    assert control > 1e-3


def _written_text_types() -> dict[str, list[str]]:
    """text type -> the written families whose text model class ``MODEL_MAPPING_NAMES`` maps it to, in their text
    module (``qwen3_vl_text``: ``qwen3_vl``; ``glm4v_text``: ``glm4v`` and ``glm46v``), the type neither a family key
    nor a causal LM of its own (5.25's ``exaone`` runs ``LlamaForCausalLM``: it derives as a causal LM)."""
    names = importlib.import_module("transformers.models.auto.modeling_auto").MODEL_MAPPING_NAMES
    known = {**lookup.families(), **lookup._text_only_families(), **derive.causal_lm_types()}
    found: dict[str, list[str]] = {}
    for key, fam in lookup.families().items():
        entry = lookup._entry_on(fam, VERSION)
        for text_type, name in names.items():
            if (entry is not None and text_type not in known and name == entry.classes.get("text_model")
                    and derive.text_model_class(text_type) is not None
                    and derive.module_name(text_type) == entry.module_of("text_model")):
                found.setdefault(text_type, []).append(key)
    return found


@pytest.mark.parametrize("text_type,families", _written_text_types().items())
def test_a_written_familys_text_type_is_its_entry(text_type, families):
    entry = lookup._language_model_entry(text_type, VERSION, None)
    assert entry in [lookup.match(f, VERSION)[0] for f in families]
    vlms = [t for t in _without_causal_lm() if default_text_type(t) == text_type]
    for model_type in vlms if entry.text_model_positions != "text" else ():
        _numbered_by_its_owner_or_refused(model_type)


def test_the_m_rope_reading_agrees_with_every_written_table():
    """`derive._text_layout` of each written family's text model on the installed release is what its table says."""
    checked = 0
    for fam in lookup.families().values():
        entry = lookup._entry_on(fam, VERSION)
        if entry is None:
            continue
        module = importlib.import_module(entry.module_of("text_model"))
        text = getattr(module, entry.classes["text_model"], None)
        if text is None:
            continue
        assert derive._text_layout(module, text) == entry.text_model_positions, fam.key
        checked += entry.text_model_positions != "text"
    assert checked, "no written M-RoPE family on this release: the reading is untested"


def _numbered_by_its_owner_or_refused(model_type: str) -> None:
    """An M-RoPE language model: the type derives where its model numbers M-RoPE itself (tests/test_derived_mrope.py
    checks those with images), else is refused naming what it lacks, never as an unknown family."""
    found = _resolution(model_type)
    if isinstance(found, TfcompatError):
        assert isinstance(found, PatchError) and "unknown model family" not in str(found), str(found)
    else:
        derived = found.entry.derived_vision
        assert derived is not None and derived.positions_call, model_type


def test_an_m_rope_text_model_is_numbered_by_its_owner_or_refused():
    m_rope = [(t, text) for t in WITHOUT_CAUSAL_LM if (text := default_text_type(t)) is not None
              and (cls := derive.text_model_class(text)) is not None
              and derive._text_layout(importlib.import_module(cls.__module__), cls) != "text"]
    if not m_rope:
        pytest.skip(f"transformers {VERSION} ships no such type whose text model takes M-RoPE positions")
    for model_type, _ in m_rope:
        _numbered_by_its_owner_or_refused(model_type)


def test_encoder_decoder_models_derive_their_decoder_or_are_refused_naming_why():
    """An encoder-decoder type resolves as an encoder-decoder entry (its decoder's row packed:
    tests/test_derived_encoder_decoder.py) or is refused naming what its decoder lacks."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    pairs = [t for t in WITHOUT_CAUSAL_LM if getattr(CONFIG_MAPPING[t](), "is_encoder_decoder", False)]
    if not pairs:
        pytest.skip(f"transformers {VERSION} ships no encoder-decoder type whose text type has no causal LM")
    for model_type in pairs:
        try:
            r = tfcompat.resolve(model_type)
        except PatchError as exc:
            assert re.search(r"encoder|decoder|position_bias|cross", str(exc)), str(exc)
            assert "unknown model family" not in str(exc)
        else:
            assert r.entry.encoder_decoder is not None, model_type


def _causal_lms_beside_their_vision_class() -> list[str]:
    """Types with a causal LM class (on the text config alone: Emu3ForCausalLM) besides a vision-language class, whose
    vision-language entry derives now that its text type derives from its text model."""
    lms = derive.causal_lm_types()
    return [t for t in TYPES if t in lms and lms[t] != vision_types()[t] and t not in lookup.families()
            and isinstance(r := RESOLUTIONS.get(t, _resolution(t)), tfcompat.Resolved)
            and r.entry.derived_vision is not None]


@pytest.mark.parametrize("model_type", _or_skip(_causal_lms_beside_their_vision_class(),
                                                "no causal LM beside a vision-language class of its type derives"))
def test_the_causal_lm_beside_a_vision_class_keeps_its_own_entry(model_type):
    from tests.every_type import check

    outcome = check(model_type, "sdpa")
    if outcome.status == "unbuildable":
        pytest.xfail(f"{model_type}: tiny causal LM cannot be built: {outcome.reason}")
    assert outcome.status == "pass", outcome.reason
