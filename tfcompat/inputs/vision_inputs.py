"""Checks of a vision-language call's vision inputs against each other and against the placeholder tokens.

`vision_call` opens `tfcompat.rope_index`, `tfcompat.embed_inputs` and `tfcompat.pack` alike: the model's family
(`family_of`), a vision family, integer ids, the module holding the vision tower, the grids and placeholders.

One rule for `tfcompat.rope_index`, `tfcompat.embed_inputs` and a patched model's forward: pixel values come
with their grid, a grid ``(n, 3)`` of positive ``(t, h, w)`` holds ``sum(t * h * w)`` patches (the pixel rows),
and ``sum(t * h * w) / merge**2`` placeholder tokens of its kind sit in the input ids (the family's
``mm_token_types`` tells image from video tokens). A mismatch raises `InvalidInputError` here rather than a
shape error deep inside the vision tower.
"""

from __future__ import annotations

from typing import Any, Literal, cast

import torch

from ..errors import InvalidInputError
from ..registry import Resolved, VisionModules, families, resolve

__all__ = ["check_token_ids", "check_vision_inputs", "family_of", "require_vision", "vision_call"]

_KINDS = (("image", 1, "pixel_values", "image_grid_thw"), ("video", 2, "pixel_values_videos", "video_grid_thw"))


def family_of(model: torch.nn.Module) -> Resolved:
    """``model``'s family resolved on the installed transformers (`UnknownFamilyError` without a model type)."""
    return resolve(cast(str, getattr(getattr(model, "config", None), "model_type", None)))


def vision_call(r: Resolved, model: torch.nn.Module, input_ids: Any, inputs: dict[str, Any], *, what: str,
                purpose: str, attention_mask: torch.Tensor | None = None,
                placeholders: Literal["always", "with_pixels"] = "always") -> VisionModules:
    """The checks that open a call needing ``model``'s vision tower, in order: a vision family
    (`require_vision`), integer ``(B, L)`` ids (`check_token_ids`), the module holding the tower
    (`tfcompat.registry.Resolved.vision_modules`, for ``purpose``), an ``attention_mask`` shaped like the ids, and
    ``inputs``' grids, pixels and placeholders (`check_vision_inputs`). Returns the tower's owner and the tower.

    what: the call, for the errors. Raises `InvalidInputError` (`PatchError` where the model has no tower).
    """
    require_vision(r, what)
    check_token_ids(r, input_ids, what)
    modules = r.vision_modules(model, purpose=purpose)
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise r.error(InvalidInputError, "attention_mask and input_ids differ in shape",
                      why=f"attention_mask {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}",
                      fix="pass one mask entry per token, or no mask")
    check_vision_inputs(r, modules.owner.config, input_ids, inputs, attention_mask=attention_mask,
                        placeholders=placeholders, what=what)
    return modules


def require_vision(r: Resolved, what: str) -> None:
    """`InvalidInputError` when ``r`` is a text-only family (``what``: the call that needs a vision tower)."""
    if r.entry.vision is None:
        raise r.error(
            InvalidInputError, f"{what} needs a vision-language family; {r.family} is text only",
            why="text-only families have no vision tower and no M-RoPE: their position ids are 0, 1, 2, ... per "
            "sequence",
            supported=", ".join(k for k, f in families().items() if f.is_vision),
            fix="for a text-only model use torch.arange(L) per sequence as position ids (tfcompat.pack builds them), "
            "and the token embeddings as inputs_embeds")


