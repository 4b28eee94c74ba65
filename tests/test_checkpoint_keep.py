"""`patch(model, checkpoint_keep=...)`: module outputs kept through gradient checkpointing, not recomputed.

The oracle is the unpatched model run per sequence under full gradient checkpointing; the patched packed model
with kept outputs must give the same loss and every gradient, and must not run the kept modules again in the
backward (counted).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import tfcompat
from tests.helpers import pack, record_kept_outputs
from tfcompat.errors import PatchedModelError
from tfcompat.hf import attention as hf_attention
from tfcompat.hf import checkpointing, kept_inputs, offload
from tfcompat.registry.derive import causal_lm_types
from tfcompat.registry.versions import installed_transformers
from tfcompat.selfcheck import sample_sequences, tiny_model

LENGTHS = [5, 9, 3]
NON_REENTRANT = {"use_reentrant": False}


def _model(family: str, checkpointing: bool = True, attn: str = "sdpa") -> torch.nn.Module:
    model = tiny_model(family, attn, num_hidden_layers=3).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    return model


def _loss(logits: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """logits: ``(T, V)``; weight ``(T, V)``: a fixed random projection, so every token's gradient differs."""
    return (logits.float() * weight).sum()


class _Counter:
    """Calls of the packed attention's core, of each layer's q projection and of its gate projection's forward,
    split by forward and backward (a call while autograd's engine runs = a recompute)."""

    def __init__(self, model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = {"attention": [0, 0], "q_proj": [0, 0], "gate_proj": [0, 0]}
        core = hf_attention.varlen_attention

        def counted(*args, **kwargs):
            self._count("attention")
            return core(*args, **kwargs)

        monkeypatch.setattr(hf_attention, "varlen_attention", counted)
        for name, module in model.named_modules():
            if name.endswith("q_proj"):
                module.register_forward_hook(lambda *_: self._count("q_proj"))
            if name.endswith("gate_proj"):  # its forward, not its call: "mlp_in" calls it and returns the kept output
                module.forward = self._counted(module.forward, "gate_proj")

    def _counted(self, forward, what):
        def counted(*args, **kwargs):
            self._count(what)
            return forward(*args, **kwargs)
        return counted

    def _count(self, what: str) -> None:
        self.calls[what][int(torch._C._current_graph_task_id() != -1)] += 1


@pytest.mark.parametrize(("family", "keep", "attention_kept", "gate_kept"), [
    ("qwen2", "attention", 3, 0), ("qwen2", "mlp", 0, 3), ("qwen2", ("attention", "mlp"), 3, 3),
    ("llama", ("attention", "mlp"), 3, 3), ("qwen3", "attention", 3, 0), ("qwen2", "mlp_in", 0, 3),
    ("llama", {"attention": 2, "mlp_in": 1.0}, 2, 3), ("qwen2", {"attention": 0.5, "mlp": 1, "mlp_in": 2}, 2, 2),
    ("qwen3", {"mlp": 1, "mlp_in": 1.0}, 0, 3)])
def test_kept_outputs_give_the_stock_gradients_and_skip_the_recompute(family, keep, attention_kept, gate_kept,
                                                                     monkeypatch):
    """Rule: with checkpoint_keep, the loss and every gradient equal the unpatched model's per sequence (fp32), and
    the kept modules run once per layer in the forward and never in the backward, in the layers the policy selects
    (a count or fraction per kind; "mlp_in" keeps the gate projection too); the control (no keep) runs them again
    in the backward, so the count can fail."""
    layers = 3
    stock = _model(family)
    seqs = sample_sequences(stock, LENGTHS, [None] * 3, seed=4)
    weight = torch.randn(sum(LENGTHS), stock.config.vocab_size, generator=torch.Generator().manual_seed(5))
    loss = 0.0
    start = 0
    for s in seqs:  # the oracle: stock, one sequence at a time
        n = s.input_ids.shape[1]
        out = stock(input_ids=s.input_ids, use_cache=False).logits[0]
        part = _loss(out, weight[start:start + n])
        part.backward()
        loss += part.item()
        start += n
    expected = {n: p.grad for n, p in stock.named_parameters() if p.grad is not None}

    full = None
    for kept in ((), keep):  # the control without kept outputs (full recompute), then the patch under test
        model = _model(family)
        counter = _Counter(model, monkeypatch)
        with tfcompat.patch(model, checkpoint_keep=kept):
            got = _loss(model(**pack(model, seqs), use_cache=False).logits[0], weight)
            got.backward()
        calls = counter.calls
        torch.testing.assert_close(float(got), loss, rtol=1e-5, atol=1e-5)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads.keys() == expected.keys()
        for name, g in grads.items():  # packed vs per sequence: per element within 1e-5 of the tensor's scale
            scale = float(expected[name].abs().max())
            torch.testing.assert_close(g, expected[name], rtol=1e-5, atol=1e-5 * scale,
                                       msg=lambda m, name=name: f"{name}: {m}")
            if full is not None:  # the same kernels on the same values as full recompute
                torch.testing.assert_close(g, full[name], rtol=1e-6, atol=1e-7 * scale,
                                           msg=lambda m, name=name: f"{name} vs full recompute: {m}")
        full = grads
        recomputed_attention = layers - attention_kept if kept else layers
        assert calls["attention"] == [layers, recomputed_attention], (kept, calls)
        assert calls["q_proj"] == [layers, recomputed_attention], (kept, calls)
        assert calls["gate_proj"] == [layers, layers - gate_kept if kept else layers], (kept, calls)


@pytest.mark.parametrize(("family", "attn", "packed", "keep"), [
    ("qwen2", "sdpa", False, ("attention", "mlp")), ("qwen3_moe", "sdpa", True, ("attention", "mlp")),
    ("gpt_oss", "eager", True, ("attention", "mlp")), ("phi3", "sdpa", True, "mlp_in"),
    ("qwen2", "sdpa", False, {"attention": 1, "mlp_in": 1.0})])
def test_equal_to_full_checkpointing_on_ordinary_calls_moe_and_sinks(family, attn, packed, keep):
    """Rule: kept outputs give full checkpointing's gradients on the stock path too (an unpacked batch of a patched
    model), for MoE blocks (qwen3_moe, gpt_oss: tuple outputs, routers), with sinks and sliding windows (gpt_oss), and
    for "mlp_in" on a fused gate/up projection (phi3's gate_up_proj); the control is the same patch without kept
    outputs, and each kind must have kept a module (not a vacuous patch)."""
    if family not in causal_lm_types():
        pytest.skip(f"transformers {installed_transformers()} ships no {family}")

    def grads(keep):
        model = _model(family, attn=attn)
        if packed:
            inputs = pack(model, sample_sequences(model, LENGTHS, [None] * 3, seed=4))
        else:
            inputs = {"input_ids": torch.randint(0, model.config.vocab_size, (2, 7),
                                                 generator=torch.Generator().manual_seed(1))}
        with tfcompat.patch(model, checkpoint_keep=keep) as handle:
            for kind in [keep] if isinstance(keep, str) else keep:
                assert f"kept through gradient checkpointing ({kind})" in handle.explain(), kind
            model(**inputs, use_cache=False).logits.float().pow(2).mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    full, kept = grads(()), grads(keep)
    assert kept.keys() == full.keys()
    for name in full:
        torch.testing.assert_close(kept[name], full[name], rtol=1e-6, atol=1e-7 * float(full[name].abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_activation_checkpointing_every_n_layers():
    """Rule: transformers' activation_checkpointing_enable (5.25+) with every_n_layers is the checkpointing
    checkpoint_keep extends: only the checkpointed layers keep (counted) and the gradients are full checkpointing's.
    (Its offload=True pins host memory, which a CPU-only torch refuses in transformers' own code.)"""
    if not hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable"):
        pytest.skip(f"transformers {installed_transformers()} has no activation_checkpointing_enable")
    inputs = None

    def grads(keep):
        nonlocal inputs
        model = _model("qwen2", checkpointing=False)
        model.activation_checkpointing_enable(every_n_layers=2, offload=torch.cuda.is_available())
        inputs = inputs or pack(model, sample_sequences(model, LENGTHS, [None] * 3, seed=4))
        with tfcompat.patch(model, checkpoint_keep=keep):
            kept = [layer for layer in model.model.layers if "forward" in vars(layer.self_attn)]
            model(**inputs, use_cache=False).logits.float().pow(2).mean().backward()
        return kept, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (_, full), (kept, got) = grads(()), grads("attention")
    assert len(kept) == 2  # layers 0 and 2 checkpointed
    for name in full:
        torch.testing.assert_close(got[name], full[name], rtol=1e-6, atol=1e-7 * float(full[name].abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


def _count_recomputed_inputs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A one-item counter of the kept modules' saved inputs read back from the recompute (`_Input.unpack`)."""
    unpack = kept_inputs._Input.unpack
    recomputed = [0]

    def counted(self):
        recomputed[0] += 1
        return unpack(self)

    monkeypatch.setattr(kept_inputs._Input, "unpack", counted)
    return recomputed


@pytest.mark.parametrize(("keep", "to_host"), [("attention", False), ("attention", True), ("mlp_in", False),
                                              (("attention", "mlp"), True)])
def test_a_kept_modules_input_is_recomputed_not_held(keep, to_host, monkeypatch):
    """Rule: what a kept module saves on the storage of its own input (the projections' input) is neither held nor
    offloaded: it comes back from the layer's recompute, with full checkpointing's gradients bit for bit; the
    control (every saved tensor held, as before) holds those inputs, so the check can fail."""
    def run(keep, substitute=True):
        model = _model("llama")
        inputs = pack(model, sample_sequences(model, LENGTHS, [None] * 3, seed=4))
        live: list[set[int]] = []  # the storages of the kept modules' inputs, innermost call last
        held_inputs = [0]

        def enter(module, args, kwargs):
            if torch._C._current_graph_task_id() == -1:
                live.append({t.untyped_storage().data_ptr() for t in [*args, *kwargs.values()]
                             if isinstance(t, torch.Tensor) and t.requires_grad})

        def leave(module, args, kwargs, out):
            if torch._C._current_graph_task_id() == -1:
                live.pop()

        for name, m in model.named_modules():
            if name.endswith(("self_attn", "mlp", "gate_proj", "up_proj")):
                m.register_forward_pre_hook(enter, with_kwargs=True)
                m.register_forward_hook(leave, with_kwargs=True)

        def watched(pack):
            def packed(*args):
                t = args[-1]
                held_inputs[0] += bool(live) and t.untyped_storage().data_ptr() in set().union(*live)
                return pack(*args)
            return packed

        monkeypatch.setattr(checkpointing, "_hold", watched(checkpointing._hold))
        monkeypatch.setattr(offload.Stash, "pack", watched(offload.Stash.pack))
        if not substitute:
            monkeypatch.setattr(kept_inputs.Inputs, "pack", lambda self, pack: pack)
        recomputed = _count_recomputed_inputs(monkeypatch)
        with tfcompat.patch(model, checkpoint_keep=keep, checkpoint_offload=to_host if keep else False):
            model(**inputs, use_cache=False).logits.float().pow(2).mean().backward()
        monkeypatch.undo()
        return {n: p.grad for n, p in model.named_parameters()}, held_inputs[0], recomputed[0]

    full, _, _ = run(())
    grads, held, recomputed = run(keep)
    assert held == 0 and recomputed > 0, (held, recomputed)
    for name in full:
        assert torch.equal(grads[name], full[name]), name
    _, held, recomputed = run(keep, substitute=False)  # the control
    assert held > 0 and recomputed == 0, (held, recomputed)


@pytest.mark.parametrize(("family", "keep"), [
    ("cohere", {"attention": 1.0, "mlp_in": 1.0}), ("gpt_neox", ("attention", "mlp")), ("phi", ("attention", "mlp")),
    ("deepseek_v3", {"attention": 1.0, "mlp_in": 1.0}), ("olmo2", {"attention": 1.0, "mlp_in": 1.0}),
    ("gemma2", ("attention", "mlp")), ("mixtral", ("attention", "mlp")), ("minimax", ("attention", "mlp"))])
def test_derived_layouts_recompute_the_inputs_exactly(family, keep, monkeypatch):
    """Rule: on layers of other layouts (parallel attention and MLP: cohere, gpt_neox, phi; multi-head latent
    attention: deepseek_v3; norms after the modules: olmo2, gemma2; routed experts: mixtral; a hybrid stack:
    minimax) the kept modules' inputs come back from the recompute and the gradients are full checkpointing's."""
    if family not in causal_lm_types():
        pytest.skip(f"transformers {installed_transformers()} ships no {family}")
    recomputed = _count_recomputed_inputs(monkeypatch)

    def grads(keep):
        model = _model(family, attn="eager" if family == "gemma2" else "sdpa")
        inputs = pack(model, sample_sequences(model, LENGTHS, [None] * 3, seed=4))
        with tfcompat.patch(model, checkpoint_keep=keep):
            model(**inputs, use_cache=False).logits.float().pow(2).mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    full = grads(())
    assert recomputed[0] == 0
    kept = grads(keep)
    assert recomputed[0] > 0
    assert kept.keys() == full.keys()
    for name in full:
        torch.testing.assert_close(kept[name], full[name], rtol=1e-6, atol=1e-7 * float(full[name].abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("keep", ["attention", {"attention": 2}])
def test_a_kept_module_that_draws_random_numbers_leaves_the_layers_later_draws_as_in_the_forward(keep, monkeypatch):
    """Rule: in train mode with a dropout inside the kept module (Starcoder2's residual dropout in its attention),
    the recompute skips the module but the layer's later draws (the MLP's residual dropout) get the forward's random
    numbers: the gradients equal full checkpointing's with the same seed. The control (generators not moved past
    the skipped module) gives other masks, so the test can fail."""
    def grads(keep, restore=True):
        model = tiny_model("starcoder2", "sdpa", num_hidden_layers=3, residual_dropout=0.1).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
        inputs = pack(model, sample_sequences(model, LENGTHS, [None] * 3, seed=4))
        if not restore:
            monkeypatch.setattr(checkpointing._Rng, "restore", lambda self: None)
        with tfcompat.patch(model, checkpoint_keep=keep):
            torch.manual_seed(7)
            model(**inputs, use_cache=False).logits.float().pow(2).mean().backward()
        monkeypatch.undo()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    full = grads(())
    kept = grads(keep)
    for name in full:
        torch.testing.assert_close(kept[name], full[name], rtol=1e-6, atol=1e-7 * float(full[name].abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")
    control = grads(keep, restore=False)
    assert any(not torch.allclose(control[n], full[n], rtol=1e-3, atol=1e-5) for n in full)


def test_an_input_recomputed_on_another_layout_is_an_error():
    """Rule: a kept module's input that the recompute gives back on a storage of another size (the layer did not
    reproduce its forward) raises PatchedModelError when read, rather than handing out a wrong view."""
    x = torch.randn(4, 8, requires_grad=True)
    source = kept_inputs._Recomputed(kept_inputs._Save.apply(x), x.untyped_storage().nbytes() * 2, 0)
    with pytest.raises(PatchedModelError, match="recompute"):
        source.value()
    assert torch.equal(kept_inputs._Recomputed(kept_inputs._Save.apply(x), x.untyped_storage().nbytes(), 0)
                       .value(), x)


def test_an_input_written_in_place_is_held_not_recomputed():
    """Rule: a tensor saved on a kept module's input after the module wrote that input in place is held as it is
    (the recompute would give the value before the write); views saved before the write, and other tensors, take
    their usual paths."""
    base = torch.randn(4, 8, requires_grad=True)
    x = base * 1.0  # a non-leaf input that requires grad
    inputs = kept_inputs.Inputs((x,), {"scale": 2.0})
    held = []
    pack = inputs.pack(lambda t: held.append(t) or t)
    assert isinstance(pack(x[1:]), kept_inputs._Input) and held == []
    other = torch.randn(3)
    assert pack(other) is other and held == [other]
    x.mul_(2)
    assert pack(x) is x and held == [other, x]


def test_mlp_in_leaves_no_mlp_matmul_to_recompute(monkeypatch):
    """Rule: with "mlp_in" the backward completes no matmul of the MLP (the gate / up projections are kept, and the
    recompute stops at the down projection's input, its last saved tensor); the control (full recompute) completes
    the gate and up matmuls of every layer in the backward, and also stops before the down projection's."""
    linear = torch.nn.functional.linear

    def run(keep):
        model = _model("qwen2")
        cfg = model.config
        shapes = {(cfg.intermediate_size, cfg.hidden_size): "gate/up", (cfg.hidden_size, cfg.intermediate_size): "down"}
        done = {"gate/up": 0, "down": 0}

        def counted(x, w, b=None):
            out = linear(x, w, b)
            if torch._C._current_graph_task_id() != -1 and tuple(w.shape) in shapes:
                done[shapes[tuple(w.shape)]] += 1  # completed in the backward: a recomputed matmul
            return out

        monkeypatch.setattr(torch.nn.functional, "linear", counted)
        inputs = pack(model, sample_sequences(model, LENGTHS, [None] * 3, seed=4))
        with tfcompat.patch(model, checkpoint_keep=keep):
            model(**inputs, use_cache=False).logits.float().pow(2).mean().backward()
        monkeypatch.setattr(torch.nn.functional, "linear", linear)
        return done

    assert run(()) == {"gate/up": 2 * 3, "down": 0}
    assert run("mlp_in") == {"gate/up": 0, "down": 0}


@pytest.mark.parametrize("to_host", [False, True])
@pytest.mark.parametrize("retain", [False, True])
def test_kept_outputs_go_with_the_recompute_unless_the_graph_is_retained(to_host, retain, monkeypatch):
    """Rule: a layer lets its kept outputs go once its recompute has taken them (what the backward still needs of
    them, the recompute's saved tensors hold): when the gradient reaches a layer's MLP input, its holder is gone and
    its gate / up outputs are freed (held on the GPU: their storages expire); layers the backward has not reached
    hold theirs. Under ``retain_graph`` they stay, and the second backward (which recomputes again) gives the first's
    gradients bit for bit; a third, through a graph not retained, is refused by torch."""
    from torch.multiprocessing.reductions import StorageWeakRef

    monkeypatch.setattr(offload, "MIN_BYTES", 0)
    model = _model("qwen2")
    inputs = pack(model, sample_sequences(model, LENGTHS, [None] * 3, seed=4))
    made = record_kept_outputs(monkeypatch)
    seen: list[tuple[int, list[bool], list[bool]]] = []
    storages: dict[int, list[StorageWeakRef]] = {}

    def at_input_grad(i):
        def hook(module, args):
            if i not in forwards:  # the forward's call, not the recompute's (whose graph is never run)
                forwards.add(i)
                args[0].register_hook(lambda g: seen.append(
                    (i, [r() is None for r in made], [r.expired() for r in storages[i]])) and None)
        return hook

    def stored(i):
        def hook(module, args, out):
            if len(storages.setdefault(i, [])) < 2:
                storages[i].append(StorageWeakRef(out.untyped_storage()))
        return hook

    forwards: set[int] = set()
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(at_input_grad(i))
        layer.mlp.gate_proj.register_forward_hook(stored(i))
        layer.mlp.up_proj.register_forward_hook(stored(i))
    with tfcompat.patch(model, checkpoint_keep=("attention", "mlp_in"), checkpoint_offload=to_host):
        loss = model(**inputs, use_cache=False).logits.float().pow(2).mean()
        loss.backward(retain_graph=retain)
        if retain:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad()
            loss.backward()
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad, first[n], rtol=0, atol=0, msg=n)
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
    n = len(model.model.layers)
    expected = [(i, [keeps is False and j >= i for j in range(n)], [] if to_host else [not keeps] * 2)
                for keeps in ([True, False] if retain else [False]) for i in reversed(range(n))]
    assert [(i, gone, [] if to_host else expired) for i, gone, expired in seen] == expected


def test_counts_and_fractions_select_the_last_layers():
    """Rule: a count or fraction keeps a kind in the last layers holding it; "mlp" takes precedence over "mlp_in" in a
    layer both select; the handle's options hold the sorted pairs and patching again with them returns the handle."""
    model = _model("qwen2")
    keep = {"mlp_in": 1.0, "attention": 2, "mlp": 0.34}
    handle = tfcompat.patch(model, checkpoint_keep=keep)
    layers = model.model.layers
    assert [("forward" in vars(layer.self_attn)) for layer in layers] == [False, True, True]
    assert [("forward" in vars(layer.mlp)) for layer in layers] == [False, False, True]
    assert [("forward" in vars(layer.mlp.gate_proj)) for layer in layers] == [True, True, False]
    assert [("forward" in vars(layer.mlp.up_proj)) for layer in layers] == [True, True, False]
    assert handle.options["checkpoint_keep"] == (("attention", 2), ("mlp", 0.34), ("mlp_in", 1.0))
    assert tfcompat.patch(model, checkpoint_keep=handle.options["checkpoint_keep"]) is handle
    assert tfcompat.patch(model, checkpoint_keep=dict(keep)) is handle
    handle.undo()
    with tfcompat.patch(model, checkpoint_keep={"attention": 0, "mlp": 0.0}) as nothing:
        assert "forward" not in vars(layers[2].self_attn) and "forward" not in vars(layers[2].mlp)
        assert "kept through gradient checkpointing" not in nothing.explain()


def test_a_range_selects_those_layers():
    """Rule: a range keeps a kind in the layers of those indices among the layers holding it (model order), here
    the first and the middle one; an empty range keeps it nowhere; the handle's options hold the range."""
    model = _model("qwen2")
    handle = tfcompat.patch(model, checkpoint_keep={"mlp_in": range(2), "attention": range(1, 2), "mlp": range(0)})
    layers = model.model.layers
    assert [("forward" in vars(layer.mlp.gate_proj)) for layer in layers] == [True, True, False]
    assert [("forward" in vars(layer.self_attn)) for layer in layers] == [False, True, False]
    assert not any("forward" in vars(layer.mlp) for layer in layers)
    assert dict(handle.options["checkpoint_keep"])["mlp_in"] == range(2)
    assert tfcompat.patch(model, checkpoint_keep=handle.options["checkpoint_keep"]) is handle
    handle.undo()


def test_a_set_of_indices_selects_those_layers():
    """Rule: any collection of ints selects those layers as a range does (the last and the first here, which no
    range gives); the handle holds it as a sorted tuple, and patching again with that is the same patch."""
    model = _model("qwen2")
    handle = tfcompat.patch(model, checkpoint_keep={"mlp_in": {2, 0}, "attention": [1]})
    layers = model.model.layers
    assert [("forward" in vars(layer.mlp.gate_proj)) for layer in layers] == [True, False, True]
    assert [("forward" in vars(layer.self_attn)) for layer in layers] == [False, True, False]
    assert dict(handle.options["checkpoint_keep"])["mlp_in"] == (0, 2)
    assert tfcompat.patch(model, checkpoint_keep=handle.options["checkpoint_keep"]) is handle
    handle.undo()


@pytest.mark.parametrize(("keep", "match"), [
    ({"attention": True}, r"checkpoint_keep\['attention'\] = True"),
    ({"mlp": range(-1, 2)}, r"checkpoint_keep\['mlp'\] = range\(-1, 2\)"),
    ({"mlp": range(2, 0, -1)}, r"checkpoint_keep\['mlp'\] = range\(2, 0, -1\)"),
    ({"mlp": range(1, 4)}, r"checkpoint_keep\['mlp'\] = range\(1, 4\) but 3 checkpointed layers hold it"),
    ({"mlp": {0, 3}}, r"checkpoint_keep\['mlp'\] = \(0, 3\) but 3 checkpointed layers hold it"),
    ({"mlp": [0, -1]}, r"checkpoint_keep\['mlp'\] = \[0, -1\]"),
    ({"mlp": {1.0}}, r"checkpoint_keep\['mlp'\] = \{1.0\}"),
    ({"mlp": -1}, r"checkpoint_keep\['mlp'\] = -1"),
    ({"mlp": 1.5}, r"checkpoint_keep\['mlp'\] = 1.5"),
    ({"mlp": float("nan")}, r"checkpoint_keep\['mlp'\] = nan"),
    ({"mlp": "all"}, r"checkpoint_keep\['mlp'\] = 'all'"),
    ({"mlp_out": 1.0}, r"unknown checkpoint_keep kinds \['mlp_out'\]"),
    (3, "checkpoint_keep=3 is a int"),
    ({"attention": 4}, r"checkpoint_keep\['attention'\] = 4 but 3 checkpointed layers hold it"),
])
def test_bad_layer_selections_are_refused_at_patch_time(keep, match):
    """Rule: a kind's layers are a count 0..layers, a fraction in [0, 1] (not a bool, a string or NaN) or indices
    from 0 within the layers (an upward range, or a collection of ints); anything else is a PatchError at patch()
    that names the value, and nothing is changed."""
    model = _model("qwen2")
    with pytest.raises(tfcompat.PatchError, match=match):
        tfcompat.patch(model, checkpoint_keep=keep)
    assert not tfcompat.is_patched(model)
    assert all("forward" not in vars(m) for m in model.model.layers[2].modules())


def test_mlp_in_without_input_projections_is_refused():
    """Rule: "mlp_in" on a model whose MLP blocks have no gate / up projection children (gpt-oss's experts) is a
    PatchError naming the kind; "mlp" on the same model is accepted (the control)."""
    if "gpt_oss" not in causal_lm_types():
        pytest.skip(f"transformers {installed_transformers()} ships no gpt_oss")
    with pytest.raises(tfcompat.PatchError, match=r"checkpoint_keep \['mlp_in'\] matches no module"):
        tfcompat.patch(_model("gpt_oss", attn="eager"), checkpoint_keep="mlp_in")
    tfcompat.patch(_model("gpt_oss", attn="eager"), checkpoint_keep="mlp").undo()


def test_refusals_at_patch_time():
    """Rule: checkpointing off, reentrant checkpointing and unknown kinds are PatchErrors at patch(); nothing is
    changed."""
    model = _model("qwen2", checkpointing=False)
    with pytest.raises(tfcompat.PatchError, match="gradient checkpointing is off"):
        tfcompat.patch(model, checkpoint_keep="attention")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(tfcompat.PatchError, match="needs non-reentrant checkpointing"):
        tfcompat.patch(model, checkpoint_keep="attention")
    with pytest.raises(tfcompat.PatchError, match=r"unknown checkpoint_keep kinds \['mlps'\]"):
        tfcompat.patch(_model("qwen2"), checkpoint_keep=("attention", "mlps"))
    assert not tfcompat.is_patched(model)
    assert "forward" not in vars(model.model.layers[0].self_attn)


def test_undo_restores_and_a_later_enable_is_refused_in_the_forward():
    """Rule: undo() restores each checkpoint function and forward; enabling checkpointing again after the patch
    replaces the function, and the next checkpointed forward raises PatchedModelError (not a silent recompute)."""
    model = _model("qwen2")
    layer = model.model.layers[0]
    original = layer._gradient_checkpointing_func
    handle = tfcompat.patch(model, checkpoint_keep="attention")
    assert layer._gradient_checkpointing_func is not original and "forward" in vars(layer.self_attn)
    assert "kept through gradient checkpointing (attention)" in handle.explain()
    clone = copy.deepcopy(model)
    assert tfcompat.is_patched(clone) and "forward" in vars(clone.model.layers[0].self_attn)
    tfcompat.patch(clone, checkpoint_keep="attention").undo()  # the copy's own handle: its registration released
    handle.undo()
    assert layer._gradient_checkpointing_func is original and "forward" not in vars(layer.self_attn)

    inputs = pack(model, sample_sequences(model, [4, 6], [None, None], seed=2))
    with tfcompat.patch(model, checkpoint_keep="attention"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
        with pytest.raises(tfcompat.PatchedModelError, match="checkpoint_keep is lost"):
            model(**inputs, use_cache=False)
