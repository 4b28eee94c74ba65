"""Token mixers tfcompat has no packed kernel for, run once per sequence of a packed row.

A derived hybrid (Jamba, Bamba, LFM2, Nemotron-H, ...) holds, besides softmax attention, mixers that carry state
along the row: a selective scan, a short convolution, a Gated DeltaNet, lightning attention. Their stock forward
over a packed row would carry that state from one sequence into the next. `patch` gives each such module (the
classes `tfcompat.registry.mixers` proved per sequence, `tfcompat.registry.records.MixerCall`) an instance
``forward`` built here: on a packed row it splits the hidden states at the boundaries of the
`tfcompat.core.context.ForwardContext`, calls the stock forward on each sequence alone with fresh state (no cache,
per-sequence slices of every per-token argument, ``cache_position`` restarting at 0) and concatenates. The result
is, per token, what the stock mixer computes on that sequence alone; the cost is a Python loop over the row's
sequences per mixer layer (the lengths are host ints of the context: no device sync).

The context reaches the mixer in its ``**kwargs`` or through a pre-hook on its decoder layer
(`tfcompat.core.context.BRIDGE_ATTR`), which recomputation under gradient checkpointing replays. An ordinary call
(`tfcompat.core.context.StockContext`) runs the stock forward, cache and all.

Where the packed core cannot express a model's attention (it dispatches through no ``AttentionInterface``, passes
sparse indices or its own mask or bias, is a layer type other than softmax attention, or shares its layer with a
mixer), `plan_layers` runs each decoder layer so instead, with the model's own attention inside: a Python loop over
the row's sequences per layer, no varlen kernel. The mask the text model built for the packed row (the patched forward
passes it no attention mask) is cut to its diagonal block per sequence; an ALiBi bias per key is cut at the
sequence's keys and re-based. Where a forward's kwargs do not carry the context, the patched text model's forward
hands it to these modules for the duration of its call (`ROW_CONTEXT_ATTR`).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch

from ..core.context import BRIDGE_ATTR, CONTEXT_KWARG, ForwardContext, StockContext
from ..errors import InvalidInputError, PatchedModelError, PatchError
from ..registry import Resolved
from ..registry.mixers import LAYER_ROLES, ROLES
from ..registry.records import MixerCall, MixerRole

__all__ = ["LAYER_NOTE", "NOTE", "ROW_CONTEXT_ATTR", "MixerPlan", "apply", "bridge", "per_sequence_forward", "plan",
           "plan_layers"]

NOTE = "runs per sequence on packed rows (split at the boundaries, fresh state, concatenated)"
LAYER_NOTE = ("runs per sequence on packed rows with the model's own attention (a Python loop per layer, no varlen "
              "kernel: the mask built for the row cut to each sequence's block)")
# on a per-sequence module during a patched text model's forward: that forward's context (its kwargs may not carry it)
ROW_CONTEXT_ATTR = "_tfcompat_row_context"


class MixerPlan(NamedTuple):
    """What `patch` changes for the per-sequence mixers: ``forwards`` (module, its per-sequence forward) and
    ``bridges`` (decoder layer, mixer module in it) handing the context to the mixer."""

    forwards: list[tuple[torch.nn.Module, Callable[..., Any]]]
    bridges: list[tuple[torch.nn.Module, torch.nn.Module]]
    note: str = NOTE


def mixer_classes(r: Resolved) -> tuple[type, ...]:
    """The classes of ``r``'s text module that run per sequence (none for a written family or an attention-only
    one)."""
    derived = r.entry.derived
    return tuple(getattr(_text_module(r), m.cls) for m in derived.mixers) if derived is not None else ()


def _text_module(r: Resolved) -> Any:
    """The module of the text model's classes: a derived vision-language family's text family's module."""
    return importlib.import_module(r.entry.module_of("decoder_layer"))


