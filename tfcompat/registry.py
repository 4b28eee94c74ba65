"""The registry: (family, transformers version range) -> entry, and resolution of an entry into symbols.

An `Entry` is a row of a family's table: the version range, the module, the symbols by role, and the facts
that differ between ranges (rotary layout, rope-config key, position-id layout, kwargs flow). `resolve`
matches the installed version, imports the module, and probes every symbol and signature the family needs,
so a missing symbol fails here and never inside a forward. A version newer than every declared range
resolves against the newest entry by probing, with a warning.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Literal

import torch

from . import versions
from .errors import SymbolProbeError, UnknownFamilyError, UnsupportedVersionError
from .rope import RopeConfigKey, TextModelLayout, rope_config

__all__ = ["Entry", "Family", "Probe", "Resolved", "ForwardCompatWarning", "families", "match", "resolve"]

RotaryLayout = Literal["sectioned", "folded"]


class ForwardCompatWarning(UserWarning):
    """transformers is newer than every declared range; the family resolved by probing its symbols."""


@dataclass(frozen=True)
class Entry:
    """One row of a family table: what the family looks like inside one transformers range.

    classes: role -> class name in ``module``; roles: ``attention``, ``rotary``, ``text_model``,
        ``decoder_layer``, ``for_causal_lm``, and for M-RoPE families ``model`` (owns ``get_rope_index``).
    apply_rotary: the module function the attention applies rotary with.
    rotary_layout: "sectioned" = the rotary embedding returns ``(3, B, L, D)`` cos/sin and ``apply_rotary``
        takes ``mrope_section``; "folded" = sectioning happens inside the embedding, ``(B, L, D)``.
    text_model_positions: "mrope" = the text model takes ``(3, B, L)`` and cannot take a text row;
        "text+mrope" = it splits ``(4, B, L)`` itself; "text" = a text-only model taking ``(B, L)``.
    layer_forwards_kwargs: the decoder layer passes ``**kwargs`` on to its attention.
    rope_index_mm_token_types: ``get_rope_index`` requires ``mm_token_type_ids``.
    rotary_marker: an attribute of the rotary class that only this range has (layout check), or None.
    rope_index_deviations: where the installed ``get_rope_index`` departs from `tfcompat.mrope`'s reference
        (known transformers bugs), by name; see `tfcompat.mrope.DEVIATIONS`.
    known_issues: bugs of the stock forward in this range, by name (``"videos_rejected"``: the forward
        rejects every video; pass videos through `tfcompat.embed_inputs` instead).
    cache_kwarg: the attention forward's cache parameter name.
    why: what sets this range apart from its neighbours.
    """

    family: str
    versions: versions.VersionRange
    module: str
    classes: dict[str, str]
    apply_rotary: str
    rotary_layout: RotaryLayout
    rope_config_key: RopeConfigKey
    text_model_positions: TextModelLayout
    layer_forwards_kwargs: bool
    rope_index_mm_token_types: bool
    cache_kwarg: str
    why: str
    rotary_marker: str | None = None
    rope_index_deviations: tuple[str, ...] = ()
    known_issues: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    """A model family: its entries (oldest first) and the few family-specific helpers.

    mm_token_types: ``(config, input_ids (B, L)) -> (B, L)`` int tensor, 0 text / 1 image / 2 video
        (None for text-only families).
    tiny_config: ``(entry) -> (config_class_name, kwargs)`` for a tiny random model (self-check, tests).
    reference_rope_index: `tfcompat.mrope.reference_rope_index` implements this family's M-RoPE index.
    """

    key: str
    entries: tuple[Entry, ...]
    mm_token_types: Callable[[Any, torch.Tensor], torch.Tensor] | None
    tiny_config: Callable[[Entry], tuple[str, dict[str, Any]]]
    reference_rope_index: bool = False

    @property
    def supported(self) -> str:
        span = versions.VersionRange(self.entries[0].versions.low, self.entries[-1].versions.high)
        return f"transformers {span} (newer releases resolve by probing, with a warning)"


@dataclass(frozen=True)
class Probe:
    """One check made at resolution: what was looked up, whether it held, and what was found."""

    what: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class Resolved:
    """A family resolved against the installed transformers: symbols imported, probed, ready to patch."""

    family: str
    transformers_version: str
    entry: Entry
    forward_compatible: bool
    module: ModuleType
    classes: dict[str, type]
    apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    repeat_kv: Callable[[torch.Tensor, int], torch.Tensor]
    probes: tuple[Probe, ...] = field(repr=False)

    @property
    def attention_cls(self) -> type:
        return self.classes["attention"]

    @property
    def rotary_cls(self) -> type:
        return self.classes["rotary"]

    @property
    def text_model_cls(self) -> type:
        return self.classes["text_model"]

    @property
    def decoder_layer_cls(self) -> type:
        return self.classes["decoder_layer"]

    @property
    def attention_function(self) -> Callable[..., Any]:
        """The packed attention plugged into the model's attention dispatch (see `tfcompat.hf_attention`)."""
        from .hf_attention import packed_attention

        return packed_attention

    def rope_config(self, config: Any) -> dict[str, Any]:
        """Flat rope settings (``rope_type``, ``rope_theta``, ``mrope_section``, ...) of ``config``."""
        return rope_config(config, self.entry.rope_config_key)

    def explain(self) -> str:
        """A human-readable account of the match, the symbols probed, and how a patch plugs in."""
        e = self.entry
        how = "matched" if not self.forward_compatible else "NOT declared; resolved by probing the newest entry"
        lines = [
            f"{self.family} on transformers {self.transformers_version}: {how} entry {e.versions} ({e.why})",
            f"  module: {e.module}",
            f"  rotary: {e.apply_rotary} ({e.rotary_layout}); rope config key: {e.rope_config_key}",
            f"  text model position ids: {_LAYOUTS[e.text_model_positions]}",
            "  attention: stock attention forward (stock rotary), dispatching to tfcompat's packed core "
            f"through transformers' AttentionInterface key {_attention_key()!r}",
            "  kwargs: " + ("flow from the text model to attention" if e.layer_forwards_kwargs
                            else "dropped by the decoder layer; a forward pre-hook on each decoder layer bridges them"),
            "  process-wide: registers the key above in transformers' AttentionInterface (a new name; no "
            "existing function is replaced); everything else is set on the patched model's instances",
            "  probes:",
        ]
        lines += [f"    [{'ok' if p.ok else 'FAIL'}] {p.what}: {p.detail}" for p in self.probes]
        return "\n".join(lines)


