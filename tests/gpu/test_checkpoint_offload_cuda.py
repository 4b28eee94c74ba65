"""`patch(model, checkpoint_keep=..., checkpoint_offload=True)` on CUDA: the kept tensors through pinned host memory on
side streams: every offloaded tensor back bit for bit, the kept path's gradients, a lower peak memory, and no host
sync more than without offload.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import tfcompat
from tests.helpers import pack
from tfcompat.hf import offload
from tfcompat.selfcheck import sample_sequences, tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine")]

DIMS = dict(hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=8,
            head_dim=64)
KEEP = {"attention": 1.0, "mlp_in": 1.0}


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("qwen2", "sdpa", **DIMS).to("cuda", torch.bfloat16).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seqs = sample_sequences(model, [1500, 7, 3000, 1, 2500, 1184], [None] * 6, seed=4)
    return model, {k: v.to("cuda") for k, v in pack(model, seqs).items()}


def _step(model, inputs, keep, to_host, syncs: list | None = None, fetch: str = "recompute"):
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with tfcompat.patch(model, checkpoint_keep=keep, checkpoint_offload=to_host, checkpoint_fetch=fetch):
        if syncs is not None:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = model(**inputs, use_cache=False).logits[0].float().square().mean()
                loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        if syncs is not None:
            syncs.append(sum("synchroniz" in str(w.message) for w in caught))
    torch.cuda.synchronize()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, torch.cuda.max_memory_allocated()


@pytest.mark.parametrize("fetch", ["recompute", "mlp_in", "attention"])
@pytest.mark.parametrize("keep", [KEEP, {"attention": 1.0, "mlp_in": range(0, 8, 2)}])
def test_every_offloaded_tensor_comes_back_bit_for_bit(setup, monkeypatch, keep, fetch):
    """Rule: under the real side streams and overlap, each saved tensor and kept output that went to host memory
    comes back equal bit for bit to its value when it was saved (a clone taken then, on the compute stream), so the
    backward runs on the kept path's tensors; counted, so the test cannot pass with nothing offloaded. Heavy and
    light layers in turn (the second policy) fetch several layers ahead; the next layers fetched at the recompute
    or after the MLP's backward."""
    model, inputs = setup
    _step(model, inputs, keep, True, fetch=fetch)  # warm: the pinned host blocks cached
    saved: dict[int, torch.Tensor] = {}
    checked = []
    pack, unpack = offload.Stash.pack, offload._Packed.unpack

    def recorded(stash, t):
        out = pack(stash, t)
        if isinstance(out, offload._Packed):
            saved[id(out)] = t.detach().clone()
        return out

    def compared(packed):
        back = unpack(packed)
        checked.append(torch.equal(back, saved[id(packed)]))
        return back

    monkeypatch.setattr(offload.Stash, "pack", recorded)
    monkeypatch.setattr(offload._Packed, "unpack", compared)
    _step(model, inputs, keep, True, fetch=fetch)
    assert len(checked) >= 4 * DIMS["num_hidden_layers"] and all(checked), (len(checked), checked.count(False))


def test_offload_gives_the_kept_gradients_at_less_memory(setup):
    """Rule: the gradients are the kept path's (bf16: within twice the difference of two kept runs + 1e-2 of the
    scale, the bound of test_checkpoint_keep_cuda: the attention backward's kernels are not deterministic; the
    bits are checked above); the peak below the kept path's, by at least 40% of what keeping added over full
    recompute (the copies back run ahead of their layer, and a forward faster than the link holds blocks until their
    copies are done); measured warm (a second step: the pinned host blocks cached)."""
    model, inputs = setup
    _, _, peak_full = _step(model, inputs, (), False)
    loss, kept, peak_kept = _step(model, inputs, KEEP, False)
    _, again, _ = _step(model, inputs, KEEP, False)
    _step(model, inputs, KEEP, True)  # warm-up: the pinned host blocks are allocated once
    loss_off, off, peak_off = _step(model, inputs, KEEP, True)
    print(f"peak GiB: full recompute {peak_full / 2**30:.3f}, kept {peak_kept / 2**30:.3f}, kept + offload "
          f"{peak_off / 2**30:.3f}")
    assert off.keys() == kept.keys()
    for n, g in off.items():
        noise = float((again[n].float() - kept[n].float()).abs().max())
        bound = 2 * noise + 1e-2 * float(kept[n].float().abs().max())
        assert float((g.float() - kept[n].float()).abs().max()) <= bound, n
    assert peak_kept > peak_full, (peak_full, peak_kept)  # not vacuous: keeping costs memory here
    assert peak_off <= peak_full + 0.6 * (peak_kept - peak_full), (peak_full, peak_kept, peak_off)


