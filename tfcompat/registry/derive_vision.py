"""Deriving a vision-language entry from the installed transformers: a vision tower, a projector and placeholder
tokens in front of a text model that tfcompat already patches (a written or derived text family; a text type without
a causal LM derives from the text model class the owner builds: `derive.derive_text_model`). Its positions are the
text row (1-D RoPE; an M-RoPE text model whose owner numbers none takes it in every axis: MiniCPM-V's Qwen3.5), or
M-RoPE that the owner numbers itself when given none (``position_ids = self.compute_3d_position_ids(...)``, the 5.x
Qwen-VL descendants: GLM-OCR, PaddleOCR-VL, ...), which tfcompat calls per sequence. A hybrid text model's
linear-attention layers are packed as in its family. An encoder-decoder model, whose decoder reads the encoder's
states, derives as one (`tfcompat.registry.derive_encoder_decoder`: the decoder's row is packed).

What a packed row of such a model needs is what its text model needs, plus proof that the packed position ids and
the forward context reach the text model: each forward from the vision-language class down to the text model (read
with `ast`, as `tfcompat.registry.derive` reads a causal LM) must pass ``position_ids`` and ``**kwargs`` on to the
next one and compute no positions of its own; the owner of the language model must hand it only the embeddings,
the mask, the positions and the usual flags, or what the text model computes itself from the tokens (Gemma 4's
per-layer inputs; `embed_inputs` then refuses, as embeddings alone do not carry them). A causal LM that holds a text
model of another type without being image-text-to-text (an audio tower in front) derives alike. Everything
family-specific about images (where the tower is, how features land in the embeddings, image sizes, patch masks)
stays in the model's own forward, which runs unchanged. What tfcompat cannot prove is refused with a `PatchError`
naming it.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import torch

from ..errors import PatchError, TfcompatError, UnknownFamilyError
from . import batching, derive_encoder_decoder, versions
from .derive import (
    _CROSS_PARAMS,
    _attention_chains,
    _built_classes,
    _is_cross_attention,
    _layer_classes,
    _method,
    _skips_cross_layers,
    causal_lm_types,
    derive_text_model,
)
from .records import TEXT_MODULE_ROLES, CrossStates, Entry, Family, VisionDerivation

__all__ = ["LANGUAGE_MODEL_KEYWORDS", "default_text_type", "derive", "vision_key", "vision_types"]

# what an owner may pass its language model besides **kwargs: the embeddings, the mask, the positions and flags
LANGUAGE_MODEL_KEYWORDS = frozenset({
    "inputs_embeds", "attention_mask", "position_ids", "past_key_values", "past_key_value", "cache", "use_cache",
    "cache_position", "return_dict", "output_attentions", "output_hidden_states", "output_router_logits",
    "logits_to_keep",
})
# config attributes naming the image placeholder token, across families and releases
PLACEHOLDER_ATTRS = ("image_token_id", "image_token_index")


def vision_types() -> dict[str, str]:
    """transformers' ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` on the installed release (``{}`` before it)."""
    auto = importlib.import_module("transformers.models.auto.modeling_auto")
    names = getattr(auto, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {})
    return {k: v for k, v in names.items() if isinstance(v, str)}


@functools.cache
def vision_key(model_type: str) -> str | None:
    """The image-text-to-text mapping key of ``model_type``: itself, or the key whose config class names it
    (4.57's LFM2-VL: key ``lfm2_vl``, ``config.model_type`` ``"lfm2-vl"``); None for another type."""
    names = vision_types()
    if model_type in names:
        return model_type
    configs = importlib.import_module("transformers.models.auto.configuration_auto").CONFIG_MAPPING
    if model_type in configs:  # a type of its own (the scan below imports every vision config class: only if not)
        return None
    return next((k for k in names if k in configs and getattr(configs[k], "model_type", None) == model_type), None)


@functools.cache
def default_text_type(model_type: str) -> str | None:
    """The ``text_config.model_type`` of ``model_type``'s default config (None where it builds none)."""
    names = importlib.import_module("transformers.models.auto.configuration_auto").CONFIG_MAPPING
    try:
        config = names[vision_key(model_type) or model_type]()
        return getattr(config.get_text_config(), "model_type", None)
    except Exception:  # noqa: BLE001 -- a config class that needs arguments names no default text model
        return None


