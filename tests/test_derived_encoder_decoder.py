"""Encoder-decoder vision-language models (`tfcompat.registry.derive_encoder_decoder`): the decoder's row is packed.

Rule: per decoder token, the patched model on one packed decoder row (``tfcompat.pack``: decoder ids of sequences of
different lengths, position ids restarting per sequence, each sequence's own image and, for Florence-2, its own
prompt of a different length) gives the logits, and every parameter the gradients, of the stock model run on each
sequence alone (eager and sdpa references). Control: the unpatched model on the same decoder row does not. What
cannot be proved is refused at ``patch()`` / ``resolve()``, naming why.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import pytest
import torch

import tfcompat
from tfcompat.core.cross_attention import cross_attention
from tfcompat.core.packing import from_lengths
from tfcompat.errors import InvalidInputError, PatchError
from tfcompat.registry.derive_vision import vision_types
from tfcompat.tiny_models import attention_implementations, encoder_decoder_examples, tiny_config, tiny_model

LENGTHS = (7, 13, 10)
TOLERANCE = 1e-5
GRAD_TOLERANCE = 2e-5
IMPLS = ("eager", "sdpa")


def _installed(model_type: str) -> bool:
    return model_type in vision_types()


def _ved(decoder_type: str, impl: str) -> torch.nn.Module:
    """A tiny VisionEncoderDecoderModel: a ViT encoder and a tiny causal LM of ``decoder_type`` with cross-attention,
    the pad and start ids set as its docs set them for training."""
    from transformers import VisionEncoderDecoderConfig, VisionEncoderDecoderModel, ViTConfig

    encoder = ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        image_size=32, patch_size=8)
    decoder = tiny_config(decoder_type, "causal_lm")
    decoder.is_decoder, decoder.add_cross_attention = True, True
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.pad_token_id, config.decoder_start_token_id = 1, 2
    config._attn_implementation = impl
    config.encoder._attn_implementation = config.decoder._attn_implementation = impl
    torch.manual_seed(0)
    try:
        return VisionEncoderDecoderModel(config).eval()
    except ValueError as exc:  # TrOCR's decoder has no sdpa attention: there is no such stock reference
        if "scaled_dot_product_attention" not in str(exc):
            raise
        pytest.skip(f"the {decoder_type} decoder has no {impl} attention")


def _logits(model: torch.nn.Module, **inputs: Any) -> torch.Tensor:
    return model(**inputs, use_cache=False).logits[0].float()  # (L, V)


def _diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().amax(-1).clamp_min(1e-6)  # (T,)
    return float(((got - expected).abs().amax(-1) / scale).max())


def _grads(model: torch.nn.Module, loss: Any) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _check(model: torch.nn.Module, examples: list[dict[str, Any]]) -> None:
    """Packed (patched) vs stock per sequence, forward and backward, with the control."""
    with torch.no_grad():
        expected = torch.cat([_logits(model, **ex) for ex in examples])  # (T, V)
    w = torch.randn(expected.shape[-1], generator=torch.Generator().manual_seed(3))
    stock_grads = _grads(model, lambda: sum((_logits(model, **ex) @ w).sum() for ex in examples))
    with tfcompat.patch(model, prove=False):
        packed = tfcompat.pack(model, examples)
        with torch.no_grad():
            got = _logits(model, **packed.model_inputs)
        grads = _grads(model, lambda: (_logits(model, **packed.model_inputs) @ w).sum())
        d = tfcompat.registry.resolve_model(model).entry.encoder_decoder
    assert _diff(got, expected) <= TOLERANCE
    assert grads.keys() == stock_grads.keys()
    for name, g in stock_grads.items():
        assert float((grads[name] - g).abs().max()) / max(1.0, float(g.abs().max())) <= GRAD_TOLERANCE, name
    # the control: the unpatched model on the decoder row (positions running on) and the first sequence's encoder
    first = {k: v for k, v in examples[0].items() if k not in (d.decoder_ids, "labels")}
    with torch.no_grad():
        control = _logits(model, **first, **{d.decoder_ids: packed.model_inputs[d.decoder_ids]})
    assert _diff(control, expected) > 1e-3


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("decoder", ["bert", "gpt2", "mbart", "trocr", "roberta"])
def test_vision_encoder_decoder_packed_equals_per_sequence(decoder: str, impl: str) -> None:
    """Donut / Nougat (MBart), TrOCR (its per-sequence layers), GPT-2 and BERT-style decoders alike."""
    if not _installed("vision-encoder-decoder"):
        pytest.skip("no VisionEncoderDecoder on this release")
    model = _ved(decoder, impl)
    try:
        tfcompat.resolve(model.config.decoder.model_type)
    except tfcompat.PatchError:  # a decoder family tfcompat refuses on this release (4.x RoBERTa's positions)
        with pytest.raises(tfcompat.PatchError, match="is not a text family tfcompat patches"):
            tfcompat.patch(model)
        return
    params = inspect.signature(model.decoder.forward).parameters
    if "position_ids" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        with pytest.raises(tfcompat.PatchError, match="takes no position ids"):  # 4.x MBartForCausalLM
            tfcompat.patch(model)
        return
    _check(model, encoder_decoder_examples(model, LENGTHS))


@pytest.mark.parametrize("impl", IMPLS)
def test_vision_encoder_decoder_packed_from_labels(impl: str) -> None:
    """Labels alone: pack shifts each sequence's by the model's own function (the first decoder token of a sequence
    is the start token, not the last label of the sequence before); the model's own loss over the packed row is the
    stock mean over the sequences' targets, whether that loss reads each token's label (5.x) or shifts them again
    (4.x's ``ForCausalLMLoss``: pack's targets are then shifted per sequence, and no label is read across a
    boundary)."""
    if not _installed("vision-encoder-decoder"):
        pytest.skip("no VisionEncoderDecoder on this release")
    model = _ved("bert", impl)
    examples = [{"pixel_values": ex["pixel_values"], "labels": ex["decoder_input_ids"]}
                for ex in encoder_decoder_examples(model, LENGTHS)]
    _check(model, examples)
    with torch.no_grad():
        stock = [model(**ex) for ex in examples]
        with tfcompat.patch(model, prove=False):
            packed = tfcompat.pack(model, examples)
            inputs = packed.model_inputs
            assert int(inputs["decoder_input_ids"][0, LENGTHS[0]]) == model.config.decoder_start_token_id
            got = float(model(**inputs).loss)
        counts = [int((packed.shift_labels[0, s:e] != -100).sum()) for s, e in zip(
            packed.seqs.cu_seqlens[:-1].tolist(), packed.seqs.cu_seqlens[1:].tolist())]
        loss = sum(float(o.loss) * n for o, n in zip(stock, counts)) / sum(counts)
        # the targets per token: what the stock loss of each sequence reads
        logits = torch.cat([o.logits[0] for o in stock])  # (T, V)
        assert abs(float(torch.nn.functional.cross_entropy(logits, packed.shift_labels[0])) - loss) <= 1e-5 * loss
    assert abs(got - loss) <= 1e-5 * abs(loss)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("model_type", ["florence2", "pp_formulanet"])
def test_vision_language_encoder_decoder_packed_equals_per_sequence(model_type: str, impl: str) -> None:
    """Florence-2 (a BART encoder over image features and prompts of different lengths, right-padded as a batch)
    and PP-FormulaNet (a vision encoder), each sequence's decoder reading its own encoder states."""
    if not _installed(model_type):
        pytest.skip(f"no {model_type} on this release")
    try:
        tfcompat.resolve(model_type)
    except PatchError as exc:  # 4.x Florence-2 calls its BART whole: its BART decoder is refused as a text family
        pytest.skip(f"refused on this release: {exc.what}")
    model = tiny_model(model_type, "image_text_to_text", attn_implementation=impl)
    examples = encoder_decoder_examples(model, LENGTHS)
    if model_type == "florence2":
        assert len({ex["input_ids"].shape[1] for ex in examples}) == len(LENGTHS)  # the encoder batch is padded
    _check(model, examples)


