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
import transformers
from packaging.version import Version

import tfcompat
from tests.helpers import pack
from tfcompat.hf import fused as F
from tfcompat.hf import swiglu_down as SD
from tfcompat.selfcheck import sample_sequences, tiny_model

FAMILIES = ["llama", "qwen2", "qwen3"]


class _Stub:
    """Torch versions of the three Liger ops (same call signatures), counting calls."""

    def __init__(self) -> None:
        self.calls = {"rms_norm": 0, "silu_mul": 0, "swiglu_forward": 0, "swiglu_backward": 0, "rope": 0,
                      "fused_moe": 0}

    def namespace(self) -> types.SimpleNamespace:
        def rms_norm(x, w, eps, offset, casting, in_place):
            self.calls["rms_norm"] += 1
            assert casting == "llama" and offset == 0.0 and in_place is False
            xf = x.float()
            return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

        def silu_mul(a, b):
            self.calls["silu_mul"] += 1
            return torch.nn.functional.silu(a) * b

        def swiglu_forward(a, b):
            self.calls["swiglu_forward"] += 1
            assert a.is_contiguous() and b.is_contiguous()
            return a, b, torch.nn.functional.silu(a) * b

        def swiglu_backward(a, b, dc):  # in place, as Liger's kernel
            self.calls["swiglu_backward"] += 1
            sig = torch.sigmoid(a)
            silu = a * sig
            da = dc * (silu * (1 - sig) + sig) * b
            b.copy_(dc * silu)
            a.copy_(da)
            return a, b

        def rope(q, k, cos, sin, position_ids, unsqueeze_dim):
            self.calls["rope"] += 1
            half = q.shape[-1] // 2
            rot = lambda x: torch.cat((-x[..., half:], x[..., :half]), -1)  # noqa: E731
            c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
            return q * c + rot(q) * s, k * c + rot(k) * s

        def fused_moe(x, w1, w2, index, weights):
            self.calls["fused_moe"] += 1
            assert x.ndim == 2 and x.dtype == w1.dtype and index.dtype == torch.int32 and index.shape == weights.shape
            out = torch.zeros(x.shape, dtype=torch.float32)
            for e in range(w1.shape[0]):
                token, k = torch.where(index == e)
                gate, up = torch.nn.functional.linear(x[token], w1[e]).chunk(2, dim=-1)
                y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e])
                out = out.index_add(0, token, y.float() * weights[token, k, None].float())
            return out.to(x.dtype)

        return types.SimpleNamespace(rms_norm=rms_norm, silu_mul=silu_mul, swiglu_forward=swiglu_forward,
                                     swiglu_backward=swiglu_backward, rope=rope, fused_moe=fused_moe)


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
    assert stub.calls["swiglu_forward"] == 1 and stub.calls["silu_mul"] == 0


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
        # the activation once in the forward, once in the backward (one row block): the MLPs' saved tensors are
        # their gate and up outputs, not the activation
        assert stub.calls["swiglu_forward"] == 2 * layers and stub.calls["swiglu_backward"] == layers
        assert stub.calls["silu_mul"] == 0 and stub.calls["rope"] == layers
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


def _swiglu_case(rows: int = 37, width: int = 24, hidden: int = 16):
    """The leaves a0, b0 ``(1, rows, width)``, the down weight ``(hidden, width)`` and bias, float64, and a function
    giving a, b as a projection's outputs (non-leaf; a fresh graph per call) and the weight and bias."""
    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
              for shape in ((1, rows, width), (1, rows, width), (hidden, width), (hidden,))]
    return leaves, lambda: (leaves[0] * 1.0, leaves[1] * 1.0, leaves[2], leaves[3])


