"""The all-to-all exchange, one tensor or several fused, over both transports, simulated in one process.

Every rank's `tfcompat.core.a2a.plan` is built; ``"all_to_all"`` is `a2a.pack`, the chunk swap `all_to_all_single`
does, `a2a.unpack`; ``"symm_mem"`` is what every rank runs around its one barrier on the GPU (`a2a.keep`,
`a2a.push` into the peers' workspaces, here plain tensors, then `a2a.collect`). The oracle is the definition of
the exchange: rank r's head shard is its heads of every rank's tokens (K/V repeated ``sp // Hkv`` times first when
``Hkv < sp``), and back; gradients from autograd through the definition. The fused exchange must also equal
three separate ones, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tfcompat import InvalidInputError, TransportError
from tfcompat.core import a2a
from tfcompat.ulysses import kv_repeats

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TRANSPORTS = ["all_to_all", "symm_mem"]


def _simulate(xs_by_rank: list[list[torch.Tensor]], direction: str, repeats: tuple[int, ...],
              transport: str) -> list[tuple[torch.Tensor, ...]]:
    """`a2a._run` on each of ``len(xs_by_rank)`` ranks; unwritten output elements show as NaN."""
    sp = len(xs_by_rank)
    plans = [a2a.plan(xs, direction, sp, repeats) for xs in xs_by_rank]
    for p in plans:
        for t in (p.dst_wire,) if p.dst_wire is not None else p.outputs:
            t.fill_(float("nan"))
    if transport == "all_to_all":
        sends = [a2a.pack(p, sp) for p in plans]
        for rank, p in enumerate(plans):
            recv = p.dst_wire if p.dst_wire is not None else torch.empty_like(sends[rank])
            for i in range(sp):  # what all_to_all_single does: chunk i of the receive buffer is rank i's chunk rank
                recv[i] = sends[i][rank]
            if p.dst_wire is None:
                a2a.unpack(p, recv)
    else:
        workspaces = [torch.full((sp, p.rows, p.width), float("nan"), dtype=p.outputs[0].dtype) for p in plans]
        for rank, p in enumerate(plans):
            a2a.keep(p, rank)
            a2a.push(p, [w[rank] for w in workspaces], rank)
        for rank, p in enumerate(plans):  # after the barrier
            a2a.collect(p, workspaces[rank], rank)
    return [p.outputs for p in plans]


def _definition(fulls: list[torch.Tensor], repeats: tuple[int, ...], sp: int) -> list[list[torch.Tensor]]:
    """seq_to_heads by definition: rank r gets heads ``[r h, (r + 1) h)`` of every token of each (repeated) tensor."""
    outs = []
    for rank in range(sp):
        mine = []
        for full, r in zip(fulls, repeats):
            full = full.repeat_interleave(r, dim=1)
            h = full.shape[1] // sp
            mine.append(full[:, rank * h:(rank + 1) * h])
        outs.append(mine)
    return outs


def _shards(full: torch.Tensor, sp: int) -> list[torch.Tensor]:
    t = full.shape[0] // sp
    return [full[r * t:(r + 1) * t] for r in range(sp)]


def _qkv(sp: int, t_local: int, hq: int, hkv: int, dim: int, dtype: torch.dtype, seed: int,
         strided: bool) -> list[torch.Tensor]:
    """Global q ``(T, Hq, D)``, k, v ``(T, Hkv, D)``; strided: views of ``(H, T, D)`` memory, as transformers hands
    attention ``(B, H, L, D)`` tensors."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for h in (hq, hkv, hkv):
        if strided:
            out.append(torch.randn(h, sp * t_local, dim, generator=gen).to(dtype).transpose(0, 1))
        else:
            out.append(torch.randn(sp * t_local, h, dim, generator=gen).to(dtype))
    return out


@st.composite
def _cases(draw):
    sp = draw(st.integers(1, 4))
    # Hkv a multiple of sp (no repeat), or a divisor of sp below it (repeated sp // Hkv times)
    hkv = draw(st.sampled_from([sp * m for m in (1, 2)] + [d for d in range(1, sp) if not sp % d]))
    hq = max(hkv, sp) * draw(st.integers(1, 3))  # a multiple of lcm(Hkv, sp)
    return dict(sp=sp, hq=hq, hkv=hkv, t_local=draw(st.integers(1, 5)), dim=draw(st.sampled_from([1, 3, 5, 8, 16])),
                dtype=draw(st.sampled_from(DTYPES)), seed=draw(st.integers(0, 99)), strided=draw(st.booleans()),
                transport=draw(st.sampled_from(TRANSPORTS)))


