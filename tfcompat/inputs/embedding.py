"""``embed_inputs``: text embeddings with the vision tower's output scattered in, on every version, and the
extras the family's text model consumes besides (`tfcompat.core.extras`: `Embedded`, `VisualExtras`).

Sequence parallelism slices the input embeddings, so whole images must go through the vision tower first;
this is the step that does it, outside the model's forward.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from ..core.extras import Embedded, VisualExtras
from ..errors import InvalidInputError, PatchError, SymbolProbeError
from ..registry import Resolved
from .derived_vision import embed_derived, is_derived_vision
from .vision_inputs import family_of, vision_call

__all__ = ["Embedded", "dummy_image", "embed_inputs", "visual_features"]  # Embedded: tfcompat.core.extras


def embed_inputs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    **vision_inputs: Any,
) -> Embedded:
    """Input embeddings ``(B, L, H)`` with image/video features at their placeholder tokens, and the extras the
    family's text model consumes (`Embedded`); pass ``**result.model_inputs()`` to the patched model, or the
    result to `tfcompat.ulysses.shard_inputs` as ``inputs_embeds``.

    input_ids: ``(B, L)``; pixel_values: ``(patches, C * tp * p * p)`` with ``image_grid_thw (n_images, 3)``;
    likewise for videos. Raises `InvalidInputError` when placeholder tokens and features disagree in count.
    A batch without pixels runs the vision tower on a dummy image (shape from the vision config) and adds
    ``0 * its mean`` (and its DeepStack features'): the tower gets zero gradients rather than none, and every
    rank of a sharded job runs the same collectives.

    Derived vision-language families (`tfcompat.registry.records.VisionDerivation`: LLaVA, InternVL, Mistral 3,
    Gemma 3, ...) take their own forward's vision inputs by name in ``vision_inputs`` (``pixel_values``,
    ``image_sizes``, ``pixel_attention_mask``, ...); the model's own forward embeds them
    (`tfcompat.inputs.derived_vision.embed_derived`).
    """
    r = family_of(model)
    if is_derived_vision(r):
        given = {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw,
                 "pixel_values_videos": pixel_values_videos, "video_grid_thw": video_grid_thw}
        return embed_derived(r, model, input_ids, {**{k: v for k, v in given.items() if v is not None},
                                                   **vision_inputs})
    if vision_inputs:
        raise r.error(InvalidInputError, f"embed_inputs got {sorted(vision_inputs)}, which {r.family} does not take",
                      supported="pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw",
                      fix="drop them")
    owner, tower = vision_call(r, model, input_ids, {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw,
                               "pixel_values_videos": pixel_values_videos, "video_grid_thw": video_grid_thw},
                               what="embed_inputs", purpose="embed_inputs (the vision tower runs outside the forward)",
                               placeholders="with_pixels")
    where = r.entry.vision
    embeds = cast(Any, model).get_input_embeddings()(input_ids)
    # ERNIE-4.5-VL's experts by modality: what the forward takes with the embeddings
    moe = None if r.spec.moe_token_types is None else r.spec.moe_token_types(owner.config, input_ids)
    types = r.spec.mm_token_types(owner.config, input_ids)  # type: ignore[misc]  # require_vision: not None
    deepstack = where is not None and where.deepstack
    if pixel_values is None and pixel_values_videos is None and not bool(types.any()):
        dummy, dummy_grid = dummy_image(owner.config.vision_config, embeds.device)
        features, layers = visual_features(owner, "image", dummy.to(next(tower.parameters()).dtype), dummy_grid, r)
        for x in (features, *layers):
            embeds = embeds + 0 * x.mean().to(embeds.dtype)
        if not deepstack:
            return Embedded(embeds, moe_token_types=moe)
        rows = tuple(x[:0].to(embeds.dtype) for x in layers)  # no visual token: no rows
        return Embedded(embeds, VisualExtras(torch.zeros_like(input_ids, dtype=torch.bool), rows), moe)
    visual = types > 0  # (B, L): every image or video token
    stacked: list[torch.Tensor] | None = None
    for kind, code, pixels, grid in (("image", 1, pixel_values, image_grid_thw),
                                     ("video", 2, pixel_values_videos, video_grid_thw)):
        slots = types == code
        if pixels is None:
            if bool(slots.any()):
                raise r.error(InvalidInputError, f"input_ids hold {kind} tokens but no {kind} pixels were given",
                              fix=f"pass the {kind}'s pixel values and grid")
            continue
        grid = cast(torch.Tensor, grid)  # check_vision_inputs: pixels come with their grid
        features, layers = visual_features(owner, kind, pixels, grid, r)
        n_slots = int(slots.sum())
        if n_slots != features.shape[0]:
            raise r.error(
                InvalidInputError, f"{kind} placeholder tokens and {kind} features disagree",
                why=f"{n_slots} {kind} tokens in input_ids, {features.shape[0]} feature rows from the vision tower",
                fix="check the grid_thw against the processor's token expansion (t * h * w / merge**2 per item)",
            )
        # out of place: the token embeddings' graph stays intact for the backward
        embeds = embeds.masked_scatter(slots[..., None].expand_as(embeds), features.to(embeds.dtype))
        if deepstack:
            # (n_kind, H) rows -> their places among all visual tokens, row-major over (B, L)
            joint = slots[visual][:, None]
            stacked = [(torch.zeros(int(visual.sum()), x.shape[-1], dtype=embeds.dtype, device=embeds.device)
                        if stacked is None else stacked[i]).masked_scatter(joint.expand(-1, x.shape[-1]),
                                                                           x.to(embeds.dtype))
                       for i, x in enumerate(layers)]
    if not deepstack:
        return Embedded(embeds, moe_token_types=moe)
    return Embedded(embeds, VisualExtras(visual, tuple(stacked or ())), moe)


def visual_features(owner: torch.nn.Module, kind: str, pixels: torch.Tensor, grid: torch.Tensor,
                    r: Resolved) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(tokens, H)`` merged features of ``kind`` ("image" or "video") and, for DeepStack families, one
    ``(tokens, H)`` tensor per DeepStack layer (else ``()``), as the entry's `VisionTower.output` declares:
    "tensors" = per-item tensors (with DeepStack: ``(per-item tensors, deepstack list)``), "model_output" = an
    output whose ``pooler_output`` holds them (its ``last_hidden_state`` is the pre-merger state) and
    ``deepstack_features`` the DeepStack layers.
    """
    where = r.entry.vision
    if where is None:
        raise r.error(PatchError, f"{r.family} has no vision tower", fix="pass the model of a vision-language family")
    out: Any = getattr(owner, f"get_{kind}_features")(pixels, grid)
    is_output = hasattr(out, "pooler_output")
    if is_output != (where.output == "model_output"):
        raise r.error(
            SymbolProbeError, f"{type(owner).__name__}.get_{kind}_features returned {type(out).__name__}",
            why=f"the {r.entry.versions} entry declares {where.output!r}", supported=r.spec.supported,
            fix="report it: this release changed what the vision tower returns",
        )
    if is_output:
        features, layers = out.pooler_output, (out.deepstack_features if where.deepstack else ())
    elif where.deepstack:
        features, layers = out
    else:
        features, layers = out, ()
    return _cat(features), tuple(_cat(x) for x in layers)


def _cat(x: torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(x), dim=0) if isinstance(x, (tuple, list)) else x


def dummy_image(vision_config: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest valid image for ``vision_config``: one merged token, ``(merge**2, C * tp * p * p)`` zeros."""
    merge = vision_config.spatial_merge_size
    channels = getattr(vision_config, "in_channels", 3)
    # a tower without temporal_patch_size embeds one frame per patch (ERNIE-4.5-VL)
    patch_dim = channels * getattr(vision_config, "temporal_patch_size", 1) * vision_config.patch_size**2
    grid = torch.tensor([[1, merge, merge]], device=device)
    return torch.zeros(merge * merge, patch_dim, device=device), grid
