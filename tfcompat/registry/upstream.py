"""Bugs of a stock model, in a range of transformers releases, that no packing can reproduce.

A derived family is exact when its stock forward computes each sequence's tokens from that sequence alone. Where a
release's stock code mixes tokens of one row (a routing score applied to another token's input), the stock model
run on one sequence and on a packed row differ before tfcompat changes anything, so the derived entry would be
"wrong" against its own oracle. Each such bug is declared here, per modeling module and release range (read from
the source of every release, never guessed); `tfcompat.registry.lookup` refuses the type on those releases at
`resolve()` / `patch()` naming the bug, and the tests check that the stock model does mix the row there.
"""

from __future__ import annotations

from dataclasses import dataclass

from .versions import VersionRange

__all__ = ["UPSTREAM_BUGS", "UpstreamBug", "bug_in"]


@dataclass(frozen=True)
class UpstreamBug:
    """name: a short id; module: the modeling module holding the bug; versions: the releases that ship it;
    what: the bug, as the refusal's ``why``; fix: what the user can do."""

    name: str
    module: str
    versions: VersionRange
    what: str
    fix: str


UPSTREAM_BUGS: tuple[UpstreamBug, ...] = (
    UpstreamBug(
        "llama4_moe_scores_misaligned", "transformers.models.llama4.modeling_llama4", VersionRange("4.54", "4.56"),
        what="Llama4TextMoe.forward scales the expert-major copies of the tokens (hidden_states.repeat(E, 1)) by the "
        "token-major router scores (router_scores.reshape(-1, 1), no transpose): each token's expert input is "
        "scaled by other tokens' scores, so a token's output depends on the rest of its row (4.56 transposes)",
        fix="use transformers 4.53 or >= 4.56 for Llama 4"),
)


def bug_in(module: str, version: str) -> UpstreamBug | None:
    """The declared bug of ``module`` on ``version``, or None."""
    return next((b for b in UPSTREAM_BUGS if b.module == module and version in b.versions), None)