def derive(model_type: str, version: str, text_type: str | None,
           text_entry: Callable[[str, type | None], Entry]) -> Family:
    """The family of the vision-language ``model_type`` whose language model is ``text_type`` (its config's
    ``text_config.model_type``), on the installed transformers (reported as ``version``); not cached.

    A causal LM that is not image-text-to-text but holds a text model of another type (an audio tower in front of
    it: MossTranscribeDiarize) derives alike, from its causal-LM class.

    text_entry: ``(text type, the class the owner builds from its text config or None) -> entry``: the installed
    release's entry of the language model's family, written or derived (a text type without a causal LM derives
    from that class, `tfcompat.registry.derive.derive_text_model`); raises a tfcompat error where there is none.
    Raises `UnknownFamilyError` for a type that is neither, `PatchError` naming what is missing.
    """
    names = vision_types()
    key = vision_key(model_type)
    if key is None and model_type in causal_lm_types():
        names, key = causal_lm_types(), model_type
    if key is None:
        raise UnknownFamilyError(
            f"unknown model family {model_type!r}", family=model_type, transformers_version=version,
            why="not an image-text-to-text model of this transformers (MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)",
            fix="pass transformers' config.model_type")

    def refuse(what: str, why: str, fix: str = "") -> PatchError:
        return PatchError(f"cannot derive {model_type}: {what}", family=model_type, transformers_version=version,
                          why=why, supported="vision-language models whose language model is a text model "
                          "(1-D RoPE, or M-RoPE the model numbers itself) "
                          "tfcompat patches, reached with position_ids and **kwargs from the top forward",
                          fix=fix or "run it unpatched")

    top = getattr(importlib.import_module("transformers"), names[key], None)
    if not isinstance(top, type):
        raise refuse(f"transformers has no class {names[key]}", "the auto mapping names a missing class")
    module = importlib.import_module(top.__module__)
    if derive_encoder_decoder.is_encoder_decoder(top):  # its decoder reads the encoder's states: the decoder's row
        return derive_encoder_decoder.derive(model_type, version, top, text_type, text_entry)
    own = _own_text_model(module, top) if text_type in (None, model_type, key) else None
    if text_type is None and own is None:
        raise refuse("its config names no text model", "the default config has no text_config.model_type",
                     fix="patch a model built from a config with a text_config")
    text_type = text_type or model_type  # a text model of the type's own (Chameleon's config is its text config)
    if own is None and (text_type in (model_type, key) or text_type in vision_types()):
        raise refuse(f"its language model is {text_type}, a vision-language type itself",
                     "the text model is not built from a separate text family's config, nor embeds the images "
                     "itself (pixel_values into its own tokens)")
    hops: list[tuple[type, str]] = []
    owner = top
    if own is None and _text_config_attr(top) is None:  # the language model sits one level down: at
        # base_model_prefix (5.x), or at whichever attribute builds a class of the module that builds it (4.x: an
        # empty prefix)
        prefix = getattr(top, "base_model_prefix", "")
        attrs = [prefix, *(a for a, _ in _self_assignments(top) if a != prefix)] if prefix else [
            a for a, _ in _self_assignments(top)]
        for attr in dict.fromkeys(attrs):
            inner = _built_classes(module, top, "__init__", attr=attr)
            if len(inner) == 1 and _text_config_attr(inner[0]) is not None:
                hops.append((top, attr))
                owner = inner[0]
                break
    lm_attr = own[0] if own is not None else _text_config_attr(owner)
    # [] for AutoModel.from_config: the text model is the text type's own
    built = _built_classes(module, owner, "__init__", attr=lm_attr) if lm_attr is not None else []
    try:  # a text model that embeds the images itself is derived from its own class (its type is the VLM's)
        text = derive_text_model(model_type, version, own[1]).entries[0] if own is not None else text_entry(
            text_type, _language_model_class(module, owner, lm_attr))
    except TfcompatError as exc:
        if lm_attr is None and isinstance(exc, UnknownFamilyError):  # no family, and no class found to derive one
            raise _no_language_model(refuse, top, owner, module) from None
        derived = exc.what.startswith(f"cannot derive {text_type}: ")  # its structure, read: the reason is what
        raise refuse(f"its language model {text_type} " + (
            f"cannot be patched: {exc.what.removeprefix(f'cannot derive {text_type}: ')}" if derived
            else "is not a text family tfcompat patches"),
            f"{type(exc).__name__}: {exc.what}" + (f" ({exc.why})" if exc.why else ""),
            fix=exc.fix or "run it unpatched") from None
    if lm_attr is None:
        raise _no_language_model(refuse, top, owner, module)
    hops.append((owner, lm_attr))
    if built and built[0].__name__ != text.classes["text_model"]:  # a causal LM around it (Llama 4)
        inner_attr = next((a for a, _ in _self_assignments(built[0]) if text.classes["text_model"] in
                           [c.__name__ for c in _built_classes(module, built[0], "__init__", attr=a)]), None)
        if inner_attr is None:
            raise refuse(f"{owner.__name__}.{lm_attr} is a {built[0].__name__}, which holds no "
                         f"{text.classes['text_model']}", f"{text_type}'s text model is not found inside it")
        hops.append((built[0], inner_attr))
    text_cls = getattr(importlib.import_module(text.module_of("text_model")), text.classes["text_model"])
    cross = _cross_states(owner, lm_attr, text_cls)
    for cls, attr in hops:
        gap = _forwards_to(cls, attr, text_cls if cls is owner else None, cross)
        if gap:
            if gap.endswith("to its language model"):  # Kosmos-2's image_embeds, placed by its text model itself
                raise refuse(gap, "the language model would take inputs besides its embeddings, mask and positions "
                             "that tfcompat does not place per sequence (image features its own forward writes into "
                             "the row, a loss, ...); tfcompat reads the images an owner scatters into the embeddings "
                             "itself, DeepStack features and cross-attention states", fix="run it unpatched, one "
                             "sequence per row (padded batches)")
            raise refuse(gap, "without position_ids it numbers a sequence otherwise than 0, 1, ... (an offset), so the "
                         "per-sequence positions of a packed row would differ from the stock model's"
                         if "own position_ids" in gap else "the stock model drops the images it is given, and "
                         "embeddings computed with them (tfcompat.embed_inputs) would differ" if "pixel_values" in gap
                         else "a packed row's position ids and forward context must reach the text model unchanged",
                         fix="run it unpatched (one sequence per row, padded batches), or on a transformers release "
                         f"whose {gap.split('.forward')[0]}.forward hands its **kwargs on" if "**kwargs" in gap else "")
    positions_call = _positions_call(owner)
    layout = text.text_model_positions
    axes = _rows_required(text_cls) if positions_call and layout != "text" else ""
    if axes:  # exactly that many M-RoPE rows, no text row (HunYuan-VL: its forward raises for any other number)
        layout = "mrope"
    # M-RoPE numbered by the owner's own method, per sequence (`inputs.derived_vision`)
    if positions_call and not axes and (layout != "text+mrope" or not _four_rows(text_cls)):
        raise refuse(f"{text_cls.__name__}.forward takes no text row in front of three M-RoPE rows",
                     "a packed row's M-RoPE position ids go to the text model as (4, B, L) = [text; t; h; w]; "
                     f"this text model takes {'(B, L)' if layout == 'text' else '(3, B, L)'} or another number "
                     "of rows")
    offset = _position_offset(owner)
    if offset and (positions_call or layout != "text"):
        raise refuse(f"{owner.__name__}.forward numbers its positions from {offset}, and M-RoPE",
                     "an offset is applied to the text row only", fix="run it unpatched")
    if layout != "text" and not positions_call:
        if not _row_in_every_axis(text_cls):
            raise refuse(f"its language model {text_type} takes M-RoPE positions",
                         f"{owner.__name__}.forward numbers no M-RoPE positions itself (no `position_ids = self."
                         "<method>(...)` when none are given) for tfcompat to call per sequence")
        layout = "text"  # 1-D positions: given none, an M-RoPE text model numbers the row in every axis, as it
        # expands a (B, L) row
    owner_mask = _passed(owner, lm_attr, "attention_mask")
    forward = _method(owner, "forward")
    params = [a.arg for a in forward.args.args + forward.args.kwonlyargs] if forward is not None else []
    read = {n.id for b in (forward.body if forward is not None else []) for n in ast.walk(b) if isinstance(n, ast.Name)}
    # token types the forward reads (Inkling's signature takes token_type_ids and its masks never read them)
    mask_inputs = tuple(p for p in params if p.endswith("token_type_ids") and p in read) if (
        owner_mask != "attention_mask") else ()
    # Molmo2's: each image token pools patches by their index in the whole batch's patches (`pack` shifts them)
    indices = batching.batch_indices(owner, [p for p in params if p.endswith("_token_pooling")])
    unread = [i for i, pixels in indices if not pixels]
    if unread:
        raise refuse(f"{owner.__name__}.forward takes {', '.join(unread)}: indices into the flattened patches of the "
                     "whole batch", "a packed row concatenates the sequences' vision inputs; these indices must be "
                     "shifted by every earlier sequence's patches, and the forward hands them on with no pixel_values* "
                     "input whose patches they index", fix="run it unpatched")
    towers, projectors = _submodules(module, owner, lm_attr)
    config = _default_config(key)
    placeholder = next((a for a in PLACEHOLDER_ATTRS if isinstance(getattr(config, a, None), int)), "")
    extras = _added_at_mask(text_cls)  # the owner hands them over (DeepStack), or the text model never adds them
    written = _written_at_mask(text_cls)  # Kosmos-2's image_embeds, written into its embeddings by the text model
    inline = _added_inline(text_cls) if set(_added_inline(text_cls)) <= _keywords(owner, lm_attr) else ()
    derivation = VisionDerivation(
        model=top.__name__, hops=tuple((c.__name__, a) for c, a in hops), owner=owner.__name__,
        language_model_attr=lm_attr, tower_attrs=towers, projector_attrs=projectors, text_family=text_type,
        placeholder=placeholder, owner_mask=owner_mask, mask_inputs=mask_inputs,
        batched_images=_batched(owner, [c for t in towers for c in _built_classes(module, owner, "__init__", attr=t)]),
        embeds_need_ids=own is not None or any(_refuses_embeds_alone(c) or _requires_pixels(c) for c, _ in hops),
        token_inputs=tuple(k for k in _token_inputs(owner, lm_attr, text_cls) if cross is None or k not in (
            cross.states, cross.mask, cross.row_mask)), positions_call=positions_call,
        visual_extras=extras if set(extras) <= _keywords(owner, lm_attr) else (), position_offset=offset,
        positions_locals=_positions_locals(owner, positions_call), inline_extras=inline,
        item_axes=batching.item_axes(key), batch_indices=indices, cross_states=cross,
        mrope_axes=axes, kwargs_shared=tuple((c.__name__, path) for c, a in hops for path in _kwargs_shared(c, a)),
        written_at_mask=written if set(written) <= _keywords(owner, lm_attr) else (),
        kinds_share_placeholder=_kinds_share_placeholder(owner))
    release = versions.parse(version).release
    entry = replace(
        text, family=model_type,
        versions=versions.VersionRange(f"{release[0]}.{release[1]}", f"{release[0]}.{release[1] + 1}"),
        module=module.__name__, text_module=text.module_of("text_model"),
        classes={**{r: text.classes[r] for r in TEXT_MODULE_ROLES if r in text.classes}, "model": owner.__name__,
                 "for_causal_lm": top.__name__},
        vision=None, rope_index_deviations=(), known_issues=(), derived_vision=derivation, text_model_positions=layout,
        why=f"derived from {module.__name__} on transformers {version}; text model as {text_type}'s {text.versions} "
        "entry")
    config_name = type(config).__name__ if config is not None else ""
    return Family(key=model_type, entries=(entry,), tiny_config=lambda e: (config_name, {}))


