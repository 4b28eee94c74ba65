"""Checks of a vision-language call's vision inputs against each other and against the placeholder tokens.

One rule for `tfcompat.rope_index`, `tfcompat.embed_inputs` and a patched model's forward: pixel values come
with their grid, a grid ``(n, 3)`` of positive ``(t, h, w)`` holds ``sum(t * h * w)`` patches (the pixel rows),
and ``sum(t * h * w) / merge**2`` placeholder tokens of its kind sit in the input ids (the family's
``mm_token_types`` tells image from video tokens). A mismatch raises `InvalidInputError` here rather than a
shape error deep inside the vision tower.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidInputError
from ..registry import Resolved, families

__all__ = ["check_token_ids", "check_vision_inputs", "require_vision"]

_KINDS = (("image", 1, "pixel_values", "image_grid_thw"), ("video", 2, "pixel_values_videos", "video_grid_thw"))


def require_vision(r: Resolved, what: str) -> None:
    """`InvalidInputError` when ``r`` is a text-only family (``what``: the call that needs a vision tower)."""
    if r.entry.vision is None:
        raise InvalidInputError(
            f"{what} needs a vision-language family; {r.family} is text only", family=r.family,
            transformers_version=r.transformers_version,
            why="text-only families have no vision tower and no M-RoPE: their position ids are 0, 1, 2, ... per sequence",
            supported=", ".join(k for k, f in families().items() if f.is_vision),
            fix="for a text-only model use torch.arange(L) per sequence as position ids (tfcompat.pack builds them), "
            "and the token embeddings as inputs_embeds")


def check_token_ids(r: Resolved, input_ids: Any, what: str) -> None:
    """`InvalidInputError` unless ``input_ids`` is an integer ``(B, L)`` tensor with values (not on meta)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.is_floating_point() \
            or input_ids.dtype == torch.bool:
        got = (f"dtype {input_ids.dtype}, shape {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor)
               else type(input_ids).__name__)
        raise InvalidInputError(f"{what} takes integer input_ids of shape (B, L)", family=r.family,
                                transformers_version=r.transformers_version, why=f"got {got}",
                                fix="pass a LongTensor (B, L); one sequence of L tokens is ids[None]")
    if input_ids.device.type == "meta":
        raise InvalidInputError(f"{what} got input_ids on the meta device", family=r.family,
                                transformers_version=r.transformers_version, why="meta tensors have no values",
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

        def error(headline: str, why: str, fix: str) -> InvalidInputError:
            return InvalidInputError(f"{what}: {headline}", family=r.family, transformers_version=r.transformers_version,
                                     why=why, fix=fix)

        if pixels is not None and grid is None:
            raise error(f"{pixel_name} without {grid_name}", f"the vision tower needs each {kind}'s (t, h, w) patch "
                        "grid to split the pixel rows", f"pass {grid_name} from the processor with {pixel_name}")
        patches = 0
        if grid is not None:
            if not isinstance(grid, torch.Tensor) or grid.ndim != 2 or grid.shape[-1] != 3 or grid.is_floating_point():
                raise error(f"{grid_name} must be an integer (n, 3) tensor",
                            f"got {tuple(grid.shape) if isinstance(grid, torch.Tensor) else type(grid).__name__}",
                            f"pass {grid_name} as the processor returns it: one (t, h, w) row per {kind}")
            rows = grid.detach().cpu()
            if bool((rows <= 0).any()) or bool((rows[:, 1:] % merge).any()):
                raise error(f"{grid_name} has an invalid grid", f"got {rows.tolist()}; t, h, w must be positive and h, w "
                            f"multiples of the spatial merge size {merge}", f"pass the {grid_name} the processor returned")
            patches = int(rows.prod(-1).sum())
        if pixels is not None and isinstance(pixels, torch.Tensor) and pixels.ndim == 2 and pixels.shape[0] != patches:
            raise error(f"{pixel_name} and {grid_name} disagree",
                        f"{pixels.shape[0]} pixel rows, the grids {grid.tolist()} hold {patches} patches (sum of t * h * w)",  # type: ignore[union-attr]  # grid given
                        f"pass the {pixel_name} and {grid_name} of the same {kind}s, in the same order")
        if input_ids is None or (placeholders == "with_pixels" and pixels is None):
            continue
        if types is None:
            types = r.spec.mm_token_types(config, input_ids)  # type: ignore[misc]  # a vision family
            if attention_mask is not None and attention_mask.shape == types.shape:
                types = types * attention_mask.to(types.device).bool()
        tokens, expected = int((types == code).sum()), patches // merge**2
        if tokens != expected:
            raise error(f"{kind} placeholder tokens and {grid_name} disagree",
                        f"{tokens} {kind} tokens in input_ids, the grids "
                        f"{grid.tolist() if grid is not None else 'None'} take {expected} (t * h * w / {merge}**2 each)",
                        f"pass one {grid_name} row per {kind} in input_ids, in order, with the processor's token "
                        "expansion (or tfcompat.pack)")
