"""Self-check of a family on the installed transformers: tiny random model, packed patched vs stock.

The oracle is stock transformers: each sequence runs alone through the unpatched model, the same sequences
run packed in one row through the patched model, and the logits are compared per token.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from .patching import patch
from .registry import Resolved, family, resolve
from .rope_index import rope_index

__all__ = ["Sequence", "CheckResult", "tiny_model", "sample_sequences", "positions", "pack", "stock_inputs", "run_check"]


@dataclass
class Sequence:
    """One sample. input_ids: ``(1, L)``; pixel_values: ``(patches, C * tp * p * p)``; grid: ``(n, 3)``."""

    input_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None


@dataclass
class CheckResult:
    family: str
    attn_implementation: str
    max_abs_diff: float
    tokens: int
    seconds: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance


def tiny_model(key: str, attn_implementation: str = "sdpa", seed: int = 0, **text: Any) -> torch.nn.Module:
    """A tiny random model of ``key`` built from config (no download), in eval mode, fp32.

    text: overrides of the text config (e.g. ``num_key_value_heads=1``).
    """
    r = resolve(key)
    config_name, kwargs = family(key).tiny_config(r.entry)
    (kwargs["text_config"] if "text_config" in kwargs else kwargs).update(text)
    config_cls = getattr(importlib.import_module("transformers"), config_name)
    torch.manual_seed(seed)
    model_cls = r.classes["for_causal_lm"]
    return model_cls._from_config(config_cls(**kwargs), attn_implementation=attn_implementation).eval()


def sample_sequences(model: torch.nn.Module, lengths: list[int], images: list[tuple[int, int, int] | None],
                     seed: int = 0) -> list[Sequence]:
    """Sequences of random text tokens; where ``images[i]`` is a grid ``(t, h, w)`` an image sits mid-text."""
    cfg = model.config
    vision = getattr(cfg, "vision_config", None)
    gen = torch.Generator().manual_seed(seed)
    special = min(getattr(cfg, k, cfg.get_text_config().vocab_size) for k in ("image_token_id", "video_token_id", "image_start_token_id"))
    out = []
    for n, grid in zip(lengths, images):
        text = torch.randint(0, special, (n,), generator=gen)
        if grid is None:
            out.append(Sequence(text[None]))
            continue
        t, h, w = grid
        n_img = t * h * w // vision.spatial_merge_size**2
        image = torch.full((n_img,), cfg.image_token_id)
        start, end = [torch.tensor([getattr(cfg, k)]) for k in ("image_start_token_id", "image_end_token_id")]
        ids = torch.cat([text[: n // 2], start, image, end, text[n // 2:]])
        patch_dim = getattr(vision, "in_channels", 3) * vision.temporal_patch_size * vision.patch_size**2
        pixels = torch.randn(t * h * w, patch_dim, generator=gen)
        out.append(Sequence(ids[None], pixels, torch.tensor([grid])))
    return out


def stock_inputs(r: Resolved, model: torch.nn.Module, seq: Sequence) -> dict[str, Any]:
    """Inputs for a stock forward of one sequence (the version's own position-id computation)."""
    # an explicit mask: 4.53's mask builder crashes on 3-row position ids when none is given
    inputs: dict[str, Any] = {"input_ids": seq.input_ids, "attention_mask": torch.ones_like(seq.input_ids)}
    if seq.pixel_values is not None:
        inputs.update(pixel_values=seq.pixel_values, image_grid_thw=seq.image_grid_thw)
    if r.entry.rope_index_mm_token_types:
        inputs["mm_token_type_ids"] = family(r.family).mm_token_types(model.config, seq.input_ids)
    return inputs


def positions(model: torch.nn.Module, seq: Sequence) -> torch.Tensor:
    """Contract position ids of one sequence: ``(4, 1, L)`` for M-RoPE families, ``(1, L)`` otherwise."""
    if "model" in resolve(model.config.model_type).classes:
        return rope_index(model, seq.input_ids, image_grid_thw=seq.image_grid_thw)
    return torch.arange(seq.input_ids.shape[1])[None]


def pack(model: torch.nn.Module, seqs: list[Sequence]) -> dict[str, Any]:
    """Packed inputs: ids ``(1, T)``, position ids ``(4, 1, T)`` (per-sequence rope_index, concatenated)."""
    with_images = [s for s in seqs if s.pixel_values is not None]
    inputs: dict[str, Any] = {
        "input_ids": torch.cat([s.input_ids for s in seqs], dim=1),
        "position_ids": torch.cat([positions(model, s) for s in seqs], dim=-1),
    }
    if with_images:
        inputs["pixel_values"] = torch.cat([s.pixel_values for s in with_images])
        inputs["image_grid_thw"] = torch.cat([s.image_grid_thw for s in with_images])
    return inputs


@torch.no_grad()
def run_check(key: str, attn_implementation: str = "sdpa", tolerance: float = 1e-5) -> CheckResult:
    """Packed patched logits against stock per-sequence logits on a tiny model: text and image sequences."""
    start = time.perf_counter()
    r = resolve(key)
    model = tiny_model(key, attn_implementation)
    image = (1, 4, 6) if hasattr(model.config, "vision_config") else None
    seqs = sample_sequences(model, [7, 12, 5], [None, image, None])
    expected = [model(**stock_inputs(r, model, s), use_cache=False).logits[0] for s in seqs]
    packed = pack(model, seqs)
    with patch(model, remove_padding=True):
        got = model(**packed, use_cache=False).logits[0]
    diff = max(float((g - e).abs().max()) for g, e in zip(got.split([e.shape[0] for e in expected]), expected))
    return CheckResult(key, attn_implementation, diff, got.shape[0], time.perf_counter() - start, tolerance)
