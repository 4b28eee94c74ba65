"""Rank functions for derived vision-language families under Ulysses (spawned by run_world)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import tfcompat
from tests.distributed.workers import assert_summed_grads_equal
from tests.every_type import build, vlm_examples
from tfcompat import ulysses


def _all_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def vlm_sp_equals_single(rank: int, world: int, model_type: str, images_only: bool = False) -> None:
    """SP logits and every parameter's gradient (vision tower and projector included) equal the single-process packed
    run; whole images go through the tower first (`tfcompat.embed_inputs`), then the row of embeddings is sliced.
    images_only: without the zoo's video sequence (a layout not every family's processor makes)."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model = build(model_type, "sdpa", kind="image_text_to_text")
    packed = tfcompat.pack(model, vlm_examples(model)[:3] if images_only else vlm_examples(model))
    inputs = {k: v for k, v in packed.model_inputs.items() if not k.startswith("tfcompat")}
    assert "pixel_values" in inputs, "the sample must hold an image"
    weight = torch.randn(model.config.get_text_config().vocab_size, generator=torch.Generator().manual_seed(9))

    with tfcompat.patch(model):  # SP = 1 reference, on every rank
        ref = model(**packed.model_inputs, use_cache=False).logits[0]
        (ref @ weight).sum().backward()
    ref_grads = _all_grads(model)
    model.zero_grad(set_to_none=True)

    with tfcompat.patch(model, ulysses_group=dist.group.WORLD):
        vision = {k: v for k, v in inputs.items() if k not in ("input_ids", "position_ids")}
        embedded = tfcompat.embed_inputs(model, inputs["input_ids"], **vision)
        shard = ulysses.shard_inputs(position_ids=inputs["position_ids"], inputs_embeds=embedded,
                                     group=dist.group.WORLD)
        local = model(**shard.model_inputs, use_cache=False).logits
        logits = ulysses.gather_outputs(local, shard)[0]
        (logits @ weight).sum().backward()

    scale = max(1.0, float(ref.abs().max()))
    diff = float((logits - ref).abs().max())
    assert diff <= 1e-5 * scale, f"rank {rank}: SP={world} logits differ from SP=1 by {diff:.3e}"
    grads = _all_grads(model)
    assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
    towers = tfcompat.resolve(model_type).entry.derived_vision.tower_attrs
    tower = [n for n in grads if any(f"{attr}." in n for attr in towers)]
    assert tower, "the vision tower must get gradients"
    worst = assert_summed_grads_equal(rank, grads, ref_grads)
    if rank == 0:  # seen with pytest -s
        print(f"{model_type} sp={world}: logits {diff / scale:.2e}, gradients {worst:.2e} (relative, {len(grads)} "
              f"parameters, {len(tower)} of the vision tower)", flush=True)


def image_blocks_refused_under_ulysses(rank: int, world: int, model_type: str) -> None:
    """Token types marking images (bidirectional attention within each) on a sharded row: `InvalidInputError`."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model = build(model_type, "sdpa", kind="image_text_to_text")
    examples = vlm_examples(model)
    name = tfcompat.resolve(model_type).entry.derived_vision.mask_inputs[0]
    for ex in examples:
        ex[name] = (ex["input_ids"] == model.config.image_token_id).long()
    inputs = {k: v for k, v in tfcompat.pack(model, examples).model_inputs.items() if not k.startswith("tfcompat")}
    with tfcompat.patch(model, ulysses_group=dist.group.WORLD):
        vision = {k: v for k, v in inputs.items() if k not in ("input_ids", "position_ids", name)}
        embedded = tfcompat.embed_inputs(model, inputs["input_ids"], **vision)
        shard = ulysses.shard_inputs(position_ids=inputs["position_ids"], inputs_embeds=embedded,
                                     group=dist.group.WORLD, per_token={name: inputs[name]})
        assert shard.model_inputs[name].shape == (1, shard.padded // world)
        try:
            model(**shard.model_inputs, use_cache=False)
        except tfcompat.InvalidInputError as exc:
            assert "cannot attend within images" in str(exc) and "sequence-parallel" in str(exc), str(exc)
        else:
            raise AssertionError("a sharded row with image token types must be refused")
