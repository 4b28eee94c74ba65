"""Sequence boundaries of a packed batch, computed once per forward from the text position row.

A packed row holds several sequences back to back with no padding; the text position row restarts at 0
at each sequence. Every attention layer of the forward shares the one `PackedSeqs` built here, so the
hot path has no per-layer ``nonzero``/``.item()``/``all_gather`` (reference: flash-attn's
``bert_padding.py`` and transformers' ``prepare_fa_kwargs_from_position_ids``, which runs per layer).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ..errors import InvalidInputError

__all__ = ["PackedSeqs", "check_text_positions", "chunked", "from_host_positions", "from_lengths", "has_packed_rows"]


class PackedSeqs(NamedTuple):
    """Boundaries of the sequences in a flattened packed stream of ``T`` tokens.

    cu_seqlens: ``(N + 1,)`` int32 on the tokens' device, ``cu_seqlens[i]`` = start of sequence ``i``.
    max_seqlen: the longest sequence, a host int (varlen kernels take it as an int).
    lengths: the ``N`` sequence lengths as host ints (the SDPA backend splits on them without a sync).
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    lengths: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.lengths)


def from_lengths(lengths: list[int] | tuple[int, ...], device: torch.device | str = "cpu") -> PackedSeqs:
    """Boundaries from host-side sequence lengths (no device sync)."""
    lengths = tuple(int(n) for n in lengths)
    if not lengths or min(lengths) <= 0:
        raise InvalidInputError(
            "packed sequence lengths must be positive",
            why=f"got lengths {lengths!r}",
            fix="drop empty sequences before packing",
        )
    cu = torch.tensor((0, *_cumsum(lengths)), dtype=torch.int32)
    return PackedSeqs(cu.to(device, non_blocking=True), max(lengths), lengths)


def check_text_positions(text_positions: torch.Tensor, *, family: str | None = None) -> None:
    """Raise `InvalidInputError` unless ``text_positions`` is a non-empty integer ``(B, L)`` tensor."""
    if text_positions.ndim != 2 or text_positions.is_floating_point() or text_positions.dtype == torch.bool:
        raise InvalidInputError(
            "the text position row must be an integer (batch, seq_len) tensor",
            family=family,
            why=f"got dtype {text_positions.dtype} and shape {tuple(text_positions.shape)}",
            fix="pass position_ids as a LongTensor: (B, L), or (4, B, L) = [text; t; h; w]",
        )
    if text_positions.numel() == 0:
        raise InvalidInputError("empty packed batch", family=family, why=f"shape {tuple(text_positions.shape)}",
                                fix="pass at least one token")


def from_host_positions(host: torch.Tensor, *, device: torch.device, family: str | None = None) -> PackedSeqs:
    """Boundaries from a ``(B, L)`` integer text row already copied to the host (no sync; the forward copies it
    once, `tfcompat.hf.forward.Router.decide`), moved to ``device``.

    Each row is flattened into the stream in order; a sequence starts at every row start and wherever the position
    is 0, and inside a sequence positions count up by 1. Returns the `PackedSeqs` of the ``B * L`` tokens.

    >>> from_host_positions(torch.tensor([[0, 1, 2, 0, 1]]), device=torch.device("cpu")).cu_seqlens.tolist()
    [0, 3, 5]
    """
    batch, length = host.shape
    if length == 0:
        raise InvalidInputError(
            "a packed forward got no tokens", family=family, why=f"position ids of shape {tuple(host.shape)}",
            fix="leave empty sequences out of the batch")
    flat = host.reshape(-1)
    if bool((flat < 0).any()):
        i = int((flat < 0).nonzero()[0])
        raise InvalidInputError(
            "negative position ids", family=family,
            why=f"at flat index {i} the position is {int(flat[i])}; each sequence's text row counts 0, 1, 2, ... "
            "(a negative run would split a sequence at its 0)",
            fix="build each sequence's ids with tfcompat.pack, or tfcompat.rope_index (or arange) per sequence, "
            "concatenated")
    starts, bad = _starts(flat, length)
    if bool(bad.any()):
        i = int(bad.nonzero()[0]) + 1
        raise InvalidInputError(
            "text position ids are not packed sequences",
            family=family,
            why=f"at flat index {i} the position goes {int(flat[i - 1])} -> {int(flat[i])}; inside a sequence "
            "positions count up by 1 and each new sequence restarts at 0",
            fix="build each sequence's ids with tfcompat.rope_index (or arange) and concatenate them",
        )
    begin = starts.nonzero().flatten()
    lengths = torch.diff(torch.cat([begin, torch.tensor([flat.numel()])])).tolist()
    return from_lengths(lengths, device=device)


def has_packed_rows(host: torch.Tensor) -> bool:
    """Whether a ``(B, L)`` integer text row on the host holds packed sequences (the rule of `from_host_positions`,
    without its errors) and some row more than one of them."""
    flat = host.reshape(-1)
    if host.shape[-1] == 0 or bool((flat < 0).any()):
        return False
    starts, bad = _starts(flat, host.shape[-1])
    return not bool(bad.any()) and int(starts.sum()) > host.shape[0]


def _starts(flat: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of the flattened ``(B * L,)`` rows of ``length`` tokens: where a sequence starts (every row start, every 0),
    and where a token neither starts one nor continues the one before by 1 (``(B * L - 1,)``, from the second)."""
    starts = flat == 0
    starts[::length] = True  # every row starts a sequence
    continues = flat[1:] == flat[:-1] + 1
    return starts, ~(starts[1:] | continues)


_chunked = WeakTensorKeyDictionary()  # a forward's cu_seqlens tensor -> {chunk size: its chunked PackedSeqs}


def chunked(seqs: PackedSeqs, size: int) -> PackedSeqs:
    """The boundaries of chunked attention (llama4): each sequence cut into chunks of ``size`` tokens counted from
    its start (the last chunk shorter), each chunk its own sequence.

    Lengths ``[5, 3]`` with size 2 -> ``[2, 2, 1, 2, 1]``. From the host lengths: no sync (one host-to-device copy
    of the new ``cu_seqlens``). Cached on ``seqs.cu_seqlens`` (weakly), like the flex block masks: every chunked
    layer of a forward, and the checkpointing recompute, share one result (and its block masks).
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidInputError("the attention chunk size must be a positive int", why=f"got {size!r}")
    per_size = _chunked.get(seqs.cu_seqlens)
    if per_size is None:
        per_size = _chunked[seqs.cu_seqlens] = {}
    if size not in per_size:
        lengths = [min(size, n - start) for n in seqs.lengths for start in range(0, n, size)]
        per_size[size] = from_lengths(lengths, device=seqs.cu_seqlens.device)
    return per_size[size]


def _cumsum(values: tuple[int, ...]) -> list[int]:
    out, acc = [], 0
    for v in values:
        acc += v
        out.append(acc)
    return out
