"""The adapter between transformers' attention dispatch and tfcompat's varlen core.

transformers' attention modules compute q/k/v, apply their own rotary, then call
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, scaling=..., **kwargs)``.
A patched model's text config names `ATTENTION_KEY` (declared by the registry, whose ``explain()`` names it),
registered here, so the stock forward (and the stock
rotary of that version) runs unchanged and only the attention itself is ours. The key has no mask function
registered, so transformers builds no (T, T) mask for it. The packed boundaries arrive in the
`tfcompat.context.ForwardContext`; what each layer does beyond causal attention (window, softcap, sinks, chunks),
in the `AttentionFeatures` that `patch()` records on its attention module under `FEATURES_ATTR`. Every kwarg
transformers passes is either used, checked against those features, known to change nothing here, or read by no
attention implementation of the installed transformers (so no stock result depends on it): anything else raises
`PatchedModelError` rather than being dropped.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import sys
import textwrap
from typing import Any

import torch
import torch.distributed as dist

from ..core import a2a
from ..core.attention import AttentionFeatures, varlen_attention
from ..core.context import BRIDGE_ATTR, CONTEXT_KWARG, StockContext
from ..core.cross_attention import cross_attention
from ..core.packing import PackedSeqs, chunked
from ..errors import PatchedModelError
from ..registry.lookup import ATTENTION_KEY

__all__ = ["ATTENTION_KEY", "CROSS_ATTR", "FEATURES_ATTR", "HARMLESS_KWARGS", "TEMPERATURE_ATTR", "names_read",
           "packed_attention", "rank_heads", "register", "stock_function", "unregister"]

FEATURES_ATTR = "_tfcompat_features"  # on each patched attention module: its AttentionFeatures (absent: none)
# on an attention module whose stock forward scales its queries by their row index (llama4's NoPE temperature
# tuning, `tfcompat.registry.derive.temperature_guard`): (floor_scale, attn_scale)
TEMPERATURE_ATTR = "_tfcompat_temperature"
# on each cross-attention module of a patched encoder-decoder model's decoder (True): its keys and values are the
# encoder states, which a packed forward packs per sequence (`tfcompat.core.context.ForwardContext.encoder`)
CROSS_ATTR = "_tfcompat_cross"

# Kwargs that reach the attention function and change nothing in attention over packed sequences, from
# transformers' modeling files (4.53-5.24): the decoder layer's and model's pass-through kwargs (positions, cache
# objects and flags; a cache that adds past keys fails the core's shape check instead), the output flags
# (packed attention returns no weights, as stock sdpa), the packed-flash kwargs of DataCollatorWithFlattening
# (stock eager and sdpa ignore them too; the boundaries here come from the position ids) and the trainer's
# num_items_in_batch; ``logits_to_keep``, which some vision-language forwards (LLaVA-OneVision) hand their owner, whose
# **kwargs carry it down to the attention.
HARMLESS_KWARGS = frozenset({
    CONTEXT_KWARG, "position_ids", "cache_position", "position_embeddings", "use_cache", "past_key_value",
    "past_key_values", "cache", "output_attentions", "output_hidden_states", "output_router_logits",
    "num_items_in_batch", "logits_to_keep", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
})
_CHECKED = frozenset({"sliding_window", "softcap", "s_aux", "is_causal"})  # compared with the layer's features
# transformers' modules whose code the attention functions of ALL_ATTENTION_FUNCTIONS run (besides their own)
_ATTENTION_HELPERS = ("transformers.modeling_flash_attention_utils",)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over the packed core.

    query: ``(B, Hq, L, Dqk)``; key: ``(B, Hkv, L, Dqk)``; value: ``(B, Hkv, L, Dv)`` (already rotated by the stock
    forward). Returns ``(B, L, Hq, Dv)`` and no weights. ``attention_mask`` is ignored: causality and sequence
    boundaries come from the context, windows, softcap and chunks from the module's `FEATURES_ATTR`, sinks from
    ``s_aux`` (gpt-oss) or ``module.sinks``; `PatchedModelError` for a kwarg that disagrees with them, for dropout,
    and for any other kwarg this adapter does not know to be harmless. A `tfcompat.context.StockContext` (an
    ordinary call recomputed under gradient checkpointing) goes to the stock function instead, with the stock mask.
    Under Ulysses (``B == 1``, ``L = T / sp``), q/k/v are traded for a head split before the core and back after
    it; each rank takes its heads' sinks (`rank_heads`).
    """
    ctx = kwargs.get(CONTEXT_KWARG) or module.__dict__.get(BRIDGE_ATTR)
    if isinstance(ctx, StockContext):  # an ordinary call, recomputed under gradient checkpointing after its forward
        return stock_function(ctx)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                   **kwargs)
    if ctx is None:
        raise PatchedModelError(
            f"{type(module).__name__} runs tfcompat's packed attention without packed boundaries",
            why="the attention was called outside the patched text model's forward (a decoder layer called "
                "directly), or its decoder layer got no **kwargs where the registry says it does",
            fix="call the patched model (or its text model) rather than a decoder layer directly, or undo() the "
                "patch",
        )
    if module.__dict__.get(CROSS_ATTR):
        return _cross(module, query, key, value, ctx, scaling, dropout, kwargs), None
    features = module.__dict__.get(FEATURES_ATTR) or AttentionFeatures()
    sinks = _layer_sinks(module, features, dropout, kwargs)
    seqs = ctx.seqs if features.chunk is None else chunked(ctx.seqs, features.chunk)  # cached per forward
    b, hq, length, d = query.shape
    dv = value.shape[-1]
    temperature: tuple[float, float] | None = module.__dict__.get(TEMPERATURE_ATTR)
    if temperature is not None:
        query = query * _temperature_rescale(ctx.seqs, temperature[0], temperature[1], query)  # (B, 1, L, 1)
    # (B, H, L, D) -> (B * L, H, D)
    q = query.transpose(1, 2).reshape(b * length, hq, d)
    k = key.transpose(1, 2).reshape(b * length, key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * length, value.shape[1], dv)
    if ctx.group is None:
        out = varlen_attention(q, k, v, seqs, scale=scaling, window=features.window, softcap=features.softcap,
                               sinks=sinks, backend=ctx.backend)
        return out.view(b, length, hq, dv), None
    # one exchange: (T/sp, Hq, D), 2 x (T/sp, Hkv, D) -> (T, Hq/sp, D), 2 x (T, max(Hkv/sp, 1), D); with Hkv < sp
    # each rank receives its one KV head (repeated sp // Hkv times over the group, not to full multi-head)
    q, k, v = a2a.qkv_to_heads(q, k, v, ctx.group, ctx.transport)
    if sinks is not None:
        sinks = rank_heads(sinks, q.shape[1], ctx.group)
    out = varlen_attention(q, k, v, seqs, scale=scaling, window=features.window, softcap=features.softcap,
                           sinks=sinks, backend=ctx.backend)
    return a2a.heads_to_seq(out, ctx.group, ctx.transport).view(b, length, hq, dv), None


