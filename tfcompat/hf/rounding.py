"""Rounding or semantics: a near miss in float32 is run again in float64.

Packing changes the shapes every matmul of a model sees (one row of ``T`` tokens instead of ``N`` rows, an expert's
tokens from every sequence at once), so float32 results differ from stock per sequence by rounding, about 1e-6
relative per token. A model whose own ops amplify rounding (a norm after a sum over experts, a normed embedding:
MuseSpark's tiny copies differ by 1.3e-5) can cross a float32 tolerance with an exact patch; a patch that is wrong
by a little (a window one token off on one layer) can look the same. Float64 tells them apart: rounding shrinks with
the precision, by about 1e-9 apart from the float32 casts a model makes itself (its norms, its router; those leave
about 1e-7), and a difference in what is computed does not shrink at all.

Rule: a float32 difference over the tolerance but within `NEAR_MISS` is rounding when the same check in float64 is
within the tolerance: what float64 leaves bounds what the patch itself computes differently, which the tolerance
accepts in float32 too, and the excess was rounding. The proof (`tfcompat.hf.proof`) and the test suite's oracle
apply it alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["NEAR_MISS", "is_rounding", "to_float64"]

NEAR_MISS = 1e-3  # above: no rounding of a float32 model, a wrong patch


def to_float64(model: torch.nn.Module, examples: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Cast ``model`` to float64 in place (a tiny throwaway copy) and return ``examples`` with their floating
    tensors in float64. MoE experts run their eager loop (transformers' grouped_mm kernels take no float64)."""
    switch = getattr(model, "set_experts_implementation", None)
    if callable(switch) and getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        switch("eager")
    model.to(torch.float64)
    return [{k: v.to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
             for k, v in ex.items()} for ex in examples]


def is_rounding(float32_diff: float, float64_diff: float, tolerance: float) -> bool:
    """Whether a float32 difference over ``tolerance`` (and within `NEAR_MISS`) is rounding: the float64 one is
    within ``tolerance``."""
    return float32_diff <= NEAR_MISS and float64_diff <= tolerance
