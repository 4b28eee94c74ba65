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
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch

from ..core.context import BRIDGE_ATTR, CONTEXT_KWARG, ForwardContext, StockContext
from ..errors import InvalidInputError, PatchedModelError, PatchError
from ..registry import Resolved
from ..registry.mixers import ROLES
from ..registry.records import MixerCall, MixerRole

__all__ = ["MixerPlan", "apply", "per_sequence_forward", "plan"]

NOTE = "runs per sequence on packed rows (split at the boundaries, fresh state, concatenated)"


class MixerPlan(NamedTuple):
    """What `patch` changes for the per-sequence mixers: ``forwards`` (module, its per-sequence forward) and
    ``bridges`` (decoder layer, mixer module in it) handing the context to the mixer."""

    forwards: list[tuple[torch.nn.Module, Callable[..., Any]]]
    bridges: list[tuple[torch.nn.Module, torch.nn.Module]]


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


def apply(handle: Any, mixers: MixerPlan) -> None:
    """Install `plan`'s forwards and bridges, each recorded on the `PatchHandle` and undone with it."""
    from .changes import Record

    for layer, module in mixers.bridges:
        hook = layer.register_forward_pre_hook(_bridge(module), with_kwargs=True)

        def remove(hook: Any = hook, module: torch.nn.Module = module) -> None:
            hook.remove()
            module.__dict__.pop(BRIDGE_ATTR, None)

        handle._add(Record("hook", layer, "forward_pre_hook", None, hook, True,
                           f"hands packed boundaries to its {type(module).__name__}"), remove)
    for module, forward in mixers.forwards:
        handle._set("instance", module, "forward", forward, NOTE)


def _bridge(module: torch.nn.Module) -> Callable[..., None]:
    def hook(layer: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        module.__dict__[BRIDGE_ATTR] = kwargs.get(CONTEXT_KWARG)

    return hook


def per_sequence_forward(module: torch.nn.Module, call: MixerCall) -> Callable[..., Any]:
    """An instance ``forward`` for ``module`` (a mixer of class ``call.cls``): on a packed row, the stock forward
    once per sequence, ``hidden_states (B, L, D) -> (B, L, D')`` concatenated (a tuple output: its first element
    concatenated, the rest None, `_concat`); otherwise the stock forward."""
    stock = type(module).forward
    names = [name for name, _ in call.params]

    def forward(*args: Any, **kwargs: Any) -> Any:
        ctx = kwargs.pop(CONTEXT_KWARG, None) or module.__dict__.get(BRIDGE_ATTR)
        if isinstance(ctx, StockContext):
            return stock(module, *args, **kwargs)
        if not isinstance(ctx, ForwardContext):
            raise PatchedModelError(
                f"{type(module).__name__} runs per sequence on packed rows but got no packed boundaries",
                why="the mixer was called outside the patched model's forward (or its decoder layer did not get the "
                "context)", fix="call the patched model (or its text model), or undo() the patch")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        hidden = bound.pop(names[0])
        batch, length = hidden.shape[:2]
        if ctx.seqs.total != batch * length:
            raise PatchedModelError(f"{type(module).__name__} got {batch} x {length} tokens for packed boundaries of "
                                    f"{ctx.seqs.total}", why="a per-sequence mixer splits the whole packed row",
                                    fix="call the patched model with the packed inputs its context was built for")
        flat = hidden.reshape(batch * length, *hidden.shape[2:])  # (B, L, D) -> (B L, D)
        outputs = []
        start = 0
        for n in ctx.seqs.lengths:
            per_seq = {name: _slice(name, _role(call, name), value, batch, length, start, start + n, hidden.device)
                       for name, value in bound.items()}
            outputs.append(stock(module, flat[start:start + n][None], **per_seq))
            start += n
        return _concat(outputs, batch, length)

    return forward


def _role(call: MixerCall, name: str) -> MixerRole:
    return dict(call.params).get(name) or ROLES.get(name, "flag")


def _slice(name: str, role: MixerRole, value: Any, batch: int, length: int, start: int, end: int,
           device: torch.device) -> Any:
    """The per-sequence value of one argument, for tokens ``start:end`` of the flattened ``B L`` row."""
    if role == "state":
        if value is not None:
            raise PatchedModelError(f"a packed forward passed a cache ({name}) to a per-sequence mixer",
                                    why="a packed row builds no cache", fix="pass use_cache=False")
        return None
    if role == "none":
        if value is not None:
            raise InvalidInputError(f"a per-sequence mixer got {name} with a packed row",
                                    why="tfcompat splits the row at the boundaries itself (the mixer runs per "
                                    "sequence); transformers' own packing index would be applied twice",
                                    fix="drop transformers' padding-free kwargs (cu_seq_lens_*, seq_idx) when the "
                                    "model is patched")
        return None
    if role == "no_cache":
        return False
    if role == "cache_position":
        return torch.arange(end - start, device=device)
    if value is None:
        return None
    if role == "position_embeddings":
        return tuple(_tokens_at(t, -3, batch, length, start, end, name) for t in value)
    if role == "per_token":
        return _tokens_at(value, -2, batch, length, start, end, name)
    if isinstance(value, torch.Tensor):  # a tensor keyword no role names: per token or not, it cannot be told
        raise InvalidInputError(f"a per-sequence mixer got the tensor keyword {name!r}",
                                why="tfcompat cannot tell whether it is per token (to be sliced per sequence)",
                                fix="drop the keyword from the packed call, or undo() the patch")
    return value


def _tokens_at(t: torch.Tensor, dim: int, batch: int, length: int, start: int, end: int, name: str) -> torch.Tensor:
    """``t`` at tokens ``start:end`` of its flattened token dims ``(B, L)`` (at ``dim, dim + 1``), as
    ``(1, end - start)`` there."""
    lead = t.ndim + dim
    if lead < 0 or tuple(t.shape[lead:lead + 2]) != (batch, length):
        raise InvalidInputError(f"{name} of shape {tuple(t.shape)} is not per token of a ({batch}, {length}) row",
                                why="a per-sequence mixer slices it at the sequence boundaries",
                                fix="pass no attention mask with packed rows (the boundaries come from the position "
                                "ids)")
    flat = t.reshape(*t.shape[:lead], batch * length, *t.shape[lead + 2:])  # (..., B, L, ...) -> (..., B L, ...)
    return flat.narrow(lead, start, end - start).unsqueeze(lead)  # (..., 1, n, ...)


def _concat(outputs: list[Any], batch: int, length: int) -> Any:
    """The per-sequence outputs ``(1, n_i, D)`` joined into ``(B, L, D)``. Of a tuple output, the other elements
    (attention weights, MiniMax's final state) are None: a per-sequence state has no packed-row value (the decoder
    layers discard them; one that read it would fail on None rather than compute with a wrong value)."""
    first = [o[0] if isinstance(o, tuple) else o for o in outputs]
    joined = torch.cat([cast(torch.Tensor, f)[0] for f in first])  # (1, n_i, D) -> (B L, D)
    joined = joined.reshape(batch, length, *joined.shape[1:])  # (B L, D) -> (B, L, D)
    return (joined, *[None] * (len(outputs[0]) - 1)) if isinstance(outputs[0], tuple) else joined
