"""A vision (or audio) tower's attention over its packed patches through tfcompat's varlen backends:
``patch(model, vision_attention=True)``.

transformers 5.x's vision towers that hold the patches of all images of a forward in one stream (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, GLM-4V, Pixtral, ...) split it at boundaries ``cu_seqlens``: one per image, or per window
of Qwen2.5-VL's window attention. They hand those boundaries to the attention function only where the tower's
implementation holds "flash" in its name (``transformers.utils.generic.is_flash_attention_requested``); under any
other implementation the attention syncs the host (``lengths.tolist()``) and calls the function once per image or
window: hundreds of calls per block for Qwen2.5-VL's 8 x 8 windows. `VISION_KEY` is registered under such a name,
so the tower hands it the boundaries, and it runs one varlen call per block on the patch's backend
(`tfcompat.core.cross_attention`: flash-attn, torch's ``varlen_attn``, or SDPA per image / window where neither
runs), needing no flash-attn package. A tower whose attention is causal (``is_causal=True``) runs the causal core.

`plan` finds, at ``patch()`` time, the towers that route that way: the configs (not the text model's) of modules
whose forward both asks ``is_flash_attention_requested`` and passes ``cu_seq_lens_q``. Their ``_attn_implementation``
becomes `VISION_KEY` and their modules carry `BACKEND_ATTR` (undone with the patch). The boundaries become a
`PackedSeqs` once per forward per ``cu_seqlens`` tensor (one host sync each, cached weakly on the tensor: every
block and the checkpointing recompute reuse it), not once per block.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, cast

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ..core.attention import AttentionFeatures, unsupported, varlen_attention
from ..core.cross_attention import cross_attention
from ..core.packing import PackedSeqs
from ..errors import PatchedModelError, PatchError
from ..registry import Resolved
from .attention import HARMLESS_KWARGS, names_read

__all__ = ["BACKEND_ATTR", "VISION_KEY", "plan", "towers", "vision_attention"]

# "flash" in the name: transformers hands a tower's boundaries only to such implementations (module docstring)
VISION_KEY = "tfcompat_flash_varlen"
BACKEND_ATTR = "_tfcompat_vision_backend"  # on each module of a routed tower: the patch's attention backend
# what a tower's forward holds where it hands its boundaries to a flash implementation
_ROUTE = ("is_flash_attention_requested", "cu_seq_lens_q")
# kwargs a tower passes that change nothing here: the text adapter's, and the causality read below
_HARMLESS = HARMLESS_KWARGS | {"is_causal"}


def plan(model: torch.nn.Module, text_configs: list[Any], resolved: Resolved, backend: str = "auto"
         ) -> list[tuple[Any, list[torch.nn.Module]]]:
    """The towers of ``model`` whose attention `VISION_KEY` can run: ``(config, its modules)`` per tower config
    outside ``text_configs``. `PatchError` where there is none (a text model, or a release whose towers hand their
    boundaries to ``"flash_attention_2"`` alone, as 4.x's), a tower has attention dropout, or an explicit
    ``backend`` cannot run a tower's head dim (FlashAttention-4 on Hopper at 80: `unsupported`)."""
    found = towers(model, text_configs)
    if not found:
        raise resolved.error(
            PatchError, f"no tower of {type(model).__name__} hands its attention boundaries to a varlen function",
            why="vision_attention=True routes a tower whose attention passes cu_seq_lens_q where its implementation "
            "is named like flash attention (transformers.utils.generic.is_flash_attention_requested); "
            + ("no module here does" if _flash_named() else "this transformers has no such rule"),
            supported="the vision and audio towers of transformers 5.x that split their patches at cu_seqlens "
            "(Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, Pixtral, ...)", fix="patch without vision_attention")
    for config, modules in found:
        dropout = max((float(getattr(m, "attention_dropout", 0.0) or 0.0) for m in modules), default=0.0)
        if dropout:
            raise resolved.error(
                PatchError, f"the tower of {type(config).__name__} has attention dropout {dropout}",
                why="tfcompat's varlen attention has no dropout (it would be silently skipped in training)",
                supported="attention_dropout=0.0", fix="set the tower config's attention_dropout to 0.0, or patch "
                "without vision_attention")
        for dim in sorted({d for m in modules if isinstance(d := getattr(m, "head_dim", None), int)}):
            gap = "" if backend == "auto" else unsupported(backend, AttentionFeatures(), qk_dim=dim, v_dim=dim)
            if gap:
                raise resolved.error(
                    PatchError, f"attention backend {backend!r} cannot run the tower of {type(config).__name__} "
                    f"(head dim {dim})", why=gap, supported="backend='auto' takes the next backend per call",
                    fix="pass backend='auto', or patch without vision_attention")
    return found


def towers(model: torch.nn.Module, text_configs: list[Any]) -> list[tuple[Any, list[torch.nn.Module]]]:
    """``(config, its modules)`` for each config of ``model`` outside ``text_configs`` (the text model's) that a
    routing module uses (`_ROUTE` in its forward); none where this transformers routes by no flash name."""
    if not _flash_named():
        return []
    by_config: dict[int, tuple[Any, list[torch.nn.Module]]] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "_attn_implementation") or any(config is c for c in text_configs):
            continue
        by_config.setdefault(id(config), (config, []))[1].append(module)
    return [(config, modules) for config, modules in by_config.values()
            if any(_routes(cast(Any, type(m))) for m in modules)]


