"""Test helpers: one assert_close with explicit tolerances, and per-token comparison of packed outputs."""

from __future__ import annotations

import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float = 0.0, what: str = "") -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def max_token_diff(packed: torch.Tensor, per_sequence: list[torch.Tensor]) -> float:
    """Max abs difference between ``packed (T, ...)`` and the concatenated per-sequence ``(L_i, ...)``."""
    chunks = packed.split([p.shape[0] for p in per_sequence])
    assert sum(p.shape[0] for p in per_sequence) == packed.shape[0]
    return max(float((c - p).abs().max()) for c, p in zip(chunks, per_sequence))


def skip_if_stock_rejects_videos(family: str, items: list) -> None:
    """Skip when the stock forward of the installed release cannot be the oracle for these vision items."""
    import pytest

    import tfcompat

    entry = tfcompat.resolve(family).entry
    has_video = any(isinstance(i, tuple) and i and i[0] == "video" for i in items)
    if has_video and "videos_rejected" in entry.known_issues:
        pytest.skip(f"transformers {entry.versions} {family}: the stock forward rejects every video (known issue)")
