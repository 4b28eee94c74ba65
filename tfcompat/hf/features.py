"""Patch time: the attention features of each attention module (sliding window, logit softcap, sinks, chunk).

The window, softcap and sinks are what the module's stock forward passes to the attention function
(`tfcompat.registry.derive` reads the call from its source; its values are evaluated on the module), as flash
attention would take them; the chunk comes from the config (``layer_types`` ``"chunked_attention"`` with
``attention_chunk_size``: transformers' masks cut chunks, no kwarg does). Whatever the call passes that the packed
core does not implement, what cannot be evaluated on the module, and a ``"sliding_attention"`` layer whose module
passes no window (its mask and its flash path would disagree) are reasons to refuse the patch. One read of the row
index is known and mended instead: llama4's NoPE temperature tuning (`tfcompat.registry.derive.temperature_guard`),
which the packed attention rescales per sequence.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import torch

from ..core.attention import AttentionFeatures, unsupported
from ..registry.derive import (
    ATTENTION_KEYWORDS,
    SOFTMAX_LAYER_TYPES,
    UNKNOWN,
    attention_call,
    guard_holds,
    layer_kind,
    passed_values,
    temperature_guard,
)
from ..registry.mask_rules import MaskRule, layer_mask, read_masks

__all__ = ["AttentionFeatures", "ModuleFeatures", "module_features", "unsupported"]

# hybrids' names for layers whose attention module is softmax attention: Falcon-H1's "hybrid" (attention and Mamba in
# parallel), Granite-MoE-Hybrid's "attention" on 4.x (beside "mamba"); the attention is patched here, the other
# mixers run per sequence (`tfcompat.hf.mixers`) or the derivation refused them
_BESIDE_MIXERS = ("hybrid", "attention")


class ModuleFeatures(NamedTuple):
    """One attention module's features, its q/k and v head dims, and a note for the patch records; refusal: why
    the packed core cannot run it ("" = it can)."""

    features: AttentionFeatures
    qk_dim: int
    v_dim: int
    note: str
    refusal: str
    temperature: tuple[float, float] | None = None  # NoPE temperature tuning: (floor_scale, attn_scale)


def module_features(attn: torch.nn.Module, config: Any, text_model: type | None = None) -> ModuleFeatures:
    """The features of ``attn`` (an attention module dispatching through transformers' ``AttentionInterface``),
    whose text config is ``config``; text_model: the class of the text model holding it, whose mask construction
    is read too (`tfcompat.registry.mask_rules`; None: the attention call alone)."""
    name = type(attn).__name__
    index = getattr(attn, "layer_idx", None)
    kind = layer_kind(config, index)
    qk_dim, v_dim = _head_dims(attn, config)
    try:
        call = attention_call(cast(type, type(attn)))
    except ValueError as exc:
        return ModuleFeatures(AttentionFeatures(), qk_dim, v_dim, "", str(exc))
    values, training = passed_values(call, attn), passed_values(call, attn, training=True)
    problems = [f"{name} passes {k}={expr}: the packed core implements {', '.join(ATTENTION_KEYWORDS)}"
                for k, expr in call.keywords if k not in ATTENTION_KEYWORDS]
    for key in ("sliding_window", "softcap", "s_aux", "is_causal", "dropout"):
        if values.get(key, None) is UNKNOWN or training.get(key, None) is UNKNOWN:
            problems.append(f"{name} passes {key}={dict(call.keywords)[key]}, which tfcompat cannot evaluate on the "
                            "module")
    if values.get("is_causal", True) not in (True, UNKNOWN):
        problems.append(f"{name} passes is_causal={values['is_causal']!r}: the packed core is causal")
    if getattr(attn, "is_causal", True) is False:  # sdpa reads it; its model builds a bidirectional mask (BERT)
        problems.append(f"{name} is not causal (is_causal=False; a BERT-style model needs config.is_decoder=True "
                        "to be a causal LM): the packed core is causal")
    if training.get("dropout") not in (None, UNKNOWN) and training["dropout"]:
        problems.append(f"{name} applies attention dropout {training['dropout']} in training")
    tuning, temperature = temperature_guard(cast(type, type(attn))), None
    for guard in call.row_positions:
        held = guard_holds(guard, attn) if guard else True
        if held and guard == tuning:  # rescaled per sequence by the packed attention
            temperature = (float(cast(Any, attn).floor_scale), float(cast(Any, attn).attn_scale))
        elif held is not False:
            problems.append(f"{name} reads positions from the row index (cache_position or torch.arange) "
                            + (f"when {guard}, which holds here" if held else "") + "; on a packed row they count "
                            "across sequences")
    if kind is not None and kind not in (*SOFTMAX_LAYER_TYPES, *_BESIDE_MIXERS):
        problems.append(f"config.layer_types[{index}] = {kind!r} is not softmax attention")
    window = values.get("sliding_window")
    chunk = getattr(config, "attention_chunk_size", None) if kind == "chunked_attention" else None
    rule = layer_mask(read_masks(text_model), config, kind) if text_model is not None else None
    window, chunk, masked = _with_mask(rule, _number(window), _number(chunk), f"{name} (layer {index})", problems,
                                       passes_window="sliding_window" in dict(call.keywords))
    if window is None and kind == "sliding_attention":  # the text model's mask may window it; flash would not
        problems.append(f"config.layer_types[{index}] = 'sliding_attention', but {name} passes no sliding_window to "
                        "its attention function")
    if kind == "chunked_attention" and chunk is None:
        problems.append(f"config.layer_types[{index}] = 'chunked_attention' without config.attention_chunk_size")
    softcap = values.get("softcap") or None
    sinks = values.get("s_aux") is not None
    features = AttentionFeatures(window=_number(window), softcap=_number(softcap), sinks=sinks, chunk=_number(chunk))
    note = f"layer {index}: " + ", ".join(
        [f"window {features.window}{masked}" if features.window else "no window",
         *([f"chunk {features.chunk}"] if features.chunk else []),
         *([f"softcap {features.softcap}"] if features.softcap else []),
         *(["sinks"] if features.sinks else []),
         *([f"head dims q/k {qk_dim}, v {v_dim}"] if qk_dim != v_dim else []),
         *([f"temperature tuning (floor_scale, attn_scale) {temperature}"] if temperature else [])])
    return ModuleFeatures(features, qk_dim, v_dim, note, "; ".join(problems), temperature)


def _with_mask(rule: MaskRule | str | None, window: int | None, chunk: int | None, name: str, problems: list[str],
               *, passes_window: bool) -> tuple[int | None, int | None, str]:
    """``(window, chunk, note)`` of a layer whose attention call passes ``window`` (passes_window: it passes the
    keyword at all; a None it passes is a "no window" the packed attention checks in the forward) and whose layer
    type says ``chunk``, reconciled with the ``rule`` of its stock mask (`tfcompat.registry.mask_rules.layer_mask`):
    a window or chunk the mask alone applies is taken from it (note " (from the mask)"); where the two disagree, or
    the mask is bidirectional or cannot be read, the reason is added to ``problems`` (stock eager and sdpa follow
    the mask, flash attention the call: no one answer is proven)."""
    if rule is None:
        return window, chunk, ""
    if isinstance(rule, str):
        problems.append(f"{name}: {rule}")
        return window, chunk, ""
    size = _number(rule.size)
    said = {"window": window, "chunk": chunk}
    mask = {"window": size if rule.kind == "window" else None, "chunk": size if rule.kind == "chunk" else None}
    if passes_window and window is None and mask["window"] is not None:
        said["window"] = 0  # "no window", said explicitly: a disagreement, not a silence
    if rule.kind == "bidirectional":
        problems.append(f"{name}: its stock mask is bidirectional ({rule.source}); the packed core is causal")
        return window, chunk, ""
    for key in ("window", "chunk"):
        if said[key] is not None and said[key] != mask[key]:
            problems.append(f"{name}: its attention call says {key} {said[key] or None}, its stock mask "
                            f"({rule.source}) " + (f"{key} {mask[key]}" if mask[key] is not None else f"no {key}")
                            + ": stock eager and sdpa follow the mask, flash attention the call")
    taken = [k for k in ("window", "chunk") if said[k] is None and mask[k] is not None]
    return mask["window"] or window, mask["chunk"] or chunk, " (from the mask)" if taken else ""


def _number(value: Any) -> Any:
    """A config number as a plain Python number (None stays None)."""
    return None if value is None or value is UNKNOWN else value.item() if isinstance(value, torch.Tensor) else value


def _head_dims(attn: torch.nn.Module, config: Any) -> tuple[int, int]:
    """q/k and v head dims of ``attn``: its ``qk_head_dim`` / ``v_head_dim`` (multi-head latent attention), else its
    ``head_dim`` (else the config's, else hidden size over heads) for both."""
    head = getattr(attn, "head_dim", None) or getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads)
    return int(getattr(attn, "qk_head_dim", None) or head), int(getattr(attn, "v_head_dim", None) or head)
