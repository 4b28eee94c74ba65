"""What a kept module saves of its own inputs: not kept, taken from the layer's recompute.

A kept module (`tfcompat.hf.checkpointing`) holds what its ops save from the forward to its layer's backward.
Among those tensors is usually the module's input: the q / k / v projections save the normed hidden state they
project, the MLP's input projections theirs (``(T, H)`` each, a quarter of what kept attention holds). The
layer's recompute produces that input again anyway (the norm before the module is not kept), so holding it, or
sending it through the host link, buys nothing.

`Inputs` is built at the kept module's call in the forward and again in the recompute. It saves each input
that requires grad through a small autograd function, so through the checkpoint's own saved-tensor hooks:
dropped in the forward, produced again by the recompute, as checkpointing handles any activation (the two passes
save the same tensors in the same order). `Inputs.pack` then replaces each tensor the module saves on the storage
of such an input by an `_Input` view; in the backward its `unpack` asks the checkpoint for the recomputed input
(which starts the layer's recompute if it has not run yet) and returns the same view of it. The recompute
reproduces the forward's tensors bit for bit (what gradient checkpointing relies on), so the gradients are those
of the held path. Inputs that do not require grad, and an input the module writes in place before saving it (its
version counter moved: the recompute would not write it again), are held as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils._pytree import tree_leaves

from ..errors import PatchedModelError
from .offload import View
from .offload import unpack as offload_unpack

__all__ = ["Inputs", "unpack"]


class _Save(torch.autograd.Function):
    """Saves its input for nobody's backward: the saved tensor is read through its node (`_Recomputed`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> None:
        return None


class _Recomputed:
    """One input of a kept module call: its node's saved tensor, the recomputed input in the backward (read once
    per backward pass: checkpointing hands each recomputed tensor out once)."""

    def __init__(self, saved: torch.Tensor, nbytes: int, version: int) -> None:
        self._saved = saved  # `_Save`'s output: its node lives while it does (a node dropped frees what it saved)
        self._nbytes = nbytes
        self.version = version  # the input's when the module was called: a later in-place write is not recomputed
        self._value: tuple[int, torch.Tensor] | None = None  # (graph task, the recomputed input)

    def value(self) -> torch.Tensor:
        task = torch._C._current_graph_task_id()
        if self._value is None or self._value[0] != task:
            self._value = (task, cast(Any, self._saved.grad_fn).saved_tensors[0])
        x = self._value[1]
        if x.untyped_storage().nbytes() != self._nbytes:
            raise PatchedModelError(
                "a kept module's input came back from the recompute on a storage of another size",
                why=f"{x.untyped_storage().nbytes()} bytes against {self._nbytes} in the forward: the layer's "
                    "recompute did not reproduce the forward",
                fix="make the layer's forward deterministic in its layout, or leave checkpoint_keep out")
        return x


@dataclass(frozen=True, eq=False)
class _Input:
    """A saved tensor as a view of a recomputed input's storage (a pytree leaf)."""

    source: _Recomputed
    view: View

    def unpack(self) -> torch.Tensor:
        x = self.source.value()
        return self.view.on(x.untyped_storage(), x.device)


class Inputs:
    """A kept module call's inputs that require grad, each saved through the checkpoint's hooks: built at
    the call in the forward and again in the recompute, outside the module's own hooks."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._by_storage: dict[int, _Recomputed] = {}
        if not torch.is_grad_enabled():
            return
        for x in tree_leaves((args, kwargs)):
            if not (type(x) is torch.Tensor and x.requires_grad and x.layout == torch.strided):
                continue
            storage = x.untyped_storage()
            if storage.data_ptr() in self._by_storage:
                continue
            self._by_storage[storage.data_ptr()] = _Recomputed(_Save.apply(x), storage.nbytes(), x._version)

    def pack(self, pack: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
        """``pack`` for the tensors not on an input's storage (or on one the module wrote in place); a view of the
        recomputed input for the others."""
        if not self._by_storage:
            return pack

        def packed(t: torch.Tensor) -> Any:
            source = self._by_storage.get(t.untyped_storage().data_ptr()) if type(t) is torch.Tensor else None
            if source is None or t.layout != torch.strided or t._version != source.version:
                return pack(t)  # not the input's, or written in place by the module since: held as it is
            return _Input(source, View.of(t))

        return packed


def unpack(x: Any) -> Any:
    """`Inputs.pack`'s result back as a tensor (`tfcompat.hf.offload.unpack` for the rest)."""
    return x.unpack() if isinstance(x, _Input) else offload_unpack(x)
