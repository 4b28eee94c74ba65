"""Deriving an encoder-decoder vision-language entry from the installed transformers: an encoder (a vision tower, or
a text encoder over image features and a prompt: Florence-2's) whose states a decoder of a text family tfcompat
patches reads through cross-attention (VisionEncoderDecoder's Donut / TrOCR / Nougat decoders, Florence-2's BART
decoder, PP-FormulaNet's).

The packed row is the decoder's: the decoder tokens of ``N`` sequences back to back ``(1, sum L_dec)``, position ids
restarting at 0 per sequence. The encoder runs stock on the ``N`` sequences' encoder inputs as a batch (images are
independent; a bidirectional text encoder runs right-padded with its attention mask), and the decoder's
cross-attention reads each sequence's own encoder states only (`tfcompat.core.cross_attention`). What is read from the
source, with `ast`: the one call in the owner's forward (the model's, or its base model's) of a submodule with
``encoder_hidden_states=`` (the decoder), the ids it hands it (``input_ids=decoder_input_ids``), how position ids reach
it (a ``position_ids=`` keyword, the forward's ``**kwargs``, or its ``decoder_``-prefixed kwargs stripped of the prefix:
learned absolute positions need restarting position ids to reach them, so a decoder they cannot reach is refused),
the encoder mask it hands it, the one encoder call besides, and the function the forward builds decoder ids from
labels with (which `tfcompat.pack` runs per sequence: shifted over the whole row, a sequence would start with the
last label of the one before). What cannot be proved is refused with a `PatchError` naming it.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..errors import PatchError, TfcompatError
from . import versions
from .derive import _attention_chains, _built_classes, _layer_classes, _method
from .records import TEXT_MODULE_ROLES, EncoderDecoderDerivation, Entry, Family

__all__ = ["decoder_call", "derive", "is_encoder_decoder"]

_CROSS = "encoder_hidden_states"


def decoder_call(cls: type) -> ast.Call | None:
    """The one call in ``cls.forward`` of a submodule (``self.<path>(...)``) given ``encoder_hidden_states=``: the
    decoder's; None where there is none or several."""
    fn = _method(cls, "forward")
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func).startswith("self.")
             and any(k.arg == _CROSS for k in n.keywords)] if fn is not None else []
    return calls[0] if len(calls) == 1 else None


def _owner(top: type, module: Any) -> tuple[type, str] | None:
    """``(owner, attribute from top)``: ``top`` itself where its forward calls a decoder with encoder states, else
    the one class built at its base model prefix whose forward does (Florence-2's ``model``)."""
    if decoder_call(top) is not None:
        return top, ""
    prefix = getattr(top, "base_model_prefix", "")
    inner = _built_classes(module, top, "__init__", attr=prefix) if prefix else []
    return (inner[0], prefix) if len(inner) == 1 and decoder_call(inner[0]) is not None else None


def is_encoder_decoder(top: type) -> bool:
    """Whether ``top`` (a vision-language class) or its base model calls a decoder with encoder states."""
    return _owner(top, importlib.import_module(top.__module__)) is not None


