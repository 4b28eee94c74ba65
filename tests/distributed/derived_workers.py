"""Rank functions for derived families under Ulysses (spawned by `tests.distributed.harness.run_world`): each rank
builds the same tiny model from config, runs the single-process patched packed row (sp = 1) and its shard of the row
(sp = world), and writes what it measured to ``{out}/{rank}.json`` for the test to compare."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers

import tfcompat
from tests.distributed.workers import sharded_logits
from tfcompat.tiny_models import attention_implementations, model_class_name, tiny_config


def tiny_model(model_type: str, **overrides: Any) -> torch.nn.Module:
    """`tfcompat.tiny_models`' tiny fp32 model of ``model_type`` (hidden 64, 4 heads of 16), with ``overrides`` of
    its config; the stock implementation is sdpa where the class has one (gpt-oss has not: eager)."""
    config = tiny_config(model_type)
    config = type(config)(**{**config.to_dict(), **overrides})
    torch.manual_seed(0)
    cls = getattr(transformers, model_class_name(model_type))
    model = cls._from_config(config, attn_implementation=attention_implementations(model_type)[-1])
    return model.float().eval()


def sequences(vocab: int, lengths: list[int]) -> dict[str, torch.Tensor]:
    """One packed row of random ids: ``input_ids (1, T)``, ``position_ids (1, T)`` restarting at 0 per sequence."""
    gen = torch.Generator().manual_seed(5)
    return {"input_ids": torch.randint(1, vocab, (1, sum(lengths)), generator=gen),
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def derived_sp_equals_single(rank: int, world: int, model_type: str, overrides: dict[str, Any], lengths: list[int],
                             out: str) -> None:
    """Write the max differences of sp = world from sp = 1: logits (relative to their max) and each parameter's
    gradient summed over the ranks (relative to max(1, its max)); plus the control (the stock model on the row as one
    sequence) and the names of the parameters with a gradient."""
    warnings.simplefilter("ignore")
    model = tiny_model(model_type, **overrides)
    inputs = sequences(model.config.vocab_size, lengths)
    weight = torch.randn(model.config.vocab_size, generator=torch.Generator().manual_seed(9))

    with torch.no_grad():  # the row without restarting positions: one sequence to the stock model
        control = model(input_ids=inputs["input_ids"], use_cache=False).logits[0]
    with tfcompat.patch(model):  # sp = 1, on every rank
        ref = model(**inputs, use_cache=False).logits[0]
        (ref @ weight).sum().backward()
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    with tfcompat.patch(model, ulysses_group=dist.group.WORLD):
        logits = sharded_logits(model, inputs, dist.group.WORLD)
        (logits @ weight).sum().backward()
    grads = _grads(model)
    for g in grads.values():
        dist.all_reduce(g)  # each rank holds its tokens' (and, for sinks, its heads') share of the gradient

    scale = float(ref.abs().max())
    result = {
        "logits": float((logits - ref).abs().max()) / scale,
        "control": float((control - ref).abs().max()) / scale,
        "grads": {n: float((g - ref_grads[n]).abs().max()) / max(1.0, float(ref_grads[n].abs().max()))
                  for n, g in grads.items() if n in ref_grads},
        "names": sorted(grads),
        "ref_names": sorted(ref_grads),
    }
    Path(out, f"{rank}.json").write_text(json.dumps(result))


def heads_refused_at_patch(rank: int, world: int, model_type: str, overrides: dict[str, Any]) -> None:
    """Query heads that ``world`` does not divide: patch() raises PatchError naming the split and the type, before
    changing anything."""
    model = tiny_model(model_type, **overrides)
    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    try:
        tfcompat.patch(model, ulysses_group=dist.group.WORLD)
    except tfcompat.PatchError as exc:
        text = str(exc)
        assert f"cannot split {heads} query / {kv} KV heads" in text and model_type in text, text
    else:
        raise AssertionError(f"{heads} query heads over {world} ranks were not rejected at patch()")
    assert not tfcompat.is_patched(model)