def _default_config(model_type: str) -> Any:
    names = importlib.import_module("transformers.models.auto.configuration_auto").CONFIG_MAPPING
    try:
        return names[model_type]()
    except Exception:  # noqa: BLE001 -- see default_text_type
        return None


def _own_text_model(module: Any, top: type) -> tuple[str, type] | None:
    """``(attribute, class)`` of the model ``top`` builds at its ``base_model_prefix`` where that model is its text
    model and embeds the images itself: its forward takes ``pixel_values`` and scatters their features (or tokens)
    at the placeholders (``inputs_embeds = inputs_embeds.masked_scatter(...)``, Chameleon's VQ codes' embeddings; 4.x
    scatters the codes into ``input_ids``); None otherwise."""
    prefix = getattr(top, "base_model_prefix", "")
    inner = _built_classes(module, top, "__init__", attr=prefix) if prefix else []
    if len(inner) != 1 or "pixel_values" not in _params(inner[0]):
        return None
    fn = _method(inner[0], "forward")
    merged = fn is not None and any(
        isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] in (["input_ids"], ["inputs_embeds"])
        and "masked_scatter" in ast.unparse(n.value) for n in ast.walk(fn))
    return (prefix, inner[0]) if merged else None


def _params(cls: type) -> set[str]:
    fn = _method(cls, "forward")
    return {a.arg for a in fn.args.args + fn.args.kwonlyargs} if fn is not None else set()


def _language_model_class(module: Any, owner: type, lm_attr: str | None) -> type | None:
    """The class ``owner.__init__`` builds its language model ``self.lm_attr`` from: one of ``module``, or one it
    imports from another module (BLIP's ``BlipTextLMHeadModel``); None for ``AutoModel.from_config`` or several."""
    built = _built_classes(module, owner, "__init__", attr=lm_attr) if lm_attr is not None else []
    if built:
        return built[0] if len(built) == 1 else None
    value = dict(_self_assignments(owner)).get(lm_attr or "")
    name = value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else ""
    found = getattr(module, name, None)
    return found if isinstance(found, type) and issubclass(found, torch.nn.Module) else None


def _no_language_model(refuse: Callable[..., PatchError], top: type, owner: type, module: Any) -> PatchError:
    """The refusal for a model whose owner builds no attribute from its text config: an encoder-decoder one names its
    encoder and decoder (its decoder reads the encoder's states: no language model a packed row feeds)."""
    holders = [owner, *(c for c in _built_classes(module, top, "__init__", attr=getattr(top, "base_model_prefix", ""))
                        if c is not owner)]
    pair = next((c for c in holders if {"encoder", "decoder"} <= {a for a, _ in _self_assignments(c)}), None)
    if pair is not None:
        return refuse(f"{pair.__name__} is an encoder-decoder model (self.encoder, self.decoder)",
                      "its decoder reads the encoder's states (cross-attention); tfcompat patches a language model "
                      "that a packed row's token embeddings and position ids alone feed")
    return refuse(f"no language model found in {owner.__name__}",
                  f"{owner.__name__}.__init__ assigns no attribute from config.text_config")


