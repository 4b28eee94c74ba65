"""Derived families (`tfcompat.registry.derive`): the named causal LMs without a written table, on the installed
release.

Rule: per token, the patched packed forward (and backward) of a tiny random model equals the stock model run on
each sequence alone, with the eager and the sdpa references; control: the stock model on the packed row does not.
Windows and chunks are shorter than the sequences, so sliding and chunked layers matter. What tfcompat cannot prove
it handles is refused at ``patch()`` / ``resolve()`` naming the feature.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

import tfcompat
from tfcompat.errors import PatchError, UnknownFamilyError
from tfcompat.registry import derive_vision, families
from tfcompat.registry.derive import causal_lm_types, module_name
from tfcompat.registry.upstream import bug_in

LENGTHS = (7, 13, 9)  # three sequences of odd lengths; windows (5) and chunks (6) are shorter
WINDOW = 5
MOE = dict(num_experts_per_tok=2)
# model_type -> the text config keys of a tiny model (sizes shrunk as transformers' own model testers do)
TINY: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, **MOE),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, **MOE),
    "mixtral": dict(num_local_experts=4, sliding_window=WINDOW, **MOE),
    "mistral": dict(sliding_window=WINDOW),
    "gpt_oss": dict(num_local_experts=4, sliding_window=WINDOW, num_hidden_layers=2, **MOE),
    "glm4_moe": dict(n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1,
                     first_k_dense_replace=1, **MOE),
    "deepseek_v3": dict(n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1,
                        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, head_dim=8, v_head_dim=16, num_key_value_heads=4, **MOE),
    "gemma2": dict(sliding_window=WINDOW, query_pre_attn_scalar=16),
    "gemma3_text": dict(sliding_window=WINDOW, num_hidden_layers=3, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # layer 3 has no rope and tunes its queries' temperature: with floor_scale 4 the tuning changes within the lengths
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128, num_hidden_layers=4,
                        attention_chunk_size=6, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5),
    "olmo2": {},
    "phi3": dict(sliding_window=WINDOW),
    "ernie4_5": {},
    "seed_oss": dict(attention_dropout=0.0),
    "apertus": {},
    "minimax_m2": dict(num_local_experts=4, **MOE),
}
INSTALLED = [t for t in TINY if t in causal_lm_types()]
# model_type -> why its decoder layers run per sequence on 4.x releases (not the packed core: the tests below are the
# packed core's; tests/test_every_causal_lm.py checks them): qwen2_moe picks one of its own attention classes per
# implementation there (QWEN2MOE_ATTENTION_CLASSES), none dispatching through AttentionInterface
REFUSED_ON_4 = {"qwen2_moe": "holds no attention that dispatches through AttentionInterface"}
# model_type -> what the refusal at resolve() names, on every release where the type exists: token mixers other than
# softmax attention that keep state on the module, attention that does not dispatch through transformers'
# AttentionInterface in decoder layers that cannot run per sequence either (tests/test_per_sequence_attention.py),
# positions counted over the row by a model that takes no position ids
NOT_DERIVABLE = {
    "recurrent_gemma": r"RecurrentGemmaRecurrentBlock cannot run per sequence",  # state on the module
    "xlnet": r"(?s)XLNetLayer holds no attention that dispatches through AttentionInterface.*'output_g'",
    "cpmant": r"CpmAntModel.forward builds CpmAntSegmentPositionEmbedding, which may count positions over the row",
}
MAJOR = int(str(tfcompat.registry.versions.installed_transformers()).split(".")[0])
INSTALLED_VERSION = str(tfcompat.registry.versions.installed_transformers())
# model_type -> the declared upstream bug (tfcompat/registry/upstream.py) refusing it on the installed release
UPSTREAM = {t: b for t in INSTALLED if (b := bug_in(module_name(t), INSTALLED_VERSION, t)) is not None}
RESOLVE_REFUSED = {**(REFUSED_ON_4 if MAJOR == 4 else {}), **{t: b.name for t, b in UPSTREAM.items()}}
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0)


def tiny(model_type: str, impl: str = "eager", seed: int = 0, **extra: Any) -> torch.nn.Module:
    """A tiny random causal LM of ``model_type`` built from config (no download), eval mode, fp32."""
    names = importlib.import_module("transformers.models.auto.configuration_auto").CONFIG_MAPPING_NAMES
    config_cls = getattr(importlib.import_module("transformers"), names[model_type])
    try:  # 5.4's OLMo2 / ERNIE 4.5 configs: bool fields typed int, a declared upstream bug (tests/test_upstream.py)
        config_cls()
    except Exception as exc:
        bug = f" (upstream bug {UPSTREAM[model_type].name})" if model_type in UPSTREAM else ""
        pytest.skip(f"transformers {INSTALLED_VERSION}'s {config_cls.__name__} does not build from its own defaults"
                    f"{bug}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    config = config_cls(**{**BASE, **TINY[model_type], **extra})
    torch.manual_seed(seed)
    lm = getattr(importlib.import_module("transformers"),
                 importlib.import_module("transformers.models.auto.modeling_auto")
                 .MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    # .float(): some modules keep parameters in bf16 whatever the config says (apertus' XIELU on 4.57)
    return lm._from_config(config, attn_implementation=impl).float().eval()


def references(model_type: str) -> tuple[str, ...]:
    """The stock implementations to compare against: eager, and sdpa where the model supports it (gpt-oss and gemma2
    refuse sdpa: sinks and softcapping)."""
    lm = tfcompat.resolve(model_type).classes["for_causal_lm"]
    return ("eager", "sdpa") if getattr(lm, "_supports_sdpa", False) else ("eager",)


def sequences(seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, BASE["vocab_size"], (1, n), generator=gen) for n in LENGTHS]


def packed(seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One row: ids ``(1, T)``, position ids ``(1, T)`` restarting at 0 per sequence."""
    return {"input_ids": torch.cat(seqs, 1), "position_ids": torch.cat([torch.arange(s.shape[1]) for s in seqs])[None]}


