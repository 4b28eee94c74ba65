"""Lookup and resolution: (family, installed transformers) -> `Resolved`, the symbols ready to patch.

`families` collects the family tables (`tfcompat.families`, built from `tfcompat.records`), `match` picks the
entry whose range holds a version, and `resolve` probes it (`tfcompat.probing`) on the installed release. A
version newer than every declared range resolves against the newest entry by probing, with a warning. A causal LM
without a written table (`derivable_types`) gets an entry derived from its modeling module on the installed
release (`tfcompat.registry.derive`); written tables win where they exist. A vision-language type derives in front
of its language model's family (`tfcompat.registry.derive_vision`): written, derived from a causal LM, the written
family whose text model it is, or derived from the text model class itself where its type has no causal LM.
"""

from __future__ import annotations

import difflib
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any, NamedTuple, TypeVar, cast

import torch

from ..errors import PatchError, TfcompatError, UnknownFamilyError, UnsupportedVersionError
from . import derive, derive_vision, upstream, versions
from .probing import Probe, probe
from .records import TEXT_ROLES, Entry, Family, VisionDerivation
from .rotary import ApplyRotary, rope_config, uniform_rotary
from .validation import check_family

__all__ = ["ATTENTION_KEY", "ForwardCompatWarning", "Resolved", "VisionModules", "derivable_types", "families",
           "family", "installed_families", "match", "resolve", "resolve_model"]


# the name a patch registers in transformers' AttentionInterface (`tfcompat.hf.attention`); declared here so that
# `Resolved.explain` can say how a patch plugs in without importing forward-time code
ATTENTION_KEY = "tfcompat_packed"

E = TypeVar("E", bound=TfcompatError)


class ForwardCompatWarning(UserWarning):
    """transformers is newer than every declared range; the family resolved by probing its symbols."""


class VisionModules(NamedTuple):
    """owner: the module holding the vision tower (``get_image_features``, ``get_rope_index``); tower: the tower."""

    owner: Any  # a transformers model: its config and methods are read by name
    tower: torch.nn.Module


