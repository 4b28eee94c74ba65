"""Trainers tfcompat's users run, on patched tiny models: transformers' ``DataCollatorWithFlattening`` and
``Trainer`` with `tfcompat.integrations.hf.PackedCollator`, and TRL's ``SFTTrainer`` (``padding_free=True``, and
the collator for images).

Oracle: the stock model of the installed transformers, unpatched, on each sequence alone. A step's loss is the
token-weighted mean of its sequences' next-token losses (the sum of every sequence's summed cross entropy over
the number of its targets); a reference loop takes the same optimizer steps (AdamW, linear schedule, grad-norm
clip 1.0) from those per-sequence stock forwards, and the Trainer's losses must follow it step by step.

The Trainer tests need ``accelerate`` and the TRL tests ``trl`` and ``datasets``; they skip without them
(``nox -s trainers`` installs them).
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import tfcompat
from tfcompat.integrations.hf import PackedCollator
from tfcompat.registry import installed_families
from tfcompat.selfcheck import Sequence, sample_case, sample_sequences, stock_inputs, tiny_model

FAMILIES = list(installed_families())
VISION = [f for f in FAMILIES if tfcompat.resolve(f).spec.is_vision]
DENSE = [f for f in ("llama", "qwen2", "qwen3") if f in FAMILIES]
_VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
LR, STEPS = 1e-3, 3
LOSS_TOL = 1e-5  # fp32: packed patched forward vs per-sequence stock forwards, and the curves after 3 AdamW steps


def _need(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (nox -s trainers installs the trainer dependencies)")


# ------------------------------------------------------------------------------------------------ the data


def _items(family: str) -> tuple[list[int], list[Any]]:
    """The family's sample (`tfcompat.selfcheck.sample_case`), with videos turned to text where the installed
    stock forward rejects them in a packed batch (known issues: the collator refuses such batches)."""
    issues = tfcompat.resolve(family).entry.known_issues
    lengths, items = sample_case(family)
    if "videos_rejected" in issues or "images_with_videos_rejected" in issues:
        items = [None if isinstance(i, tuple) and i[0] == "video" else i for i in items]
    return lengths, items


def _features(model: torch.nn.Module, groups: int, seed: int = 0) -> list[dict[str, Any]]:
    """``groups`` batches' worth of per-sequence features (tensors): ids, labels ignoring a 2-token prompt and
    the vision placeholders, and each sequence's vision inputs."""
    r = tfcompat.resolve(model.config.model_type)
    lengths, items = _items(r.family)
    out = []
    for g in range(groups):
        for s in sample_sequences(model, lengths, items, seed=seed + g):
            labels = s.input_ids[0].clone()
            labels[:2] = -100
            if r.spec.mm_token_types is not None:
                labels[r.spec.mm_token_types(model.config, s.input_ids)[0] != 0] = -100
            out.append({"input_ids": s.input_ids[0], "labels": labels, **s.vision_inputs()})
    return out


def _tensor(x: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=dtype)


