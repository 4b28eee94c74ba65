"""Building family tables: API boundaries first, then facts that hold over their own ranges laid on top."""

from __future__ import annotations

from dataclasses import replace

from ..records import Entry
from ..versions import VersionRange, release_floor


def overlay(entries: tuple[Entry, ...], span: VersionRange, why: str, *,
            rope_index_deviations: tuple[str, ...] = (), known_issues: tuple[str, ...] = ()) -> tuple[Entry, ...]:
    """Split ``entries`` at ``span``'s ends and append names to the tuple fields of the pieces inside.

    entries: contiguous, oldest first. Pieces that begin at ``span.low`` take ``why`` as their reason.
    rope_index_deviations, known_issues: names appended inside ``span`` (none: the split only marks a new reason).
    """
    out: list[Entry] = []
    for entry in entries:
        cuts = [c for c in (span.low, span.high) if c and _inside(c, entry.versions)]
        for low, high in zip([entry.versions.low, *cuts], [*cuts, entry.versions.high]):
            piece = replace(entry, versions=VersionRange(low, high))
            if _covers(span, piece.versions):
                piece = replace(
                    piece,
                    why=why if low == span.low else piece.why,
                    rope_index_deviations=(*piece.rope_index_deviations, *rope_index_deviations),
                    known_issues=(*piece.known_issues, *known_issues),
                )
            out.append(piece)
    return tuple(out)


def starting_at(entries: tuple[Entry, ...], first: str, why: str) -> tuple[Entry, ...]:
    """``entries`` from release ``first`` on (a family added after the table's first range); the first kept
    piece takes ``why``. Entries that end at or before ``first`` are dropped, the one holding it is cut."""
    kept: list[Entry] = []
    for entry in entries:
        if entry.versions.high is not None and release_floor(entry.versions.high) <= release_floor(first):
            continue
        if not kept:
            low = first if release_floor(entry.versions.low) < release_floor(first) else entry.versions.low
            entry = replace(entry, versions=VersionRange(low, entry.versions.high), why=why)
        kept.append(entry)
    return tuple(kept)


def _inside(cut: str, rng: VersionRange) -> bool:
    """``cut`` falls strictly inside ``rng``."""
    return (release_floor(rng.low) < release_floor(cut)
            and (rng.high is None or release_floor(cut) < release_floor(rng.high)))


def _covers(span: VersionRange, piece: VersionRange) -> bool:
    return release_floor(piece.low) >= release_floor(span.low) and (
        span.high is None or release_floor(piece.low) < release_floor(span.high))
