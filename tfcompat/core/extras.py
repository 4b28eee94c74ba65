"""What a family's text model consumes besides the input embeddings, and how it travels.

Qwen3-VL's text model adds DeepStack features (the vision tower's intermediate-layer features) to the hidden
states of its first decoder layers at the visual tokens. Whoever runs the vision tower outside the forward
(`tfcompat.embed_inputs`) must hand those on: `VisualExtras` carries them, in the forward's kwargs under
`VISUAL_KWARG`, to the patched text model, which passes them to the stock one; `tfcompat.ulysses.shard_inputs`
slices them to a rank's tokens. `Embedded` is what `tfcompat.embed_inputs` returns: the input embeddings and
those extras.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["VISUAL_KWARG", "Embedded", "VisualExtras"]

VISUAL_KWARG = "tfcompat_visual"


class VisualExtras(NamedTuple):
    """DeepStack inputs of the text model for one forward's tokens.

    visual_pos_masks: ``(B, L)`` bool, True at image and video tokens.
    deepstack_visual_embeds: one ``(n_visual, H)`` tensor per DeepStack layer; row ``i`` belongs to the ``i``-th
        True of ``visual_pos_masks`` in row-major order.
    """

    visual_pos_masks: torch.Tensor
    deepstack_visual_embeds: tuple[torch.Tensor, ...]

    def pad_and_slice(self, pad: int, local: slice, visual_before: int, visual_inside: int) -> VisualExtras:
        """This rank's part of a ``(1, T)`` row padded by ``pad`` non-visual tokens: the mask's ``local`` slice
        and the deepstack rows of the ``visual_inside`` visual tokens after the first ``visual_before``."""
        mask = torch.cat([self.visual_pos_masks, self.visual_pos_masks.new_zeros(1, pad)], dim=1)[:, local]
        rows = tuple(x.narrow(0, visual_before, visual_inside) for x in self.deepstack_visual_embeds)
        return VisualExtras(mask, rows)


class Embedded(NamedTuple):
    """What `embed_inputs` returns: the input embeddings and the text model's other inputs.

    inputs_embeds: ``(B, L, H)``. visual: the DeepStack inputs (`VisualExtras`) for families
    whose text model takes them (Qwen3-VL), else None. moe_token_types: ``(B, L)`` the modality of each token for a
    family whose MoE routes by it (ERNIE-4.5-VL's ``moe_mm_token_type_ids``), else None.
    """

    inputs_embeds: torch.Tensor
    visual: VisualExtras | None = None
    moe_token_types: torch.Tensor | None = None

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for the patched model: ``inputs_embeds`` and, where present, the extras."""
        inputs: dict[str, Any] = {"inputs_embeds": self.inputs_embeds}
        if self.visual is not None:
            inputs[VISUAL_KWARG] = self.visual
        if self.moe_token_types is not None:
            inputs["moe_mm_token_type_ids"] = self.moe_token_types
        return inputs
