"""Rank functions for the Ulysses misuse probes of tests/test_misuse.py (run by tests.distributed.harness.run_world)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tfcompat
from tfcompat.selfcheck import tiny_model


def boundaries_disagree(rank: int, world: int) -> None:
    """Same T on every rank, different boundaries: every rank raises from the one sync of shard_inputs."""
    ids = torch.arange(8)[None] + 3
    pos = torch.cat([torch.arange(4), torch.arange(4)])[None] if rank == 0 else torch.arange(8)[None]
    with pytest.raises(tfcompat.InvalidInputError, match="not on the sequence boundaries") as info:
        tfcompat.ulysses.shard_inputs(ids, pos, group=dist.group.WORLD)
    assert "same packed row" in info.value.fix


def group_and_labels_checks(rank: int, world: int) -> None:
    model = tiny_model("qwen2", "sdpa")
    with pytest.raises(tfcompat.PatchError, match="not a process group") as info:
        tfcompat.patch(model, ulysses_group=object())
    assert info.value.fix and not tfcompat.is_patched(model)
    ids, pos = torch.arange(8)[None] + 3, torch.cat([torch.arange(5), torch.arange(3)])[None]
    with pytest.raises(tfcompat.InvalidInputError, match="labels and the packed row differ in shape") as info:
        tfcompat.ulysses.shard_inputs(ids, pos, labels=ids[:, :-1], group=dist.group.WORLD)
    assert info.value.fix
    with tfcompat.patch(model, ulysses_group=dist.group.WORLD):
        shard = tfcompat.ulysses.shard_inputs(ids, pos, labels=ids, group=dist.group.WORLD)
        with pytest.raises(tfcompat.InvalidInputError, match="labels passed to a sequence-parallel forward") as info:
            model(**shard.model_inputs, labels=shard.labels)
        assert "shard.labels" in info.value.fix


def length_rope_under_ulysses(rank: int, world: int) -> None:
    from tests.test_rope_lengths import _model

    model = _model("dynamic")  # each rank's rotary would read its own slice's largest position
    with pytest.raises(tfcompat.PatchError, match=r"(?s)follow the call's length, under sequence parallelism.*"
                       r"dynamic rope.*fix: patch without ulysses_group") as info:
        tfcompat.patch(model, ulysses_group=dist.group.WORLD)
    assert not tfcompat.is_patched(model), info.value
