"""Ulysses sequence parallelism on CPU with gloo: SP=N equals SP=1 per token, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import tfcompat
from tests.distributed import workers
from tests.distributed.harness import run_world
from tfcompat.core.extras import Embedded
from tfcompat.registry import installed_families
from tfcompat.selfcheck import sample_case

pytestmark = pytest.mark.dist

# every registered family on its packed sample (Family.sample_vision: images and videos for the VLMs), plus
# one KV head; the sample's totals are not multiples of 2 or 4, so the pad segment is always exercised
# (a family whose MoE routes by per-token modality ids: test_routed_ulysses.py, against stock and every gradient)
CASES = {f"{key}-sample": (key, *sample_case(key), {}) for key, fam in installed_families().items()
         if fam.moe_token_types is None}
CASES["llama-kv1"] = ("llama", [9, 5, 8], [None, None, None], {"num_key_value_heads": 1})
VLMS = [key for key, fam in installed_families().items() if fam.is_vision and fam.moe_token_types is None]

WORLDS = [(case, 2) for case in sorted(CASES)] + [("qwen2-sample", 4), ("llama-kv1", 4)] + [
    (f"{key}-sample", 4) for key in VLMS]


@pytest.mark.parametrize("case,world", WORLDS, ids=[f"{c}-sp{w}" for c, w in WORLDS])
def test_sp_equals_single_process(case, world):
    """Rule: logits and the gradients of q_proj, o_proj, embeddings (and the vision tower) match SP=1.

    "llama-kv1" has one KV head (n_kv < sp at every size); at sp=4 the samples have 2 KV heads: K/V are
    repeated sp // n_kv times, no more. Every vision family runs its images and videos at sp=2 and sp=4.
    """
    run_world(workers.sp_equals_single, world, *CASES[case])


def test_labels_shift_on_the_global_row():
    run_world(workers.labels_are_shifted_globally, 2)


def test_ranks_disagreeing_on_length_raise():
    run_world(workers.disagreeing_lengths_raise, 2)


@pytest.mark.parametrize("world", [2, 4])
def test_head_divisibility_checked_at_patch(world):
    run_world(workers.bad_heads_raise_at_patch, world)


def test_transport_choice_on_gloo():
    run_world(workers.transports_on_gloo, 2)


def test_forward_without_shard_raises():
    run_world(workers.forward_without_shard_raises, 2)


@pytest.fixture
def world_of_one():
    """A one-rank gloo group in this process (shard_inputs' checks, without spawning ranks)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_per_token_inputs_checked(world_of_one):
    """Rule: per-token inputs are ``(1, T, ...)`` tensors in a mapping, named apart from shard_inputs' own arguments,
    given once (an embed_inputs result brings its own routing ids)."""
    ids, pos = torch.arange(3, 10)[None], torch.arange(7)[None]
    shard = tfcompat.ulysses.shard_inputs(ids, pos, group=world_of_one, per_token={"token_type_ids": ids % 2})
    assert torch.equal(shard.model_inputs["token_type_ids"], ids % 2)
    for per_token, match in (({"token_type_ids": ids[:, :-1]}, "per-token input token_type_ids does not match"),
                             ({"mm_token_type_ids": [0] * 7}, "per-token input mm_token_type_ids does not match"),
                             ({"position_ids": pos}, "per_token names 'position_ids', which shard_inputs builds"),
                             (ids, "per_token is not a mapping")):
        with pytest.raises(tfcompat.InvalidInputError, match=match) as info:
            tfcompat.ulysses.shard_inputs(ids, pos, group=world_of_one, per_token=per_token)
        assert info.value.fix
    embedded = Embedded(torch.zeros(1, 7, 4), moe_token_types=ids % 2)
    assert torch.equal(tfcompat.ulysses.shard_inputs(position_ids=pos, inputs_embeds=embedded, group=world_of_one)
                       .model_inputs["moe_mm_token_type_ids"], ids % 2)
    with pytest.raises(tfcompat.InvalidInputError, match=r"per-token inputs given twice: \['moe_mm_token_type_ids'\]"):
        tfcompat.ulysses.shard_inputs(position_ids=pos, inputs_embeds=embedded, group=world_of_one,
                                      per_token={"moe_mm_token_type_ids": ids % 2})


class TestShardGather:
    """Rule: shard_inputs then gather_outputs gives back the packed row, for any lengths and group size."""

    @settings(max_examples=3, deadline=None)
    @given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4), world=st.sampled_from([2, 3]))
    def test_round_trip(self, lengths, world):
        run_world(workers.shard_gather_round_trip, world, lengths)


class TestAllToAll:
    """Rule: the all-to-all pair is a lossless round trip and its own adjoint."""

    @settings(max_examples=4, deadline=None)
    @given(t_local=st.integers(1, 5), per_rank=st.integers(1, 3), dim=st.integers(1, 4), seed=st.integers(0, 99))
    def test_round_trip(self, t_local, per_rank, dim, seed):
        run_world(workers.all_to_all_round_trip, 2, t_local, 2 * per_rank, dim, seed)
