"""What an owner's token types mean to the mask it builds, asked of its own forward.

An owner that builds its language model's mask from ``token_type_ids`` (`VisionDerivation.mask_inputs`) gives each
value a meaning of its own: Gemma 3's 1 marks an image (bidirectional within it) and 0 text, PaliGemma's 0 marks the
prefix (bidirectional over the image and prompt) and 1 the causal suffix, so a processor's all-zero token types are
a whole bidirectional sequence there. `token_type_rule` asks the owner instead of assuming: its forward runs on a
short text row filled with each value (and on one without token types), no pixels, stopped at its language model,
and the mask it hands over is compared with the causal one. A packed row whose token types hold only causal values
takes the packed attention; any other value, the owner's own mask per sequence (`tfcompat.hf.vision`).

Without token types an owner may hand no mask at all (sdpa drops the causal mask of an unpadded row) over attention
modules that are not causal (PaliGemma's ``is_causal = False``): stock then attends both ways over a whole sequence
when it is alone and causally when the batch is padded; `TokenTypeRule.untyped_causal` is False there.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ..errors import PatchError
from ..registry import Resolved

__all__ = ["PROBED", "TokenTypeRule", "owner_mask", "remember", "required", "token_type_rule", "with_prefix_suffix"]

PROBED = (0, 1, 2)  # the values processors give (text / image / video, prefix / suffix); others count as marking
_LENGTH = 4  # the probe row: short, inside every window

_RULES: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, TokenTypeRule]] = weakref.WeakKeyDictionary()


class TokenTypeRule(NamedTuple):
    """causal: the token-type values whose rows the owner masks causally (as text, or as no token types); a packed
    row holding only these takes the packed attention. untyped_causal: whether a row without token types is masked
    causally (False: the owner hands no mask over attention that is not causal, or a mask that is not causal)."""

    causal: tuple[int, ...]
    untyped_causal: bool


class _Captured(Exception):
    """Stops an owner's forward at its language model once the mask it hands it is recorded."""


def owner_mask(owner: torch.nn.Module, language_model: torch.nn.Module, inputs: Mapping[str, Any]) -> Any:
    """The ``attention_mask`` ``owner`` hands ``language_model`` when called with ``inputs`` (ids or embeddings,
    token types, positions: what the mask reads); the forward stops there. A dict per layer type, a 4-D tensor, or
    None."""
    seen: list[Any] = []

    def record(module: torch.nn.Module, args: tuple, kw: dict[str, Any]) -> None:
        seen.append(kw.get("attention_mask"))
        raise _Captured

    hook = language_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with contextlib.suppress(_Captured), torch.no_grad():
            owner(**inputs)
    finally:
        hook.remove()
    return seen[0] if seen else None


def token_type_rule(r: Resolved, owner: torch.nn.Module, language_model: torch.nn.Module, names: tuple[str, ...]
                    ) -> TokenTypeRule:
    """The rule of ``owner`` (`VisionDerivation.owner`, holding ``language_model``) for its token-type inputs
    ``names`` (module docstring), under its current attention implementation; cached per owner and implementation
    (`remember` records it under another). `PatchError` where its forward does not run on a text row."""
    impl = str(getattr(owner.config, "_attn_implementation", None))
    known = _RULES.get(owner, {}).get(impl)
    if known is not None:
        return known
    v = r.entry.derived_vision
    placeholder = getattr(owner.config, v.placeholder, None) if v is not None and v.placeholder else None
    device = next(owner.parameters()).device
    ids = torch.full((1, _LENGTH), 1 if placeholder == 0 else 0, dtype=torch.long, device=device)  # text tokens
    row = {"input_ids": ids, "position_ids": torch.arange(_LENGTH, device=device)[None]}
    causal_attention = all(getattr(m, "is_causal", True) is not False for m in language_model.modules())

    def causal(mask: Any) -> bool:
        if isinstance(mask, Mapping):
            return all(causal(m) for m in mask.values())
        if mask is None:  # transformers left the mask to the attention: causal where its modules are
            return causal_attention
        if not isinstance(mask, torch.Tensor):
            return False
        if mask.ndim < 2 or mask.shape[-2] != _LENGTH or mask.shape[-1] < _LENGTH:
            return False
        grid = mask.reshape(-1, *mask.shape[-2:])[0]  # (1, 1, L, K) -> (L, K): 4.x pads the keys beyond L
        attends = grid if grid.dtype == torch.bool else grid > torch.finfo(grid.dtype).min / 2  # additive: 0 attends
        return bool(torch.equal(attends[:, :_LENGTH], torch.ones_like(attends[:, :_LENGTH]).tril())
                    and not attends[:, _LENGTH:].any())

    try:
        values = tuple(v for v in PROBED if causal(
            owner_mask(owner, language_model, {**row, **{n: torch.full_like(ids, v) for n in names}})))
        rule = TokenTypeRule(values, causal(owner_mask(owner, language_model, row)))
    except Exception as exc:  # noqa: BLE001 -- any reason the owner's forward does not run on text alone
        raise r.error(PatchError, f"cannot read how {type(owner).__name__} masks {', '.join(names)}",
                      why=f"its forward on a text row of {_LENGTH} tokens raised {type(exc).__name__}: {exc}"[:400],
                      supported="owners whose forward runs on text alone", fix="run the model unpatched") from None
    return remember(owner, impl, rule)


def remember(owner: torch.nn.Module, impl: str, rule: TokenTypeRule) -> TokenTypeRule:
    """Record ``rule`` as ``owner``'s under implementation ``impl`` (a patch's own, whose masks are not stock)."""
    _RULES.setdefault(owner, {})[impl] = rule
    return rule


def required(r: Resolved, owner: torch.nn.Module, language_model: torch.nn.Module) -> tuple[str, ...]:
    """The token-type inputs without which ``owner`` masks a row otherwise than causally (PaliGemma's under sdpa),
    so that packed rows need them (its processor returns them); () for any other owner."""
    v = r.entry.derived_vision
    if v is None or not v.mask_inputs:
        return ()
    return () if token_type_rule(r, owner, language_model, v.mask_inputs).untyped_causal else v.mask_inputs


def with_prefix_suffix(examples: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[dict[str, Any]]:
    """``examples`` each with ``names`` ``(1, L)`` as a prefix-suffix processor returns them: 0 over the first half
    of ``input_ids (1, L)``, 1 over the rest (PaliGemma's prompt and suffix; for any owner a layout to mask as stock
    does)."""
    return [{**ex, **{n: (torch.arange(ex["input_ids"].shape[-1], device=ex["input_ids"].device)
                          >= ex["input_ids"].shape[-1] // 2).long()[None] for n in names}} for ex in examples]
