"""What a patch adds for a derived vision-language model (`tfcompat.registry.records.VisionDerivation`).

Its text model is patched as its text family; the model's own forward runs the vision tower and scatters the
features, then hands the packed position ids and the forward context down (proved when the entry was derived).
Two things are checked on the instance at `patch()` time, and one per forward:

- every module of the text family's classes sits inside the language model (a vision tower built from the same
  classes would otherwise run packed attention over image patches);
- where the owner builds the language model's mask itself (Gemma 3: from ``token_type_ids``), a packed row takes its
  boundaries instead: the owner's mask is dropped at the text model, and a packed call whose token types mark
  images (bidirectional attention within each image, which the packed core does not run) raises
  `InvalidInputError` before the owner runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core.context import CONTEXT_KWARG, ForwardContext
from ..errors import InvalidInputError, PatchError
from ..inputs.derived_vision import owner_of
from ..registry import Resolved

__all__ = ["VisionHook", "vision_hooks"]

# (module, pre-hook taking (module, args, kwargs), note)
VisionHook = tuple[torch.nn.Module, Callable[..., Any], str]


def vision_hooks(model: torch.nn.Module, r: Resolved, text_models: list[torch.nn.Module],
                 attentions: list[torch.nn.Module]) -> list[VisionHook]:
    """The forward pre-hooks a patch of ``model`` registers (with kwargs), after checking that ``text_models`` and
    ``attentions`` (the text family's modules found in ``model``) all sit inside its language model; `PatchError`
    otherwise. ``[]`` for an entry that is not a derived vision-language one."""
    v = r.entry.derived_vision
    if v is None:
        return []
    owner, language_model = owner_of(r, model)
    inside = {id(m) for m in language_model.modules()}
    outside = [type(m).__name__ for m in (*text_models, *attentions) if id(m) not in inside]
    if outside:
        raise r.error(PatchError, f"{type(model).__name__} holds {outside[0]} outside its language model",
                      why=f"the vision tower or projector is built from the text family's classes ({v.text_family}); "
                      "a patch would run packed attention there", supported=r.spec.supported,
                      fix="run the model unpatched")
    if v.owner_mask == "attention_mask":
        return []
    hooks: list[VisionHook] = [(tm, _drop_owner_mask, f"packed rows: the boundaries replace {v.owner}'s own mask "
                                f"({v.owner_mask})") for tm in text_models]
    if v.mask_inputs:
        hooks.insert(0, (owner, _refuse_image_blocks(r, v.mask_inputs),
                         f"packed rows with {', '.join(v.mask_inputs)} marking images raise InvalidInputError "
                         "(bidirectional attention within images is not packed)"))
    return hooks


def _drop_owner_mask(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """A packed forward's text model: the mask its owner built (a dict or 4-D tensor over the whole row) is left out;
    the forward context holds the boundaries."""
    if isinstance(kwargs.get(CONTEXT_KWARG), ForwardContext) and not (
            isinstance(kwargs.get("attention_mask"), torch.Tensor) and kwargs["attention_mask"].ndim == 2):
        kwargs["attention_mask"] = None
    return args, kwargs


def _refuse_image_blocks(r: Resolved, names: tuple[str, ...]) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not isinstance(kwargs.get(CONTEXT_KWARG), ForwardContext):
            return
        marked = [n for n in names if isinstance(kwargs.get(n), torch.Tensor) and bool(kwargs[n].any())]
        if marked:
            raise r.error(
                InvalidInputError, f"{marked[0]} marks image tokens on a packed row",
                why=f"{r.family} attends bidirectionally within each image where {marked[0]} marks it; tfcompat's "
                "packed attention is causal within each sequence and would silently drop that",
                supported="packed rows without token types (causal over images); per-sequence (unpacked) calls with "
                "them run stock", fix=f"leave {marked[0]} out of packed rows (then images attend causally, "
                "as stock does without them), or run the batch unpacked")

    return hook
