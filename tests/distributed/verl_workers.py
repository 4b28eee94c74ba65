"""Rank functions for tests/distributed/test_verl.py: verl's actor convention, with verl's own utility functions.

`verl_actor_logprobs` is the remove-padding branch of verl 0.9.1's ``FSDPEngineWithLMHead.prepare_model_inputs`` /
``prepare_model_outputs`` (the same steps as 0.6-0.7's ``dp_actor._forward_micro_batch``), calling verl's real
``ulysses_pad``, ``ulysses_pad_and_slice_inputs`` and ``gather_outputs_and_unpad``. verl's package ``__init__``
imports Ray and its whole stack, so `load_verl_ulysses` imports ``verl/utils/ulysses.py`` (pure torch) from the
installed package without running the parent packages' ``__init__``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

import tfcompat
from tests import every_type
from tests.distributed import derived_workers
from tests.helpers import pack
from tfcompat.integrations.verl import apply_monkey_patch
from tfcompat.registry import installed_families
from tfcompat.registry.derive import causal_lm_types
from tfcompat.registry.derive_vision import vision_types
from tfcompat.selfcheck import sample_sequences, stock_inputs, tiny_model

TEMPERATURE = 0.7
TOL = 1e-5  # per token, fp32 log-probs and entropies (|values| up to log(vocab) = 5.5)
GRAD_TOL = 1e-5  # times max(1, |reference|.max()), per watched parameter
WATCHED = ("q_proj", "o_proj", "embed_tokens", "lm_head")
# lengths whose totals are not multiples of 2 or 4, so verl's Ulysses pad is always there
TEXT_CASE = ([7, 12, 6], [None, None, None])
VISION_CASE = ([7, 12, 6], [None, (1, 4, 6), (1, 2, 4)])
# derived families (no written table) through verl's drop-in: MoE routing, sinks + windows, MLA head dims, softcap-free
# sliding layers
DERIVED = ("qwen3_moe", "gpt_oss", "deepseek_v3", "gemma3_text")
# derived vision-language types: LLaVA's pixel values (1-D RoPE), InternVL's, and PaddleOCR-VL's derived M-RoPE
# (``(4, 1, T)`` contract position ids, numbered by the model's own method)
DERIVED_VLM = ("llava", "internvl", "paddleocr_vl")


def load_verl_ulysses() -> ModuleType:
    """``verl.utils.ulysses`` of the installed verl, without executing ``verl/__init__.py`` (loaded once per
    process: a kept gloo world runs several tests)."""
    if "verl.utils.ulysses" in sys.modules:
        return sys.modules["verl.utils.ulysses"]
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("verl is not installed")
    root = Path(spec.submodule_search_locations[0])
    for name, path in (("verl", root), ("verl.utils", root / "utils")):
        if name not in sys.modules:
            package = ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
    return importlib.import_module("verl.utils.ulysses")


def verl_actor_logprobs(model: torch.nn.Module, vu: ModuleType, inputs: dict[str, Any], sp: int, *,
                        fused: bool, pass_shift_labels: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's remove-padding forward of one micro-batch: gathered log-probs and entropy, ``(T,)`` each.

    inputs: ``pack`` output (ids ``(1, T)``, position ids ``(1, T)`` or ``(4, 1, T)``, vision inputs).
    pass_shift_labels: verl 0.8+ passes the globally rolled labels with fused kernels; 0.6-0.7 do not.
    """
    ids, pos = inputs["input_ids"], inputs["position_ids"]
    mm = {k: v for k, v in inputs.items() if k not in ("input_ids", "position_ids")}
    rolled = torch.roll(ids, shifts=-1, dims=1)  # (1, T): verl's labels, rolled on the global row
    pad = 0
    if sp > 1:
        if hasattr(model.config, "vision_config"):  # verl: VLM inputs are sliced after embedding
            ids, pos, pad = vu.ulysses_pad(ids, position_ids_rmpad=pos, sp_size=sp)
        else:
            ids, pos, pad = vu.ulysses_pad_and_slice_inputs(ids, position_ids_rmpad=pos, sp_size=sp)
        rolled, _, _ = vu.ulysses_pad_and_slice_inputs(rolled, position_ids_rmpad=None, sp_size=sp)
    rolled = rolled.squeeze(0)  # (T'/sp,)
    extra: dict[str, Any] = {}
    if fused:
        extra = {"temperature": TEMPERATURE, "return_dict": True}
        if pass_shift_labels:
            extra["shift_labels"] = rolled.unsqueeze(0)
    out = model(input_ids=ids, attention_mask=None, position_ids=pos, **mm, **extra, use_cache=False)
    if fused:
        log_probs, entropy = out.log_probs.squeeze(0), out.entropy.squeeze(0)
    else:
        logits = out.logits.squeeze(0) / TEMPERATURE  # (T'/sp, V)
        log_probs, entropy = _logprobs(logits, rolled), _entropy(logits)
    if sp > 1:
        log_probs = vu.gather_outputs_and_unpad(log_probs, gather_dim=0, unpad_dim=0, padding_size=pad)
        entropy = vu.gather_outputs_and_unpad(entropy, gather_dim=0, unpad_dim=0, padding_size=pad)
    return log_probs, entropy