def _cross(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ctx: Any,
           scaling: float | None, dropout: float, kwargs: dict[str, Any]) -> torch.Tensor:
    """A decoder's cross-attention on a packed row: each sequence's queries to its own encoder states.

    query: ``(1, Hq, Tq, D)`` (the packed decoder row); key: ``(1, Hkv, Tk, D)``, value: ``(1, Hkv, Tk, Dv)`` (the
    encoder states of the row's sequences, packed by the text model's forward: ``ctx.encoder``). Returns
    ``(1, Tq, Hq, Dv)``."""
    def refuse(what: str, why: str, fix: str) -> PatchedModelError:
        return PatchedModelError(f"{type(module).__name__} {what}", why=why, fix=fix)

    if ctx.encoder is None or ctx.group is not None:
        raise refuse("runs cross-attention on a packed row without packed encoder states",
                     why="the packed decoder's forward packs the encoder states per sequence; this call did not come "
                     "through it" if ctx.group is None else "cross-attention under sequence parallelism is not "
                     "implemented", fix="call the patched encoder-decoder model itself, on one process")
    if dropout:
        raise refuse(f"asked for attention dropout {dropout!r}", why="tfcompat's packed attention has no dropout",
                     fix="set the config's attention dropout to 0.0, or undo() the patch")
    unknown = sorted(n for n in kwargs.keys() - HARMLESS_KWARGS - _CHECKED if kwargs[n] is not None)
    if unknown and kwargs.get("is_causal") is not True:
        read = names_read(type(module).__module__)
        unknown = [n for n in unknown if read is None or n in read]
    if unknown or kwargs.get("is_causal") is True:
        raise refuse(f"passed {', '.join(unknown) or 'is_causal=True'} to the packed cross-attention",
                     why="it could change the result, and the packed cross-attention does not implement it",
                     fix="undo() the patch for this model, and report the model type to tfcompat")
    if query.shape[0] != 1 or key.shape[0] != 1:
        raise refuse(f"got a query of shape {tuple(query.shape)} and keys of shape {tuple(key.shape)}",
                     why="a packed decoder row is one row, and its encoder states one packed row",
                     fix="pass one packed row per forward (tfcompat.pack)")
    # (1, H, L, D) -> (L, H, D)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = cross_attention(q, k, v, ctx.seqs, ctx.encoder, scale=scaling)
    return out[None]  # (Tq, Hq, Dv) -> (1, Tq, Hq, Dv)


