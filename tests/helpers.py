"""Test helpers: one assert_close with explicit tolerances, per-token comparison of packed outputs, and the tests'
own packing of `tfcompat.selfcheck.Sequence` samples (`pack`, `packed_inputs`), and a CPU model of the memory a
step holds (`LiveBytes`)."""

from __future__ import annotations

import weakref
from typing import Any, cast

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import tfcompat
from tfcompat.selfcheck import Sequence


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float = 0.0,
                 what: str = "") -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def max_token_diff(packed: torch.Tensor, per_sequence: list[torch.Tensor]) -> float:
    """Max abs difference between ``packed (T, ...)`` and the concatenated per-sequence ``(L_i, ...)``."""
    chunks = packed.split([p.shape[0] for p in per_sequence])
    assert sum(p.shape[0] for p in per_sequence) == packed.shape[0]
    return max(float((c - p).abs().max()) for c, p in zip(chunks, per_sequence))


def skip_if_stock_rejects_videos(family: str, items: list) -> None:
    """Skip when the stock forward of the installed release cannot be the oracle for these vision items."""
    import pytest

    entry = tfcompat.resolve(family).entry
    has_video = any(isinstance(i, tuple) and i and i[0] == "video" for i in items)
    if has_video and "videos_rejected" in entry.known_issues:
        pytest.skip(f"transformers {entry.versions} {family}: the stock forward rejects every video (known issue)")


def positions(model: torch.nn.Module, seq: Sequence) -> torch.Tensor:
    """Contract position ids of one sequence: ``(4, 1, L)`` for M-RoPE families, ``(1, L)`` otherwise."""
    if tfcompat.resolve(cast(Any, model.config).model_type).entry.vision is not None:
        return tfcompat.rope_index(model, seq.input_ids, image_grid_thw=seq.image_grid_thw,
                                   video_grid_thw=seq.video_grid_thw)
    return torch.arange(seq.input_ids.shape[1])[None]


def pack(model: torch.nn.Module, seqs: list[Sequence]) -> dict[str, Any]:
    """The tests' own packing, independent of `tfcompat.pack` (no labels, no context: the patched forward finds the
    boundaries itself). Packed inputs: ids ``(1, T)``, position ids ``(4, 1, T)`` (per-sequence rope_index,
    concatenated), and every sequence's vision inputs concatenated in order."""
    inputs: dict[str, Any] = {
        "input_ids": torch.cat([s.input_ids for s in seqs], dim=1),
        "position_ids": torch.cat([positions(model, s) for s in seqs], dim=-1),
    }
    for name in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        parts = [getattr(s, name) for s in seqs if getattr(s, name) is not None]
        if parts:
            inputs[name] = torch.cat(parts)
    moe = tfcompat.registry.family(cast(Any, model.config).model_type).moe_token_types
    if moe is not None:  # per token: ERNIE-4.5-VL's text/vision experts
        inputs["moe_mm_token_type_ids"] = moe(model.config, inputs["input_ids"])
    return inputs


def packed_inputs(model: torch.nn.Module, seqs: list[Sequence]) -> dict[str, Any]:
    """The patched model's inputs for ``seqs`` in one row: `pack`'s, except where the installed stock forward
    rejects images and videos in one forward (known issue ``images_with_videos_rejected``: GLM counts both with
    the image token) and the row holds both; then `tfcompat.embed_inputs` embeds them (the route such batches
    take) and ``input_ids`` and the pixels give way to its ``inputs_embeds``."""
    inputs = pack(model, seqs)
    mixed = "pixel_values" in inputs and "pixel_values_videos" in inputs
    issues = tfcompat.resolve(cast(Any, model.config).model_type).entry.known_issues
    if not mixed or "images_with_videos_rejected" not in issues:
        return inputs
    vision = {k: inputs.pop(k) for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
    embedded = tfcompat.embed_inputs(model, inputs.pop("input_ids"), **vision)
    return {**inputs, **embedded.model_inputs()}


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages alive, after each op run under it, as a CPU model of a GPU's allocated memory
    without its caching (every storage an op returns, counted until it is freed); ``peaks``: the most, per phase
    (``phase``, set by the caller, e.g. at each layer's backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase: Any = None
        self.peaks: dict[Any, int] = {}
        self._live: dict[int, tuple[Any, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}  # before: addresses are reused
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                s = t.untyped_storage()
                self._live.setdefault(s.data_ptr(), (StorageWeakRef(s), s.nbytes()))
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), sum(n for _, n in self._live.values()))
        return out


def record_kept_outputs(monkeypatch: Any) -> list[weakref.ref]:
    """Weak references to every `tfcompat.hf.checkpointing._Outputs` made from now on (one per checkpointed layer
    call keeping modules), in the order made: whether a layer's kept outputs are still held."""
    from tfcompat.hf import checkpointing

    made: list[weakref.ref] = []
    init = checkpointing._Outputs.__init__

    def recorded(self: Any, *args: Any) -> None:
        init(self, *args)
        made.append(weakref.ref(self))

    monkeypatch.setattr(checkpointing._Outputs, "__init__", recorded)
    return made
