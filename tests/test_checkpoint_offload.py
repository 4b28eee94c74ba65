"""`patch(model, checkpoint_keep=..., checkpoint_offload=...)`: what the kept modules save, offloaded and brought back.

The oracle is the same patch without offload: the same graph on the same tensors, so the loss and every gradient
must be equal bit for bit. On CPU the "host copy" is a clone of each storage, rebuilt as views of a second clone in
the backward, so a wrong view, a storage shared by mistake or a copy that never comes back changes the gradients;
a control corrupts the copies and must change them (the gradients do come from the copies).
"""

from __future__ import annotations

import pytest
import torch

import tfcompat
from tests.helpers import LiveBytes, pack, record_kept_outputs
from tfcompat.hf import checkpointing, offload
from tfcompat.registry.derive import causal_lm_types
from tfcompat.registry.versions import installed_transformers
from tfcompat.selfcheck import sample_sequences, tiny_model

LENGTHS = [5, 9, 3]


def _model(family: str) -> torch.nn.Module:
    model = tiny_model(family, "sdpa", num_hidden_layers=3).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class _Saves:
    """The storages each stash copies (`Stash._save` calls), per stash, in forward order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.per_stash: dict[int, int] = {}
        save = offload.Stash._save

        def counted(stash, src):
            self.per_stash[id(stash)] = self.per_stash.get(id(stash), 0) + 1
            return save(stash, src)

        monkeypatch.setattr(offload.Stash, "_save", counted)


def _grads(family: str, keep, to_host, weight_seed: int = 5, fetch: str = "recompute"
           ) -> tuple[float, dict[str, torch.Tensor]]:
    model = _model(family)
    inputs = pack(model, sample_sequences(model, LENGTHS, [None] * 3, seed=4))
    weight = torch.randn(sum(LENGTHS), model.config.vocab_size, generator=torch.Generator().manual_seed(weight_seed))
    with tfcompat.patch(model, checkpoint_keep=keep, checkpoint_offload=to_host, checkpoint_fetch=fetch):
        loss = (model(**inputs, use_cache=False).logits[0].float() * weight).sum()
        loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("family", "keep", "to_host", "offloading", "fetch"), [
    ("qwen2", ("attention", "mlp"), True, 3, "recompute"),
    ("llama", {"attention": 2, "mlp_in": 1.0}, True, 3, "attention"),
    ("llama", {"attention": 1.0, "mlp_in": 2}, True, 3, "mlp_in"),
    ("qwen2", ("attention", "mlp_in"), 2, 2, "recompute"), ("qwen3", "attention", 0.34, 1, "attention"),
    ("qwen3_moe", ("attention", "mlp"), 1, 1, "recompute"), ("phi3", "mlp_in", True, 3, "recompute"),
    ("qwen2", ("attention", "mlp_in"), True, 3, "attention")])
def test_offloaded_gradients_equal_the_kept_path_bit_for_bit(family, keep, to_host, offloading, fetch, monkeypatch):
    """Rule: offloading what the kept modules save (every storage here: MIN_BYTES = 0) changes no bit of the loss
    or of any gradient against the same patch without offload, for dense and MoE blocks (tuple outputs), a fused
    gate/up projection (phi3) and per-layer policies, with the next layers fetched at the recompute or at the kept
    attention's gradient (llama there: a layer keeping only its MLP fetches at its recompute); a count or fraction
    offloads that many of the first layers keeping a module (counted: stashes that copied something)."""
    if family not in causal_lm_types():
        pytest.skip(f"transformers {installed_transformers()} ships no {family}")
    monkeypatch.setattr(offload, "MIN_BYTES", 0)
    loss, kept = _grads(family, keep, False)
    saves = _Saves(monkeypatch)
    loss_off, off = _grads(family, keep, to_host, fetch=fetch)
    assert len(saves.per_stash) == offloading, saves.per_stash
    assert loss_off == loss
    assert off.keys() == kept.keys()
    for name, g in off.items():
        assert torch.equal(g, kept[name]), name


def test_the_gradients_come_from_the_copies(monkeypatch):
    """Control: the copies corrupted on the host (zeroed before they come back) change the gradients, so the test
    above compares gradients computed from the copies, not from tensors the patch still held."""
    monkeypatch.setattr(offload, "MIN_BYTES", 0)
    _, kept = _grads("qwen2", ("attention", "mlp_in"), False)
    fetch = offload._fetch

    def zeroed(copies):
        for c in copies:
            c.host.zero_()
        fetch(copies)

    monkeypatch.setattr(offload, "_fetch", zeroed)
    _, corrupt = _grads("qwen2", ("attention", "mlp_in"), True)
    assert any(not torch.equal(corrupt[n], kept[n]) for n in kept)


def test_views_share_one_copy_and_parameters_stay():
    """Rule: views of one storage share one copy and come back as views of one block with their dtype, shape,
    strides and offset; parameters, views of them, leaves that require grad and storages under MIN_BYTES are held
    as they are (no copy)."""
    stash = offload.Offloader(min_bytes=64).stash(True)
    x = torch.randn(6, 8)
    q = x[:, 2:5]  # (6, 3), a strided view
    y = x.t()  # (8, 6)
    weight = torch.nn.Parameter(torch.randn(8, 8))
    leaf = torch.randn(8, 8, requires_grad=True)
    small = torch.randn(3)
    packed = [stash.pack(t) for t in (x, q, y, weight, weight.t(), leaf, small)]
    stash.close()
    copies = {id(p.copy) for p in packed if isinstance(p, offload._Packed)}
    assert len(copies) == 1
    assert [isinstance(p, offload._Packed) for p in packed] == [True, True, True, False, False, False, False]
    expected = [(t.clone(), t.shape, t.stride(), t.storage_offset()) for t in (x, q, y)]
    x.zero_()  # the copy is the saved value, not the live tensor
    stash.fetch()
    back = [offload.unpack(p) for p in packed[:3]]
    for b, (value, shape, stride, offset) in zip(back, expected):
        assert (b.shape, b.stride(), b.storage_offset()) == (shape, stride, offset) and torch.equal(b, value)
    assert back[0].untyped_storage().data_ptr() == back[2].untyped_storage().data_ptr()
    assert back[0].untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_the_next_layers_come_back_ahead_within_the_largest_layer():
    """Rule: a layer's fetch brings back its own copies and, ahead, those of the layers next in the backward: the
    next that offloads whatever its size, then more while the bytes ahead stay within the largest layer's; layers
    that offload nothing are passed over."""
    offloader = offload.Offloader(min_bytes=1)
    sizes = [4, 1, 1, 0, 2, 1, 3]  # float32 elements each layer offloads, in forward order: the largest 16 bytes
    stashes = []
    for n in sizes:
        stash = offloader.stash(bool(n))
        stash.pack(torch.randn(max(n, 1)))
        stash.close()
        stashes.append(stash)
    assert offloader.largest() == 16

    def back() -> list[bool]:
        return [not s._copies for s in stashes]  # fetched (or nothing to fetch)

    stashes[6].fetch()  # its own only (layer 3 has none)
    assert back() == [False, False, False, True, False, False, True]
    stashes[6].fetch_ahead()  # in elements: layer 5 (1), 4 (+2), 3 passed over, 2 (+1 = 4 <= 4); 1 would make 5
    assert back() == [False, False, True, True, True, True, True]
    stashes[2].fetch_ahead()  # layer 1 (1); layer 0 would make 5
    assert back() == [False, True, True, True, True, True, True]
    stashes[1].fetch_ahead()  # the next that offloads comes ahead whatever its size
    assert back() == [True] * 7


def test_a_share_of_the_copies_ahead_comes_back_first_and_the_rest_later():
    """Rule: ``fetch_ahead(share)`` brings back, of the copies ahead not back yet, those that left first while the
    bytes before each stay under that share of theirs (whole storages, at least one); a later call brings more, and
    ``share=1`` the rest (`_Ahead` splits a layer's fetch over its gate and up gradients this way)."""
    offloader = offload.Offloader(min_bytes=1)
    stashes, packed = [], []
    for sizes in ([4], [2, 1, 1], [1]):  # float32 elements per saved tensor, per layer in forward order
        stash = offloader.stash(True)
        packed.append([stash.pack(torch.randn(n)) for n in sizes])
        stash.close()
        stashes.append(stash)

    def back() -> list[list[bool]]:
        return [[p.copy.back is not None for p in layer] for layer in packed]

    stashes[2].fetch_ahead(0.5)  # layer 1's 16 bytes ahead (layer 0's would make 32): 8 before the second copy
    assert back() == [[False], [True, False, False], [False]]
    stashes[2].fetch_ahead(0.01)  # at least one
    assert back() == [[False], [True, True, False], [False]]
    stashes[2].fetch_ahead()
    assert back() == [[False], [True, True, True], [False]]
    stashes[1].fetch_ahead(0.5)  # a single storage comes whole
    assert back() == [[True], [True, True, True], [False]]


@pytest.mark.parametrize(("fetch", "keep", "at"), [
    ("recompute", "attention", {}), ("attention", "attention", {0: "attention", 1: "attention", 2: "attention"}),
    ("attention", {"attention": range(2), "mlp_in": 1.0}, {0: "attention", 1: "attention"}),
    ("mlp_in", ("attention", "mlp_in"), {0: "mlp_in", 1: "mlp_in", 2: "mlp_in"}),
    ("mlp_in", {"attention": 1.0, "mlp_in": range(1, 3)}, {1: "mlp_in", 2: "mlp_in"})])
def test_where_the_next_layers_copies_start_back(fetch, keep, at, monkeypatch):
    """Rule: each layer's backward fetches the next layers' copies ahead once: with ``checkpoint_fetch="recompute"``
    before its MLP's backward (at its recompute); with ``"mlp_in"`` after the down projection's and the
    activation's backward, before gate / up's; with ``"attention"`` after the MLP's backward, before the
    attention's; a layer not keeping a module of that kind at its recompute (observed by gradient hooks on the
    modules' inputs, registered in the forward, and on the fetches)."""
    monkeypatch.setattr(offload, "MIN_BYTES", 0)
    model = _model("qwen2")
    inputs = pack(model, sample_sequences(model, LENGTHS, [None] * 3, seed=4))
    log: list[tuple[str, int]] = []
    ahead = offload.Stash.fetch_ahead
    stashes: list[offload.Stash] = []

    def logged(stash, share=1.0):
        log.append(("ahead", stashes.index(stash)))
        ahead(stash, share)

    def stashed(offloader, offloads, stash=offload.Offloader.stash):
        stashes.append(stash(offloader, offloads))
        return stashes[-1]

    def on_input_grad(kind, i):
        def hook(module, args, kwargs):
            if i not in seen[kind]:  # the forward's call, not the recompute's (whose graph is never run)
                seen[kind].add(i)
                (args[0] if args else kwargs["hidden_states"]).register_hook(lambda g: log.append((kind, i)))
        return hook

    seen: dict[str, set[int]] = {"down": set(), "mlp": set(), "attention": set()}
    monkeypatch.setattr(offload.Stash, "fetch_ahead", logged)
    monkeypatch.setattr(offload.Offloader, "stash", stashed)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layer.mlp.down_proj.register_forward_pre_hook(on_input_grad("down", i), with_kwargs=True)
        layer.mlp.register_forward_pre_hook(on_input_grad("mlp", i), with_kwargs=True)
        layer.self_attn.register_forward_pre_hook(on_input_grad("attention", i), with_kwargs=True)
    with tfcompat.patch(model, checkpoint_keep=keep, checkpoint_offload=True, checkpoint_fetch=fetch):
        model(**inputs, use_cache=False).logits.sum().backward()
    # the inputs' gradients in backward order: the down projection's, the MLP's (gate / up's), the attention's
    order = {"recompute": ("ahead", "down", "mlp", "attention"),
             "mlp_in": ("down", "ahead", "ahead", "mlp", "attention"),  # a part at gate's gradient, a part at up's
             "attention": ("down", "mlp", "ahead", "attention")}
    expected = [(what, i) for i in reversed(range(len(layers))) for what in order[at.get(i, "recompute")]]
    assert log == expected


def test_the_fetch_at_gate_and_up_in_two_parts_holds_less(monkeypatch):
    """Rule: with ``checkpoint_fetch="mlp_in"`` a layer's backward brings the next layer's copies in two parts, about
    half at the first of gate's and up's gradients, the rest at the second, once the first projection's backward has
    freed its output's gradient: each layer's backward that fetches ahead holds at its peak one gate output less than
    with the whole fetch at the first (the control: the hook fetching all at once), and no more than with the fetch
    at the recompute. Measured on CPU as the bytes of the storages alive (`LiveBytes`), with the two-node SwiGLU down
    projection (Liger's ops as torch, its backward in row blocks as at long context on a GPU). Same loss."""
    from tests.test_fused import _Stub
    from tfcompat.hf import fused, swiglu_down

    namespace = _Stub().namespace()
    monkeypatch.setattr(fused, "_liger", lambda: namespace)
    monkeypatch.setattr(swiglu_down, "BLOCK_ELEMENTS", 2**16)
    monkeypatch.setattr(offload, "MIN_BYTES", 0)
    dims = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=512, num_attention_heads=4,
                num_key_value_heads=2)
    lengths = [300, 200, 500]

    def peaks(fetch: str) -> tuple[float, dict]:
        model = tiny_model("qwen2", "sdpa", **dims).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        inputs = pack(model, sample_sequences(model, lengths, [None] * 3, seed=4))
        live = LiveBytes()
        for i, layer in enumerate(model.model.layers):
            layer.register_full_backward_pre_hook(lambda m, g, i=i: setattr(live, "phase", i))
        with tfcompat.patch(model, checkpoint_keep=("attention", "mlp_in"), checkpoint_offload=3,
                            checkpoint_fetch=fetch, fused=("swiglu",)), live:
            loss = model(**inputs, use_cache=False).logits.float().square().mean()
            loss.backward()
        return float(loss.detach()), live.peaks

    loss, split = peaks("mlp_in")
    at_recompute = peaks("recompute")[1]
    whole = checkpointing._Ahead.__call__

    def at_once(self, grad=None):
        self.fired = self.parts - 1
        whole(self, grad)

    monkeypatch.setattr(checkpointing._Ahead, "__call__", at_once)
    loss_whole, at_first = peaks("mlp_in")
    one = sum(lengths) * dims["intermediate_size"] * 4  # a gate output, float32
    assert loss == loss_whole
    for i in (3, 2, 1):  # the layers that fetch ahead (layer 0 has none after it)
        assert split[i] <= at_first[i] - one, (i, split, at_first)
        assert split[i] <= at_recompute[i], (i, split, at_recompute)


