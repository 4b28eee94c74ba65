"""verl's model-patch entry point, on tfcompat: ``apply_monkey_patch`` with verl's arguments and meaning.

verl's FSDP workers build the Hugging Face model, call
``verl.models.transformers.monkey_patch.apply_monkey_patch(model, ulysses_sp_size=..., use_remove_padding=...,
use_fused_kernels=..., fused_kernels_backend=...)`` once, then run it with verl's Ulysses group set (its
``FSDPUlyssesShardingManager``, or ``set_ulysses_sequence_parallel_group``). Changing that one import to
``from tfcompat.integrations.verl import apply_monkey_patch`` keeps the actor's code as it is; inside, the model
runs on tfcompat's registry, varlen core and PPO heads, on every transformers release tfcompat supports.

What verl's actor passes, and what this forward takes (verl 0.6.0 to 0.9.1: ``dp_actor._forward_micro_batch`` in
0.6-0.7, ``FSDPEngineWithLMHead.prepare_model_inputs`` in 0.8-0.9):

- ``input_ids`` ``(1, T')``: one remove-padding row, the micro-batch's sequences back to back;
  ``position_ids`` ``(1, T')`` for text models, ``(4, 1, T')`` ``[text; t; h; w]`` for VLMs (verl's rope index,
  each sequence's text row from 0); ``attention_mask=None``; ``use_cache=False``.
- sequence parallelism (sp > 1): ``ulysses_pad`` rounds the row up to ``T'`` (a multiple of sp; pad ids 0,
  pad positions ``0..pad-1``). Text models get this rank's slice ``(1, T'/sp)`` of both
  (``ulysses_pad_and_slice_inputs``); VLMs (``hasattr(config, "vision_config")``, verl's test) get the whole
  padded row, sliced after embedding so whole images go through the vision tower.
- VLMs: ``pixel_values``, ``image_grid_thw`` (and ``pixel_values_videos``, ``video_grid_thw``) of the micro-batch;
  a derived vision-language family (LLaVA, InternVL, PaddleOCR-VL, ...: `tfcompat.registry.derive_vision`) its own
  forward's vision inputs by name (``pixel_values``, ``image_sizes``, ...), as its processor returns them for the
  micro-batch, with position ids ``(1, T')`` or, where it numbers M-RoPE itself, the contract's ``(4, 1, T')``
  (`tfcompat.rope_index` / `tfcompat.pack` give them).
- fused kernels: ``temperature`` (a float), ``return_dict=True``, and in 0.8+ ``shift_labels`` ``(1, T'/sp)``,
  the input ids rolled by one on the global row and sliced. Without it (0.6-0.7) they are computed here by
  rolling the global padded row (verl itself rolls the local shard there, its issue #6068); they differ from
  verl's only at the row's last real token (the pad id instead of the row's first id), a position verl never
  reads (it keeps the log-probs that predict response tokens).

It returns this rank's tokens: the model output with ``logits`` ``(1, T'/sp, V)``, or with fused kernels a
`FusedOutput` with ``log_probs`` and ``entropy`` ``(1, T'/sp)`` float32 and no logits; verl divides logits by the
temperature and gathers with ``gather_outputs_and_unpad`` itself. The packed boundaries come from the global text
row once per forward (text models: one all-gather of the local ids and positions; verl gathers position ids in
every layer). Not covered: verl <= 0.5 (3-row VLM position ids without a text row: rejected, their boundaries are
ambiguous), padded batches (``use_remove_padding=False``), value-model (critic) heads, prefix grouper, tiled MLP.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

import torch
import torch.distributed as dist

from ..core.a2a import check_heads
from ..errors import InvalidInputError, PatchError
from ..heads import model_logprobs
from ..hf.patching import PatchHandle, patch
from ..inputs.derived_vision import is_derived_vision
from ..inputs.embedding import embed_inputs
from ..registry import resolve
from ..ulysses import shard_inputs

__all__ = ["FUSED_BACKENDS", "FusedOutput", "VerlPatch", "apply_monkey_patch"]

FUSED_BACKENDS = ("torch", "triton", "liger")  # verl's names; each runs tfcompat.heads with its backend "auto"
VERL_ULYSSES = "verl.utils.ulysses"
_ATTR = "_tfcompat_verl"
# vision keys the forward consumes; the rope-index inputs verl's processor already turned into position ids, and the
# MoE routing ids `embed_inputs` rebuilds from the token ids (ERNIE-4.5-VL's)
_VISION = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
_REBUILT = ("second_per_grid_ts", "mm_token_type_ids", "moe_mm_token_type_ids")


@dataclass(frozen=True)
class FusedOutput:
    """What verl's actor reads with fused kernels; no ``(T, V)`` logits are materialized.

    log_probs: ``(1, T/sp)`` float32, ``log softmax(logits / temperature)[label]`` of this rank's tokens.
    entropy: ``(1, T/sp)`` float32 entropy of ``softmax(logits / temperature)`` (verl's own kernel returns it
    in the hidden dtype).
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor
    logits: None = None


