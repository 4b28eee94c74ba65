"""`tfcompat.tiny_models`: the generic shrink keeps each feature a type has, at tiny sizes, on the installed release."""

from __future__ import annotations

import pytest
import torch

from tests.every_type import image_check
from tfcompat.tiny_models import TinyModelError, model_types, special_token_ids, tiny_config, tiny_model

CAUSAL = set(model_types("causal_lm"))


def _config(model_type: str):
    if model_type not in CAUSAL:
        pytest.skip(f"the installed transformers has no causal-LM {model_type!r}")
    return tiny_config(model_type)


def test_dense_sizes():
    c = _config("llama")
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (256, 64, 128, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert c.attention_dropout == 0.0


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text", "deepseek_v3", "llama4_text", "gpt_oss"])
def test_special_token_ids_inside_the_vocab(model_type):
    c = _config(model_type)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = getattr(c, key, None)
        for i in ids if isinstance(ids, list) else [ids]:
            assert i is None or 0 <= i < c.vocab_size, (key, i)


def test_every_layer_kind_of_a_pattern_is_kept():
    """Rule: gemma3's 5 sliding : 1 full pattern needs 6 layers; a window of 8 cuts sequences of 10-20."""
    c = _config("gemma3_text")
    assert c.num_hidden_layers == 6 and set(c.layer_types) == {"sliding_attention", "full_attention"}
    assert c.sliding_window == 8


def test_llama4_keeps_no_rope_and_chunked_layers():
    c = _config("llama4_text")
    assert set(c.no_rope_layers) == {0, 1} and c.attention_chunk_size == 8


def test_moe_routes_two_of_four_experts():
    c = _config("qwen3_moe")
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 2, 32)


def test_mla_keeps_qk_head_dim_apart_from_v_and_a_dense_first_layer():
    c = _config("deepseek_v3")
    assert (c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim) == (24, 16)
    assert (c.kv_lora_rank, c.q_lora_rank, c.num_key_value_heads) == (32, 32, c.num_attention_heads)
    assert c.first_k_dense_replace == 1 < c.num_hidden_layers
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group) == (4, 2, 2, 1)


def test_tiny_model_is_seeded_fp32_eval():
    a, b = tiny_model("llama", seed=1), tiny_model("llama", seed=1)
    assert not a.training and all(p.dtype.is_floating_point and p.element_size() == 4 for p in a.parameters())
    assert all((p == q).all() for p, q in zip(a.parameters(), b.parameters()))
    assert sum(p.numel() for p in a.parameters()) < 500_000


def test_unknown_type_is_a_typed_error():
    with pytest.raises(TinyModelError, match="no causal_lm model for this type"):
        tiny_config("no_such_model_type")


@pytest.mark.broad
@pytest.mark.sweep
@pytest.mark.parametrize("model_type", model_types("image_text_to_text"))
def test_image_zoo(model_type):
    """Rule: a tiny vision-language model runs forward and backward on text around one fake image of its patch layout,
    and the image reaches the logits; a type the zoo cannot build says why (xfail)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls; see tests/test_every_causal_lm.py
    try:
        outcome = image_check(model_type)
    finally:
        torch.set_num_threads(threads)
    if outcome.status == "unbuildable":
        pytest.xfail(f"{model_type}: {outcome.reason}")
    assert outcome.status == "pass", outcome.reason


def test_shrunk_config_keeps_the_semantics_of_a_given_config():
    """Rule (`shrunk_config`): sizes shrink, everything that changes what the model computes is the given config's:
    its layer pattern (cut to the first layers holding each kind), windows and top-k capped rather than set, the
    key/value-head kind, rope scaling with longrope's factors resampled to the tiny head; the config is not touched."""
    from transformers import Gemma3TextConfig, MixtralConfig, Phi3Config

    from tfcompat.tiny_models import shrunk_config

    rope = {"rope_type": "longrope", "short_factor": [1.0 + i for i in range(48)], "long_factor": [2.0] * 48,
            "original_max_position_embeddings": 4096}
    phi3 = Phi3Config(rope_scaling=rope, max_position_embeddings=131072, sliding_window=4, num_key_value_heads=1)
    before = phi3.to_dict()
    tiny = shrunk_config(phi3)
    assert phi3.to_dict() == before
    assert (tiny.hidden_size, tiny.num_attention_heads, tiny.vocab_size) == (64, 4, 256)
    assert tiny.rope_parameters["rope_type"] == "longrope" and len(tiny.rope_parameters["short_factor"]) == 8
    assert tiny.rope_parameters["short_factor"][:2] == [1.0, 7.0]  # every sixth of the 48
    assert tiny.rope_parameters["original_max_position_embeddings"] == 4096
    assert tiny.max_position_embeddings == 131072 and tiny.sliding_window == 4 and tiny.num_key_value_heads == 1
    pattern = ["full_attention", "full_attention", "full_attention", "sliding_attention"] * 3
    gemma = shrunk_config(Gemma3TextConfig(layer_types=pattern, num_hidden_layers=12, final_logit_softcapping=7.0))
    assert gemma.layer_types == pattern[:4] and gemma.num_hidden_layers == 4
    assert gemma.final_logit_softcapping == 7.0 and gemma.sliding_window == 8
    mixtral = shrunk_config(MixtralConfig(num_experts_per_tok=1, num_key_value_heads=32))
    assert (mixtral.num_experts_per_tok, mixtral.num_local_experts, mixtral.num_key_value_heads) == (1, 4, 4)


