"""The adapter between transformers' Gated DeltaNet layers and tfcompat's packed linear-attention core.

A hybrid decoder (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) holds, per layer, either softmax attention (patched through
`tfcompat.hf_attention`) or a Gated DeltaNet module (`tfcompat.records.LinearAttention`). The stock Gated DeltaNet
forward runs its conv and its recurrence over the whole row, so a packed row carries the conv window and the
state from one sequence into the next. `patch` gives each such module an instance ``forward`` built here: the
module's own projections (as the registry entry lays them out), then `tfcompat.linear_attention.linear_attention`
over the packed boundaries of the `tfcompat.context.ForwardContext` (restarting conv and state at every sequence;
under Ulysses the head split), then the module's own gated norm and output projection. The stock kernels
(instance attributes up to 5.14, module functions from 5.15) are never called.

The context arrives in the forward's ``**kwargs`` where the decoder layer passes them on, else through the
decoder layer's pre-hook (`tfcompat.context.BRIDGE_ATTR`). The packed forward writes no recurrent or conv state
to a cache (a packed row is a batch of whole sequences, not a prefix to continue); calls that `tfcompat.routing`
sends to the stock path (a `tfcompat.context.StockContext`) run the stock forward, cache and all.

`plan` checks, at `patch()`, that every decoder layer mixes with a class tfcompat packs and that the requested
kernels exist; it changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple, Protocol, cast, get_args

import torch

from ..core import _linear_kernels
from ..core.context import BRIDGE_ATTR, CONTEXT_KWARG, StockContext
from ..core.linear_attention import (
    ConvBackend,
    RuleBackend,
    check_linear_heads,
    linear_attention,
    linear_attention_params,
)
from ..errors import InvalidInputError, PatchedModelError, PatchError
from ..registry import Resolved
from ..registry.records import LinearAttention

__all__ = ["LinearBackend", "LinearPlan", "packed_linear_forward", "plan"]

LinearBackend = Literal["auto", "fla", "torch"]
# patch()'s linear_backend -> (rule backend, conv backend) of `tfcompat.linear_attention.linear_attention`
_BACKENDS: dict[str, tuple[RuleBackend, ConvBackend]] = {
    "auto": ("auto", "auto"), "fla": ("fla", "auto"), "torch": ("torch", "torch"),
}


class LinearPlan(NamedTuple):
    """What `patch` changes for the linear-attention layers: ``forwards`` (module, its packed forward) and
    ``bridges`` (decoder layer, its linear-attention module) where the layer drops ``**kwargs``."""

    forwards: list[tuple[torch.nn.Module, Callable[..., torch.Tensor]]]
    bridges: list[tuple[torch.nn.Module, torch.nn.Module]]


def plan(model: torch.nn.Module, r: Resolved, group: Any, backend: str,
         per_sequence: tuple[type, ...] = ()) -> LinearPlan:
    """Check ``model``'s decoder layers and build the packed forwards of its linear-attention modules.

    Every decoder layer must hold mixers tfcompat packs: the entry's softmax attention class (one or more), or one
    module of its linear-attention class (`tfcompat.records.Entry.linear_attention`); in a derived hybrid with mixers
    run per sequence (``per_sequence``, `tfcompat.hf.mixers`) a layer may hold none (its derivation proved every
    mixer it holds softmax attention or one of those). backend: `LinearBackend`; "fla" needs flash-linear-attention
    installed. Raises `PatchError` (unknown mixer, unknown or missing backend, heads not divisible by the Ulysses
    group).
    """
    if backend not in _BACKENDS:
        raise r.error(PatchError, f"unknown linear-attention backend {backend!r}",
                      why="linear_backend names the Gated DeltaNet kernels",
                      supported=", ".join(get_args(LinearBackend)), fix="pass linear_backend='auto'")
    spec = r.entry.linear_attention
    linear_cls = r.classes.get("linear_attention")
    known = (r.attention_cls,) if linear_cls is None else (r.attention_cls, linear_cls)
    names = " or ".join(c.__name__ for c in known)
    forwards: list[tuple[torch.nn.Module, Callable[..., torch.Tensor]]] = []
    bridges: list[tuple[torch.nn.Module, torch.nn.Module]] = []
    for index, layer in enumerate(m for m in model.modules() if isinstance(m, r.decoder_layer_cls)):
        # the mixers below the layer (a derived family's attention may sit deeper: dbrx's norm_attn_norm.attn, or two
        # in one layer: longcat_flash's self_attn[0] and [1]); one linear-attention module alone
        mixers = [(name, child) for name, child in layer.named_modules()
                  if child is not layer and issubclass(type(child), known)]
        if not mixers and per_sequence:  # a derived hybrid's layer of per-sequence mixers, or of an MLP alone
            continue
        if not mixers or (len(mixers) > 1 and not all(isinstance(m, r.attention_cls) for _, m in mixers)):
            children = ", ".join(f"{n}: {type(c).__name__}" for n, c in layer.named_children())
            kind = _layer_type(model, index)
            raise r.error(
                PatchError,
                f"decoder layer {index}{kind} of {type(model).__name__} has {len(mixers)} mixers tfcompat can pack",
                why=f"its children are {children}; tfcompat packs {names}",
                supported=f"{r.family} layers mixing with {names}",
                fix="build the model with layer types whose mixers tfcompat packs (config.layer_types), or undo the "
                "patch for this model",
            )
        module: torch.nn.Module = mixers[0][1]
        if linear_cls is None or not isinstance(module, linear_cls):
            continue
        linear = cast(LinearAttention, spec)  # a family table names a linear_attention class only with its spec
        if backend == "fla" and _linear_kernels.fla_rule() is None:
            raise r.error(PatchError, "linear_backend='fla' but flash-linear-attention is not installed",
                          why=f"{type(module).__name__} layers would run the gated delta rule in fla's kernel",
                          supported="linear_backend 'auto' (fla where installed and usable, else torch), 'torch', "
                          "'fla'", fix="pip install flash-linear-attention, or pass linear_backend='auto'")
        if group is not None:
            import torch.distributed as dist

            try:
                check_linear_heads(linear_attention_params(module).heads, dist.get_world_size(group))
            except InvalidInputError as exc:  # patch() raises PatchError for everything it refuses
                raise r.error(PatchError, exc.what, why=exc.why, supported=exc.supported, fix=exc.fix) from None
        forwards.append((module, packed_linear_forward(module, linear, backend)))
        if not linear.layer_forwards_kwargs:
            bridges.append((layer, module))
    return LinearPlan(forwards, bridges)


def _layer_type(model: torch.nn.Module, index: int) -> str:
    """`` (layer type 'x')`` from the text config's ``layer_types``, or nothing where it has none."""
    types = getattr(cast(Any, model.config).get_text_config(), "layer_types", None)  # a PretrainedConfig
    return f" (layer type {types[index]!r})" if types is not None and index < len(types) else ""