# every GQA ratio at sp 1-4: (sp, Hq, Hkv), Hkv < sp (repeated), = sp, > sp
GRID = [(sp, hq, hkv) for sp in (1, 2, 3, 4) for hkv in sorted({1, 2, sp, 2 * sp}) if hkv >= sp or not sp % hkv
        for hq in (max(hkv, sp), 2 * max(hkv, sp))]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("sp,hq,hkv", GRID, ids=[f"sp{s}-q{q}-kv{k}" for s, q, k in GRID])
def test_every_gqa_ratio(sp, hq, hkv, transport):
    """Rule: as the two property tests below, on every GQA ratio (odd head_dim, strided inputs, bf16)."""
    case = dict(sp=sp, hq=hq, hkv=hkv, t_local=3, dim=5, dtype=torch.bfloat16, seed=sp + hq + hkv, strided=True,
                transport=transport)
    _check_forward(case)
    _check_backward(case)


@settings(max_examples=60, deadline=None)
@given(case=_cases())
def test_fused_exchange_matches_the_definition_and_three_exchanges(case):
    """Rule: one fused exchange of q, k, v gives rank r its heads of every token (its one KV head when Hkv < sp),
    equal bit for bit to the definition and to three separate exchanges after repeat_interleave; heads_to_seq
    undoes it exactly."""
    _check_forward(case)


def _check_forward(case: dict) -> None:
    sp, dtype = case["sp"], case["dtype"]
    fulls = _qkv(sp, case["t_local"], case["hq"], case["hkv"], case["dim"], dtype, case["seed"], case["strided"])
    r = kv_repeats(case["hkv"], sp)
    repeats = (1, r, r)
    by_rank = [list(parts) for parts in zip(*(_shards(f, sp) for f in fulls))]
    fused = _simulate(by_rank, "seq_to_heads", repeats, case["transport"])
    expect = _definition(fulls, repeats, sp)
    for rank in range(sp):
        for got, want in zip(fused[rank], expect[rank]):
            assert got.shape == want.shape and torch.equal(got, want), (rank, got.shape, want.shape)
    separate = [_simulate([[x.repeat_interleave(rep, dim=1)] for x in _shards(full, sp)], "seq_to_heads", (1,),
                          case["transport"]) for full, rep in zip(fulls, repeats)]
    for rank in range(sp):
        for part, got in enumerate(fused[rank]):
            assert torch.equal(got, separate[part][rank][0])
    # the way back, of each tensor alone (as the attention output goes back) and of all three fused
    for part, full in enumerate(fulls):
        if repeats[part] == 1:
            back = _simulate([[fused[rank][part]] for rank in range(sp)], "heads_to_seq", (1,), case["transport"])
            assert all(torch.equal(back[rank][0], _shards(full, sp)[rank]) for rank in range(sp))
    back = _simulate([list(outs) for outs in fused], "heads_to_seq", (1, 1, 1), case["transport"])
    for rank in range(sp):
        for part, full in enumerate(fulls):
            assert torch.equal(back[rank][part], _shards(full.repeat_interleave(repeats[part], dim=1), sp)[rank])


@settings(max_examples=40, deadline=None)
@given(case=_cases())
def test_fused_backward_is_the_gradient_of_the_definition(case):
    """Rule: the backward (one heads_to_seq exchange of the three gradients, then each KV head's copies summed)
    equals autograd through the definition (repeat_interleave and head slices)."""
    _check_backward(case)


