"""Functions run on every rank by `tests.distributed.harness.run_world` (module level so spawn can import them)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import tfcompat
from tests.helpers import pack, packed_inputs
from tfcompat import ulysses
from tfcompat.inputs.embedding import embed_inputs
from tfcompat.selfcheck import sample_sequences, tiny_model

WATCHED = ("q_proj", "o_proj", "embed_tokens")


def _loss(logits: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (logits @ weight).sum()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None and any(w in n for w in WATCHED + ("visual",))}


def assert_summed_grads_equal(rank: int, grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor]) -> float:
    """Each rank's gradients, summed over the group (each rank holds its tokens' share), equal the single-process
    ones within 1e-5 of max(1, |reference|); returns the largest such relative difference."""
    worst = 0.0
    for name, g in grads.items():
        dist.all_reduce(g)
        scale = max(1.0, float(ref_grads[name].abs().max()))
        gdiff = float((g - ref_grads[name]).abs().max())
        assert gdiff <= 1e-5 * scale, f"rank {rank}: grad {name} differs by {gdiff:.3e} (scale {scale:.2e})"
        worst = max(worst, gdiff / scale)
    return worst


def sharded_logits(model: torch.nn.Module, inputs: dict, group: dist.ProcessGroup, transport: str = "auto",
                   expect_transport: str | None = None) -> torch.Tensor:
    """The patched model's logits ``(T, V)`` of a packed row run under Ulysses: shard, forward, gather.

    transport: passed to shard_inputs; expect_transport: the transport it must have chosen (checked).

    VLMs: whole images go through the vision tower first (embed_inputs), then the embeddings are sliced.
    """
    vision = {k: v for k, v in inputs.items() if k not in ("input_ids", "position_ids")}
    if vision:
        embedded = embed_inputs(model, inputs["input_ids"], **vision)  # with its extras (DeepStack rows)
        shard = ulysses.shard_inputs(position_ids=inputs["position_ids"], inputs_embeds=embedded, group=group,
                                     transport=transport)
    else:
        shard = ulysses.shard_inputs(inputs["input_ids"], inputs["position_ids"], group=group, transport=transport)
    visual = shard.model_inputs.get("tfcompat_visual")
    if visual is not None:  # DeepStack rows: exactly this rank's visual tokens
        assert all(x.shape[0] == int(visual.visual_pos_masks.sum()) for x in visual.deepstack_visual_embeds)
    chosen = shard.model_inputs["tfcompat_context"].transport
    expected = expect_transport or (None if transport == "auto" else transport)
    assert expected is None or chosen == expected, f"transport={transport!r} chose {chosen!r}, expected {expected!r}"
    sp = dist.get_world_size(group)
    assert shard.padded % sp == 0 and shard.total == inputs["input_ids"].shape[1]
    local = model(**shard.model_inputs, use_cache=False).logits
    assert local.shape[1] == shard.padded // sp and local.device == inputs["input_ids"].device
    return ulysses.gather_outputs(local, shard)[0]


def sp_equals_single(rank: int, world: int, family: str, lengths: list[int], images: list, text: dict) -> None:
    """SP forward and backward on ``world`` ranks equal the single-process packed run, per token."""
    warnings.simplefilter("ignore")
    model = tiny_model(family, "sdpa", **text)
    seqs = sample_sequences(model, lengths, images, seed=5)
    inputs = pack(model, seqs)
    vocab = model.config.get_text_config().vocab_size
    weight = torch.randn(vocab, generator=torch.Generator().manual_seed(9))

    with tfcompat.patch(model, remove_padding=True):  # SP = 1 reference, on every rank
        ref_logits = model(**packed_inputs(model, seqs), use_cache=False).logits[0]
        _loss(ref_logits, weight).backward()
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    with tfcompat.patch(model, remove_padding=True, ulysses_group=dist.group.WORLD):
        logits = sharded_logits(model, inputs, dist.group.WORLD)
        _loss(logits, weight).backward()

    diff = float((logits - ref_logits).abs().max())
    assert diff <= 1e-5, f"rank {rank}: SP={world} logits differ from SP=1 by {diff:.3e}"
    grads = _grads(model)
    assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
    assert_summed_grads_equal(rank, grads, ref_grads)


def labels_are_shifted_globally(rank: int, world: int) -> None:
    """Labels shift on the global row before slicing; each sequence's last token and the pad are ignored."""
    ids = torch.arange(100, 111)[None]  # 11 tokens: sequences of 4, 7
    pos = torch.cat([torch.arange(4), torch.arange(7)])[None]
    shard = ulysses.shard_inputs(ids, pos, labels=ids, group=dist.group.WORLD)
    everyone = [torch.empty_like(shard.labels) for _ in range(world)]
    dist.all_gather(everyone, shard.labels)
    full = torch.cat(everyone, dim=1)[0].tolist()
    expected = [101, 102, 103, -100, 105, 106, 107, 108, 109, 110, -100] + [-100] * (shard.padded - 11)
    assert full == expected, full
    assert torch.equal(torch.cat([t for t in everyone], 1)[:, :11].ne(-100).sum(), torch.tensor(9))