@dataclass(frozen=True)
class Resolved:
    """A family resolved against the installed transformers: symbols imported, probed, ready to patch.

    family: the family key; spec: its `Family` record (table and helpers); entry: the matched `Entry` (derived:
    ``entry.derived`` says from what). rotary: the uniform rotary call (`apply_rotary`), None for a derived entry.
    repeat_kv: the module's ``repeat_kv`` (None where a derived family's module has none).
    """

    family: str
    transformers_version: str
    spec: Family
    entry: Entry
    forward_compatible: bool
    module: ModuleType
    classes: dict[str, type]
    rotary: ApplyRotary | None
    repeat_kv: Callable[[torch.Tensor, int], torch.Tensor] | None
    probes: tuple[Probe, ...] = field(repr=False)

    @property
    def apply_rotary(self) -> ApplyRotary:
        """``apply_rotary(q, k, cos, sin, config) -> (q, k)`` (`tfcompat.registry.rotary.uniform_rotary`);
        `PatchError` for a derived family, whose entry names no rotary."""
        if self.rotary is None:
            raise self.error(
                PatchError, f"{self.family} has no rotary convention in tfcompat's registry",
                why="its entry was derived from the model; a derived entry leaves rotary to the stock attention "
                "forward and replaces only the attention function", supported=", ".join(sorted(families())),
                fix="apply the model's own rotary (its attention forward does), or use a written family")
        return self.rotary

    @property
    def attention_cls(self) -> type:
        return self.classes["attention"]

    @property
    def text_model_cls(self) -> type:
        return self.classes["text_model"]

    @property
    def decoder_layer_cls(self) -> type:
        return self.classes["decoder_layer"]

    def error(self, cls: type[E], what: str, *, why: str = "", fix: str = "", supported: str = "") -> E:
        """An error of type ``cls`` (`tfcompat.errors`) for this family on this transformers version; raise it."""
        return cls(what, family=self.family, transformers_version=self.transformers_version, why=why,
                   supported=supported, fix=fix)

    def rope_config(self, config: Any) -> dict[str, Any]:
        """Flat rope settings (``rope_type``, ``rope_theta``, ``mrope_section``, ...) of ``config``."""
        return rope_config(config, self.entry.rope_config_key)

    def vision_modules(self, model: torch.nn.Module, *, purpose: str) -> VisionModules:
        """Where ``model``'s vision tower lives on this release (`tfcompat.records.VisionTower`): its owner and it.

        purpose: what the caller needs it for, for the error. Raises `PatchError` for a text-only family or a
        model without that module.
        """
        where = self.entry.vision
        owner_cls = self.classes[where.owner] if where is not None else None
        owner = next((m for m in model.modules() if isinstance(m, owner_cls)), None) if owner_cls else None
        tower = getattr(owner, where.attr, None) if owner is not None and where is not None else None
        if owner is None or not isinstance(tower, torch.nn.Module):
            raise PatchError(
                f"{type(model).__name__} has no vision tower for {purpose}",
                family=self.family, transformers_version=self.transformers_version,
                why=(f"{self.family} is a text-only family" if owner_cls is None else
                     f"no {owner_cls.__name__} with a vision tower inside {type(model).__name__}; it holds the tower "
                     "in this transformers"),
                supported=", ".join(k for k, f in families().items() if f.is_vision),
                fix="pass the model built by transformers for a vision-language family",
            )
        return VisionModules(owner, tower)

    def explain(self) -> str:
        """A human-readable account of the match, the symbols probed, and how a patch plugs in."""
        e = self.entry
        how = "matched" if not self.forward_compatible else "NOT declared; resolved by probing the newest entry"
        if e.derived is not None or e.derived_vision is not None:
            how = "DERIVED (no written table)"
        lines = [
            f"{self.family} on transformers {self.transformers_version}: {how} entry {e.versions} ({e.why})",
            f"  module: {e.module}",
            *([] if e.derived is None else [
                "  derived from: " + (f"{e.derived.causal_lm}.{e.derived.text_model_attr} -> " if e.derived.causal_lm
                                     else "(no causal LM: the text model itself) ")
                + f"{e.derived.text_model}, decoder layers {', '.join(e.derived.decoder_layers)}, config "
                f"{e.derived.config}",
                (f"  attention call seen: {e.derived.attention.describe()}" if e.derived.softmax_attention
                 else "  attention: no module dispatches through AttentionInterface for the packed core"),
                *([] if not e.derived.per_sequence_why else [
                    f"  decoder layers run per sequence on packed rows ({e.derived.per_sequence_why}): a Python loop "
                    "over the row's sequences per layer, the model's own attention (no varlen kernel), the mask built "
                    "for the row cut to each sequence's block: "
                    + "; ".join(m.describe() for m in e.derived.per_sequence)]),
                *([] if e.derived.per_sequence_why or not e.derived.per_sequence else [
                    "  where patch() finds a layer whose attention the packed core cannot run (a layer type other "
                    "than softmax attention), the decoder layers run per sequence instead"]),
                *([] if not e.derived.mixers else [
                    "  token mixers run per sequence on packed rows (no packed kernel: the stock mixer once per "
                    "sequence, fresh state, outputs concatenated): "
                    + "; ".join(m.describe() for m in e.derived.mixers)])]),
            *([] if e.derived_vision is None else _vision_lines(e.derived_vision)),
            (f"  rotary: {e.rotary.apply} ({e.rotary.layout}); rope config key: {e.rope_config_key}" if e.rotary
             else f"  rotary: the stock attention forward's own; rope config key: {e.rope_config_key}"),
            f"  text model position ids: {_LAYOUTS[e.text_model_positions]}",
            *(["  attention: the model's own, in its decoder layers run per sequence (or none: mixers alone); the "
               "attention implementation is not switched, the masks are the model's own, and the context reaches "
               "those modules from the text model's forward"]
              if e.derived is not None and not e.derived.softmax_attention else [
                  "  attention: stock attention forward (stock rotary), dispatching to tfcompat's packed core "
                  f"through transformers' AttentionInterface key {ATTENTION_KEY!r}",
                  "  kwargs: " + ("flow from the text model to attention" if e.layer_forwards_kwargs else
                                  "dropped by the decoder layer; a forward pre-hook on each decoder layer bridges "
                                  "them")]),
            *([] if e.linear_attention is None else [
                f"  linear attention: {e.classes['linear_attention']} at decoder_layer.{e.linear_attention.attr} "
                f"({e.linear_attention.projections} projections): its forward is replaced per instance by tfcompat's "
                "packed Gated DeltaNet (conv and recurrent state restart per sequence); context "
                + ("in **kwargs" if e.linear_attention.layer_forwards_kwargs
                   else "through the decoder layer's pre-hook")]),
            "  process-wide: registers the key above in transformers' AttentionInterface (a new name; no "
            "existing function is replaced); everything else is set on the patched model's instances",
            "  probes:",
        ]
        lines += [f"    [{'ok' if p.ok else 'FAIL'}] {p.what}: {p.detail}" for p in self.probes]
        return "\n".join(lines)


