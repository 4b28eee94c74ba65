"""Selective activation checkpointing: outputs of chosen modules kept through gradient checkpointing.

With transformers' gradient checkpointing each decoder layer runs its forward twice: once without saving
activations, and again in the backward to rebuild them. `tfcompat.patch(model, checkpoint_keep=...)` keeps the
outputs of the named modules of each checkpointed layer out of that recompute:

- ``"attention"``: the layer's attention module (q/k/v projections, rotary, the attention call with what its
  backend saves for its backward: q, k, v, output and log-sum-exp; the output projection);
- ``"mlp"``: the layer's MLP or MoE block (``mlp``, ``feed_forward`` or ``block_sparse_moe``);
- ``"mlp_in"``: only the input projections of that MLP (its children ``gate_proj`` / ``up_proj`` /
  ``gate_up_proj``): the recompute skips their matmuls, two thirds of a gated MLP's, and keeps about half of
  what ``"mlp"`` keeps (the projections' outputs and input, not the activation's output); the recompute still
  runs the activation, and stops before the down projection's matmul (its input is the last tensor the layer
  saves, and non-reentrant checkpointing stops the recompute there), so little of the MLP is left to recompute.
  Under ``fused`` SwiGLU (`tfcompat.hf.swiglu_down`) the MLP itself holds the projections' outputs and not the
  activation: ``"mlp"`` then keeps what ``"mlp_in"`` keeps and the MLP's output, and the recompute stops before
  the activation.

Per layer: a mapping ``{kind: layers}`` keeps a kind in some checkpointed layers only, ``layers`` a count
(``int``, the last that many of the layers holding that kind's module), a fraction (``float`` in [0, 1], of
those layers, rounded to the nearest count) or their indices (in model order: a ``range``, or any set of ints), e.g.
``{"attention": 1.0, "mlp": 8, "mlp_in": 1.0}``: attention in every layer, the whole MLP in the last 8, the MLP's
input projections in the others (``"mlp"`` takes precedence over ``"mlp_in"`` in a layer that both select). Counts
and fractions take the last layers, because their kept outputs are freed first in the backward, before the
parameter gradients have grown: the peak memory rises least. Indices place what is offloaded
(``{"attention": 1.0, "mlp_in": range(8, 16)}`` with ``checkpoint_offload=16``): early layers' copies have the
longest to go out and come back, and layers whose backward runs before the gradients have grown hold their fetched
copies when memory is lowest. A kind named alone (``"attention"``, ``("attention", "mlp")``) is every layer.

The recompute still runs everything else of the layer (norms, residual adds, the modules not kept). Gradients
are those of full checkpointing: the backward runs the same graph; only where the saved tensors come from changes.
A kept module that draws random numbers (a dropout inside it, in train mode) leaves the generators, in the
recompute, where it left them in the forward, so the layer's later dropouts draw the forward's masks.

How: the patch adds a ``context_fn`` (`torch.utils.checkpoint`'s selective-checkpoint hook: one context around
the forward, one around the recompute) to the checkpoint function transformers' ``gradient_checkpointing_enable``
set on each layer. In the forward a kept module runs with its saved tensors held as they are (an inner
``saved_tensors_hooks``, so checkpointing does not drop them) and its output is remembered; in the recompute it
is not run: its output comes back from the forward. Both passes then save the same tensors in the same order,
which non-reentrant checkpointing checks. This works at module boundaries rather than on aten ops
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`) because an op policy cannot cache kernels that
are not aten ops, such as FlashAttention-4's, and would recompute them.

What a kept module saves of its own input (the projections' input, the normed hidden state) is not kept: the
layer's recompute produces it again, and the backward takes it from there (`tfcompat.hf.kept_inputs`; a quarter of
what kept attention held).

Memory: what the kept modules save stays from the forward until the layer's backward: their saved tensors until
their own backward, their outputs until the recompute has taken them (then the recompute's saved tensors hold what
the backward still needs: a layer's gate / up outputs go with the activation's backward; under ``retain_graph``
the layer holds them for the next backward's recompute). On a 28-layer
Qwen2.5-7B-shaped step of 19,679 tokens (bench/RESULTS.md section 11): full checkpointing 31 GiB peak, ``"attention"``
38 GiB (1.04x faster), ``("attention", "mlp")`` 102 GiB (1.22x faster; checkpointing off: 98 GiB, as fast). Per
layer there (section 13): ``"mlp_in"`` keeps 1.52 GiB and saves 8 ms, ``"mlp"`` 2.35 GiB for the same; the first ~10
layers of ``"attention"`` add no peak memory (the peak comes late in the backward, when they are freed). Those
figures include the kept input; without it (section 18) kept attention is 0.46 GB per layer there and ``"mlp_in"``
1.49 GB.

Offload: ``patch(checkpoint_keep=..., checkpoint_offload=...)`` moves what the kept modules of the chosen layers
save (and their outputs) to pinned host memory during the forward, on a side stream, and brings it back during the
backward, ahead of its layer (`tfcompat.hf.offload`): kept outputs at about full checkpointing's GPU memory, the same
gradients bit for bit. ``True`` offloads every layer keeping a module, a count (``int``) the first that many of those
layers, a fraction (``float`` in [0, 1]) that share of them: the first, because their kept tensors live through the
step's peak (late in the backward) and their copies have the rest of the forward to go out and the backward of the
later layers to come back; the last layers' are freed before the peak, and their copies would stall the start of
the backward. Each offloaded byte crosses the host link twice: what the link carries in a step bounds what pays. On
the 28-layer step above (bench/RESULTS.md section 14, a 55 GB/s link): ``"attention"`` offloaded in every layer 1,691 ms
at 31.3 GiB (full checkpointing 1,755 ms at 31.0); ``{"attention": 1.0, "mlp_in": 4}`` kept 1,648 ms at 46.9 GiB,
offloaded in the first 24 layers 1,651 ms at 33.3 GiB, in all 28 1,793 ms (the last layers' copies stall the
backward's start); ``("attention", "mlp_in")`` offloaded everywhere 2,405 ms (link-bound). Spread out, heavy layers
fit the link: ``"mlp_in"`` in every third offloaded layer and the last four (``{3, 6, ..., 21, 24, 25, 26, 27}``,
offload 24) ran 1.19-1.20x Liger + flex at 1.01x its memory, where every second layer left the GPU waiting for the
copies out (section 19).

Where the copies start back (``patch(checkpoint_fetch=...)``): ``"recompute"`` (default) fetches the next layers'
copies when a layer's recompute starts: they have the layer's whole backward to arrive, and are held through it.
``"mlp_in"`` fetches them when the gradient reaches the layer's kept gate / up outputs (hooks on them from the
forward): after the activation's and the down projection's backward, the layer's peak under ``fused`` SwiGLU, and
before gate / up's and the attention's, which must then cover the copies; in two parts, one per projection: those
that left first up to about half the bytes before the first projection's backward, the rest before the second's,
into the blocks of the first's output gradient, freed by then (the second part queues behind the first on the
link; bench/RESULTS.md section 23). ``"attention"`` fetches them when the
gradient reaches the layer's kept attention output: after the whole MLP's backward, before the attention's alone. A
layer not keeping a module of that kind fetches at its recompute; in a parallel block (attention and MLP side by
side) the gradient reaches both at once. Later costs time where the rest of the backward is shorter than the
copies: long sequences are the case (the attention's backward grows with the square of the length, the copies
with the length). At 70,703 tokens in four sequences, 4 layers, ``"mlp_in"`` kept in every layer and offloaded in the
first 3 (bench/RESULTS.md section 22): ``"mlp_in"`` 1.38x Liger + flex at 1.06x its memory (22.5 GiB), where
``"recompute"`` held 23.1 GiB with ``"mlp_in"`` in two layers; ``"attention"`` 18.6 GiB (0.87x) but 1.21-1.27x (the
copies outlast the attention's backward). On the 28-layer step ``"attention"`` ran 1.06x where ``"recompute"`` ran
1.20x: a layer's backward there is shorter than a heavy layer's copies.

Needs gradient checkpointing on, non-reentrant, before `patch` (`PatchError` otherwise). Enabling it again after
the patch replaces the checkpoint function; a kept module then raises `PatchedModelError` in the next checkpointed
forward rather than silently recomputing. Not for ``torch.compile`` of a checkpointed layer (its ``context_fn``
must be a dispatch mode).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, cast, get_args

import torch
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

from ..errors import PatchedModelError, PatchError
from . import kept_inputs
from . import offload as hf_offload

__all__ = ["KEEP", "CheckpointKeep", "Fetch", "KeepPlan", "Kept", "Offload", "Policy", "apply", "fetch_of",
           "offload_of", "plan", "policy_of"]

KEEP: tuple[str, ...] = ("attention", "mlp", "mlp_in")
Layers = int | float | range | tuple[int, ...]
"""A kind's layers: a count (the last), a fraction (the last, rounded) or their indices (model order: a range, or
any collection of ints, normalized to a sorted tuple)."""
Policy = tuple[tuple[str, Layers], ...]
"""``checkpoint_keep`` normalized: ``(kind, layers)`` pairs sorted by kind."""
CheckpointKeep = str | Collection[str] | Mapping[str, Layers | Collection[int]] | Policy
Offload = bool | int | float
"""``checkpoint_offload``: False, True (every layer keeping a module), a count or a fraction of those layers (the
first)."""
Fetch = Literal["recompute", "mlp_in", "attention"]
"""``checkpoint_fetch``: where in a layer's backward the offloaded copies of the layers next in the backward start
back: when its recompute starts, or when the gradient reaches its kept module of that kind (``"mlp_in"``: the MLP's
activation and down projection done, half before each of gate / up's backward; ``"attention"``: the whole MLP
done)."""
_MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe")
_MLP_IN_NAMES = ("gate_proj", "up_proj", "gate_up_proj")
_FIX = "pass e.g. checkpoint_keep='attention', ('attention', 'mlp') or {'attention': 1.0, 'mlp': 8, 'mlp_in': 1.0}"


class KeepPlan(NamedTuple):
    """`plan`'s answer: the kept modules, the modules whose checkpoint function gets the context, and the layers
    whose kept tensors go to host memory (in model order)."""

    kept: list[Kept]
    holders: list[torch.nn.Module]
    offloaded: list[torch.nn.Module]
    fetch: Fetch = "recompute"


@dataclass(frozen=True)
class Kept:
    """One module whose output a checkpointed ``layer`` keeps (``kind`` in `KEEP`), ``name`` in the model."""

    name: str
    module: torch.nn.Module
    layer: torch.nn.Module
    kind: str


def policy_of(keep: CheckpointKeep) -> Policy:
    """``checkpoint_keep`` as sorted ``(kind, layers)`` pairs (a kind named alone: ``1.0``, every layer);
    `PatchError` for unknown kinds and for layer selections that are not a count >= 0 or a fraction in [0, 1]."""
    if isinstance(keep, Mapping):
        pairs = dict(keep)
    elif isinstance(keep, tuple) and keep and all(isinstance(p, tuple) and len(p) == 2 for p in keep):
        pairs = dict(keep)  # its own pairs (a handle's options, patched again on a copy)
    elif isinstance(keep, str):
        pairs = {keep: 1.0}
    elif isinstance(keep, Collection):
        pairs = dict.fromkeys(keep, 1.0)
    else:
        raise PatchError(f"checkpoint_keep={keep!r} is a {type(keep).__name__}", supported=", ".join(KEEP), fix=_FIX)
    unknown = sorted(map(repr, set(pairs) - set(KEEP)))
    if unknown:
        raise PatchError(f"unknown checkpoint_keep kinds [{', '.join(unknown)}]", supported=", ".join(KEEP), fix=_FIX)
    for kind, layers in pairs.items():
        count = isinstance(layers, int) and not isinstance(layers, bool) and layers >= 0
        fraction = isinstance(layers, float) and 0.0 <= layers <= 1.0
        if isinstance(layers, range):
            indices = layers.step > 0 and layers.start >= 0
        elif isinstance(layers, Collection) and not isinstance(layers, (str, bytes, Mapping)):
            indices = all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
            if indices:
                pairs[kind] = layers = tuple(sorted(set(layers)))
        else:
            indices = False
        if not (count or fraction or indices):
            raise PatchError(f"checkpoint_keep[{kind!r}] = {layers!r}",
                             why="a kind's layers are a count (int >= 0: the last that many layers holding it), a "
                                 "fraction of them (float in [0, 1]) or their indices (a range or a collection of "
                                 "ints >= 0)",
                             supported="int >= 0, float in [0.0, 1.0], range(start >= 0, stop, step > 0), a set of "
                                       "ints >= 0", fix=_FIX)
    return tuple(sorted(pairs.items()))


def offload_of(offload: Offload) -> Offload:
    """``checkpoint_offload`` checked: a bool, a count >= 0 or a fraction in [0, 1] (`PatchError` otherwise)."""
    count = isinstance(offload, int) and not isinstance(offload, bool) and offload >= 0
    fraction = isinstance(offload, float) and 0.0 <= offload <= 1.0
    if not (isinstance(offload, bool) or count or fraction):
        raise PatchError(f"checkpoint_offload={offload!r}",
                         why="it names the layers whose kept tensors go to host memory: all (True), none (False), the "
                             "first that many (int >= 0) or that fraction of them (float in [0, 1])",
                         supported="bool, int >= 0, float in [0.0, 1.0]",
                         fix="pass e.g. checkpoint_offload=True or checkpoint_offload=20")
    return offload


def fetch_of(fetch: Fetch) -> Fetch:
    """``checkpoint_fetch`` checked: one of `Fetch`'s values (`PatchError` otherwise)."""
    if fetch not in get_args(Fetch):
        raise PatchError(f"checkpoint_fetch={fetch!r}",
                         why="it says where a layer's backward starts bringing back the next layers' offloaded copies",
                         supported=", ".join(map(repr, get_args(Fetch))),
                         fix="pass checkpoint_fetch='mlp_in' or 'attention' for long sequences, else leave it out")
    return fetch