def packed_linear_forward(module: torch.nn.Module, spec: LinearAttention, backend: str) -> Callable[..., torch.Tensor]:
    """An instance ``forward`` for a stock Gated DeltaNet ``module``:
    ``hidden_states (B, L, hidden) -> (B, L, hidden)``.

    Takes every keyword the decoder layer passes (cache, cache position and mask are ignored: packed rows have no
    padding and no past) and the context (`tfcompat.context.CONTEXT_KWARG`, or the bridge). Projections per
    ``spec.projections``, then `linear_attention` on the ``B * L`` flattened tokens (``B == 1``, ``L = T / sp`` under
    Ulysses), then ``module.norm(core, z)`` per value head and ``module.out_proj``. backend: `LinearBackend`.
    """
    rule_backend, conv_backend = _BACKENDS[backend]
    project = _PROJECTIONS[spec.projections]
    tail = cast(_GatedDeltaNetTail, module)

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        ctx = kwargs.get(CONTEXT_KWARG) or module.__dict__.get(BRIDGE_ATTR)
        if isinstance(ctx, StockContext):  # an ordinary call (tfcompat.routing): the stock layer, cache and all
            kwargs.pop(CONTEXT_KWARG, None)
            return type(module).forward(module, hidden_states, *args, **kwargs)
        if ctx is None:
            raise PatchedModelError(
                f"{type(module).__name__} runs tfcompat's packed linear attention without packed boundaries",
                why="the layer was called outside the patched text model's forward",
                fix="call the patched model (or its text model) rather than a decoder layer directly, or undo() the "
                "patch",
            )
        batch, length, _ = hidden_states.shape
        mixed_qkv, z, b, a = project(module, hidden_states)
        core = linear_attention(
            mixed_qkv.reshape(batch * length, -1),  # (B, L, C) -> (B L, C)
            a.reshape(batch * length, -1),  # (B, L, Hv) -> (B L, Hv)
            b.reshape(batch * length, -1),  # (B, L, Hv) -> (B L, Hv)
            linear_attention_params(module), ctx.seqs, group=ctx.group, transport=ctx.transport,
            backend=rule_backend, conv_backend=conv_backend,
        )
        head_v_dim = tail.head_v_dim
        out = tail.norm(core.reshape(-1, head_v_dim), z.reshape(-1, head_v_dim))  # (B L Hv, Dv) each
        return tail.out_proj(out.reshape(batch, length, -1))  # (B L Hv, Dv) -> (B, L, Hv Dv)

    return forward