def _self_assignments(cls: type) -> list[tuple[str, ast.expr]]:
    """``(attribute, value)`` of each ``self.attribute = value`` in ``cls.__init__``; a local name as the value reads
    as what the local was assigned (``language_model = AutoModel.from_config(...)``, then ``self.x = language_model``).
    """
    fn = _method(cls, "__init__")
    if fn is None:
        return []
    assigns = [n for n in ast.walk(fn) if isinstance(n, ast.Assign)]
    local = {t.id: n.value for n in assigns for t in n.targets if isinstance(t, ast.Name)}
    return [(t.attr, local.get(n.value.id, n.value) if isinstance(n.value, ast.Name) else n.value) for n in assigns
            for t in n.targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"]


def _text_config_attr(cls: type) -> str | None:
    """The one attribute ``cls.__init__`` builds from ``config.text_config`` (a call taking it; of several, the one
    call taking nothing else: Gemma 3n's projectors take the vision or audio config too), else None."""
    texts = ("config.text_config", "config.get_text_config()")
    calls = [(a, [ast.unparse(x) for x in (*v.args, *(k.value for k in v.keywords))])
             for a, v in _self_assignments(cls) if isinstance(v, ast.Call)]
    found = {a for a, given in calls if any(g in texts for g in given)}
    if len(found) > 1:
        found = {a for a, given in calls if a in found and len(given) == 1}
    return found.pop() if len(found) == 1 else None


def _submodules(module: Any, owner: type, lm_attr: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The owner's vision tower attributes (built from ``config.vision_config``) and its other built submodules."""
    towers: list[str] = []
    others: list[str] = []
    for attr, value in _self_assignments(owner):
        if isinstance(value, ast.IfExp):  # an optional tower: X(...) if config.vision_config is not None else None
            value = value.body
        if attr == lm_attr or not isinstance(value, ast.Call):
            continue
        builds = "from_config" in ast.unparse(value.func) or _built_classes(module, owner, "__init__", attr=attr)
        if builds:
            (towers if "vision_config" in ast.unparse(value) else others).append(attr)
    return tuple(dict.fromkeys(towers)), tuple(dict.fromkeys(others))


def _forwards_to(cls: type, attr: str, text_model: type | None, cross: CrossStates | None = None) -> str:
    """Why ``cls.forward`` may not hand a packed row on to ``self.attr`` ("" when it does): every call of it passes
    ``position_ids=position_ids`` (or, where the forward names no such parameter, leaves them in) the forward's
    ``**kwargs`` (of a language model, the calls of a decoder-only one: those passing no ``decoder_input_ids``),
    the forward assigns no ``position_ids``, and to a language model (``text_model`` given: its class) passes
    nothing but `LANGUAGE_MODEL_KEYWORDS`, what the text model computes itself (`_text_model_computes`), features
    it adds at masked tokens (`_added_at_mask`) or writes into its embeddings there (`_written_at_mask`), the states
    of its cross-attention layers (``cross``, `_cross_states`), and the labels of a causal LM computing its own loss
    (`_computes_loss`)."""
    fn = _method(cls, "forward")
    if fn is None:
        return f"{cls.__name__}.forward cannot be read"
    var_kw = fn.args.kwarg.arg if fn.args.kwarg is not None else None
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) == f"self.{attr}"]
    if not calls:
        return f"{cls.__name__}.forward does not call self.{attr}"
    named = "position_ids" in {a.arg for a in fn.args.args + fn.args.kwonlyargs}  # else they travel in **kwargs
    leaks = sorted({ast.unparse(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call) and var_kw is not None
                    and ast.unparse(n.func).startswith("self.") and ast.unparse(n.func) not in (
                        f"self.{attr}", "self.loss_function")
                    and any(k.arg is None and ast.unparse(k.value) == var_kw for k in n.keywords)})
    if text_model is None and "pixel_values" in {a.arg for a in fn.args.args + fn.args.kwonlyargs} and not any(
            k.arg == "pixel_values" for c in calls for k in c.keywords):  # 4.x-5.15 Emu3: the images never arrive
        return f"{cls.__name__}.forward takes pixel_values and does not hand them to self.{attr}"
    if text_model is not None:  # the call for a decoder-only language model only (BLIP-2's other builds a seq2seq one)
        calls = [c for c in calls if "decoder_input_ids" not in {k.arg for k in c.keywords}] or calls
    for call in calls:
        keywords = {k.arg: ast.unparse(k.value) for k in call.keywords if k.arg is not None}
        if keywords.get("position_ids") != "position_ids" and (named or "position_ids" in keywords):
            return f"{cls.__name__}.forward passes position_ids={keywords.get('position_ids')} to self.{attr}"
        if var_kw is None or not any(k.arg is None and ast.unparse(k.value) == var_kw for k in call.keywords):
            return f"{cls.__name__}.forward calls self.{attr} without its **kwargs"
        added = (*_added_at_mask(text_model), *_added_inline(text_model)) if text_model is not None else ()
        # the pixels a text model embeds itself (Chameleon's VQ tokens) are its own inputs
        own = _params(text_model) if text_model is not None else set()
        added += (cross.states, cross.mask, cross.row_mask) if cross is not None and text_model is not None else ()
        added += _written_at_mask(text_model) if text_model is not None else ()
        if text_model is not None and keywords.get("labels") == "labels" and _computes_loss(cls, attr):
            added += ("labels",)  # its causal LM's own shifted loss: `pack` masks each sequence's first label
        extra = sorted(k for k, v in keywords.items() if k not in LANGUAGE_MODEL_KEYWORDS and v != "None"
                       and k not in added and not (k.startswith("pixel_values") and k in own)
                       and not (text_model is not None and _text_model_computes(fn, attr, k, v, text_model)))
        if text_model is not None and extra:
            return f"{cls.__name__}.forward passes {', '.join(extra)} to its language model"
    unproved = [leak for leak in leaks if not _shared_target(cls, leak.removeprefix("self."))]
    if not named and unproved:  # a call tfcompat cannot wrap would read the row's positions as its own
        return (f"{cls.__name__}.forward hands its **{var_kw}, which carry the position ids, to {', '.join(unproved)} "
                f"besides self.{attr}, and it is neither a method of {cls.__name__} nor a submodule its __init__ "
                "builds")
    defaults = {id(n) for g in ast.walk(fn) if isinstance(g, ast.If) and ast.unparse(g.test) == "position_ids is None"
                for n in g.body if _counts_the_row(n) == 0 or (text_model is not None and (
                    _own_positions_call(n, cls) or _counts_the_row(n) is not None))}  # the owner's own: offsets, M-RoPE
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        if any(isinstance(t, ast.Name) and t.id == "position_ids" for t in targets) and id(node) not in defaults:
            return f"{cls.__name__}.forward computes its own position_ids ({ast.unparse(node)[:80]})"
    return ""