def _flash_named() -> bool:
    """Whether this transformers routes boundaries by a "flash" name, and `VISION_KEY` is such a name."""
    generic = importlib.import_module("transformers.utils.generic")
    asks = getattr(generic, "is_flash_attention_requested", None)
    return asks is not None and bool(asks(requested_attention_implementation=VISION_KEY))


@functools.cache
def _routes(cls: Any) -> bool:
    """Whether ``cls.forward`` (a module class's) hands boundaries to a flash-named implementation (`_ROUTE`)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return all(name in source for name in _ROUTE)


def vision_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature for a routed tower.

    query: ``(1, Hq, T, Dqk)``; key: ``(1, Hkv, T, Dqk)``; value: ``(1, Hkv, T, Dv)``, the patches of every image of
    the forward; ``cu_seq_lens_q`` / ``cu_seq_lens_k``: ``(N + 1,)`` boundaries of its images or windows. Returns
    ``(1, T, Hq, Dv)`` and no weights. `PatchedModelError` for a call this cannot run exactly: no boundaries, a
    mask, dropout, or a kwarg it does not know.
    """
    def refuse(what: str, why: str) -> PatchedModelError:
        return PatchedModelError(f"{type(module).__name__} {what}", why=why,
                                 fix="undo() the patch and patch without vision_attention, and report the model type "
                                 "to tfcompat")

    backend = module.__dict__.get(BACKEND_ATTR)
    if backend is None:
        raise refuse("runs tfcompat's vision attention, but patch() did not route it",
                     why=f"its config names {VISION_KEY!r} but the module was not among the patched tower's")
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k", kwargs.get("cu_seq_lens_q"))
    if not isinstance(cu_q, torch.Tensor) or not isinstance(cu_k, torch.Tensor):
        raise refuse("called the vision attention without boundaries (cu_seq_lens_q)",
                     why="a routed tower hands them to flash-named implementations; this call took another path")
    if attention_mask is not None or dropout:
        raise refuse(f"passed {'an attention mask' if attention_mask is not None else f'dropout {dropout}'} to the "
                     "vision attention", why="the varlen path has no mask (the boundaries are the mask) and no dropout")
    unknown = sorted(n for n in kwargs.keys() - _HARMLESS if kwargs[n] is not None)
    if unknown:  # one no stock implementation reads changes no stock result (`tfcompat.hf.attention.names_read`)
        read = names_read(type(module).__module__)
        unknown = [n for n in unknown if read is None or n in read]
    if unknown or query.shape[0] != 1:
        raise refuse(f"passed {', '.join(unknown) or f'a batch of {query.shape[0]} rows'} to the vision attention",
                     why="it could change the result, and the varlen path does not implement it")
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
    q_seqs = _seqs(cu_q, kwargs.get("max_length_q"))
    k_seqs = q_seqs if cu_k is cu_q else _seqs(cu_k, kwargs.get("max_length_k"))
    # (1, H, T, D) -> (T, H, D)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if causal:
        if k_seqs.lengths != q_seqs.lengths:
            raise refuse("asked for causal attention between different boundaries",
                         why="causal attention runs within each sequence of one stream")
        out = varlen_attention(q, k, v, q_seqs, scale=scaling, backend=backend)
    else:
        out = cross_attention(q, k, v, q_seqs, k_seqs, scale=scaling, backend=backend)
    return out[None], None  # (T, Hq, Dv) -> (1, T, Hq, Dv)


_seqs_of = WeakTensorKeyDictionary()  # a forward's cu_seqlens tensor -> its PackedSeqs


def _seqs(cu: torch.Tensor, max_length: Any) -> PackedSeqs:
    """The `PackedSeqs` of boundaries ``cu`` ``(N + 1,)``: one host sync per tensor, cached on it."""
    seqs = _seqs_of.get(cu)
    if seqs is None:
        lengths = tuple(int(n) for n in (cu[1:] - cu[:-1]).tolist())
        cu32 = cu if cu.dtype == torch.int32 else cu.to(torch.int32)
        longest = int(max_length) if isinstance(max_length, int) else max(lengths, default=0)
        seqs = _seqs_of[cu] = PackedSeqs(cu32, longest, lengths)
    return seqs
