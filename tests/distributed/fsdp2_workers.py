"""Rank functions for FSDP2 (``fully_shard``) on a (dp, sp) DeviceMesh with Ulysses over the mesh's sp dimension.

Used by tests/distributed/test_fsdp2.py (gloo, CPU, dp x sp = 2 x 2) and tests/gpu/test_fsdp2_nccl.py (NCCL,
``cuda:rank``, 1 x 2). Every rank first trains a reference in its own process: the stock model (unpatched, no
FSDP), each sequence alone, the same optimizer and the same batches; then the patched, sharded, checkpointed model.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import tfcompat
from tests.helpers import pack
from tfcompat.selfcheck import Sequence, sample_sequences, stock_inputs, tiny_model

STEPS = 4
LR = 1e-3
LOSS_TOL = 1e-5  # per step, fp32
GRAD_TOL = 1e-5  # times max(1, |reference|.max()), per parameter
LENGTHS = [7, 12, 6]
IMAGES = [None, (1, 4, 6), (1, 2, 4)]


class PackedTrainStep(torch.nn.Module):
    """The FSDP root: embedding (whole images through the vision tower), Ulysses slicing and the forward run
    inside its ``forward``, so every parameter they touch is unsharded by FSDP's hooks.

    Returns this rank's summed next-token cross-entropy (a 0-d tensor) over its slice of the packed row.
    """

    def __init__(self, model: torch.nn.Module, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.model = model
        self.group = group

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **vision: torch.Tensor) -> torch.Tensor:
        """input_ids ``(1, T)``, position_ids ``(4, 1, T)``, the batch's pixel values and grids (or none)."""
        embeds = tfcompat.embed_inputs(self.model, input_ids, **vision)  # (1, T, H)
        shard = tfcompat.ulysses.shard_inputs(position_ids=position_ids, inputs_embeds=embeds, labels=input_ids,
                                              group=self.group)
        logits = self.model(**shard.model_inputs, use_cache=False).logits[0]  # (T/sp, V)
        return F.cross_entropy(logits.float(), shard.labels[0], ignore_index=-100, reduction="sum")


def _batches(model: torch.nn.Module, dp: int) -> list[list[list[Sequence]]]:
    """``[step][dp rank]`` -> sequences; every third batch is text only (the vision tower runs on a dummy image)."""
    out = []
    for step in range(STEPS):
        row = []
        for d in range(dp):
            images = [None] * len(IMAGES) if (step + d) % 3 == 2 else IMAGES
            row.append(sample_sequences(model, LENGTHS, images, seed=100 * step + d))
        out.append(row)
    return out


def _targets(seqs: list[Sequence]) -> int:
    return sum(s.input_ids.shape[1] - 1 for s in seqs)


def _to(seqs: list[Sequence], device: torch.device) -> list[Sequence]:
    return [Sequence(**{k: (v.to(device) if v is not None else None) for k, v in vars(s).items()}) for s in seqs]


