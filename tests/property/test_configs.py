"""Configs as users have them (issue 26, item 3): per derived causal-LM type, the config fields that change what
attention and rotary compute are drawn on top of `tfcompat.tiny_models.tiny_config` (windows on, off and shorter than
the sequences, layer-type patterns, rope scaling types with their original lengths below and above the sequences,
expert counts and top-k, q/k norms, softcaps, MLA ranks), and the patched packed row must equal stock per sequence.

Rule: `tfcompat.patch` refuses (a typed error at ``patch()``; or, at the forward, a packed batch whose sequences a
length-dependent rope rotates otherwise alone, `tfcompat.hf.rope_lengths`) or the packed logits equal stock per
sequence per token (fp32, relative `TOLERANCE`, as `tests.every_type`); patched and wrong fails, naming the type, the
drawn fields and the difference. A drawn config that transformers itself rejects, or whose stock model does not run,
is not an example (rejected). Each sequence runs alone on its own copy of the model: dynamic rope caches the longest
length it has seen, so a model that ran other sequences first is not the oracle.

Slow (a few seconds a type): ``sweep``; CI runs the ``ci_sweep`` references on its newest release (noxfile.py).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, reject, settings
from hypothesis import strategies as st

import tfcompat
from tests.every_type import REFUSALS, TOLERANCE, compare, packed_inputs, sample_sequences
from tfcompat.errors import InvalidInputError
from tfcompat.registry.versions import installed_transformers
from tfcompat.tiny_models import attention_implementations, model_types, tiny_config, tiny_model

pytestmark = [pytest.mark.broad, pytest.mark.sweep, pytest.mark.usefixtures("one_thread")]

SETTINGS = settings(max_examples=8, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])

# a broad set: dense, windowed, layer-type patterns, softcaps, sinks, experts, MLA, q/k norms, partial rotary, and
# layers run per sequence
TYPES = [
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "cohere", "cohere2", "gpt_oss", "mixtral",
    "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "olmo2", "olmo3", "phimoe", "starcoder2", "granite",
    "granitemoe", "exaone4", "ministral", "glm4", "smollm3", "dots1",
    # decoder layers run per sequence (`tfcompat.hf.mixers`) on the rope their text model computes for the row
    "falcon", "deepseek_v32", "glm_moe_dsa", "axk2",
]  # not gemma4_text: every drawn config fails its own config round trip (per-layer head_dim), so no example runs;
# tests/test_derived.py and tests/test_mask_rules.py check Gemma 4 packed against stock in float32 and float64
CI_REFERENCES = {"llama", "mistral"}
LENGTHS = st.lists(st.integers(3, 18), min_size=2, max_size=3)
ATTENTION_KINDS = ("sliding_attention", "full_attention")


def _rotary_dim(base: dict[str, Any]) -> int:
    """The rotated dims of a head, from the tiny config's ``to_dict()`` (5.25 refuses attribute reads of per-layer
    fields such as gemma4's ``head_dim``)."""
    head = base.get("qk_rope_head_dim") or base.get("head_dim") or base["hidden_size"] // base["num_attention_heads"]
    return int(head * (base.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# the rope types a config class takes (phi3's validator: default and longrope only)
ROPE_TYPES_OF = {"phi3": ("default", "longrope"), "phimoe": ("default", "longrope")}


@st.composite
def rope(draw: st.DrawFn, base: dict[str, Any], dim: int, kinds: tuple[str, ...]) -> dict[str, Any]:
    """One rope scaling of ``kinds`` over the flat ``base`` (its theta and partial factor kept); original lengths 8
    (below the longer sequences) or 4096 (above every one)."""
    kind = draw(st.sampled_from(kinds))
    keep = {k: v for k, v in base.items() if k in ("rope_theta", "partial_rotary_factor")}
    original = draw(st.sampled_from([8, 4096]))
    if kind == "default":
        return {**keep, "rope_type": "default"}
    if kind in ("linear", "dynamic"):
        return {**keep, "rope_type": kind, "factor": draw(st.sampled_from([2.0, 4.0]))}
    if kind == "yarn":
        return {**keep, "rope_type": "yarn", "factor": draw(st.sampled_from([2.0, 8.0])),
                "original_max_position_embeddings": original}
    if kind == "llama3":
        return {**keep, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": original}
    factors = st.lists(st.floats(1.0, 4.0), min_size=dim // 2, max_size=dim // 2)
    return {**keep, "rope_type": "longrope", "short_factor": draw(factors), "long_factor": draw(factors),
            "original_max_position_embeddings": original}


@st.composite
def overrides(draw: st.DrawFn, base: dict[str, Any], dim: int) -> dict[str, Any]:
    """Fields of the tiny config ``base`` (its ``to_dict()``) redrawn, only those it has."""
    out: dict[str, Any] = {}
    kinds = ROPE_TYPES_OF.get(base["model_type"], ROPE_TYPES)
    layers = base["num_hidden_layers"]
    window = None
    if "sliding_window" in base:
        window = out["sliding_window"] = draw(st.sampled_from([None, 3, 5, 8, 64]))
    if "use_sliding_window" in base:
        out["use_sliding_window"] = draw(st.booleans()) and window is not None
        if "max_window_layers" in base:
            out["max_window_layers"] = draw(st.integers(0, layers))
    if isinstance(base.get("layer_types"), list) and set(base["layer_types"]) <= set(ATTENTION_KINDS):
        kinds = ATTENTION_KINDS if window is not None else ("full_attention",)
        out["layer_types"] = draw(st.lists(st.sampled_from(kinds), min_size=layers, max_size=layers))
        if "use_sliding_window" in base:  # the config derives the pattern from the flags: let it
            out["layer_types"] = None
    parameters = base.get("rope_parameters")
    if isinstance(parameters, dict) and "rope_type" in parameters:
        out["rope_parameters"] = draw(rope(parameters, dim, kinds))
    elif isinstance(parameters, dict) and isinstance(parameters.get("full_attention"), dict):
        out["rope_parameters"] = {**parameters, "full_attention": draw(rope(parameters["full_attention"], dim, kinds))}
    if out.get("rope_parameters", {}).get("rope_type") == "dynamic":  # dynamic scales past max_position_embeddings
        out["max_position_embeddings"] = draw(st.sampled_from([8, 4096]))
    experts = next((k for k in ("num_local_experts", "num_experts", "n_routed_experts") if base.get(k)), None)
    if experts is not None:
        # group-limited routing (DeepSeek-V3) scores each group by its top 2 and picks among topk_group groups
        n = out[experts] = draw(st.sampled_from([4, 8] if base.get("n_group") else [2, 4, 8]))
        reach = n // base["n_group"] * base["topk_group"] if base.get("n_group") and base.get("topk_group") else n
        out["num_experts_per_tok"] = draw(st.integers(1, min(reach, 4)))
    for flag in ("norm_topk_prob", "use_qk_norm", "attention_bias"):
        if isinstance(base.get(flag), bool):
            out[flag] = draw(st.booleans())
    for cap, values in (("attn_logit_softcapping", [None, 5.0, 50.0]), ("final_logit_softcapping", [None, 3.0])):
        if cap in base:
            out[cap] = draw(st.sampled_from(values))
    if base.get("kv_lora_rank"):
        out["kv_lora_rank"] = draw(st.sampled_from([16, 32]))
        out["q_lora_rank"] = draw(st.sampled_from([None, 16, 32]))
        out["qk_nope_head_dim"] = draw(st.sampled_from([8, 16]))
        out["v_head_dim"] = draw(st.sampled_from([8, 16, 32]))
    return out


def _build(model_type: str, fields: dict[str, Any]) -> torch.nn.Module:
    tiny = tiny_config(model_type)
    config = type(tiny).from_dict({**tiny.to_dict(), **fields})
    impl = attention_implementations(model_type)[-1]
    return tiny_model(model_type, attn_implementation=impl, config=config)


def _case(model_type: str) -> tuple[dict[str, Any], int]:
    base = tiny_config(model_type).to_dict()
    return base, _rotary_dim(base)


def _params(types: list[str]) -> list[Any]:
    shipped = set(model_types("causal_lm"))
    out = []
    for t in types:
        marks = [pytest.mark.ci_sweep] if t in CI_REFERENCES else []
        if t not in shipped:
            marks.append(pytest.mark.skip(reason=f"transformers {installed_transformers()} "
                                          f"ships no {t} causal LM"))
        out.append(pytest.param(t, marks=marks, id=t))
    return out


@pytest.mark.parametrize("model_type", _params(TYPES))
def test_patched_packed_equals_stock_per_sequence_or_is_refused(model_type: str) -> None:
    base, dim = _case(model_type)

    @SETTINGS
    @given(fields=overrides(base, dim), lengths=LENGTHS, seed=st.integers(0, 3))
    def check(fields: dict[str, Any], lengths: list[int], seed: int) -> None:
        try:
            model = _build(model_type, fields)
            seqs = sample_sequences(model.config, lengths=lengths, seed=seed)
            with torch.no_grad():  # each alone, on a fresh copy (dynamic rope caches what it saw)
                expected = [copy.deepcopy(model)(input_ids=s[None], use_cache=False).logits[0] for s in seqs]
        except Exception as exc:  # noqa: BLE001 -- transformers rejects the drawn config or its stock model cannot run it
            event(f"not an example: {type(exc).__name__}")
            reject()
        try:
            handle = tfcompat.patch(model)
        except REFUSALS as exc:
            event(f"refused at patch(): {type(exc).__name__}")
            return
        with handle, torch.no_grad():
            try:
                got = model(**packed_inputs(seqs), use_cache=False).logits[0]
            except InvalidInputError as exc:  # a length-dependent rope over sequences it rotates otherwise alone
                assert "rope frequencies alone" in str(exc), str(exc)
                event("refused: a length-dependent rope")
                return
        diff = compare(got, expected)
        event("compared")
        assert diff <= TOLERANCE, f"{model_type} with {fields}, lengths {lengths}: packed vs per sequence {diff:.2e}"

    check()