def derive(model_type: str, version: str, top: type, text_type: str | None,
           text_entry: Callable[[str, type | None], Entry]) -> Family:
    """The family of the encoder-decoder vision-language class ``top`` (of ``model_type``) whose decoder is of the
    text type ``text_type`` (its decoder config's ``model_type``), on the installed transformers (reported as
    ``version``). text_entry: as `tfcompat.registry.derive_vision.derive`'s. Raises `PatchError` naming what is
    missing."""
    module = importlib.import_module(top.__module__)

    def refuse(what: str, why: str, fix: str = "") -> PatchError:
        return PatchError(f"cannot derive {model_type}: {what}", family=model_type, transformers_version=version,
                          why=why, supported="encoder-decoder vision-language models whose decoder is a text model "
                          "tfcompat patches, reached with its ids and position ids (by keyword, **kwargs or "
                          "decoder_-prefixed **kwargs) from the model's forward, its cross-attention through the "
                          "attention interface", fix=fix or "run it unpatched (padded)")

    found = _owner(top, module)
    if found is None:
        raise refuse(f"{top.__name__}.forward calls no one decoder with encoder states", "no encoder-decoder shape")
    owner, owner_attr = found
    call = decoder_call(owner)
    fn = _method(owner, "forward")
    if call is None or fn is None:
        raise refuse(f"{owner.__name__}.forward cannot be read", "no source")
    decoder = ast.unparse(call.func).removeprefix("self.")
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    var_kw = fn.args.kwarg.arg if fn.args.kwarg is not None else None
    keywords = {k.arg: k.value for k in call.keywords if k.arg is not None}
    spread = [k.value for k in call.keywords if k.arg is None]
    ids = keywords.get("input_ids")
    if not (isinstance(ids, ast.Name) and ids.id in params):
        raise refuse(f"{owner.__name__}.forward hands {decoder} no ids of its own parameter",
                     f"input_ids={ast.unparse(ids) if ids is not None else 'nothing'}: the packed decoder row must be "
                     "the caller's")
    positions = _positions_key(fn, keywords, spread, params, var_kw)
    if not positions:
        raise refuse(f"{owner.__name__}.forward passes {decoder} no position ids (neither position_ids=, **kwargs nor "
                     "decoder_-prefixed kwargs)", "a packed decoder row needs position ids restarting at 0 per "
                     "sequence to reach the decoder (its positions would otherwise run across sequences)")
    module_built = _built_classes(module, owner, "__init__", attr=decoder) if "." not in decoder else []
    # the class the owner builds its decoder from (PP-FormulaNet's text model; BLIP's imported text decoder)
    decoder_cls = module_built[0] if len(module_built) == 1 else _imported_class(module, owner, decoder)
    decoder_loss = _decoder_loss(keywords, params, decoder_cls)
    extra = sorted(k for k in set(keywords) - _DECODER_KEYWORDS if not (k in _LOSS_KEYWORDS and decoder_loss)
                   and not (k == "logits_to_keep" and _is_param(keywords[k], params)))
    if extra:
        raise refuse(f"{owner.__name__}.forward passes {', '.join(extra)} to {decoder}",
                     "the decoder would compute more than its logits from the packed row (a loss over the row it "
                     "does not shift by labels[:, 1:], a reduction per row), or take inputs a packed row does not "
                     "carry", fix="run it unpatched (padded), or compute the loss from the packed logits")
    mask = _encoder_mask(fn, keywords.get("encoder_attention_mask"), params)
    if mask is None:
        raise refuse(f"{owner.__name__}.forward hands {decoder} an encoder mask it computes itself",
                     f"encoder_attention_mask={ast.unparse(keywords['encoder_attention_mask'])}: the packed "
                     "encoder states are read by the caller's mask only")
    encoders = sorted({p for n in ast.walk(fn) if isinstance(n, ast.Call)
                       for p in [ast.unparse(n.func).removeprefix("self.")]
                       if ast.unparse(n.func).startswith("self.") and p.split(".")[-1] == "encoder" and p != decoder})
    if not encoders:  # a tower of another name (BLIP's vision_model): the call the encoder states come from
        traced = _states_source(fn, keywords[_CROSS])
        encoders = [traced] if traced and traced != decoder else []
    if len(encoders) != 1:
        raise refuse(f"{owner.__name__}.forward calls {len(encoders)} encoders", "tfcompat runs the one encoder "
                     "stock on the sequences' encoder inputs as a batch; it must be one submodule call")
    if owner is not top:
        gap = _hands_down(top, owner_attr, ids.id, positions)
        if gap:
            raise refuse(gap, "the decoder's ids and position ids must reach the owner's forward unchanged")
    if text_type is None:
        raise refuse("its config names no decoder model type", "no decoder config")
    if text_type == model_type:  # 5.9's PP-FormulaNet: its text config is of its own type
        raise refuse(f"its decoder's config is of its own type, {text_type}",
                     "the decoder is not built from a separate text family's config")
    merged = _merged_attention(decoder_cls) if decoder_cls is not None else None
    if merged is not None:
        raise refuse(f"its decoder's attention {merged.__name__} is self- and cross-attention in one softmax",
                     "its keys are the decoder's own causal prefix and the encoder states concatenated (torch.cat "
                     "of both keys), normalized together; tfcompat's cross-attention core attends to a sequence's "
                     "encoder states in a softmax of their own, so a packed row would differ",
                     fix="run it unpatched, one sequence per row (padded batches)")
    try:
        text = text_entry(text_type, decoder_cls)
    except TfcompatError as exc:
        raise refuse(f"its decoder {text_type} is not a text family tfcompat patches",
                     f"{type(exc).__name__}: {exc.what}" + (f" ({exc.why})" if exc.why else ""),
                     fix=exc.fix or "run it unpatched (padded)") from None
    derivation = EncoderDecoderDerivation(
        model=top.__name__, owner=owner.__name__, owner_attr=owner_attr, decoder=decoder, encoder=encoders[0],
        text_family=text_type, decoder_ids=ids.id, decoder_positions=positions, encoder_mask=mask,
        labels_shift=_labels_shift(top, ids.id), labels_loss=decoder_loss or _labels_loss(top),
        decoder_mask=_decoder_mask(keywords.get("attention_mask"), params),
        logits_to_keep=ast.unparse(keywords["logits_to_keep"]) if "logits_to_keep" in keywords else "")
    release = versions.parse(version).release
    entry = replace(
        text, family=model_type,
        versions=versions.VersionRange(f"{release[0]}.{release[1]}", f"{release[0]}.{release[1] + 1}"),
        module=module.__name__, text_module=text.module_of("text_model"),
        classes={**{r: text.classes[r] for r in TEXT_MODULE_ROLES if r in text.classes},
                 "model": owner.__name__, "for_causal_lm": top.__name__},
        vision=None, rope_index_deviations=(), known_issues=(), derived_vision=None, encoder_decoder=derivation,
        why=f"derived from {module.__name__} on transformers {version} as an encoder-decoder model; decoder as "
        f"{text_type}'s {text.versions} entry")
    return Family(key=model_type, entries=(entry,), tiny_config=lambda e: ("", {}))


