"""``rope_index``: contract position ids ``(4, B, L)`` from the installed transformers' own M-RoPE index, or
from the family's reference (`tfcompat.reference_rope`)."""

from __future__ import annotations

import inspect
from typing import Literal

import torch

from .errors import InvalidInputError
from .position_ids import text_row_from_mask
from .reference_rope import REFERENCES
from .registry import families, resolve

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
    impl: "installed" (what the stock model of this version computes) or "reference" (tfcompat's own, named by
    ``resolve(family).spec.reference_rope_index``: the original model's semantics, without the installed
    version's known deviations, listed in ``resolve(family).entry.rope_index_deviations``).
    For packing, call it per sequence and concatenate the results on the last dim.
    """
    r = resolve(getattr(getattr(model, "config", None), "model_type", None))
    owner = r.vision_modules(model, purpose="rope_index (get_rope_index lives with it)").owner
    text = text_row_from_mask(attention_mask, *input_ids.shape, device=input_ids.device)
    if impl == "reference":
        name = r.spec.reference_rope_index
        if name is None:
            raise InvalidInputError(
                f"no reference M-RoPE index for {r.family}", family=r.family, transformers_version=r.transformers_version,
                supported=", ".join(k for k, f in families().items() if f.reference_rope_index), fix="use impl='installed'",
            )
        mrope = REFERENCES[name].compute(owner.config, input_ids.cpu(), image_grid_thw, video_grid_thw,
                                         second_per_grid_ts, attention_mask)
        return torch.cat([text[None].cpu(), mrope], dim=0).to(input_ids.device)
    if ("video_grid_unsplit" in r.entry.rope_index_deviations and video_grid_thw is not None
            and bool((video_grid_thw[:, 0] > 1).any())):
        raise InvalidInputError(
            f"the installed {r.family} get_rope_index cannot place videos of more than one frame",
            family=r.family, transformers_version=r.transformers_version,
            why=REFERENCES[str(r.spec.reference_rope_index)].deviations["video_grid_unsplit"],
            supported=f"impl='installed' with images and one-frame videos on {r.entry.versions}",
            fix="use impl='reference' (the model's own semantics), or another transformers release",
        )
    kwargs = dict(image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw, attention_mask=attention_mask)
    if second_per_grid_ts is not None:
        if "second_per_grid_ts" not in inspect.signature(owner.get_rope_index).parameters:
            raise InvalidInputError(
                f"{r.family} takes no second_per_grid_ts", family=r.family, transformers_version=r.transformers_version,
                why="only families with absolute-time video positions (Qwen2.5-VL) use it", fix="drop the argument",
            )
        kwargs["second_per_grid_ts"] = second_per_grid_ts
    if r.entry.rope_index_mm_token_types:
        kwargs["mm_token_type_ids"] = r.spec.mm_token_types(owner.config, input_ids)
    mrope, _ = owner.get_rope_index(input_ids, **kwargs)
    return torch.cat([text[None].to(mrope.dtype), mrope], dim=0)