def _temperature_rescale(seqs: PackedSeqs, floor_scale: float, attn_scale: float, query: torch.Tensor
                         ) -> torch.Tensor:
    """``(B, 1, L, 1)``: per token, llama4's NoPE query scale ``log1p(floor((x + 1) / floor_scale)) * attn_scale + 1``
    at its position in its sequence over the one at its index in its row (what the stock forward applied). query:
    ``(B, H, L, D)``, a single process's packed rows (`patch()` refuses the tuning under Ulysses)."""
    b, _, length, _ = query.shape
    if b * length != seqs.total:
        raise PatchedModelError(
            f"NoPE temperature tuning on a query of shape {tuple(query.shape)} for {seqs.total} packed tokens",
            why="the rescale from row index to sequence position needs the whole packed rows",
            fix="pass whole packed rows (tfcompat.pack), or set config.attn_temperature_tuning=False")
    flat = torch.arange(seqs.total, device=query.device)  # (B * L,)
    lengths = torch.tensor(seqs.lengths, device=query.device)
    position = flat - torch.repeat_interleave(seqs.cu_seqlens[:-1].to(query.device, torch.long), lengths)

    def scale(x: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((x.float() + 1.0) / floor_scale)) * attn_scale + 1.0

    return (scale(position) / scale(flat % length)).to(query.dtype).view(b, 1, length, 1)  # (B * L,) -> (B, 1, L, 1)


