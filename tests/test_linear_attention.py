"""Differential tests of the packed linear-attention core against transformers' own torch path, per sequence.

The oracle is the installed transformers' Qwen3.5 modeling module: ``torch_chunk_gated_delta_rule``, the
``causal_conv1d_fn`` torch fallback (5.15+; before it the stock layer's own ``nn.Conv1d``), and the stock
``Qwen3_5GatedDeltaNet`` module, each run on one sequence at a time. Releases without Qwen3.5 skip.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import assert_close
from tfcompat.core import _linear_kernels
from tfcompat.core.linear_attention import (
    LinearHeads,
    _conv_channels,
    available_conv_backends,
    available_rule_backends,
    check_linear_heads,
    linear_attention,
    linear_attention_params,
    local_heads,
    packed_causal_conv1d,
    packed_gated_delta_rule,
    select_conv_backend,
    select_rule_backend,
)
from tfcompat.core.packing import from_lengths
from tfcompat.errors import InvalidInputError

ATOL = 1e-5
LENGTHS = [[37], [5, 70, 1, 130, 64], [1, 1, 2], [63, 65, 128, 3]]


@pytest.fixture(scope="module")
def stock():
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5",
                                   reason="this transformers has no Qwen3.5 (added in 5.2)")
    warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch.*")
    return modeling


def _stock_rule(stock, q, k, v, g, beta, chunk_size=64):
    """transformers' chunked rule on one sequence ``(L, H, D)``; q/k repeated to the value heads first, as the
    stock layer does up to 5.22 (5.23+ repeats inside the function, a no-op once repeated)."""
    reps = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(reps, dim=1), k.repeat_interleave(reps, dim=1)
    out, _ = stock.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g=g[None], beta=beta[None],
                                                chunk_size=chunk_size, use_qk_l2norm_in_kernel=True)
    return out[0]


def _stock_conv(stock, x, weight, bias, activation):
    """transformers' torch conv path on one sequence ``(L, C)`` -> ``(L, C)``."""
    fn = getattr(stock, "causal_conv1d_fn", None)
    if fn is not None:  # 5.15+: the torch fallback, ``(1, C, L)`` in and out
        return fn(x.t()[None], weight, bias, activation=activation)[0].t()
    # before 5.15: the stock layer's ``F.silu(self.conv1d(x)[..., :L])``, an nn.Conv1d with padding W - 1
    out = F.conv1d(x.t()[None], weight[:, None], bias, padding=weight.shape[1] - 1, groups=x.shape[1])
    out = out[0, :, : x.shape[0]].t()
    return out if activation is None else F.silu(out)


def _rule_inputs(lengths, hk, hv, dk=8, dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    tensors = [torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen),
               torch.randn(t, hv, dv, generator=gen), -torch.rand(t, hv, generator=gen) * 2,
               torch.rand(t, hv, generator=gen)]
    return [x.requires_grad_() for x in tensors]


def _grads(out, inputs, seed=1):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad((out * weight).sum(), inputs)


def _assert_grads(got, want, names):
    """Gradients agree to ATOL relative to their scale (a weight's gradient sums over every token)."""
    for name, a, b in zip(names, got, want):
        assert_close(a, b, atol=ATOL * max(1.0, float(b.abs().max())), what=f"grad {name}")


def _per_sequence(fn, lengths, tensors):
    return torch.cat([fn(*parts) for parts in zip(*(x.split(lengths) for x in tensors))])