def _blip(impl: str, label_smoothing: float = 0.0) -> torch.nn.Module:
    """A tiny BlipForConditionalGeneration, or a skip where the release has none, or no ``impl`` attention."""
    if not _installed("blip"):
        pytest.skip("no BLIP on this release")
    if impl not in attention_implementations("blip", "image_text_to_text"):  # no such stock reference
        pytest.skip(f"BlipForConditionalGeneration offers no {impl} attention on this release")
    model = tiny_model("blip", "image_text_to_text", attn_implementation=impl)
    model.text_decoder.label_smoothing = label_smoothing  # BlipTextLMHeadModel reads it at each forward
    return model


def _blip_refusal() -> str:
    """Why BLIP is refused on this release ("" where it derives): 4.53 hands its text decoder no position ids."""
    try:
        tfcompat.resolve("blip")
    except PatchError as exc:
        assert re.search(r"BlipForConditionalGeneration.forward passes text_decoder no position ids", exc.what), exc
        return exc.what
    return ""


@pytest.mark.parametrize("impl", IMPLS)
def test_blip_packed_equals_per_sequence(impl: str) -> None:
    """BLIP's text decoder (BERT-like, cross-attending to the image embeddings; its layers run per sequence) on one
    packed row, the vision tower run stock as a batch: the logits and gradients of each sequence alone."""
    model = _blip(impl)
    if _blip_refusal():
        with pytest.raises(PatchError, match="no position ids"):
            tfcompat.patch(model)
        return
    d = tfcompat.registry.resolve_model(model).entry.encoder_decoder
    assert (d.decoder, d.encoder, d.decoder_ids, d.decoder_positions, d.labels_loss) == (
        "text_decoder", "vision_model", "input_ids", "position_ids", "shifted")
    _check(model, encoder_decoder_examples(model, LENGTHS))