def rel_diff(got: torch.Tensor, expected: list[torch.Tensor]) -> float:
    """Max over tokens of the max abs difference at the token over the largest expected value of the row."""
    want = torch.cat(expected)
    return float((got - want).abs().max() / want.abs().max())


def test_written_tables_win():
    for key in families():
        assert key not in tfcompat.registry.derivable_types()
        assert tfcompat.resolve(key).entry.derived is None if key in causal_lm_types() else True


@pytest.mark.parametrize("model_type", [t for t in INSTALLED if t not in RESOLVE_REFUSED])
def test_resolve_and_explain_say_derived(model_type):
    r = tfcompat.resolve(model_type)
    assert r.entry.derived is not None and r.entry.rotary is None
    text = r.explain()
    assert "DERIVED" in text and r.entry.module in text and r.entry.derived.attention.describe() in text
    with pytest.raises(PatchError, match="no rotary convention"):
        r.apply_rotary  # noqa: B018


@pytest.mark.parametrize("model_type", [t for t in NOT_DERIVABLE if t in causal_lm_types()])
def test_not_derivable_is_refused_naming_why(model_type):
    assert model_type in tfcompat.registry.derivable_types()
    with pytest.raises(PatchError, match=NOT_DERIVABLE[model_type]) as info:
        tfcompat.resolve(model_type)
    assert info.value.family == model_type and info.value.fix


def test_unknown_type_is_unknown():
    with pytest.raises(UnknownFamilyError, match="unknown model family"):
        tfcompat.resolve("not_a_model_type")


@pytest.mark.parametrize("model_type", [t for t in INSTALLED if t in RESOLVE_REFUSED and t not in UPSTREAM])
def test_layers_run_per_sequence(model_type):
    derived = tfcompat.resolve(model_type).entry.derived
    assert derived is not None and REFUSED_ON_4[model_type] in derived.per_sequence_why
    with tfcompat.patch(tiny(model_type)) as handle:
        assert not any(r.attr == "_tfcompat_features" for r in handle.records)


@pytest.mark.parametrize("model_type", [t for t in INSTALLED if t not in RESOLVE_REFUSED])
class TestPackedEqualsStock:
    """Rule: per token, packed patched == stock per sequence (eager and sdpa), forward and backward."""

    def test_forward_and_control(self, model_type):
        seqs = sequences()
        inputs = packed(seqs)
        for impl in references(model_type):
            model = tiny(model_type, impl)
            with torch.no_grad():
                expected = [model(input_ids=s).logits[0] for s in seqs]
                control = model(**inputs).logits[0]  # stock on the packed row: attends across sequences
                with tfcompat.patch(model) as handle:
                    got = model(**inputs).logits[0]
            assert any(r.attr == "_tfcompat_features" for r in handle.records)
            assert rel_diff(got, expected) <= 1e-5, impl
            assert rel_diff(control, expected) > 1e-3, impl

    def test_backward(self, model_type):
        model = tiny(model_type, "eager")
        seqs = sequences(seed=2)
        weight = torch.randn(BASE["vocab_size"], generator=torch.Generator().manual_seed(3))
        for s in seqs:
            (model(input_ids=s).logits[0] @ weight).sum().backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        with tfcompat.patch(model):
            (model(**packed(seqs)).logits[0] @ weight).sum().backward()
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert got.keys() == expected.keys()
        for name in got:
            scale = max(1.0, float(expected[name].abs().max()))
            diff = float((got[name] - expected[name]).abs().max())
            assert diff <= 1e-5 * scale, f"{name}: max abs diff {diff:.3e} (grad scale {scale:.2e})"