class TestRuleEqualsStock:
    """Rule: the packed gated delta rule equals transformers' chunked rule run per sequence, forward and backward."""

    @pytest.mark.parametrize("lengths", LENGTHS, ids=str)
    @pytest.mark.parametrize("hk,hv", [(2, 2), (2, 4)])
    def test_forward_backward(self, stock, lengths, hk, hv):
        inputs = _rule_inputs(lengths, hk, hv)
        seqs = from_lengths(lengths)
        got = packed_gated_delta_rule(*inputs, seqs)
        want = _per_sequence(lambda *s: _stock_rule(stock, *s), lengths, inputs)
        assert_close(got, want, atol=ATOL, what="output")
        _assert_grads(_grads(got, inputs), _grads(want, inputs), ["q", "k", "v", "g", "beta"])

    def test_chunk_grid_restarts_per_sequence(self, stock):
        """With 16-token chunks, every sequence spans several chunks and most end inside one."""
        lengths = [5, 70, 1, 33, 16]
        inputs = _rule_inputs(lengths, 2, 4)
        got = _linear_kernels.torch_gated_delta_rule(*inputs, from_lengths(lengths), 8 ** -0.5, True, chunk_size=16)
        want = _per_sequence(lambda *s: _stock_rule(stock, *s, chunk_size=16), lengths, inputs)
        assert_close(got, want, atol=ATOL, what="output")

    def test_control_stock_on_the_packed_row_differs(self, stock):
        """Non-vacuity: the stock rule over the whole packed row (state carried across sequences) is far off."""
        lengths = LENGTHS[1]
        inputs = _rule_inputs(lengths, 2, 4)
        packed = packed_gated_delta_rule(*inputs, from_lengths(lengths))
        carried = _stock_rule(stock, *inputs)
        first = lengths[0]
        assert_close(carried[:first], packed[:first], atol=ATOL, what="first sequence")
        assert float((carried - packed).detach().abs().max()) > 1e-2

    def test_bf16_output_dtype(self, stock):
        inputs = [x.detach().bfloat16() for x in _rule_inputs([9, 4], 2, 4)]
        got = packed_gated_delta_rule(*inputs, from_lengths([9, 4]))
        want = _per_sequence(lambda *s: _stock_rule(stock, *s), [9, 4], inputs)
        assert got.dtype == torch.bfloat16
        assert_close(got.float(), want.float(), atol=2e-2, what="bf16 output")


class TestConvEqualsStock:
    """Rule: the packed conv equals transformers' torch conv run per sequence (no tap reads the previous one)."""

    @pytest.mark.parametrize("lengths", LENGTHS, ids=str)
    @pytest.mark.parametrize("bias,activation", [(True, "silu"), (False, "silu"), (True, None)])
    def test_forward_backward(self, stock, lengths, bias, activation):
        gen = torch.Generator().manual_seed(3)
        channels, width = 24, 4
        x = torch.randn(sum(lengths), channels, generator=gen).requires_grad_()
        weight = torch.randn(channels, width, generator=gen).requires_grad_()
        b = torch.randn(channels, generator=gen).requires_grad_() if bias else None
        inputs = [t for t in (x, weight, b) if t is not None]
        got = packed_causal_conv1d(x, weight, b, from_lengths(lengths), activation=activation)
        want = torch.cat([_stock_conv(stock, part, weight, b, activation) for part in x.split(lengths)])
        assert_close(got, want, atol=ATOL, what="output")
        _assert_grads(_grads(got, inputs), _grads(want, inputs), ["x", "weight", "bias"])

    def test_control_stock_on_the_packed_row_differs(self, stock):
        lengths = [3, 5, 4]
        x, weight = torch.randn(12, 8), torch.randn(8, 4)
        packed = packed_causal_conv1d(x, weight, None, from_lengths(lengths))
        carried = _stock_conv(stock, x, weight, None, "silu")
        assert_close(carried[:3], packed[:3], atol=ATOL, what="first sequence")
        assert float((carried - packed).abs().max()) > 1e-2


class TestRandomBoundaries:
    """Rule: for any boundaries, conv and rule equal the per-sequence stock results."""

    @settings(max_examples=25, deadline=None)
    @given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=5), ratio=st.sampled_from([1, 2]))
    def test_rule(self, stock, lengths, ratio):
        inputs = [x.detach() for x in _rule_inputs(lengths, 2, 2 * ratio, dk=4, dv=3, seed=len(lengths))]
        got = _linear_kernels.torch_gated_delta_rule(*inputs, from_lengths(lengths), 0.5, True, chunk_size=16)
        want = _per_sequence(lambda *s: _stock_rule(stock, *s, chunk_size=16), lengths, inputs)
        assert_close(got, want, atol=ATOL, what=f"lengths {lengths}")

    @settings(max_examples=25, deadline=None)
    @given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6), width=st.integers(2, 5))
    def test_conv(self, stock, lengths, width):
        gen = torch.Generator().manual_seed(sum(lengths))
        x, weight = torch.randn(sum(lengths), 6, generator=gen), torch.randn(6, width, generator=gen)
        got = packed_causal_conv1d(x, weight, None, from_lengths(lengths))
        want = torch.cat([_stock_conv(stock, part, weight, None, "silu") for part in x.split(lengths)])
        assert_close(got, want, atol=ATOL, what=f"lengths {lengths}, width {width}")