@pytest.mark.parametrize("fetch", ["recompute", "mlp_in", "attention"])
def test_a_layers_kept_outputs_are_freed_with_its_backward(fetch, monkeypatch):
    """Rule: what a layer keeps (its outputs and their copies brought back) is released when its backward is done,
    not held to the end of the step by the graph: when the gradient reaches the embedding, no layer's is alive
    (the fetch hooks on the kept outputs, which live as long as the graph, hold the layer's stash alone)."""
    monkeypatch.setattr(offload, "MIN_BYTES", 0)
    model = _model("qwen2")
    inputs = pack(model, sample_sequences(model, LENGTHS, [None] * 3, seed=4))
    made = record_kept_outputs(monkeypatch)
    alive: list[int] = []
    embed = model.get_input_embeddings()
    embed.register_forward_hook(lambda m, a, out: out.register_hook(
        lambda g: alive.append(sum(r() is not None for r in made))) and None)
    with tfcompat.patch(model, checkpoint_keep=("attention", "mlp_in"), checkpoint_offload=True,
                        checkpoint_fetch=fetch):
        loss = model(**inputs, use_cache=False).logits.sum()
        loss.backward()
    assert len(made) == len(model.model.layers) and alive == [0], (len(made), alive)


def test_options_and_the_layers_offloaded():
    """Rule: the handle's options hold checkpoint_offload, patching again with them returns the handle, and the
    offloading layers' checkpoint functions say so in explain()."""
    model = _model("qwen2")
    handle = tfcompat.patch(model, checkpoint_keep={"attention": 1.0}, checkpoint_offload=2)
    assert handle.options["checkpoint_offload"] == 2
    assert tfcompat.patch(model, checkpoint_keep={"attention": 1.0}, checkpoint_offload=2) is handle
    assert handle.explain().count("goes to host memory") == 2
    handle.undo()