def _stock_sums(model: torch.nn.Module, feature: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """The stock model on one sequence alone: its summed next-token cross entropy, and its number of targets."""
    r = tfcompat.resolve(model.config.model_type)
    ids = _tensor(feature["input_ids"]).long()
    labels = _tensor(feature.get("labels", ids)).long()
    vision = {k: _tensor(feature[k]) for k in _VISION_KEYS if feature.get(k) is not None}
    logits = model(**stock_inputs(r, model, Sequence(ids[None], **vision)), use_cache=False).logits[0]
    targets = labels[1:]
    return (F.cross_entropy(logits[:-1].float(), targets, ignore_index=-100, reduction="sum"),
            int((targets != -100).sum()))


def _per_sequence_loss(model: torch.nn.Module, micro_batches: list[list[dict[str, Any]]],
                       token_weighted: bool) -> torch.Tensor:
    """One optimizer step's loss from per-sequence stock forwards: token-weighted over every sequence of the step
    (the Trainer divides by ``num_items_in_batch``), or the mean over micro-batches of each one's token-weighted
    loss (a model class with ``accepts_loss_kwargs = False``: the Trainer divides by the accumulation steps)."""
    sums = [[_stock_sums(model, f) for f in mb] for mb in micro_batches]
    if token_weighted:
        return sum(s for mb in sums for s, _ in mb) / sum(n for mb in sums for _, n in mb)
    return sum(sum(s for s, _ in mb) / sum(n for _, n in mb) for mb in sums) / len(sums)


def _reference_curve(model: torch.nn.Module, steps: list[list[list[dict[str, Any]]]], token_weighted: bool,
                     lr: float = LR) -> list[float]:
    """The Trainer's optimizer steps, taken from per-sequence stock forwards on ``model`` (unpatched): AdamW
    (torch's, the Trainer's defaults), the linear schedule without warm-up, gradient norm clipped to 1.0."""
    from transformers import get_linear_schedule_with_warmup

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    sched = get_linear_schedule_with_warmup(opt, 0, len(steps))
    curve = []
    for micro_batches in steps:
        loss = _per_sequence_loss(model, micro_batches, token_weighted)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        curve.append(float(loss.detach()))
    return curve


class _Recording:
    """Wraps a collator and keeps every batch of features it was handed, in order."""

    def __init__(self, collator: Callable[..., Any]) -> None:
        self.collator, self.batches = collator, []

    def __call__(self, features: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
        self.batches.append([dict(f) for f in features])
        return self.collator(features, *args, **kwargs)


def _recording_trainer(base: type) -> type:
    class Recording(base):  # type: ignore[misc, valid-type]
        """Keeps the loss of every micro-batch and the ``num_items_in_batch`` it was divided by."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.micro_losses: list[float] = []
            self.num_items: list[float | None] = []

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.micro_losses.append(float((loss[0] if return_outputs else loss).detach()))
            self.num_items.append(None if num_items_in_batch is None else float(num_items_in_batch))
            return loss

    return Recording


def _args(cls: type, tmp_path, batch: int, **kw: Any) -> Any:
    return cls(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=batch, learning_rate=LR,
               optim="adamw_torch", max_grad_norm=1.0, lr_scheduler_type="linear", use_cpu=True, report_to=[],
               save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, dataloader_num_workers=0, **kw)


def _steps(batches: list[list[dict[str, Any]]], n_steps: int, ga: int) -> list[list[list[dict[str, Any]]]]:
    """The collator's first ``n_steps * ga`` batches (the data loader may collate one ahead), grouped per step."""
    assert len(batches) >= n_steps * ga
    return [batches[i * ga:(i + 1) * ga] for i in range(n_steps)]


def _logged_losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _check_run(trainer: Any, reference: torch.nn.Module, recorder: _Recording, ga: int = 1) -> None:
    """The Trainer's losses against the per-sequence reference (the numbers are printed: ``pytest -s``)."""
    steps = _steps(recorder.batches, STEPS, ga)
    token_weighted = bool(trainer.model_accepts_loss_kwargs)
    curve = _reference_curve(reference, steps, token_weighted)
    first = curve[0]  # the per-sequence loss at the initial weights
    step_losses = [sum(trainer.micro_losses[i * ga:(i + 1) * ga]) / (1 if token_weighted else ga)
                   for i in range(STEPS)]
    targets = [sum(_stock_targets(f) for mb in step for f in mb) for step in steps]
    if token_weighted:  # num_items_in_batch: every target of the step's sequences, and nothing more
        assert trainer.num_items == [float(n) for n in targets for _ in range(ga)]
    else:
        assert trainer.num_items == [None] * (STEPS * ga)
    assert abs(step_losses[0] - first) <= LOSS_TOL, (step_losses[0], first)
    assert max(abs(a - b) for a, b in zip(step_losses, curve)) <= LOSS_TOL, (step_losses, curve)
    logged = _logged_losses(trainer)  # what the Trainer reports (4.x rounds it to 4 decimals)
    assert max(abs(a - b) for a, b in zip(logged, curve)) <= 1e-4, (logged, curve)
    print(f"\n[{type(trainer).__mro__[1].__name__} {trainer.model.config.model_type} ga={ga} "
          f"{'token-weighted' if token_weighted else 'mean of micro-batches'}] first step "
          f"{step_losses[0]:.7f} per-sequence {first:.7f}; curve {[f'{x:.7f}' for x in step_losses]} reference "
          f"{[f'{x:.7f}' for x in curve]}; max diff {max(abs(a - b) for a, b in zip(step_losses, curve)):.2e}")


def _stock_targets(feature: dict[str, Any]) -> int:
    labels = _tensor(feature.get("labels", feature["input_ids"]))
    return int((labels.reshape(-1)[1:] != -100).sum())


# ------------------------------------------------------------------------ DataCollatorWithFlattening (dense)


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "flash_kwargs"])
@pytest.mark.parametrize("family", DENSE)
@torch.no_grad()
def test_flattening_collator_on_patched_model(family, flash_kwargs):
    """Rule: transformers' DataCollatorWithFlattening row, run by the patched model, has the per-sequence loss and
    logits; the stock model on the same row (control) attends across sequences."""
    from transformers import DataCollatorWithFlattening

    model = tiny_model(family, "sdpa")
    features = _features(model, groups=1)
    kwargs = {"return_flash_attn_kwargs": True, "return_seq_idx": True} if flash_kwargs else {}
    batch = DataCollatorWithFlattening(**kwargs)([{k: v.tolist() for k, v in f.items()} for f in features])
    expected = _per_sequence_loss(model, [features], token_weighted=True)
    stock = model(**batch).loss
    with tfcompat.patch(model):
        out = model(**batch)
    assert abs(float(out.loss) - float(expected)) <= LOSS_TOL
    per_seq = [model(input_ids=f["input_ids"][None], use_cache=False).logits[0] for f in features]
    assert float((out.logits[0] - torch.cat(per_seq)).abs().max()) <= 1e-5
    assert abs(float(stock) - float(expected)) > 1e-4  # control: stock attention crosses the boundaries