def _tiny_layer(stock, hk=2, hv=4):
    config = stock.Qwen3_5TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, layer_types=["linear_attention"], linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=hk, linear_num_value_heads=hv,
        hidden_act="silu", rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    layer = stock.Qwen3_5GatedDeltaNet(config, 0).float()
    with torch.no_grad():  # random, not the init constants (norm weight 1, dt_bias 1)
        for name, p in layer.named_parameters():
            p.copy_(torch.rand_like(p).mul(3).add(0.5).log() if name == "A_log" else torch.randn_like(p) * 0.3)
    return layer


def _packed_layer_forward(layer, hidden, seqs):
    """A Qwen3.5 GatedDeltaNet forward over a packed stream ``(T, hidden)`` through `linear_attention` (what a
    family patch does around it: its projections before, its gated norm and output projection after)."""
    core = linear_attention(layer.in_proj_qkv(hidden), layer.in_proj_a(hidden), layer.in_proj_b(hidden),
                            linear_attention_params(layer), seqs)  # (T, Hv, Dv)
    z = layer.in_proj_z(hidden).unflatten(-1, (layer.num_v_heads, layer.head_v_dim))  # (T, Hv Dv) -> (T, Hv, Dv)
    out = layer.norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))  # (T Hv, Dv)
    return layer.out_proj(out.reshape(hidden.shape[0], -1))  # (T Hv, Dv) -> (T, Hv Dv)


class TestLayerEqualsStockModule:
    """Rule: a packed layer built on `linear_attention` equals the stock GatedDeltaNet module per sequence."""

    @pytest.mark.parametrize("hk,hv", [(2, 4), (2, 2)])
    def test_forward_backward(self, stock, hk, hv):
        layer = _tiny_layer(stock, hk, hv)
        lengths = [7, 70, 1, 19]
        hidden = torch.randn(sum(lengths), 32, generator=torch.Generator().manual_seed(2)).requires_grad_()
        params = [hidden, *layer.parameters()]
        got = _packed_layer_forward(layer, hidden, from_lengths(lengths))
        want = torch.cat([layer(part[None])[0] for part in hidden.split(lengths)])
        assert_close(got, want, atol=ATOL, what="output")
        names = ["hidden", *(n for n, _ in layer.named_parameters())]
        _assert_grads(_grads(got, params), _grads(want, params), names)

        carried = layer(hidden[None])[0]  # control: the stock layer on the packed row
        assert float((carried - want).detach().abs().max()) > 1e-3


def test_maps_built_under_inference_mode_serve_training():
    """An index map first built under inference_mode (a log-prob pass) is reused by a training step."""
    lengths = [11, 4, 29]  # lengths no other test uses, so the maps are built here first
    inputs = _rule_inputs(lengths, 1, 2)
    x, weight = torch.randn(sum(lengths), 6, requires_grad=True), torch.randn(6, 3)
    with torch.inference_mode():
        packed_gated_delta_rule(*(t.detach() for t in inputs), from_lengths(lengths))
        packed_causal_conv1d(x.detach(), weight, None, from_lengths(lengths))
    _grads(packed_gated_delta_rule(*inputs, from_lengths(lengths)), inputs)
    _grads(packed_causal_conv1d(x, weight, None, from_lengths(lengths)), [x])