def apply_monkey_patch(
    model: torch.nn.Module,
    ulysses_sp_size: int = 1,
    use_remove_padding: bool = True,
    use_fused_kernels: bool = False,
    fused_kernels_backend: str | None = None,
    *,
    keep_logits: bool = False,
    vision_attention: bool = False,
) -> VerlPatch:
    """Patch ``model`` (this instance only) to take verl's remove-padding inputs; returns a `VerlPatch`.

    ulysses_sp_size: verl's Ulysses size; at every forward, verl's group
        (``verl.utils.ulysses.get_ulysses_sequence_parallel_group()``, read then) must have this many ranks.
    use_remove_padding: must be True (tfcompat's path is the packed one).
    use_fused_kernels: return log-probs and entropy (`FusedOutput`) instead of logits.
    fused_kernels_backend: ``"torch"``, ``"triton"`` or ``"liger"`` (verl's names; each runs `tfcompat.heads`,
        backend ``"auto"``: never the ``(T, V)`` logits).
    keep_logits: tfcompat's own option (verl has none): with fused kernels, the head keeps its forward's ``(T, V)``
        logits for the backward instead of recomputing them (`tfcompat.heads.model_logprobs`): three lm-head
        matmuls instead of four, for ``2 * T * V`` bytes in bf16.
    vision_attention: tfcompat's own option too: the vision tower's attention as one varlen call per block
        (`tfcompat.patch`'s ``vision_attention``), for a model verl built without the flash-attn 2 package, whose
        tower otherwise calls SDPA once per image or window.

    Everything that cannot apply raises here: unknown family or release, verl not importable while
    ``ulysses_sp_size > 1``, a fused backend verl would skip, heads not divisible by ``ulysses_sp_size``
    (`PatchError`, as `tfcompat.patch`).
    Calling it again with the same arguments returns the same `VerlPatch`.
    """
    options = {"ulysses_sp_size": ulysses_sp_size, "use_remove_padding": use_remove_padding,
               "use_fused_kernels": use_fused_kernels, "fused_kernels_backend": fused_kernels_backend,
               "keep_logits": keep_logits, "vision_attention": vision_attention}
    existing = vars(model).get(_ATTR)
    if existing is not None and existing.active:
        if existing.options != options:
            raise PatchError("model is already patched for verl with other options",
                             why=f"patched with {existing.options}, asked for {options}",
                             fix="undo() the first VerlPatch before patching again")
        return existing
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family is None:
        raise PatchError("model has no config.model_type", why=f"got {type(model).__name__}",
                         fix="pass the transformers model verl's worker built")
    r = resolve(family)
    if not use_remove_padding:
        raise r.error(PatchError, "tfcompat's verl patch takes remove-padding batches only",
                      why="use_remove_padding=False",
                      fix="set actor_rollout_ref.model.use_remove_padding=True (verl's default)")
    if isinstance(ulysses_sp_size, bool) or not isinstance(ulysses_sp_size, int) or ulysses_sp_size < 1:
        raise r.error(PatchError, "ulysses_sp_size must be a positive int", why=f"got {ulysses_sp_size!r}",
                      fix="pass verl's Ulysses size")
    if use_fused_kernels and fused_kernels_backend not in FUSED_BACKENDS:
        raise r.error(PatchError, f"unknown fused_kernels_backend {fused_kernels_backend!r}",
                      why="verl's own patch would skip the fused forward, and its actor would then find no log_probs",
                      fix="set model.fused_kernel_options.impl_backend=torch", supported=", ".join(FUSED_BACKENDS))
    if keep_logits and not use_fused_kernels:
        raise r.error(PatchError, "keep_logits=True keeps the fused head's logits, and use_fused_kernels=False",
                      why="without fused kernels the model returns its logits and tfcompat runs no head",
                      fix="patch with use_fused_kernels=True, or drop keep_logits")
    text = cast(Any, model.config).get_text_config()
    try:
        check_heads(text.num_attention_heads, text.num_key_value_heads, ulysses_sp_size)
    except InvalidInputError as exc:
        raise r.error(PatchError, exc.what, why=exc.why, supported=exc.supported, fix=exc.fix) from None
    if ulysses_sp_size > 1:
        _verl_ulysses(r.family, r.transformers_version)  # fail now, not in the first forward
    vp = VerlPatch(model, options, patch(model, remove_padding=True, vision_attention=vision_attention))
    model.__dict__[_ATTR] = vp
    return vp