@pytest.mark.parametrize("fetch", ["mlp_in", "attention"])
def test_fetching_later_in_the_backward_holds_no_more(setup, fetch):
    """Rule: fetching the next layers' copies at gate / up's gradient or at the attention's, rather than at the
    recompute, holds them for less of each layer's backward: the step's peak is not higher, and the loss and the
    gradients are the same (bits: above; here the peak, measured warm)."""
    model, inputs = setup
    for at in ("recompute", fetch):
        _step(model, inputs, KEEP, True, fetch=at)  # warm
    loss, _, peak = _step(model, inputs, KEEP, True)
    loss_late, _, peak_late = _step(model, inputs, KEEP, True, fetch=fetch)
    print(f"peak GiB: fetch at the recompute {peak / 2**30:.4f}, at {fetch} {peak_late / 2**30:.4f}")
    assert loss_late == loss
    assert peak_late <= peak, (peak, peak_late)


@pytest.mark.parametrize("fetch", ["recompute", "mlp_in", "attention"])
def test_offload_adds_no_host_sync(setup, fetch):
    """Rule: the copies wait on events, not the host: a step with offload warns of no more synchronizing calls
    than the same step without (torch.cuda.set_sync_debug_mode("warn"), as bench/host_syncs.py counts)."""
    model, inputs = setup
    _step(model, inputs, KEEP, True, fetch=fetch)  # warm
    syncs: list[int] = []
    _step(model, inputs, KEEP, False, syncs)
    _step(model, inputs, KEEP, True, syncs, fetch=fetch)
    assert syncs[1] <= syncs[0], syncs


@pytest.mark.xfail(strict=True, reason=(
    "on an H100 and an H200 the peak was 0.0059 GiB lower, not half a gate output (0.0156; bench/RESULTS.md sections "
    "24, 25). Not record_stream on the fetched blocks: without it (bench/results/2026-12-06-parts/"
    "fetch_owner_stream.patch) the H200 gave the same peaks, here and in the long-context step; cause not found"))
def test_the_fetch_at_gate_and_up_in_two_parts_lowers_the_peak(setup, monkeypatch):
    """Rule: with ``checkpoint_fetch="mlp_in"`` a layer's backward brings the next layer's copies in two parts, about
    half at the first of gate's and up's gradients, the rest at the second, after the first projection's backward
    has freed its output's gradient: the peak is lower than with the whole fetch at the first (the control: the hook
    fetching all at once), by at least half a gate output. With Liger's SwiGLU through the two-node down projection,
    its backward in row blocks (as at long context: the peak is then gate / up's backward, not the activation's).
    Same loss; measured warm. The CPU model of the same: tests/test_checkpoint_offload.py."""
    import importlib

    from tfcompat.hf import checkpointing, swiglu_down

    try:
        importlib.import_module("liger_kernel.ops")
    except ImportError as e:
        pytest.skip(f"liger-kernel is not installed: {e}")
    model, inputs = setup
    n = inputs["input_ids"].numel()
    monkeypatch.setattr(swiglu_down, "BLOCK_ELEMENTS", n * DIMS["intermediate_size"] // 8)
    one = n * DIMS["intermediate_size"] * 2  # one layer's gate output, bf16

    def step():
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with tfcompat.patch(model, checkpoint_keep=KEEP, checkpoint_offload=True, checkpoint_fetch="mlp_in",
                            fused=("swiglu",)):
            loss = model(**inputs, use_cache=False).logits[0].float().square().mean()
            loss.backward()
        torch.cuda.synchronize()
        return float(loss.detach()), torch.cuda.max_memory_allocated()

    step()  # warm
    loss, peak = step()
    whole = checkpointing._Ahead.__call__

    def at_once(self, grad=None):
        self.fired = self.parts - 1
        whole(self, grad)

    monkeypatch.setattr(checkpointing._Ahead, "__call__", at_once)
    loss_whole, peak_whole = step()
    print(f"peak GiB, fetch at gate / up: in two parts {peak / 2**30:.4f}, whole at the first "
          f"{peak_whole / 2**30:.4f}; one gate output {one / 2**30:.4f}")
    assert loss == loss_whole
    assert peak <= peak_whole - one / 2, (peak, peak_whole, one)
