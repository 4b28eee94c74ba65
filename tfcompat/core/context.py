"""The per-forward context every attention layer shares, and the kwarg that carries it.

It travels in the forward's ``**kwargs`` (checkpoint-safe: recomputation replays the same kwargs); where a
decoder layer drops kwargs, a pre-hook stores it on the attention module under `BRIDGE_ATTR`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .a2a import Transport
from .attention import Backend
from .packing import PackedSeqs

__all__ = ["CONTEXT_KWARG", "BRIDGE_ATTR", "CrossItems", "ForwardContext", "StockContext"]

CONTEXT_KWARG = "tfcompat_context"
BRIDGE_ATTR = "_tfcompat_context"


class CrossItems(NamedTuple):
    """The items a packed row's cross-attention layers attend to (Mllama's images), by sequence.

    counts: each sequence's number of items, in order, on the owner's item axis (0: a sequence without any, whose
    cross-attention layers the stock text model skips). Set by `tfcompat.pack`; a raw packed call has none, and
    cannot tell which sequence an image belongs to.
    """

    counts: tuple[int, ...]


class ForwardContext(NamedTuple):
    """What every attention layer of one forward shares.

    seqs: boundaries of the whole packed row (global under sequence parallelism).
    backend: the varlen backend. group: the Ulysses process group, or None for a single process.
    transport: how the Ulysses all-to-alls move data, agreed by every rank in `tfcompat.ulysses.shard_inputs`.
    mask: the caller's 4-D attention mask, found equal to the block-diagonal causal mask of ``seqs``
    (`tfcompat.core.custom_mask`): the text model's packed forward takes it (and drops it); None: none was checked.
    cross: the row's cross-attention items by sequence (`CrossItems`), None where the row carries none.
    encoder: boundaries of the encoder states the packed decoder's cross-attention reads, one sequence per sequence
    of ``seqs`` (`tfcompat.core.cross_attention`); None outside an encoder-decoder model's decoder.
    """

    seqs: PackedSeqs
    backend: Backend = "auto"
    group: Any = None
    transport: Transport = "all_to_all"
    mask: torch.Tensor | None = None
    cross: CrossItems | None = None
    encoder: PackedSeqs | None = None


class StockContext(NamedTuple):
    """An ordinary (not packed) forward of a patched model: attention runs the stock implementation.

    impl: the ``_attn_implementation`` the config named before the patch; eager: the family module's
    ``eager_attention_forward`` (the function of ``"eager"``, which transformers does not register by name).
    """

    impl: str
    eager: Callable[..., Any] | None = None
