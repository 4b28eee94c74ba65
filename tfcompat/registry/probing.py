"""Probing an entry against the installed transformers: import its module, look up every symbol and
signature the family needs, so a missing one fails at resolution and never inside a forward."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

from ..errors import SymbolProbeError
from .derive import positions_from_row
from .records import Entry, Family
from .sources import function

__all__ = ["Probe", "Probed", "probe"]


@dataclass(frozen=True)
class Probe:
    """One check made at resolution: what was looked up, whether it held, and what was found."""

    what: str
    ok: bool
    detail: str


class Probed(NamedTuple):
    """What probing found: the module, classes by role, the module's rotary and ``repeat_kv`` functions (None for
    a derived entry, which names no rotary, and a module without ``repeat_kv``)."""

    module: ModuleType
    classes: dict[str, type]
    apply_rotary: Callable[..., Any] | None
    repeat_kv: Callable[..., Any] | None
    probes: tuple[Probe, ...]


def probe(family: Family, entry: Entry, version: str, forward_compatible: bool) -> Probed:
    """Import ``entry.module`` and check every symbol ``entry`` names; `SymbolProbeError` on the first miss.

    version: the installed transformers; forward_compatible: ``entry`` is the newest one, probed for a newer
    undeclared release (the error then points at the newest declared release).
    """
    probes: list[Probe] = []

    def fail(symbol: str, why: str) -> SymbolProbeError:
        newest = family.entries[-1].versions
        nearest = f"{newest.low}" if forward_compatible else f"a release in {entry.versions}"
        return SymbolProbeError(
            f"cannot resolve {entry.family}: {entry.module}.{symbol} {why}",
            family=entry.family,
            transformers_version=version,
            why=f"the {entry.versions} entry expects it"
            + (" (undeclared version, probed)" if forward_compatible else ""),
            supported=family.supported,
            fix=f"install transformers {nearest} (nearest supported), or upgrade tfcompat",
        )

    try:
        module = importlib.import_module(entry.module)
    except ImportError as exc:
        raise fail("", f"cannot be imported ({exc})") from None
    probes.append(Probe(f"import {entry.module}", True, "ok"))
    text_module = module
    if entry.text_module is not None:  # the text model is built from another family's module
        try:
            text_module = importlib.import_module(entry.text_module)
        except ImportError as exc:
            raise fail("", f"text module {entry.text_module} cannot be imported ({exc})") from None
        probes.append(Probe(f"import {entry.text_module} (text model)", True, "ok"))

    classes: dict[str, Any] = {}  # classes by role; Any: their methods (forward, get_rope_index) are probed
    for role, name in entry.classes.items():
        obj = getattr(text_module if entry.module_of(role) != entry.module else module, name, None)
        if not isinstance(obj, type):
            raise fail(name, "is missing" if obj is None else "is not a class")
        classes[role] = obj
        probes.append(Probe(f"{role} class", True, f"{entry.module_of(role)}.{name}" if entry.text_module else name))

    rotary = entry.rotary
    apply_rotary = None if rotary is None else getattr(text_module, rotary.apply, None)
    if rotary is not None:
        if not callable(apply_rotary):
            raise fail(rotary.apply, "is missing")
        signature = inspect.signature(function(apply_rotary))  # 5.25: a kernels module calling the function
        if (rotary.layout == "sectioned") != ("mrope_section" in signature.parameters):
            raise fail(rotary.apply, f"has parameters {list(signature.parameters)}, not the {rotary.layout} convention")
        probes.append(Probe("apply_rotary", True, f"{rotary.apply}{signature}"))

        if rotary.marker is not None:
            if not hasattr(classes["rotary"], rotary.marker):
                raise fail(f"{entry.classes['rotary']}.{rotary.marker}", "is missing (rotary layout changed)")
            probes.append(Probe("rotary layout", True, f"{entry.classes['rotary']}.{rotary.marker}"))

    repeat_kv = getattr(text_module, "repeat_kv", None)
    if entry.derived is None:
        if not callable(repeat_kv):
            raise fail("repeat_kv", "is missing")
        probes.append(Probe("repeat_kv", True, "repeat_kv"))
    else:
        d = entry.derived
        if d.attention.row_positions:
            probes.append(Probe("derived: row positions", True, "read only when "
                                + " or ".join(d.attention.row_positions) + " (checked per module at patch())"))

    attn_params = inspect.signature(classes["attention"].forward).parameters
    if entry.cache_kwarg is not None and entry.cache_kwarg not in attn_params:
        raise fail(f"{entry.classes['attention']}.forward", f"has no {entry.cache_kwarg!r} parameter")
    probes.append(Probe("attention cache kwarg", True, str(entry.cache_kwarg)))

    linear = entry.linear_attention
    if linear is not None:
        name, linear_cls = entry.classes["linear_attention"], classes["linear_attention"]
        linear_params = inspect.signature(linear_cls.forward).parameters.values()
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in linear_params)
        if takes_kwargs != linear.layer_forwards_kwargs:
            raise fail(f"{name}.forward", f"takes **kwargs: {takes_kwargs}; the entry says the decoder layer passes "
                       f"them: {linear.layer_forwards_kwargs}")
        if linear.projections == "qkvz_ba" and not callable(getattr(linear_cls, "fix_query_key_value_ordering", None)):
            raise fail(f"{name}.fix_query_key_value_ordering", "is missing")
        how = "passed in **kwargs" if linear.layer_forwards_kwargs else "bridged by a pre-hook"
        probes.append(Probe("linear attention", True, f"{name} at .{linear.attr}, {linear.projections}, context {how}"))

    text_params = inspect.signature(classes["text_model"].forward).parameters
    from_row = positions_from_row(classes["text_model"]) if entry.derived is not None else None
    positionless = entry.derived is not None and (  # layers run per sequence: derive read what it counts
        bool(entry.derived.per_sequence_why) or not entry.derived.softmax_attention)
    if "position_ids" not in text_params and from_row is None and not positionless:
        raise fail(f"{entry.classes['text_model']}.forward", "has no position_ids parameter")
    probes.append(Probe("text model position_ids", True, entry.text_model_positions if from_row is None else
                        f"counted over the row and passed to .{from_row} (given per sequence by a pre-hook)"))

    if entry.vision is not None:
        owner_name = entry.classes[entry.vision.owner]
        owner = classes[entry.vision.owner]
        for method in ("get_image_features", "get_rope_index"):
            if not callable(getattr(owner, method, None)):
                raise fail(f"{owner_name}.{method}", "is missing")
        takes_mm = "mm_token_type_ids" in inspect.signature(owner.get_rope_index).parameters
        if takes_mm != entry.rope_index_mm_token_types:
            raise fail(f"{owner_name}.get_rope_index", f"mm_token_type_ids parameter is {takes_mm}")
        if entry.vision.deepstack:
            missing = {"visual_pos_masks", "deepstack_visual_embeds"} - text_params.keys()
            if missing:
                raise fail(f"{entry.classes['text_model']}.forward", f"takes no {sorted(missing)} (DeepStack extras)")
            probes.append(Probe("DeepStack extras", True, f"{entry.classes['text_model']}.forward(visual_pos_masks, "
                                "deepstack_visual_embeds)"))
        probes.append(Probe("vision tower", True, f"{owner_name}.{entry.vision.attr}, {owner_name}.get_image_features "
                            f"({entry.vision.output})"))
        probes.append(Probe("get_rope_index", True, str(inspect.signature(owner.get_rope_index))))

    modeling_utils = importlib.import_module("transformers.modeling_utils")
    interface = getattr(modeling_utils, "AttentionInterface", None)
    if interface is None or not hasattr(interface, "_global_mapping"):
        raise fail("AttentionInterface", "is missing from transformers.modeling_utils")
    probes.append(Probe("AttentionInterface", True, "transformers.modeling_utils.AttentionInterface"))

    return Probed(module, classes, apply_rotary, repeat_kv, tuple(probes))