class VerlPatch:
    """The result of `apply_monkey_patch`: the model's verl-convention forward over a tfcompat patch.

    The tfcompat patch (`handle`) follows verl's Ulysses group: it is redone with the group that verl has set
    when a forward finds another one (in practice once, at the first forward inside verl's sharding manager).
    """

    def __init__(self, model: torch.nn.Module, options: dict[str, Any], handle: PatchHandle) -> None:
        self.model = model
        self.options = options
        self.active = True
        self._vlm = hasattr(model.config, "vision_config")
        self._derived = is_derived_vision(handle.resolved)
        self._install(handle)

    def _install(self, handle: PatchHandle) -> None:
        """Put the verl forward over the model's forward as ``handle`` left it (tfcompat's, or the stock one)."""
        self.handle = handle
        self._inner = vars(self.model).get("forward")  # the instance forward the tfcompat patch set, if any
        self._original: Callable[..., Any] = self.model.forward
        self.model.forward = self._forward

    def _uninstall(self) -> None:
        """Take the verl forward off, then undo the tfcompat patch (which restores what was there before it)."""
        if self._inner is None:
            del self.model.forward
        else:
            self.model.forward = self._inner
        self.handle.undo()

    def undo(self) -> None:
        """Restore the model's forward and undo the tfcompat patch. Idempotent."""
        if not self.active:
            return
        self._uninstall()
        del self.model.__dict__[_ATTR]
        self.active = False

    def __enter__(self) -> VerlPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()

    def explain(self) -> str:
        mode = "log_probs/entropy (tfcompat heads)" if self.options["use_fused_kernels"] else "logits"
        inputs = ("VLM: whole padded row, embedded then sliced here" if self._vlm
                  else "text model: this rank's slice, boundaries from one all-gather")
        head = (f"verl apply_monkey_patch of {type(self.model).__name__} ({'active' if self.active else 'undone'}), "
                f"options {self.options}; returns {mode}; inputs: {inputs}")
        return "\n".join([head, self.handle.explain()])

    def _group(self) -> dist.ProcessGroup | None:
        """verl's current Ulysses group (None for one rank), checked against ``ulysses_sp_size``."""
        r, sp = self.handle.resolved, self.options["ulysses_sp_size"]
        module = sys.modules.get(VERL_ULYSSES) if sp == 1 else _verl_ulysses(r.family, r.transformers_version)
        group = module.get_ulysses_sequence_parallel_group() if module is not None else None
        size = dist.get_world_size(group) if group is not None else 1
        if size != sp:
            raise r.error(
                InvalidInputError,
                f"verl's Ulysses group has {size} rank(s), apply_monkey_patch was given ulysses_sp_size={sp}",
                why="verl sets the group in FSDPUlyssesShardingManager; the inputs are sliced for its size",
                fix="run the forward inside verl's sharding manager (or set_ulysses_sequence_parallel_group) with "
                "a group of ulysses_sp_size ranks",
            )
        return group if size > 1 else None

    def _follow(self, group: dist.ProcessGroup | None) -> None:
        if self.handle.options["ulysses_group"] is not group:
            self._uninstall()
            self._install(patch(self.model, remove_padding=True, ulysses_group=group,
                                vision_attention=self.options["vision_attention"]))

    def _forward(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        temperature: float | None = None,
        shift_labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """verl's call: see the module docstring for the shapes. Returns logits or a `FusedOutput` of this rank."""
        r = self.handle.resolved
        fused = self.options["use_fused_kernels"]

        # a derived vision-language family takes its own forward's vision inputs by name (embed_inputs checks them)
        names = [k for k in kwargs if k not in _REBUILT] if self._derived else _VISION
        vision = {k: kwargs.pop(k) for k in names if kwargs.get(k) is not None}
        unexpected = sorted(set(kwargs) - set(_REBUILT))
        if unexpected:
            raise r.error(InvalidInputError, f"unexpected arguments {unexpected}",
                          why="verl's remove-padding actor passes input_ids, position_ids, the multi-modal inputs "
                          "and, with fused kernels, temperature and shift_labels")
        if input_ids is None or position_ids is None:
            raise r.error(InvalidInputError, "verl's forward takes input_ids and position_ids",
                          why="one of them is None",
                          fix="pass the remove-padding row and its position ids, as verl's actor does")
        if attention_mask is not None:
            raise r.error(InvalidInputError, "a remove-padding row takes attention_mask=None",
                          why="got an attention mask", fix="pass verl's remove-padding inputs (attention_mask=None)")
        if not fused and (temperature is not None or shift_labels is not None):
            raise r.error(InvalidInputError, "temperature and shift_labels are fused-kernel arguments",
                          why="apply_monkey_patch was called with use_fused_kernels=False",
                          fix="scale the logits yourself (verl does), or patch with use_fused_kernels=True")
        if vision and not self._vlm:
            raise r.error(InvalidInputError, f"{sorted(vision)} given to a text model",
                          why=f"{type(self.model).__name__} has no vision tower")
        group = self._group()
        self._follow(group)

        ids = input_ids
        if self._vlm:
            embeds = embed_inputs(self.model, input_ids, **vision)  # (1, T', H) and extras: whole images first
            if group is None:
                inputs: dict[str, Any] = {**embeds.model_inputs(), "position_ids": position_ids}
            else:
                shard = shard_inputs(position_ids=position_ids, inputs_embeds=embeds, group=group)
                inputs = shard.model_inputs
        elif group is None:
            inputs = {"input_ids": input_ids, "position_ids": position_ids}
        else:
            ids, positions = _gather_row(input_ids, position_ids, group)
            shard = shard_inputs(ids, positions, group=group)
            inputs = shard.model_inputs
        local = inputs["position_ids"].shape[-1]
        if not fused:
            extra = {} if return_dict is None else {"return_dict": return_dict}
            return self._original(**inputs, use_cache=False, **extra)

        if shift_labels is None:  # verl 0.6-0.7: the ids rolled by one on the global row, this rank's slice
            rolled = torch.roll(ids, shifts=-1, dims=-1)  # (1, T')
            shift_labels = rolled if group is None else rolled[:, shard.local_slice]
        if shift_labels.shape != (1, local):
            raise r.error(InvalidInputError, "shift_labels must be this rank's (1, T/sp) slice of the rolled ids",
                          why=f"got {tuple(shift_labels.shape)} for {local} local tokens")
        out = model_logprobs(self.model, shift_labels, 1.0 if temperature is None else temperature,
                             keep_logits=self.options["keep_logits"], **inputs, use_cache=False)
        return FusedOutput(out.logprobs, out.entropy)


def _gather_row(input_ids: torch.Tensor, position_ids: torch.Tensor,
                group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole padded row from every rank's slice: ids ``(1, T')`` and position ids ``(..., T')``.

    input_ids ``(1, T'/sp)``; position_ids ``(1, T'/sp)`` or ``(4, 1, T'/sp)``. One all-gather (integers, no
    autograd): the ids for the global label roll, the text row for the boundaries.
    """
    n = input_ids.shape[-1]
    if input_ids.shape[0] != 1 or position_ids.shape[-1] != n or position_ids.shape[-2] != 1:
        raise InvalidInputError("verl's Ulysses slice is one row", why=f"input_ids {tuple(input_ids.shape)}, "
                                f"position_ids {tuple(position_ids.shape)}",
                                fix="pass the output of verl's ulysses_pad_and_slice_inputs")
    rows = torch.cat([input_ids, position_ids.reshape(-1, n).to(input_ids.dtype)])  # (1 + P, T'/sp)
    parts = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, rows, group=group)
    full = torch.cat(parts, dim=-1)  # (1 + P, T')
    return full[:1], full[1:].reshape(*position_ids.shape[:-1], -1).to(position_ids.dtype)


def _verl_ulysses(family: str, version: str) -> ModuleType:
    """``verl.utils.ulysses`` (already imported by verl's worker; imported here otherwise)."""
    module = sys.modules.get(VERL_ULYSSES)
    if module is not None:
        return module
    try:
        return importlib.import_module(VERL_ULYSSES)
    except ImportError as exc:
        raise PatchError("verl is not importable, and ulysses_sp_size > 1 reads verl's Ulysses group",
                         family=family, transformers_version=version, why=str(exc),
                         fix="pip install verl (or use tfcompat.ulysses directly)") from None
