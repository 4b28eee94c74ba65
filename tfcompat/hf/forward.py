"""Which path one forward of a patched model takes: tfcompat's packed core, or the stock attention.

A patched model runs a packed row through the varlen core and every other call (a padded batch with an
attention mask, KV-cache decoding, ``generate()``, a call without position ids) through the attention
implementation its config named before `tfcompat.patch`, so those calls return what the unpatched model
returns. The choice is made once per forward, by the outermost patched forward, and travels down in the
forward's kwargs (`tfcompat.context.CONTEXT_KWARG`):

- packed (`tfcompat.context.ForwardContext`): position ids with a text row are given (``(4, B, L)`` or
  ``(B, L)``), no cache object is passed, and the attention mask is None, all ones, a right padding of packed rows,
  or a 4-D mask (``(B or 1, 1, L, L)``) equal to the block-diagonal causal mask of the packed sequences
  (`tfcompat.core.custom_mask`; any other 4-D mask with packed position ids is an `InvalidInputError`);
- stock (`tfcompat.context.StockContext`): anything else. The text configs name the stock implementation for
  the duration of the stock forward (transformers builds that implementation's mask and dispatches to it); a
  recomputation under gradient checkpointing, which runs after the forward, reaches tfcompat's key and is
  dispatched to the same stock function by `tfcompat.hf_attention`.

The packed decision and its checks read one host copy of the position ids (and the 2-D mask, or where a 4-D mask
first differs from the boundaries'): the forward's one sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from ..core.context import ForwardContext, StockContext
from ..core.custom_mask import HIDDEN_AT_MOST, disagreement, is_comparable
from ..core.packing import PackedSeqs, from_host_positions, has_packed_rows
from ..core.position_ids import Positions, contract_shape, split_positions
from ..errors import InvalidInputError, PatchedModelError
from ..inputs.vision_inputs import check_vision_inputs
from ..registry import Resolved
from ..registry.records import TextModelLayout
from .rope_lengths import LengthRule, check_lengths, rules_of, seen_lengths

__all__ = ["CACHE_ARGS", "Router", "to_text_model_layout"]

# the names transformers' forwards give their cache argument, across releases
CACHE_ARGS = ("past_key_values", "past_key_value", "cache")
PER_SEQUENCE_FIX = ("pack the sequences with tfcompat.pack(model, examples), or call tfcompat.rope_index on each "
                    "sequence alone and concatenate the results on the last dim")


def to_text_model_layout(positions: Positions, layout: TextModelLayout) -> torch.Tensor:
    """What the installed text model takes (`tfcompat.registry.records.Entry.text_model_positions`): ``(A, B, L)``
    "mrope", ``(1 + A, B, L)`` "text+mrope", ``(B, L)`` "text" (A M-RoPE axes: 3, HunYuan-VL's 4)."""
    if layout == "text":
        return positions.text
    if layout == "mrope":
        return positions.mrope
    return torch.cat([positions.text[None], positions.mrope], dim=0)  # (1, B, L) + (3, B, L) -> (4, B, L)


def _pad_tails_as_sequences(text: torch.Tensor, mrope: torch.Tensor, attended: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                     torch.Tensor]:
    """Position rows for the boundaries only: each row's right padding renumbered 0, 1, ... as a sequence of its
    own, whatever positions the caller gave it. Causal attention and the linear-attention recurrences never read
    forward, so the padding changes no real token. text: ``(B, L)``, mrope: ``(A, B, L)``, attended: ``(B, L)``."""
    pad = ~attended
    tail = pad.long().cumsum(-1) - 1  # (B, L): 0, 1, ... over each row's padding
    return torch.where(pad, tail, text), torch.where(pad, tail, mrope)


# torch.compile cannot trace boundaries read from the position ids' values: the host copy is a graph break,
# which fullgraph=True reports with this reason (a packed forward with tfcompat.pack's context traces whole)
_COMPILE_REASON = ("tfcompat: a raw packed call (position_ids that restart, no tfcompat context) reads its position "
                   "ids on the host to find the sequence boundaries, which torch.compile(fullgraph=True) cannot "
                   "trace; pass tfcompat.pack(model, examples).model_inputs, whose context carries the boundaries, "
                   "or compile without fullgraph (a graph break here)")


@torch.compiler.disable(reason=_COMPILE_REASON)
def _to_host(rows: list[torch.Tensor]) -> torch.Tensor:
    """``rows`` stacked and copied to the host: the packed decision's one sync (see `_COMPILE_REASON`)."""
    return torch.cat(rows).cpu()


class Router:
    """Decides packed or stock for the forwards of one patched model (built by `tfcompat.patch`).

    stock: ``(config, implementation before the patch)`` for every config the patch set to ``key``.
    eager: the family module's ``eager_attention_forward`` (the stock function of ``"eager"``).
    vision_config: the config holding the vision placeholder token ids (the top model's), or None.
    text_configs: the text models' configs, whose rotary embeddings turn the row's positions into frequencies (those
    of decoder layers run per sequence too, which set no attention key).
    axes: the text model's number of M-RoPE axes (3; HunYuan-VL's XD-RoPE: its config's), the contract's rows
    after the text row.
    """

    def __init__(self, r: Resolved, key: str, stock: list[tuple[Any, str]], eager: Callable[..., Any] | None,
                 group: Any, vision_config: Any = None, text_configs: tuple[Any, ...] = (), axes: int = 3) -> None:
        self.r, self.key, self.stock, self.eager, self.group = r, key, stock, eager, group
        self.vision_config, self.axes = vision_config, axes
        self.context = StockContext(stock[0][1] if stock else "eager", eager)
        # ropes whose frequencies follow the call's longest position (`tfcompat.hf.rope_lengths`)
        self.rope_rules: set[LengthRule] = rules_of([c for c, _ in stock] + list(text_configs), r)
        # the path the text model's latest forward took (read after it by `tfcompat.hf.pooling`)
        self.last: ForwardContext | StockContext | None = None
        # the path the model given to `tfcompat.patch` decided for the call in progress (its forward may pass the
        # text model no **kwargs)
        self.pending: ForwardContext | StockContext | None = None
        # the split of the position ids `decide` made for a packed forward, kept for the text model's forward
        self._split: tuple[torch.Tensor, tuple[int, ...], Positions] | None = None

    def positions(self, position_ids: torch.Tensor, tokens: torch.Tensor) -> Positions:
        """``position_ids`` split by role (`tfcompat.core.position_ids.split_positions`), one row per row of
        ``tokens`` (``(B, L)`` ids or ``(B, L, H)`` embeddings); `InvalidInputError` otherwise.

        Once per forward: the split `decide` made for a packed forward is handed to the next call with the same
        tensor (the text model's forward, below the model given to `tfcompat.patch`).
        """
        kept, self._split = self._split, None
        if kept is not None and kept[0] is position_ids and kept[1] == tuple(tokens.shape[:2]):
            return kept[2]
        positions = split_positions(position_ids, seq_len=tokens.shape[1], family=self.r.family, axes=self.axes)
        if positions.text.shape[0] != tokens.shape[0]:
            raise self.r.error(InvalidInputError, "position_ids and the input tokens differ in batch size",
                               why=f"{positions.text.shape[0]} position rows for {tokens.shape[0]} token rows",
                               fix="build one row of position ids per row of tokens")
        return positions

    def check_rope_lengths(self, seqs: PackedSeqs, rows: torch.Tensor | None = None, offset: int = 0) -> None:
        """`InvalidInputError` where a length-dependent rope would rotate a sequence of ``seqs`` otherwise packed
        than alone (`tfcompat.hf.rope_lengths`). The rope switches on the largest position + 1 it is given: each
        sequence's length plus ``offset`` (where its owner numbers positions from ``offset``, PaliGemma's 1) from
        the host, no sync; over M-RoPE ``rows`` ``(A, B, L)``, which an image keeps below the token count, their
        largest per sequence (one sync per forward, for such a rope only)."""
        if not self.rope_rules:
            return
        lengths = seqs.lengths if rows is None else seen_lengths(rows, seqs)
        check_lengths(self.rope_rules, tuple(n + offset for n in lengths), self.r.error)

    def check_key(self) -> None:
        """`PatchedModelError` when a config no longer names tfcompat's key (``set_attn_implementation`` after
        the patch): the patch cannot tell which attention the caller wants."""
        changed = [c._attn_implementation for c, _ in self.stock if c._attn_implementation != self.key]
        if changed:
            raise self.r.error(
                PatchedModelError,
                f"the attention implementation of a patched model was changed to {changed[0]!r} after patch()",
                why=f"patch() set config._attn_implementation to {self.key!r}; something (set_attn_implementation?) "
                f"replaced it, so neither packed rows nor ordinary calls would run what the patch promises",
                fix="undo() the patch, then set_attn_implementation(...), then patch again; ordinary (unpacked) calls "
                f"on a patched model already run the implementation it had before patch() ({self.context.impl!r})",
            )

    def check_vision(self, a: dict[str, Any]) -> None:
        """The call's pixel values, grids and placeholder tokens agree (`tfcompat.vision_inputs`); decoding
        steps (a cache in use) carry no new pixels and are not checked."""
        names = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
        inputs = {n: a.get(n) for n in names if a.get(n) is not None}
        if self.vision_config is None or not inputs or any(a.get(n) is not None for n in CACHE_ARGS):
            return
        mask = a.get("attention_mask")
        check_vision_inputs(self.r, self.vision_config, a.get("input_ids"), inputs,
                            attention_mask=mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None)

    def decide(self, a: dict[str, Any], *, user_call: bool) -> ForwardContext | StockContext:
        """The path of the forward whose bound arguments are ``a``.

        user_call: ``a`` are the caller's own arguments (the outermost patched forward): three-row position ids
        are then refused, since a patched model cannot tell a packed row of them from one sequence. Deeper
        down they are what a vision-language model computed itself for an ordinary call.
        """
        tokens = a.get("inputs_embeds")
        tokens = a.get("input_ids") if tokens is None else tokens
        position_ids = a.get("position_ids")
        # generate() passes cache_position from its prefill on; where the model builds its own cache (Qwen3.5 on
        # 5.2-5.8) the prefill carries no cache object, and a packed forward would leave that cache empty
        cached = any(a.get(name) is not None for name in CACHE_ARGS) or a.get("cache_position") is not None
        if tokens is None or position_ids is None or cached or not isinstance(position_ids, torch.Tensor):
            return self.context
        if position_ids.ndim == 3 and position_ids.shape[0] == self.axes:
            if user_call:
                raise self.r.error(
                    InvalidInputError, f"{self.axes}-row position ids have no text row",
                    why=f"({self.axes}, B, L) ids are the M-RoPE rows only; a patched model cannot tell a packed row "
                    "of them from one sequence, nor find the sequence boundaries",
                    fix=f"pass tfcompat.rope_index(model, ids, ...) ({self.axes + 1} rows) per sequence, concatenated "
                    "(or tfcompat.pack); for an ordinary call pass no position_ids",
                    supported=contract_shape(self.axes))
            return self.context
        if tokens.device.type == "meta":
            raise self.r.error(InvalidInputError, "a patched forward got meta tensors",
                               why="the packed path reads the position ids to find the sequence boundaries; meta "
                               "tensors have no values", fix="materialize the model and the inputs "
                               "(model.to_empty(device=...), then load the weights) before running it")
        positions = self.positions(position_ids, tokens)
        mask = a.get("attention_mask")
        custom = isinstance(mask, torch.Tensor) and mask.ndim == 4
        mask4d = cast(torch.Tensor, mask)  # read only where `custom`
        if mask is not None and not custom and (not isinstance(mask, torch.Tensor)
                                                or mask.shape != positions.text.shape):
            return self.context  # a precomputed mask (a dict per layer type, ...): the caller asked for stock masking
        comparable = custom and is_comparable(mask4d, *positions.text.shape)
        ids = a.get("input_ids")
        vision = (self.vision_config is not None and self.r.spec.mm_token_types is not None and ids is not None
                  and position_ids.ndim == 2)
        rows = [positions.text[None].long(), positions.mrope.long()]
        if mask is not None and not custom:
            rows.append(mask[None].to(rows[0].device, torch.long))
        if comparable:  # where the caller's 4-D mask first differs from the boundaries', per query token
            rows.append(disagreement(mask4d, positions.text.long())[None].to(rows[0].device))
        if vision:  # vision placeholders with text-only ids: M-RoPE positions would be lost
            rows.append(self.r.spec.mm_token_types(self.vision_config, ids)[None].to(  # type: ignore[misc, arg-type]
                rows[0].device, torch.long))  # `vision` checked both for None
        host = _to_host(rows)  # (1 + A [+ 1] [+ 1], B, L): the forward's one host sync
        extra = 1 + self.axes  # the row after the positions
        text, mrope = host[0], host[1:extra]
        if custom:
            if not has_packed_rows(text):  # one sequence per row (or no packed ids): the caller's masking, stock
                return self.context
            self._check_custom_mask(mask4d, host[extra] if comparable else None, text)
        elif mask is not None and not bool(host[extra].all()):
            if not self._packed_with_padding(text, host[extra]):
                return self.context
            text, mrope = _pad_tails_as_sequences(text, mrope, host[extra].bool())
        if vision and bool(host[-1].any()):
            raise self.r.error(
                InvalidInputError, "vision placeholders with text-only (B, L) position ids",
                why="image and video tokens take M-RoPE positions [t; h; w] that a (B, L) row cannot carry; the "
                "model would place every vision token on the text row", fix=PER_SEQUENCE_FIX + " (4-row ids)")
        self._check_packed(text, mrope if position_ids.ndim == 3 else None)
        seqs = from_host_positions(text, device=tokens.device, family=self.r.family)
        if a.get("use_cache") is True:  # asked for, not defaulted: generate()'s prefill on 5.4+ passes only this
            if len(seqs.lengths) == text.shape[0]:  # one sequence per row: the stock forward builds its cache
                return self.context
            raise self.r.error(
                InvalidInputError, "a packed row cannot build a KV cache",
                why=f"use_cache=True with {len(seqs.lengths)} sequences in {text.shape[0]} row(s); a cache continues "
                "one sequence per row",
                fix="pass use_cache=False (or leave it unset) for packed rows; generate() with one sequence per row")
        if self.group is not None:
            raise self.r.error(
                InvalidInputError, "a sequence-parallel forward needs the inputs of tfcompat.ulysses.shard_inputs",
                why="the model was patched with ulysses_group, and no shard context was passed",
                fix="model(**tfcompat.ulysses.shard_inputs(ids, position_ids, group=group).model_inputs)")
        self._split = (position_ids, tuple(tokens.shape[:2]), positions)
        return ForwardContext(seqs, mask=mask if custom else None)

    def _check_custom_mask(self, mask: torch.Tensor, first: torch.Tensor | None, text: torch.Tensor) -> None:
        """`InvalidInputError` unless the 4-D ``mask`` of a packed call is the block-diagonal causal mask of its
        boundaries. first: `tfcompat.core.custom_mask.disagreement` on the host, ``(B, L)`` (None: a form it does not
        compare); text: the ``(B, L)`` host text row."""
        supported = ("a 4-D mask (B or 1, 1, L, L) equal to the block-diagonal causal mask of the position ids' "
                     f"sequences: bool (True attends) or floating additive (0 attends, at most {HIDDEN_AT_MOST:g} "
                     "hides)")
        fix = ("pass attention_mask=None (the restarting position ids mark the boundaries) or a (B, L) padding mask; "
               "attention other than causal within each sequence runs on the unpatched model (undo() the patch)")
        if first is None:
            raise self.r.error(
                InvalidInputError, f"a 4-D attention_mask of shape {tuple(mask.shape)} and dtype {mask.dtype} with "
                "packed position ids", why=f"the packed row is {tuple(text.shape)}; a 4-D mask is taken only where "
                "it is the mask of the packed boundaries", supported=supported, fix=fix)
        bad = (first >= 0).nonzero()
        if len(bad) == 0:
            return
        row, query = (int(i) for i in bad[0])
        key = int(first[row, query])
        start = query - int(text[row, query])  # inside a sequence positions count up by 1 from its start
        value = mask[min(row, mask.shape[0] - 1), 0, query, key].item()  # a sync, on the way to the error only
        if mask.dtype == torch.bool:
            says = f"is {value} ({'attends' if value else 'hides'})"
        elif value == 0 or value <= HIDDEN_AT_MOST:
            says = f"is {value:g} ({'attends' if value == 0 else 'hides'})"
        else:
            says = f"is {value:g}, which neither attends (0) nor hides (at most {HIDDEN_AT_MOST:g})"
        where = ("a later token" if key > query else "a token of an earlier sequence" if key < start
                 else "an earlier token of the same sequence" if key < query else "the query itself")
        raise self.r.error(
            InvalidInputError, "a 4-D attention_mask that is not the block-diagonal causal mask of the packed row",
            why=f"at row {row}, query token {query} (its sequence starts at token {start}), key token {key}: the mask "
            f"{says}, but the key is {where}, which causal attention within each sequence "
            f"{'attends' if start <= key <= query else 'hides'}; the packed attention would not do what the mask says",
            supported=supported, fix=fix)

    def _packed_with_padding(self, text: torch.Tensor, mask: torch.Tensor) -> bool:
        """Whether a batch with padding holds packed rows: some row restarts its position ids on attended tokens.
        Packed rows may be right-padded (LLaMA-Factory's neat packing, batches of packs padded to the longest); a
        padded batch of one sequence per row runs stock. text, mask: ``(B, L)`` on the host."""
        attended = mask.bool()
        first = attended.long().cumsum(-1) == 1  # the first attended token of each row
        restarts = attended & ~first & (text == 0)
        if not bool(restarts.any()):
            return False
        gaps = ~attended & attended.flip(-1).long().cumsum(-1).flip(-1).bool()  # a zero before an attended token
        if bool(gaps.any()):
            row, col = (int(i) for i in gaps.nonzero()[0])
            raise self.r.error(
                InvalidInputError, "a packed row with padding before its end",
                why=f"row {row} restarts its position ids and its attention_mask is 0 at token {col}, before attended "
                "tokens; packed rows may carry padding only at their end (right padding)",
                fix="pad packed rows on the right, or drop the padding (attention_mask=None)")
        return True

    def _check_packed(self, text: torch.Tensor, mrope: torch.Tensor | None) -> None:
        """M-RoPE rows that do not restart with the text row (negative ids: `tfcompat.packing.from_host_positions`)."""
        if mrope is None:
            return
        starts = text == 0
        bad = starts & (mrope != 0).any(0)
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            raise self.r.error(
                InvalidInputError, "position ids are not per sequence",
                why=f"at row {row}, token {col} the text row restarts at 0 but [t; h; w] = "
                f"{[int(x) for x in mrope[:, row, col]]}; a sequence's M-RoPE positions start at 0 too, so these were "
                "computed over more than one sequence (rope_index on the whole packed row?)", fix=PER_SEQUENCE_FIX)

    @contextlib.contextmanager
    def stock_attention(self) -> Iterator[None]:
        """The configs name their pre-patch implementation inside the block (masks and dispatch are stock)."""
        for config, impl in self.stock:
            config._attn_implementation = impl
        try:
            yield
        finally:
            for config, _ in self.stock:
                config._attn_implementation = self.key