@pytest.mark.parametrize("impl", IMPLS)
def test_blip_loss_over_a_packed_row_is_the_stock_loss_per_sequence(impl: str) -> None:
    """BLIP's decoder computes its own label-smoothed loss from ``labels[:, 1:]`` over the whole row: with pack's
    labels (each sequence's first masked) it reads no label across a boundary, so its mean is the stock mean over
    the sequences' targets (one sequence: its stock loss); the gradients of that loss are stock's. Control: the
    sequences' labels concatenated as they are give another loss."""
    model = _blip(impl, label_smoothing=0.1)
    if _blip_refusal():
        pytest.skip(f"refused on this release: {_blip_refusal()}")
    with torch.no_grad():  # peaked predictions: each label's loss its own (a tiny random model's are all ~log V)
        bias = model.text_decoder.cls.predictions.bias
        bias.add_(5 * torch.randn(bias.shape, generator=torch.Generator().manual_seed(1)))
    examples = encoder_decoder_examples(model, LENGTHS)
    for ex in examples:  # as BLIP's processor returns them, a label ignored inside the second sequence
        ex["attention_mask"] = torch.ones_like(ex["input_ids"])
        ex["labels"] = ex["input_ids"].clone()
    examples[1]["labels"][0, 4] = -100
    stock = [model(**ex) for ex in examples]
    counts = [int((ex["labels"][0, 1:] != -100).sum()) for ex in examples]
    loss = sum(o.loss * n for o, n in zip(stock, counts)) / sum(counts)
    stock_grads = _grads(model, lambda: sum(model(**ex).loss * n for ex, n in zip(examples, counts)) / sum(counts))
    with tfcompat.patch(model, prove=False):
        packed = tfcompat.pack(model, examples)
        inputs = packed.model_inputs
        assert "attention_mask" not in inputs  # the decoder's mask, all ones: the boundaries replace it
        got = model(**inputs).loss
        grads = _grads(model, lambda: model(**inputs).loss)
        alone = tfcompat.pack(model, examples[1:2]).model_inputs
        assert abs(model(**alone).loss.item() - stock[1].loss.item()) <= 1e-5 * abs(stock[1].loss.item())
        unmasked = {**inputs, "labels": torch.cat([ex["labels"] for ex in examples], 1)}
        control = model(**unmasked).loss.item()
    assert abs(got.item() - loss.item()) <= 1e-5 * abs(loss.item())
    assert abs(control - loss.item()) > 1e-3 * abs(loss.item())
    # pack's targets per token: what the stock loss of each sequence reads (the next token's label)
    bounds = packed.seqs.cu_seqlens.tolist()
    for ex, start, end in zip(examples, bounds[:-1], bounds[1:]):
        assert torch.equal(packed.shift_labels[0, start:end - 1], ex["labels"][0, 1:])
        assert int(packed.shift_labels[0, end - 1]) == -100
    assert grads.keys() == stock_grads.keys()
    for name, g in stock_grads.items():
        assert float((grads[name] - g).abs().max()) / max(1.0, float(g.abs().max())) <= GRAD_TOLERANCE, name


