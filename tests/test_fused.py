"""`patch(model, fused=...)`: which modules Liger's kernels may replace, the records, undo and refusals.

Liger-Kernel's kernels are Triton and do not run on CPU (Triton's interpreter fails on liger-kernel 0.8.5's
scalar casts), so here the kernels are stand-ins that compute the forms in torch and count their calls: what is
tested is the wiring (each module of a kind routed through its kernel, the rotary only inside the fused model's
attention, every change undone). The kernels themselves against the unfused model: tests/gpu/test_fused_cuda.py.
"""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch

import tfcompat
from tests.helpers import pack
from tfcompat.hf import fused as F
from tfcompat.selfcheck import sample_sequences, tiny_model

FAMILIES = ["llama", "qwen2", "qwen3"]


class _Stub:
    """Torch versions of the three Liger ops (same call signatures), counting calls."""

    def __init__(self) -> None:
        self.calls = {"rms_norm": 0, "silu_mul": 0, "rope": 0}

    def namespace(self) -> types.SimpleNamespace:
        def rms_norm(x, w, eps, offset, casting, in_place):
            self.calls["rms_norm"] += 1
            assert casting == "llama" and offset == 0.0 and in_place is False
            xf = x.float()
            return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

        def silu_mul(a, b):
            self.calls["silu_mul"] += 1
            return torch.nn.functional.silu(a) * b

        def rope(q, k, cos, sin, position_ids, unsqueeze_dim):
            self.calls["rope"] += 1
            half = q.shape[-1] // 2
            rot = lambda x: torch.cat((-x[..., half:], x[..., :half]), -1)  # noqa: E731
            c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
            return q * c + rot(q) * s, k * c + rot(k) * s

        return types.SimpleNamespace(rms_norm=rms_norm, silu_mul=silu_mul, rope=rope)


@pytest.fixture
def stub(monkeypatch):
    s = _Stub()
    ns = s.namespace()
    monkeypatch.setattr(F, "_liger", lambda: ns)
    return s


def _inputs(model):
    seqs = sample_sequences(model, [5, 9, 3], [None] * 3, seed=3)
    return pack(model, seqs)


def _modeling(model):
    return sys.modules[type(model).__module__]


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_finds_every_norm_mlp_and_rotary_exact(family):
    """Rule: on this transformers every RMSNorm (qwen3's q/k norms too), MLP and the rotary of these families
    are in the forms Liger's kernels compute."""
    model = tiny_model(family)
    found = F.plan(model)
    kinds = {k: [m for m in found if m.kernel == k] for k in F.KERNELS}
    layers = model.config.num_hidden_layers
    norms = 2 * layers + 1 + (2 * layers if family == "qwen3" else 0)
    assert len(kinds["rms_norm"]) == norms and len(kinds["swiglu"]) == layers and len(kinds["rope"]) == layers
    assert not [m for m in found if m.why], [(m.name, m.why) for m in found if m.why]


def test_plan_refuses_a_changed_forward():
    """Rule: a module whose computation differs from the kernel's form is refused, with the reason (non-vacuity
    of the form check: the same class with one operation changed)."""
    model = tiny_model("llama")
    norm = model.model.norm

    class ShiftedRMSNorm(type(norm)):
        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return (self.weight + 1) * hidden_states.to(input_dtype)

    norm.__class__ = ShiftedRMSNorm
    mlp = model.model.layers[0].mlp
    mlp.act_fn = torch.nn.GELU()
    why = {m.name: m.why for m in F.plan(model) if m.why}
    assert set(why) == {"model.norm", "model.layers.0.mlp"}
    assert "neither the llama nor the gemma" in why["model.norm"] and "not SiLU" in why["model.layers.0.mlp"]