def _vision_lines(v: VisionDerivation) -> list[str]:
    chain = " -> ".join(f"{c}.{a}" for c, a in v.hops)
    return [
        f"  vision-language: {v.model}; language model {v.owner}.{v.language_model_attr} patched as {v.text_family} "
        f"(text family), vision tower {', '.join(v.tower_attrs) or '(none found)'}, projector "
        f"{', '.join(v.projector_attrs) or '(none found)'}, placeholder token id config.{v.placeholder or '(none)'}",
        f"  position_ids and **kwargs proved to reach the text model: {chain}",
        "  images: the model's own forward (tower, projector, placeholders); pixel values "
        + ("(B, images, ...) per row" if v.batched_images else "(images, ...)")
        + ("; its forward refuses inputs_embeds without input_ids (no embed_inputs, no Ulysses)"
           if v.embeds_need_ids else "")
        + (f"; it computes {', '.join(v.token_inputs)} from the token ids (no embed_inputs)" if v.token_inputs else ""),
        *([] if v.cross_states is None else [
            f"  images as cross-attention states: {v.owner} hands {v.cross_states.states} and the "
            f"{v.cross_states.mask} {v.cross_states.prepare} prepares from {v.cross_states.items} to "
            f"{', '.join(v.cross_states.layers)} (skipped without them; {', '.join(v.cross_states.attentions)} runs "
            "the stock attention); packed rows: each token attends its own sequence's images (no embed_inputs)"]),
        *([] if not v.item_axes else [
            "  items along another axis, as its processors batch them (pack concatenates there): "
            + ", ".join(f"{name} on dim {axis} of one entry" for name, axis in v.item_axes)]),
        *([] if not v.batch_indices else [
            "  indices into the whole batch's patches (pack shifts each sequence's by the rows before it): "
            + ", ".join(f"{name} into the flattened {pixels}" for name, pixels in v.batch_indices)]),
        *([] if not v.positions_call else [
            f"  M-RoPE positions: {v.owner}.{v.positions_call[0]}, called per sequence by pack and rope_index (what "
            "its forward numbers when given no positions)"]),
        *([] if v.owner_mask == "attention_mask" else [
            f"  mask: {v.owner} builds its own ({v.owner_mask}); on packed rows the boundaries replace it"
            + (f"; rows whose {', '.join(v.mask_inputs)} mark images (bidirectional within each) run the stock "
               "eager/sdpa attention with transformers' mask of the packed row" if v.mask_inputs else "")]),
    ]


_LAYOUTS = {
    "mrope": "(3, B, L) [t; h; w]; tfcompat strips the text row after taking boundaries from it",
    "text+mrope": "(4, B, L) [text; t; h; w], split by the text model itself",
    "text": "(B, L)",
}


@functools.cache
def families() -> dict[str, Family]:
    """Every registered family, by key (= transformers' ``config.model_type``); each table checked as it is
    collected (`tfcompat.registry.validation.check_family`), so a bad table fails wherever the registry is used."""
    from .tables import FAMILIES

    for fam in FAMILIES:
        check_family(fam)
    return {f.key: f for f in FAMILIES}