def _kwargs_shared(cls: type, attr: str) -> tuple[str, ...]:
    """The calls ``self.<path>(..., **kwargs)`` besides ``self.attr`` that ``cls.forward`` spreads its ``**kwargs``
    into where those carry the position ids (the forward names no ``position_ids``): InstructBLIP-Video's
    ``get_video_features``, whose Q-Former and vision tower would read a packed row's position ids as their own. Each
    path is a method of ``cls`` or a submodule its ``__init__`` builds (`_forwards_to` refuses any other), so a patch
    can keep the packed row's per-token keys from it (`tfcompat.hf.vision.shared_kwargs`)."""
    fn = _method(cls, "forward")
    var_kw = fn.args.kwarg.arg if fn is not None and fn.args.kwarg is not None else None
    if fn is None or var_kw is None or "position_ids" in {a.arg for a in fn.args.args + fn.args.kwonlyargs}:
        return ()
    return tuple(sorted({ast.unparse(n.func).removeprefix("self.") for n in ast.walk(fn) if isinstance(n, ast.Call)
                         and ast.unparse(n.func).startswith("self.")
                         and ast.unparse(n.func) not in (f"self.{attr}", "self.loss_function")
                         and any(k.arg is None and ast.unparse(k.value) == var_kw for k in n.keywords)}))


def _shared_target(cls: type, path: str) -> bool:
    """Whether ``self.<path>`` of ``cls`` is a method of it (``get_video_features``) or a submodule its ``__init__``
    builds (``vision_model``, ``vision_model.encoder``): what a patch can wrap on the instance."""
    head = path.split(".")[0]
    if "." not in path and inspect.isfunction(getattr(cls, head, None)):
        return True
    return any(a == head and isinstance(v, ast.Call) for a, v in _self_assignments(cls))


def _positions_call(owner: type) -> tuple[str, tuple[tuple[str, str], ...]] | tuple[()]:
    """The owner's own M-RoPE numbering when given no positions: ``if position_ids is None: position_ids =
    self.<method>(keyword=name, ...)`` (5.x Qwen-VL descendants' ``compute_3d_position_ids``), as ``(method,
    ((keyword, name), ...))``, each name a parameter of its forward; () where there is none."""
    fn = _method(owner, "forward")
    return next((c for g in ast.walk(fn) if isinstance(g, ast.If) and ast.unparse(g.test) == "position_ids is None"
                 for n in g.body for c in [_own_positions_call(n, owner)] if c), ()) if fn is not None else ()


def _own_positions_call(node: ast.stmt, owner: type) -> tuple[str, tuple[tuple[str, str], ...]] | tuple[()]:
    """`_positions_call` of one statement: a method of ``owner`` called with keywords only, each a parameter of
    its forward that the forward does not reassign (``inputs_embeds`` aside: the method reads only its shape), or
    None."""
    if not (isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["position_ids"]
            and isinstance(node.value, ast.Call) and not node.value.args):
        return ()
    func = ast.unparse(node.value.func)
    method = func.removeprefix("self.")
    fn = _method(owner, "forward")
    assigned = {t.id for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)
                } - {"inputs_embeds"} if fn is not None else set()
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs} - assigned if fn is not None else set()
    keywords = tuple((k.arg, ast.unparse(k.value)) for k in node.value.keywords if k.arg is not None)
    if (func == method or not method.isidentifier() or not callable(getattr(owner, method, None))
            or len(keywords) != len(node.value.keywords)
            or any(v not in params | {"None"} and not _local_of_params(fn, v, params) for _, v in keywords)):
        return ()
    return method, keywords