@pytest.mark.parametrize("block_rows", [None, 5, 1])
def test_swiglu_down_is_silu_mul_then_linear(stub, monkeypatch, block_rows):
    """Rule: the two-node down projection gives F.linear(silu(a) * b, W, bias) and its gradients for a, b, W and
    the bias, in one row block and in several (the weight's gradient summed over them, remainder block included)."""
    if block_rows is not None:
        monkeypatch.setattr(SD, "BLOCK_ELEMENTS", 24 * block_rows)
    leaves, inputs = _swiglu_case()
    dy = torch.randn(1, 37, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    a, b, w, bias = inputs()
    want = torch.nn.functional.linear(torch.nn.functional.silu(a) * b, w, bias)
    want_grads = torch.autograd.grad(want, leaves, dy)
    got = SD.swiglu_down(*inputs(), stub.namespace())
    got_grads = torch.autograd.grad(got, leaves, dy)
    torch.testing.assert_close(got, want)
    for g, r in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, r)
    assert stub.calls["swiglu_backward"] == (1 if block_rows is None else -(-37 // block_rows))


def test_swiglu_down_holds_gate_and_up_outputs_only(stub):
    """Rule: from the forward to the backward the down projection holds a, b and its weight, not the activation
    (Liger's SiLUMul + linear hold it too: one more (T, I) tensor)."""
    a, b, w, bias = _swiglu_case()[1]()
    packed: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        SD.swiglu_down(a, b, w, bias, stub.namespace())
    assert [t.data_ptr() for t in packed] == [a.data_ptr(), b.data_ptr(), w.data_ptr()]


def test_swiglu_down_allows_one_backward(stub):
    """Rule: a second backward through the same forward raises (the first overwrote a and b with their
    gradients), instead of computing from gradients."""
    y = SD.swiglu_down(*_swiglu_case()[1](), stub.namespace())
    y.sum().backward(retain_graph=True)
    with pytest.raises(tfcompat.errors.PatchedModelError, match="one backward per forward"):
        y.sum().backward()


def _checkpointed_against_unfused(stub, **patch_kwargs) -> None:
    """A checkpointed qwen2 (non-reentrant) patched with fused SwiGLU and ``patch_kwargs``: the activation ran
    twice per layer (the forward and the backward's block, not in the recompute) and the gradients are the
    unfused patch's with full recompute."""
    model = tiny_model("qwen2").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inputs = _inputs(model)
    with tfcompat.patch(model):
        model(**inputs, use_cache=False).logits.square().mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with tfcompat.patch(model, fused=("swiglu",), **patch_kwargs):
        model(**inputs, use_cache=False).logits.square().mean().backward()
    layers = model.config.num_hidden_layers
    assert stub.calls["swiglu_forward"] == 2 * layers and stub.calls["swiglu_backward"] == layers
    for n, p in model.named_parameters():
        if n in want:
            torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=n)


def test_checkpoint_recompute_stops_before_the_activation(stub):
    """Rule: under non-reentrant gradient checkpointing the layer's recompute stops at the MLP's saved gate and up
    outputs: the activation runs once in the forward and once in the backward per layer (three times if the
    recompute ran it), and the gradients are the unfused model's."""
    _checkpointed_against_unfused(stub)


@pytest.mark.parametrize(("keep", "offload", "fetch"), [
    (("attention", "mlp"), False, "recompute"), (("attention", "mlp"), True, "recompute"),
    ({"attention": 1.0, "mlp_in": 1.0}, False, "recompute"), ({"attention": 1.0, "mlp_in": 1.0}, True, "recompute"),
    ({"attention": 1.0, "mlp_in": 1.0}, True, "mlp_in"), ({"attention": 1.0, "mlp_in": 1.0}, True, "attention")])
def test_swiglu_down_under_kept_and_offloaded_mlp(stub, keep, offload, fetch):
    """Rule: with the MLP or its gate / up outputs kept through checkpointing (held, or offloaded and brought back,
    the next layers' copies fetched at the recompute, at gate / up's gradient or at the attention's) the two-node
    down projection gives full checkpointing's gradients, and the kept MLP's recompute runs no activation."""
    _checkpointed_against_unfused(stub, checkpoint_keep=keep, checkpoint_offload=offload, checkpoint_fetch=fetch)


def test_swiglu_down_only_where_it_computes_the_module_call():
    """Rule: the two-node path is taken for a plain Linear with a gradient wanted, and not without a gradient, under
    autocast, with a hook, a subclass (a LoRA-like wrapper) or weights of another dtype."""
    down = torch.nn.Linear(8, 4, bias=False)
    a, b = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    assert SD.usable(down, a, b)
    with torch.no_grad():
        assert not SD.usable(down, a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not SD.usable(down, a, b)
    assert not SD.usable(down, a.double(), b.double())

    class Wrapped(torch.nn.Linear):
        pass

    assert not SD.usable(Wrapped(8, 4), a, b)
    handle = down.register_forward_pre_hook(lambda m, i: None)
    assert not SD.usable(down, a, b)
    handle.remove()
    assert SD.usable(down, a, b)


def test_a_down_projection_with_a_hook_keeps_its_call(stub):
    """Rule: a down projection that is not a plain Linear call (a forward hook here; a LoRA or quantized layer
    alike) is called as it is, after the SiLUMul kernel, so what it adds is not skipped."""
    model = tiny_model("llama")
    seen = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with tfcompat.patch(model, fused=("swiglu",)):
        model(**_inputs(model), use_cache=False).logits.sum().backward()
    layers = model.config.num_hidden_layers
    assert len(seen) == 1 and stub.calls["silu_mul"] == 1 and stub.calls["swiglu_backward"] == layers - 1


MOE = ["qwen3_moe", "mixtral"]
needs_experts_modules = pytest.mark.skipif(
    Version(transformers.__version__).major < 5, reason="MoE experts modules (@use_experts_implementation) are 5.x")


def _experts(model):
    return [m for m in F.plan(model, ("experts",))]


@needs_experts_modules
@pytest.mark.parametrize("family", MOE)
def test_plan_finds_moe_experts_exact(family):
    """Rule: the experts modules of transformers' @use_experts_implementation classes (gate/up concatenated,
    SiLU, no biases) are in the form Liger's fused MoE computes, under grouped_mm and under eager."""
    model = tiny_model(family)
    found = _experts(model)
    assert found and not [m.why for m in found if m.why]
    model.config._experts_implementation = "eager"
    assert not [m.why for m in _experts(model) if m.why]


@needs_experts_modules
def test_plan_refuses_experts_the_kernel_would_not_compute():
    """Rule: an experts module is refused, with the reason, when its gate, activation, eager loop or experts
    implementation differs from what the kernel computes (non-vacuity: one change each on an exact model)."""
    model = tiny_model("qwen3_moe")
    first, second = (m.module for m in _experts(model))
    second.act_fn = torch.nn.GELU()
    assert "not SiLU" in _experts(model)[1].why

    class ClampedGate(type(first)):
        def _apply_gate(self, gate_up_out):
            gate, up = gate_up_out.chunk(2, dim=-1)
            return self.act_fn(gate.clamp(max=7.0)) * up

    first.__class__ = ClampedGate
    assert "own _apply_gate" in _experts(model)[0].why
    first.__class__ = type(second)
    first.has_bias = True
    assert "has_bias=True" in _experts(model)[0].why
    first.has_bias = False
    model.config._experts_implementation = "sonicmoe"
    assert "'sonicmoe'" in _experts(model)[0].why

    model.config._experts_implementation = "eager"
    wrapped = type(first).forward

    def other_loop(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states * top_k_weights.sum(-1, keepdim=True)

    type(first).forward = other_loop
    try:
        assert "not the eager experts loop" in _experts(model)[0].why
    finally:
        type(first).forward = wrapped


@needs_experts_modules
def test_fused_moe_routes_bf16_experts_and_leaves_float32_stock(stub):
    """Rule: in bf16 every experts call of the packed forward goes through the kernel (counted) and gives the
    unfused model's logits and gradients within bf16 rounding; with float32 weights the experts run stock (the
    kernel would compute TF32), so the fused model's logits are the unfused ones exactly; in deterministic mode
    and in an experts module made expert-parallel after the patch the experts run stock too."""
    model = tiny_model("qwen3_moe")
    inputs = _inputs(model)
    with tfcompat.patch(model, fused=("experts",)):
        got32 = model(**inputs, use_cache=False).logits
    assert stub.calls["fused_moe"] == 0
    with tfcompat.patch(model):
        torch.testing.assert_close(model(**inputs, use_cache=False).logits, got32, rtol=0, atol=0)

    model.to(torch.bfloat16)
    torch.use_deterministic_algorithms(True)
    try:
        with tfcompat.patch(model, fused=("experts",)):
            model(**inputs, use_cache=False)
    finally:
        torch.use_deterministic_algorithms(False)
    assert stub.calls["fused_moe"] == 0  # the kernel's router gradient sums by atomics: stock when deterministic
    experts = [m.module for m in _experts(model)]
    with tfcompat.patch(model, fused=("experts",)):
        experts[0]._is_expert_parallel = True  # expert parallel set up after the patch: its routes hold sentinels
        model(**inputs, use_cache=False)
    experts[0]._is_expert_parallel = False
    assert stub.calls["fused_moe"] == len(experts) - 1
    stub.calls["fused_moe"] = 0
    runs = {}
    for fused in (False, ("experts",)):
        model.zero_grad()
        with tfcompat.patch(model, fused=fused) as handle:
            logits = model(**inputs, use_cache=False).logits.float()
            logits.square().mean().backward()
            notes = [r.note for r in handle.records]
        runs[bool(fused)] = logits, {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    assert stub.calls["fused_moe"] == len(_experts(model)) and any("fused MoE" in n for n in notes)
    (want, want_grads), (got, got_grads) = runs[False], runs[True]
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert want_grads.keys() == got_grads.keys() and any("experts.gate_up_proj" in n for n in got_grads)
    for n, g in got_grads.items():
        err = float((g - want_grads[n]).norm()) / max(float(want_grads[n].norm()), 1e-12)
        assert err < 3e-2, (n, err)
