"""The patch-time proof of a derived type: a tiny copy of the model, stock per sequence against patched packed.

A derived type's patch is read from its modeling module (`tfcompat.registry.derive`); what a config switches on (a
window, a layer pattern, a rope scaling, top-1 routing) may take a path the reading did not see. `prove` checks the
patch on the model's own semantics where it is cheap: a tiny random model of ``model``'s class built from a shrunk
copy of its config (`tfcompat.tiny_models.shrunk_config`: sizes shrunk, every other field kept), three short
sequences (`LENGTHS`; one image in the first and the last for a vision-language model) run each alone through it
stock, then packed in one row (`tfcompat.pack`, the path users take) through the same copy patched, CPU float32,
compared per token (a near miss again in float64: `tfcompat.hf.rounding`). Disagreement, or a patched forward that
raises (a `PatchedModelError` for a keyword the packed attention does not implement), is a `PatchError` at
``patch()``, not a wrong answer or an error in training.

Where the shrunk copy cannot be built or run stock (a config class that rejects the tiny sizes), the proof runs on
the type's tiny default config instead (`tfcompat.tiny_models.tiny_config`, the doctor's), and where that cannot
either, the patch goes ahead unproven and its handle says why (`PatchHandle.proof`): a model tfcompat cannot shrink
is no evidence of a wrong patch, and `tfcompat doctor` reports such types as not buildable.

``model`` is only read; the copy's patch is undone before `prove` returns, the global RNG is left as it was. Results
are cached in-process per (type, release, class, shrunk config): a second patch of the same config costs one shrink.
``patch(model, prove=False)`` or ``TFCOMPAT_PROVE=0`` skips the proof.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Literal, NamedTuple

import torch

from ..errors import PatchedModelError, PatchError, TfcompatError
from ..inputs.derived_vision import owner_of
from ..inputs.pack import pack
from ..inputs.token_types import required, with_prefix_suffix
from ..registry import Resolved
from ..tiny_models import (
    TinyModelError,
    encoder_decoder_examples,
    sample_examples,
    shrunk_config,
    tiny_config,
    tiny_copy,
)
from .rope_lengths import ALONE, answered_lengths, rules_of
from .rounding import is_rounding, to_float64

__all__ = ["ENV", "LENGTHS", "REFUSAL", "TOLERANCE", "Proof", "is_wanted", "prove"]

ENV = "TFCOMPAT_PROVE"
LENGTHS = (7, 12, 5)  # the 12-token sequence is longer than the tiny windows and chunks (8): they cut in
TOLERANCE = 1e-5  # per token, max |patched - stock| over the token's largest stock value (fp32)
REFUSAL = "fails its patch-time proof"  # how the `PatchError` of a failed proof ends its first line

Apply = Callable[[torch.nn.Module], AbstractContextManager[Any]]


class Proof(NamedTuple):
    """What `prove` found. status "proven" (packed equals stock per sequence on ``config``: "own", the shrunk copy
    of the model's config, or "default", the type's tiny default config) or "unproven" (no tiny copy builds:
    reason). max_rel_diff: the largest per-token relative difference; seconds: the proof's cost (0 from the cache)."""

    status: Literal["proven", "unproven"]
    config: Literal["own", "default", ""]
    max_rel_diff: float | None
    seconds: float
    reason: str = ""

    def __str__(self) -> str:
        if self.status == "unproven":
            return f"unproven at patch time: {self.reason}"
        on = "a shrunk copy of this config" if self.config == "own" else "the type's tiny default config"
        return (f"proven at patch time on {on} (packed vs stock per sequence, max relative diff "
                f"{self.max_rel_diff:.1e}, {self.seconds:.2f} s)" + (f"; {self.reason}" if self.reason else ""))


_CACHE: dict[tuple[Any, ...], Proof | PatchError] = {}


class _Unbuildable(Exception):
    """The tiny copy does not run stock (internal: the next config is tried)."""


def is_wanted(asked: bool | None) -> bool:
    """Whether ``patch(prove=asked)`` proves: ``asked`` where given, else unless ``TFCOMPAT_PROVE=0``."""
    return asked if asked is not None else os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def prove(model: torch.nn.Module, resolved: Resolved, apply: Apply) -> Proof:
    """Prove ``resolved``'s patch on a tiny copy of ``model`` (see the module docstring); ``apply(tiny)`` patches a
    copy (without a proof of its own) and its context manager undoes that patch. Raises `PatchError` where the
    patched copy differs from stock, raises, or is refused."""
    config: Any = model.config  # a transformers PreTrainedConfig
    try:
        own, why_not = shrunk_config(config), ""
    except TinyModelError as exc:
        own, why_not = None, _first_line(exc)
    fingerprint = "" if own is None else hashlib.sha256(own.to_json_string().encode()).hexdigest()
    options = tuple(sorted(getattr(apply, "keywords", {}).items()))  # the patch's options the copy takes too
    key = (config.model_type, resolved.transformers_version, f"{type(model).__module__}.{type(model).__qualname__}",
           fingerprint, _implementation(model), options)
    if key in _CACHE:
        found = _CACHE[key]
        if isinstance(found, PatchError):
            raise found
        return found._replace(seconds=0.0)
    found = _CACHE[key] = _outcome(model, resolved, apply, own, why_not)
    if isinstance(found, PatchError):
        raise found
    return found


