"""The registry's records: what a family looks like inside one transformers range (`Entry`), and a family
(`Family`: its entries and helpers). Family tables import this module only; nothing here imports
transformers, the lookup (`tfcompat.registry`) or the probing (`tfcompat.probing`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from . import versions

__all__ = [
    "CacheKwarg", "Entry", "Family", "RopeConfigKey", "Rotary", "RotaryLayout", "TextModelLayout", "VisionItem",
    "VisionTower",
]

RotaryLayout = Literal["sectioned", "folded"]
RopeConfigKey = Literal["rope_scaling", "rope_parameters"]
TextModelLayout = Literal["mrope", "text+mrope", "text"]
CacheKwarg = Literal["past_key_value", "past_key_values", "cache"]
# a vision item of a test/self-check sequence: ("image" | "video", (t, h, w) patch grid before the merge)
VisionItem = tuple[Literal["image", "video"], tuple[int, int, int]]


@dataclass(frozen=True)
class Rotary:
    """How the attention applies rotary in one range.

    apply: the module function the attention calls. layout: "sectioned" = the rotary embedding returns
    ``(3, B, L, D)`` cos/sin and ``apply`` takes ``mrope_section``; "folded" = sectioning happens inside the
    embedding, ``(B, L, D)``. marker: an attribute of the rotary class only this range has (a layout check).
    """

    apply: str
    layout: RotaryLayout
    marker: str | None = None


@dataclass(frozen=True)
class VisionTower:
    """Where the vision tower lives: the instance of ``Entry.classes[owner]`` holds it at ``attr`` and owns
    ``get_image_features`` / ``get_video_features`` and ``get_rope_index``."""

    owner: str = "model"
    attr: str = "visual"


@dataclass(frozen=True)
class Entry:
    """One row of a family table: what the family looks like inside one transformers range.

    classes: role -> class name in ``module``; roles: ``attention``, ``rotary``, ``text_model``,
        ``decoder_layer``, ``for_causal_lm``, and for vision-language families ``model`` (`VisionTower.owner`).
    rotary: the rotary convention (`Rotary`).
    text_model_positions: "mrope" = the text model takes ``(3, B, L)`` and cannot take a text row;
        "text+mrope" = it splits ``(4, B, L)`` itself; "text" = a text-only model taking ``(B, L)``.
    layer_forwards_kwargs: the decoder layer passes ``**kwargs`` on to its attention.
    rope_index_mm_token_types: ``get_rope_index`` requires ``mm_token_type_ids``.
    cache_kwarg: the attention forward's cache parameter name.
    why: what sets this range apart from its neighbours.
    vision: where the vision tower lives (None for text-only families).
    rope_index_deviations: where the installed ``get_rope_index`` departs from the family's reference
        (`Family.reference_rope_index`; known transformers bugs), by name from that reference's ``DEVIATIONS``.
    known_issues: bugs of the stock forward in this range, by name (``"videos_rejected"``: the forward
        rejects every video; pass videos through `tfcompat.embed_inputs` instead).
    """

    family: str
    versions: versions.VersionRange
    module: str
    classes: dict[str, str]
    rotary: Rotary
    rope_config_key: RopeConfigKey
    text_model_positions: TextModelLayout
    layer_forwards_kwargs: bool
    rope_index_mm_token_types: bool
    cache_kwarg: CacheKwarg
    why: str
    vision: VisionTower | None = None
    rope_index_deviations: tuple[str, ...] = ()
    known_issues: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    """A model family: its entries (oldest first, contiguous) and the few family-specific helpers.

    key: transformers' ``config.model_type``.
    mm_token_types: ``(config, input_ids (B, L)) -> (B, L)`` int tensor, 0 text / 1 image / 2 video
        (None for text-only families).
    tiny_config: ``(entry) -> (config_class_name, kwargs)`` for a tiny random model (self-check, tests).
    reference_rope_index: the name of tfcompat's reference M-RoPE index for this family, a key of
        `tfcompat.reference_rope.REFERENCES` (None: no reference; ``rope_index(impl="reference")`` refuses).
    sample_vision: one vision item per sequence of the family's packed sample (None = text only), run by
        the self-check and the tests: images of different grids and, where the family takes them, a video.
    """

    key: str
    entries: tuple[Entry, ...]
    tiny_config: Callable[[Entry], tuple[str, dict[str, Any]]]
    mm_token_types: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    reference_rope_index: str | None = None
    sample_vision: tuple[VisionItem | None, ...] = ()

    @property
    def is_vision(self) -> bool:
        return self.mm_token_types is not None

    @property
    def supported(self) -> str:
        span = versions.VersionRange(self.entries[0].versions.low, self.entries[-1].versions.high)
        return f"transformers {span} (newer releases resolve by probing, with a warning)"
