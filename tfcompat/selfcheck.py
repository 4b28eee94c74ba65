"""Self-check of a family on the installed transformers: tiny random model, packed patched vs stock.

The oracle is stock transformers: each sequence runs alone through the unpatched model, the same sequences
run packed in one row (by `tfcompat.pack`, the path users take) through the patched model, and the logits are
compared per token.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from .errors import TfcompatError
from .hf.patching import patch
from .hf.proof import REFUSAL as PROOF_REFUSAL
from .hf.rounding import NEAR_MISS, is_rounding, to_float64
from .hf.vision_attention import towers
from .inputs.derived_vision import owner_of
from .inputs.pack import pack
from .inputs.token_types import required, with_prefix_suffix
from .registry import Resolved, family, resolve, resolve_model
from .registry.records import VisionItem
from .tiny_models import Kind

__all__ = ["Sequence", "CheckResult", "TypeCheck", "tiny_model", "sample_case", "sample_sequences",
           "vision_placeholder", "stock_inputs", "run_check", "check_type"]

_LENGTHS = (7, 12, 5, 9, 6, 8)


@dataclass
class Sequence:
    """One sample. input_ids: ``(1, L)``; pixel values ``(patches, C * tp * p * p)`` with grids ``(n, 3)``."""

    input_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None

    def vision_inputs(self) -> dict[str, torch.Tensor]:
        names = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


@dataclass
class CheckResult:
    """One self-check: the max per-token logit difference over ``tokens`` packed tokens; vision: the kinds of
    the vision items in the packed row, in order (e.g. ``("image", "image", "video")``); vision_attention: the
    tower's attention ran through tfcompat (``patch(vision_attention=True)``)."""

    family: str
    attn_implementation: str
    max_abs_diff: float
    tokens: int
    seconds: float
    tolerance: float
    vision: tuple[str, ...] = ()
    vision_attention: bool = False

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance


def tiny_model(key: str, attn_implementation: str = "sdpa", seed: int = 0, **text: Any) -> torch.nn.Module:
    """A tiny random model of ``key`` built from config (no download), in eval mode, fp32.

    text: overrides of the text config (e.g. ``num_key_value_heads=1``).
    """
    r = resolve(key)
    config_name, kwargs = r.spec.tiny_config(r.entry)
    kwargs.get("text_config", kwargs).update(text)
    config_cls = getattr(importlib.import_module("transformers"), config_name)
    torch.manual_seed(seed)
    model_cls: Any = r.classes["for_causal_lm"]  # a transformers PreTrainedModel class
    return model_cls._from_config(config_cls(**kwargs), attn_implementation=attn_implementation).eval()


Item = tuple[int, int, int] | VisionItem | None


def sample_case(key: str, vision: bool = True) -> tuple[list[int], list[Item]]:
    """Text lengths and vision items of ``key``'s packed sample (`tfcompat.records.Family.sample_vision`).

    vision: False (or a text-only family) gives three text-only sequences.
    """
    items: list[Item] = list(family(key).sample_vision) if vision else []
    if not items:
        items = [None, None, None]
    return list(_LENGTHS[: len(items)]), items


