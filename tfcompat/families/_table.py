"""Building family tables: API boundaries first, then facts that hold over their own ranges laid on top."""

from __future__ import annotations

from dataclasses import replace

from ..registry import Entry
from ..versions import VersionRange, release_floor


def overlay(entries: tuple[Entry, ...], span: VersionRange, why: str, **add: tuple[str, ...]) -> tuple[Entry, ...]:
    """Split ``entries`` at ``span``'s ends and append ``add``'s names to the tuple fields of the pieces inside.

    entries: contiguous, oldest first. Pieces that begin at ``span.low`` take ``why`` as their reason.
    """
    out: list[Entry] = []
    for entry in entries:
        cuts = [c for c in (span.low, span.high) if c and _inside(c, entry.versions)]
        bounds = [entry.versions.low, *cuts, entry.versions.high]
        for low, high in zip(bounds, bounds[1:]):
            piece = replace(entry, versions=VersionRange(low, high))
            if _covers(span, piece.versions):
                changes = {k: (*getattr(piece, k), *v) for k, v in add.items()}
                piece = replace(piece, **changes, why=why if low == span.low else piece.why)
            out.append(piece)
    return tuple(out)


def _inside(cut: str, rng: VersionRange) -> bool:
    """``cut`` falls strictly inside ``rng``."""
    return release_floor(rng.low) < release_floor(cut) and (rng.high is None or release_floor(cut) < release_floor(rng.high))


def _covers(span: VersionRange, piece: VersionRange) -> bool:
    return release_floor(piece.low) >= release_floor(span.low) and (
        span.high is None or release_floor(piece.low) < release_floor(span.high))
