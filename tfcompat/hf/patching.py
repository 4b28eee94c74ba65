"""Applying and undoing patches, with a record of every change.

`patch` changes the given model's instances only, except one process-wide action: it registers the
attention key ``"tfcompat_packed"`` in transformers' ``AttentionInterface`` (a new name; no existing
function is replaced; removed again when the last patched model is undone). Per instance it sets:

- the text config's ``_attn_implementation`` to that key (the stock attention forward then dispatches to
  tfcompat's packed core, after its own rotary);
- an instance ``forward`` on the text model that accepts contract position ids, computes the packed
  boundaries once per forward and passes them down in kwargs;
- where the installed decoder layer drops ``**kwargs``, a forward pre-hook on each decoder layer that hands
  the boundaries to its attention;
- on each token mixer other than softmax attention of a derived hybrid, an instance ``forward`` that runs it per
  sequence, and a pre-hook on its decoder layer handing it the boundaries (`tfcompat.hf.mixers`);
- in an encoder-decoder model (`tfcompat.hf.encoder_decoder`), instance forwards on the model (packed or stock
  decided from the decoder's row) and on its encoder (always stock), and on each of the decoder's cross-attention
  modules `tfcompat.hf.attention.CROSS_ATTR` (its keys: each sequence's own encoder states);
- on each attention module, its attention features (window, softcap, sinks, chunk: `tfcompat.hf.features`) under
  `tfcompat.hf.attention.FEATURES_ATTR`;
- with ``fused``, the forwards `tfcompat.hf.fused` routes through Liger's kernels; with ``checkpoint_keep``, each
  checkpointing module's checkpoint function and each kept module's forward (`tfcompat.hf.checkpointing`).
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast, get_args

import torch

from ..core.a2a import check_heads
from ..core.attention import Backend
from ..core.context import BRIDGE_ATTR, CONTEXT_KWARG, ForwardContext, StockContext
from ..core.extras import VISUAL_KWARG, VisualExtras
from ..core.labels import mask_ends, mask_starts
from ..core.packing import PackedSeqs
from ..core.position_ids import split_positions
from ..errors import InvalidInputError, PatchedModelError, PatchError
from ..inputs.derived_vision import mrope_axes
from ..registry import Resolved, resolve_model
from ..registry.derive import (
    OwnPositions,
    cross_attrs,
    own_positions,
    positions_from_row,
    positions_module_from_row,
    takes_row_positions,
)
from . import attention as hf_attention
from . import checkpointing as hf_checkpointing
from . import cross_states as hf_cross
from . import encoder_decoder as hf_encoder_decoder
from . import fused as hf_fused
from . import linear_attention as hf_linear_attention
from . import mixers as hf_mixers
from . import proof as hf_proof
from . import vision_attention as hf_vision_attention
from .changes import Record
from .features import ModuleFeatures, module_features, unsupported
from .forward import Router, to_text_model_layout
from .pooling import is_sequence_classifier, pooled_forward, scores_holder
from .rope_lengths import rules_of
from .vision import plan_vision, shared_kwargs, vision_hooks

__all__ = ["PatchHandle", "Record", "is_patched", "patch"]

_MISSING = object()
_HANDLE_ATTR = "_tfcompat_handle"
_ROW_POSITIONS_ATTR = "_tfcompat_row_positions"  # on a text model's positions module during a packed forward



class PatchHandle:
    """The result of `patch`: what was changed, and how to take it back (`undo`, or leave the ``with``)."""

    def __init__(self, model: torch.nn.Module, resolved: Resolved, options: dict[str, Any],
                 proof: hf_proof.Proof | None = None) -> None:
        self.model = model
        self.resolved = resolved
        self.options = options
        self.proof = proof  # a derived type's patch-time proof (`tfcompat.hf.proof`); None: not proven here
        self.records: list[Record] = []
        self._undo: list[Callable[[], None]] = []
        self.active = True

    def _set(self, scope: str, target: Any, attr: str, new: Any, note: str) -> None:
        was_set = attr in vars(target) if scope == "instance" else True
        old = vars(target).get(attr) if scope == "instance" else getattr(target, attr)
        setattr(target, attr, new)
        self.records.append(Record(scope, target, attr, old, new, was_set, note))

        def restore() -> None:
            current = vars(target).get(attr, _MISSING) if scope == "instance" else getattr(target, attr)
            if current is not new and current != new:  # changed after the patch: keep the later choice
                return
            if was_set:
                setattr(target, attr, old)
            else:
                delattr(target, attr)

        self._undo.append(restore)

    def _add(self, record: Record, restore: Callable[[], None]) -> None:
        self.records.append(record)
        self._undo.append(restore)

    def undo(self) -> None:
        """Restore every original object, newest change first. Idempotent. An attribute changed again after
        the patch (``set_attn_implementation``, a forward replaced by someone else) keeps its later value."""
        while self._undo:
            self._undo.pop()()
        self.active = False

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()

    def explain(self) -> str:
        state = "active" if self.active else "undone"
        head = f"tfcompat patch of {type(self.model).__name__} ({state}), options {self.options}"
        proof = [] if self.proof is None else [f"  {self.proof}"]
        return "\n".join([head, *proof, *(f"  {r}" for r in self.records), self.resolved.explain()])


def patch(
    model: torch.nn.Module,
    *,
    remove_padding: bool = True,
    ulysses_group: Any = _MISSING,
    backend: Backend = "auto",
    linear_backend: hf_linear_attention.LinearBackend = "auto",
    fused: hf_fused.Fused = False,
    checkpoint_keep: hf_checkpointing.CheckpointKeep = (),
    checkpoint_offload: hf_checkpointing.Offload = False,
    checkpoint_fetch: hf_checkpointing.Fetch = "recompute",
    vision_attention: bool = False,
    prove: bool | None = None,
) -> PatchHandle:
    """Make a stock transformers model accept packed batches; returns a `PatchHandle`.

    remove_padding: accept packed rows (several sequences back to back, no padding; the text row of the
        position ids restarts at 0 at each sequence) and return, per token, what the stock model returns
        for each sequence alone. Position ids are ``(4, B, L)`` ``[text; t; h; w]`` or ``(B, L)``.
    ulysses_group: a torch.distributed process group for Ulysses sequence parallelism, or None. The forward
        then takes `tfcompat.ulysses.shard_inputs(...).model_inputs` (this rank's slice of one packed row).
    backend: the varlen attention backend (``"auto"``, ``"flash"``, ``"torch"``, ``"sdpa"``).
    linear_backend: the kernels of linear-attention (Gated DeltaNet) layers, where the family has them:
        ``"auto"`` (flash-linear-attention / causal-conv1d where installed and usable, else torch), ``"fla"``
        (flash-linear-attention required), ``"torch"`` (exact on any device).
    fused: Liger-Kernel's RMSNorm / SwiGLU / RoPE / fused MoE kernels where exact for the module
        (`tfcompat.hf.fused`): False (default), True or a subset of ``("rms_norm", "swiglu", "rope", "experts")``
        (`PatchError` for a module they would not compute exactly, or without liger-kernel), ``"auto"`` (where
        exact, if liger-kernel imports).
    checkpoint_keep: under gradient checkpointing (on, non-reentrant, before `patch`), the modules of each
        checkpointed layer whose outputs are kept rather than recomputed in the backward: ``"attention"``
        (projections, rotary, attention call), ``"mlp"``, ``"mlp_in"`` (the MLP's gate / up projections), or
        several; per layer with ``{kind: count or fraction}`` (the last layers) or ``{kind: indices}`` (a range or
        a set of ints: those layers), e.g. ``{"attention": 1.0, "mlp_in": 8}`` (`tfcompat.hf.checkpointing`).
    checkpoint_offload: what ``checkpoint_keep`` keeps goes to pinned host memory in the forward and comes back in
        the backward, ahead of its layer, overlapped on side streams (`tfcompat.hf.offload`; the same gradients):
        False (default), True (every layer keeping a module), a count or fraction of those layers (the first).
    checkpoint_fetch: where in a layer's backward the next layers' offloaded copies start back: ``"recompute"``
        (default: when its recompute starts; the copies have the whole layer's backward to arrive), ``"mlp_in"``
        (when the gradient reaches its kept gate / up outputs: not held through the activation's and down
        projection's backward; half before each projection's backward) or ``"attention"`` (at its kept
        attention's output: not held through the MLP's backward); later holds them for less of the backward and
        leaves them less time: for long sequences.
    vision_attention: the vision (or audio) towers that split their patches at boundaries (``cu_seqlens``: per
        image, or per window) run their attention as one varlen call per block on ``backend``, rather than one
        call per image or window after a host sync (`tfcompat.hf.vision_attention`; transformers 5.x's Qwen2-VL,
        Qwen2.5-VL, Qwen3-VL, GLM-4V, Pixtral, ...). `PatchError` for a model without such a tower.
    prove: for a type without a written table (derived from its modeling module), check the patch first on a tiny
        copy of the model's own config, CPU float32: stock per sequence against patched packed (`tfcompat.hf.proof`,
        cached per type, release and config; `PatchHandle.proof` says what it found). None (default): prove unless
        the environment sets ``TFCOMPAT_PROVE=0``; False skips it. `PatchError` where the copy's packed path is wrong.

    Idempotent: patching a patched model with the same options returns its handle. Everything that cannot
    apply raises `PatchError` here, never inside a forward. See the module docstring for what is changed.
    """
    if not remove_padding:
        raise PatchError(
            "nothing to patch: remove_padding=False",
            fix="pass remove_padding=True (the packed path is what tfcompat.patch provides)",
        )
    if backend not in get_args(Backend):
        raise PatchError(f"unknown attention backend {backend!r}", supported=", ".join(get_args(Backend)),
                         fix="pass one of the supported backends")
    ulysses_group = _check_group(ulysses_group)
    if not isinstance(vision_attention, bool):
        raise PatchError(f"vision_attention must be True or False, got {vision_attention!r}",
                         fix="pass vision_attention=True to route the vision towers' attention, else leave it out")
    keep = hf_checkpointing.policy_of(checkpoint_keep)
    offload = hf_checkpointing.offload_of(checkpoint_offload)
    fetch = hf_checkpointing.fetch_of(checkpoint_fetch)
    options = {"remove_padding": remove_padding, "ulysses_group": ulysses_group, "backend": backend,
               "linear_backend": linear_backend, "fused": fused, "checkpoint_keep": keep,
               "checkpoint_offload": offload, "checkpoint_fetch": fetch, "vision_attention": vision_attention}
    existing = vars(model).get(_HANDLE_ATTR)
    if existing is not None and existing.active:
        if existing.options != options:
            raise PatchError(
                "model is already patched with other options",
                family=existing.resolved.family,
                transformers_version=existing.resolved.transformers_version,
                why=f"patched with {existing.options}, asked for {options}",
                fix="undo() the first handle before patching again",
            )
        return existing

    family = getattr(getattr(model, "config", None), "model_type", None)
    if family is None:
        raise PatchError("model has no config.model_type", why=f"got {type(model).__name__}",
                         fix="pass a transformers PreTrainedModel")
    resolved = resolve_model(model)
    crossed = hf_encoder_decoder.plan(model, resolved)
    if crossed is not None and ulysses_group is not None:
        raise resolved.error(PatchError, f"{type(model).__name__} cannot run sequence parallel",
                             why="its decoder's cross-attention reads each sequence's encoder states whole; under "
                             "Ulysses a rank holds a slice of the decoder row", supported="ulysses_group=None",
                             fix="patch without ulysses_group")
    plan = _plan(model, resolved, ulysses_group, linear_backend, backend,
                 crossed.decoder if crossed is not None else model)
    if ulysses_group is not None:
        lengths = rules_of([*plan.configs, *(tm.config for tm in plan.text_models)], resolved)
        if lengths:
            raise resolved.error(
                PatchError, "a rope whose frequencies follow the call's length, under sequence parallelism",
                why=f"{', '.join(sorted({rule.rope_type for rule in lengths}))} rope rotates by the largest position "
                "its text model is given, and under Ulysses each rank's is given its own slice of the row: a rank "
                "would rotate a sequence with other frequencies than the sequence takes alone",
                supported="ulysses_group=None with such a rope", fix="patch without ulysses_group")
    vision = plan_vision(model, resolved, plan.text_models, [f[0] for f in plan.features], ulysses_group)
    fused_modules = hf_fused.prepare(model, fused, resolved.family, resolved.transformers_version)
    if any(n for _, n in keep) and plan.mixers.note.startswith(hf_mixers.LAYER_NOTE):
        raise resolved.error(PatchError, "checkpoint_keep where the decoder layers run per sequence",
                             why="tfcompat replaces those layers' forwards with a loop over the row's sequences; the "
                             "modules kept from recomputation are the packed path's", supported="checkpoint_keep=()",
                             fix="patch without checkpoint_keep")
    keep_plan = hf_checkpointing.plan(model, keep, resolved.attention_cls, resolved.error, offload, fetch)
    towers = hf_vision_attention.plan(model, plan.configs, resolved, backend) if vision_attention else []
    is_derived = resolved.entry.derived is not None or resolved.entry.derived_vision is not None
    # the copy's own patch proves nothing again; it routes its towers as this one does
    copy_patch = functools.partial(patch, prove=False, vision_attention=vision_attention)
    proof = hf_proof.prove(model, resolved, copy_patch) if is_derived and hf_proof.is_wanted(prove) else None

    handle = PatchHandle(model, resolved, options, proof)
    hf_attention.register()
    # the use ends at undo() or when the model is collected (a dropped deepcopy is never undone)
    release = weakref.finalize(model, hf_attention.unregister)
    release.atexit = False
    handle._add(
        Record("process", hf_attention, "AttentionInterface", None, hf_attention.ATTENTION_KEY, True,
               f"registered attention key {hf_attention.ATTENTION_KEY!r} (reference counted)"),
        release,
    )
    router = Router(resolved, hf_attention.ATTENTION_KEY, [(c, c._attn_implementation) for c in plan.configs],
                    getattr(resolved.module, "eager_attention_forward", None), ulysses_group,
                    vision_config=model.config if resolved.spec.is_vision else None,
                    text_configs=tuple(tm.config for tm in plan.text_models), axes=mrope_axes(resolved, model))
    hooks = vision_hooks(vision, resolved, router)
    for config in plan.configs:
        handle._set("config", config, "_attn_implementation", hf_attention.ATTENTION_KEY,
                    f"{config._attn_implementation!r} -> {hf_attention.ATTENTION_KEY!r}")
    if towers:
        hf_attention.register(hf_vision_attention.VISION_KEY, hf_vision_attention.vision_attention)
        release_vision = weakref.finalize(model, hf_attention.unregister, hf_vision_attention.VISION_KEY)
        release_vision.atexit = False
        handle._add(Record("process", hf_vision_attention, "AttentionInterface", None, hf_vision_attention.VISION_KEY,
                           True, f"registered attention key {hf_vision_attention.VISION_KEY!r} (reference counted)"),
                    release_vision)
    for config, modules in towers:
        handle._set("config", config, "_attn_implementation", hf_vision_attention.VISION_KEY,
                    f"tower: {config._attn_implementation!r} -> {hf_vision_attention.VISION_KEY!r}")
        for module in modules:
            handle._set("instance", module, hf_vision_attention.BACKEND_ATTR, backend,
                        "the tower's attention backend (one varlen call per block)")
    own = own_positions(resolved.text_model_cls) if resolved.entry.derived is not None else None
    derived = resolved.entry.derived
    from_row = positions_from_row(resolved.text_model_cls) if derived is not None else None
    layered = derived is not None and (bool(derived.per_sequence_why) or not derived.softmax_attention)
    if from_row is None and layered:  # layers run per sequence (MVP)
        from_row = positions_module_from_row(resolved.text_model_cls)
    for text_model in plan.text_models:
        computes = None if own is None else functools.partial(_own_positions, text_model.get_submodule(own.attr), own)
        row_module = None if from_row is None else getattr(text_model, from_row)
        if row_module is not None:
            hook = row_module.register_forward_pre_hook(_row_positions_hook, with_kwargs=True)
            handle._add(Record("hook", row_module, "forward_pre_hook", None, hook, True,
                               "packed rows: the row's position ids instead of the ones counted over the row"),
                        hook.remove)
        inside = {id(x) for x in text_model.modules()}
        per_sequence = [m for m, _ in plan.mixers.forwards if id(m) in inside]
        bridged = [attn for _, attn in plan.bridges if id(attn) in inside]
        forward = _packed_text_forward(text_model.forward, resolved, backend, ulysses_group, router, computes,
                                       row_module, per_sequence, bridged)
        handle._set("instance", text_model, "forward", forward, "packed position ids -> boundaries once per forward; "
                    "ordinary calls -> the stock attention")
    if crossed is not None:
        handle._set("instance", model, "forward", hf_encoder_decoder.top_forward(model.forward, router,
                                                                                 crossed.derivation),
                    "packed or stock decided once per forward, from the decoder's ids and position ids")
        handle._set("instance", crossed.encoder, "forward",
                    hf_encoder_decoder.encoder_forward(crossed.encoder.forward, router, crossed.derivation),
                    "the encoder runs stock (attention, masks) on every call")
        for module in crossed.cross:
            handle._set("instance", module, hf_attention.CROSS_ATTR, True,
                        "packed rows: cross-attention of each sequence to its own encoder states")
    elif all(model is not m for m in plan.text_models):
        boundaries_only = (layered and from_row is None
                           and "position_ids" not in inspect.signature(model.forward).parameters)
        handle._set("instance", model, "forward", _top_forward(model.forward, router, boundaries_only),
                    "packed or stock decided once per forward; labels per sequence on packed rows")
    if is_sequence_classifier(model):
        held: dict[str, torch.Tensor] = {}
        score = cast(torch.nn.Module, model.score)
        pad_id = cast(Any, model.config).get_text_config().pad_token_id
        handle._set("instance", score, "forward", scores_holder(score, held),
                    "keeps the per-token scores for per-sequence pooling")
        handle._set("instance", model, "forward", pooled_forward(model.forward, router, held, pad_id),
                    "packed rows: one score per sequence (its last non-pad token), not one per row")
    for target, attr, wrapper, note in shared_kwargs(model, resolved, router):
        handle._set("instance", target, attr, wrapper, note)
    for layer, attn in plan.bridges:
        hook = layer.register_forward_pre_hook(hf_mixers.bridge(attn), with_kwargs=True)

        def remove(hook=hook, attn=attn) -> None:
            hook.remove()
            attn.__dict__.pop(BRIDGE_ATTR, None)

        handle._add(Record("hook", layer, "forward_pre_hook", None, hook, True,
                           "hands packed boundaries to self-attention (layer drops **kwargs)"), remove)
    for module, kind, fn, note in hooks:
        vision_hook = (module.register_forward_pre_hook(fn, with_kwargs=True) if kind == "pre"
                       else module.register_forward_hook(fn, with_kwargs=True, always_call=True))
        handle._add(Record("hook", module, "forward_pre_hook" if kind == "pre" else "forward_hook", None, vision_hook,
                           True, note), vision_hook.remove)
    for attn, features, note, temperature in plan.features:
        handle._set("instance", attn, hf_attention.FEATURES_ATTR, features, note)
        if temperature is not None:
            handle._set("instance", attn, hf_attention.TEMPERATURE_ATTR, temperature,
                        "NoPE temperature tuning rescaled from the row index to the position in each sequence")
    for module, forward in plan.linear:
        handle._set("instance", module, "forward", forward,
                    "packed Gated DeltaNet (conv and state restart per sequence)")
    hf_mixers.apply(handle, plan.mixers)
    hf_fused.apply(handle, fused_modules)
    hf_checkpointing.apply(handle, keep_plan)
    handle._set("instance", model, "__deepcopy__", _deepcopy(handle), "copy.deepcopy gives a copy patched alike")
    handle._set("instance", model, "__reduce_ex__", _refuse_pickle(handle), "pickling raises PatchedModelError")
    handle._set("instance", model, _HANDLE_ATTR, handle, "the active handle (idempotence)")
    return handle


def is_patched(model: torch.nn.Module) -> bool:
    """Whether `patch` was applied to ``model`` (the module given to it) and its handle is not undone.

    A ``copy.deepcopy`` of a patched model is patched (with its own handle); a submodule of a patched model is not
    itself patched.
    """
    handle = vars(model).get(_HANDLE_ATTR)
    return isinstance(handle, PatchHandle) and handle.active


def _check_group(group: Any) -> Any:
    """The Ulysses group of ``patch(ulysses_group=...)``, or None; `PatchError` for anything else."""
    if group is _MISSING:
        return None
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    if group is None and not initialized:
        raise PatchError(
            "ulysses_group=None while torch.distributed is not initialized",
            why="dist.group.WORLD is None until init_process_group runs, so "
            "patch(model, ulysses_group=dist.group.WORLD) would silently become a single-process patch",
            fix="call torch.distributed.init_process_group(...) before patch(); for a single-process patch leave "
            "ulysses_group out")
    if group is not None and not (initialized and isinstance(group, dist.ProcessGroup)):
        raise PatchError(
            "ulysses_group is not a process group of an initialized torch.distributed",
            why=f"got {type(group).__name__}" + ("" if initialized else " and torch.distributed is not initialized"),
            supported="a torch.distributed.ProcessGroup (dist.group.WORLD, dist.new_group(ranks), "
            "device_mesh['sp'].get_group())",
            fix="init_process_group first, then pass the sequence-parallel group")
    return group


def _top_forward(original: Callable[..., Any], router: Router, boundaries_only: bool = False) -> Callable[..., Any]:
    """Wrap the bound forward of the model given to `patch` (when it is not the text model): decide packed or
    stock once for the whole call (`tfcompat.hf.forward`) and, on a packed row, make the loss per sequence
    (`tfcompat.core.labels`) and ask for no KV cache where ``use_cache`` is left unset. boundaries_only: a model
    that takes no position ids (Bloom, Mamba: their modules run per sequence): the position ids only mark the
    boundaries, and neither they nor the context are passed on (4.x Bloom refuses unknown kwargs); the text model's
    forward takes the context from `Router.pending`. A forward
    without ``**kwargs`` (4.x OpenLlama's) is handed none of the extra keywords: `tfcompat.pack`'s context reaches
    the text model through `Router.pending` alone."""
    sig = inspect.signature(original)
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        given = kwargs.pop(CONTEXT_KWARG, None) if var_kw is None else None
        a = sig.bind(*args, **kwargs).arguments
        extra = a.setdefault(var_kw, {}) if var_kw is not None else {CONTEXT_KWARG: given}
        ctx = extra.get(CONTEXT_KWARG)
        if ctx is None:
            router.check_key()
            router.check_vision({**extra, **a})
            ctx = extra[CONTEXT_KWARG] = router.decide({**extra, **a}, user_call=True)
        if isinstance(ctx, ForwardContext):
            _per_sequence_labels(a, extra, ctx, router)
            if "use_cache" in sig.parameters and a.get("use_cache") is None:
                # the text model builds no cache on a packed row: a model above that would start one and convert it
                # after (4.x Idefics2's legacy cache, when its config says use_cache) must not expect one
                a["use_cache"] = False
        if boundaries_only:
            extra.pop(CONTEXT_KWARG, None)
            extra.pop("position_ids", None)
        router.pending = ctx
        try:
            return original(**{k: v for k, v in a.items() if k != var_kw}, **(extra if var_kw is not None else {}))
        finally:
            router.pending = None

    return forward


def _per_sequence_labels(a: dict[str, Any], extra: dict[str, Any], ctx: ForwardContext, router: Router) -> None:
    """Labels of a packed row: ignored at each sequence start (``labels``) or end (``shift_labels``)."""
    tokens = a.get("inputs_embeds") if a.get("inputs_embeds") is not None else a.get("input_ids")
    ignore = extra.get("ignore_index", -100)
    r = router.r
    for name, where, fn in (("labels", a, mask_starts), ("shift_labels", extra, mask_ends)):
        labels = where.get(name)
        if labels is None:
            continue
        if ctx.group is not None and name == "labels":
            raise r.error(
                InvalidInputError, "labels passed to a sequence-parallel forward",
                why="each rank holds a slice of the packed row; transformers would shift the labels inside the slice",
                fix="compute the loss from tfcompat.ulysses.gather_outputs(out.logits, shard) and shard.labels "
                "(already shifted on the whole row), or pass shift_labels=shard.labels")
        if ctx.group is not None:
            continue  # shard.labels are shifted and masked on the whole row already
        if tokens is not None and tuple(labels.shape) != tuple(tokens.shape[:2]):
            raise r.error(InvalidInputError, f"{name} and the input tokens differ in shape",
                          why=f"{name} {tuple(labels.shape)}, tokens {tuple(tokens.shape[:2])}",
                          fix=f"pass one {name[:-1]} per token, (B, L) like input_ids")
        where[name] = fn(labels, ctx.seqs, ignore)


def _deepcopy(handle: PatchHandle) -> Callable[[dict], torch.nn.Module]:
    """The patched model's ``__deepcopy__``: copy it without the patch, then patch the copy with the same
    options (its own handle: ``tfcompat.patch(copy, **options)`` returns it)."""
    def deepcopy(memo: dict) -> torch.nn.Module:
        model = handle.model
        own: dict[str, Any] = {k: vars(model).pop(k) for k in ("__deepcopy__", "__reduce_ex__") if k in vars(model)}
        memo[id(handle)] = None
        try:
            clone = copy.deepcopy(model, memo)
        finally:
            vars(model).update(own)
        for rec in reversed(handle.records):
            target = memo.get(id(rec.target))
            if target is None or target is rec.target:
                continue
            if rec.scope == "hook":
                for hooks in (target._forward_pre_hooks, target._forward_pre_hooks_with_kwargs, target._forward_hooks,
                              target._forward_hooks_with_kwargs):
                    hooks.pop(rec.new.id, None)
            elif rec.scope == "config":
                setattr(target, rec.attr, rec.old)
            elif rec.was_set:
                setattr(target, rec.attr, copy.deepcopy(rec.old, memo))
            else:
                vars(target).pop(rec.attr, None)
        for module in clone.modules():
            vars(module).pop(BRIDGE_ATTR, None)
        patch(clone, **{k: v for k, v in handle.options.items() if k != "ulysses_group" or v is not None})
        return clone

    return deepcopy


def _refuse_pickle(handle: PatchHandle) -> Callable[[int], Any]:
    def reduce_ex(protocol: int) -> Any:
        raise PatchedModelError(
            f"cannot pickle a patched {type(handle.model).__name__} (torch.save(model), copy.copy)",
            family=handle.resolved.family, transformers_version=handle.resolved.transformers_version,
            why="tfcompat.patch replaced instance forwards and holds process-local state (the attention key, "
            "process groups); a pickle of them would not run in another process",
            fix="save the weights: torch.save(model.state_dict()) (the patch changes no parameter), or handle.undo() "
            "before pickling and patch again after loading; copy.deepcopy(model) works and gives a patched copy")

    return reduce_ex


@dataclass
class _Plan:
    configs: list[Any]
    text_models: list[torch.nn.Module]
    bridges: list[tuple[torch.nn.Module, torch.nn.Module]]
    linear: list[tuple[torch.nn.Module, Callable[..., torch.Tensor]]]
    features: list[tuple[torch.nn.Module, Any, str, tuple[float, float] | None]]
    mixers: hf_mixers.MixerPlan


def _plan(model: torch.nn.Module, r: Resolved, group: Any, linear_backend: str, backend: str,
          decoder: torch.nn.Module) -> _Plan:
    """Find what to change and check it can be changed, before changing anything. decoder: the module holding the
    text models and attention to patch (``model``; an encoder-decoder model's decoder: its encoder runs stock)."""
    entry = f"entry {r.entry.versions}"

    if group is not None and is_sequence_classifier(model):
        raise r.error(PatchError, f"{type(model).__name__} cannot run sequence parallel",
                      why="it pools one score per sequence from tokens that sit on other ranks", supported=entry,
                      fix="score packed rows without ulysses_group (tfcompat pools one score per sequence there)")
    text_models = [m for m in decoder.modules() if isinstance(m, r.text_model_cls)]
    derived = r.entry.derived
    why = derived.per_sequence_why if derived is not None else ""
    if not why and derived is not None and derived.per_sequence and derived.softmax_attention:
        why = _refused_features(decoder, r)  # a layer type the core cannot run: the layers run per sequence instead
    if why:
        if not text_models:
            raise r.error(PatchError, f"cannot patch {type(model).__name__}", supported=entry,
                          why=f"found no {r.text_model_cls.__name__}", fix="pass the model built by transformers for "
                          "this family")
        _check_positions_reach(model, r, entry)
        attr = positions_module_from_row(r.text_model_cls) if positions_from_row(r.text_model_cls) is None else None
        held = {type(getattr(tm, attr)) for tm in text_models} if attr is not None else set()
        if any(not takes_row_positions(cls) for cls in held):
            raise r.error(PatchError, f"{r.text_model_cls.__name__}.{attr} counts positions over the row",
                          why=f"it holds {', '.join(c.__name__ for c in held)}, which takes no position ids; the "
                          "decoder layers run per sequence, but their positions would run across sequences",
                          supported=entry, fix="build the model with the positions module that takes position ids "
                          "(TrOCR: use_learned_position_embeddings=True), or run it unpatched")
        return _Plan([], text_models, [], [], [], hf_mixers.plan_layers(model, r, group, why))
    # cross-attention of the self-attention's class (Bart's encoder_attn): called only with encoder states, which a
    # packed forward refuses; left to its stock function
    cross_ids = {id(getattr(layer, a, None)) for layer in decoder.modules() if isinstance(layer, r.decoder_layer_cls)
                 for a in (cross_attrs(r.decoder_layer_cls, r.attention_cls) if r.entry.derived is not None else ())}
    attentions = [m for m in decoder.modules() if isinstance(m, r.attention_cls) and id(m) not in cross_ids
                  and (derived is None or derived.softmax_attention)]
    linear_cls = r.classes.get("linear_attention")  # a hybrid family: its linear layers alone still need the patch
    linears = [m for m in decoder.modules() if linear_cls is not None and isinstance(m, linear_cls)]
    per_sequence = hf_mixers.mixer_classes(r)  # a derived hybrid: its per-sequence mixers alone still need the patch
    if not text_models or not (attentions or linears or any(isinstance(m, per_sequence) for m in model.modules())):
        mixers = " or ".join(c.__name__ for c in (r.attention_cls, linear_cls) if c is not None)
        raise r.error(PatchError, f"cannot patch {type(model).__name__}", supported=entry,
                      why=f"found {len(text_models)} {r.text_model_cls.__name__} and {len(attentions) + len(linears)} "
                      f"{mixers}", fix="pass the model built by transformers for this family")
    if group is not None and r.entry.derived is not None and own_positions(r.text_model_cls) is not None:
        raise r.error(PatchError, f"{r.text_model_cls.__name__} computes its own positions, under sequence parallelism",
                      why="its default positions count a sequence's tokens (skipping padding tokens); a rank holds "
                      "only a slice of each sequence", supported=entry, fix="patch without ulysses_group")
    cross_cls = r.classes.get("cross_attention")
    cross = [m for m in model.modules() if cross_cls is not None and isinstance(m, cross_cls)]
    if cross and r.entry.encoder_decoder is None:  # an encoder-decoder model's are marked (`hf_encoder_decoder`)
        raise r.error(PatchError, f"{type(model).__name__} holds cross-attention ({type(cross[0]).__name__})",
                      why="its keys and values come from encoder states, not from the packed row", supported=entry,
                      fix="build the model without cross-attention (add_cross_attention=False), or run it unpatched")
    if derived is not None and not derived.softmax_attention:  # mixers alone (Mamba): no kwargs needed either
        _check_positions_reach(model, r, entry)
    else:
        _check_text_kwargs(text_models, r, entry)
    configs: list[Any] = []
    features: list[tuple[torch.nn.Module, ModuleFeatures]] = []
    for attn in attentions:
        cfg: Any = attn.config  # a PretrainedConfig (torch types a Module attribute read `Tensor | Module`)
        if getattr(cfg, "attention_dropout", 0.0):
            raise r.error(PatchError, "attention dropout is not supported by the packed core",
                          why=f"config.attention_dropout = {cfg.attention_dropout}", fix="set attention_dropout=0.0",
                          supported=entry)
        found = module_features(attn, cfg, r.text_model_cls)
        if found.refusal:
            raise r.error(PatchError, f"{type(attn).__name__} (layer {getattr(attn, 'layer_idx', '?')}) does what the "
                          "packed core cannot", why=found.refusal, supported=entry,
                          fix="run the model unpatched, or build it without the feature")
        features.append((attn, found))
        if group is not None and found.temperature is not None:
            raise r.error(PatchError, f"{type(attn).__name__} (layer {getattr(attn, 'layer_idx', '?')}) scales its "
                          "queries by their row index (NoPE temperature tuning) under sequence parallelism",
                          why="each rank's stock forward counts the row index of its own slice; tfcompat rescales it "
                          "per sequence on a single process only", supported=entry,
                          fix="set config.attn_temperature_tuning=False, or patch without ulysses_group")
        if group is not None:
            import torch.distributed as dist

            try:
                check_heads(cfg.num_attention_heads, cfg.num_key_value_heads, dist.get_world_size(group),
                            family=r.family, transformers_version=r.transformers_version)
            except InvalidInputError as exc:
                raise r.error(PatchError, exc.what, why=exc.why, supported=exc.supported, fix=exc.fix) from None
        if all(cfg is not c for c in configs):
            configs.append(cfg)
    for attn, found in features:  # after every module's refusal: what no backend can do is named first
        gap = unsupported(backend, found.features, qk_dim=found.qk_dim, v_dim=found.v_dim)
        if gap:
            raise r.error(PatchError, f"attention backend {backend!r} cannot run {type(attn).__name__} ({found.note})",
                          why=gap, supported=entry, fix="pass backend='auto' (or 'sdpa')")
    for tm in text_models:
        if all(tm.config is not c for c in configs):
            configs.append(tm.config)
    bridges = []
    if not r.entry.layer_forwards_kwargs:  # the decoder layer (or a module below it) drops **kwargs
        for layer in (m for m in decoder.modules() if isinstance(m, r.decoder_layer_cls)):
            below = [c for c in layer.modules() if isinstance(c, r.attention_cls)]
            if not below and per_sequence:
                continue  # a hybrid's layer without attention (mixers, which `tfcompat.hf.mixers` bridges, or an MLP)
            if not below:
                raise r.error(PatchError, f"{type(layer).__name__} holds no {r.attention_cls.__name__}",
                              why="cannot bridge kwargs", supported=entry)
            bridges += [(layer, attn) for attn in below]
    linear = hf_linear_attention.plan(model, r, group, linear_backend, per_sequence)
    return _Plan(configs, text_models, bridges + linear.bridges, linear.forwards,
                 [(attn, found.features, found.note, found.temperature) for attn, found in features],
                 hf_mixers.plan(model, r, group))


def _check_text_kwargs(text_models: list[torch.nn.Module], r: Resolved, entry: str) -> None:
    for tm in text_models:
        params = inspect.signature(tm.forward).parameters.values()
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            raise r.error(PatchError, f"{type(tm).__name__}.forward takes no **kwargs",
                          why="boundaries cannot reach attention", supported=entry)


def _check_positions_reach(model: torch.nn.Module, r: Resolved, entry: str) -> None:
    """The model given to `patch` takes position ids (by name or in ``**kwargs``): the boundaries of a packed row
    whose modules run per sequence (the context reaches them from the text model's forward, `ROW_CONTEXT_ATTR`)."""
    params = inspect.signature(model.forward).parameters
    if "position_ids" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise r.error(PatchError, f"{type(model).__name__}.forward takes no position_ids (nor **kwargs)",
                      why="a packed row's boundaries come from its position ids", supported=entry,
                      fix="patch the text model, or run the model unpatched")


def _refused_features(model: torch.nn.Module, r: Resolved) -> str:
    """Why the packed core refuses the first attention module of ``model`` whose features it cannot run (a layer
    type other than softmax attention), "" where it runs them all; an encoder-decoder model's cross-attention
    (non-causal, `tfcompat.hf.encoder_decoder`) aside."""
    crossed = r.entry.encoder_decoder is not None
    cross = {id(getattr(layer, a, None)) for layer in model.modules() if isinstance(layer, r.decoder_layer_cls)
             for a in cross_attrs(r.decoder_layer_cls, r.attention_cls)} if crossed else set()
    for attn in (m for m in model.modules() if isinstance(m, r.attention_cls) and id(m) not in cross):
        found = module_features(attn, cast(Any, attn).config, r.text_model_cls)
        if found.refusal:
            return f"{type(attn).__name__} (layer {getattr(attn, 'layer_idx', '?')}): {found.refusal}"
    return ""


def _own_positions(module: torch.nn.Module, own: OwnPositions, tokens: torch.Tensor, seqs: PackedSeqs
                   ) -> torch.Tensor:
    """``(B, L)`` positions of packed ``tokens`` (ids ``(B, L)`` or embeddings ``(B, L, D)``) as ``module`` computes
    them by default for each sequence alone, with its own calls (`tfcompat.registry.derive.OwnPositions`)."""
    call = own.from_ids if not tokens.is_floating_point() else own.from_embeds
    function = getattr(module, call.function) if call.method else getattr(
        importlib.import_module(type(module).__module__), call.function)
    values = {"padding": cast(Any, module).padding_idx, "cache": 0}
    flat = tokens.reshape(-1, *tokens.shape[2:])  # (B, L[, D]) -> (B * L[, D])
    pieces = [function(*(piece[None] if role == "tokens" else values[role] for role in call.args))
              for piece in flat.split(list(seqs.lengths))]
    return torch.cat(pieces, dim=-1).view(tokens.shape[:2])  # N x (1, L_i) -> (B, L)


def _row_positions_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the module a text model hands the positions it counted over the row: on a packed
    forward, the packed row's own position ids (`_ROW_POSITIONS_ATTR`) instead."""
    positions = module.__dict__.get(_ROW_POSITIONS_ATTR)
    return None if positions is None else (args, {**kwargs, "position_ids": positions})


def _packed_text_forward(original: Callable[..., Any], r: Resolved, backend: Backend, group: Any, router: Router,
                         own: Callable[[torch.Tensor, PackedSeqs], torch.Tensor] | None = None,
                         row_module: torch.nn.Module | None = None,
                         per_sequence: list[torch.nn.Module] | None = None,
                         bridged: list[torch.nn.Module] | None = None) -> Callable[..., Any]:
    """Wrap the text model's bound forward: contract ids in, boundaries computed once, stock forward out.

    The path (packed or stock, `tfcompat.routing`) comes from the caller's context or is decided here. A packed
    row without a caller's context takes its boundaries from the text row (single process); under Ulysses the
    context comes from `tfcompat.ulysses.shard_inputs` (global boundaries) and must name the patch's group. A
    packed forward builds no KV cache (``use_cache=False``). An ordinary call runs the stock forward with the
    configs naming the pre-patch attention. own: the text model's own default positions per sequence (RoBERTa's,
    from its padding index), replacing the contract's 0, 1, ... (None: the contract's are the model's).
    row_module: where the text forward takes no position ids and counts them over the row (Bart's decoder), the
    module it hands them to: on a packed row it gets the row's position ids (`_row_positions_hook`), one row only.
    per_sequence: the text model's modules run per sequence (`tfcompat.hf.mixers`), handed the forward's context for
    the duration of the call (their forwards' kwargs may not carry it); a text model of such modules alone that takes
    no position ids (Mamba, Bloom) is not given them: they only mark the boundaries. bridged: the attention modules
    whose decoder layer's pre-hook hands them the context (`tfcompat.hf.mixers.bridge`), handed it as well: a text
    model that calls its layers without **kwargs under gradient checkpointing (Mllama's on transformers 4.53-4.54)
    gives them none.
    """
    sig = inspect.signature(original)
    takes_positions = "position_ids" in sig.parameters
    modules = per_sequence or []
    derived = r.entry.derived
    positionless = (bool(modules) and derived is not None and (bool(derived.per_sequence_why)
                                                               or not derived.softmax_attention)
                    and not takes_positions and row_module is None)

    holders = [*modules, *(bridged or [])]

    def call(ctx: Any, kwargs: dict[str, Any]) -> Any:
        for m in holders:
            m.__dict__[hf_mixers.ROW_CONTEXT_ATTR] = ctx
        if positionless:  # nor the context: 4.x Bloom refuses unknown kwargs; its modules take it from above
            kwargs.pop(CONTEXT_KWARG, None)
        try:
            return original(**(kwargs if var_kw is not None else {k: v for k, v in kwargs.items()
                                                                   if k in sig.parameters}))
        finally:
            for m in holders:
                m.__dict__.pop(hf_mixers.ROW_CONTEXT_ATTR, None)
    # None: a text model of per-sequence modules alone that takes no **kwargs (4.x Mamba, GPT-Neo): the context
    # reaches those modules from `call` only
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    offset = r.entry.derived_vision.position_offset if r.entry.derived_vision is not None else 0
    cross = r.entry.derived_vision.cross_states if r.entry.derived_vision is not None else None

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        a = sig.bind(*args, **kwargs).arguments
        extra = a.setdefault(var_kw, {}) if var_kw is not None else {}  # without: filtered out by `call`
        tokens = a.get("inputs_embeds")
        tokens = a.get("input_ids") if tokens is None else tokens
        ctx = extra.get(CONTEXT_KWARG)
        if not isinstance(ctx, StockContext):  # a StockContext: the model above switched to its stock attention
            router.check_key()
        if ctx is None:  # the model above may decide it and pass the text model no kwargs (MambaForCausalLM)
            ctx = router.pending or router.decide({**extra, **a}, user_call=True)
        router.last = ctx
        if isinstance(ctx, StockContext):
            return _stock(a, extra, ctx)
        if not takes_positions:  # given to the forward's **kwargs (Bart's decoder): handed to row_module below
            a["position_ids"] = extra.pop("position_ids", None)
        if not takes_positions and a.get("position_ids") is None and tokens is not None and ctx.group is None:
            # the model above took them and passes its text model none (MVP's, Mamba's causal LM): the contract's
            # (0, 1, ... per sequence, which `Router.decide` checked) from the boundaries it decided
            a["position_ids"] = torch.cat([torch.arange(n, device=tokens.device) for n in ctx.seqs.lengths]).view(
                tokens.shape[:2])  # (B L,) -> (B, L)
        if a.get("position_ids") is None or tokens is None:
            raise r.error(InvalidInputError, "a packed forward needs position_ids and input_ids (or inputs_embeds)",
                          why="position_ids is None" if tokens is not None else "no input tokens",
                          fix="pass position_ids: tfcompat.rope_index(model, ids, ...) per sequence, concatenated on "
                          "dim -1")
        positions = router.positions(a["position_ids"], tokens)  # the split `decide` made, where it made one
        rows = positions.mrope if a["position_ids"].ndim == 3 else None  # given M-RoPE rows, which the rope reads
        if ctx.group is not group:
            raise r.error(InvalidInputError, "the shard's group is not the group the model was patched with",
                          why=f"patched with {_describe(group)}, inputs sharded over {_describe(ctx.group)}",
                          fix="shard_inputs(..., group=g) with the same g as patch(model, ulysses_group=g)")
        for name, value in (*a.items(), *extra.items()):  # token types: the same tokens as the row (or the shard)
            if name.endswith("token_type_ids") and isinstance(value, torch.Tensor) \
                    and tuple(value.shape[:2]) != tuple(tokens.shape[:2]):
                raise r.error(InvalidInputError, f"{name} and the input tokens differ in shape",
                              why=f"{name} {tuple(value.shape)}, tokens {tuple(tokens.shape[:2])}",
                              fix=f"pass one {name} entry per input token; under Ulysses, shard_inputs(..., "
                              f"per_token={{'{name}': ...}}) slices the whole row's to this rank")
        extra[CONTEXT_KWARG] = ctx._replace(backend=backend)
        visual = extra.pop(VISUAL_KWARG, None)
        if visual is not None:
            _take_visual(a, visual, tokens.shape[:2])
        a["position_ids"] = to_text_model_layout(positions, r.entry.text_model_positions)
        if modules:  # a copy: 4.x XGLM adds its offset to the position ids in place (its stock call counts its own)
            a["position_ids"] = a["position_ids"].clone()
        if own is not None:  # the model's own default positions (RoBERTa's), per sequence
            a["position_ids"] = own(tokens, ctx.seqs)
        if offset:  # where the owner starts a sequence's row given none (PaliGemma's 1-indexed positions)
            a["position_ids"] = a["position_ids"] + offset
        router.check_rope_lengths(ctx.seqs, rows, offset)
        mask = a.get("attention_mask")
        # ctx.mask: a 4-D mask `Router.decide` found equal to the boundaries' block-diagonal causal mask
        if mask is not None and mask is not ctx.mask and not (isinstance(mask, torch.Tensor)
                                                               and mask.shape == tokens.shape[:2]):
            raise r.error(InvalidInputError, "a custom attention mask with packed inputs",
                          why=f"got {_mask_kind(mask)} with a tfcompat context; the packed forward attends within "
                          "the context's sequences and would ignore it",
                          fix="drop attention_mask (the boundaries come from the packed inputs), or call the model "
                          "without the tfcompat context (stock attention honours the mask)")
        crossed = next((n for n in ("encoder_hidden_states", "cross_attention_states")
                        if a.get(n) is not None or extra.get(n) is not None), None)
        if crossed is not None and cross is not None and crossed == cross.states and crossed in a:
            # images a derived owner hands its cross-attention layers: each token attends its own sequence's
            a[cross.mask] = hf_cross.per_sequence_mask(r, a.get(cross.mask), ctx, cross.mask)
        elif crossed == "encoder_hidden_states" and r.entry.encoder_decoder is not None:
            where = a if a.get(crossed) is not None else extra  # each sequence's own states, packed in one row
            where[crossed], packed = hf_encoder_decoder.pack_encoder_states(
                r, extra[CONTEXT_KWARG], tokens, where[crossed],
                a.get("encoder_attention_mask", extra.get("encoder_attention_mask")))
            extra[CONTEXT_KWARG] = ctx = packed
            for place in (a, extra):  # the boundaries replace the mask (a mask of the row would be (1, sum L_enc))
                if place.get("encoder_attention_mask") is not None:
                    place["encoder_attention_mask"] = None
        elif crossed is not None:  # (Mllama's cross-attention layers are skipped without them)
            raise r.error(InvalidInputError, f"{crossed} with packed inputs",
                          why="cross-attention to encoder states runs on padded batches only; the packed forward "
                          "attends within the packed sequences",
                          fix="call the model without packed position ids (the stock forward takes encoder states)")
        if "attention_mask" in a:
            a["attention_mask"] = None
        if "use_cache" in sig.parameters:  # a KV cache of a packed row is of no use to any later call
            a["use_cache"] = False
        if row_module is None:
            if not takes_positions and positionless:
                a.pop("position_ids")  # it takes none: they only marked the boundaries
            # keywords only: transformers' forward decorators re-inject defaults by name
            return call(ctx, {**{k: v for k, v in a.items() if k != var_kw}, **extra})
        positions = a.pop("position_ids")
        if positions.ndim != 2 or positions.shape[0] != 1:
            raise r.error(InvalidInputError, f"{r.family} takes one packed row at a time",
                          why=f"its text model counts positions over the row, for every row alike; got position ids "
                          f"{tuple(positions.shape)}", fix="pass one packed row (batch 1) per forward")
        row_module.__dict__[_ROW_POSITIONS_ATTR] = positions[0]  # (1, L) -> (L,), as the stock forward counts them
        try:
            return call(ctx, {**{k: v for k, v in a.items() if k != var_kw}, **extra})
        finally:
            row_module.__dict__.pop(_ROW_POSITIONS_ATTR, None)

    def _stock(a: dict[str, Any], extra: dict[str, Any], ctx: StockContext) -> Any:
        """An ordinary call: the stock forward, masks and attention of the pre-patch implementation."""
        extra[CONTEXT_KWARG] = ctx
        position_ids = a.get("position_ids")
        if isinstance(position_ids, torch.Tensor) and position_ids.ndim == 3 and position_ids.shape[0] == \
                router.axes + 1:
            positions = split_positions(position_ids, seq_len=position_ids.shape[-1], family=r.family,
                                        axes=router.axes)
            a["position_ids"] = to_text_model_layout(positions, r.entry.text_model_positions)
        visual = extra.pop(VISUAL_KWARG, None)
        if visual is not None:
            tokens = a.get("inputs_embeds") if a.get("inputs_embeds") is not None else a.get("input_ids")
            _take_visual(a, visual, cast(torch.Tensor, tokens).shape[:2])  # embed_inputs gives inputs_embeds
        with router.stock_attention():
            return call(ctx, {**{k: v for k, v in a.items() if k != var_kw}, **extra})

    def _take_visual(a: dict[str, Any], visual: Any, shape: torch.Size) -> None:
        """Hand `tfcompat.embed_inputs`' DeepStack extras to the stock text model's own parameters."""
        derived = r.entry.derived_vision.visual_extras if r.entry.derived_vision is not None else ()
        names = ("visual_pos_masks", "deepstack_visual_embeds") if r.entry.vision is not None and (
            r.entry.vision.deepstack) else derived
        if not names or not isinstance(visual, VisualExtras):
            raise r.error(InvalidInputError, f"{r.family}'s text model takes no visual extras",
                          why=f"got {type(visual).__name__}", fix="pass **tfcompat.embed_inputs(...).model_inputs() "
                          "of this model")
        if any(a.get(n) is not None for n in names):
            raise r.error(InvalidInputError, "visual extras given twice",
                          why=f"the forward also got {' / '.join(names)}",
                          fix="pass either pixel values or the embed_inputs result, not both")
        if tuple(visual.visual_pos_masks.shape) != tuple(shape):
            raise r.error(InvalidInputError, "the visual extras do not match the input tokens",
                          why=f"visual_pos_masks {tuple(visual.visual_pos_masks.shape)}, tokens {tuple(shape)}",
                          fix="shard the embed_inputs result with tfcompat.ulysses.shard_inputs(inputs_embeds=...)")
        a[names[0]], a[names[1]] = visual.visual_pos_masks, list(visual.deepstack_visual_embeds)

    return forward


def _mask_kind(mask: object) -> str:
    if isinstance(mask, torch.Tensor):
        return f"a {mask.ndim}-D attention_mask {tuple(mask.shape)}"
    return f"an attention_mask of type {type(mask).__name__}"


def _describe(group: Any) -> str:
    if group is None:
        return "no group (single process)"
    import torch.distributed as dist

    return f"a group of {dist.get_world_size(group)} ranks"
