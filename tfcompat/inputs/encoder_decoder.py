"""`tfcompat.pack` for encoder-decoder vision-language models (`tfcompat.registry.derive_encoder_decoder`).

The packed row is the decoder's: each sequence's decoder ids back to back ``(1, sum L_dec)`` under the keyword the
model's forward takes them by (``decoder_input_ids``), with position ids restarting at 0 per sequence under the
keyword that reaches the decoder (``decoder_position_ids`` for VisionEncoderDecoder, ``position_ids`` for Florence-2).
Decoder ids come from the example, or from its ``labels`` through the function the model's forward shifts labels
with (run per sequence: a sequence starts with the decoder start token, not with the last label of the one before).
Every other input of an example is the encoder's, batched one row per sequence: ``(1, ...)`` tensors concatenated on
dim 0 (images of one size), token rows of different lengths right-padded (the ids with the pad token, the mask the
owner hands the decoder as its encoder mask with 0s: the padded encoder states are never read).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..core.labels import mask_starts, shift_labels
from ..core.packing import PackedSeqs, from_lengths
from ..errors import InvalidInputError
from ..registry import Resolved
from ..registry.records import EncoderDecoderDerivation

__all__ = ["pack_encoder_decoder"]


def pack_encoder_decoder(r: Resolved, model: torch.nn.Module, examples: Sequence[Mapping[str, Any]],
                         ignore_index: int = -100) -> tuple[dict[str, Any], torch.Tensor | None, PackedSeqs]:
    """``(model inputs, per-token targets (1, T) or None, boundaries)`` of ``examples`` (see the module docstring).

    Each example: the decoder ids ``(L,)`` / ``(1, L)`` under the forward's keyword, or ``labels`` (or both; labels
    are per decoder token, as the model's loss takes them). The targets are the labels where the model's loss reads
    each token's own label; where it shifts them (4.x VisionEncoderDecoder's ``ForCausalLMLoss``, BLIP's text
    decoder) they are shifted per sequence, and the packed labels hold ``ignore_index`` at each sequence start, so
    that the model's own loss over the row reads no label across a boundary: the stock loss of each sequence alone.
    Optionally an all-ones decoder mask (``decoder_attention_mask``; BLIP's ``attention_mask``:
    `EncoderDecoderDerivation.decoder_mask`), left out of the row; the encoder's inputs as its processor returns them
    for one sample (``pixel_values (1, C, H, W)``; Florence-2's prompt ``input_ids (1, P)`` and ``attention_mask (1,
    P)``). `InvalidInputError` naming the example otherwise."""
    d = r.entry.encoder_decoder
    if d is None:
        raise r.error(InvalidInputError, f"{r.family} is not an encoder-decoder model", why="no derivation",
                      fix="call tfcompat.pack")
    mask_key = d.decoder_mask or "decoder_attention_mask"  # the decoder's mask, all ones: left out of the row
    ids: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    encoder: dict[str, list[torch.Tensor]] = {}
    for i, ex in enumerate(examples):
        what = f"tfcompat.pack example {i}"
        if not isinstance(ex, Mapping):
            raise r.error(InvalidInputError, f"{what} is not a mapping", why=f"got {type(ex).__name__}",
                          fix=f"pass one dict per sequence: {{'{d.decoder_ids}' or 'labels': ..., 'pixel_values': "
                          "...}")
        row = _decoder_ids(r, d, model, ex, what)
        mask = ex.get(mask_key)
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.numel() != row.numel()
                                 or not bool(mask.bool().all())):
            raise r.error(InvalidInputError, f"{what}: {mask_key} is not all ones over the decoder ids",
                          why="a packed row carries no padding", fix="drop the padded decoder tokens before packing")
        ids.append(row)
        if ex.get("labels") is not None:
            labels.append(torch.as_tensor(ex["labels"]).reshape(-1))  # (1, L) or (L,) -> (L,)
            if labels[-1].numel() != row.numel():
                raise r.error(InvalidInputError, f"{what}: labels and {d.decoder_ids} differ in length",
                              why=f"{labels[-1].numel()} labels, {row.numel()} decoder ids",
                              fix="pass one label per decoder token")
        names = set(ex) - {d.decoder_ids, "labels", mask_key}
        if i and names != set(encoder):
            raise r.error(InvalidInputError, f"{what} has other encoder inputs than example 0",
                          why=f"{sorted(names)} against {sorted(encoder)}", fix="give every example the same inputs")
        for name in names:
            value = ex[name]
            if not isinstance(value, torch.Tensor) or value.ndim < 2 or value.shape[0] != 1:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise r.error(InvalidInputError, f"{what}: {name} is not one sample's batch of one",
                              why=f"got {got}", fix=f"pass {name} as the processor returns it for one sample (1, ...)")
            encoder.setdefault(name, []).append(value)
    if labels and len(labels) != len(ids):
        raise r.error(InvalidInputError, "tfcompat.pack got labels for some examples only",
                      why=f"{len(labels)} of {len(ids)} examples", fix="give every example labels, or none")
    seqs = from_lengths([x.numel() for x in ids], device=ids[0].device)
    inputs: dict[str, Any] = {
        d.decoder_ids: torch.cat(ids)[None],  # (T,) -> (1, T)
        d.decoder_positions: torch.cat([torch.arange(x.numel(), device=x.device) for x in ids])[None],
    }
    for name, parts in encoder.items():
        inputs[name] = _batched(r, d, model, name, parts, encoder)
    targets = torch.cat(labels)[None] if labels else None  # (T,) -> (1, T)
    if targets is not None:
        if _loss_shifts(r, d, model):
            inputs["labels"] = mask_starts(targets, seqs, ignore_index)
            targets = shift_labels(targets, seqs, ignore_index)
        else:
            inputs["labels"] = targets
    return inputs, targets, seqs


def _loss_shifts(r: Resolved, d: EncoderDecoderDerivation, model: torch.nn.Module) -> bool:
    """Whether the model's forward shifts ``labels`` in its loss (`EncoderDecoderDerivation.labels_loss`); asked of
    ``model.loss_function`` where the forward hands it the labels alone: two tokens whose logits favour class 1 then
    class 0, both labelled 1, lose about 0 shifted (token 0's target is label 1) and about 4.5 aligned. A decoder
    that shifts them itself (``"shifted"``: BLIP's, by ``labels[:, 1:]``) does."""
    if d.labels_loss in ("aligned", "shifted"):
        return d.labels_loss == "shifted"
    if d.labels_loss != "loss_function":
        raise r.error(InvalidInputError, f"tfcompat.pack got labels, and {d.model}.forward's loss reads them in a "
                      "form tfcompat does not know", why="its loss over the packed row could read labels across "
                      "sequence boundaries", fix=f"pass {d.decoder_ids} without labels and compute the loss from the "
                      "logits with pack's targets of your own labels")
    logits = torch.tensor([[[0.0, 9.0], [9.0, 0.0]]])  # (1, 2, V=2)
    loss = model.loss_function(logits=logits, labels=torch.tensor([[1, 1]]), vocab_size=2)  # type: ignore[operator]
    return float(loss) < 1.0


def _decoder_ids(r: Resolved, d: EncoderDecoderDerivation, model: torch.nn.Module, ex: Mapping[str, Any], what: str
                 ) -> torch.Tensor:
    """The example's decoder ids ``(L,)``: given, or shifted from its labels by the model's own function."""
    given = ex.get(d.decoder_ids)
    if given is None and ex.get("labels") is not None:
        if not d.labels_shift:
            raise r.error(InvalidInputError, f"{what} has labels and no {d.decoder_ids}",
                          why=f"{d.model}.forward builds no decoder ids from labels",
                          fix=f"give every example its {d.decoder_ids}")
        fn = getattr(importlib.import_module(r.entry.module), d.labels_shift[0])
        args = [_attribute(model, src.removeprefix("self.")) for src in d.labels_shift[1]]
        try:
            given = fn(torch.as_tensor(ex["labels"]).reshape(1, -1), *args)  # (L,) -> (1, L)
        except (ValueError, TypeError) as exc:
            raise r.error(InvalidInputError, f"{what}: {d.labels_shift[0]} of its labels failed",
                          why=f"{type(exc).__name__}: {exc}", fix=f"pass {d.decoder_ids}, or set the config's "
                          f"{', '.join(d.labels_shift[1])}") from None
    if not isinstance(given, torch.Tensor) or given.numel() == 0 or given.ndim > 2 or (
            given.ndim == 2 and given.shape[0] != 1):
        got = tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__
        raise r.error(InvalidInputError, f"{what}: {d.decoder_ids} must hold one non-empty sequence",
                      why=f"got {got}", fix=f"pass {d.decoder_ids} (L,) or (1, L), or labels")
    return given.reshape(-1)


def _attribute(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def _batched(r: Resolved, d: EncoderDecoderDerivation, model: torch.nn.Module, name: str, parts: list[torch.Tensor],
             encoder: dict[str, list[torch.Tensor]]) -> torch.Tensor:
    """One encoder input of every sequence as a batch, one row per sequence: ``(1, ...)`` parts on dim 0, token
    rows ``(1, P_i)`` of different lengths right-padded (with the encoder mask named by the derivation)."""
    if all(p.shape == parts[0].shape for p in parts):
        return torch.cat(parts)  # N x (1, ...) -> (N, ...)
    if not all(p.ndim == 2 for p in parts):
        raise r.error(InvalidInputError, f"tfcompat.pack: the examples' {name} differ in shape",
                      why=f"got {[tuple(p.shape) for p in parts]}; the encoder runs them as one batch",
                      fix=f"give every example {name} of one shape (images of one size)")
    if not d.encoder_mask or d.encoder_mask not in encoder:
        raise r.error(InvalidInputError, f"tfcompat.pack: the examples' {name} differ in length",
                      why="the encoder runs them right-padded, and "
                      + (f"{d.owner}.forward hands the decoder no encoder mask: it would read the padded states"
                         if not d.encoder_mask else f"the examples carry no {d.encoder_mask} to say which are padding"),
                      fix=f"give every example its {d.encoder_mask}" if d.encoder_mask else "pack sequences whose "
                      f"{name} are of one length")
    width = max(p.shape[1] for p in parts)
    config: Any = model.config  # a PretrainedConfig
    pad = 0 if name == d.encoder_mask else getattr(config.get_text_config(), "pad_token_id", None) or 0
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=pad) for p in parts])  # (N, P)