def _last(layers: list[torch.nn.Module], n: int | float) -> list[torch.nn.Module]:
    """The last ``n`` of ``layers`` (a count), or that fraction of them rounded to the nearest count."""
    count = math.floor(n * len(layers) + 0.5) if isinstance(n, float) else n
    return layers[len(layers) - count:] if count else []


def plan(model: torch.nn.Module, keep: Policy, attention_cls: type, error: Callable[..., PatchError],
         offload: Offload = False, fetch: Fetch = "recompute") -> KeepPlan:
    """The kept modules, the modules whose checkpoint function gets the context and the offloaded layers, before
    anything changes.

    ``keep``: `policy_of`'s pairs; ``offload``: `offload_of`'s value; ``fetch``: `fetch_of`'s.
    ``error(PatchError, what, why=..., fix=...)`` builds the family's error. Raises when checkpointing is off or
    reentrant, a kind is found in no checkpointed layer, a count exceeds the layers holding its kind, offload is
    asked for where nothing is kept or for more layers than keep a module, or ``fetch`` names a kind where nothing
    is offloaded or no layer keeps that kind.
    """
    policy = [(kind, n) for kind, n in keep if n]
    if fetch != "recompute" and not (offload and policy):
        raise error(PatchError, f"checkpoint_fetch={fetch!r} without checkpoint_offload",
                    why="checkpoint_fetch places the copies checkpoint_offload brings back: nothing is offloaded",
                    fix="pass checkpoint_offload (and checkpoint_keep) too, or leave checkpoint_fetch out")
    if not policy:
        if offload:
            raise error(PatchError, f"checkpoint_offload={offload!r} without checkpoint_keep",
                        why="checkpoint_offload moves what checkpoint_keep keeps to host memory: nothing is kept",
                        fix="pass checkpoint_keep too, e.g. {'attention': 1.0, 'mlp_in': 1.0}, or leave "
                            "checkpoint_offload out")
        return KeepPlan([], [], [])
    holders = [m for m in model.modules() if "_gradient_checkpointing_func" in vars(m)]
    layers = [m for m in holders if getattr(m, "gradient_checkpointing", False)]
    if not layers:
        raise error(PatchError, f"checkpoint_keep={dict(keep)!r} but gradient checkpointing is off",
                    why="checkpoint_keep keeps module outputs out of gradient checkpointing's recompute",
                    fix="call model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
                        "False}) (activation_checkpointing_enable() from transformers 5.25) before patch(), or leave "
                        "checkpoint_keep out")
    for m in holders:
        fn = m._gradient_checkpointing_func
        kw = fn.keywords if isinstance(fn, functools.partial) else None
        if kw is None or kw.get("use_reentrant", True) or "context_fn" in kw:
            raise error(PatchError, f"checkpoint_keep needs non-reentrant checkpointing without a context_fn, "
                        f"{type(m).__name__} has {fn!r}",
                        why="the kept outputs come back through torch.utils.checkpoint's context_fn, which only the "
                            "non-reentrant checkpoint takes (and takes once)",
                        fix="gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}), "
                            "or activation_checkpointing_enable() from transformers 5.25")
    names = {id(m): n for n, m in model.named_modules()}
    found = {layer: _modules(layer, attention_cls) for layer in layers}
    chosen: dict[str, set[torch.nn.Module]] = {}
    for kind, n in policy:
        holding = [layer for layer in layers if found[layer][kind]]
        if not holding:
            raise error(PatchError, f"checkpoint_keep {[kind]} matches no module of a checkpointed layer",
                        why=f"checkpointed layers: {sorted({type(m).__name__ for m in layers})}; attention is a "
                            f"child {attention_cls.__name__}, mlp a child named one of {_MLP_NAMES}, mlp_in its "
                            f"children named {_MLP_IN_NAMES}",
                        fix=f"leave {kind!r} out of checkpoint_keep")
        if isinstance(n, int) and n > len(holding):
            raise error(PatchError, f"checkpoint_keep[{kind!r}] = {n} but {len(holding)} checkpointed layers hold it",
                        why="a count selects the last that many layers holding the kind's module",
                        fix=f"pass a count up to {len(holding)}, or 1.0 for every layer")
        if isinstance(n, (range, tuple)):
            if max(n) >= len(holding):
                raise error(PatchError, f"checkpoint_keep[{kind!r}] = {n} but {len(holding)} checkpointed layers "
                            "hold it", why="indices select the layers holding the kind's module, 0 the first",
                            fix=f"pass indices within range({len(holding)})")
            chosen[kind] = {holding[i] for i in n}
        else:
            chosen[kind] = set(_last(holding, n))
    kept: list[Kept] = []
    for layer in layers:
        for kind in KEEP:
            if layer in chosen.get(kind, ()) and not (kind == "mlp_in" and layer in chosen.get("mlp", ())):
                kept += [Kept(names[id(m)], m, layer, kind) for m in found[layer][kind]]
    keeping = list({k.layer: None for k in kept})  # model order
    if isinstance(offload, int) and not isinstance(offload, bool) and offload > len(keeping):
        raise error(PatchError, f"checkpoint_offload={offload} but {len(keeping)} layers keep a module",
                    why="a count offloads the first that many layers keeping a module",
                    fix=f"pass a count up to {len(keeping)}, or True for every layer")
    first = len(_last(keeping, offload)) if isinstance(offload, float) else len(keeping) if offload is True \
        else int(offload)
    offloaded = keeping[:first]
    if fetch != "recompute" and not any(k.kind == fetch for k in kept):
        raise error(PatchError, f"checkpoint_fetch={fetch!r} but no layer keeps its {fetch}",
                    why=f"the copies start back when the gradient reaches a kept {fetch} module's output",
                    fix=f"keep {fetch} too, e.g. checkpoint_keep={{{fetch!r}: 1.0, ...}}, or leave checkpoint_fetch "
                        "out")
    return KeepPlan(kept, holders, offloaded, fetch)


