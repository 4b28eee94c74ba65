"""ERNIE-4.5-VL's own rules beyond the every-family tests (test_packed, test_mrope, test_pack, test_embedding): its
MoE sends each token to text or vision experts by ``moe_mm_token_type_ids``, which tfcompat builds as the processor
does; under sequence parallelism `tfcompat.ulysses.shard_inputs` slices them to a rank's tokens
(tests/distributed/test_routed_ulysses.py: sp = 2 and 4 equal stock per sequence)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

import tfcompat
from tests.helpers import max_token_diff
from tfcompat.errors import InvalidInputError
from tfcompat.registry import installed_families
from tfcompat.selfcheck import sample_case, sample_sequences, stock_inputs, tiny_model

MOE_ROUTED = [k for k, f in installed_families().items() if f.moe_token_types is not None]


@pytest.mark.parametrize("family", MOE_ROUTED)
def test_moe_token_types_are_the_processors(family):
    """Rule: tfcompat's ``moe_mm_token_type_ids`` are the processor's (its own method from 5.18; the same rule inline
    in ``__call__`` before, read from the 5.0-5.17 wheels)."""
    import importlib

    config = tiny_model(family, "sdpa").config
    module = importlib.import_module(f"transformers.models.{family}.processing_{family}")
    processor_cls = next(v for k, v in vars(module).items() if k.endswith("Processor") and isinstance(v, type))
    holder = types.SimpleNamespace(**{f"{kind}{edge}_token_id": getattr(config, f"{kind}{edge}_token_id")
                                      for kind in ("image", "video") for edge in ("", "_start", "_end")})
    ids = torch.tensor([[5, 246, 250, 250, 247, 9, 248, 251, 251, 249, 3]])
    got = tfcompat.registry.family(family).moe_token_types(config, ids)
    assert got.tolist() == [[0, 1, 1, 1, 1, 0, 2, 2, 2, 2, 0]]
    build = getattr(processor_cls, "create_moe_mm_token_type_ids", None)  # 5.18+; inline in __call__ before
    if build is not None:
        assert got.tolist() == build(holder, ids.tolist())


@pytest.mark.parametrize("family", MOE_ROUTED)
@torch.no_grad()
def test_packed_row_routes_vision_tokens_to_the_vision_experts(family):
    """Rule: `tfcompat.pack` gives the packed row its routing ids, so it equals stock per sequence; control: the same
    row without them (every token to the text experts) does not."""
    r = tfcompat.resolve(family)
    model = tiny_model(family, "sdpa")
    seqs = sample_sequences(model, *sample_case(family), seed=5)
    expected = [model(**stock_inputs(r, model, s), use_cache=False).logits[0] for s in seqs]
    packed = tfcompat.pack(model, [{"input_ids": s.input_ids, **s.vision_inputs()} for s in seqs]).model_inputs
    with tfcompat.patch(model):
        got = model(**packed, use_cache=False).logits[0]
        unrouted = model(**{k: v for k, v in packed.items() if k != "moe_mm_token_type_ids"}, use_cache=False)
    assert max_token_diff(got, expected) <= 1e-5
    assert max_token_diff(unrouted.logits[0], expected) > 1e-3


@pytest.fixture
def world_of_one():
    """A one-rank gloo group in this process: patch(ulysses_group=...) and shard_inputs without spawning ranks."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", MOE_ROUTED)
def test_sequence_parallel_slices_the_routing_ids(family, world_of_one):
    """Rule: patch(ulysses_group=...) takes the family; shard_inputs hands the forward the routing ids of the
    `tfcompat.embed_inputs` result (a one-rank group: the whole row), and the shard equals stock per sequence."""
    r = tfcompat.resolve(family)
    model = tiny_model(family, "sdpa")
    seqs = sample_sequences(model, *sample_case(family), seed=5)
    with torch.no_grad():
        expected = [model(**stock_inputs(r, model, s), use_cache=False).logits[0] for s in seqs]
    packed = tfcompat.pack(model, [{"input_ids": s.input_ids, **s.vision_inputs()} for s in seqs]).model_inputs
    vision = {k: v for k, v in packed.items() if k.startswith(("pixel_values", "image_grid", "video_grid"))}
    with tfcompat.patch(model, ulysses_group=world_of_one), torch.no_grad():
        embedded = tfcompat.embed_inputs(model, packed["input_ids"], **vision)
        shard = tfcompat.ulysses.shard_inputs(position_ids=packed["position_ids"], inputs_embeds=embedded,
                                              group=world_of_one)
        assert torch.equal(shard.model_inputs["moe_mm_token_type_ids"], packed["moe_mm_token_type_ids"])
        got = model(**shard.model_inputs, use_cache=False).logits[0]
    assert max_token_diff(got, expected) <= 1e-5


@pytest.mark.parametrize("family", MOE_ROUTED)
def test_routing_ids_of_another_length_are_refused(family):
    """Rule: routing ids that do not match the forward's tokens (the whole row's handed to a rank's shard, say) raise
    a typed error naming them, not torch's IndexError from the MoE block."""
    model = tiny_model(family, "sdpa")
    seqs = sample_sequences(model, *sample_case(family), seed=5)
    packed = tfcompat.pack(model, [{"input_ids": s.input_ids, **s.vision_inputs()} for s in seqs]).model_inputs
    packed["moe_mm_token_type_ids"] = packed["moe_mm_token_type_ids"][:, :-1]
    match = "moe_mm_token_type_ids and the input tokens differ in shape"
    with tfcompat.patch(model), torch.no_grad(), pytest.raises(InvalidInputError, match=match) as info:
        model(**packed, use_cache=False)
    assert "per_token" in info.value.fix