# ------------------------------------------------------------------------------------ PackedCollator itself


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_collator_is_pack_without_context(family):
    """Rule: the collator returns `tfcompat.pack`'s inputs, all tensors (no forward context: the Trainer moves
    tensors to the device, the patched forward finds the boundaries itself), from dataset-style lists too (the
    loss of pack's row: tests/test_pack.py)."""
    model = tiny_model(family, "sdpa")
    features = _features(model, groups=1)
    tfcompat.patch(model)
    batch = PackedCollator(model)(features)
    packed = tfcompat.pack(model, features)
    assert set(batch) == set(packed.model_inputs) - {"tfcompat_context"}
    assert all(torch.equal(batch[k], packed.model_inputs[k]) for k in batch)
    as_lists = PackedCollator(model)([{k: v.tolist() for k, v in f.items()} for f in features])
    assert set(as_lists) == set(batch)
    for k in batch:
        assert as_lists[k].dtype == batch[k].dtype and torch.equal(as_lists[k], batch[k]), k


def test_collator_without_labels_trains_on_every_token():
    model = tiny_model("qwen2", "sdpa")
    tfcompat.patch(model)
    ids = [torch.arange(2, 7), torch.arange(10, 14)]
    batch = PackedCollator(model)([{"input_ids": i} for i in ids])
    assert batch["labels"].tolist() == [[-100, 3, 4, 5, 6, -100, 11, 12, 13]]