def _modules(layer: torch.nn.Module, attention_cls: type) -> dict[str, list[torch.nn.Module]]:
    """Per kind, the modules of ``layer`` it keeps (empty where the layer has none)."""
    mlps = [m for attr in _MLP_NAMES if isinstance(m := getattr(layer, attr, None), torch.nn.Module)]
    return {"attention": [c for c in layer.children() if isinstance(c, attention_cls)],
            "mlp": mlps,
            "mlp_in": [c for mlp in mlps for n, c in mlp.named_children() if n in _MLP_IN_NAMES]}


def apply(handle: Any, plan: KeepPlan) -> None:
    """Give each checkpoint function the context and each kept module its forward, recorded on the handle."""
    kept, holders, offloaded, fetch = plan
    offloader = hf_offload.Offloader() if offloaded else None
    for m in holders:
        fn = cast(functools.partial, m._gradient_checkpointing_func)  # plan checked it
        to_host = any(m is x for x in offloaded)
        keeping = any(m is k.layer for k in kept)  # its backward fetches the next layers' copies ahead
        # at its recompute, or at the gradient of its kept module of the kind fetch names
        at = fetch if any(m is k.layer and k.kind == fetch for k in kept) else "recompute"
        handle._set("instance", m, "_gradient_checkpointing_func",
                    _with_context(fn, offloader if keeping else None, to_host, at),
                    "checkpoint with tfcompat's context_fn (kept module outputs are not recomputed"
                    + ("; what they save goes to host memory)" if to_host else ")"))
    for k in kept:
        handle._set("instance", k.module, "forward", _kept_forward(k.module.forward, k.layer, k.kind),
                    f"output kept through gradient checkpointing ({k.kind}), not recomputed")