def _local_of_params(fn: ast.FunctionDef | None, name: str, params: set[str]) -> str:
    """The source of the one statement of ``fn`` that assigns ``name`` from its parameters alone: ``if p is not
    None: name = <expression of parameters and torch> else: name = None`` (Qwen-Omni's ``audio_feature_lengths =
    torch.sum(feature_attention_mask, dim=1)``); "" where ``name`` is assigned otherwise. `mrope_positions` runs it
    on the caller's inputs before the owner's numbering."""
    if fn is None or not name.isidentifier():
        return ""
    found = [n for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and any(
        isinstance(t, ast.Name) and t.id == name for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
    ifs = [g for g in fn.body if isinstance(g, ast.If) and len(g.body) >= 1 and len(g.orelse) == 1]
    for g in ifs:
        body = [b for b in g.body if isinstance(b, ast.Assign) and [ast.unparse(t) for t in b.targets] == [name]]
        other = g.orelse[0]
        if (len(body) != 1 or not isinstance(other, ast.Assign) or [ast.unparse(t) for t in other.targets] != [name]
                or ast.unparse(other.value) != "None" or {id(n) for n in found} != {id(body[0]), id(other)}):
            continue
        names = {n.id for n in ast.walk(g.test) if isinstance(n, ast.Name)} | {
            n.id for n in ast.walk(body[0].value) if isinstance(n, ast.Name)}
        if names <= params | {"torch"} and not any(isinstance(n, ast.Attribute) and ast.unparse(n.value) == "self"
                                                   for n in ast.walk(body[0].value)):
            return ast.unparse(ast.If(test=g.test, body=list[ast.stmt](body), orelse=[other]))
    return ""


def _positions_locals(owner: type, call: tuple[str, tuple[tuple[str, str], ...]] | tuple[()]
                      ) -> tuple[tuple[str, str], ...]:
    """``(name, statement)`` of the locals the owner's numbering ``call`` reads (`_local_of_params`)."""
    fn = _method(owner, "forward")
    if not call or fn is None:
        return ()
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    return tuple((v, src) for _, v in call[1] if (src := _local_of_params(fn, v, params)))


def _four_rows(text_model: type) -> bool:
    """Whether ``text_model.forward`` reads ``(4, B, L)`` position ids as a text row and three M-RoPE rows (it compares
    ``position_ids.shape[0] == 4``; HunYuan-VL's compares with its number of axes, four, plus one)."""
    fn = _method(text_model, "forward")
    return fn is not None and any(isinstance(n, ast.Compare) and ast.unparse(n) == "position_ids.shape[0] == 4"
                                  for n in ast.walk(fn))


def _rows_required(text_model: type) -> str:
    """The expression of ``text_model`` (``self``) whose value is the only number of M-RoPE rows its forward takes
    (``if position_ids.shape[0] != n: raise ...``, with ``n`` a local assigned from ``self``), "" where it takes
    another layout. HunYuan-VL's: ``len(self.rotary_emb.mrope_section or [])`` (its text row check, ``n + 1``, is
    followed by that raise: a text row in front is never taken)."""
    fn = _method(text_model, "forward")
    if fn is None:
        return ""
    assigned = {t.id: n.value for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    for node in ast.walk(fn):
        if not isinstance(node, ast.If):
            continue
        test = node.test
        if (isinstance(test, ast.Compare) and ast.unparse(test.left) == "position_ids.shape[0]"
                and len(test.ops) == 1 and isinstance(test.ops[0], ast.NotEq)
                and any(isinstance(b, ast.Raise) for b in node.body)):
            n = test.comparators[0]
            value = assigned.get(n.id) if isinstance(n, ast.Name) else None
            source = ast.unparse(value) if value is not None else ""
            if source and {x.id for x in ast.walk(ast.parse(source)) if isinstance(x, ast.Name)} <= {"self", "len"}:
                return source
    return ""


def _row_in_every_axis(text_model: type) -> bool:
    """Whether ``text_model.forward`` (an M-RoPE text model) takes ``(B, L)`` position ids as the row of every axis
    (``elif position_ids.ndim == 2: position_ids = position_ids[None, ...].expand(n, B, -1)``) and, given none,
    counts that row from 0 in every axis (`_counts_the_row`): what an owner numbering no M-RoPE gives it either way
    (MiniCPM-V's Qwen3.5 text model)."""
    fn = _method(text_model, "forward")
    tests = {"position_ids.ndim == 2": False, "position_ids is None": False}
    for node in (n for n in ast.walk(fn) if isinstance(n, ast.If)) if fn is not None else ():
        test = ast.unparse(node.test)
        if test not in tests:
            continue
        sets = [n for n in node.body if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == [
            "position_ids"]]
        expands = all(ast.unparse(n.value).startswith(("position_ids[None, ...].expand(",
                                                       "position_ids.unsqueeze(0).expand(")) for n in sets)
        counts = all(_counts_the_row(n) == 0 for n in sets)
        tests[test] = bool(sets) and (expands if test == "position_ids.ndim == 2" else counts)
    return all(tests.values())


def _text_model_computes(fn: ast.FunctionDef, attr: str, keyword: str, value: str, text_model: type) -> bool:
    """Whether ``fn`` (an owner's forward) passes its language model ``self.attr`` as ``keyword`` only what the text
    model's own forward computes for it when not given: the value is a name (``per_layer_inputs``) that ``fn`` takes
    as a parameter (the caller's own) or assigns only as None or the lookups the text model makes (`_lookups`:
    ``self.attr.<method>(...)``, the ids themselves), and ``text_model.forward`` takes ``keyword`` and assigns it
    from those lookups itself (Gemma 3n's and Gemma 4's per-layer inputs: ``self.get_per_layer_inputs(...)``;
    Qwen4-Exp's ``ple_input_ids = input_ids if input_ids is not None else self.reverse_embedding(...)``). Such a
    value is what the patched text model computes on a packed row, token by token."""
    text_fn = _method(text_model, "forward")
    if text_fn is None or keyword not in {a.arg for a in text_fn.args.args + text_fn.args.kwonlyargs}:
        return False
    own = {f for n in ast.walk(text_fn) if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == [
        keyword] and keyword not in {x.id for x in ast.walk(n.value) if isinstance(x, ast.Name)}  # a change of
        for f in _lookups(n.value, "self.")}  # the value given or computed (Qwen4-Exp's masking) applies to both
    assigns = [n for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
               and any(isinstance(t, ast.Name) and t.id == value
                       for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    return value.isidentifier() and "" not in own and (bool(assigns) or value in params) and all(
        isinstance(n, ast.Assign) and len(n.targets) == 1 and (ast.unparse(n.value) == "None" or (
            bool(_lookups(n.value, f"self.{attr}.")) and _lookups(n.value, f"self.{attr}.") <= own))
        for n in assigns)


def _lookups(expr: ast.expr, prefix: str) -> set[str]:
    """What ``expr`` computes a per-token input from: ``method`` for ``<prefix><method>(...)`` (one attribute
    deep), the name of the ids it passes on (``input_ids``), either branch of a conditional; "" for anything else."""
    if isinstance(expr, ast.IfExp):
        return _lookups(expr.body, prefix) | _lookups(expr.orelse, prefix)
    if isinstance(expr, ast.Name) and expr.id == "input_ids":
        return {"input_ids"}
    func = ast.unparse(expr.func) if isinstance(expr, ast.Call) else ""
    method = func.removeprefix(prefix)
    return {method} if func.startswith(prefix) and method.isidentifier() else {""}


def _added_at_mask(text_model: type) -> tuple[str, str] | tuple[()]:
    """``(mask, features)``: the parameters of ``text_model.forward`` whose tensors it adds to the hidden states at
    the masked tokens, as DeepStack does (``self.<method>(hidden_states, visual_pos_masks,
    deepstack_visual_embeds[layer_idx])``, the method adding ``features`` at ``hidden_states[mask, :]``); () where
    there are none. Such features follow the tokens: a packed row's are its sequences' in order, as the owner
    computes them over the row."""
    fn = _method(text_model, "forward")
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs} if fn is not None else set()
    for call in ast.walk(fn) if fn is not None else []:
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and len(call.args) == 3
                and ast.unparse(call.func.value) == "self" and isinstance(call.args[1], ast.Name)
                and isinstance(call.args[2], ast.Subscript) and isinstance(call.args[2].value, ast.Name)
                and {call.args[1].id, call.args[2].value.id} <= params):
            continue
        method = _method(text_model, call.func.attr)
        names = [a.arg for a in method.args.args[1:4]] if method is not None else []
        if method is None or len(names) != 3:
            continue
        hidden, mask, features = names
        indexed = any(isinstance(n, ast.Subscript) and ast.unparse(n.value) == hidden and mask in {
            x.id for x in ast.walk(n.slice) if isinstance(x, ast.Name)} for n in ast.walk(method))
        added = any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add) and features in (
            ast.unparse(n.left), ast.unparse(n.right)) for n in ast.walk(method))
        if indexed and added:
            return call.args[1].id, call.args[2].value.id
    return ()


def _written_at_mask(text_model: type) -> tuple[str, str] | tuple[()]:
    """``(mask, features)``: the parameters of ``text_model.forward`` whose features it writes into the token
    embeddings at the masked tokens, flattened in order (``embeds[mask] = features.view(-1, ...)``), itself or in a
    method or submodule it hands them to by keyword (`_scopes`: Kosmos-2's causal LM hands them to its transformer,
    whose ``forward_embedding`` reads ``inputs_embeds[img_input_mask.to(dtype=torch.bool)] = image_embeds.to(...)
    .view(-1, image_embeds.size(-1))``); () where there are none. A packed row's mask and features are its
    sequences' back to back, so each sequence's features land at its own masked tokens."""
    for body, names in _scopes(text_model):
        for node in ast.walk(body):
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(target := node.targets[0], ast.Subscript) and isinstance(target.value, ast.Name)
                    and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
                    and node.value.func.attr in ("view", "reshape") and node.value.args
                    and ast.unparse(node.value.args[0]) == "-1"):
                continue
            masks = {names[x.id] for x in ast.walk(target.slice) if isinstance(x, ast.Name) and x.id in names}
            features = {names[x.id] for x in ast.walk(node.value.func.value) if isinstance(x, ast.Name)
                        and x.id in names and x.id != target.value.id}  # cast to the embeddings' dtype: not read
            if len(masks) == 1 and len(features) == 1 and masks != features:
                return next(iter(masks)), next(iter(features))
    return ()