def sample_sequences(model: torch.nn.Module, lengths: list[int], items: list[Item], seed: int = 0) -> list[Sequence]:
    """Sequences of random text tokens, each with an optional vision item in the middle of its text.

    items[i]: None (text only), a grid ``(t, h, w)`` (an image), ``("image", (t, h, w))`` or ``("video", (t, h, w))``;
    its tokens are laid out as the family's processor does (`vision_placeholder`).
    """
    cfg: Any = model.config
    vision: Any = getattr(cfg, "vision_config", None)
    gen = torch.Generator().manual_seed(seed)
    special = min(getattr(cfg, k, cfg.get_text_config().vocab_size)
                  for k in ("image_token_id", "video_token_id", "image_start_token_id", "vision_start_token_id"))
    out = []
    for n, item in zip(lengths, items):
        text = torch.randint(0, special, (n,), generator=gen)
        if item is None:
            out.append(Sequence(text[None]))
            continue
        kind, grid = item if isinstance(item[0], str) else ("image", item)
        t, h, w = grid
        placeholder = torch.tensor(vision_placeholder(cfg, kind, grid))
        ids = torch.cat([text[: n // 2], placeholder, text[n // 2:]])
        # a tower without temporal_patch_size embeds one frame per patch (ERNIE-4.5-VL)
        patch_dim = getattr(vision, "in_channels", 3) * getattr(vision, "temporal_patch_size", 1) * vision.patch_size**2
        pixels = torch.randn(t * h * w, patch_dim, generator=gen)
        if kind == "video":
            out.append(Sequence(ids[None], pixel_values_videos=pixels, video_grid_thw=torch.tensor([grid])))
        else:
            out.append(Sequence(ids[None], pixels, torch.tensor([grid])))
    return out


def vision_placeholder(config: Any, kind: str, grid: tuple[int, int, int]) -> list[int]:
    """Token ids of one vision item of ``kind`` ("image" or "video") and patch grid ``(t, h, w)``, as the family's
    processor lays it out (`tfcompat.records.Family.vision_placeholder`); by default ``t * h * w / merge**2``
    placeholder tokens between the kind's (or the vision) start and end tokens."""
    custom = family(config.model_type).vision_placeholder
    if custom is not None:
        return custom(config, kind, grid)
    t, h, w = grid
    video = kind == "video" and hasattr(config, "vision_start_token_id")
    token = config.video_token_id if video else config.image_token_id
    start, end = (_first(config, f"{kind}_start_token_id", "vision_start_token_id"),
                  _first(config, f"{kind}_end_token_id", "vision_end_token_id"))
    return [start, *[token] * (t * h * w // config.vision_config.spatial_merge_size**2), end]


def _first(config: Any, *names: str) -> int:
    """The first of the config attributes ``names`` that is set (`ValueError` naming them where none is: 4.53's
    Qwen2-VL config has no vision start token id, which its own rope index reads)."""
    for name in names:
        if getattr(config, name, None) is not None:
            return getattr(config, name)
    raise ValueError(f"{type(config).__name__} sets none of {', '.join(names)}")


def stock_inputs(r: Resolved, model: torch.nn.Module, seq: Sequence) -> dict[str, Any]:
    """Inputs for a stock forward of one sequence (the version's own position-id computation)."""
    # an explicit mask: 4.53's mask builder crashes on 3-row position ids when none is given
    inputs: dict[str, Any] = {"input_ids": seq.input_ids, "attention_mask": torch.ones_like(seq.input_ids),
                              **seq.vision_inputs()}
    if r.entry.rope_index_mm_token_types and r.spec.mm_token_types is not None:
        inputs["mm_token_type_ids"] = r.spec.mm_token_types(model.config, seq.input_ids)
    if r.spec.moe_token_types is not None:
        inputs["moe_mm_token_type_ids"] = r.spec.moe_token_types(model.config, seq.input_ids)
    return inputs


@torch.no_grad()
def run_check(key: str, attn_implementation: str = "sdpa", tolerance: float = 1e-5, *,
              vision_attention: bool = False) -> CheckResult | None:
    """Packed patched logits against stock per-sequence logits on a tiny model: the family's packed sample
    (text, and the images and videos of `tfcompat.records.Family.sample_vision`). vision_attention: patch with it
    (`tfcompat.hf.vision_attention`); None where the family's tower does not route so on this transformers."""
    start = time.perf_counter()
    r = resolve(key)
    model = tiny_model(key, attn_implementation)
    if vision_attention and not towers(model, [cast(Any, model.config).get_text_config()]):
        return None
    lengths, items = sample_case(key)
    if "videos_rejected" in r.entry.known_issues:  # the stock forward cannot be the oracle for videos here
        items = [None if isinstance(i, tuple) and i[0] == "video" else i for i in items]
    seqs = sample_sequences(model, lengths, items)
    expected = [model(**stock_inputs(r, model, s), use_cache=False).logits[0] for s in seqs]
    packed = pack(model, [{"input_ids": s.input_ids, **s.vision_inputs()} for s in seqs]).model_inputs
    with patch(model, remove_padding=True, vision_attention=vision_attention):
        got = model(**packed, use_cache=False).logits[0]
    diff = max(float((g - e).abs().max()) for g, e in zip(got.split([e.shape[0] for e in expected]), expected))
    kinds = tuple(i[0] if isinstance(i[0], str) else "image" for i in items if i is not None)
    return CheckResult(key, attn_implementation, diff, got.shape[0], time.perf_counter() - start, tolerance, kinds,
                       vision_attention)


@dataclass(frozen=True)
class TypeCheck:
    """The self-check of one causal-LM type without a written table (`check_type`).

    status: "pass" (patched packed equals stock per sequence within the tolerance), "fail" (patched and wrong, or
    the patched forward raised), "refused" (`resolve`/`patch` raised a typed error: reason), "unbuildable" (no tiny
    model of the type builds and runs stock on CPU: reason). max_rel_diff: per token, ``max |patched - stock|`` over
    the token's largest stock logit. proof: what ``patch()``'s proof of the type found (`tfcompat.hf.proof`):
    "proven", "proven on the default config", "unproven: reason", "refused" (the proof refused the patch: reason), or
    "" where the patch was refused before its proof or never tried.
    """

    model_type: str
    status: Literal["pass", "fail", "refused", "unbuildable"]
    reason: str = ""
    max_rel_diff: float | None = None
    proof: str = ""


@torch.no_grad()
def check_type(model_type: str, kind: Kind = "causal_lm", tolerance: float = 1e-5) -> TypeCheck:
    """``model_type``'s tiny model (`tfcompat.tiny_models`, its last CPU attention implementation: sdpa where it has
    one) run stock on three sequences alone and patched on their packed row (`tfcompat.pack`); logits compared per
    token. kind "image_text_to_text": the first and last sequence hold one image each (`tiny_image`), the middle one
    is text only."""
    from .tiny_models import attention_implementations, encoder_decoder_examples, sample_examples
    from .tiny_models import tiny_model as tiny_of_type

    try:
        resolve(model_type)
    except TfcompatError as exc:
        return TypeCheck(model_type, "refused", _first_line(exc))
    try:
        model = tiny_of_type(model_type, kind, attn_implementation=attention_implementations(model_type, kind)[-1])
        r = resolve_model(model)
        examples = (encoder_decoder_examples(model, _LENGTHS[:3]) if r.entry.encoder_decoder is not None
                    else sample_examples(model, _LENGTHS[:3], images=kind == "image_text_to_text"))
        if r.entry.derived_vision is not None:  # token types where stock needs them (PaliGemma's sdpa), as its
            # processor returns them
            examples = with_prefix_suffix(examples, required(r, *owner_of(r, model)))
        # each sequence at the positions the model gives it by default (0, 1, ... for most; RoBERTa's count from its
        # padding index): what the packed row's restarting position ids must give
        expected = [model(**ex, use_cache=False).logits[0] for ex in examples]
    except Exception as exc:  # noqa: BLE001 -- any reason a foreign model cannot be built or run is reported
        return TypeCheck(model_type, "unbuildable", _first_line(exc))
    try:
        handle = patch(model)  # with the patch-time proof, as users patch
    except TfcompatError as exc:
        if exc.what.endswith(PROOF_REFUSAL):
            return TypeCheck(model_type, "refused", f"{_first_line(exc)}: {exc.why}"[:300], proof="refused")
        return TypeCheck(model_type, "refused", _first_line(exc))
    proof = "" if handle.proof is None else "proven" if handle.proof.config == "own" else \
        "proven on the default config" if handle.proof.status == "proven" else f"unproven: {handle.proof.reason}"
    with handle:
        try:
            inputs = pack(model, examples).model_inputs
        except TfcompatError as exc:  # typed before any forward: a text family packs no images (GIT's), said
            return TypeCheck(model_type, "refused", _first_line(exc), proof=proof)
        try:
            got = model(**inputs, use_cache=False).logits[0]
        except Exception as exc:  # noqa: BLE001 -- a patched forward that raises is a failure to report
            return TypeCheck(model_type, "fail", f"the patched forward raised {_first_line(exc)}", proof=proof)
    diff = _diff(got, expected)
    if diff <= tolerance:
        return TypeCheck(model_type, "pass", max_rel_diff=diff, proof=proof)
    wide = _float64_diff(model, examples) if diff <= NEAR_MISS else None
    if wide is not None and is_rounding(diff, wide, tolerance):
        return TypeCheck(model_type, "pass", f"float32's {diff:.1e} is rounding: {wide:.1e} in float64", diff, proof)
    return TypeCheck(model_type, "fail", f"packed differs from stock per sequence by {diff:.1e}"
                     + ("" if wide is None else f" ({wide:.1e} in float64)"), diff, proof)


def _diff(got: torch.Tensor, expected: list[torch.Tensor]) -> float:
    """Max over tokens of ``max |got - stock| / max |stock|``: ``got (T, V)``, ``expected`` ``(L_i, V)`` each."""
    want = torch.cat(expected)  # (T, V)
    return float(((got - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-6)).max())


def _float64_diff(model: torch.nn.Module, examples: list[dict[str, Any]]) -> float | None:
    """`_diff` with ``model`` (a throwaway tiny model, cast in place) and ``examples`` in float64
    (`tfcompat.hf.rounding`); None where it does not run so."""
    try:
        examples = to_float64(model, examples)
        with torch.no_grad():
            expected = [model(**ex, use_cache=False).logits[0] for ex in examples]
            with patch(model, prove=False):
                return _diff(model(**pack(model, examples).model_inputs, use_cache=False).logits[0], expected)
    except Exception:  # noqa: BLE001 -- a kernel without float64: no evidence either way
        return None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]