def _logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """verl's ``logprobs_from_logits`` (torch fallback): logits ``(T, V)``, labels ``(T,)`` -> ``(T,)``."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """verl's ``entropy_from_logits``: ``logsumexp(z) - sum(softmax(z) * z)``, ``(T, V)`` -> ``(T,)``."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None and any(w in n for w in WATCHED + ("visual",))}


def _models() -> Iterator[tuple[str, torch.nn.Module]]:
    """Every written family of the installed transformers (its selfcheck tiny model, sdpa), then the `DERIVED` types
    it ships (`tfcompat.tiny_models`' tiny model)."""
    for family in sorted(installed_families()):
        yield family, tiny_model(family, "sdpa")
    for model_type in DERIVED:
        if model_type in causal_lm_types():
            yield model_type, derived_workers.tiny_model(model_type)


def _case(model: torch.nn.Module) -> tuple[list[int], list]:
    return VISION_CASE if hasattr(model.config, "vision_config") else TEXT_CASE


def _derived_vlms() -> Iterator[tuple[str, torch.nn.Module, list[dict[str, torch.Tensor]]]]:
    """The `DERIVED_VLM` types the installed transformers ships: the zoo's tiny model (sdpa) and its examples (two
    with an image, one text only), as verl's actor hands them on: the processor's outputs of each sample."""
    for model_type in DERIVED_VLM:
        if model_type in vision_types():
            model = every_type.build(model_type, "sdpa", kind="image_text_to_text")
            yield model_type, model, every_type.vlm_examples(model)[:3]


def verl_convention(rank: int, world: int, out_path: str | None) -> None:
    """Every installed family, `DERIVED` and `DERIVED_VLM` type at sp = world: verl's actor on the patched model
    equals stock per sequence.

    Checked per token on the gathered row: log-probs and entropies, logits path and fused path (0.8+ with
    shift_labels, 0.6-0.7 without: all tokens but the row's last), and the gradients of ``sum(w * log_probs)``
    (fused) summed over the group and divided by sp (verl's ``gather_outputs_and_unpad`` scales them by sp for its
    FSDP averaging). Control: the same row with a text position row that never restarts must differ from the
    oracle (boundaries matter). A derived vision-language type gets verl's remove-padding row of `tfcompat.pack`
    (its contract position ids, ``(1, T)`` or ``(4, 1, T)`` for derived M-RoPE) and its own vision inputs by name.
    """
    warnings.simplefilter("ignore")
    vu = load_verl_ulysses()
    vu.set_ulysses_sequence_parallel_group(dist.group.WORLD if world > 1 else None)
    report: dict[str, dict[str, float]] = {}
    for family, model in _models():
        seqs = sample_sequences(model, *_case(model), seed=3)
        report[family] = _verl_vs_stock(model, vu, world, pack(model, seqs),
                                        lambda m, s=seqs: [m(**stock_inputs(tfcompat.resolve(m.config.model_type), m,
                                                                            x), use_cache=False).logits[0] for x in s])
    for model_type, model, examples in _derived_vlms():
        inputs = {k: v for k, v in tfcompat.pack(model, examples).model_inputs.items() if not k.startswith("tfcompat")}
        report[model_type] = _verl_vs_stock(model, vu, world, inputs, lambda m, e=examples: [
            m(**x, use_cache=False).logits[0] for x in e])
    if rank == 0 and out_path:
        Path(out_path).write_text(json.dumps({"sp": world, "families": report}))
    bad = {f: d for f, d in report.items()
           if max(v for k, v in d.items() if k not in ("control_one_sequence", "fused_grads_relative")) > TOL
           or d["fused_grads_relative"] > GRAD_TOL or d["control_one_sequence"] < 1e-2}
    assert not bad, f"rank {rank} sp={world}: {json.dumps(bad, indent=1)}"


