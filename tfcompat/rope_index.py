"""``rope_index``: contract position ids ``(4, B, L)`` from the installed transformers' own M-RoPE index."""

from __future__ import annotations

import inspect
from typing import Literal

import torch

from .errors import InvalidInputError, PatchError
from .mrope import reference_rope_index
from .registry import families
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
    second_per_grid_ts: torch.Tensor | None = None,
    impl: Literal["installed", "reference"] = "installed",
) -> torch.Tensor:
    """Position ids ``(4, B, L)`` = ``[text; t; h; w]`` for ``input_ids (B, L)``, on every transformers version.

    Calls the installed ``get_rope_index`` with that version's signature (building ``mm_token_type_ids``
    where it is required). The text row counts attended tokens (``attention_mask``), padding gets 1.
    ``second_per_grid_ts (n_videos,)``: seconds per temporal grid step (Qwen2.5-VL only).
    impl: "installed" (what the stock model of this version computes) or "reference" (tfcompat's own, for the
    Qwen-VL families: the original Qwen semantics, without the installed version's known deviations,
    listed in ``resolve(family).entry.rope_index_deviations``).
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
    text = text_row_from_mask(attention_mask, *input_ids.shape, device=input_ids.device)
    if impl == "reference":
        if not _family(key).reference_rope_index:
            raise InvalidInputError(
                f"no reference M-RoPE index for {key}", family=r.family, transformers_version=r.transformers_version,
                supported=", ".join(k for k, f in families().items() if f.reference_rope_index), fix="use impl='installed'",
            )
        mrope = reference_rope_index(owner.config, input_ids.cpu(), image_grid_thw, video_grid_thw,
                                     second_per_grid_ts, attention_mask)
        return torch.cat([text[None].cpu(), mrope], dim=0).to(input_ids.device)
    kwargs = dict(image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw, attention_mask=attention_mask)
    if second_per_grid_ts is not None:
        if "second_per_grid_ts" not in inspect.signature(owner.get_rope_index).parameters:
            raise InvalidInputError(
                f"{r.family} takes no second_per_grid_ts", family=r.family, transformers_version=r.transformers_version,
                why="only families with absolute-time video positions (Qwen2.5-VL) use it", fix="drop the argument",
            )
        kwargs["second_per_grid_ts"] = second_per_grid_ts
    if r.entry.rope_index_mm_token_types:
        kwargs["mm_token_type_ids"] = _family(key).mm_token_types(owner.config, input_ids)
    mrope, _ = owner.get_rope_index(input_ids, **kwargs)
    return torch.cat([text[None].to(mrope.dtype), mrope], dim=0)
