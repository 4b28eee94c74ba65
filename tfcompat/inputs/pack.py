"""``pack``: per-sequence examples -> the inputs of one packed forward, for every registered family.

The way to build a packed row that cannot get the position ids wrong: each sequence's position ids come from
`tfcompat.rope_index` on that sequence alone (text-only families: ``0 .. L-1``), so every row restarts at 0 at
each sequence; labels never cross a boundary; pixel values and grids are concatenated in sequence order. What
differs between families and releases is read from the registry records (`tfcompat.records.Entry`):
``rope_index_mm_token_types`` (``mm_token_type_ids`` in the inputs), ``known_issues`` (a stock forward that
rejects images and videos together: the row is embedded with `tfcompat.embed_inputs` instead).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ..core.context import CONTEXT_KWARG, ForwardContext
from ..core.labels import mask_starts, shift_labels
from ..core.packing import PackedSeqs, from_lengths
from ..errors import InvalidInputError, PatchError
from ..registry import Resolved, resolve_model
from .derived_vision import is_derived_vision, pack_derived
from .embedding import embed_inputs
from .encoder_decoder import pack_encoder_decoder
from .rope_index import Impl, rope_index
from .vision_inputs import check_token_ids, family_of, vision_call

__all__ = ["Packed", "pack"]

_VISION = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
_KEYS = frozenset({"input_ids", "labels", "attention_mask", "second_per_grid_ts", "mm_token_type_ids",
                   "moe_mm_token_type_ids", *_VISION})


class Packed(NamedTuple):
    """One packed row of ``T`` tokens built by `pack`.

    model_inputs: kwargs of the patched model: ``input_ids (1, T)`` (or ``inputs_embeds (1, T, H)`` where the
        stock forward rejects the row's mix of vision items), ``position_ids`` ``(4, 1, T)`` (M-RoPE families) or
        ``(1, T)``, the concatenated vision inputs, ``labels (1, T)`` (given labels with ``ignore_index`` at each
        sequence start: transformers' shifted loss then never predicts across sequences), ``mm_token_type_ids``
        where the release's forward takes them, and the forward context (the boundaries: no host sync in the
        forward).
    shift_labels: ``(1, T)`` next-token targets per sequence (``shift_labels[t]`` is the target of token ``t``,
        ``ignore_index`` at each sequence's last token), for a loss computed from the logits; None without labels.
    seqs: the boundaries (`tfcompat.packing.PackedSeqs`); lengths in order.
    """

    model_inputs: dict[str, Any]
    shift_labels: torch.Tensor | None
    seqs: PackedSeqs


def pack(model: torch.nn.Module, examples: Sequence[Mapping[str, Any]], *, ignore_index: int = -100,
         impl: Impl = "installed") -> Packed:
    """Pack ``examples`` (one mapping per sequence, e.g. a processor's output for one sample) into one row.

    Each example: ``input_ids`` ``(L,)`` or ``(1, L)``; optional ``labels`` (same shape; transformers'
    convention, unshifted, ``ignore_index`` where no loss is wanted; give them for every example or none),
    ``attention_mask`` (all ones: packing has no padding), ``pixel_values`` with ``image_grid_thw``,
    ``pixel_values_videos`` with ``video_grid_thw``, ``second_per_grid_ts`` (Qwen2.5-VL), ``mm_token_type_ids`` and
    ``moe_mm_token_type_ids`` (ignored: rebuilt from the ids). impl: the M-RoPE index used per sequence
    (`tfcompat.rope_index`).
    Derived vision-language families take their forward's own vision inputs by name (`tfcompat.inputs.derived_vision`
    `.pack_derived`): concatenated in sequence order, zero-padded as a processor pads a batch. An encoder-decoder
    model's packed row is its decoder's (`tfcompat.inputs.encoder_decoder`): each example's decoder ids (or labels,
    shifted per sequence by the model's own function) in one row, the encoder's inputs one row per sequence; its
    ``shift_labels`` are the targets of each decoder token as the model's loss reads them (the labels themselves, or
    shifted per sequence where the loss shifts them: 4.x VisionEncoderDecoder).

    Raises `InvalidInputError` naming the example for anything `tfcompat.rope_index` or the vision checks
    refuse, unknown keys, padding, labels of another shape or given for only some examples.
    """
    try:
        r = family_of(model)
    except PatchError:  # an encoder-decoder type without a default decoder (4.x VisionEncoderDecoder): this model's
        r = resolve_model(model)
    if not examples:
        raise r.error(InvalidInputError, "tfcompat.pack got no examples", why="an empty list packs no row",
                      fix="pass at least one example")
    if r.entry.encoder_decoder is not None:  # the decoder's row, the encoder's inputs one row per sequence
        crossed, targets, crossed_seqs = pack_encoder_decoder(r, model, examples, ignore_index)
        crossed[CONTEXT_KWARG] = ForwardContext(crossed_seqs)
        return Packed(crossed, targets, crossed_seqs)
    if is_derived_vision(r):
        derived, derived_labels, derived_seqs, cross = pack_derived(r, model, examples, ignore_index)
        derived[CONTEXT_KWARG] = ForwardContext(derived_seqs, cross=cross)
        return Packed(derived, derived_labels, derived_seqs)
    rows = [_example(r, model, i, ex, impl) for i, ex in enumerate(examples)]
    has_labels = [ex.get("labels") is not None for ex in examples]
    if any(has_labels) and not all(has_labels):
        raise r.error(InvalidInputError, "tfcompat.pack got labels for some examples only",
                      why=f"examples without labels: {[i for i, h in enumerate(has_labels) if not h]}",
                      fix=f"give every example labels (all {ignore_index} where no loss is wanted), or none")
    ids = torch.cat([row[0] for row in rows])[None]  # (T,) -> (1, T)
    seqs = from_lengths([row[0].shape[0] for row in rows], device=ids.device)
    inputs: dict[str, Any] = {"input_ids": ids, "position_ids": torch.cat([row[1] for row in rows], dim=-1)}
    for name in (*_VISION, "second_per_grid_ts"):
        parts = [torch.as_tensor(ex[name]) for ex in examples if ex.get(name) is not None]  # seconds may be a list
        if parts:
            inputs[name] = torch.cat(parts)
    if r.entry.rope_index_mm_token_types and r.spec.mm_token_types is not None:
        inputs["mm_token_type_ids"] = r.spec.mm_token_types(model.config, ids)
    if r.spec.moe_token_types is not None:  # per token: the packed row's are the sequences' concatenated
        inputs["moe_mm_token_type_ids"] = r.spec.moe_token_types(model.config, ids)
    shifted = None
    if all(has_labels):
        labels = torch.cat([_flat(ex["labels"]) for ex in examples])[None].to(ids.device)  # (T,) -> (1, T)
        inputs["labels"] = mask_starts(labels, seqs, ignore_index)
        shifted = shift_labels(labels, seqs, ignore_index)
    if "images_with_videos_rejected" in r.entry.known_issues and "pixel_values" in inputs \
            and "pixel_values_videos" in inputs:
        vision = {k: inputs.pop(k) for k in _VISION}
        embedded = embed_inputs(model, inputs.pop("input_ids"), **vision)
        inputs.update(embedded.model_inputs())
    inputs[CONTEXT_KWARG] = ForwardContext(seqs)
    return Packed(inputs, shifted, seqs)


def _example(r: Resolved, model: torch.nn.Module, i: int, ex: Mapping[str, Any],
             impl: Impl) -> tuple[torch.Tensor, torch.Tensor]:
    """Example ``i``'s ids ``(L,)`` and position ids (``(4, 1, L)`` M-RoPE families, else ``(1, L)``)."""
    what = f"tfcompat.pack example {i}"
    if not isinstance(ex, Mapping):
        raise r.error(InvalidInputError, f"{what} is not a mapping", why=f"got {type(ex).__name__}",
                      fix="pass one dict per sequence: {'input_ids': ..., 'labels': ..., 'pixel_values': ..., ...}")
    unknown = sorted(set(ex) - _KEYS)
    if unknown:
        raise r.error(InvalidInputError, f"{what} has unknown keys {unknown}", why="pack places only the keys it knows",
                      fix="drop them, or pack them yourself", supported=", ".join(sorted(_KEYS)))
    if ex.get("input_ids") is None:
        raise r.error(InvalidInputError, f"{what} has no input_ids", why=f"keys {sorted(ex)}",
                      fix="give every example its token ids")
    raw = ex["input_ids"]
    ids = raw[None] if isinstance(raw, torch.Tensor) and raw.ndim == 1 else raw
    check_token_ids(r, ids, what)
    if ids.shape[0] != 1 or ids.shape[1] == 0:
        raise r.error(InvalidInputError, f"{what}: input_ids must hold one non-empty sequence",
                      why=f"got shape {tuple(raw.shape)}", fix="pass (L,) or (1, L) ids per example")
    for name in ("labels", "attention_mask"):
        value = ex.get(name)
        if value is not None and (not isinstance(value, torch.Tensor) or value.numel() != ids.shape[1]):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise r.error(InvalidInputError, f"{what}: {name} and input_ids differ in length",
                          why=f"{name} {got}, input_ids {tuple(raw.shape)}", fix=f"pass one {name} entry per token")
    mask = ex.get("attention_mask")
    if mask is not None and not bool(mask.bool().all()):
        raise r.error(InvalidInputError, f"{what} has padding",
                      why="attention_mask has zeros; a packed row carries no padding",
                      fix="drop the padded tokens (ids[mask.bool()]) before packing")
    vision = {k: ex[k] for k in _VISION if ex.get(k) is not None}
    if r.entry.vision is None:
        if vision:
            raise r.error(InvalidInputError, f"{what} has vision inputs {sorted(vision)}, and {r.family} is text only",
                          why="tfcompat patches it as a text family: no vision-language owner whose images fill "
                          "placeholder tokens was derived for it (GIT sets each image in front of its row, attended "
                          "both ways), so a packed row carries no vision inputs",
                          fix="drop the pixel values (text rows pack), or run image rows unpatched")
        return ids[0], torch.arange(ids.shape[1], device=ids.device)[None]
    vision_call(r, model, ids, vision, what=what, purpose="tfcompat.pack")
    positions = rope_index(model, ids, image_grid_thw=ex.get("image_grid_thw"), video_grid_thw=ex.get("video_grid_thw"),
                           second_per_grid_ts=ex.get("second_per_grid_ts"), impl=impl)
    return ids[0], positions


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1)  # (1, L) or (L,) -> (L,)
