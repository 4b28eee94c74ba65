"""``embed_inputs``: text embeddings with the vision tower's output scattered in, on every version.

Sequence parallelism slices the input embeddings, so whole images must go through the vision tower first;
this is the step that does it, outside the model's forward.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import InvalidInputError
from .registry import resolve

__all__ = ["dummy_image", "embed_inputs", "visual_features"]


def embed_inputs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(B, L, hidden)`` input embeddings: token embeddings, image/video features at their placeholder tokens.

    input_ids: ``(B, L)``; pixel_values: ``(patches, C * tp * p * p)`` with ``image_grid_thw (n_images, 3)``;
    likewise for videos. Raises `InvalidInputError` when placeholder tokens and features disagree in count.
    A batch without pixels runs the vision tower on a dummy image (shape from the vision config) and adds
    ``0 * its mean``: the tower gets zero gradients rather than none, and every rank of a sharded job runs
    the same collectives.
    """
    r = resolve(model.config.model_type)
    owner, tower = r.vision_modules(model, purpose="embed_inputs (the vision tower runs outside the forward)")
    embeds = model.get_input_embeddings()(input_ids)
    types = r.spec.mm_token_types(owner.config, input_ids)
    if pixel_values is None and pixel_values_videos is None and not bool(types.any()):
        pixels, grid = dummy_image(owner.config.vision_config, embeds.device)
        dtype = next(tower.parameters()).dtype
        return embeds + 0 * visual_features(owner, "image", pixels.to(dtype), grid).mean().to(embeds.dtype)
    for kind, code, pixels, grid in (("image", 1, pixel_values, image_grid_thw), ("video", 2, pixel_values_videos, video_grid_thw)):
        slots = types == code
        if pixels is None:
            if bool(slots.any()):
                raise InvalidInputError(f"input_ids hold {kind} tokens but no {kind} pixels were given", family=r.family,
                                        transformers_version=r.transformers_version, fix=f"pass the {kind}'s pixel values and grid")
            continue
        features = visual_features(owner, kind, pixels, grid)
        n_slots = int(slots.sum())
        if n_slots != features.shape[0]:
            raise InvalidInputError(
                f"{kind} placeholder tokens and {kind} features disagree", family=r.family,
                transformers_version=r.transformers_version,
                why=f"{n_slots} {kind} tokens in input_ids, {features.shape[0]} feature rows from the vision tower",
                fix="check the grid_thw against the processor's token expansion (t * h * w / merge**2 per item)",
            )
        # out of place: the token embeddings' graph stays intact for the backward
        embeds = embeds.masked_scatter(slots[..., None].expand_as(embeds), features.to(embeds.dtype))
    return embeds


def visual_features(owner: torch.nn.Module, kind: str, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """``(tokens, hidden)`` merged features of ``kind`` ("image" or "video"), whatever the version returns.

    transformers returns a tuple of per-item tensors (4.x), or an output whose ``pooler_output`` holds them
    (5.x; its ``last_hidden_state`` is the pre-merger state, not the embeddings).
    """
    out: Any = getattr(owner, f"get_{kind}_features")(pixels, grid)
    out = getattr(out, "pooler_output", out)
    if isinstance(out, (tuple, list)):
        out = torch.cat(list(out), dim=0)
    return out


def dummy_image(vision_config: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest valid image for ``vision_config``: one merged token, ``(merge**2, C * tp * p * p)`` zeros."""
    merge = vision_config.spatial_merge_size
    patch_dim = getattr(vision_config, "in_channels", 3) * vision_config.temporal_patch_size * vision_config.patch_size**2
    grid = torch.tensor([[1, merge, merge]], device=device)
    return torch.zeros(merge * merge, patch_dim, device=device), grid