# ------------------------------------------------------------------------------------------ forward time


class _Outputs:
    """One checkpointed call's kept outputs, in call order: appended in the forward, taken in the recompute."""

    def __init__(self, stash: hf_offload.Stash | None, fetch: Fetch) -> None:
        # (outputs detached or packed by the stash, their requires_grad, the generators after the call if it drew)
        self.items: list[tuple[Any, Any, _Rng | None]] = []
        self.taken = 0
        self.stash = stash  # the layer's offloaded tensors, where it offloads
        self.fetch = fetch  # the kind of kept module whose output's gradient fetches ahead, or "recompute"
        self.ahead = None if stash is None else _Ahead(stash)

    def fetch_ahead_at_gradient(self, out: Any) -> None:
        """The backward reaching ``out`` (its first tensor that requires grad) fetches a part of the next layers'
        copies."""
        t = next((x for x in tree_leaves(out) if isinstance(x, torch.Tensor) and x.requires_grad), None)
        if self.ahead is None or t is None:  # no gradient will reach it
            if self.ahead is None or not self.ahead.parts:  # nor an earlier output's: the recompute fetches ahead
                self.fetch = "recompute"
            return
        self.ahead.parts += 1
        t.register_hook(self.ahead)


class _Ahead:
    """One layer's fetch of the next layers' copies at the gradient hooks of its kept outputs of the fetch kind, in
    as many parts as it has hooks (gate's and up's: two), one per hook as the backward reaches them: the first
    brings the copies that left first up to about half their bytes, the last the rest. Split, the second part comes
    back into the blocks the first projection's backward freed (its output's gradient), and queues behind the first
    on the link. Holds the stash alone: the hooks live as long as the graph, the kept outputs only to
    the layer's recompute."""

    def __init__(self, stash: hf_offload.Stash) -> None:
        self.stash = stash
        self.parts = 0  # hooks registered in the forward
        self.fired = 0  # in this backward

    def __call__(self, grad: torch.Tensor | None = None) -> None:
        left = self.parts - self.fired
        if left > 0:
            self.fired += 1
            self.stash.fetch_ahead(1 / left)