def test_explicit_request_refuses_non_exact_module_and_auto_skips_it(stub):
    """Rule: fused=True raises PatchError naming the module that is not exact and changes nothing; "auto" fuses
    the others and leaves it stock."""
    model = tiny_model("llama")
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    forwards = {n: vars(m).get("forward") for n, m in model.named_modules()}
    with pytest.raises(tfcompat.PatchError, match=r"'swiglu' is not exact for model.layers.1.mlp"):
        tfcompat.patch(model, fused=True)
    assert not tfcompat.is_patched(model)
    assert {n: vars(m).get("forward") for n, m in model.named_modules()} == forwards
    with tfcompat.patch(model, fused="auto"):
        assert "forward" in vars(model.model.layers[0].mlp) and "forward" not in vars(model.model.layers[1].mlp)
        model(**_inputs(model), use_cache=False)
    assert stub.calls["silu_mul"] == 1


def test_unknown_kernel_names_are_refused():
    model = tiny_model("llama")
    with pytest.raises(tfcompat.PatchError, match="unknown fused kernels"):
        tfcompat.patch(model, fused=("rms_norm", "geglu"))
    with pytest.raises(tfcompat.PatchError, match="unknown fused option"):
        tfcompat.patch(model, fused="yes")


def test_without_liger_explicit_raises_and_auto_is_a_no_op(monkeypatch):
    """Rule: without liger-kernel, fused=True is a PatchError at patch time and fused='auto' fuses nothing."""
    monkeypatch.setattr(F, "_liger", lambda: None)
    model = tiny_model("qwen2")
    with pytest.raises(tfcompat.PatchError, match="need liger-kernel"):
        tfcompat.patch(model, fused=("rms_norm",))
    with tfcompat.patch(model, fused="auto") as h:
        assert not [r for r in h.records if "Liger" in r.note]


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_forward_routes_every_module_and_matches_unfused(stub, family):
    """Rule: a fused patch sends every norm, MLP and rotary of the packed forward through the kernels (counted),
    gives the unfused patched logits and gradients (the stand-ins compute the same forms), and undo restores
    every forward and the modeling module's apply_rotary_pos_emb."""
    model = tiny_model(family)
    inputs = _inputs(model)
    modeling = _modeling(model)
    original_rope = modeling.apply_rotary_pos_emb
    with tfcompat.patch(model):
        want = model(**inputs, use_cache=False).logits
        want.square().mean().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with tfcompat.patch(model, fused=True) as handle:
        assert modeling.apply_rotary_pos_emb is not original_rope
        got = model(**inputs, use_cache=False).logits
        got.square().mean().backward()
        layers = model.config.num_hidden_layers
        assert stub.calls["silu_mul"] == layers and stub.calls["rope"] == layers
        assert stub.calls["rms_norm"] == 2 * layers + 1 + (2 * layers if family == "qwen3" else 0)
        # outside the fused model's attention the original rotary runs (no kernel call)
        q = torch.randn(1, 2, 3, 16)
        cos = torch.randn(1, 3, 16)
        modeling.apply_rotary_pos_emb(q, q, cos, cos)
        assert stub.calls["rope"] == layers
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        if n in want_grads:
            torch.testing.assert_close(p.grad, want_grads[n], rtol=1e-5, atol=1e-6, msg=n)
    assert modeling.apply_rotary_pos_emb is original_rope
    assert not [n for n, m in model.named_modules() if "forward" in vars(m)]
    assert [r for r in handle.records if r.scope == "process" and r.attr == "apply_rotary_pos_emb"]


def test_rotary_swap_is_reference_counted_and_deepcopy_is_fused(stub):
    """Rule: two fused models share one swap of apply_rotary_pos_emb, restored when the last is undone; a deep
    copy of a fused model is fused alike (its own handle)."""
    a, b = tiny_model("llama"), tiny_model("llama")
    modeling = _modeling(a)
    original = modeling.apply_rotary_pos_emb
    ha = tfcompat.patch(a, fused=True)
    hb = tfcompat.patch(b, fused=True)
    c = copy.deepcopy(a)
    assert tfcompat.is_patched(c) and "forward" in vars(c.model.norm)
    ha.undo()
    assert modeling.apply_rotary_pos_emb is not original
    hb.undo()
    assert modeling.apply_rotary_pos_emb is not original  # the copy's handle still holds it
    vars(c)["_tfcompat_handle"].undo()
    assert modeling.apply_rotary_pos_emb is original
