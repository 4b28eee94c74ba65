"""Rope scalings whose frequencies follow the length of the call, and the packed batches they cannot answer.

transformers' ``dynamic_rope_update`` reads ``max(position_ids) + 1`` of the whole call: ``dynamic`` (NTK) recomputes
its frequencies for that length once it passes ``max_position_embeddings``, ``longrope`` switches from its short to
its long factors once it passes ``original_max_position_embeddings``. Over a packed batch that maximum is the longest
sequence's, so every sequence is rotated with the longest one's frequencies; alone, each takes its own. A packed
batch is answered per sequence only where both agree (`check_lengths`), from the host lengths: no sync.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..errors import InvalidInputError

__all__ = ["LengthRule", "check_lengths", "length_rules"]


class LengthRule(NamedTuple):
    """One length-dependent rope: its ``rope_type`` and the length past which its frequencies change."""

    rope_type: str
    original: int


def length_rules(config: Any, rope: dict[str, Any]) -> set[LengthRule]:
    """The length-dependent ropes of a text ``config`` whose flat rope settings are ``rope``
    (`tfcompat.registry.rotary.rope_config`; one dict per layer type where the model keeps them so)."""
    per_type = [v for v in rope.values() if isinstance(v, dict)] or [rope]
    rules: set[LengthRule] = set()
    for settings in per_type:
        kind = str(settings.get("rope_type", "default"))
        if "dynamic" in kind:  # transformers' own test of the name
            original = getattr(config, "max_position_embeddings", None)
        elif kind == "longrope":
            original = settings.get("original_max_position_embeddings",
                                    getattr(config, "original_max_position_embeddings", None))
        else:
            continue
        if isinstance(original, int):
            rules.add(LengthRule(kind, original))
    return rules


def check_lengths(rules: set[LengthRule], lengths: tuple[int, ...], error: Any) -> None:
    """`InvalidInputError` (built by ``error(cls, what, why=..., fix=...)``) where a sequence of ``lengths`` (those
    of one forward) would take other rope frequencies alone than in the packed batch."""
    longest = max(lengths)
    for rule in sorted(rules):
        if longest <= rule.original:
            continue
        if rule.rope_type == "longrope":
            other = next((n for n in lengths if n <= rule.original), None)
            alone = f"the short factors (at most {rule.original} tokens)"
        else:
            other = next((n for n in lengths if n != longest), None)
            alone = f"frequencies scaled for its own length (past {rule.original} tokens, scaled per length)"
        if other is None:
            continue
        raise error(
            InvalidInputError, f"a packed batch whose sequences take other {rule.rope_type} rope frequencies alone",
            why=f"{rule.rope_type} rope rotates by the longest position of the call: packed, every sequence takes the "
            f"frequencies of the longest ({longest} tokens); alone, the one of {other} tokens takes {alone}",
            fix=f"pack sequences of one side of {rule.original} tokens together "
            f"({'all at most or all past it' if rule.rope_type == 'longrope' else 'all at most it, or of one length'})"
            ", or run longer ones alone")