# what the owner may hand its decoder by keyword: the ids, masks, encoder states, embeddings, cache and flags
_DECODER_KEYWORDS = frozenset({
    "input_ids", "attention_mask", "encoder_hidden_states", "encoder_attention_mask", "inputs_embeds", "position_ids",
    "cache", "past_key_values", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "cache_position",
})


# what the owner may hand a decoder that computes its own loss (`_decoder_loss`): the labels and a reduction over all
# of its tokens (``reduction="mean"``: one mean over the row's labelled tokens, per sequence alone a mean of its own)
_LOSS_KEYWORDS = frozenset({"labels", "reduction"})


def _is_param(value: ast.expr, params: set[str]) -> bool:
    return isinstance(value, ast.Name) and value.id in params


def _decoder_mask(value: ast.expr | None, params: set[str]) -> str:
    """The owner's parameter handed the decoder as ``attention_mask`` (BLIP's ``attention_mask``,
    VisionEncoderDecoder's ``decoder_attention_mask``), "" for none or anything else."""
    return value.id if value is not None and _is_param(value, params) and isinstance(value, ast.Name) else ""


def _decoder_loss(keywords: dict[str, ast.expr], params: set[str], decoder: type | None) -> str:
    """``"shifted"`` where the owner hands the decoder its ``labels`` parameter (and a ``reduction`` of ``"mean"`` or
    ``"sum"``, if any), and the decoder's forward (``decoder``: the class the owner builds it from) computes its loss
    from ``labels[:, 1:]`` (BLIP's ``BlipTextLMHeadModel``: the logits of token ``t`` against the label of ``t + 1``,
    over the whole row, label-smoothed); "" otherwise (the owner hands no labels, or in a form tfcompat does not
    read)."""
    labels, reduction = keywords.get("labels"), keywords.get("reduction")
    if labels is None or not _is_param(labels, params) or decoder is None:
        return ""
    if reduction is not None and not (isinstance(reduction, ast.Constant) and reduction.value in ("mean", "sum")):
        return ""
    fn = _method(decoder, "forward")
    shifted = fn is not None and any(
        isinstance(n, ast.Subscript) and ast.unparse(n) == "labels[:, 1:]"
        for n in ast.walk(fn))
    return "shifted" if shifted else ""


def _imported_class(module: Any, owner: type, attr: str) -> type | None:
    """The class ``owner.__init__`` assigns ``self.attr = Name(...)`` from, ``Name`` a class of ``module``'s namespace
    (imported: BLIP's ``BlipTextLMHeadModel`` comes from ``modeling_blip_text``); None otherwise."""
    fn = _method(owner, "__init__")
    values = [n.value for n in ast.walk(fn) if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets]
              == [f"self.{attr}"]] if fn is not None else []
    if len(values) != 1 or not isinstance(values[0], ast.Call) or not isinstance(values[0].func, ast.Name):
        return None
    cls = getattr(module, values[0].func.id, None)
    return cls if isinstance(cls, type) else None