def installed_families() -> dict[str, Family]:
    """The families whose table covers the installed transformers (or that resolve on it forward-compatibly)."""
    installed = versions.installed_transformers()
    out = {}
    for key, fam in families().items():
        try:
            match(key, installed or "")
        except UnsupportedVersionError:
            continue
        out[key] = fam
    return out


def derivable_types() -> tuple[str, ...]:
    """The causal-LM ``model_type``s of the installed transformers without a written table: `resolve` derives their
    entries from their modeling modules (`tfcompat.registry.derive`), or refuses one naming what it cannot prove."""
    if versions.installed_transformers() is None:
        return ()
    known = {**families(), **_text_only_families()}
    return tuple(sorted(k for k in derive.causal_lm_types() if k not in known))


def family(key: str) -> Family:
    """The family for ``key`` (a registered family or one's text-only model, `tfcompat.records.Family.text_only`,
    else one derived on the installed transformers, `derivable_types`), or `UnknownFamilyError` with a
    did-you-mean. A derived family that cannot be derived raises `PatchError` naming why."""
    known = {**families(), **_text_only_families()}
    if key in known:
        return known[key]
    installed = versions.installed_transformers()
    if installed is not None and isinstance(key, str) and derive_vision.vision_key(key) is not None:
        try:
            return _derived_vision(key, derive_vision.default_text_type(key), installed)
        except PatchError as exc:  # a causal LM of the same type (Emu3's) may still derive as text
            if key not in derivable_types():
                raise
            try:
                return _derived(key, installed)
            except PatchError as text_exc:  # its language model is the type itself (GIT): the text reading says why
                raise (text_exc if derive_vision.default_text_type(key) == key else exc) from None
    if installed is not None and key in derivable_types():
        try:
            return _derived(key, installed)
        except PatchError as exc:  # a causal LM around a text model of another type (an audio tower in front)
            text_type = derive_vision.default_text_type(key)
            if text_type in (None, key):
                raise
            try:
                return _derived_vision(key, text_type, installed)
            except PatchError:
                raise exc from None
    norm = {k.replace("_", "").replace("-", "").lower(): k for k in known}
    guess = norm.get(str(key).replace("_", "").replace("-", "").lower())
    guesses = [guess] if guess else difflib.get_close_matches(str(key), list(known), n=2)
    raise UnknownFamilyError(
        f"unknown model family {key!r}" + (f"; did you mean {' or '.join(map(repr, guesses))}?" if guesses else ""),
        family=str(key),
        transformers_version=versions.installed_transformers(),
        why="family keys are transformers' config.model_type",
        supported=", ".join(sorted(known)),
        fix=f"use tfcompat.resolve({guesses[0]!r})" if guesses else "pick one of the supported families",
    )


@functools.cache
def _derived(key: str, version: str) -> Family:
    _refuse_upstream_bug(key, derive.module_name(key), version)  # first: a bug may keep its model from building
    return derive.derive(key, version)


@functools.cache
def _derived_vision(key: str, text_type: str | None, version: str) -> Family:
    _refuse_upstream_bug(key, derive.module_name(key), version)
    return derive_vision.derive(key, version, text_type, lambda t, built: _language_model_entry(t, version, built))


def _language_model_entry(text_type: str, version: str, built: type | None) -> Entry:
    """The entry on ``version`` of a vision-language model's language model, ``text_type``: its own family's (written,
    a written family's text-only model, or derived from its causal LM); for a text type without one, the written
    family whose text model it is (``qwen3_vl_text``: ``qwen3_vl``'s entry), else one derived from its text model
    class (``MODEL_MAPPING_NAMES``, else ``built``: the class the vision-language model builds from its text config).
    Raises the type's `UnknownFamilyError` where no text model class is found."""
    try:
        return match(text_type, version)[0]
    except UnknownFamilyError:
        text = derive.text_model_class(text_type) or built
        if text is None:
            raise
    written = next((entry for entry in map(functools.partial(_entry_on, version=version), families().values())
                    if entry is not None and entry.classes.get("text_model") == text.__name__
                    and entry.module_of("text_model") == text.__module__), None)
    return written or _derived_text_model(text_type, version, text).entries[0]