_SCOPE: contextvars.ContextVar[tuple[_Outputs, bool] | None] = contextvars.ContextVar("tfcompat_kept", default=None)


class _Scope:
    """The context of a checkpointed call (``context_fn``'s): around its forward, or around its recompute. After a
    recompute it lets the layer's kept outputs go (what the backward still needs of them, the recompute's saved
    tensors hold), unless the backward keeps the graph (``retain_graph``): a second backward enters it again (a class:
    a generator's context enters once)."""

    def __init__(self, outputs: _Outputs, recompute: bool) -> None:
        self.outputs: _Outputs | None = outputs
        self.recompute = recompute
        self.tokens: list[contextvars.Token] = []

    def __enter__(self) -> None:
        outputs = self.outputs
        if outputs is None:
            raise PatchedModelError(
                "a checkpointed layer was recomputed again after a backward that did not retain its graph",
                why="the kept module outputs went with that backward's recompute",
                fix="pass retain_graph=True to every backward but the last through the same graph")
        if self.recompute:
            outputs.taken = 0
            if outputs.stash is not None:
                outputs.stash.fetch()  # this layer's tensors back
                ahead = cast(_Ahead, outputs.ahead)  # with the stash
                ahead.fired = 0
                if outputs.fetch == "recompute":
                    ahead.stash.fetch_ahead()  # and the next layers' of the backward
        self.tokens.append(_SCOPE.set((outputs, self.recompute)))

    def __exit__(self, *exc: object) -> None:
        _SCOPE.reset(self.tokens.pop())
        outputs = cast(_Outputs, self.outputs)
        if not self.recompute:
            if outputs.stash is not None:
                outputs.stash.close()
        elif not torch._C._autograd._get_current_graph_task_keep_graph():  # outside a backward: True
            self.outputs = None