def _states_source(fn: ast.FunctionDef, states: ast.expr) -> str:
    """The submodule path ``P`` whose call the encoder states handed the decoder come from: ``states`` is (a local
    assigned once as) ``out.<attr>`` or ``out[0]`` of a local ``out`` assigned once as ``self.P(...)`` (BLIP's
    ``image_embeds = vision_outputs.last_hidden_state``, ``vision_outputs = self.vision_model(...)``); "" otherwise."""
    def assigned(name: str) -> ast.expr | None:
        found = [n.value for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AnnAssign)) and [
            ast.unparse(t) for t in (n.targets if isinstance(n, ast.Assign) else [n.target])] == [name]]
        return found[0] if len(found) == 1 else None

    value = assigned(states.id) if isinstance(states, ast.Name) else states
    if isinstance(value, ast.Attribute) or (isinstance(value, ast.Subscript) and ast.unparse(value.slice) == "0"):
        out = value.value
        call = assigned(out.id) if isinstance(out, ast.Name) else None
        if isinstance(call, ast.Call) and ast.unparse(call.func).startswith("self."):
            return ast.unparse(call.func).removeprefix("self.")
    return ""


def _positions_key(fn: ast.FunctionDef, keywords: dict[str, ast.expr], spread: list[ast.expr], params: set[str],
                   var_kw: str | None) -> str:
    """The keyword the caller gives the decoder's position ids at ``fn`` (the owner's forward): the parameter passed
    as ``position_ids=``, ``position_ids`` where ``fn``'s own ``**kwargs`` go to the decoder, or
    ``<prefix>position_ids`` where the decoder takes a dict of ``fn``'s kwargs stripped of ``<prefix>``
    (VisionEncoderDecoder's ``{argument[len("decoder_"):]: value ... if argument.startswith("decoder_")}``); "" for
    none."""
    given = keywords.get("position_ids")
    if given is not None:
        return given.id if isinstance(given, ast.Name) and given.id in params else ""
    for value in spread:
        if isinstance(value, ast.Name) and value.id == var_kw:
            return "position_ids"
        built = [n.value for n in ast.walk(fn) if isinstance(n, ast.Assign) and isinstance(value, ast.Name)
                 and [ast.unparse(t) for t in n.targets] == [value.id]]
        if len(built) == 1 and isinstance(built[0], ast.DictComp):
            prefix = _stripped_prefix(built[0], var_kw)
            if prefix:
                return f"{prefix}position_ids"
    return ""


def _stripped_prefix(comp: ast.DictComp, var_kw: str | None) -> str:
    """``P`` of ``{k[len("P"):]: v for k, v in <var_kw>.items() if k.startswith("P")}``; "" for any other dict."""
    gen = comp.generators[0] if len(comp.generators) == 1 else None
    if gen is None or ast.unparse(gen.iter) != f"{var_kw}.items()" or len(gen.ifs) != 1:
        return ""
    test, key = gen.ifs[0], comp.key
    if not (isinstance(test, ast.Call) and isinstance(test.func, ast.Attribute) and test.func.attr == "startswith"
            and len(test.args) == 1 and isinstance(test.args[0], ast.Constant) and isinstance(test.args[0].value, str)):
        return ""
    prefix = test.args[0].value
    stripped = isinstance(key, ast.Subscript) and isinstance(key.slice, ast.Slice) and key.slice.upper is None and (
        ast.unparse(key.slice.lower) if key.slice.lower is not None else "") in (f"len({prefix!r})", str(len(prefix)))
    return prefix if stripped else ""


def _encoder_mask(fn: ast.FunctionDef, value: ast.expr | None, params: set[str]) -> str | None:
    """The owner's parameter handed the decoder as ``encoder_attention_mask``: "" for none (not passed, None, or a
    local only ever assigned None: VisionEncoderDecoder's), None for anything it computes."""
    if value is None or (isinstance(value, ast.Constant) and value.value is None):
        return ""
    if not isinstance(value, ast.Name):
        return None
    if value.id in params:
        return value.id
    assigned = [n.value for n in ast.walk(fn) if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets]
                == [value.id]]
    return "" if assigned and all(isinstance(v, ast.Constant) and v.value is None for v in assigned) else None


