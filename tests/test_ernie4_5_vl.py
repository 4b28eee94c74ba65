"""ERNIE-4.5-VL's own rules beyond the every-family tests (test_packed, test_mrope, test_pack, test_embedding): its
MoE sends each token to text or vision experts by ``moe_mm_token_type_ids``, which tfcompat builds as the processor
does, and which sequence parallelism cannot slice (refused at patch time)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

import tfcompat
from tests.helpers import max_token_diff
from tfcompat.errors import PatchError
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


@pytest.mark.parametrize("family", MOE_ROUTED)
def test_sequence_parallel_refused(family):
    model = tiny_model(family, "sdpa")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(PatchError, match=f"{family} cannot run sequence parallel") as info:
            tfcompat.patch(model, ulysses_group=dist.group.WORLD)
        assert "moe_mm_token_type_ids" in info.value.why
    finally:
        dist.destroy_process_group()
    assert not tfcompat.is_patched(model)