@pytest.mark.parametrize(("keep", "to_host", "match"), [
    ("attention", "yes", "checkpoint_offload='yes'"),
    ("attention", -1, "checkpoint_offload=-1"),
    ("attention", 1.5, "checkpoint_offload=1.5"),
    ((), True, "checkpoint_offload=True without checkpoint_keep"),
    ({"attention": 2}, 3, "checkpoint_offload=3 but 2 layers keep a module"),
])
def test_bad_offloads_are_refused_at_patch_time(keep, to_host, match):
    """Rule: checkpoint_offload is a bool, a count up to the layers keeping a module or a fraction in [0, 1], and
    needs checkpoint_keep; anything else is a PatchError at patch() and nothing is changed."""
    model = _model("qwen2")
    with pytest.raises(tfcompat.PatchError, match=match):
        tfcompat.patch(model, checkpoint_keep=keep, checkpoint_offload=to_host)
    assert not tfcompat.is_patched(model)


@pytest.mark.parametrize(("keep", "to_host", "fetch", "match"), [
    ("attention", True, "late", "checkpoint_fetch='late'"),
    ("attention", False, "attention", "checkpoint_fetch='attention' without checkpoint_offload"),
    ((), False, "attention", "checkpoint_fetch='attention' without checkpoint_offload"),
    ("mlp_in", True, "attention", "no layer keeps its attention"),
    ("attention", True, "mlp_in", "no layer keeps its mlp_in"),
])
def test_bad_fetches_are_refused_at_patch_time(keep, to_host, fetch, match):
    """Rule: checkpoint_fetch is "recompute", "mlp_in" or "attention"; the last two need something offloaded and a
    layer keeping a module of that kind (else they would place nothing): a PatchError at patch(), nothing
    changed."""
    model = _model("qwen2")
    with pytest.raises(tfcompat.PatchError, match=match):
        tfcompat.patch(model, checkpoint_keep=keep, checkpoint_offload=to_host, checkpoint_fetch=fetch)
    assert not tfcompat.is_patched(model)