def _implementation(model: torch.nn.Module) -> str:
    """The stock attention the copy runs: the model's own where a CPU copy can run it (eager, sdpa: where they
    differ, an upstream bug, the user's is the oracle), else sdpa where the class has it, else eager."""
    own = getattr(model.config, "_attn_implementation", None)
    if own in ("eager", "sdpa"):
        return own
    return "sdpa" if getattr(type(model), "_supports_sdpa", False) else "eager"


def _outcome(model: torch.nn.Module, resolved: Resolved, apply: Apply, own: Any, why_not: str
             ) -> Proof | PatchError:
    """The proof on the shrunk copy ``own`` (None: it does not shrink, ``why_not``), else on the type's tiny default
    config; its refusal as an error rather than raised (to be cached)."""
    start = time.perf_counter()
    config: Any = model.config
    vision = resolved.spec.is_vision or resolved.entry.derived_vision is not None
    v = resolved.entry.derived_vision
    # a model cross-attending to its images' states (Mllama) fills no placeholders: the zoo lays its images out too
    images = vision and (_has_image_features(model) or (v is not None and v.cross_states is not None))
    impl = _implementation(model)
    reasons = [] if own is not None else [f"its own config does not shrink ({why_not})"]
    with _isolated():
        for name in ("own", "default"):
            try:
                tiny_cfg = own if name == "own" else tiny_config(config.model_type,
                                                                 "image_text_to_text" if images else "causal_lm")
                if tiny_cfg is None:
                    continue
                tiny = tiny_copy(model, tiny_cfg, attn_implementation=impl)
                runs = [_stock(tiny, examples) for examples in _variants(tiny, resolved, images)]
            except (TinyModelError, _Unbuildable) as exc:
                why = str(exc) if isinstance(exc, _Unbuildable) else _first_line(exc)
                reasons.append(f"the copy of its {'own' if name == 'own' else 'default'} config does not run stock "
                               f"({why})")
                continue
            try:
                handle = apply(tiny)
            except PatchError as exc:
                return _wrong(resolved, name, f"the patch of the tiny copy is refused: {_first_line(exc)}")
            diff = _packed_diff(tiny, runs, handle)
            if isinstance(diff, str) and ALONE in diff:  # sequences that a rope of the call's length rotates
                # otherwise alone (whose lengths images set): one sequence, repeated
                runs = [_stock(tiny, examples) for examples in _variants(tiny, resolved, images, alike=True)]
                diff = _packed_diff(tiny, runs, apply(tiny))
            if isinstance(diff, str):
                return _wrong(resolved, name, diff)
            if not diff <= TOLERANCE:  # NaN too
                diff64 = _float64_diff(tiny, runs, apply)
                if diff64 is None or not is_rounding(diff, diff64, TOLERANCE):
                    again = "" if diff64 is None else f"; {diff64:.1e} in float64: not rounding"
                    return _wrong(resolved, name, f"packed differs from stock per sequence by {diff:.1e} (relative, "
                                  f"per token; tolerance {TOLERANCE:.0e}){again}")
                reasons.append(f"float32's {diff:.1e} is rounding: {diff64:.1e} in float64")
            return Proof("proven", name, diff, time.perf_counter() - start, "; ".join(reasons))
    return Proof("unproven", "", None, time.perf_counter() - start, "; ".join(reasons))


def _packed_diff(tiny: torch.nn.Module, runs: list[tuple[list[dict[str, Any]], torch.Tensor]],
                 handle: AbstractContextManager[Any]) -> float | str:
    """The largest per-token relative difference of the patched copy's packed rows from ``runs``' stock outputs,
    under ``handle`` (undone on return); what is wrong where a row cannot be compared."""
    diff = 0.0
    with handle:
        for examples, expected in runs:
            try:
                got = _values(tiny(**_packed(tiny, examples), use_cache=False))
            except Exception as exc:  # noqa: BLE001 -- the packed path failing on the copy is the finding
                return f"the patched forward raised {_first_line(exc)}"
            if got.shape != expected.shape:
                return f"packed output {tuple(got.shape)} vs stock per sequence {tuple(expected.shape)}"
            scale = expected.abs().amax(-1).clamp_min(1e-6)  # (T,) or (N,)
            diff = max(diff, float(((got - expected).abs().amax(-1) / scale).max()))
    return diff


def _float64_diff(tiny: torch.nn.Module, runs: list[tuple[list[dict[str, Any]], torch.Tensor]], apply: Apply
                  ) -> float | None:
    """`_packed_diff` of the copy and ``runs``' inputs cast to float64 (`tfcompat.hf.rounding`); None where the copy
    does not run in float64."""
    try:
        again = [_stock(tiny, to_float64(tiny, examples)) for examples, _ in runs]
        diff = _packed_diff(tiny, again, apply(tiny))
    except Exception:  # noqa: BLE001 -- a kernel without float64: no evidence either way
        return None
    return diff if isinstance(diff, float) else None


