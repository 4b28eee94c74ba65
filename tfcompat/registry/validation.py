"""A family table checked when the registry collects it (`tfcompat.registry.families`), in any environment.

A table is well formed when its entries are oldest first, contiguous and non-overlapping (each entry's high is
the next entry's low; only the newest may be unbounded), every entry names the family and the text roles, and
the fields agree with the family's kind: a vision family's entries say where the tower lives (and it samples
vision items), a text family's do not; an entry with linear-attention layers names their class role.
"""

from __future__ import annotations

from ..errors import TfcompatError
from .records import TEXT_ROLES, Family
from .versions import release_floor

__all__ = ["check_family"]


def check_family(fam: Family) -> None:
    """Raise `TfcompatError` naming the first rule ``fam``'s table breaks (and its text-only family's)."""
    def bad(why: str) -> TfcompatError:
        return TfcompatError(f"the family table of {fam.key!r} is malformed", family=fam.key, why=why,
                             fix="correct the table in tfcompat/registry/tables/ (entries oldest first, each high the "
                             "next entry's low)")

    if not fam.entries:
        raise bad("it has no entries")
    for e in fam.entries:
        if e.family != fam.key:
            raise bad(f"entry {e.versions} names family {e.family!r}")
        if e.versions.high is not None and release_floor(e.versions.low) >= release_floor(e.versions.high):
            raise bad(f"entry {e.versions} is empty")
        missing = [r for r in TEXT_ROLES if r not in e.classes]
        if missing:
            raise bad(f"entry {e.versions} has no class role {', '.join(missing)}")
        if (e.vision is not None) != fam.is_vision:
            raise bad(f"entry {e.versions} " + ("has no vision tower in a vision family" if fam.is_vision
                                                else "has a vision tower in a text-only family"))
        if e.vision is not None and e.vision.owner not in e.classes:
            raise bad(f"entry {e.versions}: the vision owner role {e.vision.owner!r} is not in its classes")
        if (e.linear_attention is not None) != ("linear_attention" in e.classes):
            raise bad(f"entry {e.versions}: linear_attention and the 'linear_attention' class role must come together")
    for before, after in zip(fam.entries, fam.entries[1:]):
        if before.versions.high != after.versions.low:
            raise bad(f"entries {before.versions} and {after.versions} are not contiguous (oldest first, each "
                      "high the next low: no gap, no overlap)")
    if bool(fam.sample_vision) != fam.is_vision:
        raise bad("sample_vision is given exactly for vision families (mm_token_types)")
    if fam.reference_rope_index is not None and not fam.is_vision:
        raise bad("a text-only family has no reference rope index")
    if fam.text_only is not None:
        check_family(fam.text_only)
