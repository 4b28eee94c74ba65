"""``rope_index``: contract position ids ``(4, B, L)`` from the installed transformers' own M-RoPE index."""

from __future__ import annotations

import torch

from .errors import PatchError
from .registry import family as _family
from .registry import resolve
from .rope import text_row_from_mask

__all__ = ["rope_index"]


@torch.no_grad()
def rope_index(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Position ids ``(4, B, L)`` = ``[text; t; h; w]`` for ``input_ids (B, L)``, on every transformers version.

    Calls the installed ``get_rope_index`` with that version's signature (building ``mm_token_type_ids``
    where it is required). The text row counts attended tokens (``attention_mask``), padding gets 1.
    For packing, call it per sequence and concatenate the results on the last dim.
    """
    key = getattr(getattr(model, "config", None), "model_type", None)
    r = resolve(key)
    owner = next((m for m in model.modules() if isinstance(m, r.classes["model"])), None)
    if owner is None:
        raise PatchError(
            f"no {r.classes['model'].__name__} inside {type(model).__name__}",
            family=r.family, transformers_version=r.transformers_version,
            why="get_rope_index lives on that class in this transformers",
        )
    kwargs = dict(image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw, attention_mask=attention_mask)
    if r.entry.rope_index_mm_token_types:
        kwargs["mm_token_type_ids"] = _family(key).mm_token_types(owner.config, input_ids)
    mrope, _ = owner.get_rope_index(input_ids, **kwargs)
    text = text_row_from_mask(attention_mask, *input_ids.shape, device=input_ids.device)
    return torch.cat([text[None].to(mrope.dtype), mrope], dim=0)