def _entry_on(fam: Family, version: str) -> Entry | None:
    try:
        return match(fam.key, version)[0]
    except UnsupportedVersionError:
        return None


@functools.cache
def _derived_text_model(key: str, version: str, text: type) -> Family:
    return derive.derive_text_model(key, version, text)


def _refuse_upstream_bug(key: str, module: str, version: str) -> None:
    """The refusal naming the declared upstream bug of ``module`` and type ``key`` on ``version``, if any."""
    bug = upstream.bug_in(module, version, key)
    if bug is not None:
        raise PatchError(f"{key} on transformers {version} has an upstream bug packing cannot reproduce ({bug.name})",
                         family=key, transformers_version=version, why=bug.what,
                         supported=f"{key} outside transformers {bug.versions}", fix=bug.fix)


@functools.cache
def _text_only_families() -> dict[str, Family]:
    """The families' text-only models (`tfcompat.records.Family.text_only`), by key."""
    return {f.text_only.key: f.text_only for f in families().values() if f.text_only is not None}


def match(key: str, version: str) -> tuple[Entry, bool]:
    """The entry for ``version``, and whether it is a forward-compatible (undeclared, newer) match.

    Exactly one entry's range holds any version inside the family's span; an older version raises
    `UnsupportedVersionError`; a newer one returns the newest entry with ``True``.
    """
    fam = family(key)
    try:
        parsed = versions.parse(version)
    except ValueError:
        parsed = None
    hits = [e for e in fam.entries if version in e.versions] if parsed is not None and parsed.epoch == 0 else []
    if len(hits) == 1:
        return hits[0], False
    newest = fam.entries[-1]
    if (not hits and parsed is not None and parsed.epoch == 0 and newest.versions.high is not None
            and parsed >= versions.release_floor(newest.versions.high)):
        return newest, True
    why = "no registry entry covers this version" if parsed is not None else "not a PEP 440 version"
    raise UnsupportedVersionError(
        f"{key} is not supported on transformers {version}",
        family=key,
        transformers_version=version,
        why=why if not hits else f"{len(hits)} entries overlap (registry bug)",
        supported=fam.supported,
        fix=f"pip install 'transformers>={fam.entries[0].versions.low}'",
    )


def resolve(key: str) -> Resolved:
    """Resolve ``key`` on the installed transformers: match its entry, import and probe its symbols (cached)."""
    installed = versions.installed_transformers()
    if installed is None:
        raise UnsupportedVersionError(
            "transformers is not installed", family=key, fix="pip install transformers",
            supported=family(key).supported,
        )
    return _resolve(key, installed)


@functools.cache
def _resolve(key: str, version: str) -> Resolved:
    entry, forward_compatible = match(key, version)
    _refuse_upstream_bug(key, entry.module, version)  # a written family's (a derived one's refused it already)
    if forward_compatible:
        warnings.warn(
            f"tfcompat: transformers {version} is newer than every {key} entry; resolved by probing the newest "
            f"entry ({entry.versions}). Run `tfcompat doctor` to self-check it.",
            ForwardCompatWarning,
            stacklevel=3,
        )
    return resolve_entry(family(key), entry, version, forward_compatible)


