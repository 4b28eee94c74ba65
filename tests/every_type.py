"""Every causal-LM type transformers ships, as a tiny random model: build, sample, run stock, pack, compare.

The oracle is the stock model run on each sequence alone (no cache); the candidate is the packed row (one row,
position ids restarting at 0 per sequence) through `tfcompat.patch(model)`. `check()` classifies one type:

- ``pass``: patched, and per token the packed logits (and every parameter's gradient of a fixed random projection
  of them) equal stock per sequence within `TOLERANCE` (`GRAD_TOLERANCE` for gradients; relative, fp32), or miss
  them by less than `tfcompat.hf.rounding.NEAR_MISS` and meet them with the model and inputs in float64
  (rounding shrinks with the precision, a wrong patch does not; the reason names both);
- ``refused``: `patch()` raised a typed tfcompat error (its first line is the reason);
- ``fail``: patched and wrong, or `patch()` raised something untyped;
- ``unbuildable``: the tiny model cannot be built, or its stock forward/backward does not run (the reason says which);
- ``skipped``: the model class has no such stock attention implementation (sdpa), so there is no reference.

`stock_check()` validates the zoo without tfcompat: each tiny model runs forward and backward per sequence, and the
comparison can fail (the unpatched row with positions running on across sequences differs from per sequence).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

import tfcompat
from tfcompat.errors import InvalidInputError, PatchError, UnknownFamilyError, UnsupportedVersionError
from tfcompat.hf import offload as hf_offload
from tfcompat.hf.rounding import is_rounding, to_float64
from tfcompat.inputs.derived_vision import owner_of
from tfcompat.inputs.token_types import required, with_prefix_suffix
from tfcompat.registry.lookup import resolve_model
from tfcompat.registry.upstream import UPSTREAM_BUGS
from tfcompat.selfcheck import vision_placeholder
from tfcompat.tiny_models import (
    Kind,
    TinyModelError,
    attention_implementations,
    encoder_decoder_examples,
    requires_images,
    special_token_ids,
    tiny_image,
    tiny_model,
    tiny_video,
)

TOLERANCE = 1e-5
# gradients sum a projection over every token and parameter entry: a deep tiny model's eager reference differs from
# its own sdpa one by about 1e-5 there (gemma3n_text: patched vs sdpa 2.7e-7, vs eager 1.1e-5), so twice the margin
GRAD_TOLERANCE = 2e-5
REFUSALS = (PatchError, UnknownFamilyError, UnsupportedVersionError)
LENGTHS = (7, 13, 10)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What `check()` or `stock_check()` found for one type: status, reason (first line), max relative diff."""

    model_type: str
    status: str  # "pass" | "refused" | "fail" | "unbuildable" | "skipped"
    reason: str = ""
    diff: float | None = None


def build(model_type: str, attn_implementation: str = "sdpa", *, kind: Kind = "causal_lm", seed: int = 0
          ) -> torch.nn.Module:
    """The tiny fp32 model of `model_type`, seeded, in eval mode (dropout is 0 anyway); raises TinyModelError."""
    return tiny_model(model_type, kind, attn_implementation=attn_implementation, seed=seed)


def special_ids(config) -> set[int]:
    """Every token id the config tree names (bos, eos, pad, image, ...): sampled text avoids them."""
    return special_token_ids(config)