IMAGE = set(model_types("image_text_to_text"))
# image-text-to-text types the zoo builds since issue 27 (the rule each needed): widths checked against a hidden size
# (apertus1p5, dots3_note), VQ tokenizers' codebooks and vocabulary maps (apertus1p5, chameleon, emu3), Fuyu's linear
# patches, GIT's prepended image, Granite 4 Vision's projector layers, Inkling 2's merged blocks, Inkling's frames,
# Mllama's tiles (its tower's tapped layers, and a per-token cross-attention mask instead of placeholders to fill)
NEWLY_BUILT = ["apertus1p5", "chameleon", "dots3_note", "emu3", "fuyu", "git", "granite4_vision", "inkling2",
               "inkling2_loop", "inkling_mm_model", "mllama"]
# stock forwards (4.x) that take no image the zoo lays out: the zoo builds them, the image check cannot pass
_IMAGE_NOT_TAKEN = {
    "emu3": "4.x Emu3ForConditionalGeneration.forward does not pass pixel_values to its model",
    "fuyu": "4.x Fuyu's forward takes image_patches at image_patches_indices, not pixel_values at placeholders",
}


def _image_config(model_type: str):
    if model_type not in IMAGE:
        pytest.skip(f"the installed transformers has no image-text-to-text {model_type!r}")
    return tiny_config(model_type, "image_text_to_text")


@pytest.mark.parametrize("model_type", NEWLY_BUILT)
def test_newly_built_image_types(model_type):
    """Rule: each of these builds, runs forward and backward around one fake image of its layout, and the image
    reaches the logits (as `test_image_zoo`, which xfails an unbuildable type; here that is a failure)."""
    _image_config(model_type)
    if model_type == "inkling_mm_model":  # its vision tower plans its scales with scipy's linear_sum_assignment
        pytest.importorskip("scipy", reason="Inkling's vision tower needs scipy (a test dependency: noxfile.py)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls; see tests/test_every_causal_lm.py
    try:
        outcome = image_check(model_type)
    finally:
        torch.set_num_threads(threads)
    if outcome.reason.startswith("the image does not reach the logits") and model_type in _IMAGE_NOT_TAKEN:
        pytest.xfail(_IMAGE_NOT_TAKEN[model_type])
    assert outcome.status == "pass", outcome.reason


def test_widths_checked_against_a_hidden_size_follow_it():
    """Rule: a width the class checks against a hidden size (no projection between them) stays equal to it, at the
    tiny size: WavTokenizer's codebook_dim, dots3's audio and vision adapters (their input, and their output that is
    the text hidden size)."""
    apertus = _image_config("apertus1p5")
    assert apertus.audio_config.codebook_dim == apertus.audio_config.hidden_size == 64
    dots = _image_config("dots3_note")
    assert dots.audio_config.adapter_input_size == dots.audio_config.hidden_size == 64
    assert dots.vision_config.adapter_in_dim == dots.vision_config.hidden_size == 64
    assert dots.vision_config.adapter_out_dim == dots.audio_config.adapter_out_dim == dots.text_config.hidden_size


def test_codebook_ranges_lie_in_the_tiny_vocab():
    """Rule: codebooks shrink to 32 codes; the ranges a config lays into its vocabulary at `*_token_offset` lie end to
    end inside the tiny vocab, in their full-size order, below the special ids (Apertus 1.5: image codes, audio codes).
    """
    c = _image_config("apertus1p5")
    assert c.vision_config.codebook_size == c.audio_config.codebook_size == 32
    assert c.image_token_offset + c.vision_config.codebook_size == c.audio_token_offset
    codes = set(range(c.image_token_offset, c.audio_token_offset + c.audio_config.codebook_size))
    assert max(codes) < c.text_config.vocab_size and not codes & special_token_ids(c)


@pytest.mark.parametrize(("model_type", "field"), [("chameleon", "num_embeddings"), ("emu3", "codebook_size")])
def test_vq_tokenizer_vocabulary_map(model_type, field):
    """Rule: a VQ image tokenizer's vocabulary map names the image placeholder at the config's image token id and
    one token of the tiny vocab per code of its codebook, none of them a special id."""
    c = _image_config(model_type)
    vocabulary = c.vocabulary_map
    assert vocabulary["<image>"] == c.image_token_id
    codes = [i for name, i in vocabulary.items() if name.startswith(("IMGIMG", "<|visual token"))]
    assert len(set(codes)) == getattr(c.vq_config, field) == 32
    assert all(0 <= i < c.get_text_config().vocab_size for i in vocabulary.values())
    assert not set(codes) & special_token_ids(c)


def test_block_diffusion_builds_and_is_refused():
    """DiffusionGemma (block diffusion: an encoder over the prompt, a decoder attending bidirectionally over the canvas)
    builds (its text config's experts set: every layer is MoE), and `tfcompat.patch` refuses it with a reason."""
    import tfcompat
    from tfcompat.errors import PatchError

    _image_config("diffusion_gemma")
    model = tiny_model("diffusion_gemma", "image_text_to_text", attn_implementation="eager")
    with pytest.raises(PatchError, match="encoder-decoder"):
        tfcompat.patch(model)
