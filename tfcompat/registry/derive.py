"""Deriving a family entry for a causal LM from the installed transformers' own modeling module.

A text model needs no hand-written table when its structure can be read: transformers' auto mappings name the
causal-LM class of a ``model_type`` and its module; the causal LM's ``__init__`` names the text model (through a
wrapper that only delegates to it: Bart's ``*DecoderWrapper``); the text model's ``__init__`` its decoder layers; a
decoder layer's ``__init__`` its attention, up to `_DEPTH` classes down (dbrx's ``norm_attn_norm.attn``, BERT's
``attention.self``), with ``**kwargs`` proved passed at each level (else bridged by a pre-hook); and the attention's
``forward`` names what it passes to the attention function it takes from ``ALL_ATTENTION_FUNCTIONS``. Each of these
is read from the source with `ast`, never guessed from names. Attention the packed core cannot express (one that
does not dispatch through transformers' ``AttentionInterface``, passes a keyword or its own mask the core does not
know, reads positions from the row index, shares its layer with a mixer) makes the decoder layers run once per
sequence with the model's own attention, where every parameter of theirs has a proved role
(`tfcompat.registry.mixers.layer_call`) and what the text model computes from the row index reaches them only where
it is cut right (`_counted_positions`); token mixers other than softmax attention run per sequence as modules of their
own (`tfcompat.registry.mixers`, `tfcompat.hf.mixers`). What tfcompat cannot prove it handles is refused with a
`PatchError` naming it: a mixer or layer that could carry state across sequences, a layer parameter of no known role,
positions counted over the row where a sequence alone counts its own, cross-attention where a model builds it (left
stock where the text model skips its layers without cross states: Mllama), several stacks of layers (BLT), a forward
that requires inputs a packed row does not carry (Gemma 4's assistant). Layers are found in ``nn.ModuleList`` s built
in ``__init__`` or by a builder method (Zamba2's ``get_layers``), with the blocks a builder hands a layer's
``__init__`` (`_handed`).

Readings of the row index are recognized and mended instead, each from its exact source: llama4's NoPE temperature
tuning (`temperature_guard`), a decoder counting ``position_ids`` over the row for its positions module
(`positions_from_row`) or leaving its positions module to count them (`positions_module_from_row`, MVP), and learned
positions counted from a padding index (`own_positions`, RoBERTa).

A vision-language model's text type without a causal LM (``glm_ocr_text``, ``molmo2_text``) is read the same way
from its text model class as the root (`derive_text_model`): the one ``MODEL_MAPPING_NAMES`` names (`text_model_class`),
or the one the vision-language model builds from its text config. Whether a text model takes M-RoPE positions is read
from its forward and its rotary embedding's (`_text_layout`), so that `tfcompat.registry.derive_vision` refuses it.

`derive` gives the `Family` (one `Entry`, for the installed release line); `attention_call` reads one attention
class (also for written families, at `patch()`), and `passed_values` evaluates what one attention module passes.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import operator
import re
import textwrap
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch

from ..errors import PatchError, UnknownFamilyError
from . import versions
from .mixers import LAYER_ROLES, layer_call, mixer_call
from .records import AttentionCall, Derivation, Entry, Family, MixerCall, RopeConfigKey, TextModelLayout
from .sources import defined

__all__ = ["ATTENTION_KEYWORDS", "MIXER_PATTERN", "SOFTMAX_LAYER_TYPES", "UNKNOWN", "OwnPositions", "PositionsCall",
           "attention_call",
           "causal_lm_types", "cross_attrs", "derive", "derive_text_model", "guard_holds", "layer_kind", "module_name",
           "own_positions", "passed_values", "positions_from_row", "positions_module_from_row", "takes_row_positions",
           "temperature_guard", "text_model_class"]

# what an attention forward may pass to the attention function, and what the packed path makes of it
ATTENTION_KEYWORDS = {
    "dropout": "attention dropout (must be 0.0 in training)",
    "scaling": "the softmax scale",
    "sliding_window": "a sliding window (per layer)",
    "softcap": "logit softcapping",
    "s_aux": "attention sinks (learnable per head)",
    "is_causal": "causality (must be True)",
    "attention_mask": "the mask (the packed core takes the boundaries instead)",
    "position_ids": "position ids for flash-attention's packing check (the packed core takes the boundaries instead)",
    "head_mask": "a per-head mask (4.x; the packed attention refuses any but None, per forward)",
    "output_attentions": "whether the weights are returned (the packed core returns none, as stock sdpa)",
}
# class names (and torch.nn layers) of token mixers other than softmax attention: state space, convolution,
# recurrence, linear attention
# recurrence, linear attention, read in a class name after the model's own prefix ("Mamba" in "MambaMixer" is the
# model; "Mixer" the mixer)
MIXER_PATTERN = re.compile(r"mamba|ssm|conv|recurren|rglru|mixer|linearattention|linear_attention|deltanet|rwkv|"
                           r"retention|lightning|xlstm|mlstm|slstm|hyena", re.IGNORECASE)
# the names transformers gives the attention forward's cache parameter, across releases
_CACHE_PARAMS = ("past_key_value", "past_key_values", "cache", "layer_past")
# the names of an attention forward's parameter for encoder states (cross-attention)
_CROSS_PARAMS = ("encoder_hidden_states", "key_value_states", "cross_attention_states")
# how many classes down from a decoder layer the attention is looked for (BERT: BertLayer.attention.self)
_DEPTH = 3
# the ``config.layer_types`` values of softmax attention layers
SOFTMAX_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def causal_lm_types() -> dict[str, str]:
    """transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` on the installed release: ``model_type`` -> class name;
    with the causal LMs its image-text-to-text mapping alone names (5.24's ``Mistral4ForCausalLM``, a text model)."""
    auto = importlib.import_module("transformers.models.auto.modeling_auto")
    names = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    vision = getattr(auto, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {})
    only = {k: v for k, v in vision.items() if k not in names and isinstance(v, str) and v.endswith("ForCausalLM")}
    return {**{k: v for k, v in names.items() if isinstance(v, str)}, **only}


def module_name(model_type: str) -> str:
    """The modeling module of ``model_type``, by transformers' own ``model_type_to_module_name``; for a type whose
    folder holds a config and no modeling file (5.25: ``exaone`` and ``internlm3`` run ``LlamaForCausalLM``,
    ``param2moe`` ``Glm4MoeForCausalLM``), the module of the causal LM its mapping names."""
    auto = importlib.import_module("transformers.models.auto.configuration_auto")
    folder = auto.model_type_to_module_name(model_type)
    own = f"transformers.models.{folder}.modeling_{folder.rsplit('.', 1)[-1]}"
    lm = causal_lm_types().get(model_type)
    if lm is None or importlib.util.find_spec(own) is not None:
        return own
    cls = getattr(importlib.import_module("transformers"), lm, None)
    return cls.__module__ if isinstance(cls, type) else own


def derive(model_type: str, version: str) -> Family:
    """The family of ``model_type`` derived on the installed transformers (reported as ``version``); not cached.

    Raises `UnknownFamilyError` for a ``model_type`` that is not a causal LM of this release, and `PatchError`
    naming the feature for one whose structure tfcompat cannot prove it handles.
    """
    lms = causal_lm_types()
    if model_type not in lms:
        raise UnknownFamilyError(
            f"unknown model family {model_type!r}", family=model_type, transformers_version=version,
            why="neither a written family nor a causal LM of this transformers (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)",
            supported="the written families (tfcompat.registry.families()) and every causal-LM model_type",
            fix="pass transformers' config.model_type of a causal LM")
    where = module_name(model_type)
    refuse = _refuser(model_type, version, "decoder-only causal LMs whose decoder layers hold softmax attention "
                      "dispatched through transformers' AttentionInterface")
    try:
        module = importlib.import_module(where)
    except ImportError as exc:
        raise refuse(f"{where} cannot be imported", str(exc)) from None
    lm = _local_class(module, lms[model_type])
    if lm is None:
        raise refuse(f"{lms[model_type]} is not defined in {where}", "the causal LM comes from another module")
    required = _inputs_required(lm)
    if required:
        raise refuse(f"{lm.__name__}.forward requires {', '.join(required)}",
                     "it raises unless they are given: inputs that a packed row (token ids or embeddings, position "
                     "ids) does not carry", "run it unpatched, fed as its forward requires")
    prefix = getattr(lm, "base_model_prefix", "model")
    if not _built_classes(module, lm, "__init__", attr=prefix) and _built_classes(module, lm, "__init__", attr="model"):
        prefix = "model"  # MllamaForCausalLM: prefix "language_model", the text model at self.model
    text = _single(_built_classes(module, lm, "__init__", attr=prefix)) or _local_class(
        module, _auto_name("MODEL_MAPPING_NAMES", model_type))
    if text is None:
        raise refuse(f"no text model found in {lm.__name__}.{prefix}",
                     f"{lm.__name__}.__init__ does not build a class of {where} at self.{prefix}")
    return _derive_from(model_type, version, module, text, lm, prefix, _config_class(model_type), refuse)


def text_model_class(model_type: str) -> type | None:
    """The text model class that transformers' ``MODEL_MAPPING_NAMES`` maps ``model_type`` to, where the type's
    modeling module defines it; None otherwise."""
    name = _auto_name("MODEL_MAPPING_NAMES", model_type)
    try:
        return _local_class(importlib.import_module(module_name(model_type)), name) if name else None
    except ImportError:
        return None


def derive_text_model(model_type: str, version: str, root: type) -> Family:
    """The family of ``model_type``, a text type without a causal LM (a vision-language model's
    ``text_config.model_type``: ``glm_ocr_text``), derived from the class ``root`` (found by `text_model_class`, or
    the class a vision-language model builds from its text config) by the same reading as `derive`: ``root`` is the
    text model, or a model with a head around the text model it builds at its ``base_model_prefix`` (BLIP's
    ``BlipTextLMHeadModel``), read as a causal LM; not cached. Without such a head, the entry names no
    ``for_causal_lm`` and `Derivation.causal_lm` is "".

    Raises `PatchError` naming the feature for a text model whose structure tfcompat cannot prove it handles.
    """
    refuse = _refuser(model_type, version, "text models of vision-language models whose decoder layers hold softmax "
                      "attention dispatched through transformers' AttentionInterface")
    module = importlib.import_module(root.__module__)
    prefix = getattr(root, "base_model_prefix", "")
    inner = _single(_built_classes(module, root, "__init__", attr=prefix)) if prefix else None
    lm, text = (root, inner) if inner is not None else (None, root)
    required = _inputs_required(root)
    if required:
        raise refuse(f"{root.__name__}.forward requires {', '.join(required)}",
                     "it raises unless they are given: inputs that a packed row (token ids or embeddings, position "
                     "ids) does not carry", "run it unpatched, fed as its forward requires")
    config = getattr(root, "config_class", None)
    if not isinstance(config, type):
        raise refuse(f"{root.__name__} names no config_class", "its config's keys (rope settings) cannot be read")
    return _derive_from(model_type, version, module, text, lm, prefix if lm is not None else "", config, refuse)


def _refuser(model_type: str, version: str, supported: str) -> Callable[..., PatchError]:
    def refuse(what: str, why: str, fix: str = "") -> PatchError:
        return PatchError(f"cannot derive {model_type}: {what}", family=model_type, transformers_version=version,
                          why=why, supported=supported,
                          fix=fix or "use a model whose structure tfcompat supports, or run it unpatched")

    return refuse


def _derive_from(model_type: str, version: str, module: Any, text: type, lm: type | None, prefix: str,
                 config: str | type, refuse: Callable[..., PatchError]) -> Family:
    """The reading `derive` and `derive_text_model` share, from the text model ``text`` of ``module`` down: held by
    the causal LM ``lm`` at ``prefix`` (None, "": the text model is the root). config: the config class (or its name
    in transformers' namespace)."""
    where = module.__name__
    layers = _layer_classes(module, text)
    holders: list[type] = []  # the class between the text model and its layers: OPTModel.decoder, BertModel.encoder
    stacks = [] if layers else [h for h in _built_classes(module, text, "__init__") if _layer_classes(module, h)]
    if len(stacks) > 1:  # BLT: a local encoder, a global transformer and a local decoder
        raise refuse(f"{text.__name__} holds several stacks of layers ({', '.join(c.__name__ for c in stacks)})",
                     "tfcompat patches one decoder stack over the packed row's tokens; these run over different "
                     "sequences (bytes and patches) that the row's position ids do not describe")
    for holder in stacks:
        layers = _layer_classes(module, holder)
        holders.append(holder)
    if len(holders) == 1 and _delegates(text, holders[0]):  # BartDecoderWrapper.forward: self.decoder(*a, **kw)
        text, holders = holders[0], []
    if not layers:
        raise refuse(f"no decoder layers found in {text.__name__}",
                     f"{text.__name__}.__init__ builds no nn.ModuleList of {where}'s classes")
    lists = [item for h in (text, *holders) for item in _layer_lists(module, h)]
    if len(lists) > 1 and not any(_attention_chains(module, c) for _, cs in lists for c in cs):
        raise refuse(f"{text.__name__} keeps its layers' parts in parallel lists, no decoder layer class ("
                     + "; ".join(f"{a}: {', '.join(c.__name__ for c in cs)}" for a, cs in lists) + ")",
                     "tfcompat finds a model's attention inside its decoder layers; here the text model's forward "
                     "calls each part itself")
    mixer_calls: list[MixerCall] = []  # every layer class first: a hybrid is named by its mixer
    per_sequence, unproved = _layer_calls(layers)
    try:
        found = _softmax_attention(module, _own_prefix(lm or text), text, layers, refuse, mixer_calls)
        forced = ""
    except PatchError as exc:  # the packed core cannot express it: the decoder layers run per sequence, if proved
        if unproved:
            raise refuse(exc.what.removeprefix(f"cannot derive {model_type}: "),
                         f"{exc.why}; nor can its decoder layers run per sequence ({unproved})") from None
        found, forced, mixer_calls = None, exc.what.removeprefix(f"cannot derive {model_type}: "), []
    attention, cross, passes, layers = found if found is not None else (None, [], [True], layers)
    softmax = attention is not None  # else the layers run per sequence, or hold mixers alone (Mamba)
    call = attention_call(attention) if softmax else AttentionCall(layers[0].__name__, (), False, (), 0, "")
    attention = attention or layers[0]
    # the boundaries reach the packed core's attention in the forwards' kwargs; where they cannot (4.x Bart's decoder
    # calls its layers without them), the layers run per sequence, which take them from the text model's forward
    dropped = [f"{owner.__name__}.forward calls its decoder layers without **kwargs ({d})"
               for owner in (text, *holders) for d in [_layer_calls_without_kwargs(owner)] if d]
    dropped += [f"{text.__name__}.forward calls its {holder.__name__} without **kwargs" for holder in holders
                if not _passes_kwargs(text, holder)]
    if softmax and not forced and dropped:
        if unproved:
            raise refuse(dropped[0], "the packed boundaries travel in the forward's kwargs and could not reach the "
                         f"attention; nor can its decoder layers run per sequence ({unproved})")
        forced, mixer_calls = dropped[0], []
    takes_ids = "position_ids" in inspect.signature(cast(Any, text).forward).parameters
    if softmax and not forced and not takes_ids and positions_from_row(text) is None:
        counted = next((f"{o.__name__}.{attr} ({c[0].__name__})" for o in (text, *holders)
                        for attr, c in _assigned_classes(module, o, "__init__") if "position" in attr and c), "")
        raise refuse(f"{text.__name__}.forward takes no position_ids",
                     "it numbers the row's tokens itself" + (f", in {counted}," if counted else "") + " from the row's "
                     "length; a packed row's positions restart per sequence only through position_ids",
                     "run one sequence per row, unpatched")
    # a text model without position ids whose layers run per sequence: what it counts over the row is read below
    positionless = (forced or not softmax) and not takes_ids
    for owner in () if positionless else (text, *holders):
        unpositioned = _position_modules_without_ids(module, owner)
        if unpositioned:
            raise refuse(f"{owner.__name__}.forward {unpositioned}",
                         "on a packed row, positions must restart per sequence; tfcompat passes them as position_ids",
                         "run the model unpatched")
    # layers run per sequence take what the text model computed for the row, cut per sequence: what it computed
    # from the row index must reach them only where it is cut right (the mask, an ALiBi bias, cache_position)
    row = _counted_positions(module, text, layers, holders) if forced or not softmax or per_sequence else ""
    if row and (forced or not softmax):
        raise refuse(f"{text.__name__}.forward {row}",
                     "its layers run per sequence, and what it counts over a packed row runs across sequences",
                     "run the model unpatched")
    per_sequence = () if row else per_sequence  # no fallback at patch() for a layer type the core cannot run
    cache = [p for p in _CACHE_PARAMS if p in inspect.signature(cast(Any, attention).forward).parameters]
    config_cls = config if isinstance(config, str) else config.__name__
    rope_key: RopeConfigKey = "rope_parameters" if "rope_parameters" in _config_fields(config) else "rope_scaling"
    derivation = Derivation(
        causal_lm=lm.__name__ if lm is not None else "", text_model=text.__name__, text_model_attr=prefix,
        decoder_layers=tuple(c.__name__ for c in layers), attention=call, config=config_cls, mixers=tuple(mixer_calls),
        per_sequence=per_sequence, per_sequence_why=forced, softmax_attention=softmax)
    release = versions.parse(version).release
    line = f"{release[0]}.{release[1]}"
    entry = Entry(
        family=model_type,
        versions=versions.VersionRange(line, f"{release[0]}.{release[1] + 1}"),
        module=where,
        classes={"attention": attention.__name__, "text_model": text.__name__, "decoder_layer": layers[0].__name__,
                 **({"for_causal_lm": lm.__name__} if lm is not None else {}),
                 **({"cross_attention": cross[0].__name__} if cross else {})},
        rotary=None,
        rope_config_key=rope_key,
        text_model_positions=_text_layout(module, text),
        layer_forwards_kwargs=all(passes) and not _checkpointed_layer_calls_without_kwargs(text),
        rope_index_mm_token_types=False,
        cache_kwarg=cast(Any, cache[0]) if cache else None,
        why=f"derived from {where} on transformers {version}",
        derived=derivation,
    )
    return Family(key=model_type, entries=(entry,), tiny_config=functools.partial(_tiny_config, config))


def _own_prefix(root: type) -> str:
    """The model's own name in its class names, from the causal LM or text model at the root (``MambaForCausalLM``,
    ``Molmo2TextModel``: ``Mamba``, ``Molmo2``): `MIXER_PATTERN` is read after it."""
    return re.sub(r"(ForCausalLM|(Text)?Model)$", "", root.__name__)


def _text_layout(module: Any, text: type) -> TextModelLayout:
    """The position ids ``text`` (a text model class) takes (`tfcompat.registry.records.Entry.text_model_positions`):
    M-RoPE where its forward, or the forward of a module its ``__init__`` builds (its rotary embedding), expands
    ``position_ids`` to one row per M-RoPE axis (``.expand(3, B, -1)``; a 1-D model's expand takes two sizes); then
    "text+mrope" where the text model's forward also reads the text row ``position_ids[0]``, else "mrope"."""
    layers = set(_layer_classes(module, text))
    forwards = [_method(c, "forward") for c in (text, *(c for c in _built_classes(module, text, "__init__")
                                                         if c not in layers))]

    def axes(fn: ast.FunctionDef | None) -> bool:
        return fn is not None and any(
            isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == ["position_ids"]
            and any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "expand"
                    and len(c.args) == 3 for c in ast.walk(n.value)) for n in ast.walk(fn))

    if not any(axes(fn) for fn in forwards):
        return "text"
    fn = forwards[0]
    text_row = fn is not None and any(ast.unparse(n) == "position_ids[0]" for n in ast.walk(fn))
    return "text+mrope" if text_row else "mrope"


def _softmax_attention(module: Any, prefix: str, text: type, layers: list[type], refuse: Callable[..., PatchError],
                       mixer_calls: list[MixerCall]) -> tuple[type | None, list[type], list[bool], list[type]]:
    """The attention class of ``layers`` (of ``text``) that the packed core runs, the cross-attention class (empty or
    one), per layer class holding it whether each chain down to it passes ``**kwargs``, and the layer classes (the
    decoder layer class first); ``(None, [], [True], layers)`` for layers of per-sequence mixers alone (Mamba).
    `PatchError` (from ``refuse``) for attention the core cannot express. Adds the per-sequence mixers to
    ``mixer_calls``. prefix: the model's own name in its class names (`_own_prefix`)."""
    mixing = [layer for layer in layers if _per_sequence_mixers(module, layer, prefix, refuse, mixer_calls)]
    chains: dict[type, list[tuple[type, ...]]] = {}  # decoder layer -> its chains (layer, ..., attention)
    for layer in layers:
        chains[layer] = _attention_chains(module, layer)
        if not chains[layer] and layer not in mixing:  # a layer of mixers alone (Jamba's Mamba layers) has none
            raise refuse(f"{layer.__name__} holds no attention that dispatches through AttentionInterface",
                         f"none of the classes {layer.__name__}.__init__ builds (nor theirs, {_DEPTH} levels down) "
                         "calls a function taken from ALL_ATTENTION_FUNCTIONS")
    found = list(dict.fromkeys(chain[-1] for layer in layers for chain in chains[layer]))
    if not found:
        return None, [], [True], layers
    attentions = [c for c in found if not _is_cross_attention(c)] if len(found) > 1 else found
    cross = [c for c in found if c not in attentions]  # built only with encoder states: refused at patch() if built
    if len(attentions) != 1 or len(cross) > 1:
        raise refuse(f"several attention classes: {', '.join(c.__name__ for c in found)}",
                     "one attention class per model is supported (besides cross-attention, refused where built)")
    attention = attentions[0]
    holding = [c for c in layers if any(ch[-1] in cross for ch in chains[c])]
    if cross and _skips_cross_layers(text, holding):
        # Mllama's cross-attention layers: skipped without cross states, which a packed forward refuses; the decoder
        # layer class is the other one
        cross, layers = [], [c for c in layers if c not in holding] + holding
    call = attention_call(attention)
    unknown = sorted(set(dict(call.keywords)) - ATTENTION_KEYWORDS.keys())
    if unknown:
        raise refuse(f"{attention.__name__} passes {', '.join(unknown)} to the attention function",
                     "the packed core implements " + ", ".join(ATTENTION_KEYWORDS))
    if call.positional + ("attention_mask" in dict(call.keywords)) != 5:
        raise refuse(f"{attention.__name__} passes {call.positional} positional arguments to the attention function",
                     "transformers' attention functions take (module, query, key, value, attention_mask) first")
    own_mask = _method(attention, "forward")
    if call.mask not in ("", "None", "attention_mask") or own_mask is None or "attention_mask" not in {
            a.arg for a in own_mask.args.args + own_mask.args.kwonlyargs}:
        raise refuse(f"{attention.__name__} passes its own mask ({call.mask or 'none'}) to the attention function",
                     "the packed core replaces the model's causal mask by the sequence boundaries; a mask or bias the "
                     "attention computes itself (dynamic masks, position biases) would be dropped")
    unguarded = [g for g in call.row_positions if not g]
    if unguarded:
        raise refuse(f"{attention.__name__} reads positions from the row index",
                     "it computes with cache_position or torch.arange over the row, which on a packed row counts "
                     "across sequences (position_ids restart per sequence)")
    # every chain from a decoder layer down to the attention passes **kwargs at each level: else a pre-hook on the
    # decoder layer hands the boundaries to each attention module below it
    passes = [all(_passes_kwargs(a, b) for chain in chains[layer] if chain[-1] is attention
                  for a, b in zip(chain, chain[1:])) for layer in layers if chains[layer]]
    if len(passes) > 1 and not all(passes):
        raise refuse(f"several decoder layer classes ({', '.join(c.__name__ for c in layers)}), some dropping **kwargs",
                     "the packed boundaries are bridged to the attention of one decoder layer class")
    return attention, cross, passes, layers


def _counted_positions(module: Any, text: type, layers: list[type], holders: list[type]) -> str:
    """What ``text.forward`` (a text model whose layers run per sequence or hold per-sequence mixers), or the forward
    of a holder of its layers, computes from the row index that a packed row cannot take ("" = nothing): without a
    ``position_ids`` parameter, a module it builds besides the layers and their holder that is more than a
    one-argument, row-blind layer (a norm: not a positions module); a value computed from ``torch.arange`` /
    ``cache_position`` reaching anything but a layer argument cut per sequence (`tfcompat.registry.mixers
    .LAYER_ROLES`: the mask, an ALiBi bias, ``cache_position``)."""
    fn = _method(text, "forward")
    positioned = fn is not None and "position_ids" in {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    for owner in (text, *holders):
        counted = _counted_by(module, owner, layers, holders, positioned)
        if counted:
            return counted if owner is text else f"calls {owner.__name__}, which {counted}"
    return ""


# the parameters of a module a text model without position ids may build besides its layers: it takes tokens (ids,
# token types, embeddings: BERT-style embeddings without positions, norms), no lengths or positions
_TOKEN_PARAMS = {"input_ids", "token_type_ids", "inputs_embeds", "input_embeds", "hidden_states", "x", "input"}


def _counted_by(module: Any, owner: type, layers: list[type], holders: list[type], positioned: bool) -> str:
    """`_counted_positions` of one forward. positioned: the text model takes ``position_ids`` (a packed forward
    always passes them: its default positions are not computed; its modules take them or the checks of
    `_position_modules_without_ids` refused them)."""
    fn = _method(owner, "forward")
    if fn is None:
        return "has no readable forward"
    defaults = {id(n) for i in ast.walk(fn) if positioned and isinstance(i, ast.If)
                and ast.unparse(i.test) == "position_ids is None" for b in i.body for n in ast.walk(b)}
    from_row = positions_from_row(owner) or positions_module_from_row(owner)
    if from_row is not None:  # the positions it counts are replaced by the row's own (Bart's decoder): a patch hands
        # that module the packed row's position ids (`tfcompat.hf.patching`)
        defaults |= {id(n) for b in fn.body if isinstance(b, ast.Assign)
                     and [ast.unparse(t) for t in b.targets] == ["position_ids"] for n in ast.walk(b)}
    cut = {n for n, role in LAYER_ROLES.items() if role in ("mask", "key_bias", "cache_position", "row_prefix")}
    held = {name for name, classes in _assigned_classes(module, owner, "__init__") if set(classes) & set(layers)}
    loops = [(loop, loop.iter.args[0] if isinstance(loop.iter, ast.Call) and loop.iter.args else loop.iter)
             for loop in ast.walk(fn) if isinstance(loop, ast.For)]  # for layer in self.layers / enumerate(...)
    loop_vars = {t.id for loop, it in loops if (_self_attr(it) or "") in held for t in ast.walk(loop.target)
                 if isinstance(t, ast.Name)}
    # for i in range(...): layer_module = self.layer[i] (4.x BLIP's text encoder)
    loop_vars |= {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Subscript)
                  and (_self_attr(n.value) or "") in held for t in n.targets if isinstance(t, ast.Name)}
    layer_params = [a.arg for a in (_method(layers[0], "forward") or fn).args.args[1:]]

    def names(call: ast.Call) -> list[str]:  # a layer's positional arguments by name: cut as its keywords
        to_layer = ((isinstance(call.func, ast.Name) and call.func.id in loop_vars)
                    or (_self_attr(call.func) or "") in held)
        return layer_params if to_layer else []

    handed = {id(n) for c in ast.walk(fn) if isinstance(c, ast.Call)
              for a in [*(k.value for k in c.keywords if k.arg in cut),
                        *(a for a, name in zip(c.args, names(c)) if name in cut)]
              for n in ast.walk(a)}  # cut per sequence where it is passed
    passed = {id(n) for c in ast.walk(fn) if isinstance(c, ast.Call)
              for a in [*c.args, *(k.value for k in c.keywords)] for n in ast.walk(a)}  # checked at the call below
    loads: dict[str, list[ast.Name]] = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            loads.setdefault(n.id, []).append(n)
    looped = {id(n) for loop in ast.walk(fn) if isinstance(loop, (ast.For, ast.While)) for n in ast.walk(loop)}

    def read_after(n: ast.Assign, name: str) -> list[ast.Name]:  # the loads that may read what ``n`` assigns: those
        end = (n.end_lineno or n.lineno, n.end_col_offset or 0)  # after it (every load where it is in a loop)
        return [x for x in loads.get(name, []) if id(n) in looped or (x.lineno, x.col_offset) >= end]

    # a call whose value only ever reaches the layers cut per sequence (4.x: causal_mask = self._update_causal_mask(
    # attention_mask, inputs_embeds, cache_position, ...), passed as attention_mask=causal_mask; 4.57 Bart's decoder
    # reassigns attention_mask itself, read before only as the call's input)
    to_cut = {id(c) for n in ast.walk(fn) if isinstance(n, ast.Assign) and all(
        isinstance(t, ast.Name) and all(id(x) in handed for x in read_after(n, t.id)) for t in n.targets)
        for c in ast.walk(n.value) if isinstance(c, ast.Call)}
    # names that may hold something of the row: the forward's parameters and what is computed from them (a value of
    # constants and the module's attributes alone, MVP's prompt ids ``torch.arange(self.prompt_length)``, is not)
    dependent = {a.arg for a in fn.args.args[1:] + fn.args.kwonlyargs} | {
        a.arg for a in (fn.args.vararg, fn.args.kwarg) if a is not None}
    for node in sorted((n for n in ast.walk(fn) if isinstance(n, ast.Assign)), key=lambda n: (n.lineno, n.col_offset)):
        if any(isinstance(n, ast.Name) and n.id in dependent for n in ast.walk(node.value)):
            dependent |= {t.id for target in node.targets for t in ast.walk(target) if isinstance(t, ast.Name)}

    def of_row(expr: ast.AST) -> bool:
        return any(isinstance(n, ast.Name) and n.id in dependent for n in ast.walk(expr))

    for attr, classes in [] if positioned else _assigned_classes(module, owner, "__init__"):
        if attr == from_row:
            continue
        uses = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and _self_attr(c.func) == attr]
        if uses and all(id(c) in to_cut or not any(of_row(a) for a in [*c.args, *(k.value for k in c.keywords)])
                        for c in uses):
            continue  # it computes nothing of the row, or only for the layers' arguments cut per sequence (RoFormer's
            # sinusoidal positions)
        for cls in (c for c in classes if c not in layers and c not in holders):
            forward = _method(cls, "forward")
            params = {a.arg for a in forward.args.args[1:] + forward.args.kwonlyargs} if forward is not None else {""}
            if not params <= _TOKEN_PARAMS or _reads_row(cls):
                return f"builds {cls.__name__}, which may count positions over the row"
    tainted: set[str] = {"cache_position"}

    def row(expr: ast.AST, skip: set[int]) -> bool:
        return any(id(n) not in skip and ((isinstance(n, ast.Name) and n.id in tainted) or (
            isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.arange" and of_row(n))) for n in ast.walk(expr))

    for node in sorted((n for n in ast.walk(fn) if isinstance(n, ast.Assign) and id(n) not in defaults),
                       key=lambda n: (n.lineno, n.col_offset)):
        if row(node.value, passed | handed):  # computed from the row index, not by a call given it (checked there)
            tainted |= {t.id for target in node.targets for t in ast.walk(target) if isinstance(t, ast.Name)}
    calls = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Call) and id(n) not in to_cut | defaults
                    and (from_row is None or _self_attr(n.func) != from_row)),  # given the row's own positions
                   key=lambda n: (n.lineno, n.col_offset))
    for call in calls:
        by_name = names(call)
        for i, arg in enumerate([*call.args, *(k.value for k in call.keywords if k.arg not in cut)]):
            if i < len(call.args) and i < len(by_name) and by_name[i] in cut:
                continue
            if row(arg, set()):
                return f"passes {ast.unparse(arg)}, counted over the row, to {ast.unparse(call.func)}"
    return ""


def _reads_row(cls: type) -> bool:
    """Whether ``cls.forward``, or a method of ``self`` it calls (recursively), computes with the row index."""
    todo, seen = ["forward"], set()
    while todo:
        name = todo.pop()
        fn = _method(cls, name) if name not in seen else None
        seen.add(name)
        if fn is None:
            continue
        if _row_position_guards(fn):
            return True
        todo += [n.func.attr for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]
    return False


def _layer_calls(layers: list[type]) -> tuple[tuple[MixerCall, ...], str]:
    """Each decoder layer class's `MixerCall` as run per sequence (`tfcompat.registry.mixers.layer_call`), or ``((),
    why not)``."""
    try:
        return tuple(layer_call(layer) for layer in layers), ""
    except ValueError as exc:
        return (), str(exc)


@functools.cache
def attention_call(cls: type) -> AttentionCall:
    """What ``cls.forward`` passes to the attention function it takes from ``ALL_ATTENTION_FUNCTIONS`` (cached).

    Raises `ValueError` when its forward calls no such function (see `_dispatch_call`).
    """
    found = _dispatch_call(cls)
    if found is None:
        raise ValueError(f"{cls.__name__}.forward dispatches through no AttentionInterface function")
    fn, call = found
    keywords = tuple((k.arg, ast.unparse(k.value)) for k in call.keywords if k.arg is not None)
    passes = any(k.arg is None for k in call.keywords)
    mask = call.args[4] if len(call.args) > 4 else next((k.value for k in call.keywords if k.arg == "attention_mask"),
                                                        None)
    return AttentionCall(cls.__name__, keywords, passes, _row_position_guards(fn), len(call.args),
                         "" if mask is None else ast.unparse(mask))


# llama4's NoPE temperature tuning (https://huggingface.co/papers/2501.19399): the query scale at row position X
# (4.53: torch.log(... + 1.0), the same function)
_TEMPERATURE = re.compile(r"torch\.log(?:1p\(torch\.floor\(\((\w+)\.float\(\) \+ 1\.0\) / self\.floor_scale\)\)|"
                          r"\(torch\.floor\(\((\w+)\.float\(\) \+ 1\.0\) / self\.floor_scale\) \+ 1\.0\)) \* "
                          r"self\.attn_scale \+ 1\.0")
_TEMPERATURE_LOCALS = {"past_seen_tokens", "positions", "attn_scales", "query_states"}


@functools.cache
def temperature_guard(cls: type) -> str:
    """The guard (as in `AttentionCall.row_positions`) of ``cls.forward``'s NoPE temperature tuning, "" when it has
    none: an ``if`` block that only scales ``query_states`` by ``log1p(floor((X + 1) / self.floor_scale)) *
    self.attn_scale + 1`` with X the row index (``cache_position``, or ``torch.arange(hidden_states.shape[1])`` plus
    the cached length, 0 in a packed forward). On a packed row X counts across sequences; the packed attention
    rescales each query from its row index to its position in its sequence (`tfcompat.hf.attention`)."""
    fn = _method(cls, "forward")
    for node in ast.walk(fn) if fn is not None else ():
        if not isinstance(node, ast.If):
            continue
        body = "\n".join(ast.unparse(b) for b in node.body)
        found = _TEMPERATURE.search(body)
        targets = {t.id for b in node.body if isinstance(b, ast.Assign) for t in b.targets if isinstance(t, ast.Name)}
        read = None if found is None else found.group(1) or found.group(2)
        row = read == "cache_position" or (read == "positions" and "positions = torch.arange(hidden_states.shape[1]"
                                           in body)
        if (row and "query_states = (query_states * attn_scales)" in body and targets <= _TEMPERATURE_LOCALS
                and all(isinstance(b, ast.Assign) for b in node.body)):
            return f"({ast.unparse(node.test)})"
    return ""


def passed_values(call: AttentionCall, module: Any, *, training: bool = False) -> dict[str, Any]:
    """The values ``module`` (an instance of ``call.cls``) passes for each keyword of ``call``, evaluated on the
    module as its forward would (``self.training`` read as ``training``). A keyword whose expression reads anything
    but the module, its config and constants maps to `UNKNOWN`."""
    return {name: _evaluate(expr, module, training) for name, expr in call.keywords}


def guard_holds(guard: str, module: Any) -> bool | None:
    """Whether the guard (an ``if`` test of `AttentionCall.row_positions`) holds on ``module`` in a packed forward
    (no cache); None when it cannot be evaluated."""
    value = _evaluate(guard, module, False)
    return None if value is UNKNOWN else bool(value)


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Any = _Unknown()


# -- source reading ------------------------------------------------------------------------------------------------

def _method(cls: type, name: str) -> ast.FunctionDef | None:
    """The ``ast`` of ``cls.name`` as defined on the nearest class of its MRO (decorators unwrapped)."""
    owner = next((c for c in cls.__mro__ if name in vars(c)), None)
    if owner is None or owner is object:
        return None
    fn = defined(owner, name)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0]
    return node if isinstance(node, ast.FunctionDef) else None


def _local_class(module: Any, name: str | None) -> type | None:
    obj = getattr(module, name, None) if name else None
    return obj if isinstance(obj, type) and obj.__module__ == module.__name__ else None


def _auto_name(mapping: str, model_type: str) -> str | None:
    names = getattr(importlib.import_module("transformers.models.auto.modeling_auto"), mapping)
    name = names.get(model_type)
    return name if isinstance(name, str) else None


def _single(classes: list[type]) -> type | None:
    return classes[0] if len(classes) == 1 else None


def _layer_lists(module: Any, cls: type) -> list[tuple[str, list[type]]]:
    """``(attribute, classes)`` of each ``nn.ModuleList`` of module classes that ``cls.__init__`` builds; lists it
    fills by ``self.attr.append(...)`` only where it builds no other (XLM's; GraniteSWA's per-window rotary modules
    beside its layers are not layers)."""
    return [(a, cs) for a, cs in _assigned_classes(module, cls, "__init__", lists_only=True) if cs] or [
        (a, cs) for a, cs in _assigned_classes(module, cls, "__init__", lists_only=True, appended=True) if cs]


def _layer_classes(module: Any, cls: type) -> list[type]:
    return list(dict.fromkeys(c for _, cs in _layer_lists(module, cls) for c in cs))


def _built_classes(module: Any, cls: type, method: str, *, attr: str | None = None,
                   lists_only: bool = False) -> list[type]:
    """The classes of ``module`` that ``cls.method`` instantiates (in order, once each).

    attr: only those assigned to ``self.attr``; lists_only: only those inside an ``nn.ModuleList(...)`` assigned to
    an attribute of ``self`` (or into a local list it is built from: ``layers.append(...)``, where the class may come
    from a dict of the module, ``ALL_DECODER_LAYER_TYPES[kind]``).
    """
    built = _assigned_classes(module, cls, method, lists_only=lists_only)
    return list(dict.fromkeys(c for name, classes in built if attr is None or name == attr for c in classes))


def _assigned_classes(module: Any, cls: type, method: str, *, lists_only: bool = False, appended: bool = False
                      ) -> list[tuple[str, list[type]]]:
    """``(attribute, classes)`` for each assignment to an attribute of ``self`` in ``cls.method``: the module
    classes the assigned value instantiates (a class may be named directly, through a local variable assigned from
    class names, ``cls = A if cross else B; self.x = cls(...)``, or read from a dict of the module, or handed to
    ``__init__`` by its builder, `_handed`). lists_only: only values that are an ``nn.ModuleList(...)`` (see
    `_built_classes`), or that a method of ``cls`` returns as one (``self.layers = self.get_layers()``); appended:
    with lists_only, also an empty ``nn.ModuleList()`` filled by ``self.attr.append(...)``."""
    fn = _method(cls, method)
    if fn is None:
        return []
    local = {t.id: n.value for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Name)}
    out: list[tuple[str, list[type]]] = []
    for node in ast.walk(fn):
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        on_self = [t for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                   and t.value.id == "self"]
        value = node.value
        if lists_only and isinstance(value, ast.Call) and not value.args and isinstance(value.func, ast.Attribute) \
                and ast.unparse(value.func.value) == "self" and _method(cls, value.func.attr) is not None:
            built = _returned_list(module, cls, value.func.attr)  # self.layers = self.get_layers() (Zamba2)
            out += [(t.attr, built) for t in on_self] if built else []
            continue
        if not on_self or (lists_only and not (isinstance(value, ast.Call)
                                               and ast.unparse(value.func).endswith("ModuleList"))):
            continue
        names: list[str] = []
        if isinstance(value, ast.Name) and method == "__init__" and value.id in {a.arg for a in fn.args.args[1:]}:
            names += _handed(module.__name__, cls.__name__).get(value.id, ())  # a module its builder hands it
        for sub in (n for n in ast.walk(value) if isinstance(n, ast.Call)):
            if (isinstance(sub.func, ast.Attribute) and sub.func.attr in ("_from_config", "from_config")
                    and isinstance(sub.func.value, ast.Name)):  # MllamaTextModel._from_config(config)
                names.append(sub.func.value.id)
            elif isinstance(sub.func, ast.Name):
                names.append(sub.func.id)
                if sub.func.id in local:  # a local naming the class: cls = A if cross else B (Chameleon's layers)
                    names += [n.id for n in ast.walk(local[sub.func.id]) if isinstance(n, ast.Name)]
            elif isinstance(sub.func, ast.Subscript) and isinstance(sub.func.value, ast.Name):  # TYPES[kind](config)
                table = getattr(module, sub.func.value.id, None)
                names += [v.__name__ for v in table.values() if isinstance(v, type)] if isinstance(table, dict) else []
        if lists_only and isinstance(value, ast.Call):  # nn.ModuleList(layers): what was appended to the local list
            for arg in (a for a in value.args if isinstance(a, ast.Name)):
                names += _appended(fn, module, arg.id)
            if not value.args and appended:  # nn.ModuleList(), then self.layers.append(...) (XLM, Inkling 2 Loop)
                names += [n for t in on_self for n in _appended(fn, module, f"self.{t.attr}")]
        classes = [c for c in dict.fromkeys(_local_class(module, n) for n in names) if c is not None and _is_module(c)]
        out += [(t.attr, classes) for t in on_self]
    return out


@functools.cache
def _handed(module_name: str, cls_name: str) -> dict[str, tuple[str, ...]]:
    """The classes that builders in ``module_name`` hand ``cls_name.__init__`` instances of, by parameter: in each
    call ``cls_name(a, ...)``, an argument assigned from ``C(...)`` in the same function (Zamba2's
    ``Zamba2HybridLayer(attn_block, linear_layer, mamba_layer)``, its blocks built in ``get_layers``)."""
    module = importlib.import_module(module_name)
    init = _method(getattr(module, cls_name), "__init__")
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return {}
    params = [a.arg for a in init.args.args[1:]] if init is not None else []
    out: dict[str, list[str]] = {}
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        assigned = {t.id: n.value for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) == cls_name):
            for param, arg in [*zip(params, call.args), *((k.arg, k.value) for k in call.keywords if k.arg)]:
                value = assigned.get(arg.id) if isinstance(arg, ast.Name) else arg
                if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
                    out.setdefault(param, []).append(value.func.id)
    return {k: tuple(dict.fromkeys(v)) for k, v in out.items()}


def _appended(fn: ast.FunctionDef, module: Any, var: str) -> list[str]:
    """Names of the classes ``fn`` appends instances of to its list ``var`` (a local, or ``self.attr``):
    ``var.append(C(...))``, an appended local assigned from ``C(...)``, or ``C`` read from a dict of the module or a
    local dict (``TYPES[kind](...)``)."""
    assigned = {t.id: n.value for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}

    def classes(expr: ast.AST) -> list[str]:
        if isinstance(expr, ast.Name) and expr.id in assigned:
            return classes(assigned[expr.id])
        if isinstance(expr, ast.Call):
            return [n.func.id for n in ast.walk(expr) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                    and n.func.id not in assigned] + (classes(expr.func) if isinstance(expr.func, ast.Name) else [])
        if isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Name):
            local = assigned.get(expr.value.id)
            if isinstance(local, ast.Dict):  # layer_classes = {...}; layer_classes[kind](...)
                return [v.id for v in local.values if isinstance(v, ast.Name)]
            table = getattr(module, expr.value.id, None)
            return [v.__name__ for v in table.values() if isinstance(v, type)] if isinstance(table, dict) else []
        return []

    return [name for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "append" and ast.unparse(n.func.value) == var
            for arg in n.args for name in classes(arg)]


def _returned_list(module: Any, cls: type, method: str) -> list[type]:
    """The module classes of the ``nn.ModuleList(layers)`` that ``cls.method`` returns (see `_appended`)."""
    fn = _method(cls, method)
    returned = [n.value for n in ast.walk(fn) if isinstance(n, ast.Return)] if fn is not None else []
    if fn is None or len(returned) != 1 or not (isinstance(returned[0], ast.Call)
                                                 and ast.unparse(returned[0].func).endswith("ModuleList")):
        return []
    names = [n for a in returned[0].args if isinstance(a, ast.Name) for n in _appended(fn, module, a.id)]
    return [c for c in dict.fromkeys(_local_class(module, n) for n in names) if c is not None and _is_module(c)]


def _is_module(cls: type) -> bool:
    import torch

    return issubclass(cls, torch.nn.Module)


def _token_mixers(module: Any, layer: type, prefix: str, seen: frozenset[type] = frozenset()) -> list[str]:
    """Names of token mixers other than softmax attention that ``layer`` builds, directly or in its own children:
    classes of the module or ``nn`` layers whose name (after the model's ``prefix``) says state space,
    convolution, recurrence or linear attention (`MIXER_PATTERN`)."""
    fn = _method(layer, "__init__")
    if fn is None:
        return []
    out = [ast.unparse(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)
           and isinstance(n.func, ast.Attribute) and MIXER_PATTERN.search(n.func.attr)]
    for child in _built_classes(module, layer, "__init__"):
        if MIXER_PATTERN.search(child.__name__.removeprefix(prefix)) and _dispatch_call(child) is None:
            out.append(child.__name__)
        elif child not in seen:
            out += _token_mixers(module, child, prefix, seen | {layer})
    return list(dict.fromkeys(out))


def _per_sequence_mixers(module: Any, layer: type, prefix: str, refuse: Callable[..., PatchError],
                         out: list[MixerCall]) -> bool:
    """Whether ``layer`` holds token mixers other than softmax attention; each child class holding them is added to
    ``out`` as a mixer run per sequence (`tfcompat.registry.mixers`). `PatchError` (from ``refuse``) where a mixer
    sits in the layer itself or in an attention, or its forward is not proved per sequence. prefix: the model's own
    name in its class names (`_own_prefix`)."""
    mixers = _token_mixers(module, layer, prefix)
    if not mixers:
        return False
    above_attention = {c for chain in _attention_chains(module, layer) for c in chain[1:]}  # a mixer around attention
    held = [c for c in _built_classes(module, layer, "__init__") if c not in above_attention
            and (MIXER_PATTERN.search(c.__name__.removeprefix(prefix)) or _token_mixers(module, c, prefix))]
    covered = {c.__name__ for c in held} | {m for c in held for m in _token_mixers(module, c, prefix)}
    loose = [m for m in mixers if m not in covered]
    if loose:
        raise refuse(f"{layer.__name__} holds a token mixer other than softmax attention: {', '.join(loose)}",
                     "a mixer runs per sequence only as a module of its own that dispatches no attention; this one "
                     "sits in the decoder layer or in its attention")
    for cls in held:
        try:
            call = mixer_call(cls)
        except ValueError as exc:
            raise refuse(f"{cls.__name__} cannot run per sequence", str(exc)) from None
        if all(c.cls != call.cls for c in out):
            out.append(call)
    return True


def _dispatch_call(cls: type) -> tuple[ast.FunctionDef, ast.Call] | None:
    """``cls.forward`` and its call of the attention function: a name assigned from an expression reading
    ``ALL_ATTENTION_FUNCTIONS`` (with or without ``eager_attention_forward``); None when it has none, or several
    that differ in more than the value passed."""
    fn = _method(cls, "forward")
    if fn is None:
        return None
    names = set()
    for node in ast.walk(fn):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name) and "ALL_ATTENTION_FUNCTIONS" in ast.unparse(node.value):
                names.add(target.id)
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in names]
    # several calls (DiffLlama: one per half of the values) read as one when they differ in the value alone
    same = {(ast.unparse(c.func), *(ast.unparse(a) for i, a in enumerate(c.args) if i != 3),
             *(ast.unparse(k) for k in c.keywords)) for c in calls}
    return (fn, calls[0]) if calls and len(same) == 1 else None


def _inputs_required(lm: type) -> tuple[str, ...]:
    """Parameters of ``lm.forward`` besides the tokens (``input_ids``, ``inputs_embeds``) that it raises without: a
    top-level ``if <p> is None [or ...]: raise`` (Gemma 4's assistant: ``shared_kv_states``)."""
    fn = _method(lm, "forward")
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs} - {"input_ids", "inputs_embeds"} if fn else set()
    found: list[str] = []
    for node in fn.body if fn is not None else ():
        if isinstance(node, ast.If) and any(isinstance(b, ast.Raise) for b in node.body):
            tests = node.test.values if isinstance(node.test, ast.BoolOp) and isinstance(node.test.op, ast.Or) else [
                node.test]
            found += [t.left.id for t in tests if isinstance(t, ast.Compare) and isinstance(t.left, ast.Name)
                      and t.left.id in params and ast.unparse(t).endswith(" is None")]
    return tuple(dict.fromkeys(found))


def _layer_loop_names(fn: ast.FunctionDef) -> set[str]:
    """The loop variables of ``for layer in self.<...>`` loops in ``fn``."""
    names: set[str] = set()
    for loop in (n for n in ast.walk(fn) if isinstance(n, ast.For) and "self." in ast.unparse(n.iter)):
        targets = loop.target.elts if isinstance(loop.target, ast.Tuple) else [loop.target]
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _layer_calls_without_kwargs(text: type) -> str:
    """The source of a decoder-layer call in ``text.forward`` that passes no ``**kwargs`` ("" when every call found
    does): calls of the loop variable of ``for layer in self.<...>`` loops. Found none: "" (nothing to prove wrong)."""
    fn = _method(text, "forward")
    if fn is None:
        return ""
    names = _layer_loop_names(fn)
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in names]
    bad = [c for c in calls if not any(k.arg is None for k in c.keywords)]
    return ast.unparse(bad[0].func) + "(...)" if bad else ""


def _checkpointed_layer_calls_without_kwargs(text: type) -> str:
    """The source of a gradient-checkpointed decoder-layer call in ``text.forward`` that passes no ``**kwargs`` (""
    when none): ``self._gradient_checkpointing_func(layer.__call__, hidden_states, ...)`` of a layer loop's variable,
    the releases before transformers' ``GradientCheckpointingLayer`` (Mllama's text model on 4.53-4.54). Its plain
    call passes them: only under checkpointing do the layers get no context, which a pre-hook then hands them."""
    fn = _method(text, "forward")
    if fn is None:
        return ""
    names = _layer_loop_names(fn)
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "_gradient_checkpointing_func" and n.args
             and any(isinstance(x, ast.Name) and x.id in names for x in ast.walk(n.args[0]))]
    bad = [c for c in calls if not any(k.arg is None for k in c.keywords)]
    return f"{ast.unparse(bad[0].func)}({ast.unparse(bad[0].args[0])}, ...)" if bad else ""


def _passes_kwargs(holder: type, child: type) -> bool:
    """Whether ``holder.forward`` passes ``**kwargs`` on to every attribute of ``self`` holding a ``child`` (called
    as ``self.attr(...)`` or ``self.attr[i](...)``, an ``nn.ModuleList`` of them), and calls at least one."""
    fn = _method(holder, "forward")
    module = importlib.import_module(holder.__module__)
    attrs = {name for name, classes in _assigned_classes(module, holder, "__init__") if child in classes}
    if fn is None or not attrs:
        return False
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and _self_attr(n.func) in attrs]
    return bool(calls) and all(any(k.arg is None for k in c.keywords) for c in calls)


def _self_attr(func: ast.expr) -> str | None:
    """``attr`` of a call's function ``self.attr`` or ``self.attr[i]``; None for anything else."""
    func = func.value if isinstance(func, ast.Subscript) else func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
        return func.attr
    return None


def _delegates(wrapper: type, inner: type) -> bool:
    """Whether ``wrapper.forward`` only returns ``self.<attr>(*args, **kwargs)`` of an attribute holding ``inner``."""
    fn = _method(wrapper, "forward")
    module = importlib.import_module(wrapper.__module__)
    attrs = {name for name, classes in _assigned_classes(module, wrapper, "__init__") if inner in classes}
    body = [b for b in fn.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))] if fn else []
    call = body[0].value if len(body) == 1 and isinstance(body[0], ast.Return) else None
    return (fn is not None and isinstance(call, ast.Call) and _self_attr(call.func) in attrs
            and not isinstance(call.func, ast.Subscript) and fn.args.vararg is not None and fn.args.kwarg is not None
            and [ast.unparse(a) for a in call.args] == [f"*{fn.args.vararg.arg}"]
            and [(k.arg, ast.unparse(k.value)) for k in call.keywords] == [(None, fn.args.kwarg.arg)])


_ROW_POSITIONS = re.compile(r"torch\.arange\(seq_length, device=\w+\.device\) \+ (cache_length|past_key_values_length)")


@functools.cache
def positions_from_row(text: type) -> str | None:
    """The attribute of the module to which ``text.forward`` (a text model's forward without a ``position_ids``
    parameter) passes ``position_ids=position_ids`` where it counted them over the row itself (Bart's decoder:
    ``position_ids = torch.arange(seq_length, ...) + cache_length``, unconditionally, used for nothing else); None
    otherwise. A packed forward hands that module the positions of each token in its sequence instead
    (`tfcompat.hf.patching`)."""
    fn = _method(text, "forward")
    if fn is None or "position_ids" in {a.arg for a in fn.args.args + fn.args.kwonlyargs}:
        return None
    counted = [b for b in fn.body if isinstance(b, ast.Assign) and [ast.unparse(t) for t in b.targets]
               == ["position_ids"] and _ROW_POSITIONS.fullmatch(ast.unparse(b.value))]
    stores = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == "position_ids"
                     and isinstance(n.ctx, ast.Store)), key=lambda n: n.lineno)
    if len(counted) != 1 or len(stores) > 2 or stores[0].lineno != counted[0].lineno:
        return None
    # a second store may hold the embedding itself (Blenderbot: position_ids = self.embed_positions(...)): the
    # positions are read up to it, the name means the embedding after it
    restore = next((b for b in ast.walk(fn) if isinstance(b, ast.Assign) and len(stores) == 2
                    and stores[1] in b.targets), None)
    if len(stores) == 2 and (restore is None or not isinstance(restore.value, ast.Call)):
        return None
    end = restore.value.end_lineno or restore.lineno if restore is not None else None
    loads = {id(n) for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == "position_ids"
             and isinstance(n.ctx, ast.Load) and (end is None or n.lineno <= end)}
    uses = [(c, k) for c in ast.walk(fn) if isinstance(c, ast.Call) for k in c.keywords if id(k.value) in loads]
    attrs = {_self_attr(c.func) for c, k in uses if k.arg == "position_ids" and not isinstance(c.func, ast.Subscript)}
    if len(uses) != len(loads) or len(attrs) != 1 or None in attrs:
        return None
    if restore is not None and _self_attr(cast(ast.Call, restore.value).func) not in attrs:
        return None
    return attrs.pop()


@functools.cache
def positions_module_from_row(text: type) -> str | None:
    """The attribute of the positions module that ``text.forward`` (without a ``position_ids`` parameter) calls
    without position ids (or with the row index, ``position_ids=cache_position``), so that the module counts them
    over the row itself, where every class it may hold takes
    them instead: ``forward(..., position_ids=None)`` reading ``if position_ids is None: <count over the row> else:
    position_ids = position_ids.unsqueeze(0)`` (MVP's and TrOCR's learned positions: `takes_row_positions`; where
    the attribute may hold another class, TrOCR's sinusoidal positions, ``patch()`` checks the module built); None
    otherwise. A packed
    forward hands that module the positions of each token in its sequence (`tfcompat.hf.patching`, as for
    `positions_from_row`)."""
    fn = _method(text, "forward")
    if fn is None or "position_ids" in {a.arg for a in fn.args.args + fn.args.kwonlyargs}:
        return None
    module = importlib.import_module(text.__module__)
    for attr, classes in _assigned_classes(module, text, "__init__"):
        calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and _self_attr(c.func) == attr]
        # no position ids passed, or the row index (4.57 Bart: position_ids=cache_position): replaced by the hook
        if not calls or not classes or any(isinstance(c.func, ast.Subscript) or any(
                k.arg is None or (k.arg == "position_ids" and ast.unparse(k.value) != "cache_position")
                for k in c.keywords) for c in calls):
            continue
        if any(takes_row_positions(cls) for cls in classes):  # the module a model holds is checked at patch()
            return attr
    return None


def takes_row_positions(cls: type) -> bool:
    """Whether ``cls.forward`` takes ``position_ids=None`` and then counts them over the row, else reads them as
    ``position_ids.unsqueeze(0)`` (`positions_module_from_row`)."""
    fn = _method(cls, "forward")
    if fn is None:
        return False
    params = fn.args.args[1:]
    defaults = dict(zip([a.arg for a in params][len(params) - len(fn.args.defaults):], fn.args.defaults))
    if "position_ids" not in defaults or ast.unparse(defaults["position_ids"]) != "None":
        return False
    return any(isinstance(n, ast.If) and ast.unparse(n.test) == "position_ids is None"
               and [ast.unparse(b) for b in n.orelse] == ["position_ids = position_ids.unsqueeze(0)"]
               for n in fn.body)


def cross_attrs(layer: type, attention: type) -> tuple[str, ...]:
    """The attributes of ``layer`` (a decoder layer class) holding ``attention`` that its forward calls only inside
    ``if encoder_hidden_states is not None`` (cross-attention: Bart's ``encoder_attn``, the self-attention's class
    with keys and values from the encoder; never called on a packed row, which takes no encoder states)."""
    fn = _method(layer, "forward")
    module = importlib.import_module(layer.__module__)
    attrs = {name for name, classes in _assigned_classes(module, layer, "__init__") if attention in classes}
    if fn is None:
        return ()
    guarded: set[int] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "encoder_hidden_states is not None":
            guarded |= {id(n) for b in node.body for n in ast.walk(b)}
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and _self_attr(n.func) in attrs]
    return tuple(sorted(a for a in attrs if any(_self_attr(c.func) == a for c in calls)
                        and all(id(c) in guarded for c in calls if _self_attr(c.func) == a)))


def _attention_chains(module: Any, layer: type) -> list[tuple[type, ...]]:
    """Each path ``(layer, ..., attention)`` of classes built in ``__init__``, from a decoder layer down to a class
    dispatching through ``ALL_ATTENTION_FUNCTIONS``, at most `_DEPTH` levels down (dbrx: ``DbrxBlock.norm_attn_norm
    .attn``; BERT: ``BertLayer.attention.self``)."""
    chains: list[tuple[type, ...]] = []

    def walk(chain: tuple[type, ...]) -> None:
        for child in _built_classes(module, chain[-1], "__init__"):
            if child in chain:
                continue
            if _dispatch_call(child) is not None:
                chains.append((*chain, child))
            elif len(chain) < _DEPTH:
                walk((*chain, child))

    walk((layer,))
    return chains


def _skips_cross_layers(text: type, holding: list[type]) -> bool:
    """Whether ``text.forward`` skips every layer of the ``holding`` classes (those holding cross-attention) when it
    is given no cross states: its layer loop ``continue``s under ``<i> in self.<list> and <cross param> is None``
    (and terms on the cache, empty in a packed forward), and ``text.__init__`` builds the ``holding`` classes only
    under ``<i> in self.<list>`` (Mllama: ``idx in self.cross_attention_layers``)."""
    init, fn = _method(text, "__init__"), _method(text, "forward")
    if init is None or fn is None or not holding:
        return False
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs} & set(_CROSS_PARAMS)
    names = {c.__name__ for c in holding}
    built = [n for n in ast.walk(init) if isinstance(n, ast.If) and any(
        isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in names for b in n.body
        for c in ast.walk(b))]
    lists = {ast.unparse(n.test.comparators[0]) for n in built if isinstance(n.test, ast.Compare)
             and isinstance(n.test.ops[0], ast.In) and ast.unparse(n.test.comparators[0]).startswith("self.")}
    if len(lists) != 1 or not all(isinstance(n.test, ast.Compare) and isinstance(n.test.ops[0], ast.In) for n in built):
        return False
    listed = lists.pop()
    local = {t.id: ast.unparse(n.value) for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Name)}
    for node in ast.walk(fn):
        if not (isinstance(node, ast.If) and [type(b) for b in node.body] == [ast.Continue]
                and isinstance(node.test, ast.BoolOp) and isinstance(node.test.op, ast.And)):
            continue
        terms = [local.get(ast.unparse(v), ast.unparse(v)) if isinstance(v, ast.Name) else ast.unparse(v)
                 for v in node.test.values]
        member = [t for t in terms if t.endswith(f" in {listed}")]
        unset = [t for t in terms if t in {f"{p} is None" for p in params}]
        if member and unset and all(t in member or t in unset or any(c in t for c in _CACHE_PARAMS) for t in terms):
            return True
    return False


def _is_cross_attention(cls: type) -> bool:
    """Whether ``cls.forward`` takes encoder states (its keys and values come from another sequence)."""
    fn = _method(cls, "forward")
    return fn is not None and any(a.arg in _CROSS_PARAMS for a in fn.args.args + fn.args.kwonlyargs)


def _position_modules_without_ids(module: Any, owner: type) -> str:
    """What ``owner.forward`` does with positions that a packed row cannot take ("" = nothing): a call of a module
    attribute whose forward takes ``position_ids`` without passing the forward's ``position_ids``, or one whose
    default positions (``if position_ids is None``) are offset by a padding index (fairseq-style learned positions
    counting from ``padding_idx + 1``: position ids restarting at 0 would shift them)."""
    fn = _method(owner, "forward")
    if fn is None:
        return ""
    holders = {name: classes for name, classes in _assigned_classes(module, owner, "__init__")}
    for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
        attr = _self_attr(call.func)
        for cls in holders.get(attr or "", []):
            forward = _method(cls, "forward")
            params = [a.arg for a in forward.args.args[1:]] if forward is not None else []
            if "position_ids" not in params:
                continue
            given = [a for i, a in enumerate(call.args) if i < len(params) and params[i] == "position_ids"]
            given += [k.value for k in call.keywords if k.arg == "position_ids"]
            if not any(isinstance(n, ast.Name) and n.id == "position_ids" for g in given for n in ast.walk(g)):
                return f"calls self.{attr} ({cls.__name__}) without position_ids"
            defaults = [n for n in ast.walk(cast(ast.AST, forward)) if isinstance(n, ast.If)
                        and ast.unparse(n.test) == "position_ids is None"]
            if any("padding_idx" in ast.unparse(b) for n in defaults for b in n.body) and _own_methods(cls) is None:
                return (f"calls self.{attr} ({cls.__name__}), whose positions default to counting from its "
                        "padding_idx + 1 in a way tfcompat does not recognize")
    return ""


class PositionsCall(NamedTuple):
    """How a positions module computes one sequence's default positions: ``function`` (a method of the module, or a
    function of its module's source file where ``method`` is False) called with ``args``, each a role: ``"tokens"``
    (the ids or the embeddings, ``(1, L[, D])``), ``"padding"`` (the module's ``padding_idx``), ``"cache"`` (the
    cache length, 0)."""

    function: str
    method: bool
    args: tuple[str, ...]


class OwnPositions(NamedTuple):
    """A text model's module whose default positions are its own, not 0, 1, ... (RoBERTa's fairseq-style learned
    positions, Kosmos-2's sinusoidal ones: from ``padding_idx + 1``, skipping padding tokens): the packed forward
    computes them per sequence with the module's own calls and passes them as ``position_ids``.

    attr: the text model's attribute holding it; from_ids / from_embeds: the calls computing them from ``input_ids``
    / ``inputs_embeds`` of one sequence ``(1, L)``, returning its ``(1, L)`` positions (with no cache).
    """

    attr: str
    from_ids: PositionsCall
    from_embeds: PositionsCall


def own_positions(text: type, depth: int = 2) -> OwnPositions | None:
    """The module of ``text`` (a text model class) whose positions default to its own calls when it is given no
    ``position_ids`` (`OwnPositions`), or None: an attribute of ``text``, else one of the model of one class it
    builds (``depth`` deep: Kosmos-2's causal LM holds the transformer holding them, ``attr`` then dotted,
    ``"model.embed_positions"``)."""
    module = importlib.import_module(text.__module__)
    assigned = _assigned_classes(module, text, "__init__")
    for name, classes in assigned:
        calls = next((m for m in map(_own_methods, classes) if m is not None), None)
        if calls is not None:
            return OwnPositions(name, *calls)
    inner = [(name, classes[0]) for name, classes in assigned if len(classes) == 1
             and issubclass(classes[0], torch.nn.Module)] if depth > 1 else []
    found = [(name, own) for name, cls in inner for own in [own_positions(cls, depth - 1)] if own is not None]
    return found[0][1]._replace(attr=f"{found[0][0]}.{found[0][1].attr}") if len(found) == 1 else None


def _own_methods(cls: type) -> tuple[PositionsCall, PositionsCall] | None:
    """``(from_ids, from_embeds)`` where every assignment of ``position_ids`` in ``cls.forward`` sits under ``if
    position_ids is None`` and is one call reading ``input_ids`` or ``inputs_embeds`` (one each), ``self.padding_idx``
    and the cache length (a parameter defaulting to 0), optionally moved ``.to(<tokens>.device)``: RoBERTa's
    ``if position_ids is None: if input_ids is not None: position_ids = self.<from_ids>(input_ids, self.padding_idx,
    past_key_values_length) else: ...``, Kosmos-2's ``if input_ids is not None: ... if position_ids is None: ...``
    (4.x: a function of the module for the ids, the embeddings' method reading its own padding index); else None."""
    fn = _method(cls, "forward")
    if fn is None:
        return None
    params = fn.args.args[1:]
    defaults = dict(zip([a.arg for a in params][len(params) - len(fn.args.defaults):], fn.args.defaults))
    caches = {name for name, d in defaults.items() if isinstance(d, ast.Constant) and d.value == 0}
    guarded = {id(n) for g in ast.walk(fn) if isinstance(g, ast.If) and ast.unparse(g.test) == "position_ids is None"
               for b in g.body for n in ast.walk(b)}
    assigns = [n for n in ast.walk(fn) if isinstance(n, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "position_ids" for t in n.targets)]
    calls: dict[str, PositionsCall] = {}
    for node in assigns:
        call = _positions_call(node, caches)
        if id(node) not in guarded or [ast.unparse(t) for t in node.targets] != ["position_ids"] or call is None:
            return None
        source, found = call
        if source in calls or (found.method and not callable(getattr(cls, found.function, None))):
            return None
        calls[source] = found
    return (calls["input_ids"], calls["inputs_embeds"]) if calls.keys() == {"input_ids", "inputs_embeds"} else None


def _positions_call(node: ast.Assign, caches: set[str]) -> tuple[str, PositionsCall] | None:
    """``(tokens source, call)`` of ``position_ids = <call>(...)[.to(<source>.device)]`` (`_own_methods`), or None."""
    value = node.value
    if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "to"
            and isinstance(value.func.value, ast.Call)):
        value = value.func.value  # .to(input_ids.device): the device the sequence's ids are on already
    if not isinstance(value, ast.Call) or value.keywords:
        return None
    method = _self_attr(value.func)
    function = method if method is not None and not isinstance(value.func, ast.Subscript) else (
        value.func.id if isinstance(value.func, ast.Name) else None)
    roles = {"self.padding_idx": "padding", **dict.fromkeys(caches, "cache"),
             "input_ids": "tokens", "inputs_embeds": "tokens"}
    args = tuple(roles.get(ast.unparse(a), "") for a in value.args)
    sources = [ast.unparse(a) for a in value.args if ast.unparse(a) in ("input_ids", "inputs_embeds")]
    if function is None or "" in args or args.count("tokens") != 1 or len(sources) != 1:
        return None
    return sources[0], PositionsCall(function, method is not None, args)


def _row_position_guards(fn: ast.FunctionDef) -> tuple[str, ...]:
    """The ``if`` tests (joined with ``and``; "" = none) guarding each place where ``fn`` computes with
    ``cache_position`` or ``torch.arange`` (positions counted over the row). Passing ``cache_position`` on (a dict
    value, a keyword argument: the cache update) or testing it against None is not computing with it."""
    passed: set[int] = set()  # cache_position passed on or tested against None, not computed with
    for node in ast.walk(fn):
        if isinstance(node, ast.Dict):
            passed |= {id(v) for v in node.values if v is not None}
        elif isinstance(node, ast.Call):
            passed |= {id(k.value) for k in node.keywords}
        elif isinstance(node, ast.Compare) and all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            passed |= {id(node.left), *map(id, node.comparators)}
    guards: list[str] = []

    def visit(node: ast.AST, tests: tuple[str, ...]) -> None:
        if isinstance(node, ast.If):
            visit(node.test, tests)
            for child in node.body:
                visit(child, (*tests, f"({ast.unparse(node.test)})"))
            for child in node.orelse:
                visit(child, (*tests, f"(not ({ast.unparse(node.test)}))"))
            return
        reads = ((isinstance(node, ast.Name) and node.id == "cache_position" and id(node) not in passed)
                 or (isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.arange"))
        if reads:
            guards.append(" and ".join(tests))
        for sub in ast.iter_child_nodes(node):
            visit(sub, tests)

    for statement in fn.body:
        visit(statement, ())
    return tuple(dict.fromkeys(guards))


# -- evaluation on a module ----------------------------------------------------------------------------------------

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: operator.pow, ast.FloorDiv: operator.floordiv,
}
_COMPARE: dict[type, Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Is: operator.is_, ast.IsNot: operator.is_not,
    ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}


def _evaluate(expr: str, module: Any, training: bool) -> Any:
    """``expr`` (source of the attention forward) evaluated with ``self`` = ``module``; `UNKNOWN` when it reads a
    local, a parameter or a call other than ``getattr`` / ``hasattr`` / ``len``. Cache parameters read as None (a
    packed forward passes no cache)."""
    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id == "self":
                return module
            return None if node.id in _CACHE_PARAMS else UNKNOWN
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr == "training":
                return training
            obj = ev(node.value)
            return UNKNOWN if obj is UNKNOWN else getattr(obj, node.attr, UNKNOWN)
        if isinstance(node, ast.Subscript):
            obj, key = ev(node.value), ev(node.slice)
            if obj is UNKNOWN or key is UNKNOWN:
                return UNKNOWN
            try:
                return obj[key]
            except (LookupError, TypeError):
                return UNKNOWN
        if isinstance(node, ast.IfExp):
            test = ev(node.test)
            return UNKNOWN if test is UNKNOWN else ev(node.body if test else node.orelse)
        if isinstance(node, ast.BoolOp):  # short-circuits as Python does; an unknown operand it reaches is unknown
            value: Any = None
            for operand in node.values:
                value = ev(operand)
                if value is UNKNOWN or (not value if isinstance(node.op, ast.And) else value):
                    return value
            return value
        if isinstance(node, ast.UnaryOp):
            value = ev(node.operand)
            if value is UNKNOWN:
                return UNKNOWN
            return (not value) if isinstance(node.op, ast.Not) else -value if isinstance(node.op, ast.USub) else UNKNOWN
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            return UNKNOWN if UNKNOWN in (left, right) else _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
            left, right = ev(node.left), ev(node.comparators[0])
            return UNKNOWN if left is UNKNOWN or right is UNKNOWN else _COMPARE[type(node.ops[0])](left, right)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
            fns: dict[str, Callable[..., Any]] = {"getattr": getattr, "hasattr": hasattr, "len": len}
            args = [ev(a) for a in node.args]
            if node.func.id in fns and all(a is not UNKNOWN for a in args):
                return fns[node.func.id](*args)
        return UNKNOWN

    return ev(ast.parse(expr, mode="eval").body)


# -- config --------------------------------------------------------------------------------------------------------

def _config_class(model_type: str) -> str:
    names = importlib.import_module("transformers.models.auto.configuration_auto").CONFIG_MAPPING_NAMES
    return cast(str, names[model_type])


def _config_fields(config: str | type) -> set[str]:
    """The keys a config class (or its name in transformers' namespace) takes (its ``__init__`` parameters, or its
    dataclass fields on 5.x)."""
    cls: Any = getattr(importlib.import_module("transformers"), config) if isinstance(config, str) else config
    fields = set(inspect.signature(cls.__init__).parameters)
    return fields | set(getattr(cls, "__dataclass_fields__", {})) | set(getattr(cls, "__annotations__", {}))


_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0)


def _tiny_config(config: str | type, entry: Entry) -> tuple[str, dict[str, Any]]:
    """A tiny config of a derived family: the common size keys its config class takes (the self-check's model;
    families with more size keys need them shrunk by the caller)."""
    fields = _config_fields(config)
    return config if isinstance(config, str) else config.__name__, {k: v for k, v in _TINY.items() if k in fields}


def layer_kind(config: Any, index: int | None) -> str | None:
    """``config.layer_types[index]`` where the config has layer types (None otherwise)."""
    types = getattr(config, "layer_types", None) or ()
    return types[index] if isinstance(index, int) and 0 <= index < len(types) else None