def _check_backward(case: dict) -> None:
    sp, dtype = case["sp"], case["dtype"]
    fulls = [f.detach().requires_grad_() for f in
             _qkv(sp, case["t_local"], case["hq"], case["hkv"], case["dim"], dtype, case["seed"], case["strided"])]
    r = kv_repeats(case["hkv"], sp)
    repeats = (1, r, r)
    expect = _definition(fulls, repeats, sp)
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    upstream = [[torch.randn(o.shape, generator=gen).to(dtype) for o in outs] for outs in expect]
    torch.autograd.backward([o for outs in expect for o in outs], [g for gs in upstream for g in gs])
    back = _simulate(upstream, "heads_to_seq", (1, 1, 1), case["transport"])
    grads = [a2a.sum_repeats(b, repeats) for b in back]
    magnitudes = [a2a.sum_repeats([b.abs().float() for b in bs], repeats) for bs in back]
    for part, full in enumerate(fulls):
        got = torch.cat([grads[rank][part] for rank in range(sp)])
        if repeats[part] <= 2:  # at most two addends: the order of the sum cannot matter
            assert torch.equal(got, full.grad), part
        else:  # r addends summed in another order: the summation bound, r roundings of the sum of magnitudes
            bound = repeats[part] * torch.finfo(dtype).eps * torch.cat([m[part] for m in magnitudes])
            assert ((got.float() - full.grad.float()).abs() <= bound).all(), part


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_single_tensor_round_trip(transport, dtype):
    """Rule: one tensor alone (the attention output's way back, linear attention's inputs) keeps the old layout."""
    sp, t_local, heads, dim = 3, 4, 6, 8
    full = torch.randn(sp * t_local, heads, dim).to(dtype)
    head_shards = _simulate([[s] for s in _shards(full, sp)], "seq_to_heads", (1,), transport)
    for rank, (got,) in enumerate(head_shards):
        assert got.is_contiguous() and torch.equal(got, full[:, rank * 2:(rank + 1) * 2])
    back = _simulate([[h[0]] for h in head_shards], "heads_to_seq", (1,), transport)
    assert all(torch.equal(b[0], s) for b, s in zip(back, _shards(full, sp)))


def test_fused_outputs_are_views_of_one_buffer():
    """Rule: seq_to_heads returns q, k, v as views into the received wire buffer, rows W apart (no unpack copy)."""
    q, k, v = torch.randn(3, 8, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    p = a2a.plan([q, k, v], "seq_to_heads", 4, (1, 2, 2))
    assert p.width == (2 + 1 + 1) * 4
    assert all(o._base is p.dst_wire for o in p.outputs)
    assert [o.shape for o in p.outputs] == [(12, 2, 4), (12, 1, 4), (12, 1, 4)]
    assert all(o.stride() == (p.width, 4, 1) for o in p.outputs)


def test_repeat_reads_the_kv_head_in_place():
    """Rule: with Hkv < sp no repeated K/V is built: each rank's chunk is an expanded view of its KV head."""
    k = torch.randn(5, 2, 8)
    p = a2a.plan([k], "seq_to_heads", 4, (2,))
    src = p.src[0]
    assert src.shape == (2, 2, 5, 1, 8) and src.stride()[1] == 0 and src.data_ptr() == k.data_ptr()
    assert torch.equal(a2a.chunk(src, 3), k[:, 1:2])


@pytest.mark.parametrize("xs,direction,repeats,match", [
    ([torch.zeros(2, 4, 8), torch.zeros(3, 2, 8)], "seq_to_heads", (1, 1), "one token count"),
    ([torch.zeros(2, 4, 8), torch.zeros(2, 2, 8, dtype=torch.float16)], "seq_to_heads", (1, 1), "dtypes"),
    ([torch.zeros(2, 3, 8)], "seq_to_heads", (1,), "multiple of 2"),
    ([torch.zeros(2, 1, 8)], "seq_to_heads", (4,), "exactly 2"),
    ([torch.zeros(3, 1, 8)], "heads_to_seq", (1,), "T must divide by 2"),
    ([torch.zeros(2, 4)], "seq_to_heads", (1,), "each \\(tokens, heads, head_dim\\)"),
])
def test_bad_inputs_raise(xs, direction, repeats, match):
    with pytest.raises(InvalidInputError, match=match):
        a2a.plan(xs, direction, 2, repeats)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("view", ["rows", "heads_slice", "odd_dim", "offset", "expanded"])
def test_word_copy_equals_elementwise_copy(dtype, view):
    """Rule: the widened copy moves exactly the bytes copy_ moves (broadcasting an expanded source too), and falls
    back where words do not fit."""
    base = torch.randn(6, 4, 9 if view == "odd_dim" else 8).to(dtype)
    views = {"rows": lambda: base, "heads_slice": lambda: base[:, 1:3], "odd_dim": lambda: base[:, :2],
             "offset": lambda: base.flatten()[1:161].view(20, 8), "expanded": lambda: base[:, :1].expand(6, 3, 8)}
    src = views[view]()
    outer = src.ndim - 1  # dst: the outer dims in reverse memory order, rows still contiguous
    dst = torch.zeros(*reversed(src.shape[:-1]), src.shape[-1], dtype=dtype).permute(*reversed(range(outer)), outer)
    expected = torch.zeros_like(dst).copy_(src)
    wide = a2a._wide(dst, src)
    assert (wide is None) == (view in ("odd_dim", "offset")), wide[0].dtype
    a2a._copy(dst, src)
    assert torch.equal(dst, expected)


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
