"""The all-to-all layouts and the symmetric-memory exchange, simulated in one process.

`tfcompat.a2a.keep`, `push` and `collect` are what every rank runs around its one barrier on the GPU; here the
ranks' workspaces are plain tensors, every rank keeps and pushes, then every rank collects. The oracle is the
definition of the exchange: rank r's head shard is its heads of every rank's tokens, and back.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tfcompat import TransportError, a2a

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _exchange_all(xs: list[torch.Tensor], layout: a2a.Layout) -> list[torch.Tensor]:
    """What `a2a._symm_mem` does on each of ``len(xs)`` ranks, on either side of the barrier."""
    sp = len(xs)
    shape = layout.out_shape(xs[0].shape, sp)
    workspaces = [torch.full(shape, float("nan"), dtype=x.dtype) for x in xs]  # an unwritten chunk shows as NaN
    outs = [torch.full(shape, float("nan"), dtype=x.dtype) for x in xs]
    for rank, x in enumerate(xs):
        send = layout.send(x, sp)
        a2a.keep(send, layout.recv(outs[rank], sp), rank)
        a2a.push(send, [layout.recv(w, sp)[rank] for w in workspaces], rank)
    for rank in range(sp):  # after the barrier
        a2a.collect(layout.recv(outs[rank], sp), layout.recv(workspaces[rank], sp), rank)
    return outs


@settings(max_examples=40, deadline=None)
@given(sp=st.integers(1, 4), t_local=st.integers(1, 5), per_rank=st.integers(1, 3), dim=st.sampled_from([1, 3, 4, 8]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 99))
def test_exchange_matches_the_definition(sp, t_local, per_rank, dim, dtype, seed):
    """Rule: seq_to_heads gives rank r heads r of every token; heads_to_seq undoes it exactly."""
    heads = sp * per_rank
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(sp * t_local, heads, dim, generator=gen).to(dtype)
    shards = [full[r * t_local:(r + 1) * t_local] for r in range(sp)]
    head_shards = _exchange_all(shards, a2a.SEQ_TO_HEADS)
    for r, got in enumerate(head_shards):
        assert torch.equal(got, full[:, r * per_rank:(r + 1) * per_rank])
    back = _exchange_all(head_shards, a2a.HEADS_TO_SEQ)
    for r, got in enumerate(back):
        assert torch.equal(got, shards[r])


def test_exchange_reads_strided_inputs():
    """Rule: q/k/v arrive as (T, H, D) views of (H, T, D) or padded memory; the exchange reads them as they are."""
    sp, t_local, heads, dim = 2, 3, 4, 8
    full = torch.randn(heads, sp * t_local, dim).transpose(0, 1)  # (T, H, D), not contiguous
    shards = [full[r * t_local:(r + 1) * t_local] for r in range(sp)]
    for r, got in enumerate(_exchange_all(shards, a2a.SEQ_TO_HEADS)):
        assert torch.equal(got, full[:, r * 2:(r + 1) * 2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("view", ["rows", "heads_slice", "odd_dim", "offset"])
def test_word_copy_equals_elementwise_copy(dtype, view):
    """Rule: the widened copy moves exactly the bytes copy_ moves, and falls back where words do not fit."""
    base = torch.randn(6, 4, 9 if view == "odd_dim" else 8).to(dtype)
    views = {"rows": lambda: base, "heads_slice": lambda: base[:, 1:3], "odd_dim": lambda: base[:, :2],
             "offset": lambda: base.flatten()[1:161].view(20, 8)}
    src = views[view]()
    outer = src.ndim - 1  # dst: the outer dims in reverse memory order, rows still contiguous
    dst = torch.zeros(*reversed(src.shape[:-1]), src.shape[-1], dtype=dtype).permute(*reversed(range(outer)), outer)
    expected = torch.zeros_like(dst).copy_(src)
    wide = a2a._wide(dst, src)
    assert (wide is None) == (view in ("odd_dim", "offset")), wide[0].dtype
    a2a._copy(dst, src)
    assert torch.equal(dst, expected)


def test_inverse_layouts():
    assert a2a.SEQ_TO_HEADS.inverse == a2a.HEADS_TO_SEQ.name and a2a.HEADS_TO_SEQ.inverse == a2a.SEQ_TO_HEADS.name


def test_workspace_failure_is_a_transport_error(monkeypatch):
    """Rule: a symmetric workspace that cannot be set up raises TransportError naming the fallback transport."""

    class NoSymmetricMemory:
        @staticmethod
        def empty(*args, **kwargs):
            raise RuntimeError("CUDA driver error: peer access is not supported between these two devices")

    monkeypatch.setattr(a2a, "_symm_mem_module", lambda: NoSymmetricMemory)
    workspace = a2a._Workspace.__new__(a2a._Workspace)  # no CUDA here: skip the stream set-up of __init__
    workspace.handle, workspace.device, workspace.views = None, torch.device("cpu"), {}
    with pytest.raises(TransportError) as info:
        workspace._grow(256)
    message = str(info.value)
    assert "peer access is not supported" in message and 'transport="all_to_all"' in message
