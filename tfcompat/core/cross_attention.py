"""Cross-attention over packed sequences: each sequence's queries attend to its own keys only, without causality.

The decoder of an encoder-decoder model reads the encoder's states of its own sequence. Packed, the decoder tokens of
``N`` sequences lie back to back in one stream (boundaries ``q_seqs``) and so do the encoder states (boundaries
``k_seqs``, ``N`` too): sequence ``i``'s queries see exactly sequence ``i``'s keys, all of them (varlen attention with
``cu_seqlens_q`` / ``cu_seqlens_k``, non-causal). Reference: stock cross-attention of each sequence alone
(``softmax(scale * q k^T) v`` over every encoder state); here ``F.scaled_dot_product_attention`` per sequence, which
stock SDPA also calls, so the numerics are the stock ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import InvalidInputError
from .packing import PackedSeqs

__all__ = ["cross_attention"]


def cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_seqs: PackedSeqs, k_seqs: PackedSeqs, *,
                    scale: float | None = None) -> torch.Tensor:
    """Per-sequence, non-causal attention of packed queries to packed keys.

    q: ``(Tq, Hq, D)``, the queries of ``q_seqs``; k: ``(Tk, Hkv, D)`` and v: ``(Tk, Hkv, Dv)``, the keys and values of
    ``k_seqs`` (``Hq`` a multiple of ``Hkv``: query head ``h`` reads KV head ``h // (Hq // Hkv)``). Returns
    ``(Tq, Hq, Dv)`` in q's dtype. `InvalidInputError` where the shapes and boundaries disagree.
    """
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
        raise InvalidInputError("cross-attention takes q (Tq, Hq, D), k (Tk, Hkv, D) and v (Tk, Hkv, Dv)",
                                why=f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise InvalidInputError("the query heads are not a multiple of the key heads",
                                why=f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    if len(q_seqs.lengths) != len(k_seqs.lengths) or q.shape[0] != q_seqs.total or k.shape[0] != k_seqs.total:
        raise InvalidInputError(
            "the packed boundaries of the queries and of the keys do not match the tokens",
            why=f"{len(q_seqs.lengths)} query sequences over {q.shape[0]} tokens (boundaries: {q_seqs.total}), "
            f"{len(k_seqs.lengths)} key sequences over {k.shape[0]} tokens (boundaries: {k_seqs.total})",
            fix="pass one encoder state sequence per packed decoder sequence (tfcompat.pack)")
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for qs, ks, vs in zip(q.split(q_seqs.lengths), k.split(k_seqs.lengths), v.split(k_seqs.lengths)):
        # (L, H, D) -> (1, H, L, D)
        o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                           vs.transpose(0, 1)[None], scale=scale, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))  # (1, H, Lq, Dv) -> (Lq, H, Dv)
    return torch.cat(outs)