def plan(model: torch.nn.Module, r: Resolved, group: Any) -> MixerPlan:
    """Build the per-sequence forwards of ``model``'s mixers and the bridges from their decoder layers; changes
    nothing. `PatchError` under Ulysses (a sequence is split over ranks) or for a mixer outside a decoder layer."""
    derived = r.entry.derived
    if derived is None or not derived.mixers:
        return MixerPlan([], [])
    text_module = _text_module(r)
    calls: dict[type, MixerCall] = {getattr(text_module, m.cls): m for m in derived.mixers}
    names = ", ".join(cls.__name__ for cls in calls)
    if group is not None:
        raise r.error(PatchError, f"{names} cannot run sequence parallel",
                      why="tfcompat runs these token mixers per sequence, and under Ulysses each rank holds a slice "
                      "of every sequence", supported="a single-process patch of this family",
                      fix="patch without ulysses_group")
    layer_classes = tuple(getattr(text_module, name) for name in derived.decoder_layers)
    forwards: list[tuple[torch.nn.Module, Callable[..., Any]]] = []
    bridges: list[tuple[torch.nn.Module, torch.nn.Module]] = []
    for layer in (m for m in model.modules() if isinstance(m, layer_classes)):
        inner = {id(m) for sub in layer.modules() if sub is not layer and isinstance(sub, layer_classes)
                 for m in sub.modules()}  # a mixer of a nested decoder layer is bridged from that layer
        for module in (m for m in layer.modules() if isinstance(m, tuple(calls)) and id(m) not in inner):
            module = cast(torch.nn.Module, module)
            bridges.append((layer, module))
            forwards.append((module, per_sequence_forward(module, calls[type(module)])))
    found = {id(m) for m, _ in forwards}
    stray = [type(m).__name__ for m in model.modules() if isinstance(m, tuple(calls)) and id(m) not in found]
    if stray:
        raise r.error(PatchError, f"{stray[0]} sits outside the decoder layers",
                      why="the packed boundaries reach a mixer through its decoder layer",
                      supported=f"{names} inside {', '.join(derived.decoder_layers)}",
                      fix="pass the model built by transformers for this family")
    return MixerPlan(forwards, bridges)


def plan_layers(model: torch.nn.Module, r: Resolved, group: Any, why: str) -> MixerPlan:
    """The per-sequence forwards of ``model``'s decoder layers (`tfcompat.registry.records.Derivation.per_sequence`),
    for attention the packed core cannot express (``why``); changes nothing. `PatchError` under Ulysses, or where
    the layers were not proved per sequence."""
    derived = r.entry.derived
    calls = {} if derived is None else {getattr(_text_module(r), c.cls): c for c in derived.per_sequence}
    if not calls:
        raise r.error(PatchError, f"the decoder layers of {r.family} cannot run per sequence", why=why,
                      supported="attention the packed core expresses, or decoder layers proved per sequence",
                      fix="run the model unpatched")
    if group is not None:
        raise r.error(PatchError, f"{', '.join(c.__name__ for c in calls)} cannot run sequence parallel",
                      why=f"tfcompat runs these decoder layers per sequence ({why}), and under Ulysses each rank holds "
                      "a slice of every sequence", supported="a single-process patch of this family",
                      fix="patch without ulysses_group")
    layers = [m for m in model.modules() if type(m) in calls]
    outer = [m for m in layers if not any(m is not o and any(m is x for x in o.modules()) for o in layers)]
    return MixerPlan([(m, per_sequence_forward(m, calls[type(m)], LAYER_ROLES)) for m in outer], [],
                     f"{LAYER_NOTE}; why: {why}")