def reference_run(family: str, dp: int, device: torch.device) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Stock model, no patch, no FSDP: loss per step = mean over the dp batches of the batch's mean next-token
    cross-entropy, every sequence run alone; returns the losses and the gradients of step 1.

    A parameter the step did not reach gets a zero gradient, not None: in the sharded run every rank runs the
    vision tower (`tfcompat.embed_inputs` adds ``0 *`` a dummy image's features to a text-only batch), so on a step
    whose batches are all text-only the tower's gradients are zeros, and AdamW still moves it (momentum, decay)."""
    model = tiny_model(family, "sdpa").to(device).train()
    r = tfcompat.resolve(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step, row in enumerate(_batches(model, dp)):
        loss = torch.zeros((), device=device)
        for seqs in row:
            total = torch.zeros((), device=device)
            for s in _to(seqs, device):
                logits = model(**stock_inputs(r, model, s), use_cache=False).logits[0]  # (L, V)
                total = total + F.cross_entropy(logits[:-1].float(), s.input_ids[0, 1:], reduction="sum")
            loss = loss + total / _targets(seqs) / dp
        loss.backward()
        for p in model.parameters():  # a text-only step: the sharded run's vision tower got zeros, not None
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses, grads


def _shard_mesh(mesh: DeviceMesh, layout: str, device_type: str) -> DeviceMesh:
    """``"hsdp"``: the 2-D (dp, sp) mesh itself (replicate over dp, shard over sp);
    ``"fsdp"``: one dimension over every rank (shard over dp x sp), as verl's FSDP workers do."""
    if layout == "hsdp":
        return mesh
    return init_device_mesh(device_type, (mesh.size(),), mesh_dim_names=("fsdp",))


def fsdp2_equals_single(rank: int, world: int, family: str, dp: int, layout: str, out_path: str | None) -> None:
    """Patched model, ``fully_shard`` per decoder layer and vision block and at the root, gradient checkpointing,
    Ulysses over ``mesh["sp"]``: the loss of every step and the gradients after step 1 equal `reference_run`.

    Each rank's loss is its slice's summed cross-entropy over the batch's target count; its backward is scaled by
    sp because FSDP averages gradients over all dp * sp ranks while the sp ranks of a batch hold parts of one
    gradient (verl's ``gather_outputs_and_unpad`` applies the same factor).
    """
    warnings.simplefilter("ignore")
    sp = world // dp
    nccl = dist.get_backend() == "nccl"
    device_type = "cuda" if nccl else "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    if nccl:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    ref_losses, ref_grads = reference_run(family, dp, device)

    mesh = init_device_mesh(device_type, (dp, sp), mesh_dim_names=("dp", "sp"))
    group, dp_rank = mesh["sp"].get_group(), mesh["dp"].get_local_rank()
    model = tiny_model(family, "sdpa").to(device).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing
    tfcompat.patch(model, remove_padding=True, ulysses_group=group)
    step_module = PackedTrainStep(model, group)
    shard_mesh = _shard_mesh(mesh, layout, device_type)
    units = [m for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "VisionBlock"))]
    assert units, "no decoder layers or vision blocks found to shard"
    for unit in units:
        fully_shard(unit, mesh=shard_mesh)
    fully_shard(step_module, mesh=shard_mesh)
    opt = torch.optim.AdamW(step_module.parameters(), lr=LR)

    losses, grad_diffs = [], {}
    for step, row in enumerate(_batches(model, dp)):
        seqs = _to(row[dp_rank], device)
        inputs = pack(model, seqs)
        ce = step_module(**inputs)
        (ce / _targets(seqs) * sp).backward()
        logged = (ce / _targets(seqs)).detach()
        dist.all_reduce(logged)  # sum over every rank = sum of the dp batch losses
        losses.append(float(logged) / dp)
        if step == 0:
            grad_diffs = _grad_diffs(step_module, ref_grads)
        opt.step()
        opt.zero_grad(set_to_none=True)

    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    worst = max(grad_diffs.items(), key=lambda kv: kv[1])
    if rank == 0 and out_path:
        Path(out_path).write_text(json.dumps({"family": family, "layout": layout, "dp": dp, "sp": sp,
                                              "losses": losses, "reference_losses": ref_losses,
                                              "max_loss_diff": loss_diff, "max_grad_diff_relative": worst[1],
                                              "worst_grad": worst[0], "params": len(grad_diffs)}))
    assert loss_diff <= LOSS_TOL, f"rank {rank}: losses {losses} vs single process {ref_losses}"
    assert worst[1] <= GRAD_TOL, f"rank {rank}: step-1 gradient {worst[0]} differs by {worst[1]:.3e} (relative)"


def _grad_diffs(step_module: torch.nn.Module, ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter, the max abs difference of the full (unsharded) gradient from the reference, relative to
    ``max(1, |reference|.max())``. Every rank calls ``full_tensor`` on every parameter in the same order."""
    out: dict[str, float] = {}
    names = []
    for name, p in step_module.named_parameters():
        key = name.removeprefix("model.")
        names.append(key)
        if p.grad is None:
            assert key not in ref, f"{key}: no gradient under FSDP, one in the single-process run"
            continue
        full: Any = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert key in ref, f"{key}: a gradient under FSDP, none in the single-process run"
        out[key] = float((full - ref[key]).abs().max()) / max(1.0, float(ref[key].abs().max()))
    assert set(ref) <= set(names), sorted(set(ref) - set(names))
    assert max(float(g.abs().max()) for g in ref.values()) > 1e-2, "vanishing reference gradients: no control"
    return out