@contextlib.contextmanager
def _isolated() -> Iterator[None]:
    """No gradients, no warnings, one thread (tiny matmuls run many times faster), the global RNG restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the copy's construction warnings are not the user's
            yield
    finally:
        torch.set_num_threads(threads)


def _variants(tiny: torch.nn.Module, resolved: Resolved, images: bool, alike: bool = False
              ) -> list[list[dict[str, torch.Tensor]]]:
    """The sequences a proof packs: an encoder-decoder model's (`tfcompat.tiny_models.encoder_decoder_examples`:
    decoder ids, each with its image), else `sample_examples` of `LENGTHS` (past the switch of a rope that follows
    the call's length: `tfcompat.hf.rope_lengths.answered_lengths`): as they are, and where the owner builds its mask
    from token types, with token types as a prefix-suffix processor returns them (0 over the first half, 1 over the
    rest; for any owner a layout to mask as stock does) in every example; the first only where the owner masks a row
    without token types causally (`tfcompat.inputs.token_types`: else packed rows without them are refused).
    alike: the first sequence of each, repeated."""
    try:
        if resolved.entry.encoder_decoder is not None:
            return [encoder_decoder_examples(tiny, LENGTHS)]
        configs = [m.config for m in tiny.modules() if isinstance(m, resolved.text_model_cls)] or [tiny.config]
        # a length-dependent rope's switch among the lengths would refuse the packed row: lengths it answers
        examples = sample_examples(tiny, answered_lengths(rules_of(configs, resolved), LENGTHS),
                                   images=images)
        examples = [examples[0]] * len(examples) if alike else examples
    except TinyModelError as exc:
        raise _Unbuildable(_first_line(exc)) from None
    v = resolved.entry.derived_vision
    if v is None or not v.mask_inputs:
        return [examples]
    typed = with_prefix_suffix(examples, v.mask_inputs)
    return [typed] if required(resolved, *owner_of(resolved, tiny)) else [examples, typed]


def _stock(tiny: torch.nn.Module, examples: list[dict[str, torch.Tensor]]
           ) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """The sequences' inputs and their stock outputs ``(T, V)`` (a sequence classifier's ``(N, C)``), each alone at
    the positions the model gives it by default (what the packed row's restarting position ids must give)."""
    try:
        return examples, torch.cat([_values(tiny(**ex, use_cache=False)) for ex in examples])
    except Exception as exc:  # noqa: BLE001 -- any reason a foreign tiny model does not run stock
        raise _Unbuildable(_first_line(exc)) from None


def _packed(tiny: torch.nn.Module, examples: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The packed row's inputs: `tfcompat.pack`'s; where pack itself refuses a text-only copy (a text model whose
    config type pack does not map, Mllama's), the raw packed call users make: ids ``(1, T)``, position ids restarting
    at 0 per sequence ``(1, T)``."""
    try:
        return pack(tiny, examples).model_inputs
    except TfcompatError as exc:
        if isinstance(exc, PatchedModelError) or any(set(ex) != {"input_ids"} for ex in examples):
            raise
    ids = [ex["input_ids"] for ex in examples]  # (1, L_i) each
    positions = torch.cat([torch.arange(x.shape[-1], device=x.device) for x in ids])[None]  # (1, T)
    return {"input_ids": torch.cat(ids, -1), "position_ids": positions}


def _values(out: Any) -> torch.Tensor:
    """``(L, V)`` of a one-row output: its logits, or its last hidden states (a model without a head); ``(N, C)``
    of a sequence classifier's (one score per sequence: a packed row's N rows, one alone's one)."""
    values = getattr(out, "logits", None)
    values = out.last_hidden_state if values is None else values
    values = values if values.ndim == 2 else values[0]
    return values if values.dtype == torch.float64 else values.float()


def _has_image_features(model: torch.nn.Module) -> bool:
    """Whether the model or its base model embeds images or videos (InstructBLIP-Video's ``get_video_features``)."""
    return any(hasattr(m, name) for m in (model, getattr(model, "model", None)) if m is not None
               for name in ("get_image_features", "get_video_features"))


def _wrong(resolved: Resolved, config: str, detail: str) -> PatchError:
    on = "a tiny copy of this model's config (sizes shrunk, the rest kept)" if config == "own" else \
        "a tiny model of the type's default config (this config's copy does not build)"
    return resolved.error(
        PatchError, f"the packed patch of {resolved.family} {REFUSAL}",
        why=f"on {on}: {detail}",
        supported="derived types whose packed forward equals stock per sequence (tfcompat doctor lists them)",
        fix="run the model unpatched (or padded), or on a transformers release where `tfcompat doctor --types "
        f"{resolved.family}` passes; patch(model, prove=False) or {ENV}=0 skips the proof at the risk of wrong "
        "results; please report the config")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