def apply(handle: Any, mixers: MixerPlan) -> None:
    """Install `plan`'s forwards and bridges, each recorded on the `PatchHandle` and undone with it."""
    from .changes import Record

    for layer, module in mixers.bridges:
        hook = layer.register_forward_pre_hook(bridge(module), with_kwargs=True)

        def remove(hook: Any = hook, module: torch.nn.Module = module) -> None:
            hook.remove()
            module.__dict__.pop(BRIDGE_ATTR, None)

        handle._add(Record("hook", layer, "forward_pre_hook", None, hook, True,
                           f"hands packed boundaries to its {type(module).__name__}"), remove)
    for module, forward in mixers.forwards:
        handle._set("instance", module, "forward", forward, mixers.note)


def bridge(module: torch.nn.Module) -> Callable[..., None]:
    """A decoder layer's pre-hook handing ``module`` (a mixer, or an attention the layer's call may not give the
    context) the context: from the layer's kwargs, else the text model's forward (`ROW_CONTEXT_ATTR`), else, under
    non-reentrant gradient checkpointing, the context the layer's input came with in the forward (the recompute calls
    the layer again with the same input tensor after the text model's forward ended, while the module itself may get
    a recomputed one: Mamba's norm output). A stock context is remembered too: an ordinary call's recompute runs
    stock."""
    seen: dict[int, tuple[weakref.ref, ForwardContext | StockContext]] = {}

    def hook(layer: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ctx = kwargs.get(CONTEXT_KWARG) or module.__dict__.get(ROW_CONTEXT_ATTR)
        first = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(first, torch.Tensor):
            key = id(first)
            if ctx is None and key in seen and seen[key][0]() is first:
                ctx = seen[key][1]
            elif isinstance(ctx, (ForwardContext, StockContext)) and torch.is_grad_enabled():
                seen[key] = (weakref.ref(first, functools.partial(_forget, seen, key)), ctx)
        module.__dict__[BRIDGE_ATTR] = ctx

    return hook


def per_sequence_forward(module: torch.nn.Module, call: MixerCall,
                         roles: dict[str, MixerRole] = ROLES) -> Callable[..., Any]:
    """An instance ``forward`` for ``module`` (a mixer or decoder layer of class ``call.cls``): on a packed row, the
    stock forward once per sequence, ``hidden_states (B, L, D) -> (B, L, D')`` concatenated (a tuple output: its
    per-token tensors concatenated, the rest None, `_concat`); otherwise the stock forward. roles: the roles of
    keywords its signature does not name (passed through ``**kwargs``)."""
    stock = type(module).forward
    names = [name for name, _ in call.params]
    known = dict(call.params)
    # hidden states seen in a packed forward -> its context: the recomputation under non-reentrant gradient
    # checkpointing calls again with the same tensor, after the text model's forward (and `ROW_CONTEXT_ATTR`) ended
    seen: dict[int, tuple[weakref.ref, ForwardContext]] = {}

    def forward(*args: Any, **kwargs: Any) -> Any:
        ctx = (kwargs.pop(CONTEXT_KWARG, None) or module.__dict__.get(BRIDGE_ATTR)
               or module.__dict__.get(ROW_CONTEXT_ATTR))
        first = args[0] if args else kwargs.get(names[0])
        if ctx is None and id(first) in seen and seen[id(first)][0]() is first:
            ctx = seen[id(first)][1]
        if isinstance(ctx, StockContext):
            return stock(module, *args, **kwargs)
        if isinstance(ctx, ForwardContext) and isinstance(first, torch.Tensor) and torch.is_grad_enabled():
            key = id(first)
            seen[key] = (weakref.ref(first, functools.partial(_forget, seen, key)), ctx)
        if not isinstance(ctx, ForwardContext):
            raise PatchedModelError(
                f"{type(module).__name__} runs per sequence on packed rows but got no packed boundaries",
                why="it was called outside the patched model's forward (or its decoder layer did not get the "
                "context; under gradient checkpointing, the text model passes its layers no **kwargs)",
                fix="call the patched model (or its text model), or undo() the patch")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        hidden = bound.pop(names[0])
        batch, length = hidden.shape[:2]
        if ctx.seqs.total != batch * length:
            raise PatchedModelError(f"{type(module).__name__} got {batch} x {length} tokens for packed boundaries of "
                                    f"{ctx.seqs.total}", why="a per-sequence module splits the whole packed row",
                                    fix="call the patched model with the packed inputs its context was built for")
        flat = hidden.reshape(batch * length, *hidden.shape[2:])  # (B, L, D) -> (B L, D)
        outputs: list[Any] = []
        start = 0
        # an encoder-decoder model's packed encoder states: sequence i's, for its decoder tokens
        encoder = [0, *itertools.accumulate(ctx.encoder.lengths)] if ctx.encoder is not None else None
        for n in ctx.seqs.lengths:
            states = slice(encoder[len(outputs)], encoder[len(outputs) + 1]) if encoder is not None else None
            at = _Span(batch, length, start, start + n, hidden.device, len(outputs), states,
                       ctx.encoder.total if ctx.encoder is not None else 0)
            per_seq = {name: _slice(name, known.get(name) or roles.get(name, "flag"), value, at)
                       for name, value in bound.items()}
            outputs.append(stock(module, flat[start:start + n][None], **per_seq))
            start += n
        return _concat(outputs, batch, length)

    return forward


def _forget(seen: dict[int, tuple[weakref.ref, Any]], key: int, ref: weakref.ref) -> None:
    if key in seen and seen[key][0] is ref:  # not a later tensor that took the id
        del seen[key]


class _Span(NamedTuple):
    """Tokens ``start:end`` of a flattened ``(B L)`` row: one sequence, in row ``start // length``."""

    batch: int
    length: int
    start: int
    end: int
    device: torch.device
    seq: int = 0  # the sequence's index in the row
    encoder: slice | None = None  # the sequence's states in the packed encoder row (an encoder-decoder model's)
    encoder_total: int = 0  # the packed encoder row's length

    @property
    def row(self) -> int:
        return self.start // self.length

    @property
    def cols(self) -> slice:
        col = self.start - self.row * self.length
        return slice(col, col + self.end - self.start)


def _slice(name: str, role: MixerRole, value: Any, at: _Span) -> Any:
    """The per-sequence value of one argument, for the tokens of ``at``."""
    if role == "state":
        if value is not None:
            raise PatchedModelError(f"a packed forward passed a cache ({name}) to a per-sequence module",
                                    why="a packed row builds no cache", fix="pass use_cache=False")
        return None
    if role == "none":
        if value is not None:
            raise InvalidInputError(f"a per-sequence module got {name} with a packed row",
                                    why="tfcompat splits the row at the boundaries itself (the module runs per "
                                    "sequence); transformers' own packing index would be applied twice",
                                    fix="drop transformers' padding-free kwargs (cu_seq_lens_*, seq_idx) when the "
                                    "model is patched")
        return None
    if role == "encoder":
        if value is not None and at.encoder is not None and name == "encoder_hidden_states":
            return value[:, at.encoder]  # (1, sum L_enc, D) -> (1, L_enc_i, D): its own encoder states
        if isinstance(value, torch.Tensor) and at.encoder is not None and value.shape[-1] == at.encoder_total:
            # a mask over the packed encoder row (4.x BERT's, extended from none: every state read): its keys
            return value[..., at.encoder]  # (..., sum L_enc) -> (..., L_enc_i)
        if value is not None:  # a mask of the packed encoder row is None (its boundaries replace it)
            raise InvalidInputError(f"a per-sequence decoder layer got {name} with a packed row",
                                    why="cross-attention to encoder states runs packed only in an encoder-decoder "
                                    "model patched as one (its decoder packs them per sequence)",
                                    fix="patch the encoder-decoder model itself, or call it without packed position "
                                    "ids")
        return None
    if role == "no_cache":
        return False
    if role == "cache_position":
        return torch.arange(at.end - at.start, device=at.device)
    if value is None or role == "per_layer":
        return value
    if role == "position_embeddings":
        if isinstance(value, dict):  # per rotary kind (DeepSeek-V4's "main" and "compress")
            return {k: _slice(name, role, v, at) for k, v in value.items()}
        return tuple(_tokens_at(t, -3, at, name) for t in value)
    if role == "per_token_lead":
        if isinstance(value, PerSequence):
            return value[at.seq]
        return _tokens_at(value, -value.ndim, at, name)
    if role == "per_token":
        return _tokens_at(value, -2, at, name)
    if role == "mask":
        if isinstance(value, dict):  # masks per layer type (a decoder layer picks its own)
            return {k: _slice(name, role, v, at) for k, v in value.items()}
        if isinstance(value, torch.Tensor) and tuple(value.shape) == (at.batch, at.length):
            return _tokens_at(value, -2, at, name)
        return _block(value, at, name)
    if role == "key_bias":
        return _key_bias(value, at, name)
    if role == "row_prefix":
        if not isinstance(value, torch.Tensor) or value.ndim < 2 or value.shape[-2] != at.length:
            raise InvalidInputError(f"{name} is not a table over the packed row of {at.length} tokens",
                                    why="a per-sequence layer takes its first rows per sequence",
                                    fix="run the model unpatched")
        return value[..., :at.end - at.start, :]
    if isinstance(value, torch.Tensor):  # a tensor keyword no role names: per token or not, it cannot be told
        raise InvalidInputError(f"a per-sequence module got the tensor keyword {name!r}",
                                why="tfcompat cannot tell whether it is per token (to be sliced per sequence)",
                                fix="drop the keyword from the packed call, or undo() the patch")
    return value


def _rows(t: torch.Tensor, lead: int, at: _Span, name: str) -> torch.Tensor:
    """``t``'s leading dims ``t.shape[:lead]`` cut to ``at``'s row: a first dim of ``B`` (or ``B x`` heads) is
    indexed, one of 1 (broadcast over rows) kept."""
    if lead == 0 or at.batch == 1 or t.shape[0] == 1:
        return t
    if t.shape[0] % at.batch:
        raise InvalidInputError(f"{name} of shape {tuple(t.shape)} is not per row of a batch of {at.batch}",
                                why="a per-sequence layer cuts it to the row of each sequence",
                                fix="pass packed rows without an attention mask")
    per_row = t.shape[0] // at.batch
    return t[at.row * per_row:(at.row + 1) * per_row]


def _block(t: Any, at: _Span, name: str) -> torch.Tensor:
    """The diagonal block ``(..., n, n)`` of a mask or bias ``(..., L, K)`` the model built for the packed row: what
    it builds for the sequence alone where the mask depends on ``i - j`` only (causal, sliding window). ``K >= L``:
    keys past the row's (4.x masks built for one more key, which the attention cuts to its keys) are not keys of a
    sequence."""
    if not isinstance(t, torch.Tensor) or t.ndim < 2 or t.shape[-2] != at.length or t.shape[-1] < at.length:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise InvalidInputError(f"{name} of shape {shape} is not a mask over the packed row of {at.length} tokens",
                                why="a per-sequence layer takes its diagonal block per sequence",
                                fix="pass no attention mask with packed rows (the boundaries come from the position "
                                "ids)")
    return _rows(t, t.ndim - 2, at, name)[..., at.cols, at.cols]


def _key_bias(t: torch.Tensor, at: _Span, name: str) -> torch.Tensor:
    """A bias added to the scores before the softmax: ``(..., L, L)`` its diagonal block; ``(..., 1, L)`` (ALiBi per
    key) cut at the sequence's keys and re-based to its first key (a constant per query row: the softmax does not
    change, and ALiBi's ``slope * j`` becomes the sequence's own ``slope * (j - start)``); one spanning no dim of the
    row's length (MPT's, built for ``max_seq_len`` and cut by the attention itself) unchanged."""
    if tuple(t.shape[-2:]) == (at.length, at.length):
        return _block(t, at, name)
    if t.ndim >= 2 and t.shape[-1] == at.length and t.shape[-2] == 1:
        cut = _rows(t, t.ndim - 2, at, name)[..., at.cols]
        return cut - cut[..., :1]
    if at.length not in t.shape:
        return t
    raise InvalidInputError(f"{name} of shape {tuple(t.shape)} is not a bias per key of the packed row",
                            why=f"a per-sequence layer cuts a (..., 1, {at.length}) or ({at.length}, {at.length}) bias",
                            fix="run the model unpatched")


def _tokens_at(t: torch.Tensor, dim: int, at: _Span, name: str) -> torch.Tensor:
    """``t`` at the tokens of ``at`` in its flattened token dims ``(B, L)`` (at ``dim, dim + 1``), as ``(1, n)``
    there."""
    lead = t.ndim + dim
    if lead < 0 or tuple(t.shape[lead:lead + 2]) != (at.batch, at.length):
        raise InvalidInputError(f"{name} of shape {tuple(t.shape)} is not per token of a ({at.batch}, {at.length}) "
                                "row", why="a per-sequence module slices it at the sequence boundaries",
                                fix="pass no attention mask with packed rows (the boundaries come from the position "
                                "ids)")
    flat = t.reshape(*t.shape[:lead], at.batch * at.length, *t.shape[lead + 2:])  # (..., B, L, ...) -> (..., B L, ...)
    return flat.narrow(lead, at.start, at.end - at.start).unsqueeze(lead)  # (..., 1, n, ...)


def _concat(outputs: list[Any], batch: int, length: int) -> Any:
    """The per-sequence outputs ``(1, n_i, D)`` joined into ``(B, L, D)``. Of a tuple output, the other elements are
    joined alike where every sequence's is per token ``(1, n_i, ...)`` (GLM-DSA's top-k indices, which the next layer
    cuts per sequence again), else None (attention weights, MiniMax's final state: a per-sequence state has no
    packed-row value; a decoder layer that read it would fail on None rather than compute with a wrong value)."""
    if not isinstance(outputs[0], (tuple, list)):  # a list: OpenAI GPT's blocks
        return _join([cast(torch.Tensor, o) for o in outputs], batch, length)
    parts = list(zip(*outputs))
    lengths = [cast(torch.Tensor, o[0]).shape[1] for o in outputs]
    joined = [_join(list(p), batch, length) if i == 0 else _extra(list(p), lengths, batch, length)
              for i, p in enumerate(parts)]
    return joined if isinstance(outputs[0], list) else tuple(joined)


class PerSequence(tuple):
    """What a layer run per sequence returned besides its hidden states, per token of each sequence ``(1, n_i, ...)``,
    where the pieces differ past the token dim (GLM-DSA's top-k indices: ``min(top_k, n_i)`` keys): handed back to
    the next layer run per sequence piece by piece; anything else that reads it fails on the type."""


def _extra(pieces: list[Any], lengths: list[int], batch: int, length: int) -> Any:
    """A tuple output's other element: joined ``(B, L, ...)`` where every sequence's is per token and alike past the
    token dim, a `PerSequence` where they differ there, else None."""
    if not all(isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[0] == 1 and t.shape[1] == n
               for t, n in zip(pieces, lengths)):
        return None
    if len({tuple(t.shape[2:]) for t in pieces}) == 1:
        return _join(pieces, batch, length)
    return PerSequence(pieces)


def _join(pieces: list[torch.Tensor], batch: int, length: int) -> torch.Tensor:
    joined = torch.cat([p[0] for p in pieces])  # (1, n_i, ...) -> (B L, ...)
    return joined.reshape(batch, length, *joined.shape[1:])  # (B L, ...) -> (B, L, ...)