def check_token_ids(r: Resolved, input_ids: Any, what: str) -> None:
    """`InvalidInputError` unless ``input_ids`` is an integer ``(B, L)`` tensor with values (not on meta)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.is_floating_point() \
            or input_ids.dtype == torch.bool:
        got = (f"dtype {input_ids.dtype}, shape {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor)
               else type(input_ids).__name__)
        raise r.error(InvalidInputError, f"{what} takes integer input_ids of shape (B, L)", why=f"got {got}",
                      fix="pass a LongTensor (B, L); one sequence of L tokens is ids[None]")
    if input_ids.device.type == "meta":
        raise r.error(InvalidInputError, f"{what} got input_ids on the meta device", why="meta tensors have no values",
                      fix="pass the token ids on a real device (cpu or cuda)")


def check_vision_inputs(r: Resolved, config: Any, input_ids: torch.Tensor | None, inputs: dict[str, Any], *,
                        attention_mask: torch.Tensor | None = None, placeholders: str = "with_pixels",
                        what: str = "the forward") -> None:
    """Raise `InvalidInputError` unless ``inputs``' pixel values, grids and ``input_ids``' placeholders agree.

    config: the config holding the placeholder token ids and ``vision_config`` (the vision-language model's).
    inputs: any of ``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``.
    placeholders: "with_pixels" = count a kind's placeholders only when its pixels are given (a forward: decoding
        steps carry grids without their tokens); "always" = whenever ids are given (`tfcompat.rope_index`).
    """
    merge = config.vision_config.spatial_merge_size
    types = None
    for kind, code, pixel_name, grid_name in _KINDS:
        pixels, grid = inputs.get(pixel_name), inputs.get(grid_name)
        if pixels is not None and grid is None:
            raise r.error(InvalidInputError, f"{what}: {pixel_name} without {grid_name}",
                          why=f"the vision tower needs each {kind}'s (t, h, w) patch grid to split the pixel rows",
                          fix=f"pass {grid_name} from the processor with {pixel_name}")
        patches = 0
        if grid is not None:
            if not isinstance(grid, torch.Tensor) or grid.ndim != 2 or grid.shape[-1] != 3 or grid.is_floating_point():
                got = tuple(grid.shape) if isinstance(grid, torch.Tensor) else type(grid).__name__
                raise r.error(InvalidInputError, f"{what}: {grid_name} must be an integer (n, 3) tensor",
                              why=f"got {got}",
                              fix=f"pass {grid_name} as the processor returns it: one (t, h, w) row per {kind}")
            rows = grid.detach().cpu()
            if bool((rows <= 0).any()) or bool((rows[:, 1:] % merge).any()):
                raise r.error(InvalidInputError, f"{what}: {grid_name} has an invalid grid",
                              why=f"got {rows.tolist()}; t, h, w must be positive and h, w multiples of the spatial "
                              f"merge size {merge}", fix=f"pass the {grid_name} the processor returned")
            patches = int(rows.prod(-1).sum())
        if pixels is not None and isinstance(pixels, torch.Tensor) and pixels.ndim == 2 and pixels.shape[0] != patches:
            raise r.error(InvalidInputError, f"{what}: {pixel_name} and {grid_name} disagree",
                          why=f"{pixels.shape[0]} pixel rows, the grids {grid.tolist()} "  # type: ignore[union-attr]
                          f"hold {patches} patches (sum of t * h * w)",  # grid given: pixels came with one
                          fix=f"pass the {pixel_name} and {grid_name} of the same {kind}s, in the same order")
        if input_ids is None or (placeholders == "with_pixels" and pixels is None):
            continue
        if types is None:
            types = r.spec.mm_token_types(config, input_ids)  # type: ignore[misc]  # a vision family
            if attention_mask is not None and attention_mask.shape == types.shape:
                types = types * attention_mask.to(types.device).bool()
        # a video's frames merged in groups of temporal_merge_size after the tower (ERNIE-4.5-VL's resampler)
        steps = getattr(config.vision_config, "temporal_merge_size", 1) if kind == "video" else 1
        tokens, expected = int((types == code).sum()), patches // merge**2 // steps
        if tokens != expected:
            raise r.error(InvalidInputError, f"{what}: {kind} placeholder tokens and {grid_name} disagree",
                          why=f"{tokens} {kind} tokens in input_ids, the grids "
                          f"{grid.tolist() if grid is not None else 'None'} take {expected} (t * h * w / {merge}**2 "
                          f"{f'/ {steps} ' if steps > 1 else ''}each)",
                          fix=f"pass one {grid_name} row per {kind} in input_ids, in order, with the processor's token "
                          "expansion (or tfcompat.pack)")