_LAYOUTS = {
    "mrope": "(3, B, L) [t; h; w]; tfcompat strips the text row after taking boundaries from it",
    "text+mrope": "(4, B, L) [text; t; h; w], split by the text model itself",
    "text": "(B, L)",
}


def _attention_key() -> str:
    from .hf_attention import ATTENTION_KEY

    return ATTENTION_KEY


@functools.cache
def families() -> dict[str, Family]:
    """Every registered family, by key (= transformers' ``config.model_type``)."""
    from .families import FAMILIES

    return {f.key: f for f in FAMILIES}


def family(key: str) -> Family:
    """The family for ``key``, or `UnknownFamilyError` with a did-you-mean."""
    known = families()
    if key in known:
        return known[key]
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
    if forward_compatible:
        warnings.warn(
            f"tfcompat: transformers {version} is newer than every {key} entry; resolved by probing the newest "
            f"entry ({entry.versions}). Run `tfcompat doctor` to self-check it.",
            ForwardCompatWarning,
            stacklevel=3,
        )
    return _probe(entry, version, forward_compatible)


def _probe(entry: Entry, version: str, forward_compatible: bool) -> Resolved:
    probes: list[Probe] = []

    def fail(symbol: str, why: str) -> SymbolProbeError:
        fam = family(entry.family)
        newest = fam.entries[-1].versions
        nearest = f"{newest.low}" if forward_compatible else f"a release in {entry.versions}"
        return SymbolProbeError(
            f"cannot resolve {entry.family}: {entry.module}.{symbol} {why}",
            family=entry.family,
            transformers_version=version,
            why=f"the {entry.versions} entry expects it" + (" (undeclared version, probed)" if forward_compatible else ""),
            supported=fam.supported,
            fix=f"install transformers {nearest} (nearest supported), or upgrade tfcompat",
        )

    try:
        module = importlib.import_module(entry.module)
    except ImportError as exc:
        raise fail("", f"cannot be imported ({exc})") from None
    probes.append(Probe(f"import {entry.module}", True, "ok"))

    classes: dict[str, type] = {}
    for role, name in entry.classes.items():
        obj = getattr(module, name, None)
        if not isinstance(obj, type):
            raise fail(name, "is missing" if obj is None else "is not a class")
        classes[role] = obj
        probes.append(Probe(f"{role} class", True, name))

    apply_rotary = getattr(module, entry.apply_rotary, None)
    if not callable(apply_rotary):
        raise fail(entry.apply_rotary, "is missing")
    params = inspect.signature(apply_rotary).parameters
    if (entry.rotary_layout == "sectioned") != ("mrope_section" in params):
        raise fail(entry.apply_rotary, f"has parameters {list(params)}, not the {entry.rotary_layout} convention")
    probes.append(Probe("apply_rotary", True, f"{entry.apply_rotary}{inspect.signature(apply_rotary)}"))

    if entry.rotary_marker is not None:
        if not hasattr(classes["rotary"], entry.rotary_marker):
            raise fail(f"{entry.classes['rotary']}.{entry.rotary_marker}", "is missing (rotary layout changed)")
        probes.append(Probe("rotary layout", True, f"{entry.classes['rotary']}.{entry.rotary_marker}"))

    repeat_kv = getattr(module, "repeat_kv", None)
    if not callable(repeat_kv):
        raise fail("repeat_kv", "is missing")
    probes.append(Probe("repeat_kv", True, "repeat_kv"))

    attn_params = inspect.signature(classes["attention"].forward).parameters
    if entry.cache_kwarg not in attn_params:
        raise fail(f"{entry.classes['attention']}.forward", f"has no {entry.cache_kwarg!r} parameter")
    probes.append(Probe("attention cache kwarg", True, entry.cache_kwarg))

    text_params = inspect.signature(classes["text_model"].forward).parameters
    if "position_ids" not in text_params:
        raise fail(f"{entry.classes['text_model']}.forward", "has no position_ids parameter")
    probes.append(Probe("text model position_ids", True, entry.text_model_positions))

    if "model" in classes:  # M-RoPE families
        rope_index = getattr(classes["model"], "get_rope_index", None)
        if rope_index is None:
            raise fail(f"{entry.classes['model']}.get_rope_index", "is missing")
        takes_mm = "mm_token_type_ids" in inspect.signature(rope_index).parameters
        if takes_mm != entry.rope_index_mm_token_types:
            raise fail(f"{entry.classes['model']}.get_rope_index", f"mm_token_type_ids parameter is {takes_mm}")
        probes.append(Probe("get_rope_index", True, str(inspect.signature(rope_index))))

    modeling_utils = importlib.import_module("transformers.modeling_utils")
    interface = getattr(modeling_utils, "AttentionInterface", None)
    if interface is None or not hasattr(interface, "_global_mapping"):
        raise fail("AttentionInterface", "is missing from transformers.modeling_utils")
    probes.append(Probe("AttentionInterface", True, "transformers.modeling_utils.AttentionInterface"))

    return Resolved(
        family=entry.family,
        transformers_version=version,
        entry=entry,
        forward_compatible=forward_compatible,
        module=module,
        classes=classes,
        apply_rotary=_uniform_rotary(apply_rotary, entry),
        repeat_kv=repeat_kv,
        probes=tuple(probes),
    )


def _uniform_rotary(fn: Callable[..., Any], entry: Entry) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``apply_rotary(q, k, cos, sin, config) -> (q, k)`` whatever the installed convention.

    q, k: ``(B, H, L, D)``; cos, sin: what the installed rotary embedding returns (``(3, B, L, D)``
    sectioned or ``(B, L, D)`` folded); config: the model or text config (read for ``mrope_section``).
    """
    if entry.rotary_layout == "sectioned":
        def apply_rotary(q, k, cos, sin, config):
            return fn(q, k, cos, sin, rope_config(config, entry.rope_config_key)["mrope_section"])
    else:
        def apply_rotary(q, k, cos, sin, config):
            return fn(q, k, cos, sin)
    apply_rotary.__doc__ = _uniform_rotary.__doc__
    return apply_rotary