def _scopes(cls: type, names: dict[str, str] | None = None, depth: int = 3) -> list[tuple[ast.FunctionDef,
                                                                                          dict[str, str]]]:
    """``(function, {its parameter: the top forward's parameter handed to it})`` for ``cls.forward`` and, by
    keyword, each method of ``cls`` it calls and each submodule of one class its ``__init__`` builds, ``depth`` deep.
    """
    fn = _method(cls, "forward")
    if fn is None:
        return []
    params = {a.arg for a in fn.args.args[1:] + fn.args.kwonlyargs}
    names = {p: p for p in params} if names is None else names
    found = [(fn, names)]
    module = importlib.import_module(cls.__module__)
    for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and ast.unparse(n.func.value) == "self"):
        attr = cast(ast.Attribute, call.func).attr
        handed = {k.arg: names[k.value.id] for k in call.keywords if k.arg is not None
                  and isinstance(k.value, ast.Name) and k.value.id in names}
        method = _method(cls, attr) if inspect.isfunction(getattr(cls, attr, None)) else None
        built = _built_classes(module, cls, "__init__", attr=attr) if method is None else []
        if method is not None and attr != "forward":
            found.append((method, handed))
        elif len(built) == 1 and depth > 1 and handed:
            found += _scopes(built[0], handed, depth - 1)
    return found


def _computes_loss(cls: type, attr: str) -> bool:
    """Whether the one class ``cls.__init__`` builds as ``self.attr`` computes its loss from the labels it is given
    as a causal LM does (``self.loss_function(logits=..., labels=labels, ...)``: shifted over the row, Kosmos-2's
    text model)."""
    built = _built_classes(importlib.import_module(cls.__module__), cls, "__init__", attr=attr)
    fn = _method(built[0], "forward") if len(built) == 1 else None
    return fn is not None and any(
        isinstance(n, ast.Call) and ast.unparse(n.func) == "self.loss_function"
        and any(k.arg == "labels" and ast.unparse(k.value) == "labels" for k in n.keywords) for n in ast.walk(fn))


def _added_inline(text_model: type) -> tuple[str, str] | tuple[()]:
    """``(mask, features)``: the parameters of ``text_model.forward`` whose tensors its own loop adds to the hidden
    states at the masked tokens, inline (Granite 4 Vision's ``hidden_states[mask.squeeze(-1)] + features``, ``mask``
    and ``features`` read from ``vision_mask`` and ``deepstack_features[layer_idx]``); () where there are none."""
    fn = _method(text_model, "forward")
    if fn is None:
        return ()
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    sources: dict[str, set[str]] = {}  # a local -> the parameters its assignments read
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            sources.setdefault(n.targets[0].id, set()).update(
                x.id for x in ast.walk(n.value) if isinstance(x, ast.Name) and x.id in params)

    def origin(e: ast.expr) -> set[str]:
        names = {x.id for x in ast.walk(e) if isinstance(x, ast.Name)}
        return {p for x in names for p in ({x} if x in params else sources.get(x, set()))} - {"hidden_states"}

    for n in ast.walk(fn):
        if not (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add)):
            continue
        for indexed, other in ((n.left, n.right), (n.right, n.left)):
            if isinstance(indexed, ast.Subscript) and ast.unparse(indexed.value) == "hidden_states":
                masks, features = origin(indexed.slice), origin(other)
                if len(masks) == 1 and len(features) == 1 and masks != features:
                    return next(iter(masks)), next(iter(features))
    return ()


def _keywords(cls: type, attr: str) -> set[str]:
    """The keywords ``cls.forward`` passes ``self.attr``, other than None."""
    fn = _method(cls, "forward")
    return {k.arg for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) == f"self.{attr}"
            for k in n.keywords if k.arg is not None and ast.unparse(k.value) != "None"} if fn is not None else set()


def _token_inputs(owner: type, attr: str, text_model: type) -> tuple[str, ...]:
    """The keywords ``owner.forward`` hands its language model ``self.attr`` that the text model computes itself
    (`_text_model_computes`): Gemma 4's ``per_layer_inputs``."""
    fn = _method(owner, "forward")
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) == f"self.{attr}"] if fn else []
    return tuple(dict.fromkeys(k.arg for c in calls for k in c.keywords if k.arg is not None and fn is not None
                               and k.arg not in LANGUAGE_MODEL_KEYWORDS and ast.unparse(k.value) != "None"
                               and _text_model_computes(fn, attr, k.arg, ast.unparse(k.value), text_model)))


def _counts_the_row(node: ast.stmt) -> int | None:
    """The offset from 0 at which ``node`` (inside ``if position_ids is None:``) counts the row, where it sets the
    default positions every text model takes without them: 0 for the row counted from 0 after the cache
    (``torch.arange(...) + past_seen_tokens``, ``torch.arange(cache_length, seq_len + cache_length)`` (Fuyu),
    ``cache_position``), reshaped (``.unsqueeze``, ``.expand``, ``.view``); a constant added to such a row (PaliGemma's
    ``+ 1``, its 1-indexed positions) is the offset; None for anything else."""
    if not (isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["position_ids"]):
        return None

    def cached(e: ast.expr) -> bool:  # the cache's length, by its name
        return isinstance(e, ast.Name) and ("past" in e.id or e.id == "cache_length")

    def plain(e: ast.expr) -> bool:
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add):
            return plain(e.left) and cached(e.right)
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute):
            if e.func.attr in ("unsqueeze", "expand", "view", "to"):
                return plain(e.func.value)
            if ast.unparse(e.func) != "torch.arange" or not e.args or isinstance(e.args[0], ast.Constant):
                return False
            if len(e.args) == 2:  # arange(start, stop + start): start the cache length
                stop = e.args[1]
                return cached(e.args[0]) and isinstance(stop, ast.BinOp) and isinstance(stop.op, ast.Add) and (
                    ast.unparse(stop.right) == ast.unparse(e.args[0])) and not isinstance(stop.left, ast.Constant)
            return len(e.args) == 1
        return isinstance(e, ast.Name) and e.id in ("cache_position", "position_ids")

    value = node.value
    if (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add) and isinstance(value.right, ast.Constant)
            and type(value.right.value) is int and plain(value.left)):
        return value.right.value
    return 0 if plain(value) else None