def rank_heads(per_head: torch.Tensor, heads: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's slice of a per-query-head tensor under Ulysses: after `tfcompat.core.a2a.qkv_to_heads` rank ``r``
    holds query heads ``[r * heads, (r + 1) * heads)``. per_head: ``(Hq, ...)``; returns ``(heads, ...)`` (a view:
    the gradient reaches the full tensor, each rank its own heads)."""
    rank = dist.get_rank(group)
    return per_head[rank * heads:(rank + 1) * heads]


def _layer_sinks(module: torch.nn.Module, features: AttentionFeatures, dropout: float | None,
                 kwargs: dict[str, Any]) -> torch.Tensor | None:
    """Check what transformers passed against the layer's recorded features; the layer's sinks ``(Hq,)`` or None."""
    def refuse(what: str, why: str, fix: str) -> PatchedModelError:
        return PatchedModelError(f"{type(module).__name__} {what}", why=why, fix=fix)

    refit = "patch() the model again after changing its config or modules, or undo() the patch"
    extra = kwargs.keys() - HARMLESS_KWARGS  # usually none, or sliding_window: this runs per layer call
    for name in extra:
        value = kwargs[name]
        recorded = features.window if name == "sliding_window" else features.softcap if name == "softcap" else None
        if name in ("sliding_window", "softcap") and value != recorded:
            raise refuse(f"passed {name}={value!r} to the packed attention, but patch() recorded {recorded!r}",
                         why=f"the layer's attention features were read at patch time: {features}", fix=refit)
        if name == "is_causal" and value is False:
            raise refuse("asked for non-causal attention (is_causal=False)",
                         why="tfcompat's packed attention is causal within each sequence",
                         fix="run bidirectional attention unpatched (undo() the patch)")
    if dropout:
        raise refuse(f"asked for attention dropout {dropout!r}",
                     why="tfcompat's packed attention has no dropout (it would be silently skipped)",
                     fix="set the config's attention_dropout to 0.0, or undo() the patch")
    unknown = sorted(name for name in extra - _CHECKED if kwargs[name] is not None)
    if unknown:  # read only then: usually nothing is unknown (and a compiled graph calls no import)
        read = names_read(type(module).__module__)
        unknown = [name for name in unknown if read is None or name in read]
    if unknown:
        raise refuse(f"passed {', '.join(unknown)} to the packed attention, which does not implement "
                     f"{'it' if len(unknown) == 1 else 'them'}",
                     why="an attention implementation of the installed transformers (or the model's own eager "
                         "function) reads it, so it could change the result; it is not dropped",
                     fix="undo() the patch for this model, and report the model type to tfcompat")
    sinks = kwargs.get("s_aux")
    if sinks is None and features.sinks:
        sinks = getattr(module, "sinks", None)
        if not isinstance(sinks, torch.Tensor):
            raise refuse("has no attention sinks, but patch() recorded that it uses them",
                         why="neither an s_aux argument nor a sinks tensor on the module", fix=refit)
    if sinks is not None and not features.sinks:
        raise refuse("passed attention sinks (s_aux), but patch() recorded none",
                     why=f"the layer's attention features were read at patch time: {features}", fix=refit)
    return sinks


@functools.cache
def names_read(modeling: str) -> frozenset[str] | None:
    """Every name the attention functions of the installed transformers could read a keyword by: the identifiers,
    attribute names and string constants in the modules of `ALL_ATTENTION_FUNCTIONS`' functions (ours aside), in
    `_ATTENTION_HELPERS`, and in the ``*attention_forward`` functions that ``modeling`` (the attention class's
    module) defines or imports: its eager function. A keyword outside this set is read by no stock implementation,
    so no stock result depends on it (LLaVA-OneVision-1.5's forward lets ``mm_token_type_ids`` and
    ``second_per_grid_ts`` run down its text model's ``**kwargs``): the packed attention may ignore it too. None
    where a source cannot be read (a compiled hub kernel): then every keyword counts as read, none is ignored on a
    guess."""
    functions = importlib.import_module("transformers.modeling_utils").ALL_ATTENTION_FUNCTIONS._global_mapping
    sources: set[Any] = {inspect.getmodule(fn) for fn in functions.values()
                         if not (getattr(fn, "__module__", None) or "").startswith("tfcompat.")}
    sources.update(importlib.import_module(name) for name in _ATTENTION_HELPERS)
    own = sys.modules.get(modeling)
    eager = [fn for name, fn in vars(own).items()
             if name.endswith("attention_forward") and inspect.isfunction(fn)] if own is not None else []
    names: set[str] = set()
    try:
        for source in [*sources, *eager]:
            for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(source)))):
                if isinstance(node, ast.Name):
                    names.add(node.id)
                elif isinstance(node, ast.Attribute):
                    names.add(node.attr)
                elif isinstance(node, (ast.arg, ast.keyword)) and node.arg is not None:
                    names.add(node.arg)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names.add(node.value)
    except (OSError, TypeError, SyntaxError):
        return None
    return frozenset(names)


def stock_function(ctx: StockContext) -> Any:
    """The attention function of the implementation named by ``ctx`` (``"eager"``: the family's own)."""
    if ctx.impl == "eager" and ctx.eager is not None:
        return ctx.eager
    return importlib.import_module("transformers.modeling_utils").ALL_ATTENTION_FUNCTIONS[ctx.impl]


def _interface() -> Any:
    return importlib.import_module("transformers.modeling_utils").AttentionInterface


_users: dict[str, int] = {}


def register(key: str = ATTENTION_KEY, function: Any = None) -> None:
    """Add ``key`` -> ``function`` (default `packed_attention`) to transformers' AttentionInterface (process-wide;
    reference counted per key)."""
    _interface().register(key, packed_attention if function is None else function)
    _users[key] = _users.get(key, 0) + 1


def unregister(key: str = ATTENTION_KEY) -> None:
    """Drop one use of ``key``; the last one removes it from the AttentionInterface."""
    _users[key] -= 1
    if _users[key] == 0:
        _interface()._global_mapping.pop(key, None)