def test_blip_refuses_keeping_the_last_logits_of_a_packed_row() -> None:
    """``logits_to_keep`` keeps the row's last logits, which are the last sequence's: only 0 on a packed row."""
    model = _blip("eager")
    if _blip_refusal():
        pytest.skip(f"refused on this release: {_blip_refusal()}")
    if not tfcompat.registry.resolve_model(model).entry.encoder_decoder.logits_to_keep:
        pytest.skip("BLIP's forward takes no logits_to_keep on this release")
    examples = encoder_decoder_examples(model, LENGTHS)
    with tfcompat.patch(model, prove=False):
        inputs = tfcompat.pack(model, examples).model_inputs
        with pytest.raises(InvalidInputError, match="logits_to_keep=1 on a packed decoder row"):
            model(**inputs, logits_to_keep=1)
        assert model(**inputs, logits_to_keep=0).logits.shape[1] == sum(LENGTHS)


def test_patched_model_runs_ordinary_calls_stock() -> None:
    """An ordinary (unpacked) call of the patched model is the stock call."""
    if not _installed("vision-encoder-decoder"):
        pytest.skip("no VisionEncoderDecoder on this release")
    model = _ved("gpt2", "sdpa")
    ex = encoder_decoder_examples(model, (6,))[0]
    with torch.no_grad():
        expected = _logits(model, **ex)
        with tfcompat.patch(model, prove=False):
            got = _logits(model, **ex)
    assert torch.equal(got, expected)


def test_pack_refuses_what_it_cannot_place() -> None:
    if not _installed("vision-encoder-decoder"):
        pytest.skip("no VisionEncoderDecoder on this release")
    model = _ved("bert", "sdpa")
    examples = encoder_decoder_examples(model, LENGTHS)
    with tfcompat.patch(model, prove=False):
        with pytest.raises(InvalidInputError, match="labels for some examples only"):
            tfcompat.pack(model, [{**examples[0], "labels": examples[0]["decoder_input_ids"]}, *examples[1:]])
        with pytest.raises(InvalidInputError, match="decoder_attention_mask is not all ones"):
            tfcompat.pack(model, [{**examples[0], "decoder_attention_mask": torch.zeros_like(
                examples[0]["decoder_input_ids"])}])
        with pytest.raises(InvalidInputError, match="other encoder inputs than example 0"):
            tfcompat.pack(model, [examples[0], {"decoder_input_ids": examples[1]["decoder_input_ids"]}])
        inputs = tfcompat.pack(model, examples).model_inputs
        with pytest.raises(InvalidInputError, match="encoder states do not match the packed decoder row"):
            model(pixel_values=inputs["pixel_values"][:2], decoder_input_ids=inputs["decoder_input_ids"],
                  decoder_position_ids=inputs["decoder_position_ids"])


def test_florence2_prompts_of_different_lengths_need_their_mask() -> None:
    if not _installed("florence2"):
        pytest.skip("no Florence-2 on this release")
    try:
        tfcompat.resolve("florence2")
    except PatchError as exc:
        pytest.skip(f"refused on this release: {exc.what}")
    model = tiny_model("florence2", "image_text_to_text")
    examples = [{k: v for k, v in ex.items() if k != "attention_mask"}
                for ex in encoder_decoder_examples(model, LENGTHS)]
    with tfcompat.patch(model, prove=False), pytest.raises(InvalidInputError, match="carry no attention_mask"):
        tfcompat.pack(model, examples)


# model_type -> what its refusal names, where the type exists and is not derived
REFUSED = {
    "pix2struct": r"no position ids|position_bias",
    "udop": r"an encoder mask it computes itself|decoder no position ids",
    "t5gemma2": r"T5Gemma2MergedAttention is self- and cross-attention in one softmax",
}


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refusals_name_the_reason(model_type: str) -> None:
    if not _installed(model_type):
        pytest.skip(f"no {model_type} on this release")
    with pytest.raises(PatchError, match=REFUSED[model_type]):
        tfcompat.resolve(model_type)