def disagreeing_lengths_raise(rank: int, world: int) -> None:
    n = 8 + rank
    try:
        ulysses.shard_inputs(torch.zeros(1, n, dtype=torch.long), torch.arange(n)[None], group=dist.group.WORLD)
    except tfcompat.InvalidInputError as exc:
        assert "disagree" in str(exc), str(exc)
    else:
        raise AssertionError("ranks with different lengths were not rejected")


def transports_on_gloo(rank: int, world: int) -> None:
    """auto picks all_to_all on gloo; asking for symm_mem there, or for an unknown transport, raises at shard time."""
    ids, pos = torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None]
    shard = ulysses.shard_inputs(ids, pos, group=dist.group.WORLD)
    assert shard.model_inputs["tfcompat_context"].transport == "all_to_all"
    for transport, words in (("symm_mem", ("symm_mem", "CUDA", "all_to_all")), ("nvlink", ("unknown", "auto"))):
        try:
            ulysses.shard_inputs(ids, pos, group=dist.group.WORLD, transport=transport)
        except tfcompat.InvalidInputError as exc:
            assert all(w in str(exc) for w in words), str(exc)
        else:
            raise AssertionError(f"transport={transport!r} on gloo was not rejected")


def bad_heads_raise_at_patch(rank: int, world: int) -> None:
    model = tiny_model("llama", "sdpa", num_attention_heads=4, num_key_value_heads=2 if world == 4 else 4)
    if world == 4:
        # 4 query heads over 4 ranks with 2 KV heads is fine; 3 ranks would not be, so use a subgroup-free check
        tfcompat.patch(model, ulysses_group=dist.group.WORLD).undo()
        return
    wide = tiny_model("llama", "sdpa", hidden_size=48, num_attention_heads=3, num_key_value_heads=3)
    try:
        tfcompat.patch(wide, ulysses_group=dist.group.WORLD)
    except tfcompat.PatchError as exc:
        assert "cannot split 3 query / 3 KV heads" in str(exc) and "llama" in str(exc), str(exc)
    else:
        raise AssertionError("3 heads over 2 ranks were not rejected at patch()")


def forward_without_shard_raises(rank: int, world: int) -> None:
    model = tiny_model("llama", "sdpa")
    with tfcompat.patch(model, ulysses_group=dist.group.WORLD):
        try:
            model(input_ids=torch.zeros(1, 6, dtype=torch.long), position_ids=torch.arange(6)[None])
        except tfcompat.InvalidInputError as exc:
            assert "shard_inputs" in str(exc)
        else:
            raise AssertionError("an unsharded forward under Ulysses was not rejected")


def all_to_all_round_trip(rank: int, world: int, t_local: int, heads: int, dim: int, seed: int) -> None:
    """seq_to_heads then heads_to_seq is the identity; seq_to_heads gathers the right tokens and heads."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(t_local * world, heads, dim, generator=gen)  # same on every rank
    mine = full[rank * t_local:(rank + 1) * t_local].clone().requires_grad_()
    h = ulysses.seq_to_heads(mine, dist.group.WORLD)
    per = heads // world
    assert torch.equal(h, full[:, rank * per:(rank + 1) * per])
    back = ulysses.heads_to_seq(h, dist.group.WORLD)
    assert torch.equal(back, mine)
    back.sum().backward()
    assert torch.equal(mine.grad, torch.ones_like(mine))


def shard_gather_round_trip(rank: int, world: int, lengths: list[int]) -> None:
    """Every rank holds padded // world tokens of the padded row (ids, positions, and a per-token input padded with 0);
    gathering restores the row without the pad."""
    ids = torch.randint(3, 100, (1, sum(lengths)), generator=torch.Generator().manual_seed(sum(lengths)))
    text = torch.cat([torch.arange(n) for n in lengths])[None]
    pos = torch.cat([text[None], text[None].expand(3, 1, -1) + 1])  # (4, 1, T): rows differ, to catch mix-ups
    types = ids % 3  # any per-token input
    shard = ulysses.shard_inputs(ids, pos, labels=ids, group=dist.group.WORLD, per_token={"token_type_ids": types})
    n = shard.padded // world
    assert shard.padded % world == 0 and shard.padded - shard.total < world
    assert shard.model_inputs["input_ids"].shape == (1, n) and shard.model_inputs["position_ids"].shape == (4, 1, n)
    local_types = shard.model_inputs["token_type_ids"]
    assert torch.equal(ulysses.gather_outputs(local_types, shard), types)
    assert not bool(local_types[0, max(0, shard.total - rank * n):].any()), "the pad's token types are 0 (text)"
    assert shard.seqs.lengths[: len(lengths)] == tuple(lengths)  # then the pad, as its own sequence
    assert sum(shard.seqs.lengths) == shard.padded
    embedded = shard.model_inputs["input_ids"].float()[..., None]  # (1, n, 1): any per-token output
    assert torch.equal(ulysses.gather_outputs(embedded, shard)[0, :, 0].long(), ids[0])
    gathered_pos = ulysses.gather_outputs(shard.model_inputs["position_ids"].float(), shard, dim=-1)
    assert torch.equal(gathered_pos.long(), pos)