def sample_sequences(config, lengths: Sequence[int] = LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    """Random token ids, one `(L_i,)` long tensor per length, drawn from the text vocab minus the special ids."""
    vocab = config.get_text_config().vocab_size
    allowed = torch.tensor(sorted(set(range(vocab)) - special_ids(config)))
    g = torch.Generator().manual_seed(seed)
    return [allowed[torch.randint(len(allowed), (n,), generator=g)] for n in lengths]


def logits_of(model: torch.nn.Module, **inputs) -> torch.Tensor:
    """`(L, V)` fp32 (a float64 model's: float64) logits of a one-row call without cache."""
    logits = model(**inputs, use_cache=False).logits[0]
    return logits if logits.dtype == torch.float64 else logits.float()


def in_float64(model: torch.nn.Module, examples: list[dict[str, Any]], packed: Callable[[], dict[str, Any]]
               ) -> tuple[float, float] | None:
    """``(logits, gradients)`` differences of the patched packed row from stock per sequence with ``model`` (a
    throwaway tiny model, cast in place) and ``examples`` in float64 (`tfcompat.hf.rounding`); ``packed()`` builds
    the row's inputs from the cast examples' (called under the patch). None where the model does not run in
    float64."""
    try:
        examples = to_float64(model, examples)
        with torch.no_grad():
            expected = [logits_of(model, **ex) for ex in examples]
        w = projection(expected[0].shape[-1]).to(torch.float64)
        expected_grads = gradients(model, lambda: sum((logits_of(model, **ex) @ w).sum() for ex in examples))
        with tfcompat.patch(model, prove=False):
            inputs = packed(examples)
            with torch.no_grad():
                diff = compare(logits_of(model, **inputs), expected)
            grad_diff = compare_gradients(gradients(model, lambda: (logits_of(model, **inputs) @ w).sum()),
                                          expected_grads)
    except Exception:  # noqa: BLE001 -- a kernel without float64: no evidence either way
        return None
    return diff, grad_diff


def _rounding_note(model: torch.nn.Module, examples: list[dict[str, Any]], packed: Callable[..., dict[str, Any]],
                   diff: float, grad_diff: float) -> str:
    """Where float32's ``diff`` / ``grad_diff`` miss the tolerances: "" unless float64 shows each that misses its
    tolerance rounding (then what it shows)."""
    again = in_float64(model, examples, packed)
    if again is None or not all(got <= tol or is_rounding(got, wide, tol) for got, wide, tol in (
            (diff, again[0], TOLERANCE), (grad_diff, again[1], GRAD_TOLERANCE))):
        return ""
    return f"float32's logits {diff:.1e}, gradients {grad_diff:.1e} are rounding: {again[0]:.1e}, {again[1]:.1e} " \
        "in float64"


def stock_per_sequence(model: torch.nn.Module, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Stock logits of each sequence alone, `(L_i, V)` each, at the positions the model gives it by default (0, 1, ...
    for most; RoBERTa's count from its padding index): what the packed row's restarting position ids must give."""
    return [logits_of(model, input_ids=s[None]) for s in seqs]


def packed_inputs(seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One packed row: `input_ids (1, T)` and `position_ids (1, T)` restarting at 0 at each sequence."""
    return {
        "input_ids": torch.cat(seqs)[None],
        "position_ids": torch.cat([torch.arange(len(s)) for s in seqs])[None],
    }


def compare(packed: torch.Tensor, per_sequence: list[torch.Tensor]) -> float:
    """Max over tokens of `max |packed - stock| / max |stock|` for that token;
    `packed (T, V)`, `per_sequence (L_i, V)`. Logits the model bans (the dtype's minimum: Chameleon's image codes) are
    no scale: against theirs (3.4e38) any difference would vanish."""
    expected = torch.cat(per_sequence)
    if packed.shape != expected.shape:
        raise ValueError(f"packed logits {tuple(packed.shape)} vs per-sequence {tuple(expected.shape)}")
    banned = expected <= torch.finfo(expected.dtype).min / 2
    scale = expected.masked_fill(banned, 0.0).abs().amax(-1).clamp_min(1e-6)  # (T,)
    return float(((packed - expected).abs().amax(-1) / scale).max())


def projection(vocab: int, seed: int = 3) -> torch.Tensor:
    """A fixed random `(V,)` vector: the loss `(logits @ w).sum()` reaches every logit with a distinct weight."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


def gradients(model: torch.nn.Module, losses: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gradient of every parameter of `losses()` (a scalar), from zero."""
    model.zero_grad(set_to_none=True)
    losses().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def compare_gradients(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """Max over parameters of `max |got - expected| / max(1, max |expected|)`;
    a parameter missing on one side is inf."""
    if got.keys() != expected.keys():
        return float("inf")
    return max((float((got[n] - e).abs().max()) / max(1.0, float(e.abs().max())) for n, e in expected.items()),
               default=0.0)


def two_rows_checkpointed(model: torch.nn.Module) -> tuple[float, float]:
    """Two packed rows of two sequences each through the patched ``model`` under non-reentrant gradient
    checkpointing (train mode): ``(logits diff, gradient diff)`` against stock per sequence (`compare`,
    `compare_gradients`); the recomputation must find the boundaries again."""
    import tfcompat

    seqs = sample_sequences(model.config, lengths=(7, 13, 12, 8))
    with torch.no_grad():
        expected = stock_per_sequence(model, seqs)
    w = projection(expected[0].shape[-1])
    expected_grads = gradients(model, lambda: sum((o @ w).sum() for o in stock_per_sequence(model, seqs)))
    rows = [packed_inputs(seqs[:2]), packed_inputs(seqs[2:])]
    inputs = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}  # (2, 20) each
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with tfcompat.patch(model):
        logits = model(**inputs, use_cache=False).logits.float()  # (2, 20, V)
        with torch.no_grad():
            diff = compare(logits.detach().reshape(-1, logits.shape[-1]), expected)
        model.zero_grad(set_to_none=True)
        (logits @ w).sum().backward()
        got = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return diff, compare_gradients(got, expected_grads)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    why = next((line.strip() for line in text if line.strip().startswith("why:")), "")
    return f"{type(exc).__name__}: {text[0] if text else ''}{' (' + why + ')' if why else ''}"[:240]


def _unbuildable(model_type: str, exc: BaseException) -> Outcome:
    """``unbuildable`` for ``exc``, or ``refused`` where `tfcompat.resolve` refuses the type for a declared upstream
    bug (`tfcompat.registry.upstream`: a stock model that does not build or run on the release)."""
    try:
        tfcompat.resolve(model_type)
    except REFUSALS as refusal:
        if getattr(refusal, "why", None) in {bug.what for bug in UPSTREAM_BUGS}:
            return Outcome(model_type, "refused", _reason(refusal))
    return Outcome(model_type, "unbuildable", _reason(exc))


def _patch(model_type: str, model: torch.nn.Module, **options: Any) -> Any:
    """`tfcompat.patch(model, **options)`'s handle, or the `Outcome` of a refusal (a typed error) or a defect (an
    untyped one)."""
    try:
        return tfcompat.patch(model, **options)
    except REFUSALS as exc:
        return Outcome(model_type, "refused", _reason(exc))
    except Exception as exc:  # noqa: BLE001 -- an untyped error at patch() is a defect
        return Outcome(model_type, "fail", f"untyped error at patch(): {_reason(exc)}")


def check(model_type: str, attn_implementation: str = "sdpa", seed: int = 0) -> Outcome:
    """Packed through `tfcompat.patch` vs stock per sequence, forward and backward (see the module docstring)."""
    if attn_implementation not in attention_implementations(model_type):
        return Outcome(model_type, "skipped", f"the model class offers no {attn_implementation} attention")
    try:
        model = build(model_type, attn_implementation, seed=seed)
        seqs = sample_sequences(model.config, seed=seed)
        with torch.no_grad():
            expected = stock_per_sequence(model, seqs)
        w = projection(expected[0].shape[-1])
        expected_grads = gradients(model, lambda: sum((o @ w).sum() for o in stock_per_sequence(model, seqs)))
    except Exception as exc:  # noqa: BLE001 -- the zoo reports every reason a type cannot be built or run
        return _unbuildable(model_type, exc)
    handle = _patch(model_type, model)
    if isinstance(handle, Outcome):
        return handle
    with handle:
        try:
            inputs = packed_inputs(seqs)
            with torch.no_grad():
                diff = compare(logits_of(model, **inputs), expected)
            got_grads = gradients(model, lambda: (logits_of(model, **inputs) @ w).sum())
        except Exception as exc:  # noqa: BLE001
            return Outcome(model_type, "fail", f"patched forward raised {_reason(exc)}")
    if got_grads.keys() != expected_grads.keys():
        missing = sorted(got_grads.keys() ^ expected_grads.keys())
        return Outcome(model_type, "fail", f"patched gradients reach other parameters: {', '.join(missing[:4])}",
                       float("inf"))
    grad_diff = compare_gradients(got_grads, expected_grads)
    if diff <= TOLERANCE and grad_diff <= GRAD_TOLERANCE:
        return Outcome(model_type, "pass", diff=max(diff, grad_diff))
    rounding = _rounding_note(model, [{"input_ids": s[None]} for s in seqs],
                              lambda examples: packed_inputs([ex["input_ids"][0] for ex in examples]), diff, grad_diff)
    if rounding:
        return Outcome(model_type, "pass", rounding, max(diff, grad_diff))
    return Outcome(model_type, "fail", f"patched packed differs from stock per sequence: logits {diff:.2e}, "
                   f"gradients {grad_diff:.2e}", max(diff, grad_diff))


KEPT: tuple[dict[str, Any], ...] = (
    {"checkpoint_keep": ("attention", "mlp")},
    {"checkpoint_keep": {"attention": 1.0, "mlp_in": 1.0}},
    {"checkpoint_keep": {"attention": 1.0, "mlp_in": 1.0}, "checkpoint_offload": True, "checkpoint_fetch": "mlp_in"},
    {"checkpoint_keep": ("attention", "mlp"), "checkpoint_offload": True, "checkpoint_fetch": "attention"},
)
"""`kept_check`'s policies: patch arguments (offloaded ones copy every storage: `offload.MIN_BYTES` is 0 there)."""
KEPT_TOLERANCE = 1e-6  # the same kernels on the same values as full recompute: only summation order may differ


def kept_check(model_type: str, seed: int = 0) -> Outcome:
    """The packed row under non-reentrant gradient checkpointing (train mode) with kept modules (each `KEPT` policy
    the patch accepts, kept or offloaded with each fetch point) against the same patch with full recompute: every
    parameter's gradient (`compare_gradients`) within `KEPT_TOLERANCE`. ``refused`` where the patch refuses every
    policy, ``skipped`` without checkpointing."""
    try:
        model = build(model_type, attention_implementations(model_type)[-1], seed=seed)
        if not model.supports_gradient_checkpointing:
            return Outcome(model_type, "skipped", "the model class has no gradient checkpointing")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        inputs = packed_inputs(sample_sequences(model.config, seed=seed))
        w = projection(model.config.get_text_config().vocab_size)
    except Exception as exc:  # noqa: BLE001
        return _unbuildable(model_type, exc)

    def grads(options: dict[str, Any]) -> dict[str, torch.Tensor] | Outcome:
        with _every_storage_offloaded():
            handle = _patch(model_type, model, **options)
        if isinstance(handle, Outcome):
            return handle
        with handle:
            try:
                torch.manual_seed(seed)  # the same draws in both runs, should the layers draw any
                return gradients(model, lambda: (logits_of(model, **inputs) @ w).sum())
            except Exception as exc:  # noqa: BLE001
                return Outcome(model_type, "fail", f"patched forward raised {_reason(exc)}")

    full = grads({})
    if isinstance(full, Outcome):
        return full
    diffs, refusals = [], []
    for keep in KEPT:
        got = grads(keep)
        if isinstance(got, Outcome) and got.status == "refused":
            refusals.append(got.reason)
        elif isinstance(got, Outcome):
            return got
        else:
            diffs.append(compare_gradients(got, full))
    if not diffs:
        return Outcome(model_type, "refused", refusals[0])
    diff = max(diffs)
    if diff <= KEPT_TOLERANCE:
        return Outcome(model_type, "pass", diff=diff)
    return Outcome(model_type, "fail", f"kept modules' gradients differ from full recompute by {diff:.2e}", diff)


@contextlib.contextmanager
def _every_storage_offloaded() -> Iterator[None]:
    """A patch made inside offloads every storage its kept modules save (tiny models' are under `MIN_BYTES`)."""
    before = hf_offload.MIN_BYTES
    hf_offload.MIN_BYTES = 0
    try:
        yield
    finally:
        hf_offload.MIN_BYTES = before


def stock_check(model_type: str, attn_implementation: str = "eager", seed: int = 0) -> Outcome:
    """Without tfcompat: the tiny model runs forward and backward per sequence, with finite logits `(L_i, V)`, and
    `compare` can fail (the unpatched row with positions running on across sequences differs from per sequence)."""
    try:
        model = build(model_type, attn_implementation, seed=seed)
        seqs = sample_sequences(model.config, seed=seed)
        with torch.no_grad():
            w = projection(stock_per_sequence(model, seqs[:1])[0].shape[-1])
        grads = gradients(model, lambda: sum((o @ w).sum() for o in stock_per_sequence(model, seqs)))
        with torch.no_grad():
            expected = stock_per_sequence(model, seqs)
            run_on = logits_of(model, input_ids=torch.cat(seqs)[None])
    except Exception as exc:  # noqa: BLE001
        return Outcome(model_type, "unbuildable", _reason(exc))
    if not all(torch.isfinite(o).all() for o in expected) or not grads:
        return Outcome(model_type, "fail", "non-finite logits or no gradient")
    control = compare(run_on, expected)
    if control <= 1e-3:
        return Outcome(model_type, "fail", f"control: the run-on row equals per sequence ({control:.1e})", control)
    return Outcome(model_type, "pass", diff=control)


def image_sequence(model: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """One row of text around one fake image (`tiny_image`), laid out as `_vision_row` says."""
    before, after = sample_sequences(model.config, lengths=(5, 4), seed=seed)
    return _vision_row(model, "image", tiny_image(model, seed=seed), before, after)


def _vision_row(model: torch.nn.Module, kind: str, item: Any, before: torch.Tensor, after: torch.Tensor,
                run: list[int] | None = None) -> dict[str, torch.Tensor]:
    """``input_ids (1, L)``: ``before``, the item's placeholder run, ``after``; the item's kwargs; and
    ``mm_token_type_ids`` / ``moe_mm_token_type_ids (1, L)`` where the forward takes them (1 image, 2 video: as the
    processor returns them; without them 5.3+ Qwen-VL forwards place every token as text, and a reference run so is
    not the model's). A written M-RoPE family's item takes its processor's layout (start / end tokens) and token types.
    item: a `tfcompat.tiny_models.TinyImage` (an image or a video); run: its placeholder run where given (its
    placeholders, ``item.tokens`` of them, are the tokens of the item's type; the rest is text or markers)."""
    written = _written_family(model)
    grid = item.inputs.get(f"{kind}_grid_thw")
    placeholders = None
    if run is None:
        run = [item.token_id] * item.tokens
        if written is not None and grid is not None:
            run = vision_placeholder(model.config, kind, tuple(grid[0].tolist()))
    elif written is None:  # a derived family's own layout: its placeholders are the items' tokens, at their places
        marked = torch.tensor(run) == (item.token_id if run.count(item.token_id) == item.tokens
                                       else model.config.image_token_id)
        placeholders = torch.cat([torch.zeros(len(before), dtype=torch.bool), marked,
                                  torch.zeros(len(after), dtype=torch.bool)])[None]
    ids = torch.cat([before, torch.tensor(run, dtype=torch.long), after])[None]  # run: empty for a prepended image
    inputs = {"input_ids": ids, **item.inputs, **(item.per_token(ids) if getattr(item, "per_token", None) else {})}
    for name in ("mm_token_type_ids", "moe_mm_token_type_ids"):  # ERNIE-4.5-VL routes its MoE by the latter
        if name in inspect.signature(model.forward).parameters:
            build_types = None if written is None else (
                written.mm_token_types if name == "mm_token_type_ids" else written.moe_token_types)
            code = 1 if kind == "image" else 2
            inputs[name] = (build_types(model.config, ids) if build_types is not None
                            else code * (ids == item.token_id if placeholders is None else placeholders).long())
    return inputs


def _derived_vision(model: torch.nn.Module) -> bool:
    """Whether ``model``'s type resolves as a derived vision-language entry."""
    try:
        return tfcompat.resolve(model.config.model_type).entry.derived_vision is not None
    except REFUSALS:
        return False


def _written_family(model: torch.nn.Module) -> Any:
    """The written vision-language family table of ``model``'s type (`tfcompat.registry.records.Family`), or None."""
    try:
        fam = tfcompat.registry.family(model.config.model_type)
    except REFUSALS:
        return None
    return fam if fam.is_vision and fam.entries[-1].derived_vision is None else None


def image_check(model_type: str, attn_implementation: str = "eager", seed: int = 0) -> Outcome:
    """Without tfcompat: the tiny vision-language model runs forward and backward on text around one fake image,
    with finite logits, and the image reaches the logits (another image changes them)."""
    try:
        model = build(model_type, attn_implementation, kind="image_text_to_text", seed=seed)
        inputs = image_sequence(model, seed=seed)
        logits = logits_of(model, **inputs)
        (logits @ projection(logits.shape[-1])).sum().backward()
        other = {k: torch.randn_like(v) if k == "pixel_values" else v for k, v in inputs.items()}
        with torch.no_grad():
            moved = compare(logits_of(model, **other), [logits.detach()])
    except Exception as exc:  # noqa: BLE001
        return Outcome(model_type, "unbuildable", _reason(exc))
    if not torch.isfinite(logits).all():
        return Outcome(model_type, "fail", "non-finite logits")
    if moved <= 1e-6:  # the zoo's limit, not the model's: its tiny tower maps every image to the same features
        return Outcome(model_type, "unbuildable", "the image does not reach the logits (degenerate tiny vision tower)")
    n = int(inputs["input_ids"].shape[-1]) - 9  # 5 + 4 text tokens around the image
    return Outcome(model_type, "pass", f"{n} image tokens, pixel_values {tuple(inputs['pixel_values'].shape)}", moved)


def video_sequence(model: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor] | None:
    """One row of text around one fake two-frame video (`tiny_video`), laid out as `_vision_row` says, or None where
    the tiny model takes none."""
    try:
        video = tiny_video(model, seed=seed)
    except TinyModelError:
        return None
    before, after = sample_sequences(model.config, lengths=(3, 4), seed=seed)
    rows = [_vision_row(model, "video", video, before, after, run) for run in _video_runs(model.config, video, seed)]
    for row in rows:  # the first layout the stock forward takes: its rope index / placeholder check rejects the others
        try:
            with torch.no_grad():
                logits_of(model, **row)
        except Exception:  # noqa: BLE001, S112 -- the next layout may be the processor's
            continue
        return row
    return rows[0]  # none runs: vlm_check says why the first (Qwen-VL's) does not


def _video_runs(config, video: Any, seed: int) -> list[list[int] | None]:
    """Placeholder runs of one video as processors lay them out, in order (None: `_vision_row`'s default run):

    - one run of ``video_token_id`` for the whole video (Qwen2-VL; a written family's own layout);
    - one segment per frame of the ``video_grid_thw`` (``t`` frames of ``n`` tokens), each after its timestamp (text),
      between ``vision_start`` / ``vision_end`` (Qwen3-VL, Cosmos3 Edge: the rope index splits the grid per frame);
    - GLM's: the frames as images (``image_start``, ``image_token_id * n``, ``image_end``, timestamp) between
      ``video_start`` / ``video_end`` (GLM-OCR's placeholder mask counts video features at image tokens).
    """
    grid = video.inputs.get("video_grid_thw")
    if grid is None:
        return [None]
    t = int(grid[0, 0])
    n = video.tokens // t
    stamps = sample_sequences(config, lengths=(2,) * t, seed=seed + 7)  # "<0.5 seconds>": text between frames
    ids = {k: v for k in ("vision_start_token_id", "vision_end_token_id", "image_start_token_id", "image_end_token_id",
                          "video_start_token_id", "video_end_token_id", "image_token_id")
           if isinstance(v := getattr(config, k, None), int)}
    runs: list[list[int] | None] = [None]
    if {"vision_start_token_id", "vision_end_token_id"} <= ids.keys():
        runs.append([x for f in range(t) for x in (*stamps[f].tolist(), ids["vision_start_token_id"],
                                                   *[video.token_id] * n, ids["vision_end_token_id"])])
    if {"image_start_token_id", "image_end_token_id", "video_start_token_id", "video_end_token_id", "image_token_id"
        } <= ids.keys():
        frames = [x for f in range(t) for x in (ids["image_start_token_id"], *[ids["image_token_id"]] * n,
                                                ids["image_end_token_id"], *stamps[f].tolist())]
        runs.append([ids["video_start_token_id"], *frames, ids["video_end_token_id"]])
    return runs


def vlm_examples(model: torch.nn.Module, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Sequences for a packed row of a vision-language model: text around an image, text alone, text around another
    image (each an `image_sequence`: its own image kwargs, as a processor returns them for one sample), and text
    around a video where the model takes videos and tfcompat patches it (`video_sequence`), unless the release's
    stock forward rejects every video (known issue ``videos_rejected``: no reference)."""
    if getattr(model.config, "vision_config", None) is None and not {"image_token_id", "image_token_index"} & set(
            model.config.to_dict()):
        # a text model the image-text-to-text mapping lists (5.24's Mistral 4): its own sequences, text alone
        return [{"input_ids": ids[None]} for ids in sample_sequences(model.config, seed=seed)]  # (L,) -> (1, L)
    text = sample_sequences(model.config, lengths=(6,), seed=seed + 1)[0][None]
    try:
        issues = tfcompat.resolve(model.config.model_type).entry.known_issues
        takes_videos = "videos_rejected" not in issues
    except REFUSALS:
        takes_videos = False
    video = video_sequence(model, seed=seed + 3) if takes_videos else None
    # a forward that requires pixel values (BLIP-2) runs no text alone: that sequence holds an image too
    alone = image_sequence(model, seed=seed + 1) if _requires_images(model) else {"input_ids": text}
    examples = [image_sequence(model, seed=seed), alone, image_sequence(model, seed=seed + 2),
                *([video] if video is not None else [])]
    if _written_family(model) is not None:  # as selfcheck.stock_inputs: 4.x mask builders crash on 3-row ids without
        for ex in examples:
            ex["attention_mask"] = torch.ones_like(ex["input_ids"])
    # the processor's prefix (0) and suffix (1) where stock needs them (PaliGemma's sdpa: its processor returns them)
    return with_prefix_suffix(examples, token_types_needed(model))


def token_types_needed(model: torch.nn.Module) -> tuple[str, ...]:
    """The token types without which the owner's stock mask is not causal (PaliGemma's under sdpa), so that packed
    rows without them are refused (`tfcompat.inputs.token_types.required`)."""
    try:
        r = resolve_model(model)
    except REFUSALS:
        return ()
    return required(r, *owner_of(r, model)) if r.entry.derived_vision is not None else ()


def _requires_images(model: torch.nn.Module) -> bool:
    return requires_images(model)


def vlm_check(model_type: str, attn_implementation: str = "sdpa", seed: int = 0, **options: Any) -> Outcome:
    """A vision-language type: `tfcompat.pack` of `vlm_examples` through `tfcompat.patch(model, **options)` vs stock per
    sequence (each with its own image), forward and backward; and the same row through `tfcompat.embed_inputs` (the
    vision tower run before the forward, as for Ulysses). Statuses as `check`; a pass records the largest diff, and
    fails when the control (the unpatched packed row, positions running on) does not differ."""
    if attn_implementation not in attention_implementations(model_type, "image_text_to_text"):
        return Outcome(model_type, "skipped", f"the model class offers no {attn_implementation} attention")
    try:
        model = build(model_type, attn_implementation, kind="image_text_to_text", seed=seed)
    except Exception as exc:  # noqa: BLE001 -- the zoo reports every reason a type cannot be built or run
        return _unbuildable(model_type, exc)
    if _encoder_decoder(model) is not None:
        return encoder_decoder_check(model_type, model, seed)
    try:
        examples, video_note = vlm_examples(model, seed=seed), ""
        if len(examples) > 3:  # the video row, where the stock forward runs it (else the zoo's video layout is not
            try:  # the processor's, as Nemotron-H Omni's image tokens for videos): the type is then checked on images
                with torch.no_grad():
                    logits_of(model, **examples[3])
            except Exception as exc:  # noqa: BLE001
                examples, video_note = examples[:3], f"; video not run: {_reason(exc)}"
        shared = _derived_vision(model) and resolve_model(model).entry.derived_vision.kinds_share_placeholder
        if len(examples) > 3 and _derived_vision(model) and not shared:  # a stock forward that rejects images and
            try:  # videos in one row rejects them unpacked too: images only then, said (where its placeholder mask
                # counts video frames as images, GLM-OCR's, pack embeds each sequence alone: the video stays)
                with torch.no_grad():
                    logits_of(model, **{k: v for k, v in tfcompat.pack(model, examples).model_inputs.items()
                                        if not k.startswith("tfcompat")})
            except Exception as exc:  # noqa: BLE001
                examples, video_note = examples[:3], f"; video not packed with images (stock rejects the mix: " \
                    f"{_reason(exc)[:80]})"
        with torch.no_grad():
            expected = [logits_of(model, **ex) for ex in examples]
        w = projection(expected[0].shape[-1])
        expected_grads = gradients(model, lambda: sum((logits_of(model, **ex) @ w).sum() for ex in examples))
    except Exception as exc:  # noqa: BLE001
        # no fake image for it: patch() still says whether tfcompat takes the model at all (a refusal needs no image)
        refusal = _patch(model_type, model, **options)
        if isinstance(refusal, Outcome):
            return refusal
        refusal.undo()
        return Outcome(model_type, "unbuildable", _reason(exc))
    handle = _patch(model_type, model, **options)
    if isinstance(handle, Outcome):
        return handle
    with handle:
        try:
            inputs = tfcompat.pack(model, examples).model_inputs
        except InvalidInputError as exc:  # typed before any forward: a text family packs no images (GIT's, set in
            return Outcome(model_type, "refused", _reason(exc))  # front of its row), said
        try:
            with torch.no_grad():
                diff = compare(logits_of(model, **inputs), expected)
                rest = {k: v for k, v in inputs.items() if k not in ("input_ids", "position_ids")}
                per_token = ("tfcompat", "token_type_ids", "mm_token_type_ids", "moe_mm_token_type_ids")
                vision = {k: v for k, v in rest.items() if not k.startswith(per_token)}
                context = {k: v for k, v in rest.items() if k.startswith(per_token)}
                diff_embedded, note = diff, "; packed through embed_inputs"  # GLM: images with videos
                try:
                    embedded = (tfcompat.embed_inputs(model, inputs["input_ids"], **vision)
                                if "input_ids" in inputs else None)
                except InvalidInputError as exc:  # a stock forward that takes no embeddings alone: said, typed
                    diff_embedded, note = 0.0, f"; embed_inputs refused: {_reason(exc)}"
                else:
                    if embedded is not None:
                        diff_embedded, note = compare(logits_of(model, **{**context, **embedded.model_inputs()},
                                                                position_ids=inputs["position_ids"]), expected), ""
            got_grads = gradients(model, lambda: (logits_of(model, **inputs) @ w).sum())
        except Exception as exc:  # noqa: BLE001
            return Outcome(model_type, "fail", f"patched forward raised {_reason(exc)}")
    with torch.no_grad():  # the control: the same row unpatched, positions running on (stock 5.x finds restarting
        # position ids itself), attends across sequences
        unpatched = {k: v for k, v in inputs.items() if not k.startswith("tfcompat") and k != "position_ids"}
        if "input_ids" not in unpatched:  # embedded by pack: no ids to compute positions from, so they run on
            unpatched["position_ids"] = torch.arange(inputs["position_ids"].shape[-1])[None]
        if _written_family(model) is not None:  # as in vlm_examples
            unpatched["attention_mask"] = torch.ones(inputs["position_ids"].shape[-2:], dtype=torch.long)
        control = compare(logits_of(model, **unpatched), expected)
    if got_grads.keys() != expected_grads.keys():
        missing = sorted(got_grads.keys() ^ expected_grads.keys())
        return Outcome(model_type, "fail", f"patched gradients reach other parameters: {', '.join(missing[:4])}",
                       float("inf"))
    grad_diff = compare_gradients(got_grads, expected_grads)
    worst = max(diff, diff_embedded, grad_diff)
    rounding = ""
    if not (diff <= TOLERANCE and diff_embedded <= TOLERANCE and grad_diff <= GRAD_TOLERANCE) and control > 1e-3:
        rounding = _rounding_note(model, examples, lambda ex: tfcompat.pack(model, ex).model_inputs,
                                  max(diff, diff_embedded), grad_diff)
    if rounding or (diff <= TOLERANCE and diff_embedded <= TOLERANCE and grad_diff <= GRAD_TOLERANCE):
        if control <= 1e-3:
            return Outcome(model_type, "fail", f"control: the unpatched packed row equals per sequence ({control:.1e})",
                           worst)
        return Outcome(model_type, "pass", f"control {control:.1e}{note}{video_note}" + (f"; {rounding}" if rounding
                                                                                           else ""), worst)
    return Outcome(model_type, "fail", f"patched packed differs from stock per sequence: logits {diff:.2e}, "
                   f"embedded {diff_embedded:.2e}, gradients {grad_diff:.2e}", worst)


def _encoder_decoder(model: torch.nn.Module) -> Any:
    """The encoder-decoder derivation of ``model``'s entry (`tfcompat.registry.records.EncoderDecoderDerivation`), or
    None (another kind of model, or a refused one: `_patch` says why)."""
    try:
        return tfcompat.registry.resolve_model(model).entry.encoder_decoder
    except REFUSALS:
        return None


def encoder_decoder_check(model_type: str, model: torch.nn.Module, seed: int = 0) -> Outcome:
    """An encoder-decoder type: `tfcompat.pack` of `tfcompat.tiny_models.encoder_decoder_examples` (decoder ids of
    `LENGTHS`, each sequence with its own image, Florence-2's prompts of different lengths) through `tfcompat.patch`
    vs stock per sequence, forward and backward; where the model's forward shifts labels into decoder ids, the same
    row packed from labels alone (shifted per sequence by `pack`) vs stock per sequence given the labels. The control:
    the unpatched decoder row (positions running on) on the first sequence's encoder inputs must differ."""
    d = _encoder_decoder(model)
    try:
        examples = encoder_decoder_examples(model, LENGTHS, seed=seed)
        with torch.no_grad():
            expected = [logits_of(model, **ex) for ex in examples]
        w = projection(expected[0].shape[-1])
        expected_grads = gradients(model, lambda: sum((logits_of(model, **ex) @ w).sum() for ex in examples))
        labelled, note = [], "; no labels shift read"
        if d.labels_shift:  # labels alone: stock builds the decoder ids from them per sequence
            labelled = [{**{k: v for k, v in ex.items() if k != d.decoder_ids}, "labels": ex[d.decoder_ids]}
                        for ex in examples]
            try:
                with torch.no_grad():
                    expected_labelled = [logits_of(model, **ex) for ex in labelled]
            except Exception as exc:  # noqa: BLE001 -- a config without the ids the shift needs (VED's pad id)
                labelled, note = [], f"; labels not run (stock: {_reason(exc)[:80]})"
    except Exception as exc:  # noqa: BLE001 -- as vlm_check: patch() says whether tfcompat takes the model at all
        refusal = _patch(model_type, model)
        if isinstance(refusal, Outcome):
            return refusal
        refusal.undo()
        return Outcome(model_type, "unbuildable", _reason(exc))
    handle = _patch(model_type, model)
    if isinstance(handle, Outcome):
        return handle
    with handle:
        try:
            inputs = tfcompat.pack(model, examples).model_inputs
        except InvalidInputError as exc:
            return Outcome(model_type, "refused", _reason(exc))
        try:
            with torch.no_grad():
                diff = compare(logits_of(model, **inputs), expected)
                diff_labels = 0.0
                if labelled:
                    diff_labels, note = compare(logits_of(model, **tfcompat.pack(model, labelled).model_inputs),
                                                expected_labelled), "; packed from labels too"
            got_grads = gradients(model, lambda: (logits_of(model, **inputs) @ w).sum())
        except Exception as exc:  # noqa: BLE001
            return Outcome(model_type, "fail", f"patched forward raised {_reason(exc)}")
    with torch.no_grad():  # the control: the row unpatched, positions running on, the first sequence's encoder inputs
        first = {k: v for k, v in examples[0].items() if k != d.decoder_ids}
        control = compare(logits_of(model, **first, **{d.decoder_ids: inputs[d.decoder_ids]}), expected)
    if got_grads.keys() != expected_grads.keys():
        missing = sorted(got_grads.keys() ^ expected_grads.keys())
        return Outcome(model_type, "fail", f"patched gradients reach other parameters: {', '.join(missing[:4])}",
                       float("inf"))
    grad_diff = compare_gradients(got_grads, expected_grads)
    worst = max(diff, diff_labels, grad_diff)
    if diff <= TOLERANCE and diff_labels <= TOLERANCE and grad_diff <= GRAD_TOLERANCE:
        if control <= 1e-3:
            return Outcome(model_type, "fail", f"control: the unpatched packed row equals per sequence ({control:.1e})",
                           worst)
        return Outcome(model_type, "pass", f"control {control:.1e}{note}", worst)
    return Outcome(model_type, "fail", f"patched packed differs from stock per sequence: logits {diff:.2e}, "
                   f"from labels {diff_labels:.2e}, gradients {grad_diff:.2e}", worst)
