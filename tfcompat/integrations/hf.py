"""Hugging Face ``Trainer`` / TRL ``SFTTrainer``: a data collator that packs each batch into one row.

``PackedCollator(model)`` is the vision-language counterpart of transformers' ``DataCollatorWithFlattening``:
it turns the list of per-sequence features a ``Trainer`` batch holds into one packed row with `tfcompat.pack`
(each sequence's position ids from `tfcompat.rope_index` on that sequence alone, pixel values and grids
concatenated in order, labels ignored at each sequence start), for a model patched with `tfcompat.patch`::

    tfcompat.patch(model)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds,
                                   data_collator=tfcompat.integrations.hf.PackedCollator(model))

The loss the patched model returns on such a row is the per-sequence loss: the token-weighted mean over the
row's sequences that a per-sequence loop computes. Under gradient accumulation the Trainer divides by
``num_items_in_batch`` (the targets of every micro-batch of the step; on packed rows it counts exactly the
per-sequence targets, the label at each sequence start being ignored) where the model class accepts loss
kwargs; classes that declare ``accepts_loss_kwargs = False`` (Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4V and their
MoE variants; not Qwen2-VL) get the mean of the micro-batches' losses instead, as padded batches do, unless
``model.accepts_loss_kwargs = True`` is set (their forwards pass the count on to the loss).

Text models need no collator of tfcompat's: ``DataCollatorWithFlattening`` (and TRL's ``padding_free=True``)
rows run on a patched model as they are. TRL's ``SFTTrainer`` refuses ``padding_free=True`` for vision datasets
and custom collators; give it this collator with ``padding_free=False``, ``remove_unused_columns=False`` and a
processed dataset (``dataset_kwargs={"skip_prepare_dataset": True}``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..core.context import CONTEXT_KWARG
from ..errors import InvalidInputError, PatchedModelError
from ..hf.patching import is_patched
from ..inputs.pack import pack
from ..inputs.rope_index import Impl
from ..inputs.vision_inputs import family_of

__all__ = ["PackedCollator"]

_FLOAT_KEYS = frozenset({"pixel_values", "pixel_values_videos", "second_per_grid_ts"})


class PackedCollator:
    """A ``data_collator`` for ``transformers.Trainer`` (and TRL's ``SFTTrainer``) that packs a batch into one row.

    model: the model the Trainer trains (any registered family, text or vision-language); it must be patched
        with `tfcompat.patch` before the first batch is collated (a packed row through stock attention would
        attend across sequences). The collator holds it for its config and its M-RoPE index.
    ignore_index: the label ignored by the loss (transformers' ``-100``).
    impl: the M-RoPE index used per sequence (`tfcompat.rope_index`): ``"installed"`` (the stock model's) or
        ``"reference"``.

    Call it with a list of features, one mapping per sequence (a processor's or tokenizer's output for one
    sample; lists, NumPy arrays or tensors): ``input_ids`` ``(L,)`` or ``(1, L)``, optional ``labels`` (same
    length, unshifted, ``ignore_index`` where no loss is wanted; features without labels train on every token,
    ``labels = input_ids``, as ``DataCollatorWithFlattening`` does), ``attention_mask`` (all ones),
    ``pixel_values`` with ``image_grid_thw``, ``pixel_values_videos`` with ``video_grid_thw``,
    ``second_per_grid_ts``, ``mm_token_type_ids`` (rebuilt from the ids). It returns the model's kwargs for one
    packed row of ``T`` tokens, all tensors (the Trainer moves them to the device): ``input_ids`` ``(1, T)``,
    ``position_ids`` ``(4, 1, T)`` (vision-language families) or ``(1, T)``, ``labels`` ``(1, T)``, the
    concatenated vision inputs, ``mm_token_type_ids`` where the installed forward takes them. The patched
    forward finds the boundaries from the position ids (one host sync per forward).

    Raises `InvalidInputError` for what `tfcompat.pack` refuses (naming the example), for features whose
    values are not numeric arrays, and for a batch the installed stock forward cannot take in one call (known
    issues of the registry entry): images with videos where the forward rejects the mix (GLM-4V; `tfcompat.pack`
    would embed the row with the vision tower, which a collator must not run, since the data loader collates
    ahead of the optimizer step), any video where it rejects every video (Qwen2-VL on 4.54, GLM-4V on 4.55,
    Qwen3-VL and Qwen3.5 on 5.3). `PatchedModelError` when the model is not patched.
    """

    def __init__(self, model: torch.nn.Module, *, ignore_index: int = -100, impl: Impl = "installed") -> None:
        self.model = model
        self.ignore_index = ignore_index
        self.impl = impl
        self.resolved = family_of(model)

    def __call__(self, features: Sequence[Mapping[str, Any]], return_tensors: str | None = None) -> dict[str, Any]:
        r = self.resolved
        if return_tensors not in (None, "pt"):
            raise self.resolved.error(InvalidInputError, f"PackedCollator cannot return {return_tensors!r} tensors",
                                      why="the packed row feeds a torch model",
                                      fix="leave return_tensors out, or pass 'pt'", supported="'pt'")
        if not is_patched(self.model):
            raise r.error(
                PatchedModelError, f"PackedCollator's {type(self.model).__name__} is not patched",
                why="a packed row holds several sequences; the stock attention would let each attend to the ones "
                "before it (no error, a wrong loss)",
                fix="call tfcompat.patch(model) before training (and keep the handle active while the Trainer runs)")
        examples = [self._example(i, f) for i, f in enumerate(features)]
        self._check_known_issues(examples)
        if examples and all(ex.get("labels") is None for ex in examples):
            examples = [dict(ex, labels=ex["input_ids"]) for ex in examples]
        packed = pack(self.model, examples, ignore_index=self.ignore_index, impl=self.impl)
        return {k: v for k, v in packed.model_inputs.items() if k != CONTEXT_KWARG}

    def _example(self, i: int, feature: Mapping[str, Any]) -> dict[str, Any]:
        """Feature ``i`` with every value a tensor (ids and grids int64, pixels and seconds floating point)."""
        if not isinstance(feature, Mapping):
            raise self.resolved.error(InvalidInputError, f"PackedCollator feature {i} is not a mapping",
                                      why=f"got {type(feature).__name__}",
                                      fix="give the Trainer a dataset of dicts (a processor's output per sample)")
        out: dict[str, Any] = {}
        for name, value in feature.items():
            if value is None or isinstance(value, torch.Tensor):
                out[name] = value
                continue
            try:
                tensor = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError) as e:
                raise self.resolved.error(
                    InvalidInputError, f"PackedCollator feature {i}: {name} is not a numeric array",
                    why=f"{type(value).__name__}: {e}", fix="pass lists, NumPy arrays or tensors of numbers (a "
                    "processor's output per sample; drop text columns)") from None
            floating = name in _FLOAT_KEYS
            out[name] = tensor.float() if floating and not tensor.is_floating_point() else (
                tensor if floating else tensor.long())
        return out

    def _check_known_issues(self, examples: list[dict[str, Any]]) -> None:
        """Batches whose stock forward `tfcompat.pack` would replace by `tfcompat.embed_inputs` (running the tower)."""
        r = self.resolved
        images = any(ex.get("pixel_values") is not None for ex in examples)
        videos = any(ex.get("pixel_values_videos") is not None for ex in examples)
        issues = r.entry.known_issues
        if videos and ("videos_rejected" in issues or (images and "images_with_videos_rejected" in issues)):
            issue = "videos_rejected" if "videos_rejected" in issues else "images_with_videos_rejected"
            raise r.error(
                InvalidInputError, "PackedCollator got a batch the installed stock forward cannot take in one call",
                why=f"known issue {issue!r} of the registry entry {r.entry.versions}: the forward rejects "
                + ("every video" if issue == "videos_rejected" else "images and videos together; tfcompat.pack would "
                   "embed the row with the vision tower, which a collator must not run (the data loader collates "
                   "ahead of the optimizer step)"),
                fix="keep videos out of the batches"
                + ("" if issue == "videos_rejected" else " that hold images (group the dataset by modality)")
                + ", or pack inside the training step: override Trainer.compute_loss to call "
                "tfcompat.pack(model, examples) on the raw features", supported=f"entry {r.entry.versions}")
