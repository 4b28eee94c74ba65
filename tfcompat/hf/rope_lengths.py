"""Rope scalings whose frequencies follow the length of the call, and the packed batches they cannot answer.

transformers' ``dynamic_rope_update`` reads ``max(position_ids) + 1`` of the whole call: ``dynamic`` (NTK) recomputes
its frequencies for that length once it passes ``max_position_embeddings``, ``longrope`` switches from its short to
its long factors once it passes ``original_max_position_embeddings``. Over a packed batch that maximum is the longest
sequence's, so every sequence is rotated with the longest one's frequencies; alone, each takes its own. A packed
batch is answered per sequence only where both agree (`check_lengths`): from the host lengths (no sync) where a
sequence's positions are 0, 1, ..., from its largest M-RoPE position where an image keeps those below its token count
(`seen_lengths`, one sync per forward). Under Ulysses each rank's rotary reads its own slice: refused at `patch()`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..core.packing import PackedSeqs
from ..errors import InvalidInputError

if TYPE_CHECKING:
    from ..registry import Resolved

__all__ = ["ALONE", "LengthRule", "answered_lengths", "check_lengths", "length_rules", "rules_of", "seen_lengths"]


ALONE = "rope frequencies alone"  # how the refusal's first line ends


class LengthRule(NamedTuple):
    """One length-dependent rope: its ``rope_type`` and the length past which its frequencies change."""

    rope_type: str
    original: int


def length_rules(config: Any, rope: dict[str, Any], key: str = "rope_parameters") -> set[LengthRule]:
    """The length-dependent ropes of a text ``config`` whose flat rope settings are ``rope``
    (`tfcompat.registry.rotary.rope_config`; one dict per layer type where the model keeps them so). key: where
    the release keeps them (`tfcompat.registry.records.Entry.rope_config_key`): a longrope switches at its
    ``rope_parameters``' original length, or under ``rope_scaling`` (4.x) at the config's own (else at
    ``max_position_embeddings``), whatever the scaling dict says."""
    per_type = [v for v in rope.values() if isinstance(v, dict)] or [rope]
    rules: set[LengthRule] = set()
    for settings in per_type:
        kind = str(settings.get("rope_type", "default"))
        if "dynamic" in kind:  # transformers' own test of the name
            original = getattr(config, "max_position_embeddings", None)
        elif kind == "longrope" and key == "rope_scaling":
            own = hasattr(config, "original_max_position_embeddings")  # transformers' own test
            original = config.original_max_position_embeddings if own else config.max_position_embeddings
        elif kind == "longrope":
            original = settings.get("original_max_position_embeddings",
                                    getattr(config, "original_max_position_embeddings", None))
        else:
            continue
        if isinstance(original, int):
            rules.add(LengthRule(kind, original))
    return rules


def rules_of(configs: Iterable[Any], r: Resolved) -> set[LengthRule]:
    """The length-dependent ropes of ``configs`` (a model's, its text model's) on ``r``'s release."""
    key = r.entry.rope_config_key
    return {rule for c in configs
            for rule in length_rules(getattr(c, "text_config", None) or c, r.rope_config(c), key)}


def answered_lengths(rules: set[LengthRule], lengths: tuple[int, ...]) -> tuple[int, ...]:
    """``lengths``, or where ``rules`` refuse them packed, lengths they answer: each moved past the largest switch
    (longrope takes its long factors for all), else as many of one length past it (dynamic scales all alike)."""
    past = max((rule.original for rule in rules), default=0)
    moved = tuple(n + past for n in lengths)
    return next((c for c in (lengths, moved) if _refusal(rules, c) is None), (max(moved),) * len(lengths))


def _refusal(rules: set[LengthRule], lengths: tuple[int, ...]) -> tuple[LengthRule, int] | None:
    """The first rule under which a sequence of ``lengths`` takes other frequencies alone than packed, and the
    length of such a sequence; None where every sequence takes the same."""
    longest = max(lengths)
    for rule in sorted(rules):
        if longest <= rule.original:
            continue
        if rule.rope_type == "longrope":
            other = next((n for n in lengths if n <= rule.original), None)
        else:
            other = next((n for n in lengths if n != longest), None)
        if other is not None:
            return rule, other
    return None


def seen_lengths(rows: torch.Tensor, seqs: PackedSeqs) -> tuple[int, ...]:
    """Per sequence of ``seqs``, the largest of its positions in ``rows`` ``(A, B, L)`` (M-RoPE's ``[t; h; w]``) + 1:
    the length the rope takes it for alone. One host copy."""
    flat = rows.reshape(rows.shape[0], -1).amax(0)  # (B L,)
    if flat.numel() != seqs.total:
        return seqs.lengths
    owner = torch.repeat_interleave(torch.arange(len(seqs.lengths), device=flat.device),
                                    torch.tensor(seqs.lengths, device=flat.device), output_size=seqs.total)
    top = torch.full((len(seqs.lengths),), -1, dtype=flat.dtype, device=flat.device)
    return tuple(int(n) + 1 for n in top.scatter_reduce_(0, owner, flat, "amax").tolist())


def check_lengths(rules: set[LengthRule], lengths: tuple[int, ...], error: Any) -> None:
    """`InvalidInputError` (built by ``error(cls, what, why=..., fix=...)``) where a sequence of ``lengths`` (those
    of one forward) would take other rope frequencies alone than in the packed batch."""
    found = _refusal(rules, lengths)
    if found is None:
        return
    (rule, other), longest = found, max(lengths)
    if rule.rope_type == "longrope":
        alone = f"the short factors (at most {rule.original} positions)"
    else:
        alone = f"frequencies scaled for its own length (past {rule.original} positions, scaled per length)"
    raise error(
        InvalidInputError, f"a packed batch whose sequences take other {rule.rope_type} {ALONE}",
        why=f"{rule.rope_type} rope rotates by the longest position of the call: packed, every sequence takes the "
        f"frequencies of the longest ({longest} positions); alone, the one of {other} takes {alone}",
        fix=f"pack sequences of one side of {rule.original} positions together "
        f"({'all at most or all past it' if rule.rope_type == 'longrope' else 'all at most it, or of one length'})"
        ", or run longer ones alone")