Projected = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_Layer = Callable[[torch.Tensor], torch.Tensor]


# What the packed forward reads of a stock Gated DeltaNet module, typed (torch types every Module attribute read
# `Tensor | Module`): its tail (after the core), and its projections by `LinearAttention.projections`.
class _GatedDeltaNetTail(Protocol):
    head_v_dim: int
    norm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (N, Dv) core, (N, Dv) gate -> (N, Dv)
    out_proj: _Layer


class _Qwen35Projections(Protocol):  # "qkv_z_b_a"
    in_proj_qkv: _Layer
    in_proj_z: _Layer
    in_proj_b: _Layer
    in_proj_a: _Layer


class _Qwen3NextProjections(Protocol):  # "qkvz_ba"
    in_proj_qkvz: _Layer
    in_proj_ba: _Layer
    fix_query_key_value_ordering: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


def _project_qkv_z_b_a(module: torch.nn.Module, hidden: torch.Tensor) -> Projected:
    """Qwen3.5: ``mixed_qkv (B, L, 2 Hk Dk + Hv Dv)``, ``z (B, L, Hv Dv)``, ``b``, ``a (B, L, Hv)``."""
    m = cast(_Qwen35Projections, module)
    return m.in_proj_qkv(hidden), m.in_proj_z(hidden), m.in_proj_b(hidden), m.in_proj_a(hidden)


def _project_qkvz_ba(module: torch.nn.Module, hidden: torch.Tensor) -> Projected:
    """Qwen3-Next: the stock regrouping by key-head group, then ``[q | k | v]`` flattened as its forward does."""
    m = cast(_Qwen3NextProjections, module)
    q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(hidden), m.in_proj_ba(hidden))
    # (B, L, Hk, Dk), (B, L, Hk, Dk), (B, L, Hv, Dv) -> (B, L, 2 Hk Dk + Hv Dv)
    mixed_qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
    return mixed_qkv, z, b, a


_PROJECTIONS: dict[str, Callable[[torch.nn.Module, torch.Tensor], Projected]] = {
    "qkv_z_b_a": _project_qkv_z_b_a, "qkvz_ba": _project_qkvz_ba,
}