def _hands_down(top: type, attr: str, ids: str, positions: str) -> str:
    """What ``top.forward`` fails to hand its base model ``self.attr`` of the decoder's ids and positions ("" where
    it passes ``ids=ids`` and the positions, by name or in its ``**kwargs``)."""
    fn = _method(top, "forward")
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) == f"self.{attr}"] if (
        fn is not None) else []
    if len(calls) != 1:
        return f"{top.__name__}.forward calls self.{attr} {len(calls)} times"
    keywords = {k.arg: ast.unparse(k.value) for k in calls[0].keywords if k.arg is not None}
    var_kw = fn.args.kwarg.arg if fn is not None and fn.args.kwarg is not None else None
    spread = [ast.unparse(k.value) for k in calls[0].keywords if k.arg is None]
    if keywords.get(ids) != ids:
        return f"{top.__name__}.forward does not pass {ids}={ids} to self.{attr}"
    if keywords.get(positions) != positions and var_kw not in spread:
        return f"{top.__name__}.forward passes self.{attr} neither {positions} nor its **kwargs"
    return ""


def _labels_shift(top: type, ids: str) -> tuple[str, tuple[str, ...]] | tuple[()]:
    """``(function, argument sources)`` of ``ids = function(labels, ...)`` in ``top.forward`` (a function of its
    module, its other arguments attributes of ``self``); () where the forward builds no ids from the labels."""
    fn = _method(top, "forward")
    for n in ast.walk(fn) if fn is not None else ():
        if not (isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == [ids]
                and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name) and n.value.args
                and ast.unparse(n.value.args[0]) == "labels" and not n.value.keywords):
            continue
        rest = tuple(ast.unparse(a) for a in n.value.args[1:])
        if all(r.startswith("self.") and r.replace(".", "").replace("_", "").isalnum() for r in rest):
            return n.value.func.id, rest
    return ()


def _labels_loss(top: type) -> str:
    """How ``top.forward``'s loss reads ``labels`` (`EncoderDecoderDerivation.labels_loss`): ``"loss_function"``,
    ``"aligned"`` or "" (read from its ``loss = ...`` statements)."""
    fn = _method(top, "forward")
    forms = set()
    for n in ast.walk(fn) if fn is not None else ():
        if not (isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == ["loss"]
                and isinstance(n.value, ast.Call)):
            continue
        call = n.value
        keywords = {k.arg: ast.unparse(k.value) for k in call.keywords if k.arg is not None}
        if ast.unparse(call.func) == "self.loss_function" and "shift_labels" in keywords:
            forms.add("aligned")  # Florence-2, PP-FormulaNet: labels are the targets, not shifted again
        elif ast.unparse(call.func) == "self.loss_function" and keywords.get("labels") == "labels":
            forms.add("loss_function")
        elif any(ast.unparse(a) in ("labels.reshape(-1)", "labels.view(-1)") for a in call.args):
            forms.add("aligned")  # 5.x VisionEncoderDecoder: CrossEntropyLoss over the flat logits and labels
        else:
            forms.add("")
    return forms.pop() if len(forms) == 1 else ""


def _merged_attention(decoder: type) -> type | None:
    """The attention class of ``decoder``'s layers whose forward takes ``encoder_hidden_states`` and concatenates
    keys computed from them onto its own (``key_states = torch.cat([key_states, cross_key_states], dim=2)``,
    T5Gemma 2's ``T5Gemma2MergedAttention``: one softmax over self and cross keys); None where there is none."""
    module = importlib.import_module(decoder.__module__)
    for layer in _layer_classes(module, decoder):
        for chain in _attention_chains(module, layer):
            fn = _method(chain[-1], "forward")
            params = {a.arg for a in fn.args.args + fn.args.kwonlyargs} if fn is not None else set()
            if fn is not None and "encoder_hidden_states" in params and any(
                    isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == ["key_states"]
                    and isinstance(n.value, ast.Call) and ast.unparse(n.value.func) == "torch.cat"
                    for n in ast.walk(fn)):
                return chain[-1]
    return None