class TestCollatorRefuses:
    """Rule: what the collator cannot pack raises a typed error naming the fix, before any forward."""

    def test_unpatched_model(self):
        model = tiny_model("qwen2", "sdpa")
        collator = PackedCollator(model)
        with pytest.raises(tfcompat.PatchedModelError, match="is not patched") as info:
            collator([{"input_ids": torch.arange(5)}])
        assert "tfcompat.patch(model)" in info.value.fix
        handle = tfcompat.patch(model)
        collator([{"input_ids": torch.arange(5)}])
        handle.undo()
        with pytest.raises(tfcompat.PatchedModelError, match="is not patched"):
            collator([{"input_ids": torch.arange(5)}])

    def test_text_column(self):
        model = tiny_model("qwen2", "sdpa")
        tfcompat.patch(model)
        with pytest.raises(tfcompat.InvalidInputError, match="feature 0: text is not a numeric array"):
            PackedCollator(model)([{"input_ids": [1, 2, 3], "text": "hello"}])

    def test_unknown_key_names_the_example(self):
        model = tiny_model("qwen2", "sdpa")
        tfcompat.patch(model)
        with pytest.raises(tfcompat.InvalidInputError, match=r"example 1 has unknown keys \['token_type_ids'\]"):
            PackedCollator(model)([{"input_ids": [1, 2, 3]}, {"input_ids": [1, 2], "token_type_ids": [0, 0]}])

    def test_numpy_return_tensors(self):
        model = tiny_model("qwen2", "sdpa")
        tfcompat.patch(model)
        with pytest.raises(tfcompat.InvalidInputError, match="cannot return 'np' tensors"):
            PackedCollator(model)([{"input_ids": [1, 2, 3]}], return_tensors="np")

    @pytest.mark.parametrize("family", [f for f in VISION if {"videos_rejected", "images_with_videos_rejected"}
                                        & set(tfcompat.resolve(f).entry.known_issues)] or ["none"])
    def test_batch_the_stock_forward_rejects(self, family):
        if family == "none":
            pytest.skip("no registry entry of this transformers declares a stock forward rejecting videos")
        model = tiny_model(family, "sdpa")
        tfcompat.patch(model)
        items = [("image", (1, 4, 4)), ("video", (2, 4, 4))]
        seqs = sample_sequences(model, [6, 6], items)
        with pytest.raises(tfcompat.InvalidInputError, match="stock forward cannot take in one call") as info:
            PackedCollator(model)([{"input_ids": s.input_ids[0], **s.vision_inputs()} for s in seqs])
        assert "compute_loss" in info.value.fix


# --------------------------------------------------------------------------- transformers.Trainer, 3 steps


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_steps_equal_per_sequence_loop(family, tmp_path):
    """Rule: a Trainer fed by PackedCollator reports, from its first step on, the loss of per-sequence stock
    forwards, and its 3-step loss curve is the per-sequence reference loop's."""
    _need("accelerate")
    from transformers import Trainer, TrainingArguments

    model = tiny_model(family, "sdpa")
    reference = copy.deepcopy(model)
    tfcompat.patch(model)
    batch = len(_items(family)[1])
    recorder = _Recording(PackedCollator(model))
    trainer = _recording_trainer(Trainer)(model=model, args=_args(TrainingArguments, tmp_path, batch),
                                          train_dataset=_features(model, groups=STEPS), data_collator=recorder)
    trainer.train()
    _check_run(trainer, reference, recorder)


@pytest.mark.parametrize("family,accepts_loss_kwargs", [("qwen2", None), ("qwen2_vl", None), ("qwen2_5_vl", None),
                                                        ("qwen2_5_vl", True)])