def _context_fn(offloader: hf_offload.Offloader | None, to_host: bool, fetch: Fetch
                ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    outputs = _Outputs(None if offloader is None else offloader.stash(to_host), fetch)
    return _Scope(outputs, False), _Scope(outputs, True)


def _with_context(fn: functools.partial, offloader: hf_offload.Offloader | None, to_host: bool, fetch: Fetch
                  ) -> Callable[..., Any]:
    """transformers' checkpoint function (a partial of ``checkpoint`` with ``use_reentrant=False``) plus the
    context_fn (with the patch's offloader where the layer keeps modules; ``to_host``: it offloads them; ``fetch``:
    where its backward fetches the next layers' copies)."""
    return functools.partial(fn, context_fn=functools.partial(_context_fn, offloader, to_host, fetch))


def _hold(t: torch.Tensor) -> torch.Tensor:
    return t.detach()  # the saved tensor's data without its autograd history


def _kept_forward(forward: Callable[..., Any], layer: torch.nn.Module, kind: str) -> Callable[..., Any]:
    @functools.wraps(forward)
    def kept(*args: Any, **kwargs: Any) -> Any:
        scope = _SCOPE.get()
        if scope is None:
            if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
                raise PatchedModelError(
                    f"{type(layer).__name__} checkpoints without tfcompat's context, so checkpoint_keep is lost",
                    why="gradient checkpointing was enabled again after patch(checkpoint_keep=...), which replaced "
                        "the checkpoint function the patch had extended",
                    fix="undo() the patch, enable gradient checkpointing, then patch again")
            return forward(*args, **kwargs)
        outputs, recompute = scope
        inputs = kept_inputs.Inputs(args, kwargs)  # in both passes: checkpointing drops them, then recomputes them
        if recompute:
            held, grads, drawn = outputs.items[outputs.taken]
            outputs.taken += 1
            if drawn is not None:  # the module drew random numbers in the forward: the rest of the layer draws on
                drawn.restore()  # from where it left them, as in the forward
            # the same requires_grad as in the forward: the rest of the recompute then saves the same tensors
            return _rebuild(tree_map(hf_offload.unpack, held), grads)
        pack = _hold if outputs.stash is None else outputs.stash.pack
        before = _Rng.of(args, kwargs)
        # innermost hooks: kept (or offloaded), not dropped
        with torch.autograd.graph.saved_tensors_hooks(inputs.pack(pack), kept_inputs.unpack):
            out = forward(*args, **kwargs)
        after = _Rng.of(args, kwargs)
        if kind == outputs.fetch:
            outputs.fetch_ahead_at_gradient(out)
        outputs.items.append((tree_map_only(torch.Tensor, pack, out),
                              tree_map_only(torch.Tensor, lambda t: t.requires_grad, out),
                              None if after == before else after))
        return out

    return kept


@dataclass(frozen=True, eq=False)
class _Rng:
    """The random number generators a kept module call can draw from: the CPU's and those of its inputs' devices.

    A module that draws (a dropout inside it, e.g. Starcoder2's or GPT-J's residual dropout in the attention module)
    moves them in the forward; the recompute skips it, so without `restore` every later draw of the layer (the MLP's
    dropout) would differ from the forward's, and the backward would run on other masks than the forward used."""

    cpu: torch.Tensor
    devices: tuple[tuple[torch.device, torch.Tensor], ...]

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Rng:
        found = dict.fromkeys(x.device for x in tree_leaves((args, kwargs))
                              if isinstance(x, torch.Tensor) and x.device.type not in ("cpu", "meta"))
        return cls(torch.get_rng_state(), tuple((d, torch.get_device_module(d.type).get_rng_state(d)) for d in found))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, _Rng) and torch.equal(self.cpu, other.cpu) and len(self.devices) == len(other.devices)
                and all(a == c and torch.equal(b, d) for (a, b), (c, d) in zip(self.devices, other.devices)))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in self.devices:
            torch.get_device_module(device.type).set_rng_state(state, device)


def _rebuild(detached: Any, grads: Any) -> Any:
    """Fresh leaves of the kept outputs (each recompute builds its own graph on them)."""
    return tree_map(lambda d, g: d.detach().requires_grad_(g) if isinstance(d, torch.Tensor) else d, detached, grads)