def _position_offset(owner: type) -> int:
    """The offset from 0 at which ``owner.forward`` numbers a sequence given no positions (`_counts_the_row`)."""
    fn = _method(owner, "forward")
    return sum(o for g in ast.walk(fn) if isinstance(g, ast.If) and ast.unparse(g.test) == "position_ids is None"
               for n in g.body for o in [_counts_the_row(n)] if o) if fn is not None else 0


def _passed(cls: type, attr: str, keyword: str) -> str:
    """The source of what ``cls.forward`` passes as ``keyword`` to ``self.attr`` ("" when nothing)."""
    fn = _method(cls, "forward")
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) == f"self.{attr}"] if fn else []
    values = [ast.unparse(k.value) for c in calls for k in c.keywords if k.arg == keyword]
    return values[0] if values else ""


def _refuses_embeds_alone(cls: type) -> bool:
    """Whether ``cls.forward`` raises under ``if inputs_embeds is not None and input_ids is None and ...`` (not the
    usual exactly-one-of check, an ``^``)."""
    fn = _method(cls, "forward")
    return fn is not None and any(
        isinstance(n, ast.If) and isinstance(n.test, ast.BoolOp) and isinstance(n.test.op, ast.And)
        and {"inputs_embeds is not None", "input_ids is None"} <= {ast.unparse(v) for v in n.test.values}
        and any(isinstance(b, ast.Raise) for b in n.body) for n in ast.walk(fn))


def _requires_pixels(cls: type) -> bool:
    """Whether ``cls.forward`` takes ``pixel_values`` without a default (BLIP-2's): no call of embeddings alone."""
    param = inspect.signature(getattr(cls, "forward")).parameters.get("pixel_values")  # noqa: B009 -- a Module
    return param is not None and param.default is inspect.Parameter.empty


def _batched(owner: type, towers: list[type] | None = None) -> bool:
    """Whether the owner, or its vision tower (one of ``towers``), unpacks its pixel values as ``(batch, images,
    ...)`` (``batch, num_images, ... = pixel_values.shape``; Mllama's tower: ``num_concurrent_media``): one entry of
    the batch per text row, the images of a row on dim 1."""
    methods = [(owner, "get_image_features"), (owner, "forward"), *((t, "forward") for t in towers or ())]
    for cls, name in methods:
        fn = _method(cls, name)
        for node in ast.walk(fn) if fn is not None else []:
            if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
                    and ast.unparse(node.value) == "pixel_values.shape" and len(node.targets[0].elts) >= 5):
                second = node.targets[0].elts[1]
                if isinstance(second, ast.Name) and ("image" in second.id or "media" in second.id):
                    return True
    return False


def _cross_states(owner: type, attr: str | None, text_model: type) -> CrossStates | None:
    """The states ``owner.forward`` hands its language model ``self.attr`` for cross-attention layers (Mllama's image
    states), None where it hands none: one keyword of `tfcompat.registry.derive._CROSS_PARAMS` that
    ``text_model.forward`` takes and skips the layers holding a cross-attention without (`_skips_cross_layers`);
    two more that are the targets of one statement ``mask, gate = <function of the owner's module>(<parameter>,
    ...)`` of the forward (``_prepare_cross_attention_mask(cross_attention_mask, ...)``): the additive mask and the
    per-token gate prepared from the per-token mask over items."""
    fn = _method(owner, "forward")
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) == f"self.{attr}"] if (
        fn is not None and attr is not None) else []
    if fn is None or len(calls) != 1:
        return None
    passed = {ast.unparse(k.value): k.arg for k in calls[0].keywords if k.arg is not None}
    states = [k for k in passed.values() if k in _CROSS_PARAMS]
    text_module = importlib.import_module(text_model.__module__)
    holding: dict[type, list[type]] = {}
    for layer in _layer_classes(text_module, text_model):
        for chain in _attention_chains(text_module, layer):
            if _is_cross_attention(chain[-1]):
                holding.setdefault(layer, []).append(chain[-1])
    if len(states) != 1 or not holding or not _skips_cross_layers(text_model, list(holding)):
        return None
    module = importlib.import_module(owner.__module__)
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Tuple)
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                and inspect.isfunction(getattr(module, node.value.func.id, None)) and node.value.args
                and isinstance(node.value.args[0], ast.Name) and node.value.args[0].id in params):
            continue
        targets = [ast.unparse(t) for t in node.targets[0].elts]
        # the layers take the mask by the text model's name for it (`tfcompat.hf.cross_states.keep_skipped`)
        if len(targets) == 2 and all(t in passed for t in targets) and all(
                passed[targets[0]] in inspect.signature(getattr(c, "forward")).parameters  # noqa: B009 -- a Module
                for c in holding):
            return CrossStates(
                states=states[0], mask=passed[targets[0]], row_mask=passed[targets[1]], items=node.value.args[0].id,
                prepare=node.value.func.id, layers=tuple(c.__name__ for c in holding),
                attentions=tuple(dict.fromkeys(c.__name__ for cs in holding.values() for c in cs)))
    return None


def _kinds_share_placeholder(owner: type) -> bool:
    """Whether ``owner.get_placeholder_mask`` finds images and videos in the ids at the same config attribute
    (``special_image_mask = input_ids == self.config.image_token_id`` and ``special_video_mask = input_ids ==
    self.config.image_token_id``: GLM-OCR's, GLM-4.1V's)."""
    fn = _method(owner, "get_placeholder_mask")
    found: dict[str, set[str]] = {}
    for n in ast.walk(fn) if fn is not None else ():
        if (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                and isinstance(n.value, ast.Compare) and len(n.value.ops) == 1 and isinstance(n.value.ops[0], ast.Eq)
                and ast.unparse(n.value.left) == "input_ids"):
            found.setdefault(n.targets[0].id, set()).add(ast.unparse(n.value.comparators[0]))
    image, video = found.get("special_image_mask", set()), found.get("special_video_mask", set())
    return len(image) == 1 and image == video