def test_trainer_gradient_accumulation(family, accepts_loss_kwargs, tmp_path):
    """Rule: under gradient accumulation (2 packed rows per optimizer step) the Trainer's num_items_in_batch counts
    the targets of both rows exactly, so the step's loss is the token-weighted mean over all its sequences; a model
    class with ``accepts_loss_kwargs = False`` gets the Trainer's mean of the rows' losses, as for padded batches,
    and ``model.accepts_loss_kwargs = True`` gives it the token-weighted mean (its forward passes the count on)."""
    _need("accelerate")
    if family not in FAMILIES:
        pytest.skip(f"{family} is not in this transformers")
    from transformers import Trainer, TrainingArguments

    model = tiny_model(family, "sdpa")
    reference = copy.deepcopy(model)
    tfcompat.patch(model)
    if accepts_loss_kwargs is not None:
        model.accepts_loss_kwargs = accepts_loss_kwargs
    batch = len(_items(family)[1])
    recorder = _Recording(PackedCollator(model))
    args = _args(TrainingArguments, tmp_path, batch, gradient_accumulation_steps=2)
    trainer = _recording_trainer(Trainer)(model=model, args=args, train_dataset=_features(model, groups=2 * STEPS),
                                          data_collator=recorder)
    trainer.train()
    _check_run(trainer, reference, recorder, ga=2)


# ----------------------------------------------------------------------------------------- TRL's SFTTrainer


def _tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over the tiny model's vocabulary, built in memory (no download)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                   pad_token="<pad>", eos_token="<eos>")


@pytest.mark.parametrize("family", [*DENSE, *[f for f in ("qwen2_vl", "qwen3_vl") if f in FAMILIES]])
def test_sft_trainer_padding_free(family, tmp_path):
    """Rule: TRL's SFTTrainer with padding_free=True (its flattening collator, its fused LM-head loss, gradient
    checkpointing on) on a patched model reports the per-sequence loss and follows the reference curve; for a
    vision-language model this is text-only data (TRL refuses padding-free vision datasets)."""
    _need("trl", "datasets", "accelerate")
    import datasets
    from trl import SFTConfig, SFTTrainer

    model = tiny_model(family, "sdpa")
    reference = copy.deepcopy(model)
    tfcompat.patch(model)
    gen = torch.Generator().manual_seed(0)
    lengths = [7, 12, 5, 9, 6]
    rows = [{"input_ids": torch.randint(2, 100, (n,), generator=gen).tolist()} for n in lengths * STEPS]
    args = _args(SFTConfig, tmp_path, len(lengths), padding_free=True, max_length=None, bf16=False,
                 router_aux_loss_coef=0.0)
    trainer = _recording_trainer(SFTTrainer)(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                             processing_class=_tokenizer(model.config.get_text_config().vocab_size))
    assert trainer.args.gradient_checkpointing
    recorder = trainer.data_collator = _Recording(trainer.data_collator)
    trainer.train()
    _check_run(trainer, reference, recorder)


@pytest.mark.parametrize("family", VISION)
def test_sft_trainer_with_packed_collator(family, tmp_path):
    """Rule: TRL's SFTTrainer fed by PackedCollator (images; TRL's own padding-free mode refuses vision datasets and
    custom collators) on a patched vision-language model reports the per-sequence loss and follows the reference.
    The MoE load-balancing loss TRL adds by default (a batch statistic, not a per-sequence loss) is turned off."""
    _need("trl", "datasets", "accelerate")
    import datasets
    from trl import SFTConfig, SFTTrainer

    model = tiny_model(family, "sdpa")
    reference = copy.deepcopy(model)
    tfcompat.patch(model)
    features = _features(model, groups=STEPS)
    keys = sorted({k for f in features for k in f})
    rows = [{k: (f[k].tolist() if k in f else None) for k in keys} for f in features]  # every row holds every column
    args = _args(SFTConfig, tmp_path, len(_items(family)[1]), max_length=None, bf16=False, router_aux_loss_coef=0.0,
                 remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True})
    recorder = _Recording(PackedCollator(model))
    trainer = _recording_trainer(SFTTrainer)(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                             processing_class=_tokenizer(model.config.get_text_config().vocab_size),
                                             data_collator=recorder)
    trainer.train()
    _check_run(trainer, reference, recorder)
