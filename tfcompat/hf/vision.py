"""What a patch adds for a derived vision-language model (`tfcompat.registry.records.VisionDerivation`).

Its text model is patched as its text family; the model's own forward runs the vision tower and scatters the
features, then hands the packed position ids and the forward context down (proved when the entry was derived).
`plan_vision` checks the instance at `patch()` time: every module of the text family's classes sits inside the
language model (a vision tower built from the same classes would otherwise run packed attention over patches).

Where the owner builds the language model's mask itself (Gemma 3, from ``token_type_ids``), `vision_hooks` adds:

- a packed row whose token types hold only values the owner masks causally (asked of its forward at ``patch()``:
  `tfcompat.inputs.token_types`; Gemma 3's 0, PaliGemma's 1), or that has none, takes its boundaries from the
  forward context; the owner's mask (over the whole row) is dropped at the text model. Where the owner's attention
  is not causal and it hands no mask without token types (PaliGemma under sdpa), a row without them is refused;
- a packed row whose token types mark anything else (images, PaliGemma's bidirectional prefix) runs the stock attention
  of the pre-patch implementation for that forward, with the owner's own mask of each sequence alone laid on the
  row's diagonal (`_masks_per_sequence`: exact, as stock per sequence). Only ``eager`` and ``sdpa`` take such a
  mask, and it needs one process: other implementations, Ulysses and padded rows raise `InvalidInputError`.
  transformers' own mask of the whole row is not used: where it remaps a packed row's mask functions to
  per-sequence positions (5.23+) and the owner hands its image overlay to a mask as such a function (Gemma 3's and
  Gemma 4's sliding-window masks), it reads each later sequence's tokens at the first sequence's positions
  (`overlay_remapped`), and PaliGemma's prefix blocks (5.18 and before) span the sequences of a row.

Where a forward on the way spreads the ``**kwargs`` that carry the position ids into a vision method besides its
language model (InstructBLIP-Video's ``get_video_features``, whose vision tower and Q-Former would read a packed row's
position ids as their own: `VisionDerivation.kwargs_shared`), `shared_kwargs` wraps that method or submodule on the
instance: tfcompat's forward context never reaches it, nor, on a packed row, the row's position ids (the stock model
of each sequence alone is called without them).

Where the owner hands its text model images as cross-attention states (Mllama: `tfcompat.hf.cross_states`), the
cross-attention modules run the stock attention, and their decoder layers hand a sequence without images its hidden
states through.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch

from ..core.context import CONTEXT_KWARG, ForwardContext
from ..core.position_ids import split_positions
from ..errors import InvalidInputError, PatchError
from ..inputs.derived_vision import owner_of
from ..inputs.token_types import TokenTypeRule, owner_mask, remember, token_type_rule
from ..registry import Resolved
from ..registry.records import CrossStates
from . import cross_states as hf_cross
from .forward import Router

__all__ = ["EXACT_BLOCK_IMPLEMENTATIONS", "VisionHook", "VisionPlan", "overlay_remapped", "plan_vision",
           "shared_kwargs", "vision_hooks"]

# stock implementations whose masks transformers builds from packed position ids (sequences apart), image blocks in
EXACT_BLOCK_IMPLEMENTATIONS = ("eager", "sdpa")


class VisionHook(NamedTuple):
    """A hook to register: on ``module``, a forward ``"pre"`` hook (with kwargs) or a ``"post"`` hook (always
    called, also when the forward raises)."""

    module: torch.nn.Module
    kind: Literal["pre", "post"]
    fn: Callable[..., Any]
    note: str


class VisionPlan(NamedTuple):
    owner: torch.nn.Module
    text_models: list[torch.nn.Module]


def plan_vision(model: torch.nn.Module, r: Resolved, text_models: list[torch.nn.Module],
                attentions: list[torch.nn.Module], group: Any) -> VisionPlan | None:
    """Check that ``text_models`` and ``attentions`` (the text family's modules found in ``model``) all sit inside
    its language model, and that a Ulysses ``group`` can be fed; `PatchError` otherwise. None for an entry that is
    not a derived vision-language one."""
    v = r.entry.derived_vision
    if v is None:
        return None
    owner, language_model = owner_of(r, model)
    inside = {id(m) for m in language_model.modules()}
    outside = [type(m).__name__ for m in (*text_models, *attentions) if id(m) not in inside]
    if outside:
        raise r.error(PatchError, f"{type(model).__name__} holds {outside[0]} outside its language model",
                      why=f"the vision tower or projector is built from the text family's classes ({v.text_family}); "
                      "a patch would run packed attention there", supported=r.spec.supported,
                      fix="run the model unpatched")
    if v.embeds_need_ids and group is not None:
        raise r.error(PatchError, f"{type(model).__name__} cannot run sequence parallel on this transformers",
                      why=f"{v.model}'s forward takes no inputs_embeds without input_ids (or without pixel "
                      "values), and a sharded forward "
                      "takes the embeddings of whole images (tfcompat.embed_inputs) sliced per rank",
                      supported="Ulysses for vision-language models whose forward takes inputs_embeds",
                      fix="patch without ulysses_group, or use a transformers release whose forward takes them")
    if v.mask_inputs and v.owner_mask != "attention_mask" and owner is model:
        raise r.error(PatchError, f"cannot patch {type(model).__name__} itself: it builds its language model's mask "
                      f"from {', '.join(v.mask_inputs)}", why="the packed decision is made in the patched model's "
                      "forward, after a hook on it could route token-typed packed rows to the attention that honours "
                      "them", supported=f"patching {v.model}", fix=f"patch the {v.model} that holds it")
    return VisionPlan(owner, text_models)


def vision_hooks(plan: VisionPlan | None, r: Resolved, router: Router) -> list[VisionHook]:
    """The hooks a patch registers for ``plan`` (see the module docstring): those of cross-attention states where the
    owner hands any, and none more where it hands its language model the caller's mask."""
    v = r.entry.derived_vision
    if plan is None or v is None:
        return []
    hooks = _cross_hooks(plan, v.cross_states, router) if v.cross_states is not None else []
    if v.owner_mask == "attention_mask":
        return hooks
    hooks += [VisionHook(tm, "pre", _drop_owner_mask, f"packed rows: the boundaries replace {v.owner}'s own mask "
                         f"({v.owner_mask})") for tm in plan.text_models]
    if v.mask_inputs:  # asked before the patch names its own implementation, under which masks are not stock
        rule = remember(plan.owner, router.key, token_type_rule(r, *owner_of(r, plan.owner), v.mask_inputs))
        switch = _ImageBlocks(r, router, v.mask_inputs, rule)
        hooks += [VisionHook(plan.owner, "pre", switch.enter, f"packed rows with {', '.join(v.mask_inputs)} marking "
                             "images: stock attention, transformers' mask of the packed row (bidirectional images)"),
                  VisionHook(owner_of(r, plan.owner)[1], "pre", switch.substitute, "such rows: the owner's mask of "
                             "each sequence alone, block-diagonal"),
                  VisionHook(plan.owner, "post", switch.exit, "restores the patched attention after such a forward")]
    return hooks


def shared_kwargs(model: torch.nn.Module, r: Resolved, router: Router
                  ) -> list[tuple[Any, str, Callable[..., Any], str]]:
    """``(target, attribute, wrapper, note)`` for each call `VisionDerivation.kwargs_shared` names in ``model``: the
    bound method (``owner.get_video_features``) or submodule forward (``vision_model.forward``) it wraps with
    `_without_row_keys`; `PatchError` where the instance holds no such method or submodule."""
    v = r.entry.derived_vision
    if v is None or not v.kwargs_shared:
        return []
    module = importlib.import_module(r.entry.module)
    out: list[tuple[Any, str, Callable[..., Any], str]] = []
    for cls_name, path in v.kwargs_shared:
        cls = getattr(module, cls_name, None)
        holders = [m for m in model.modules() if isinstance(cls, type) and isinstance(m, cls)]
        for holder in holders:
            *parents, last = path.split(".")
            parent: Any = holder
            for name in parents:
                parent = getattr(parent, name, None)
            target = getattr(parent, last, None)
            if isinstance(target, torch.nn.Module):
                parent, last, target = target, "forward", target.forward
            if not callable(target):
                raise r.error(PatchError, f"{type(model).__name__} has no {cls_name}.{path} to call",
                              why=f"{cls_name}.forward hands its **kwargs to self.{path}", supported=r.spec.supported,
                              fix=f"pass the {v.model} built by transformers")
            out.append((parent, last, _without_row_keys(target, router), f"packed rows: {cls_name}.forward's **kwargs "
                        f"reach self.{path} without the row's position ids or tfcompat's context, as stock per "
                        "sequence"))
    return out


def _without_row_keys(original: Callable[..., Any], router: Router) -> Callable[..., Any]:
    """``original`` called without tfcompat's forward context, and on a packed row without its position ids: what
    the stock model of each sequence alone hands it (no position ids)."""
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        ctx = kwargs.pop(CONTEXT_KWARG, None)
        if isinstance(ctx, ForwardContext) or isinstance(router.pending, ForwardContext):
            kwargs.pop("position_ids", None)
        return original(*args, **kwargs)

    return call


def _cross_hooks(plan: VisionPlan, cross: CrossStates, router: Router) -> list[VisionHook]:
    """The hooks on the language model's cross-attention layers and their attention (`tfcompat.hf.cross_states`)."""
    language_model = [m for tm in plan.text_models for m in tm.modules()]
    hooks = [VisionHook(m, "pre", hf_cross.stock_attention(router.context), "cross-attention to image states: the "
                        f"stock attention ({router.context.impl}), with each token's own sequence's keys")
             for m in language_model if type(m).__name__ in cross.attentions]
    hooks += [VisionHook(m, "post", hf_cross.keep_skipped(type(m), cross.mask), "packed rows: tokens of a sequence "
                         "without images keep their hidden states (stock skips the layer)")
              for m in language_model if type(m).__name__ in cross.layers]
    return hooks


def _drop_owner_mask(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """A packed forward's text model: the mask its owner built (a dict or 4-D tensor over the whole row) is left out;
    the forward context holds the boundaries."""
    if isinstance(kwargs.get(CONTEXT_KWARG), ForwardContext) and not (
            isinstance(kwargs.get("attention_mask"), torch.Tensor) and kwargs["attention_mask"].ndim == 2):
        kwargs["attention_mask"] = None
    return args, kwargs


class _ImageBlocks:
    """The switch of a packed forward whose token types mark images to the stock attention (module docstring)."""

    def __init__(self, r: Resolved, router: Router, names: tuple[str, ...], rule: TokenTypeRule) -> None:
        self.r, self.router, self.names, self.rule = r, router, names, rule
        self.active = 0
        self.masks: list[Any] = []  # per active forward: the mask its language model gets

    def enter(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        ctx = kwargs.get(CONTEXT_KWARG)
        if not isinstance(ctx, ForwardContext):
            return args, kwargs
        given = [n for n in self.names if isinstance(kwargs.get(n), torch.Tensor)]
        if not given and not self.rule.untyped_causal:
            raise self.r.error(
                InvalidInputError, f"a packed row without {self.names[0]}",
                why=f"{self.r.family}'s attention is not causal and, without {self.names[0]}, its owner hands it no "
                "mask under this attention implementation: stock attends both ways over a sequence alone and "
                "causally in a padded batch, so no packed row can equal it",
                supported=f"packed rows with {self.names[0]} (what the processor returns)",
                fix=f"pass the processor's {self.names[0]} in every example, or build the model with "
                "attn_implementation='eager'")
        causal = torch.tensor(self.rule.causal, dtype=torch.long)
        # under Ulysses a rank's slice may hold no image: refuse on the presence of token types, the same on every rank
        marked = given if ctx.group is not None else [
            n for n in given if bool((~torch.isin(kwargs[n], causal.to(kwargs[n].device))).any())]
        if not marked:
            return args, kwargs
        impls = sorted({impl for _, impl in self.router.stock})
        why = ""
        if ctx.group is not None:
            why = ("a sequence-parallel forward: the stock attention cannot run on a slice of the row (refused "
                   "whenever token types are given, so that every rank refuses alike)")
        elif any(impl not in EXACT_BLOCK_IMPLEMENTATIONS for impl in impls):
            why = (f"the model's own attention implementation is {', '.join(impls)}; transformers builds the mask of a "
                   f"packed row with image blocks for {' and '.join(EXACT_BLOCK_IMPLEMENTATIONS)} only")
        elif not hasattr(importlib.import_module("transformers.masking_utils"), "find_packed_sequence_indices"):
            why = "this transformers does not build masks of packed rows from their position ids"
        mask = kwargs.get("attention_mask")
        if not why and isinstance(mask, torch.Tensor) and not bool(mask.bool().all()):
            why = "the row has padding; transformers finds packed sequences only in rows without an attention mask"
        if why:
            raise self.r.error(
                InvalidInputError, f"{marked[0]} marks image tokens on a packed row that cannot attend within images",
                why=f"{self.r.family} attends bidirectionally within each image where {marked[0]} marks it; {why}",
                supported=f"one process, {' or '.join(EXACT_BLOCK_IMPLEMENTATIONS)} as the model's attention "
                "implementation, rows without padding",
                fix=f"build the model with attn_implementation='sdpa', or leave {marked[0]} out of packed rows (images "
                "then attend causally, as stock does without them)")
        # the stock rotary reads the row's positions: numbered as the owner numbers a sequence given none (1-indexed
        # PaliGemma), and refused where a length-dependent rope would take another length for one alone
        offset = self.r.entry.derived_vision.position_offset if self.r.entry.derived_vision is not None else 0
        positions = kwargs.get("position_ids")
        rows = None
        if isinstance(positions, torch.Tensor) and positions.ndim == 3:
            rows = split_positions(positions, seq_len=positions.shape[-1], family=self.r.family,
                                   axes=self.router.axes).mrope
        self.router.check_rope_lengths(ctx.seqs, rows, offset)
        if offset and isinstance(positions, torch.Tensor):
            kwargs["position_ids"] = positions + offset
        kwargs[CONTEXT_KWARG] = self.router.context  # an ordinary forward from here down: stock attention and masks
        kwargs["attention_mask"] = None  # all ones (checked): transformers then finds the sequences from positions
        if "use_cache" in kwargs:  # a cache of a packed row serves no later call
            kwargs["use_cache"] = False
        for config, impl in self.router.stock:
            config._attn_implementation = impl
        # the owner's own mask of each sequence alone, block-diagonal: transformers' mask of the whole row can read
        # one sequence's token types against another's (5.23+ remaps its overlay, `overlay_remapped`; PaliGemma's
        # prefix blocks on older releases span sequences). Built for the stock implementation just set, before the
        # count below, so that `exit` after each of those owner calls leaves the implementations as they are. It is
        # handed to the language model (`substitute`): an owner may build its mask anew from any mask it is given
        self.masks.append(_masks_per_sequence(module, self.r, ctx, kwargs))
        self.active += 1
        return args, kwargs

    def substitute(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]
                   ) -> tuple[tuple, dict[str, Any]]:
        """The language model's pre-hook: in such a forward, the owner's mask of each sequence alone replaces the
        one it built over the whole row."""
        if self.masks and kwargs.get(CONTEXT_KWARG) is self.router.context:
            kwargs["attention_mask"] = self.masks[-1]
        return args, kwargs

    def exit(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if self.active:
            self.active -= 1
            self.masks.pop()
            for config, _ in self.router.stock:
                config._attn_implementation = self.router.key


@torch.no_grad()
def _masks_per_sequence(owner: torch.nn.Module, r: Resolved, ctx: ForwardContext, kwargs: dict[str, Any]) -> Any:
    """The mask ``owner`` hands its language model for the packed row in ``kwargs``, built per sequence: its own
    forward runs on each sequence alone (ids or embeddings, token types, positions; no pixels: the mask reads token
    types only) up to the language model, and each mask (a dict per layer type, or a tensor; ``(1, 1, L_i, L_i)``
    boolean or additive, None for plain causal) lands on the diagonal of a ``(1, 1, T, T)`` mask that attends nowhere
    else."""
    language_model = owner_of(r, owner)[1]
    tokens = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
    per_token = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and (k == tokens or k.endswith(
        "token_type_ids"))]
    bounds = ctx.seqs.cu_seqlens.tolist()  # host copy: this path runs the stock attention anyway
    seen = [owner_mask(owner, language_model, {**{k: kwargs[k][:, start:end] for k in per_token},  # (1, L_i, ...)
                                               "position_ids": kwargs["position_ids"][..., start:end]})
            for start, end in zip(bounds[:-1], bounds[1:])]
    total = bounds[-1]
    if isinstance(seen[0], dict):
        return {key: _block_diagonal([m[key] for m in seen], bounds, total) for key in seen[0]}
    return _block_diagonal(seen, bounds, total)


def _block_diagonal(parts: list[torch.Tensor | None], bounds: list[int], total: int) -> torch.Tensor:
    """``(1, 1, T, T)``: ``parts[i]`` ``(1, 1, L_i, L_i)`` at sequence ``i``'s block (None: causal), nothing attended
    across blocks. Boolean where the parts are (sdpa's: True attends), else additive (eager's: 0 attends)."""
    given = [p for p in parts if p is not None]
    dtype = given[0].dtype if given else torch.bool
    device = given[0].device if given else None
    out = (torch.zeros(1, 1, total, total, dtype=torch.bool, device=device) if dtype == torch.bool else
           torch.full((1, 1, total, total), torch.finfo(dtype).min, dtype=dtype, device=device))
    for part, start, end in zip(parts, bounds[:-1], bounds[1:]):
        if part is None:
            causal = torch.ones(end - start, end - start, dtype=torch.bool, device=device).tril()
            part = causal if dtype == torch.bool else torch.zeros_like(causal, dtype=dtype).masked_fill(
                ~causal, torch.finfo(dtype).min)
        out[..., start:end, start:end] = part[..., : end - start]  # 4.x pads a sequence's keys beyond it: masked
    return out


@functools.cache
def overlay_remapped(module_name: str) -> str:
    """Why transformers' mask of a packed row reads the image overlay of ``module_name`` (a modeling module) at the
    wrong tokens ("" where it does not): its ``masking_utils`` remaps a packed row's mask functions to per-sequence
    positions (``remap_positions_for_packed_sequence``) and the module hands an overlay of image blocks or token types
    to a mask as ``or_mask_function``, which then looks each later sequence's tokens up at the first sequence's
    positions. Stock per sequence is right; only packed rows meet it."""
    masking = importlib.import_module("transformers.masking_utils")
    if not hasattr(masking, "remap_positions_for_packed_sequence"):
        return ""
    tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
    overlays = [ast.unparse(k.value) for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords
                if k.arg == "or_mask_function" and ("block" in ast.unparse(k.value) or "token_type" in
                                                    ast.unparse(k.value))]
    if not overlays:
        return ""
    return (f"this transformers remaps a packed row's mask functions to per-sequence positions (masking_utils."
            f"remap_positions_for_packed_sequence), and {module_name.rsplit('.', 1)[-1]} hands its image overlay to a "
            f"mask as one ({overlays[0]}): each later sequence would read the first sequence's image positions (a "
            "transformers bug of packed rows; stock per sequence is right)")