class TestBackends:
    def test_cpu_has_only_torch(self):
        x = torch.zeros(3, 4)
        assert available_rule_backends(x) == ["torch"] and available_conv_backends(x) == ["torch"]
        assert select_rule_backend(x) == "torch" and select_conv_backend(x) == "torch"

    @pytest.mark.parametrize("select,name", [(select_rule_backend, "fla"), (select_conv_backend, "causal_conv1d"),
                                             (select_conv_backend, "fla")])
    def test_explicit_backend_that_cannot_run_raises(self, select, name):
        with pytest.raises(InvalidInputError, match=f"backend '{name}' cannot run these inputs"):
            select(torch.zeros(3, 4), name)

    def test_packed_ops_take_an_explicit_backend(self):
        q = torch.randn(5, 1, 4)
        with pytest.raises(InvalidInputError, match="'fla' cannot run"):
            packed_gated_delta_rule(q, q, q, -torch.rand(5, 1), torch.rand(5, 1), from_lengths([5]), backend="fla")


class TestBadInput:
    def test_tokens_must_match_the_boundaries(self):
        with pytest.raises(InvalidInputError, match="do not cover the tokens"):
            packed_causal_conv1d(torch.zeros(5, 4), torch.zeros(4, 3), None, from_lengths([2, 2]))

    def test_unknown_activation(self):
        with pytest.raises(InvalidInputError, match="activation 'gelu' is not supported"):
            packed_causal_conv1d(torch.zeros(4, 4), torch.zeros(4, 3), None, from_lengths([4]), activation="gelu")

    def test_value_heads_must_be_a_multiple_of_key_heads(self):
        q, v = torch.zeros(4, 2, 3), torch.zeros(4, 3, 3)
        with pytest.raises(InvalidInputError, match="Hk | Hv"):
            packed_gated_delta_rule(q, q, v, torch.zeros(4, 3), torch.zeros(4, 3), from_lengths([4]))

    @pytest.mark.parametrize("hk,hv,sp", [(2, 4, 8), (3, 6, 2), (4, 6, 4)])
    def test_heads_that_cannot_split(self, hk, hv, sp):
        with pytest.raises(InvalidInputError, match="cannot split a linear-attention layer"):
            check_linear_heads(LinearHeads(hk, hv, 8, 8), sp, family="qwen3_5")


class TestHeadSplit:
    """Rule: the ranks' conv channels are each head's channels, every head on exactly the ranks that need it."""

    @pytest.mark.parametrize("hk,hv,sp", [(2, 4, 1), (2, 4, 2), (2, 4, 4), (4, 8, 2), (1, 4, 4)])
    def test_channels_follow_heads(self, hk, hv, sp):
        heads = LinearHeads(hk, hv, 3, 2)
        check_linear_heads(heads, sp)
        per_rank = [_conv_channels(heads, sp, r, torch.device("cpu")).tolist() for r in range(sp)]
        local = local_heads(heads, sp)
        assert all(len(c) == local.conv_dim for c in per_rank)
        values = sorted(c for chans in per_rank for c in chans if c >= 2 * heads.key_dim)
        assert values == list(range(2 * heads.key_dim, heads.conv_dim))  # every value channel once
        keys = sorted(c for chans in per_rank for c in chans if c < 2 * heads.key_dim)
        assert keys == sorted(list(range(2 * heads.key_dim)) * max(1, sp // hk))  # key heads repeated sp // Hk


def test_fla_guarded_backward_is_not_offered(monkeypatch):
    """fla's own guard (Hopper, Triton >= 3.4, < 3.7.1, no tilelang) makes 'auto' skip fla rather than crash
    in backward."""
    import importlib.util
    import sys
    import types

    from tfcompat.core import _linear_kernels as kernels

    env = types.SimpleNamespace(TRITON_ABOVE_3_4_0=True, TRITON_ABOVE_3_7_1=False)
    hardware = types.SimpleNamespace(IS_NVIDIA_HOPPER=True)
    for name, mod in {"fla": types.ModuleType("fla"), "fla.utils": types.ModuleType("fla.utils"),
                      "fla.utils.env": env, "fla.utils.hardware": hardware}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tilelang" else real_find_spec(n, *a))
    kernels.fla_rule_refusal.cache_clear()
    try:
        assert "3.7.1" in kernels.fla_rule_refusal()
        env.TRITON_ABOVE_3_7_1 = True
        kernels.fla_rule_refusal.cache_clear()
        assert kernels.fla_rule_refusal() is None
    finally:
        kernels.fla_rule_refusal.cache_clear()