def _verl_vs_stock(model: torch.nn.Module, vu: ModuleType, world: int, inputs: dict[str, Any],
                   stock_logits: Callable[[torch.nn.Module], list[torch.Tensor]]) -> dict[str, float]:
    """One model through verl's actor (logits and fused paths) against ``stock_logits(model)`` (each sequence's
    ``(L_i, V)`` logits, unpatched): the differences `verl_convention` checks."""
    labels = torch.roll(inputs["input_ids"][0], shifts=-1)  # (T,)
    weight = torch.randn(labels.shape[0], generator=torch.Generator().manual_seed(7))

    logits = torch.cat(stock_logits(model)) / TEMPERATURE  # (T, V)
    stock_lp, stock_ent = _logprobs(logits, labels), _entropy(logits)
    (stock_lp * weight).sum().backward()
    stock_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    stock_lp, stock_ent = stock_lp.detach(), stock_ent.detach()

    diffs: dict[str, float] = {}
    with apply_monkey_patch(model, ulysses_sp_size=world, use_fused_kernels=False), torch.no_grad():
        lp, ent = verl_actor_logprobs(model, vu, inputs, world, fused=False)
        diffs["logits_logprobs"] = _max_diff(lp, stock_lp)
        diffs["logits_entropy"] = _max_diff(ent, stock_ent)
        text = inputs["position_ids"].clone()
        text.view(-1, text.shape[-1])[0] = torch.arange(text.shape[-1])  # text row: one long sequence
        control, _ = verl_actor_logprobs(model, vu, {**inputs, "position_ids": text}, world, fused=False)
        diffs["control_one_sequence"] = _max_diff(control, stock_lp)
    with apply_monkey_patch(model, ulysses_sp_size=world, use_fused_kernels=True, fused_kernels_backend="torch"):
        lp, ent = verl_actor_logprobs(model, vu, inputs, world, fused=True)
        (lp * weight).sum().backward()
        diffs["fused_logprobs"] = _max_diff(lp, stock_lp)
        diffs["fused_entropy"] = _max_diff(ent, stock_ent)
        grads = _grads(model)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            old, _ = verl_actor_logprobs(model, vu, inputs, world, fused=True, pass_shift_labels=False)
            # the row's last token: label = the Ulysses pad id here, the row's first id in verl (never used)
            diffs["fused_no_shift_labels_logprobs"] = _max_diff(old[:-1], stock_lp[:-1])
    assert grads.keys() == stock_grads.keys(), sorted(set(grads) ^ set(stock_grads))
    worst = 0.0
    for name, g in grads.items():
        if world > 1:
            dist.all_reduce(g)
            g /= world
        worst = max(worst, _max_diff(g, stock_grads[name]) / max(1.0, float(stock_grads[name].abs().max())))
    diffs["fused_grads_relative"] = worst
    return diffs


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return float((a.detach().float() - b.float()).abs().max())


def group_size_mismatch_raises(rank: int, world: int) -> None:
    """A forward outside verl's sharding manager (no group set) with ulysses_sp_size > 1 raises, naming both sizes."""
    vu = load_verl_ulysses()
    vu.set_ulysses_sequence_parallel_group(None)
    model = tiny_model("qwen2", "sdpa")
    with apply_monkey_patch(model, ulysses_sp_size=world):
        try:
            model(input_ids=torch.zeros(1, 4, dtype=torch.long), position_ids=torch.arange(4)[None], use_cache=False)
        except tfcompat.InvalidInputError as exc:
            assert f"has 1 rank(s), apply_monkey_patch was given ulysses_sp_size={world}" in str(exc), str(exc)
        else:
            raise AssertionError("a forward without verl's group was not rejected")


def collectives_per_forward(rank: int, world: int) -> None:
    """The boundaries are gathered once per forward: the all-gathers of a text-model forward do not grow with its
    depth."""
    vu = load_verl_ulysses()
    vu.set_ulysses_sequence_parallel_group(dist.group.WORLD)
    calls = []
    original = dist.all_gather

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    counts = {}
    for layers in (1, 4):
        model = tiny_model("qwen2", "sdpa", num_hidden_layers=layers)
        inputs = pack(model, sample_sequences(model, *TEXT_CASE, seed=3))
        with apply_monkey_patch(model, ulysses_sp_size=world), torch.no_grad():
            dist.all_gather = counting
            try:
                verl_actor_logprobs(model, vu, inputs, world, fused=False)
            finally:
                dist.all_gather = original
        counts[layers], calls[:] = len(calls), []
    assert counts[1] == counts[4] >= 1, f"all_gather calls by depth: {counts}"