@pytest.mark.skipif("llama4_text" not in INSTALLED, reason="transformers has no llama4_text before 4.51")
def test_temperature_tuning_matters_and_is_refused_under_ulysses():
    """Control for llama4_text above: its NoPE layer's temperature tuning changes the logits within the lengths (the
    packed rescale from row index to sequence position is not vacuous); under Ulysses it is refused at patch()."""
    import torch.distributed as dist

    if "llama4_text" in UPSTREAM:
        pytest.skip(f"llama4_text is refused on {INSTALLED_VERSION} for {UPSTREAM['llama4_text'].name}")
    seq = sequences()[1]
    tuned, untuned = tiny("llama4_text"), tiny("llama4_text", attn_temperature_tuning=False)
    with torch.no_grad():
        assert rel_diff(tuned(input_ids=seq).logits[0], [untuned(input_ids=seq).logits[0]]) > 1e-4
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(PatchError, match="NoPE temperature tuning"):
            tfcompat.patch(tuned, ulysses_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    assert not tfcompat.is_patched(tuned)


def twins(head: str) -> list[str]:
    """The named types whose ``*For{head}`` twin transformers maps on this release."""
    names = getattr(importlib.import_module("transformers.models.auto.modeling_auto"),
                    f"MODEL_FOR_{head}_MAPPING_NAMES")
    return [t for t in ("qwen3_moe", "mistral", "gemma2", "gpt_oss", "llama4_text", "minimax_m2") if t in INSTALLED
            and t in names]


def twin(model_type: str, head: str) -> torch.nn.Module:
    """The ``*For{head}`` twin of a tiny ``model_type`` (same config), num_labels 2, fp32, eval."""
    config = tiny(model_type).config
    config.num_labels = 2
    auto = getattr(importlib.import_module("transformers"), f"AutoModelFor{head}")
    torch.manual_seed(0)
    return auto.from_config(config, attn_implementation="eager").float().eval()


@pytest.mark.parametrize("model_type", twins("TOKEN_CLASSIFICATION"))
@torch.no_grad()
def test_token_classification_twin(model_type):
    """Critics (a value per token): the same text model, derived alike."""
    critic = twin(model_type, "TokenClassification")
    seqs = sequences()
    expected = [critic(input_ids=s).logits[0] for s in seqs]
    inputs = packed(seqs)
    control = critic(**inputs).logits[0]
    with tfcompat.patch(critic):
        got = critic(**inputs).logits[0]
    assert rel_diff(got, expected) <= 1e-5
    assert rel_diff(control, expected) > 1e-3


@pytest.mark.parametrize("model_type", twins("SEQUENCE_CLASSIFICATION"))
@torch.no_grad()
def test_sequence_classification_twin_pools_per_sequence(model_type):
    """Reward models: a packed row gives one score per sequence (N, C), each what the stock model gives that sequence
    alone (its last non-pad token: the second sequence ends in pad tokens); control: the stock row pools one score
    (the first two sequences' scores are nowhere in it)."""
    reward = twin(model_type, "SequenceClassification")
    pad = reward.config.pad_token_id
    seqs = sequences()
    seqs[1][0, -3:] = pad
    expected = torch.cat([reward(input_ids=s).logits for s in seqs])  # (N, C)
    inputs = packed(seqs)
    control = reward(**inputs).logits  # (1, C): the last sequence's score, seen through the whole row
    with tfcompat.patch(reward):
        got = reward(**inputs).logits
        with pytest.raises(tfcompat.InvalidInputError, match="labels"):
            reward(**inputs, labels=torch.tensor([1]))
    assert got.shape == expected.shape == (len(seqs), 2)
    assert float((got - expected).abs().max() / expected.abs().max()) <= 1e-5
    assert control.shape == (1, 2)
    assert reward(**inputs).logits.shape == (1, 2)  # undone: the stock pooling again
    assert "forward" not in vars(reward) and "forward" not in vars(reward.score)


@pytest.mark.parametrize("model_type", [t for t in ("qwen3_moe", "mixtral") if t in INSTALLED])
@torch.no_grad()
def test_moe_routing_is_per_token_and_aux_loss_is_the_padded_batch_one(model_type):
    """Rule: packed routing equals per-sequence routing per token (router logits, every layer). The router auxiliary
    loss of a packed row is the stock one of the same sequences as a right-padded batch with its attention mask (a
    mean over every real token of the batch); control: the mean of the per-sequence losses differs (the loss is a
    product of means)."""
    model = tiny(model_type, "eager", output_router_logits=True)
    lm = importlib.import_module(type(model).__module__)
    seqs = sequences()
    alone = [model(input_ids=s) for s in seqs]
    width = max(LENGTHS)
    batch = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : s.shape[1]], mask[i, : s.shape[1]] = s[0], 1
    padded = model(input_ids=batch, attention_mask=mask)
    with tfcompat.patch(model):
        got = model(**packed(seqs))
    for layer, logits in enumerate(got.router_logits):  # (T, E) per layer
        want = torch.cat([out.router_logits[layer] for out in alone])
        assert float((logits - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max())), layer
    assert abs(float(got.aux_loss) - float(padded.aux_loss)) <= 1e-5 * float(padded.aux_loss)
    per_sequence = sum(float(out.aux_loss) for out in alone) / len(alone)
    assert abs(per_sequence - float(got.aux_loss)) > 1e-4
    # the per-sequence loss from the packed forward: the module's load_balancing_loss_func on each sequence's slice
    pieces = [[layer[i] for layer in (logits.split(LENGTHS) for logits in got.router_logits)] for i in range(len(seqs))]
    from_packed = [float(lm.load_balancing_loss_func(tuple(p), model.num_experts, model.num_experts_per_tok))
                   for p in pieces]
    assert abs(sum(from_packed) / len(from_packed) - per_sequence) <= 1e-5 * per_sequence


class _AlibiAttention(torch.nn.Module):
    """An attention whose call passes what the packed core does not implement (read from this source)."""

    def __init__(self) -> None:
        super().__init__()
        self.sliding_window, self.layer_idx, self.head_dim, self.alibi = 3, 0, 8, None

    def forward(self, hidden_states, cache_position=None, **kwargs):  # pragma: no cover - only its source is read
        attention_interface = ALL_ATTENTION_FUNCTIONS["eager"]  # noqa: F821
        if self.training and cache_position is not None:
            hidden_states = hidden_states * cache_position.float()
        return attention_interface(self, hidden_states, hidden_states, hidden_states, None,
                                   sliding_window=self.sliding_window if not self.training else None,
                                   alibi=self.alibi, **kwargs)


def test_attention_call_read_from_the_source():
    from tfcompat.registry.derive import attention_call, guard_holds, passed_values

    call = attention_call(_AlibiAttention)
    assert call.keywords == (("sliding_window", "self.sliding_window if not self.training else None"),
                             ("alibi", "self.alibi")) and call.passes_kwargs and call.positional == 5
    assert call.row_positions == ("(self.training and cache_position is not None)",)
    module = _AlibiAttention()
    assert passed_values(call, module) == {"sliding_window": 3, "alibi": None}
    assert passed_values(call, module, training=True)["sliding_window"] is None
    assert guard_holds(call.row_positions[0], module) is False  # no cache in a packed forward, eval mode


def test_unknown_attention_keyword_is_refused_naming_it():
    from tfcompat.hf.features import module_features

    found = module_features(_AlibiAttention(), tiny("olmo2").config)
    assert "passes alibi=self.alibi" in found.refusal and found.features.window == 3


@pytest.mark.skipif(MAJOR < 5, reason="BERT-style and dbrx attention dispatch through AttentionInterface from 5.0")
def test_attention_found_below_the_decoder_layer():
    """dbrx's attention sits two classes below its decoder layer, BERT's two (Layer.attention.self); BERT's
    cross-attention class is recorded apart (refused where built, see below)."""
    from tfcompat.registry.derive import derive

    version = str(tfcompat.registry.versions.installed_transformers())
    dbrx, bert = derive("dbrx", version).entries[0], derive("bert", version).entries[0]
    assert (dbrx.classes["decoder_layer"], dbrx.classes["attention"]) == ("DbrxBlock", "DbrxAttention")
    assert dbrx.layer_forwards_kwargs  # DbrxBlock -> DbrxNormAttentionNorm -> DbrxAttention pass **kwargs
    assert (bert.classes["attention"], bert.classes["cross_attention"]) == ("BertSelfAttention", "BertCrossAttention")