def test_derivation_reads_the_decoders_keywords() -> None:
    """VisionEncoderDecoder strips ``decoder_`` off its kwargs for the decoder: its position ids travel as
    ``decoder_position_ids``; Florence-2's decoder takes the forward's ``**kwargs`` and the prompt's mask."""
    if not _installed("florence2") or importlib.util.find_spec("transformers.models.florence2") is None:
        pytest.skip("no Florence-2 on this release")
    if _installed("vision-encoder-decoder"):  # of an instance: some releases' config names no default decoder
        ved = tfcompat.registry.resolve_model(_ved("bert", "eager")).entry.encoder_decoder
        assert ved is not None
        assert (ved.decoder, ved.encoder, ved.decoder_ids, ved.decoder_positions, ved.encoder_mask) == (
            "decoder", "encoder", "decoder_input_ids", "decoder_position_ids", "")
        assert ved.labels_shift and ved.labels_shift[0] == "shift_tokens_right"
        assert ved.labels_loss in ("aligned", "loss_function")  # 5.x's CrossEntropyLoss, 4.x's self.loss_function
    try:
        florence = tfcompat.resolve("florence2").entry.encoder_decoder
    except PatchError as exc:
        pytest.skip(f"Florence-2 refused on this release: {exc.what}")
    assert florence is not None
    assert (florence.decoder_path(), florence.decoder_positions, florence.encoder_mask) == (
        "model.language_model.decoder", "position_ids", "attention_mask")


def test_cross_attention_core_is_per_sequence() -> None:
    """Each sequence's queries see exactly its own keys (all of them), with grouped key heads."""
    g = torch.Generator().manual_seed(0)
    q_lens, k_lens = (3, 5, 2), (4, 1, 6)
    q = torch.randn(sum(q_lens), 4, 8, generator=g)
    k, v = torch.randn(sum(k_lens), 2, 8, generator=g), torch.randn(sum(k_lens), 2, 8, generator=g)
    got = cross_attention(q, k, v, from_lengths(q_lens), from_lengths(k_lens), scale=0.3)
    outs = []
    for qs, ks, vs in zip(q.split(q_lens), k.split(k_lens), v.split(k_lens)):
        ks, vs = ks.repeat_interleave(2, dim=1), vs.repeat_interleave(2, dim=1)  # (Lk, 2, D) -> (Lk, 4, D)
        weights = torch.softmax(torch.einsum("qhd,khd->hqk", qs, ks) * 0.3, -1)
        outs.append(torch.einsum("hqk,khd->qhd", weights, vs))
    assert torch.allclose(got, torch.cat(outs), atol=1e-6)
    with pytest.raises(InvalidInputError, match="do not match the tokens"):
        cross_attention(q, k, v, from_lengths(q_lens), from_lengths((4, 7)))


def test_labels_under_a_loss_form_tfcompat_does_not_know_are_refused(monkeypatch):
    """Where the derivation could not read how the forward's loss takes its labels, `pack` given labels raises a typed
    error naming the way out (decoder ids, and the loss from the logits), rather than a loss read across sequences."""
    if not _installed("vision-encoder-decoder"):
        pytest.skip("no VisionEncoderDecoder on this release")
    from dataclasses import replace

    model = _ved("bert", "eager")
    examples = [{"pixel_values": ex["pixel_values"], "labels": ex["decoder_input_ids"]}
                for ex in encoder_decoder_examples(model, LENGTHS)]
    r = tfcompat.registry.resolve_model(model)
    unknown = replace(r, entry=replace(r.entry, encoder_decoder=replace(r.entry.encoder_decoder, labels_loss="")))
    monkeypatch.setattr("tfcompat.inputs.pack.family_of", lambda m: unknown)
    with pytest.raises(InvalidInputError, match="loss reads them in a form tfcompat does not know(.|\n)*fix: pass "
                       "decoder_input_ids without labels"):
        tfcompat.pack(model, examples)