def resolve_model(model: torch.nn.Module) -> Resolved:
    """`resolve` for a model instance: its ``config.model_type`` (or the causal-LM type transformers maps its class
    to, where the config is a text sub-config of another type); where the family's text model follows the text
    config (`tfcompat.records.Family.text_variants`) and that config names a listed ``model_type``, the text half
    of the entry (`tfcompat.records.TEXT_ROLES`, rotary, cache kwarg, position layout, kwargs flow) comes from the
    listed family's entry on the installed release."""
    config = getattr(model, "config", None)
    key = cast(str, getattr(config, "model_type", None))  # None: resolve's UnknownFamilyError says so
    if key not in families() and key not in _text_only_families() and key not in derivable_types():
        # a causal LM built from its text sub-config (Emu3ForCausalLM: "emu3_text_model"): the type it is mapped to
        key = next((k for k, name in derive.causal_lm_types().items() if name == type(model).__name__
                    and k in derivable_types()), key)
    vision = derive_vision.vision_key(key) if isinstance(key, str) else None
    decoder_type = getattr(getattr(config, "decoder", None), "model_type", None)
    try:
        resolved = resolve(key)
    except PatchError:  # an encoder-decoder config without a default decoder (4.x VisionEncoderDecoder): this one's
        installed = versions.installed_transformers()
        if vision is None or not isinstance(decoder_type, str) or installed is None:
            raise
        fam = _derived_vision(key, decoder_type, installed)
        return resolve_entry(fam, fam.entries[0], installed, False)
    if (not resolved.spec.is_vision and vision is not None and resolved.entry.derived is not None
            and resolved.entry.derived_vision is None and resolved.entry.encoder_decoder is None
            and type(model).__name__ == derive_vision.vision_types()[vision]
            and type(model).__name__ != derive.causal_lm_types().get(key)):
        # the type resolved as its causal LM (its vision-language entry cannot be derived), and this is its own
        # vision-language class: its refusal is the vision derivation's
        fam = _derived_vision(key, derive_vision.default_text_type(key), resolved.transformers_version)
        return resolve_entry(fam, fam.entries[0], resolved.transformers_version, False)
    if (vision is not None and resolved.entry.derived_vision is not None and key in derivable_types()
            and type(model).__name__ == derive.causal_lm_types().get(key)
            and type(model).__name__ != derive_vision.vision_types()[vision]):
        # the type's causal LM on its text config alone (Emu3ForCausalLM), not its vision-language class: its entry is
        # the causal LM's own
        fam = _derived(key, resolved.transformers_version)
        return resolve_entry(fam, fam.entries[0], resolved.transformers_version, False)
    crossed = resolved.entry.encoder_decoder
    if crossed is not None:  # the decoder this instance was built with (VisionEncoderDecoder's: any causal LM)
        decoder = _submodule(model, crossed.decoder_path())
        decoder_type = getattr(getattr(decoder, "config", None), "model_type", None)
        if decoder_type is not None and decoder_type != crossed.text_family:
            fam = _derived_vision(key, decoder_type, resolved.transformers_version)
            return resolve_entry(fam, fam.entries[0], resolved.transformers_version, False)
        return resolved
    text_type = getattr(getattr(config, "text_config", None), "model_type", None)
    derived = resolved.entry.derived_vision
    if derived is not None and text_type != derived.text_family:  # the text model this instance was built with
        fam = _derived_vision(key, text_type, resolved.transformers_version)
        return resolve_entry(fam, fam.entries[0], resolved.transformers_version, False)
    text_family = dict(resolved.spec.text_variants).get(cast(str, text_type))
    return resolved if text_family is None else _resolve_text_variant(key, text_family, resolved.transformers_version)


def _submodule(model: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


@functools.cache
def _resolve_text_variant(key: str, text_family: str, version: str) -> Resolved:
    base = _resolve(key, version)
    text, _ = match(text_family, version)
    entry = replace(
        base.entry, text_module=text.module, classes={**base.entry.classes, **{r: text.classes[r] for r in TEXT_ROLES}},
        rotary=text.rotary, rope_config_key=text.rope_config_key, text_model_positions=text.text_model_positions,
        layer_forwards_kwargs=text.layer_forwards_kwargs, cache_kwarg=text.cache_kwarg,
        why=f"{base.entry.why}; text model from {text_family}'s {text.versions} entry",
    )
    return resolve_entry(base.spec, entry, version, base.forward_compatible)


def resolve_entry(fam: Family, entry: Entry, version: str, forward_compatible: bool) -> Resolved:
    """Probe ``entry`` of ``fam`` on the installed transformers (reported as ``version``); not cached."""
    found = probe(fam, entry, version, forward_compatible)
    return Resolved(
        family=entry.family,
        transformers_version=version,
        spec=fam,
        entry=entry,
        forward_compatible=forward_compatible,
        module=found.module,
        classes=found.classes,
        rotary=(None if entry.rotary is None or found.apply_rotary is None
                else uniform_rotary(found.apply_rotary, entry.rotary, entry.rope_config_key)),
        repeat_kv=found.repeat_kv,
        probes=found.probes,
    )