@pytest.mark.skipif(MAJOR < 5, reason="BERT-style attention dispatches through AttentionInterface from 5.0")
@pytest.mark.parametrize(("change", "what"), [
    # an encoder (is_decoder=False), attending both ways, runs its layers per sequence instead:
    # tests/test_per_sequence_attention.py
    (dict(add_cross_attention=True), r"holds cross-attention \(BertCrossAttention\)"),
])
def test_bert_style_decoder_refused_where_not_causal_or_cross(change, what):
    from tfcompat.tiny_models import tiny_config

    config = tiny_config("bert")
    for key, value in change.items():
        setattr(config, key, value)
    model = importlib.import_module("transformers").BertLMHeadModel(config)
    with pytest.raises(PatchError, match=what):
        tfcompat.patch(model)
    assert not tfcompat.is_patched(model)


@pytest.mark.skipif(MAJOR < 5, reason="RoBERTa-style attention dispatches through AttentionInterface from 5.0")
def test_own_positions_per_sequence():
    """RoBERTa's learned positions default to padding_idx + 1 + the count of non-padding tokens: the packed row gets
    them per sequence (a padding token inside a sequence included), not the contract's 0, 1, ...; control: those
    differ. Under Ulysses it is refused."""
    import torch.distributed as dist

    from tests.every_type import build

    model = build("roberta", "eager")
    pad = model.config.pad_token_id
    seqs = [s[0] for s in sequences()]
    seqs[1][4] = pad  # positions skip it: the rest of the sequence counts one less
    with torch.no_grad():
        expected = [model(input_ids=s[None]).logits[0] for s in seqs]
        contract = [model(input_ids=s[None], position_ids=torch.arange(len(s))[None]).logits[0] for s in seqs]
        assert rel_diff(torch.cat(contract), expected) > 1e-3
        with tfcompat.patch(model):
            got = model(**packed([s[None] for s in seqs])).logits[0]
    assert rel_diff(got, expected) <= 1e-5
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(PatchError, match="computes its own positions, under sequence parallelism"):
            tfcompat.patch(model, ulysses_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(MAJOR < 5, reason="Bart's and Whisper's decoders dispatch through AttentionInterface from 5.0")
def test_decoders_with_cross_attention_and_row_positions():
    """Bart's decoder counts positions over the row (its positions module gets the packed row's instead, one row at
    a time); its encoder_attn, the self-attention's class, is left stock: packed rows refuse encoder states."""
    from tests.every_type import build
    from tfcompat.errors import InvalidInputError
    from tfcompat.registry.derive import cross_attrs, positions_from_row

    bart = importlib.import_module("transformers.models.bart.modeling_bart")
    derived = tfcompat.resolve("bart").entry.derived
    if derived is not None and derived.per_sequence:
        pytest.skip(f"Bart's decoder layers run per sequence on {INSTALLED_VERSION} (called without **kwargs: "
                    "tests/test_per_sequence_attention.py and the every-type sweep check them)")
    assert positions_from_row(bart.BartDecoder) == "embed_positions"
    assert cross_attrs(bart.BartDecoderLayer, bart.BartAttention) == ("encoder_attn",)
    model = build("bart", "eager")
    seqs = [s[0] for s in sequences()]
    inputs = packed([s[None] for s in seqs])
    with torch.no_grad():
        expected = [model(input_ids=s[None]).logits[0] for s in seqs]
        with tfcompat.patch(model) as handle:
            got = model(**inputs).logits[0]
            hook = next(r for r in handle.records if r.scope == "hook" and r.attr == "forward_pre_hook").new
            hook.remove()  # control: packed boundaries, but the positions the decoder counts over the row
            control = model(**inputs).logits[0]
            with pytest.raises(InvalidInputError, match="takes one packed row at a time"):
                model(input_ids=inputs["input_ids"].expand(2, -1), position_ids=inputs["position_ids"].expand(2, -1))
            with pytest.raises(InvalidInputError, match="encoder_hidden_states with packed inputs"):
                model(**inputs, encoder_hidden_states=torch.randn(1, 5, model.config.d_model))
    assert rel_diff(got, expected) <= 1e-5 < rel_diff(control, expected)


# -- the structure above the text model -------------------------------------------------------------------------------

def _installed(model_type: str) -> bool:
    return model_type in causal_lm_types()


@pytest.mark.skipif(not _installed("gemma4"), reason="transformers has no gemma4 on this release")
def test_owner_hands_its_language_model_per_token_inputs_the_text_model_computes():
    """Gemma 4's owner passes per_layer_inputs (a per-token lookup) to its language model: accepted because the text
    model's own forward computes the same keyword from the same method (`_text_model_computes`); the composite packs,
    forward and backward; control: the stock composite on the packed row with a mask of ones attends across
    sequences. An owner passing anything else under that keyword is refused; `embed_inputs` (embeddings without the
    ids the per-layer inputs are read from) is refused, typed."""
    from tests.every_type import build, check, logits_of, packed_inputs, sample_sequences, stock_per_sequence
    from tfcompat.registry.derive_vision import _forwards_to

    entry = tfcompat.resolve("gemma4").entry
    assert entry.derived_vision is not None and ("Gemma4Model", "language_model") in entry.derived_vision.hops
    outcome = check("gemma4", "sdpa")
    if outcome.status == "unbuildable":  # 5.14: its text config's per-layer attributes refuse the zoo's shrink
        pytest.skip(f"the tiny zoo cannot build gemma4 on {INSTALLED_VERSION}: {outcome.reason.splitlines()[0]}")
    assert outcome.status == "pass", outcome.reason
    model = build("gemma4", "sdpa")
    seqs = sample_sequences(model.config)
    inputs = packed_inputs(seqs)
    with torch.no_grad():
        expected = stock_per_sequence(model, seqs)
        control = logits_of(model, **inputs, attention_mask=torch.ones_like(inputs["input_ids"]))
    assert rel_diff(control, expected) > 1e-3
    text_model = importlib.import_module(entry.module_of("text_model")).Gemma4TextModel
    assert _forwards_to(_OwnPerLayerInputs, "language_model", text_model) == (
        "_OwnPerLayerInputs.forward passes per_layer_inputs to its language model")
    # embeddings computed outside the forward lack the per-layer inputs read from the ids: refused, typed
    assert entry.derived_vision.token_inputs == ("per_layer_inputs",)
    with pytest.raises(tfcompat.InvalidInputError, match="also hands its language model per_layer_inputs"):
        tfcompat.embed_inputs(model, inputs["input_ids"])


class _OwnPerLayerInputs(torch.nn.Module):
    """An owner computing per_layer_inputs its own way (not the text model's method): read from this source."""

    def forward(self, inputs_embeds, position_ids=None, **kwargs):  # pragma: no cover - only its source is read
        per_layer_inputs = self.mix_over_the_row(inputs_embeds)
        return self.language_model(inputs_embeds=inputs_embeds, position_ids=position_ids,
                                   per_layer_inputs=per_layer_inputs, **kwargs)


@pytest.mark.parametrize("model_type", [t for t in ("gemma4_assistant", "gemma4_unified_assistant") if _installed(t)])
def test_causal_lm_needing_another_models_states_is_refused(model_type):
    """Gemma 4's assistant (a drafter) raises without shared_kv_states, its target model's keys and values."""
    with pytest.raises(PatchError, match=r"forward requires shared_kv_states"):
        tfcompat.resolve(model_type)


@pytest.mark.skipif(not _installed("gemma3n"), reason="transformers has no gemma3n on this release")
def test_language_model_is_the_one_built_from_the_text_config_alone():
    """Gemma 3n's owner builds its vision and audio projectors from the text config too: the language model is the
    attribute built from it alone (the model itself needs timm for its vision tower, which the test env lacks)."""
    derived = tfcompat.resolve("gemma3n").entry.derived_vision
    assert derived is not None and derived.language_model_attr == "language_model"


@pytest.mark.skipif(MAJOR < 5, reason="Fuyu's forward calls its language model without **kwargs on 4.x (refused)")
def test_default_positions_counted_after_the_cache_are_the_contract():
    """Fuyu numbers a row without position_ids as ``torch.arange(cache_length, seq_len + cache_length)``: the usual
    default (0, 1, ... after the cache), so given position ids it hands them on and the composite packs (the sweep
    compares it)."""
    try:
        assert tfcompat.resolve("fuyu").entry.derived_vision is not None
    except PatchError as exc:
        if "calls self.model without its **kwargs" not in str(exc):
            raise
        pytest.skip(f"FuyuForCausalLM.forward drops **kwargs on {INSTALLED_VERSION} (5.0-5.2): refused")


@pytest.mark.parametrize("model_type", [t for t in ("musicgen", "musicgen_melody") if _installed(t)])
def test_positions_from_the_row_length_alone_are_refused_naming_where(model_type):
    """MusicGen's decoder adds sinusoidal positions counted from the row's length (its positions module takes no
    position ids): a packed row's positions cannot restart per sequence. On 4.x its decoder layers get no **kwargs
    and would run per sequence, but their positions would still be the row's."""
    with pytest.raises(PatchError, match=r"forward takes no position_ids|SinusoidalPositionalEmbedding, which may "
                       "count positions over the row") as info:
        tfcompat.resolve(model_type)
    assert "SinusoidalPositionalEmbedding" in info.value.why + info.value.what


@pytest.mark.skipif(not _installed("xlm"), reason="transformers has no xlm causal LM on this release")
def test_parallel_lists_of_layer_parts_are_refused_naming_them():
    """XLM's model holds lists of attentions, norms and FFNs that its forward calls in turn: no decoder layer."""
    with pytest.raises(PatchError, match=r"XLMModel keeps its layers' parts in parallel lists, no decoder layer class "
                       r"\(attentions: MultiHeadAttention; ffns: TransformerFFN\)"):
        tfcompat.resolve("xlm")


@pytest.mark.skipif(not _installed("moss_transcribe_diarize"), reason="transformers has no moss_transcribe_diarize")
def test_causal_lm_around_a_text_model_of_another_type_derives_as_a_composite():
    """MossTranscribeDiarize: an audio tower in front of a Qwen3 text model, built from config.text_config, the
    positions in **kwargs all the way down: derived as a composite (the sweep compares it packed with stock)."""
    derived = tfcompat.resolve("moss_transcribe_diarize").entry.derived_vision
    assert derived is not None and derived.text_family == "qwen3"
    assert derived.hops == (("MossTranscribeDiarizeForConditionalGeneration", "model"),
                            ("MossTranscribeDiarizeModel", "language_model"))


@pytest.mark.skipif(not _installed("zamba2") or MAJOR < 5, reason="transformers has no zamba2, or (4.x) hands its "
                    "layers their blocks through iterators (next(...)), which are not read")
def test_layers_a_builder_method_returns_and_blocks_handed_to_a_layer_are_found():
    """Zamba2's model builds its layers in ``get_layers`` and hands each hybrid layer its shared attention block and
    its Mamba layer (constructor arguments): both are read (what it then needs is the mixers' business)."""
    from tfcompat.registry.derive import _built_classes

    zamba2 = importlib.import_module("transformers.models.zamba2.modeling_zamba2")
    layers = _built_classes(zamba2, zamba2.Zamba2Model, "__init__", lists_only=True)
    if INSTALLED_VERSION in tfcompat.registry.versions.VersionRange("5.0", "5.2"):
        pytest.skip(f"Zamba2 of {INSTALLED_VERSION}: layers through iterators (5.0), cache_position counted over the "
                    "row into its mask (5.1): refused there")
    assert set(layers) == {zamba2.Zamba2HybridLayer, zamba2.Zamba2MambaDecoderLayer}
    assert set(_built_classes(zamba2, zamba2.Zamba2HybridLayer, "__init__")) == {
        zamba2.Zamba2AttentionDecoderLayer, zamba2.Zamba2MambaDecoderLayer}
    derived = tfcompat.resolve("zamba2").entry.derived  # its layers run per sequence (tests/test_every_causal_lm.py)
    assert derived is not None and derived.per_sequence_why and derived.per_sequence


@pytest.mark.skipif(not _installed("blt"), reason="transformers has no blt on this release")
def test_several_stacks_of_layers_are_refused_naming_them():
    """BLT runs a local encoder over bytes, a global transformer over patches and a local decoder: no one stack."""
    with pytest.raises(PatchError, match=r"BltModel holds several stacks of layers \(BltLocalEncoder, "
                       r"BltGlobalTransformer, BltLocalDecoder"):
        tfcompat.resolve("blt")


# model_type -> (vision config class, its tiny sizes, patches per side, values per patch): 4 soft tokens per image
_GEMMA4_VISION = {
    "gemma4": ("Gemma4VisionConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                          pooling_kernel_size=2, patch_size=4, position_embedding_size=64), 4, 48),
    "gemma4_unified": ("Gemma4UnifiedVisionConfig", dict(patch_size=4, pooling_kernel_size=2, mm_embed_dim=64,
                                                         mm_posemb_size=16, output_proj_dims=64), 2, 192),
}


def _gemma4_with_vision(model_type: str, impl: str, bidirectional: str | None) -> torch.nn.Module:
    """The zoo's tiny ``model_type`` with a tiny vision tower (its config has none by default; `_GEMMA4_VISION`)."""
    from tfcompat.tiny_models import TinyModelError, model_class_name, tiny_config

    transformers = importlib.import_module("transformers")
    try:
        config = tiny_config(model_type)
    except TinyModelError as exc:  # 5.14: the text config's per-layer attributes refuse the zoo's shrink
        pytest.skip(f"the tiny zoo cannot build {model_type} on {INSTALLED_VERSION}: {exc.what}")
    name, sizes, _, _ = _GEMMA4_VISION[model_type]
    config.vision_config = getattr(transformers, name)(**sizes)
    config.text_config.use_bidirectional_attention = bidirectional
    torch.manual_seed(0)
    model = getattr(transformers, model_class_name(model_type))._from_config(config, attn_implementation=impl)
    return model.float().eval()


@pytest.mark.parametrize("model_type", [t for t in _GEMMA4_VISION if _installed(t)])
@pytest.mark.parametrize("bidirectional", [None, "vision"])
def test_gemma4_packs_with_images(model_type, bidirectional):
    """Rule: Gemma 4 (and its unified tower) with images, packed by `tfcompat.pack` and patched, equals stock per
    sequence, forward and backward (sdpa; Gemma 4 reads its per-layer inputs from the ids, image tokens as padding;
    with "vision", attention is bidirectional within each image: the token-typed row runs transformers' mask of the
    packed row); control: the unpatched row with positions running on differs."""
    from tests.every_type import compare, compare_gradients, gradients, logits_of, projection, sample_sequences

    # float64: Gemma 4 attends at scaling 1.0 over RMS-normed q/k (logits of the order of head_dim), where fp32
    # rounding of the same sums in another order reaches 4e-5 of the gradients
    model = _gemma4_with_vision(model_type, "sdpa", bidirectional).double()
    token = model.config.image_token_id
    gen = torch.Generator().manual_seed(0)
    _, _, side, values = _GEMMA4_VISION[model_type]
    grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1).reshape(1, -1, 2)

    def with_image(seed: int) -> dict[str, torch.Tensor]:
        before, after = sample_sequences(model.config, lengths=(5, 4), seed=seed)
        ids = torch.cat([before, torch.full((4,), token), after])[None]
        return {"input_ids": ids, "pixel_values": torch.randn(1, side * side, values, generator=gen).double(),
                "image_position_ids": grid, "mm_token_type_ids": (ids == token).long()}

    examples = [with_image(1), {"input_ids": sample_sequences(model.config, lengths=(6,), seed=2)[0][None]},
                with_image(3)]
    def logits64(**inputs: torch.Tensor) -> torch.Tensor:  # (L, V), the loss in float64 too
        return model(**inputs, use_cache=False).logits[0]

    with torch.no_grad():
        expected = [logits64(**ex) for ex in examples]
    w = projection(expected[0].shape[-1]).double()
    model.set_attn_implementation("eager")
    eager_grads = gradients(model, lambda: sum((logits64(**ex) @ w).sum() for ex in examples))
    model.set_attn_implementation("sdpa")
    expected_grads = gradients(model, lambda: sum((logits64(**ex) @ w).sum() for ex in examples))
    with tfcompat.patch(model):
        inputs = tfcompat.pack(model, examples).model_inputs
        with torch.no_grad():
            diff = compare(logits64(**inputs), expected)
        got_grads = gradients(model, lambda: (logits64(**inputs) @ w).sum())
    with torch.no_grad():
        control = compare(logits_of(model, **{k: v for k, v in inputs.items() if not k.startswith("tfcompat")
                                              and k != "position_ids"}), expected)
    grads, spread = compare_gradients(got_grads, expected_grads), compare_gradients(eager_grads, expected_grads)
    # the tiny Gemma 4's backward is ill-conditioned (attention logits of the order of head_dim at scaling 1.0): stock
    # eager and stock sdpa disagree in float64 too (3e-6 to 1.7e-5; packed vs sdpa 3e-7 to 5e-7): packed may not
    # stray further from sdpa than stock eager does
    assert diff <= 1e-10 and grads <= spread, (diff, grads, spread)
    assert control > 1e-3


@pytest.mark.skipif(not _installed("mllama"), reason="transformers has no mllama on this release")
@torch.no_grad()
def test_cross_attention_layers_skipped_without_states_are_left_stock():
    """Mllama's text model skips its cross-attention layers (to image states) when given none: the causal LM packs
    (the tiny model holds one such layer; the sweep compares forward and backward), and a packed row with cross
    states is refused, typed; the cross-attention modules are never patched."""
    from tests.every_type import build, compare, logits_of, packed_inputs, sample_sequences, stock_per_sequence

    model = build("mllama", "sdpa")
    assert any(type(m).__name__ == "MllamaTextCrossAttention" for m in model.modules())
    seqs = sample_sequences(model.config)
    expected = stock_per_sequence(model, seqs)
    inputs = packed_inputs(seqs)
    with tfcompat.patch(model):
        assert compare(logits_of(model, **inputs), expected) <= 1e-5
        with pytest.raises(tfcompat.InvalidInputError, match="cross_attention_states with packed inputs"):
            model.model(**inputs, cross_attention_states=torch.randn(1, 4, model.config.hidden_size))
    control = logits_of(model, **inputs, attention_mask=torch.ones_like(inputs["input_ids"]))
    assert compare(control, expected) > 1e-3


@pytest.mark.skipif("paligemma" not in derive_vision.vision_types(), reason="transformers has no paligemma here")
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("token_types", ["none", "zeros", "suffix", "mixed"])
def test_owner_numbering_from_an_offset_is_kept_per_sequence(token_types, impl):
    """PaliGemma's owner numbers a sequence from 1 when given no positions (``position_ids.unsqueeze(0) + 1``): the
    derivation reads the offset (`_counts_the_row`) and the packed text model gets the contract's row plus it; packed
    with images equals stock per sequence, with the processor's token types too: all zeros (no suffix: the whole
    sequence is a bidirectional prefix, not text), a suffix of ones, or some examples without them ("mixed": packed
    as masked without them). Under sdpa without token types stock attends both ways over a sequence alone (its
    attention is not causal and the mask it builds is dropped for sdpa) and causally in a padded batch: packed rows
    without them are refused, typed. Where stock eager attends both ways without token types too (4.x: over its
    whole prompt), the proof refuses."""
    import ast

    from tests.every_type import build, vlm_examples
    from tfcompat.registry.derive_vision import _counts_the_row

    assert _counts_the_row(ast.parse("position_ids = position_ids.unsqueeze(0) + 1").body[0]) == 1
    assert _counts_the_row(ast.parse("position_ids = torch.arange(n) + past_seen_tokens").body[0]) == 0
    assert _counts_the_row(ast.parse("position_ids = position_ids * 2").body[0]) is None
    entry = tfcompat.resolve("paligemma").entry
    if entry.derived_vision is None or entry.derived_vision.position_offset != 1:
        pytest.skip(f"paligemma's owner numbers no offset row on {INSTALLED_VERSION}")
    model = build("paligemma", impl, kind="image_text_to_text")
    examples = [{k: v for k, v in ex.items() if k != "token_type_ids"} for ex in vlm_examples(model)]
    for i, ex in enumerate(examples if token_types != "none" else []):
        n = ex["input_ids"].shape[1]
        if token_types == "zeros":
            ex["token_type_ids"] = torch.zeros(1, n, dtype=torch.long)
        elif token_types == "suffix" or i != 1:  # mixed: the second example has none
            ex["token_type_ids"] = (torch.arange(n) >= n // 2).long()[None]
    with torch.no_grad():
        expected = [model(**ex).logits[0] for ex in examples]
        if token_types == "mixed" and not _causal_without_token_types(model, examples[1]):
            with pytest.raises(tfcompat.InvalidInputError, match="some examples have token_type_ids"):
                tfcompat.pack(model, examples)
            return
        packed = tfcompat.pack(model, examples)
        with tfcompat.patch(model):  # proved on a copy running the model's own attention, with token types
            if token_types == "none" and not _causal_without_token_types(model, examples[0]):
                with pytest.raises(tfcompat.InvalidInputError, match="a packed row without token_type_ids"):
                    model(**packed.model_inputs)
                return
            got = model(**packed.model_inputs).logits[0]
    assert rel_diff(got, expected) < 1e-5


def test_token_type_values_are_read_from_the_owner_mask():
    """Rule: what a token type means is asked of the owner's own mask (`tfcompat.inputs.token_types`), not assumed
    (Gemma 3's 0 is text and its 1 an image; PaliGemma's 0 is the bidirectional prefix and its 1 the causal suffix):
    the values it finds causal are those whose rows the stock model runs causally (a prefix's logits are the whole
    row's first), and without token types likewise (PaliGemma's sdpa attends both ways: no mask over attention that
    is not causal)."""
    from tests.every_type import build, vlm_examples
    from tfcompat.inputs.derived_vision import owner_of
    from tfcompat.inputs.token_types import PROBED, token_type_rule

    checked = 0
    for model_type in ("gemma3", "paligemma"):
        if model_type not in derive_vision.vision_types():
            continue
        r = tfcompat.resolve(model_type)
        if r.entry.derived_vision is None or "token_type_ids" not in r.entry.derived_vision.mask_inputs:
            continue
        for impl in ("eager", "sdpa"):
            model = build(model_type, impl, kind="image_text_to_text")
            rule = token_type_rule(r, *owner_of(r, model), ("token_type_ids",))
            text = vlm_examples(model)[1]  # text alone
            text = {"input_ids": text["input_ids"]}
            causal = tuple(v for v in PROBED if _causal_without_token_types(
                model, {**text, "token_type_ids": torch.full_like(text["input_ids"], v)}, keep_types=True))
            assert rule.causal == causal, (model_type, impl)
            assert rule.untyped_causal == _causal_without_token_types(model, text), (model_type, impl)
            checked += 1
    if not checked:
        pytest.skip(f"no owner builds its mask from token_type_ids on {INSTALLED_VERSION}")


def _causal_without_token_types(model: torch.nn.Module, example: dict[str, torch.Tensor], keep_types: bool = False
                                ) -> bool:
    """Whether the stock model's logits of a prefix are those of the whole sequence's first tokens (causal), for
    ``example`` without its token types (keep_types: with them, cut alike)."""
    example = {k: v for k, v in example.items() if keep_types or k != "token_type_ids"}
    with torch.no_grad():
        whole = model(**example).logits[0]
        ids = example["input_ids"]
        prefix = model(**{k: v[:, : ids.shape[1] - 2] if k in ("input_ids", "token_type_ids") else v
                          for k, v in example.items()}).logits[0]
    return bool(torch.allclose(whole[: prefix.shape[0]], prefix, atol=1e-5))


@pytest.mark.skipif("instructblip" not in derive_vision.vision_types(), reason="transformers has no instructblip")
def test_decoder_only_branch_and_sub_model_text():
    """InstructBLIP's forward calls a decoder-only language model or, in its other branch, a seq2seq one with
    ``decoder_input_ids``: the derivation reads the decoder-only call (its text model is a causal family) and packs;
    its forward requires pixel values, so embeddings alone are refused, typed. The Q-Former's instruction ids are
    padded by `pack`: of different lengths without their mask, refused naming it."""
    from tests.every_type import build, vlm_examples

    entry = tfcompat.resolve("instructblip").entry
    if entry.derived_vision is None:
        pytest.skip("instructblip is a written family here")
    assert entry.derived_vision.embeds_need_ids
    model = build("instructblip", "eager", kind="image_text_to_text")
    examples = vlm_examples(model)[:3]
    with torch.no_grad():
        expected = [model(**ex).logits[0] for ex in examples]
        with tfcompat.patch(model):
            got = model(**tfcompat.pack(model, examples).model_inputs).logits[0]
            with pytest.raises(tfcompat.InvalidInputError, match="cannot take embeddings computed outside"):
                tfcompat.embed_inputs(model, examples[0]["input_ids"], pixel_values=examples[0]["pixel_values"])
    assert rel_diff(got, expected) < 1e-5
    examples[0] = {**examples[0], "qformer_input_ids": examples[0]["qformer_input_ids"][:, :3]}
    examples[0].pop("qformer_attention_mask")
    with pytest.raises(tfcompat.InvalidInputError, match="qformer_input_ids differ in length"):
        tfcompat.pack(model, examples)


@pytest.mark.skipif("qwen4_exp" not in derive_vision.vision_types(), reason="transformers has no qwen4_exp here")
def test_owner_hands_the_ids_the_text_model_would_look_up():
    """Qwen4-Exp's owner hands its language model ``ple_input_ids`` (the token ids, or the text model's
    ``reverse_embedding`` of the embeddings), which the text model computes alike when not given: accepted
    (`_lookups`); with per-layer embeddings on, packed with images equals stock per sequence; embeddings alone are
    refused, typed (they do not carry the ids)."""
    from tests.every_type import compare, vlm_examples
    from tfcompat.tiny_models import tiny_config, tiny_model

    entry = tfcompat.resolve("qwen4_exp").entry
    assert entry.derived_vision is not None and entry.derived_vision.token_inputs == ("ple_input_ids",)
    config = tiny_config("qwen4_exp", "image_text_to_text")
    config.text_config.ple_layer_ids, config.text_config.ple_embed_dim = [0], 16
    model = tiny_model("qwen4_exp", kind="image_text_to_text", config=config)
    examples = vlm_examples(model)
    with torch.no_grad():
        expected = [model(**ex).logits[0] for ex in examples]
        with tfcompat.patch(model):
            inputs = tfcompat.pack(model, examples).model_inputs
            assert compare(model(**inputs).logits[0], expected) <= 1e-5
            with pytest.raises(tfcompat.InvalidInputError, match="also hands its language model ple_input_ids"):
                tfcompat.embed_inputs(model, inputs["input_ids"])


@pytest.mark.skipif("paligemma" not in derive_vision.vision_types(), reason="transformers has no paligemma here")
def test_a_derived_owner_built_on_another_text_config_derives_from_it():
    """A vision-language model whose default language model is a derived text type (PaliGemma's gemma), built with
    another (PaliGemma 2's gemma2, sliding layers): its entry is derived from the text config it was built with, and
    it packs exactly (eager: see the offset test for sdpa). Before, the default text family was planned and the patch
    found none of its classes."""
    from tests.every_type import compare, vlm_examples
    from tfcompat.registry.lookup import resolve_model
    from tfcompat.tiny_models import shrunk_config, tiny_config

    config_cls = type(tiny_config("paligemma", "image_text_to_text"))
    config = shrunk_config(config_cls(text_config={"model_type": "gemma2", "sliding_window": 4,
                                                   "num_hidden_layers": 4}))
    model_cls = getattr(importlib.import_module("transformers"), derive_vision.vision_types()["paligemma"])
    torch.manual_seed(0)
    model = model_cls._from_config(config, attn_implementation="eager").eval()
    if resolve_model(model).entry.derived_vision is None:
        pytest.skip(f"paligemma is not derived on {INSTALLED_VERSION}")
    assert resolve_model(model).entry.derived_vision.text_family == "gemma2"
    examples = vlm_examples(model)
    with torch.no_grad():
        expected = [model(**ex).logits[0] for ex in examples]
        if not _causal_without_token_types(model, examples[0]):
            pytest.skip("the stock model attends both ways without token types here (4.x); patch() refuses")
        with tfcompat.patch(model):
            got = model(**tfcompat.pack(model, examples).model_inputs).logits[0]
    assert compare(got, expected) <= 1e-5
