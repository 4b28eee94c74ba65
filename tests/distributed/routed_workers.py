"""Rank functions for families whose MoE routes each token by its modality (ERNIE-4.5-VL's text and vision experts by
``moe_mm_token_type_ids``) under Ulysses (spawned by `tests.distributed.harness.run_world`): each rank builds the same
tiny model, runs stock per sequence (the oracle), the single-process patched packed row (sp = 1) and its shard of the
row (sp = world), and writes what it measured to ``{out}/{rank}.json`` for the test to compare."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import tfcompat
from tfcompat import ulysses
from tfcompat.selfcheck import sample_sequences, stock_inputs, tiny_model

VISION = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
# text; an 8 x 8 image first in its sequence (16 merged tokens between its start and end); a 2 x 4 image; a four-frame
# video (two merged temporal steps); text. 63 tokens, so the pad is exercised at sp = 2 and 4; at sp = 4 rank 0's
# slice (tokens 0-15) holds text alone (the MoE runs its text experts alone there) and rank 1's (16-31) vision alone
# (the text experts get no token)
LENGTHS = [16, 1, 4, 6, 10]
ITEMS = [None, ("image", (1, 8, 8)), ("image", (1, 2, 4)), ("video", (4, 2, 2)), None]


def _grads(model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Each of ``names``' gradient, zeros where a rank's tokens reached none of it (the experts of a modality its
    slice does not hold): every rank then all-reduces the same tensors in the same order."""
    params = dict(model.named_parameters())
    return {n: params[n].grad.detach().clone() if params[n].grad is not None else torch.zeros_like(params[n])
            for n in names}


def _max_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: float((g - want[n]).abs().max()) / max(1.0, float(want[n].abs().max())) for n, g in got.items()}


def routed_sp_equals_stock(rank: int, world: int, family: str, out: str) -> None:
    """Write the max differences, per token, of the logits (relative to max(1, |stock|)) and of every parameter's
    gradient (summed over the ranks; relative to max(1, |reference|)): sp = world against sp = 1 and against stock
    per sequence, and sp = 1 against stock. Whole images and the video go through the tower first
    (`tfcompat.embed_inputs`, which returns the routing ids), then `tfcompat.ulysses.shard_inputs` slices the
    embeddings, the routing ids and (``per_token``) the M-RoPE token types. Control: the same shard without its
    routing ids (every token to the text experts)."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    r = tfcompat.resolve(family)
    model = tiny_model(family, "sdpa")
    seqs = sample_sequences(model, LENGTHS, ITEMS, seed=5)
    weight = torch.randn(model.config.get_text_config().vocab_size, generator=torch.Generator().manual_seed(9))

    stock = [model(**stock_inputs(r, model, s), use_cache=False).logits[0] for s in seqs]  # the oracle
    sum((x @ weight).sum() for x in stock).backward()
    stock_logits = torch.cat(stock).detach()  # (T, V)
    names = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    stock_grads = _grads(model, names)
    model.zero_grad(set_to_none=True)

    packed = tfcompat.pack(model, [{"input_ids": s.input_ids, **s.vision_inputs()} for s in seqs]).model_inputs
    with tfcompat.patch(model):  # sp = 1, on every rank
        ref = model(**packed, use_cache=False).logits[0]
        (ref @ weight).sum().backward()
    ref_grads = _grads(model, names)
    model.zero_grad(set_to_none=True)

    ids = packed["input_ids"]
    per_token = {k: packed[k] for k in ("mm_token_type_ids",) if k in packed}  # the M-RoPE types, where given
    with tfcompat.patch(model, ulysses_group=dist.group.WORLD):
        embedded = tfcompat.embed_inputs(model, ids, **{k: packed[k] for k in VISION if k in packed})
        shard = ulysses.shard_inputs(position_ids=packed["position_ids"], inputs_embeds=embedded,
                                     group=dist.group.WORLD, per_token=per_token)
        routing = shard.model_inputs["moe_mm_token_type_ids"]
        whole = torch.cat([packed["moe_mm_token_type_ids"], ids.new_zeros(1, shard.padded - shard.total)], 1)
        assert torch.equal(routing, whole[:, shard.local_slice]), "the routing ids are not this rank's slice"
        logits = ulysses.gather_outputs(model(**shard.model_inputs, use_cache=False).logits, shard)[0]
        (logits @ weight).sum().backward()
        with torch.no_grad():
            unrouted = {k: v for k, v in shard.model_inputs.items() if k != "moe_mm_token_type_ids"}
            control = ulysses.gather_outputs(model(**unrouted, use_cache=False).logits, shard)[0]
    grads = _grads(model, names)
    for g in grads.values():
        dist.all_reduce(g)  # each rank holds its tokens' share of the gradient

    scale = max(1.0, float(stock_logits.abs().max()))
    result = {
        "routed_here": int(routing.bool().sum()),
        "local": routing.shape[1],
        "logits_sp_vs_sp1": float((logits - ref).abs().max()) / scale,
        "logits_sp_vs_stock": float((logits - stock_logits).abs().max()) / scale,
        "logits_sp1_vs_stock": float((ref - stock_logits).abs().max()) / scale,
        "control": float((control - stock_logits).abs().max()) / scale,
        "grads_sp_vs_sp1": _max_rel(grads, ref_grads),
        "grads_sp_vs_stock": _max_rel(grads, stock_grads),
        "grads_sp1_vs_stock": _max_rel(ref_grads, stock_grads),
        "names": names,
    }
    Path(out, f"{rank}.json").write_text(json.dumps(result))
