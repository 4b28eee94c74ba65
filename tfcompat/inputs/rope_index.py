"""``rope_index``: contract position ids ``(4, B, L)`` from the installed transformers' own M-RoPE index, or
from the family's reference (`tfcompat.reference_rope`)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Literal, get_args

import torch

from ..core.position_ids import text_row_from_mask
from ..errors import InvalidInputError
from ..registry import families
from .derived_vision import is_derived_vision, mrope_positions, owner_of, text_positions
from .reference_rope import REFERENCES
from .vision_inputs import family_of, vision_call

__all__ = ["Impl", "rope_index"]

Impl = Literal["installed", "reference"]


@torch.no_grad()
def rope_index(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | Sequence[float] | None = None,
    impl: Impl = "installed",
) -> torch.Tensor:
    """Position ids ``(4, B, L)`` = ``[text; t; h; w]`` for ``input_ids (B, L)``, on every transformers version;
    for a derived vision-language family with 1-D RoPE (LLaVA, InternVL, Gemma 3, ...) the text row alone, ``(B, L)``;
    for one whose model numbers M-RoPE itself (GLM-OCR, PaddleOCR-VL, ...) ``(4, B, L)`` from its own method.

    Calls the installed ``get_rope_index`` with that version's signature (building ``mm_token_type_ids``
    where it is required). The text row counts attended tokens (``attention_mask``), padding gets 1.
    ``second_per_grid_ts (n_videos,)``: seconds per temporal grid step (Qwen2.5-VL only; a tensor or a list).
    impl: "installed" (what the stock model of this version computes) or "reference" (tfcompat's own, named by
    ``resolve(family).spec.reference_rope_index``: the original model's semantics, without the installed
    version's known deviations, listed in ``resolve(family).entry.rope_index_deviations``).
    For packing, call it per sequence and concatenate the results on the last dim (or use `tfcompat.pack`).

    Raises `InvalidInputError` for an unknown ``impl``, a text-only family, ids that are not an integer
    ``(B, L)`` tensor, grids that disagree with the placeholder tokens (one grid row per image / video, in order),
    and ``second_per_grid_ts`` for a family whose index takes none, or of another length than the videos.
    """
    r = family_of(model)
    derived = r.entry.derived_vision
    if derived is not None and derived.positions_call:  # M-RoPE numbered by the model's own method
        if second_per_grid_ts is not None:
            raise r.error(InvalidInputError, f"{r.family} takes no second_per_grid_ts in rope_index",
                          fix="drop the argument")
        text_positions(r, input_ids, attention_mask)  # the ids' and the mask's checks
        grids = {"image_grid_thw": image_grid_thw, "video_grid_thw": video_grid_thw}
        return mrope_positions(r, owner_of(r, model)[0], derived.positions_call, input_ids, grids, attention_mask)
    if is_derived_vision(r):  # 1-D RoPE: the text row is all there is (the same contract's first row)
        if image_grid_thw is not None or video_grid_thw is not None or second_per_grid_ts is not None:
            raise r.error(InvalidInputError, f"{r.family} takes no vision grids in rope_index",
                          why="its text model takes 1-D positions: image tokens count like text tokens",
                          fix="call rope_index(model, input_ids, attention_mask=...) only")
        return text_positions(r, input_ids, attention_mask)
    if impl not in get_args(Impl):
        raise r.error(InvalidInputError, f"unknown rope_index impl {impl!r}", why="impl picks whose M-RoPE index runs",
                      fix="pass impl='installed' (the stock model's) or impl='reference' (tfcompat's)",
                      supported=", ".join(map(repr, get_args(Impl))))
    owner = vision_call(r, model, input_ids, {"image_grid_thw": image_grid_thw, "video_grid_thw": video_grid_thw},
                        what="rope_index", purpose="rope_index (get_rope_index lives with it)",
                        attention_mask=attention_mask).owner
    if second_per_grid_ts is not None and not isinstance(second_per_grid_ts, torch.Tensor):
        # a processor called without return_tensors="pt" gives a list of floats
        try:
            second_per_grid_ts = torch.tensor(second_per_grid_ts, dtype=torch.float32)
        except (TypeError, ValueError) as exc:
            raise r.error(InvalidInputError, "second_per_grid_ts must be numbers",
                          why=f"got {second_per_grid_ts!r} ({exc})",
                          fix="pass the processor's second_per_grid_ts: a tensor or list of seconds, one per video"
                          ) from exc
    if second_per_grid_ts is not None:  # one behaviour for both impls: the installed signature decides
        if "second_per_grid_ts" not in inspect.signature(owner.get_rope_index).parameters:
            raise r.error(InvalidInputError, f"{r.family} takes no second_per_grid_ts",
                          why="only families with absolute-time video positions (Qwen2.5-VL) use it",
                          fix="drop the argument")
        videos = 0 if video_grid_thw is None else video_grid_thw.shape[0]
        if second_per_grid_ts.ndim != 1 or second_per_grid_ts.shape[0] != videos:
            raise r.error(InvalidInputError, "second_per_grid_ts must hold one value per video",
                          why=f"second_per_grid_ts {tuple(second_per_grid_ts.shape)}, {videos} videos in "
                          "video_grid_thw",
                          fix="pass the processor's second_per_grid_ts: (n_videos,), seconds per temporal grid step")
    text = text_row_from_mask(attention_mask, input_ids.shape[0], input_ids.shape[1], device=input_ids.device)
    if impl == "reference":
        name = r.spec.reference_rope_index
        if name is None:
            raise r.error(InvalidInputError, f"no reference M-RoPE index for {r.family}", fix="use impl='installed'",
                          supported=", ".join(k for k, f in families().items() if f.reference_rope_index))
        mrope = REFERENCES[name].compute(owner.config, input_ids.cpu(), image_grid_thw, video_grid_thw,
                                         second_per_grid_ts, attention_mask)
        return torch.cat([text[None].cpu(), mrope], dim=0).to(input_ids.device)
    if ("video_grid_unsplit" in r.entry.rope_index_deviations and video_grid_thw is not None
            and bool((video_grid_thw[:, 0] > 1).any())):
        raise r.error(
            InvalidInputError, f"the installed {r.family} get_rope_index cannot place videos of more than one frame",
            why=REFERENCES[str(r.spec.reference_rope_index)].deviations["video_grid_unsplit"],
            supported=f"impl='installed' with images and one-frame videos on {r.entry.versions}",
            fix="use impl='reference' (the model's own semantics), or another transformers release",
        )
    kwargs = dict(image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw, attention_mask=attention_mask)
    if second_per_grid_ts is not None:
        kwargs["second_per_grid_ts"] = second_per_grid_ts
    if r.entry.rope_index_mm_token_types:
        kwargs["mm_token_type_ids"] = r.spec.mm_token_types(owner.config, input_ids)  # type: ignore[misc]  # vision
    mrope, _ = owner.get_rope_index(input_ids, **kwargs)
    return torch.cat([text[None].to(mrope.dtype), mrope], dim=0)
