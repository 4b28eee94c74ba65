"""Tiny random models of any transformers model type, built from its config class (no download).

`tiny_config(model_type)` shrinks the defaults of the type's config class generically: every size the config
names (through its `attribute_map`, and in every sub-config) is set from one table, every dropout to 0, special
token ids are moved inside the small vocabulary, and the number of layers is the smallest that still holds one
layer of each kind the full-size default has (its `layer_types` and other per-layer patterns, first dense layers
of an MoE). Where a class rejects that shrink, the widths equal to a hidden size of the config tree follow it (a
validator's "codebook_dim must equal hidden_size"). Codebooks get 32 codes; the token ranges a config lays them at
(`*_token_offset`) lie end to end inside the tiny vocabulary. A few types need more than the generic shrink:
`_OVERRIDES` says which and why. A type that cannot be made tiny raises `TinyModelError` naming why.

`shrunk_config(config)` shrinks a given config the same way and keeps every other field (`tiny_copy` builds a
model of it): the user's layer pattern (cut to the first layers that hold each of its kinds), rope scaling and its
parameters (longrope's factor lists resampled to the tiny head), softcaps, norms, biases; windows, chunks, top-k and
expert groups are capped at the tiny sizes rather than set, and the key/value heads keep the config's kind
(multi-head, multi-query, grouped). The config's per-layer patterns win over `_OVERRIDES`.

transformers is imported inside the functions only: importing tfcompat does not import it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, cast

from .errors import TfcompatError
from .registry.versions import installed_transformers

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

__all__ = [
    "Kind", "TinyImage", "TinyModelError", "attention_implementations", "encoder_decoder_examples", "model_class_name",
    "model_types", "requires_images", "sample_examples", "shrunk_config", "special_token_ids", "tiny_config",
    "tiny_copy", "tiny_image", "tiny_model", "tiny_video",
]

Kind = Literal["causal_lm", "image_text_to_text"]

VOCAB = 256

# One size per role, keyed by config attribute (resolved through the config's `attribute_map`). Chosen so that
# head_dim (16) times heads (4) is the hidden size (64), q/k head dims differ from v (MLA: 16 + 8 vs 16), MoE routes
# 2 of 4 experts in 2 groups, and a window of 8 tokens cuts into sequences of 10-20.
_SIZES: dict[str, int] = {
    "vocab_size": VOCAB, "unpadded_vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB,
    "encoder_hash_byte_group_vocab": VOCAB, "hidden_size_per_layer_input": 16,
    "hidden_size": 64, "hidden_size_global": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    # other names of the same roles that are not in an attribute_map
    "n_embd": 64, "d_model": 64, "emb_dim": 64, "embedding_dim": 64, "word_embed_proj_dim": 64, "n_inner": 128,
    "ffn_dim": 128, "decoder_ffn_dim": 128, "encoder_ffn_dim": 128, "ffn_hidden_size": 128, "dim_ff": 128,
    "intermediate_size_mlp": 128,
    "dense_intermediate_size": 128, "n_head": 4, "n_heads": 4, "num_heads": 4, "decoder_attention_heads": 4,
    "encoder_attention_heads": 4, "attention_heads": 4, "num_kv_heads": 2, "d_head": 16, "dim_head": 16,
    "attention_head_dim": 16, "kv_channels": 16, "rotary_dim": 8, "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2, "swa_head_dim": 16,
    # MoE
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_k": 2, "moe_topk": 2, "top_k_experts": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_ffn_hidden_size": 32,
    "moe_shared_expert_intermediate_size": 32, "shared_experts_intermediate_size": 32,
    "n_group": 2, "num_expert_group": 2, "topk_group": 1,
    # multi-head latent attention (DeepSeek): q/k head dim 24, v head dim 16
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "qk_head_dim": 24,
    "v_head_dim": 16, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 8,
    "index_kpool": 4,  # the indexer selects top-k keys in pools of this many (2 of them)
    # windows and chunks that matter for sequences of 10-20 tokens
    "sliding_window": 8, "attention_chunk_size": 8, "sliding_window_size": 8, "attention_window_size": 8,
    # linear attention and state-space layers: 4 value heads of 16, state 16
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_heads": 4, "linear_head_dim": 16, "mamba_n_heads": 8, "mamba_num_heads": 8, "mamba_d_head": 16,
    "mamba_head_dim": 16, "mamba_headdim": 16, "mamba_d_ssm": 128, "ssm_state_size": 16, "state_size": 16,
    "mamba_chunk_size": 16, "chunk_size": 16,  # the torch SSD scan pads to whole chunks
    # vision towers: 32 x 32 images of 8 x 8 patches (a 4 x 4 grid, divisible by the usual 2 x 2 merges)
    "image_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 64, "out_hidden_size": 64, "projection_dim": 64,
    "output_dim": 64,
    "mm_tokens_per_image": 4, "vision_hidden_size": 64, "text_hidden_size": 64, "vision_output_dim": 64,
    "projector_input_dim": 64, "projector_output_dim": 64, "projection_hidden_size": 64,
    "mm_embed_dim": 64, "output_proj_dims": 64, "mm_posemb_size": 16,  # Gemma 4 unified's tower and its positions
    # VQ image tokenizers and audio codecs: 32 codes; the narrowest convolution width GroupNorm's 32 groups take
    "codebook_size": 32, "base_channels": 32,
}
# Token ids from here on hold the ranges of codebook codes a config lays into its vocabulary at `*_token_offset`s (as
# many ids as codes, `codebook_size`): end to end, in their full-size order (Apertus 1.5: the image's, the audio's)
_CODE_IDS = 64
# Capped, not set: a model may have none of these, and keeping one is enough to have that kind of layer or expert.
_AT_MOST: dict[str, int] = {
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "first_k_dense_replace": 1, "num_dense_layers": 1, "moe_layer_start_index": 1,
}
# Left None by some classes for the modeling code to derive, yet read as numbers by others: always set.
_DERIVED = {"head_dim", "num_key_value_heads", "num_experts_per_tok", "num_local_experts", "n_routed_experts"}
_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers", "encoder_layers",
           "num_decoder_layers", "num_encoder_layers")
_MAX_LAYERS = 16
# A given config's values kept where smaller than the tiny size (`shrunk_config`): a window of 4 stays 4, top-1
# routing stays top-1
_CAPPED_OWN = ("sliding_window", "attention_chunk_size", "sliding_window_size", "attention_window_size",
               "num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k_experts", "n_group",
               "num_expert_group", "topk_group")
# Fields of a given config that say how it was stored or loaded, not what the model computes (`shrunk_config`)
_NOT_SEMANTIC = {"dtype", "torch_dtype", "_name_or_path", "quantization_config", "auto_map"}
# Lists of layer indices (not one entry per layer): SAM-style towers' global-attention layers among windowed ones
_LAYER_INDICES = ("global_attn_indexes",)
# indices of a tower's layers whose features are tapped (DeepStack: each feeds one decoder layer): the tiny tower's
# first layers, as many as it has
_TAPPED_LAYERS = ("deepstack_visual_indexes",)
# One layer index of the full-size tower: where MiniCPM-V inserts its window merger (past a tiny tower's layers, the
# merger never runs while the features are still split by the merged sizes)
_LAYER_INDEX = ("insert_layer_id",)

# Additions to the generic shrink, by config class, each with the reason the generic one fails.
_OVERRIDES: dict[str, dict[str, Any]] = {
    # the pattern is a run-length list [[kinds, repeats]], not one entry per layer
    "GPTNeoConfig": {"attention_types": [[["global", "local"], 1]]},
    # `num_heads` here are SSM heads: num_heads * head_dim must be expand (2) * hidden (64)
    "Mamba2Config": {"num_heads": 8, "head_dim": 16, "n_groups": 1},
    # hybrids whose default pattern leaves the tiny model without one of its mixers: a short-convolution layer beside
    # attention (LFM2's default is attention only), an attention layer beside Mamba (Jamba's period 8, Bamba's none)
    "Lfm2Config": {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2},
    "JambaConfig": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "BambaConfig": {"attn_layer_indices": [1]},
    # routes to one expert only
    "ZayaConfig": {"num_experts_per_tok": 1},
    # one codebook: the decoder then reads input_ids (B, L) like any causal LM
    "MusicgenDecoderConfig": {"num_codebooks": 1},
    "MusicgenMelodyDecoderConfig": {"num_codebooks": 1},
    # the model reads `rope_theta` from its attention sub-config, whose class has no such field (5.x)
    "DbrxAttentionConfig": {"rope_theta": 10000.0},
    # the last `num_kv_shared_layers` layers reuse K/V of earlier ones: 6 of 11 compute their own (both kinds)
    "Gemma3nTextConfig": {"num_kv_shared_layers": 5},
    # per-layer overrides are keyed by layer index: the one full-attention layer of 6 keeps a larger head
    "Gemma4TextConfig": {"per_layer_config": {"05": {"head_dim": 32}}},
    "Gemma4UnifiedTextConfig": {"per_layer_config": {"05": {"head_dim": 32}}},
    # the cross-attention layers (to image states) are indices, not a per-layer pattern: one of the two layers
    "MllamaTextConfig": {"cross_attention_layers": [1]},
    # the tower concatenates its last state with these layers' (full size 5 of 32): two of the tiny tower's two, so
    # its output is 3 x its hidden size
    "MllamaVisionConfig": {"intermediate_layers_indices": [0, 1], "num_global_layers": 1, "vision_output_dim": 192},
    # the shared transformer block is tied across hybrid layers: it needs two of them
    "ZambaConfig": {"attn_layer_period": 2, "attn_layer_offset": 1, "num_hidden_layers": 6},
    # sliding layers' head_dim is their q/k head (per-layer qk_nope_head_dim + qk_rope_head_dim)
    "Dots3NoteTextConfig": {"head_dim": 24},
    # ReformerModelWithLMHead asserts it (the causal LM head of an encoder-style config)
    "ReformerConfig": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_embds": False,
                       "hash_seed": 0},  # LSH buckets drawn alike at every call (it trains in train mode, below)
    # BERT-style encoders: their LM head model is a causal LM only as a decoder (bidirectional otherwise)
    **{name: {"is_decoder": True} for name in (
        "BertConfig", "BertGenerationConfig", "CamembertConfig", "Data2VecTextConfig", "ElectraConfig", "ErnieConfig",
        "MegatronBertConfig", "RemBertConfig", "RobertaConfig", "RobertaPreLayerNormConfig", "RoCBertConfig",
        "RoFormerConfig", "XLMRobertaConfig", "XLMRobertaXLConfig", "XmodConfig", "BigBirdConfig")},
    # the projector concatenates these vision layers: two of the tiny tower's two
    "VipLlavaConfig": {"vision_feature_layers": [-2, -1]},
    "Molmo2AdapterConfig": {"vision_feature_layer": [1, 0]},  # full size [24, 18] of 25, indices checked
    # positions are one per patch of the default image (27**2, kept from the full-size values): the tiny one's 4**2
    "Molmo2VisionConfig": {"num_position_embeddings": 16},
    # the projector takes the tower's merged patches: vision hidden (64) times merge_size**2 (4), not a size of its own
    "MuseSparkConfig": {"out_hidden_size": 256}, "MuseGlimmerConfig": {"out_hidden_size": 256},
    # full-size multi-head (10 of 10): its eager attention repeats no key/value heads
    "UnlimitedOcrTextConfig": {"num_key_value_heads": 4},
    # the pixel-shuffle adapter's input (hidden 64 / 0.5**2) is the vision `intermediate_size`
    "Llama4VisionConfig": {"intermediate_size": 256},
    # the projector's query count is keyed by the patch count of the full-size image (35**2, 70**2): the tiny one's 4**2
    "AriaConfig": {"projector_patch_to_query_dict": {16: 4}},
    # any-resolution tiles of the tiny 32 x 32 image
    "LlavaNextConfig": {"image_grid_pinpoints": [[32, 32]]},
    "LlavaNextVideoConfig": {"image_grid_pinpoints": [[32, 32]]},
    "LlavaOnevisionConfig": {"image_grid_pinpoints": [[32, 32]]},
    # the codebook's codes are token ids of the tiny vocab (`_CODE_NAMES`): as many as `codebook_size` says
    "ChameleonVQVAEConfig": {"num_embeddings": 32},
    "Emu3VQVAEConfig": {"hidden_size": 128},  # its attention blocks' width: the last stage's, base_channels * 4
    # image features are injected at text layers (one per projector: a deepstack layer of the vision tower, 4 spatial
    # offset groups): 5 text layers, one each; the projector's Q-Former pools 2 x 2 windows of the 4 x 4 patches
    "Granite4VisionConfig": {"deepstack_layer_map": [[1, 0]], "spatial_target_layers": [1, 2, 3, 4],
                             "downsample_rate": "1/2", "image_grid_pinpoints": [[32, 32]]},
    "Granite4VisionTextConfig": {"num_hidden_layers": 5},
    # DaViT stages: the default kernels (7, then 3) over the tiny image, one block each (the shrink gives 8 x 8 kernels
    # of 4 x 4 maps)
    "Florence2VisionConfig": {"patch_size": [7, 3, 3, 3], "depths": [1, 1, 1, 1]},
    # the projector's output is the decoder's hidden size (the tiny text model's 64), its convolutions' channels
    # shrunk alike
    # the tiny MobileNetV5's 2 x 2 tokens (`_TIMM_TOWERS`), full size 16 x 16
    "Gemma3nConfig": {"vision_soft_tokens_per_image": 4},
    "PPFormulaNetVisionConfig": {"decoder_hidden_size": 64, "output_channels": 64, "post_conv_in_channels": 64,
                                 "post_conv_mid_channels": 64, "post_conv_out_channels": 64, "mlp_dim": 128},
    # rotary parameters are keyed by layer type, and the defaults give none
    "CohereCompassTextConfig": {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
}

# Vision towers that are timm models (`TimmWrapperConfig` and its kin, Gemma 3n's `Gemma3nVisionConfig`): their
# sizes are timm constructor arguments (`model_args`), not config fields, so the generic shrink cannot reach them.
# Per timm architecture, the arguments that keep each stage's kinds of block at tiny widths and depths, the width of
# the features the tower returns (the config's `hidden_size`, read by the projector, where the config has one) and
# the side of the images it takes (the zoo's image). Block strings are timm's (decoded by timm where it is installed).
class _TimmTower(NamedTuple):
    args: dict[str, Any]
    width: int
    image: int


_TIMM_TOWERS: dict[str, _TimmTower] = {
    # FastViT MCi3 (FastVLM): five stages of one block each, three RepMixer then two attention (head_dim 32: widths
    # of 32), the head's width twice the last stage's; strides total 64, so a 128 image gives 2 x 2 tokens
    "fastvit_mci3": _TimmTower({"layers": [1, 1, 1, 1, 1], "embed_dims": [8, 16, 32, 32, 32]}, 64, 128),
    # Perception Encoder ViT (PerceptionLM): 2 x 2 patches of 14 (and the class token), rope on that grid
    "vit_pe_core_large_patch14_336": _TimmTower(
        {"embed_dim": 64, "depth": 2, "num_heads": 4, "img_size": [28, 28], "ref_feat_shape": [2, 2]}, 64, 28),
    # MobileNetV5 (Gemma 3n): each stage's kinds of block once (edge residual; universal inverted residuals; then
    # multi-query attention beside them), 16-32 channels; the multi-scale fusion's output is fixed at 2048 channels
    # by timm, pooled to 2 x 2 tokens (`Gemma3nConfig.vision_soft_tokens_per_image`)
    "mobilenetv5_300m_enc": _TimmTower({"stem_size": 16, "msfa_output_resolution": 2, "block_args": [
        ["er_r1_k3_s2_e4_c16"], ["uir_r1_a3_k5_s2_e6_c16", "uir_r1_a5_k0_s1_e4_c16"],
        ["uir_r1_a5_k5_s2_e6_c32", "uir_r1_a0_k0_s1_e1_c32", "mqa_r1_k3_h2_v2_s1_d16_c32", "uir_r1_a0_k0_s1_e2_c32"],
        ["uir_r1_a5_k5_s2_e6_c32", "mqa_r1_k3_h2_s1_d16_c32", "uir_r1_a0_k0_s1_e2_c32"]]}, 2048, 32),
}
# Sub-configs a class's defaults leave unusable, by config class: PerceptionLM's default tower is timm's ResNet-50,
# which returns no `model_args["embed_dim"]` for its projector; its checkpoints' Perception Encoder (Perception-LM-1B)
_DEFAULT_SUBS: dict[str, dict[str, Any]] = {
    "PerceptionLMConfig": {"vision_config": {
        "model_type": "timm_wrapper", "architecture": "vit_pe_core_large_patch14_336",
        "model_args": {"embed_dim": 1024, "depth": 23, "img_size": [448, 448], "ref_feat_shape": [32, 32],
                       "global_pool": "", "use_post_transformer_norm": False}}},
}

# Encoder-decoder configs with no default pair on some releases (4.x: "not both `encoder` and `decoder`"): the pair
# 5.x's defaults build (ViT, BERT), by config class
_DEFAULT_PAIRS: dict[str, tuple[str, str]] = {"VisionEncoderDecoderConfig": ("vit", "bert")}


def _pair_default(config_cls: Any, pair: tuple[str, str]) -> PretrainedConfig:
    """``config_cls``'s default, or where it builds none its ``pair`` of encoder and decoder types' defaults."""
    try:
        return config_cls()
    except ValueError:
        import transformers

        mapping: Any = transformers.CONFIG_MAPPING
        decoder = mapping[pair[1]](is_decoder=True, add_cross_attention=True)
        return config_cls.from_encoder_decoder_configs(mapping[pair[0]](), decoder)


# Values a class's defaults leave None where its model needs a value, by config class; set only where the default is
# None (so where a release has a default, it stays).
_FILL_NONE: dict[str, dict[str, Any]] = {
    "Lfm2MoeConfig": {"layer_types": ["conv", "full_attention"]},  # indexed per layer
    "GraniteMoeHybridConfig": {"layers_block_type": ["mamba", "attention"]},  # indexed per layer (4.x)
    "Qwen4ExpTextConfig": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                           "indexer_compress_ratio": 4},  # divided by
    "DbrxAttentionConfig": {"clip_qkv": 8.0},  # clamped by
    "Dots1Config": {"n_shared_experts": 1},  # multiplied by
    "MllamaTextConfig": {"rope_scaling": {"rope_type": "default"}},  # read by the rotary embedding (4.x)
    "DeepseekOcr2TextConfig": {"mlp_layer_types": ["dense", "sparse"]},  # indexed per layer
    "Step3p7TextConfig": {"sliding_window": 8},  # its sliding mask is built whatever the layer types
    "DiffusionGemmaTextConfig": {"num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},  # every layer MoE
}
# M-RoPE sections the modeling code assumes where the config has none, and the 4.x rope type, by text config class:
# scaled to the tiny head like a config's own.
_MROPE: dict[str, tuple[list[int], str]] = {
    "Qwen2VLTextConfig": ([16, 24, 24], "mrope"), "Qwen2_5_VLTextConfig": ([16, 24, 24], "mrope"),
    "Qwen2_5OmniTextConfig": ([16, 24, 24], "mrope"), "Qwen3VLTextConfig": ([24, 20, 20], "default"),
    "Qwen3VLMoeTextConfig": ([24, 20, 20], "default"), "Glm4vTextConfig": ([8, 12, 12], "default"),
    "Glm4vMoeTextConfig": ([8, 12, 12], "default"), "GlmImageTextConfig": ([8, 12, 12], "default"),
    "GlmOcrTextConfig": ([8, 12, 12], "default"), "PaddleOCRTextConfig": ([16, 24, 24], "default"),
    # ERNIE-4.5-VL's sections are [h, w, t] (h and w interleaved: equal)
    "Ernie4_5_VLMoeTextConfig": ([22, 22, 20], "default"), "Ernie4_5_VL_MoeTextConfig": ([22, 22, 20], "default"),
    # HunYuan-VL's XD-RoPE: four axes (its checkpoints' xdrope_section; the default config names none)
    "HunYuanVLTextConfig": ([16, 16, 16, 16], "default"),
}
# VQ image tokenizers' vocabulary maps (the tokenizer's names of the codes, which the model parses), by config class:
# the vq config's codebook-size field, the name of code i, the special names the model reads besides "<image>"
_CODE_NAMES: dict[str, tuple[str, Callable[[int], str], tuple[str, ...]]] = {
    # code 12 is "IMGIMGBCZ": its digits as the letters A-J
    "ChameleonConfig": ("num_embeddings", lambda i: "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(i)) + "Z",
                        ()),
    "Emu3Config": ("codebook_size", lambda i: f"<|visual token {i:06d}|>", ("<|extra_200|>",)),  # the row end
}
# Switches to the stock code path that runs on CPU, wherever a config has them.
_FLAGS: dict[str, Any] = {"use_mamba_kernels": False}

# Calls a model needs before its first forward, by type.
_AFTER_BUILD: dict[str, Callable[[Any], None]] = {
    "xmod": lambda model: model.set_default_language(model.config.languages[0]),  # adapters are per language
    # its reversible layers' backward asserts train mode (every dropout is 0 in the tiny config)
    "reformer": lambda model: model.train(),
}


class TinyModelError(TfcompatError, ValueError):
    """A model type that tfcompat cannot make tiny from its config class."""


def model_types(kind: Kind = "causal_lm") -> list[str]:
    """The model types the installed transformers maps to a model class of this kind, sorted."""
    return sorted(_mapping(kind))


def model_class_name(model_type: str, kind: Kind = "causal_lm") -> str:
    """The name of the class transformers' auto mapping of this kind builds for `model_type`."""
    mapping = _mapping(kind)
    if model_type not in mapping:
        raise _error(model_type, f"transformers has no {kind} model for this type",
                     supported=f"{len(mapping)} {kind} types: see tfcompat.tiny_models.model_types({kind!r})")
    name = mapping[model_type]
    return name if isinstance(name, str) else name[0]


def attention_implementations(model_type: str, kind: Kind = "causal_lm") -> tuple[str, ...]:
    """The stock attention implementations of the mapped class that run on CPU: eager, and sdpa where it has one."""
    import transformers

    cls = getattr(transformers, model_class_name(model_type, kind), None)
    return ("eager", "sdpa") if getattr(cls, "_supports_sdpa", False) else ("eager",)


def tiny_config(model_type: str, kind: Kind = "causal_lm") -> PretrainedConfig:
    """The config of `model_type` with every size shrunk (hidden 64, 4 heads of 16, vocab 256, few layers).

    The config class is the one the mapped model class takes (`Qwen3_5ForCausalLM` takes the text config of
    `qwen3_5`, not the composite one `CONFIG_MAPPING` names).
    """
    config_cls = _config_class(model_type, kind)
    try:
        pair = _DEFAULT_PAIRS.get(config_cls.__name__)
        default = config_cls(**_DEFAULT_SUBS.get(config_cls.__name__, {})) if pair is None else _pair_default(
            config_cls, pair)
        vision_cls = (getattr(config_cls, "sub_configs", None) or {}).get("vision_config")
        if kind == "image_text_to_text" and vision_cls is not None and getattr(default, "vision_config", 0) is None:
            default = config_cls(**{"vision_config": vision_cls()})  # an optional tower (Gemma 4): an image needs one
    except Exception as exc:  # noqa: BLE001 -- any failure of a foreign constructor is the reason to report
        raise _error(model_type, f"{config_cls.__name__} does not build from its own defaults", cause=exc) from None
    tiny = _shrunk(model_type, default, _token_map(default), base={})
    return _with_vocabulary_map(_with_placeholders(tiny, read=True))


def shrunk_config(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of ``config`` with its sizes shrunk as `tiny_config` shrinks a class's defaults and every other field
    kept (see the module docstring); ``config`` itself is left as it is."""
    try:
        tiny = _shrunk(config.model_type, config, _token_map(config), base=config.to_diff_dict(), own=True)
        return _with_vocabulary_map(_with_placeholders(tiny))
    except TinyModelError:
        raise
    except Exception as exc:  # noqa: BLE001 -- any failure of a foreign config class is the reason to report
        raise _error(config.model_type, f"{type(config).__name__} does not shrink", cause=exc) from None


def tiny_model(
    model_type: str, kind: Kind = "causal_lm", *, attn_implementation: str = "sdpa", seed: int = 0,
    config: PretrainedConfig | None = None,
) -> torch.nn.Module:
    """A tiny random fp32 model of `model_type` in eval mode (`_AFTER_BUILD` says where not), seeded; `(config,
    class)` as transformers maps them. config: the one to build (a `tiny_config` with fields changed; default
    `tiny_config(model_type, kind)`)."""
    import transformers

    cls = getattr(transformers, model_class_name(model_type, kind))
    return _built(model_type, cls, tiny_config(model_type, kind) if config is None else config, attn_implementation,
                  seed)


def tiny_copy(model: torch.nn.Module, config: PretrainedConfig | None = None, *, attn_implementation: str = "sdpa",
              seed: int = 0) -> torch.nn.Module:
    """A tiny random fp32 model of ``model``'s class, built as `tiny_model` builds one, from ``config`` (default:
    `shrunk_config` of ``model``'s config); ``model`` is only read."""
    own: Any = model.config  # a transformers PreTrainedConfig
    return _built(own.model_type, type(model), shrunk_config(own) if config is None else config, attn_implementation,
                  seed)


def _built(model_type: str, cls: Any, config: PretrainedConfig, attn_implementation: str, seed: int
           ) -> torch.nn.Module:
    import torch

    torch.manual_seed(seed)
    try:
        model = cls._from_config(config, attn_implementation=attn_implementation)
    except Exception as exc:  # noqa: BLE001
        towers = _eager_towers(config, attn_implementation)
        if towers is None:
            raise _error(model_type, f"{cls.__name__} does not build from the tiny config", cause=exc) from None
        try:
            torch.manual_seed(seed)
            model = cls._from_config(config, attn_implementation=towers)
        except Exception:  # noqa: BLE001 -- the first failure says why
            raise _error(model_type, f"{cls.__name__} does not build from the tiny config", cause=exc) from None
    with torch.no_grad():  # zero-initialized weights (gemma3's projector, gpt-oss' sinks) would make a path vacuous
        for p in model.parameters():
            if p.is_floating_point() and not p.any():
                p.normal_(0.0, 0.02)
    model = model.float().eval()
    _AFTER_BUILD.get(model_type, lambda m: None)(model)
    _mark_written_images(model)
    return model


def requires_images(model: torch.nn.Module) -> bool:
    """Whether ``model``'s stock forward runs no text alone: it requires ``pixel_values`` by its signature (BLIP-2),
    or raises asking for them given text alone (Kosmos-2: ``You have to specify either pixel_values or
    image_embeds``; one forward of two tokens, no gradients)."""
    import inspect

    import torch

    param = inspect.signature(model.forward).parameters.get("pixel_values")
    if param is None:
        return False
    if param.default is inspect.Parameter.empty:
        return True
    config: Any = model.config  # a transformers PreTrainedConfig
    ids = torch.tensor([[i for i in range(config.get_text_config().vocab_size) if i not in special_token_ids(config)
                         ][:2]])
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    except ValueError as exc:
        return "pixel_values" in str(exc)
    except Exception:  # noqa: BLE001 -- any other failure is not the forward asking for images
        return False
    return False


def _mark_written_images(model: torch.nn.Module) -> None:
    """A model given where to write its images by a mask (Kosmos-2's ``image_embeds_position_mask``, `_image_mask`)
    names no placeholder id: ``config.image_token_id`` (which such a model does not read) gets a free id of the tiny
    vocab, so that the zoo's rows mark the image's tokens with it and sampled text avoids it."""
    config: Any = model.config
    if _image_mask(model) is None or _image_token_id(config) is not None:
        return
    used = special_token_ids(config)
    config.image_token_id = next(i for i in range(config.get_text_config().vocab_size - 1, -1, -1) if i not in used)


def _image_mask(model: torch.nn.Module) -> str | None:
    """The forward's one ``*_position_mask`` parameter, where the text model writes the image features at the
    tokens it marks (Kosmos-2's ``image_embeds_position_mask``); None for none."""
    import inspect

    names = [n for n in inspect.signature(model.forward).parameters if n.endswith("_position_mask")]
    return names[0] if len(names) == 1 else None


def _eager_towers(config: PretrainedConfig, attn_implementation: str) -> dict[str, str] | None:
    """``attn_implementation`` for the model and its text config, eager for its other sub-configs (Apertus 1.5's
    tokenizers offer no sdpa though the composite class does): the implementation the reference is about reaches the
    language model. None where that changes nothing (eager, or no sub-config besides the text config)."""
    subs = _sub_configs(config)
    text = config.get_text_config()
    towers = {name: "eager" for name, sub in subs.items() if sub is not text}
    if attn_implementation == "eager" or not towers:
        return None
    return {"": attn_implementation, **{name: attn_implementation for name, sub in subs.items() if sub is text},
            **towers}


def sample_examples(model: torch.nn.Module, lengths: tuple[int, ...], images: bool = False, seed: int = 0
                    ) -> list[dict[str, torch.Tensor]]:
    """One forward's inputs per sequence: ``input_ids (1, L_i)`` of random text tokens (no special id) for each of
    ``lengths``; images: the first and last hold one image each (`tiny_image`, after their third token, with
    ``mm_token_type_ids`` where the forward takes them), the others are text only (or each holds one, where the
    forward requires pixel values)."""
    import inspect

    import torch

    config: Any = model.config  # a transformers PreTrainedConfig
    allowed = torch.tensor(sorted(set(range(config.get_text_config().vocab_size)) - special_token_ids(config)))
    gen = torch.Generator().manual_seed(seed)
    examples: list[dict[str, Any]] = [
        {"input_ids": allowed[torch.randint(len(allowed), (n,), generator=gen)][None]} for n in lengths]
    # a text model the image-text-to-text mapping lists (5.24's Mistral 4) takes text alone
    images = images and (getattr(config, "vision_config", None) is not None or _image_token_id(config) is not None)
    required = requires_images(model)  # BLIP-2, Kosmos-2 run no text alone
    for i in (range(len(lengths)) if required else sorted({0, len(lengths) - 1})) if images else ():
        image = tiny_image(model, seed=i)
        ids = examples[i]["input_ids"]  # (1, L): text, the image's placeholders, text
        run = torch.tensor([[image.token_id] * image.tokens], dtype=torch.long)  # (1, 0) for a prepended image
        examples[i] = {"input_ids": torch.cat([ids[:, :3], run, ids[:, 3:]], 1), **image.inputs}
        if image.per_token is not None:  # where in the row the image sits (Mllama's cross-attention mask)
            examples[i].update(image.per_token(examples[i]["input_ids"]))
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:  # 1 at an image's tokens, as its
            # processor returns them (5.x M-RoPE forwards number images only with them)
            examples[i]["mm_token_type_ids"] = (examples[i]["input_ids"] == image.token_id).long()
    return examples


def encoder_decoder_examples(model: torch.nn.Module, lengths: tuple[int, ...], seed: int = 0
                             ) -> list[dict[str, torch.Tensor]]:
    """One forward's inputs per sequence of an encoder-decoder vision-language model: ``decoder_input_ids (1, L_i)``
    (``input_ids`` where the forward takes no decoder ids: BLIP) of random text tokens (no special id) for each of
    ``lengths``, each sequence with its own image (`tiny_image`'s where the config names an image placeholder, else
    one ``(1, C, S, S)`` image of the encoder's size); where the encoder reads a prompt around the image's
    placeholders (Florence-2), ``input_ids (1, P_i)`` of prompts of different lengths, with their
    ``attention_mask``."""
    import inspect

    import torch

    config: Any = model.config
    decoder = getattr(config, "decoder", None) or config.get_text_config()
    allowed = torch.tensor(sorted(set(range(decoder.vocab_size)) - special_token_ids(config)))
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> torch.Tensor:
        return allowed[torch.randint(len(allowed), (n,), generator=gen)][None]  # (1, n)

    params = inspect.signature(model.forward).parameters
    # the decoder's ids: decoder_input_ids, or input_ids where the forward takes no others (BLIP's text decoder)
    key = "decoder_input_ids" if "decoder_input_ids" in params else "input_ids"
    prompts = key != "input_ids" and "input_ids" in params and _image_token_id(config) is not None
    vision = getattr(config, "encoder", None) or _image_tower_config(config)
    if vision is None:
        raise _error(config.model_type, "the config names no encoder or vision config")
    examples = []
    for i, n in enumerate(lengths):
        example: dict[str, Any] = {key: text(n)}
        if prompts:  # the image's placeholders, then a prompt of a length of its own
            image = tiny_image(model, seed=seed + i)
            ids = torch.cat([torch.full((1, image.tokens), cast(int, image.token_id)), text(2 + 2 * i)], 1)
            example.update(image.inputs, input_ids=ids, attention_mask=torch.ones_like(ids))
        else:
            layouts = [x for x in _layouts(vision, {}, torch.Generator().manual_seed(seed + i))
                       if set(x) == {"pixel_values"} and x["pixel_values"].ndim == 4]
            if not layouts:
                raise _error(config.model_type, "no (1, C, S, S) image layout fits its encoder")
            example["pixel_values"] = layouts[0]["pixel_values"]
        examples.append(example)
    return examples


class TinyImage(NamedTuple):
    """One fake image for a tiny vision-language model: the image kwargs of its forward and the placeholder run.

    inputs: `pixel_values` (and `image_grid_thw` / `image_sizes` where the model takes them), batch of one image.
    token_id: the placeholder token id; tokens: how many placeholders the image fills in `input_ids`.
    token_id None (and no tokens): the model places the image itself, at no placeholder (GIT prepends it to the row).
    per_token: the inputs that depend on where the image sits in a row, from the row's ``input_ids (1, L)`` (a model
    whose text model cross-attends to the image: Mllama's ``cross_attention_mask``, which tokens see which tiles);
    None where there are none.
    """

    inputs: dict[str, torch.Tensor]
    token_id: int | None
    tokens: int
    per_token: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None


def tiny_image(model: torch.nn.Module, seed: int = 0) -> TinyImage:
    """A random image in the patch layout `model` expects, found by trying the layouts transformers' VLMs use.

    Layouts, in order: flattened patches with a `(1, 3)` `image_grid_thw` (Qwen2-VL style, `(t*h*w, C*tp*p*p)`) or
    a `(1, 2)` `image_grid_hw`; one `(1, C, S, S)` image (with `image_sizes` where the forward takes them);
    `(1, 1, C, S, S)` (Idefics3 style). The forward's and `get_image_features`' parameters say which apply.
    The placeholder count is what `get_image_features` returns, in rows of the text hidden size.
    """
    import functools
    import inspect

    import torch

    config: Any = model.config
    token_id = _image_token_id(config)
    kind = "image"
    if token_id is None and _video_token_id(config) is not None:  # a video model whose pixel values are frames
        token_id, kind = _video_token_id(config), "video"  # (InstructBLIP-Video): a one-frame video is the image
    vision = _image_tower_config(config)
    candidates = _feature_functions(model, kind)
    features = candidates[0] if candidates else None
    if token_id is None and vision is not None and features is None and "pixel_values" in inspect.signature(
            model.forward).parameters:
        return _prepended(model, _layouts(vision, {}, torch.Generator().manual_seed(seed)))
    if token_id is None or vision is None:
        raise _error(config.model_type, "the config names no image token id or no vision config")
    cross = _cross_states(config)
    if features is None and cross is not None:
        return _cross_image(model, cross, token_id, _layouts(vision, inspect.signature(model.forward).parameters,
                                                              torch.Generator().manual_seed(seed)))
    if features is None:
        raise _error(config.model_type, "the model has no get_image_features")
    hidden = config.get_text_config().hidden_size
    # what the forward or the feature function names (a forward taking **kwargs may name no image kwarg itself)
    params = {**inspect.signature(model.forward).parameters, **inspect.signature(features).parameters}
    g = torch.Generator().manual_seed(seed)
    layouts = _layouts(vision, params, g)
    for name in params:  # a second tower's image where its config names one (`high_res_pixel_values` for the
        tower = getattr(config, name.removesuffix("pixel_values") + "vision_config", None)  # SAM tower of
        if name.endswith("_pixel_values") and tower is not None:  # DeepSeek-VL hybrid), of that tower's size
            size = _image_size(tower)
            channels = getattr(tower, "num_channels", 3)
            layouts = [{**layout, name: torch.randn(*layout["pixel_values"].shape[:-3], channels, size, size,
                                                    generator=g)} for layout in layouts]
    for name in params:  # a sub-model's own text the tower reads (InstructBLIP's Q-Former instruction), with its mask
        vocab = getattr(getattr(config, name.removesuffix("input_ids") + "config", None), "vocab_size", None)
        if name.endswith("_input_ids") and isinstance(vocab, int):
            ids = torch.randint(vocab, (1, 5), generator=g)
            mask = {name.removesuffix("input_ids") + "attention_mask": torch.ones_like(ids)}
            layouts = [{**layout, name: ids, **{k: v for k, v in mask.items() if k in params}} for layout in layouts]
    first = _unpacks_features(model, kind)
    failures: list[TinyModelError] = []
    for fn in candidates:  # the model's own first; the one its forward reaches where the model's does not run
        try:
            image = _first_fit(config.model_type, kind, fn, layouts, hidden, token_id,
                               functools.partial(_required_from_config, fn, config), first=first)
            break
        except TinyModelError as exc:
            failures.append(exc)
    else:
        raise failures[0]
    written = _image_mask(model)
    if written is None:
        return image
    return image._replace(per_token=lambda ids: {written: (ids == token_id).long()})  # (1, L): 1 at the image's tokens


def tiny_video(model: torch.nn.Module, seed: int = 0) -> TinyImage:
    """A random two-frame video for a tiny vision-language model whose forward takes ``pixel_values_videos``, found
    by trying layouts as `tiny_image` does: ``(1, 2, C, S, S)`` frames (LLaVA-NeXT-Video, LLaVA-OneVision), then
    flattened patches with a ``(1, 3)`` ``video_grid_thw`` of ``t = 2``. The placeholder count is what
    ``get_video_features`` returns, in rows of the text hidden size."""
    import inspect

    import torch

    config: Any = model.config
    token_id = _video_token_id(config)
    vision = getattr(config, "vision_config", None)
    features = getattr(model, "get_video_features", None) or getattr(getattr(model, "model", None),
                                                                    "get_video_features", None)
    if token_id is None or vision is None or features is None:
        raise _error(config.model_type, "the model takes no videos (no video token id, vision config or "
                     "get_video_features)")
    params = inspect.signature(model.forward).parameters
    g = torch.Generator().manual_seed(seed)
    layouts = [{"pixel_values_videos": layout["pixel_values"][:, None].expand(-1, 2, *layout["pixel_values"].shape[1:])
                .contiguous()} for layout in _layouts(vision, {}, g) if layout["pixel_values"].ndim == 4][:1]
    if "video_grid_thw" in params:
        merges = {"image_merge_sizes": None} if "video_merge_sizes" in params else {}
        for layout in _layouts(vision, {"image_grid_thw": None, **merges}, g)[:2]:
            grid = layout["image_grid_thw"] * torch.tensor([[2, 1, 1]])
            layouts.append({"pixel_values_videos": torch.cat([layout["pixel_values"]] * 2), "video_grid_thw": grid,
                            **({"video_merge_sizes": layout["image_merge_sizes"]} if merges else {})})
    return _first_fit(config.model_type, "video", features, layouts, config.get_text_config().hidden_size, token_id,
                      lambda layout: {})


def _prepended(model: torch.nn.Module, layouts: list[dict[str, Any]]) -> TinyImage:
    """The first of ``layouts`` that a model with no placeholders (GIT: the image's tokens before the text) runs on,
    as a `TinyImage` of no placeholders; the logits' extra length is the image's tokens. Raises `TinyModelError`."""
    import torch

    config: Any = model.config
    reasons = []
    ids = torch.zeros(1, 3, dtype=torch.long)  # (1, 3): any text
    for layout in layouts:
        try:
            with torch.no_grad():
                extra = model(input_ids=ids, **layout, use_cache=False).logits.shape[1] - ids.shape[1]
        except Exception as exc:  # noqa: BLE001 -- the next layout may fit
            reasons.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:120])
            continue
        if extra > 0:
            return TinyImage(layout, None, 0)
        reasons.append("the image adds no tokens to the logits")
    raise _error(config.model_type, "the config names no image token id, and no image layout adds tokens before the "
                 "text (as GIT's prepended image does)", supported="; ".join(reasons))


def _cross_states(config: Any) -> Any:
    """The derived record of the states ``config``'s model cross-attends to (`tfcompat.registry.records.CrossStates`:
    Mllama's images), None where its type has none or tfcompat does not resolve it."""
    from .registry import resolve

    try:
        v = resolve(config.model_type).entry.derived_vision
    except TfcompatError:
        return None
    return v.cross_states if v is not None else None


def _cross_image(model: torch.nn.Module, cross: Any, token_id: int, layouts: list[dict[str, Any]]) -> TinyImage:
    """The first of ``layouts`` that ``model`` runs on around one placeholder token, for a model whose text model
    cross-attends to the image's states (``cross``: `tfcompat.registry.records.CrossStates`) rather than filling
    placeholders: one placeholder, and the per-token mask over items (``cross.items``) its processor builds, each
    token from the placeholder on seeing the image's real tiles (``aspect_ratio_mask``'s, where the layout has one).
    Raises `TinyModelError`."""
    import torch

    def per_token(layout: dict[str, Any]) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
        tiles = layout.get("aspect_ratio_mask", torch.ones(1, 1, layout["pixel_values"].shape[2]))[0, 0]  # (n,)

        def mask(ids: torch.Tensor) -> dict[str, torch.Tensor]:  # (1, L) -> (1, L, 1, n)
            seen = (ids[0] == token_id).long().cumsum(0).clamp(max=1)  # (L,): 0 before the image, 1 from it on
            return {cross.items: (seen[:, None] * tiles[None].long())[None, :, None]}
        return mask

    reasons = []
    ids = torch.tensor([[1, token_id, 2]])  # (1, 3): text, the placeholder, text
    for layout in layouts:
        if layout["pixel_values"].ndim < 6:  # (1, images, tiles, C, S, S): a batch entry of tiled images
            continue
        try:
            with torch.no_grad():
                model(input_ids=ids, **layout, **per_token(layout)(ids), use_cache=False)
        except Exception as exc:  # noqa: BLE001 -- the next layout may fit
            reasons.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:120])
            continue
        return TinyImage(layout, token_id, 1, per_token(layout))
    config: Any = model.config
    raise _error(config.model_type, "no tiled image layout runs", supported="; ".join(reasons))


def _first_fit(model_type: str, kind: str, features: Callable[..., Any], layouts: list[dict[str, Any]], hidden: int,
               token_id: int, extra: Callable[[dict[str, Any]], dict[str, Any]], *, first: bool = False) -> TinyImage:
    """The first of ``layouts`` whose ``get_{kind}_features`` output is whole rows of the text hidden size; the
    placeholder count is the number of rows (of the output's first element where ``first``: `_unpacks_features`).
    Raises `TinyModelError` with every layout's reason."""
    import torch

    reasons = []
    for layout in layouts:
        try:
            with torch.no_grad():
                out = features(**layout, **extra(layout))
        except Exception as exc:  # noqa: BLE001 -- the next layout may fit
            reasons.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:120])
            continue
        if first and isinstance(out, (tuple, list)) and out:
            out = out[0]
        numel = sum(t.numel() for t in _tensors(out))
        if numel and numel % hidden == 0:
            return TinyImage(layout, token_id, numel // hidden)
        reasons.append(f"get_{kind}_features gave {numel} values, not rows of {hidden}")
    raise _error(model_type, f"no {kind} layout fits its get_{kind}_features", supported="; ".join(reasons))


def _feature_functions(model: torch.nn.Module, kind: str) -> list[Callable[..., Any]]:
    """The ``get_{kind}_features`` to count an image's placeholders with, in order: the model's own; its inner
    model's (``model.model``: the one the forward reaches, where the outer one passes it arguments it does not take,
    as 4.57's GOT-OCR2 does); the base model class's of its type (``AutoModel``'s: 4.57's ``Kosmos2Model``), bound to
    ``model`` where the model's class has none but holds every attribute that function reads (the same vision tower
    and projection, which its forward runs inline)."""
    import inspect
    import re
    import types

    import transformers
    from transformers.models.auto import modeling_auto

    name = f"get_{kind}_features"
    found = [getattr(model, name, None), getattr(getattr(model, "model", None), name, None)]
    config: Any = model.config
    base = getattr(transformers, str(modeling_auto.MODEL_MAPPING_NAMES.get(config.model_type)), None)
    unbound = getattr(base, name, None)
    if found[0] is None and isinstance(base, type) and not isinstance(model, base) and callable(unbound):
        try:
            source = inspect.getsource(unbound)
        except (OSError, TypeError):
            source = ""
        if source and all(hasattr(model, a) for a in set(re.findall(r"\bself\.(\w+)", source))):
            found.append(types.MethodType(unbound, model))
    unique: list[Callable[..., Any]] = []
    for fn in found:
        if fn is not None and fn not in unique:
            unique.append(fn)
    return unique


def _unpacks_features(model: torch.nn.Module, kind: str) -> bool:
    """Whether the forward (the model's, or its inner model's) unpacks ``get_{kind}_features`` into several names
    (4.57's Ovis2 ``image_features, visual_indicator_features = ...``, Qwen3-VL's DeepStack features): only the
    first of them fills the placeholders, the rest go elsewhere."""
    import inspect
    import re

    pattern = re.compile(rf"^\s*\w+(\s*,\s*\w+)+\s*=\s*self\.(model\.)?get_{kind}_features\(", re.MULTILINE)
    for owner in (model, getattr(model, "model", None)):
        forward = getattr(type(owner), "forward", None) if owner is not None else None
        try:
            source = inspect.getsource(forward) if forward is not None else ""
        except (OSError, TypeError):
            continue
        if pattern.search(source):
            return True
    return False


def _required_from_config(fn: Any, config: Any, given: dict[str, Any]) -> dict[str, Any]:
    """The parameters ``fn`` requires besides ``given`` that the config or its vision config holds by the same name
    (4.x Llama 4's ``vision_feature_select_strategy``); the forward passes them from there too."""
    import inspect

    holders = [config, getattr(config, "vision_config", None)]
    required = [n for n, p in inspect.signature(fn).parameters.items()
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in given]
    return {n: next(getattr(h, n) for h in holders if hasattr(h, n)) for n in required
            if any(hasattr(h, n) for h in holders)}


def _video_token_id(config: Any) -> int | None:
    return next((v for k in ("video_token_id", "video_token_index") if isinstance(v := getattr(config, k, None), int)),
                None)


def _image_tower_config(config: Any) -> Any:
    """The config that says which images the model takes: its vision tower's, its VQ image tokenizer's (Chameleon,
    Emu3), or the config itself where it names a patch size (Fuyu: patches projected linearly, no tower); or None."""
    for name in ("vision_config", "vq_config"):
        if getattr(config, name, None) is not None:
            return getattr(config, name)
    return config if isinstance(getattr(config, "patch_size", None), int) else None


def _image_token_id(config: Any) -> int | None:
    for key in ("image_token_id", "image_token_index", "image_token"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def _layouts(vision: Any, params: Any, g: Any) -> list[dict[str, Any]]:
    """The image kwargs to try, in order (see `tiny_image`)."""
    import torch

    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", None) or 3
    patch = getattr(vision, "patch_size", 8)
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    size = _image_size(vision)
    layouts = []
    if "image_token_pooling" in params and "image_grids" in params:  # crops of patches, pooled 2 x 2 into tokens by
        side = size // patch  # indices into the flat patches (Molmo2): a low-res crop's windows, a high-res crop's
        windows = torch.arange(side * side).view(side // 2, 2, side // 2, 2)  # (h/2, 2, w/2, 2) -> (h*w/4, 4)
        windows = windows.permute(0, 2, 1, 3).reshape(-1, 4)
        layouts.append({"pixel_values": torch.randn(2, side * side, channels * patch * patch, generator=g),
                        "image_token_pooling": torch.cat([windows, windows + side * side]),
                        "image_grids": torch.tensor([[side // 2] * 4]),  # [low h, low w, high h, high w]
                        **({"image_num_crops": torch.tensor([2])} if "image_num_crops" in params else {})})
    if "image_grid_thw" in params:  # flattened patches and their (t, h, w) grid (Qwen2-VL); Kimi takes them unflattened
        merge = _first_attr(vision, ("spatial_merge_size", "merge_size"), 2) or 1  # Muse Spark's names second
        merge = merge[0] if isinstance(merge, (list, tuple)) else merge
        temporal = _first_attr(vision, ("temporal_patch_size", "patch_temporal"), 1) or 1
        h, w = 2 * merge, 3 * merge
        flat = torch.randn(h * w, channels * temporal * patch * patch, generator=g)
        grid = torch.tensor([[1, h, w]])
        # the merge of each image where the forward takes it per image (VideoLLaMA3's `image_merge_sizes`)
        merges = {"image_merge_sizes": torch.tensor([merge])} if "image_merge_sizes" in params else {}
        blocks = torch.randn(h * w // merge**2, merge * patch, merge * patch, channels, generator=g)
        layouts += [{"pixel_values": flat, "image_grid_thw": grid, **merges},
                    {"pixel_values": flat.view(h * w, channels * temporal, patch, patch), "image_grid_thw": grid,
                     **merges},
                    # one merged block of patches per text token, channels last, the grid counted in tokens (Inkling 2)
                    {"pixel_values": blocks, "image_grid_thw": grid // torch.tensor([[1, merge, merge]]), **merges}]
    if "image_grid_hw" in params:  # flattened 2-D patches and their (h, w) grid (Nemotron-H Omni)
        flat = torch.randn(16, channels * patch * patch, generator=g)
        layouts.append({"pixel_values": flat, "image_grid_hw": torch.tensor([[4, 4]])})
    if "image_position_ids" in params:  # (B, N, C*p*p) patches and their (x, y) positions (Gemma 4): a square of
        side, cell = 2 * (getattr(vision, "pooling_kernel_size", 1) or 1), patch  # two pooling windows a side,
        if isinstance(getattr(vision, "model_patch_size", None), int):  # or of two already pooled patches (unified)
            side, cell = 2, vision.model_patch_size
        positions = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1)
        layouts.append({"pixel_values": torch.randn(1, side * side, channels * cell * cell, generator=g),
                        "image_position_ids": positions.reshape(1, -1, 2)})
    if "spatial_shapes" in params:  # SigLIP2 NaFlex (LFM2-VL): (B, N, C*p*p) patches, their grid, a patch mask
        layouts.append({"pixel_values": torch.randn(1, 16, channels * patch * patch, generator=g),
                        "spatial_shapes": torch.tensor([[4, 4]]), "pixel_attention_mask": torch.ones(1, 16).bool()})
    if "target_sizes" in params:  # NaViT-packed (MiniCPM-V): one entry, each patch a (C, p, p) column block along the
        side = size // patch  # last dim, (1, C, p, N * p); the image and one slice, their (h, w) grids of patches
        layouts.append({"pixel_values": torch.randn(1, channels, patch, 2 * side * side * patch, generator=g),
                        "target_sizes": torch.tensor([[side, side]] * 2, dtype=torch.int32)})
    if "aspect_ratio_ids" in params and "aspect_ratio_mask" in params:  # tiles of each image of a row (Mllama):
        tiles = getattr(vision, "max_num_tiles", 4)  # (1, 1, tiles, C, S, S), a 1 x n arrangement of n real tiles
        arrangements = [list(a) for a in getattr(vision, "supported_aspect_ratios", [[1, n] for n in range(1, 5)])]
        for n in sorted({min(2, tiles), 1}, reverse=True):  # the rest padded with zeros, as the processor pads
            if [1, n] in arrangements:
                pixels = torch.zeros(1, 1, tiles, channels, size, size)
                pixels[:, :, :n] = torch.randn(1, 1, n, channels, size, size, generator=g)
                layouts.append({"pixel_values": pixels, "aspect_ratio_ids": torch.tensor([[arrangements.index(
                    [1, n]) + 1]]), "aspect_ratio_mask": (torch.arange(tiles) < n).long()[None, None]})
    image = torch.randn(1, channels, size, size, generator=g)
    layouts += [{"pixel_values": image}, {"pixel_values": image[:, None]}]
    if "pixel_attention_mask" in params:  # tiles of an image and which are real (Granite-Docling: (B, tiles))
        layouts.append({"pixel_values": image[:, None], "pixel_attention_mask": torch.ones(1, 1, dtype=torch.bool)})
    # (B, N, C*p*p) patches of the image (Fuyu: projected linearly); (N, t, p, p, C) patches of t frames, channels
    # last, one text token each (Inkling: folded space-to-depth)
    frames = _first_attr(vision, ("temporal_patch_size",), 1) or 1
    layouts += [{"pixel_values": torch.randn(1, (size // patch) ** 2, channels * patch * patch, generator=g)},
                {"pixel_values": torch.randn(4, frames, patch, patch, channels, generator=g)}]
    if "image_sizes" in params:  # any-resolution (LLaVA-NeXT): the base image and one tile of the 32 x 32 grid
        sizes = torch.tensor([[size, size]])
        layouts += [{"pixel_values": image, "image_sizes": sizes},
                    {"pixel_values": torch.cat([image, image.flip(-1)])[None], "image_sizes": sizes}]
    return layouts


def _first_attr(config: Any, names: tuple[str, ...], default: Any) -> Any:
    """The value of the first of ``names`` that ``config`` has (one role, several spellings), else ``default``."""
    return next((getattr(config, n) for n in names if hasattr(config, n)), default)


def _image_size(vision: Any) -> int:
    """The side of the square image a vision config takes (32 where it names none)."""
    size = getattr(vision, "image_size", 32)
    size = size[0] if isinstance(size, (list, tuple)) else size
    return size if isinstance(size, int) else 32


def _tensors(out: Any) -> list[Any]:
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    for key in ("pooler_output", "last_hidden_state"):  # 5.x returns a model output; llama4 projects later
        if getattr(out, key, None) is not None:
            return _tensors(getattr(out, key))
    if getattr(out, "deepstack_features", None):  # only features injected at text layers (Granite 4 Vision): each
        return _tensors(out.deepstack_features[0][1])  # (layer, features per image) pair fills the placeholders
    return []


def _config_class(model_type: str, kind: Kind) -> type[PretrainedConfig]:
    import transformers
    from transformers import CONFIG_MAPPING

    name = model_class_name(model_type, kind)
    model_cls = getattr(transformers, name, None)
    if model_cls is None:
        raise _error(model_type, f"transformers does not export {name}")
    config_cls = getattr(model_cls, "config_class", None)
    if config_cls is None:
        try:
            config_cls = CONFIG_MAPPING[model_type]
        except KeyError:
            raise _error(model_type, "transformers has no config class for this type") from None
    return config_cls


def _mapping(kind: Kind) -> dict[str, Any]:
    from transformers.models.auto import modeling_auto

    if kind == "causal_lm":
        return dict(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if kind == "image_text_to_text":
        return dict(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    raise ValueError(f"kind must be 'causal_lm' or 'image_text_to_text', got {kind!r}")


def _error(model_type: str, what: str, *, cause: BaseException | None = None, supported: str = "") -> TinyModelError:
    while cause is not None and cause.__cause__ is not None:  # a validator's wrapper: its cause says why
        cause = cause.__cause__
    first = next((line.strip() for line in str(cause).splitlines() if line.strip()), "")
    why = f"{type(cause).__name__}: {first}"[:300] if cause else ""
    return TinyModelError(
        f"cannot build a tiny {model_type!r}: {what}", family=model_type,
        transformers_version=installed_transformers(), why=why, supported=supported,
        fix="add an entry to tfcompat.tiny_models._OVERRIDES naming what the generic shrink gets wrong",
    )


def _sub_configs(config: PretrainedConfig) -> dict[str, PretrainedConfig]:
    from transformers import PretrainedConfig

    names = set(getattr(config, "sub_configs", {}) or {})
    return {n: getattr(config, n) for n in sorted(names) if isinstance(getattr(config, n, None), PretrainedConfig)}


def special_token_ids(config: PretrainedConfig) -> set[int]:
    """Every token id the config tree names (bos, eos, pad, image, ...): sampled text avoids them."""
    found: set[int] = set()

    def collect(cfg: PretrainedConfig) -> None:
        for key, value in cfg.to_dict().items():
            if _is_token_key(key, cfg.attribute_map):
                found.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
        for sub in _sub_configs(cfg).values():
            collect(sub)

    collect(config)
    return found


def _token_map(config: PretrainedConfig) -> dict[int, int]:
    """Special token ids of the whole config tree that the tiny vocab does not hold -> distinct ids inside it."""
    found = special_token_ids(config)
    kept = {i for i in found if 0 <= i < VOCAB}
    free = (i for i in range(VOCAB - 1, -1, -1) if i not in kept)
    return {i: next(free) for i in sorted(found - kept)}


def _with_placeholders(config: PretrainedConfig, read: bool = False) -> PretrainedConfig:
    """``config`` with a free id of the tiny vocab for each image / video placeholder id it leaves None (MiniCPM-V,
    BLIP-2: the processor's tokenizer names them), and where ``read``, each its model reads and it does not declare
    (`_read_token_ids`); without one the model has no placeholder to scatter features at."""
    missing = [k for k, v in config.to_dict().items() if v is None and _is_token_key(k, config.attribute_map) and
               any(kind in k for kind in ("image", "video"))]
    # a class's defaults (not a given config, whose copy keeps its semantics): the ids its model reads undeclared
    missing += [k for k in _read_token_ids(config) if not hasattr(config, k)] if read else []
    used = special_token_ids(config)
    free = (i for i in range(VOCAB - 1, -1, -1) if i not in used)
    for key in missing:
        setattr(config, key, next(free))
    return config


def _read_token_ids(config: PretrainedConfig) -> list[str]:
    """The ids of the markers opening a vision item's run (``vision_start_token_id``, ...) the type's modeling
    module reads off its config (``self.config.<name>``), and the end marker of each, which checkpoints' config files
    carry and some config classes do not declare (4.53's Qwen2-VL: its rope index reads ``vision_start_token_id``)."""
    import importlib
    import inspect
    import re

    from .registry.derive import module_name

    try:
        source = inspect.getsource(importlib.import_module(module_name(config.model_type)))
    except (ImportError, OSError, TypeError, ValueError):
        return []
    # the markers around a vision item's run only: a placeholder id the module reads in a method its forward does not
    # call (InstructBLIP-Video's copied image mask) would turn the zoo's video model into an image one
    names = set(re.findall(r"config\.(\w*(?:image|video|vision)_start_token_id)\b", source))
    return sorted(names | {n.replace("_start_", "_end_") for n in names if "_start_" in n})  # the run's end marker


def _with_vocabulary_map(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` with the tokenizer's vocabulary map where a VQ image tokenizer's model reads one and the config
    leaves it None (`_CODE_NAMES`): ``"<image>"`` at the config's image token id, the other special names and one
    name per code of the tiny codebook at free ids of the tiny vocab (the codes' embeddings are the image features)."""
    names = _CODE_NAMES.get(type(config).__name__)
    if names is None or getattr(config, "vocabulary_map", 0) is not None:
        return config
    field, code_name, specials = names
    codes = getattr(config.vq_config, field)
    used = special_token_ids(config)
    free = (i for i in range(VOCAB - 1, -1, -1) if i not in used)
    vocabulary = {"<image>": config.image_token_id, **{name: next(free) for name in specials}}
    config.vocabulary_map = {**vocabulary, **{code_name(code): next(free) for code in range(codes)}}
    return config


def _is_token_key(key: str, attribute_map: dict[str, str]) -> bool:
    """Whether a config key holds token ids: by its name, or as the stored name of one (Molmo2's `image_patch_id`
    behind `image_token_id`)."""
    names = [key, *(alias for alias, real in attribute_map.items() if real == key)]
    return any(n.endswith(("token_id", "token_ids", "token_index")) and "vocab" not in n for n in names)


def _shrunk(model_type: str, default: PretrainedConfig, ids: dict[int, int], base: dict[str, Any],
            own: bool = False, tied: frozenset[int] = frozenset()) -> PretrainedConfig:
    """Build the tiny config of the class of `default`, sub-configs first; the fewest layers that hold every kind.

    `base` holds the values to start from: none for the top config (its class defaults), the full-size values
    for a sub-config (a parent may give its sub-configs values their class lacks, e.g. dbrx's `rope_theta`).
    own: `default` is a given config (`shrunk_config`), not a class's defaults: its per-layer patterns win over the
    class's rule and over `_OVERRIDES` (cut to the layers that hold each kind, or the override's more), its windows
    and routing are capped.
    tied: full-size hidden sizes of the config tree; a width the shrink leaves as it is (`_WIDTH_SUFFIXES`) equal to one
    of them follows to the tiny hidden size. A class that checks a width against a hidden size (no projection between
    them: WavTokenizer's ``codebook_dim``, dots3's adapters) rejects the shrink without it; the tree is shrunk again so
    only where a class of it rejects the shrink, so that a width equal to a hidden size by chance stays where nothing
    checks it.
    """
    patterns = _per_layer_patterns(default)
    subs = _sub_configs(default)
    dropped = _META | (_NOT_SEMANTIC if own else set())
    kwargs = {k: v for k, v in base.items() if k not in patterns and k not in subs and k not in dropped}
    kwargs.update(_generic_kwargs(default, ids, own))
    values = default.to_dict()
    kwargs.update({k: _SIZES["hidden_size"] for k, v in values.items() if isinstance(v, int) and v in tied
                   and kwargs.get(k, v) == v and not isinstance(v, bool) and k.endswith(_WIDTH_SUFFIXES)
                   and "position" not in k})
    for name, sub in subs.items():
        kwargs[name] = _shrunk(model_type, sub, ids, base=sub.to_diff_dict(), own=own, tied=tied)
    layers = _layers_needed(default, patterns)
    overrides = {k: v for k, v in _OVERRIDES.get(type(default).__name__, {}).items() if not own or k not in patterns}
    if own:  # a layer count the class needs (Zamba's two hybrid layers), but never fewer than the pattern's kinds
        layers = max(layers, overrides.pop("num_hidden_layers", layers))
        kwargs.update({k: kwargs.get(k, v) for k, v in patterns.items()})  # cut to `layers` below
    for key in _LAYERS:
        real = default.attribute_map.get(key, key)
        if real in default.to_dict():
            kwargs[real] = layers
    kwargs.update(overrides)
    kwargs.update(_timm_kwargs(values))
    kwargs.update({k: v for k, v in _FILL_NONE.get(type(default).__name__, {}).items() if values.get(k, None) is None})
    kwargs.update({k: v for k, v in _FLAGS.items() if k in values})
    layers = kwargs.get("num_hidden_layers", layers)
    for key in _LAYER_INDICES:  # indices of the full-size layers that are of another kind: the tiny model's last
        if isinstance(values.get(key), (list, tuple)) and key not in _OVERRIDES.get(type(default).__name__, {}):
            kwargs[key] = [layers - 1]
    depth = next((kwargs[k] for k in ("depth", *_LAYERS) if isinstance(kwargs.get(k), int)), layers)
    for key in _TAPPED_LAYERS:
        if isinstance(values.get(key), (list, tuple)) and values[key]:
            kwargs[key] = list(range(min(len(values[key]), depth)))
    for key in _LAYER_INDEX:  # the tiny tower's last layer but one (a layer runs after it); a parent's copy, which it
        # hands its sub-config, follows the sub-config holding the same key
        holder = next((kwargs[n] for n in subs if hasattr(kwargs[n], key)), None)
        if isinstance(values.get(key), int):
            kwargs[key] = max(min(values[key], getattr(holder, "num_hidden_layers", layers) - 2), 0)
    for key, value in kwargs.items():
        if key in patterns and isinstance(value, list):
            kwargs[key] = value[:layers]  # a per-layer size (gemma3n's intermediate_size), shrunk above
    if isinstance(kwargs.get("per_layer_config"), dict):
        kwargs["per_layer_config"] = {i: v for i, v in kwargs["per_layer_config"].items() if int(i) < layers}
    cls = type(default)
    if subs and not _accepts_config_objects(cls, kwargs, subs):
        kwargs.update({n: kwargs[n].to_diff_dict() for n in subs})  # 4.x composites that take dicts only
    try:
        config = cls(**kwargs)
        if all(_holds(getattr(config, k, None), v, layers) for k, v in patterns.items() if k not in kwargs):
            return config
    except Exception:  # noqa: BLE001, S110 -- retried below with the pattern given, which then names the cause
        pass
    # the class keeps a full-size pattern (a list, not a rule derived from the number of layers): give it the first
    # `layers` entries
    kwargs.update({k: v[:layers] for k, v in patterns.items() if k not in kwargs})
    try:
        return cls(**kwargs)
    except Exception as exc:  # noqa: BLE001
        hiddens = _hidden_sizes(default)
        if tied or not hiddens:
            raise _error(model_type, f"{cls.__name__} rejects the shrunk sizes", cause=exc) from None
    return _shrunk(model_type, default, ids, base, own, tied=hiddens)


def _timm_kwargs(values: dict[str, Any]) -> dict[str, Any]:
    """A timm tower's tiny fields (`_TIMM_TOWERS`) for a config whose ``values`` name its timm ``architecture``: its
    ``model_args`` (the config's own, the tiny ones over them), ``hidden_size`` where it has one, ``image_size``;
    nothing for another config or an architecture the table lacks."""
    tower = _TIMM_TOWERS.get(str(values.get("architecture"))) if "model_args" in values else None
    if tower is None:
        return {}
    args = dict(tower.args)
    if "block_args" in args:  # timm's block strings -> its per-stage lists of block kwargs (plain values)
        try:
            from timm.models._efficientnet_builder import decode_arch_def  # type: ignore[import-not-found,unused-ignore]
        except ImportError:  # without timm the tower does not build anyway: the model build names that
            return {}
        args["block_args"] = decode_arch_def(args["block_args"])
    width = {"hidden_size": tower.width} if "hidden_size" in values else {}
    return {"model_args": {**(values["model_args"] or {}), **args}, **width, "image_size": tower.image}


def _hidden_sizes(config: PretrainedConfig) -> frozenset[int]:
    """The full-size hidden sizes of ``config`` and of every sub-config in its tree."""
    own = getattr(config, "hidden_size", None)
    subs = (_hidden_sizes(sub) for sub in _sub_configs(config).values())
    return frozenset({own} if isinstance(own, int) and not isinstance(own, bool) else ()).union(*subs)


_WIDTH_SUFFIXES = ("_dim", "_channels", "_width", "hidden_size", "input_size", "output_size")


def _holds(pattern: Any, default: list[Any], layers: int) -> bool:
    """Whether a tiny per-layer pattern has one entry per layer and every kind the full-size one has."""
    return isinstance(pattern, (list, tuple)) and len(pattern) == layers and {repr(k) for k in pattern} == {
        repr(k) for k in default}


def _accepts_config_objects(cls: type, kwargs: dict[str, Any], subs: dict[str, Any]) -> bool:
    """Whether `cls` keeps sub-configs given as config objects (some 4.x composites take dicts and drop objects)."""
    try:
        built = cls(**{n: kwargs[n] for n in subs})
    except (TypeError, AttributeError):
        return False
    except Exception:  # noqa: BLE001 -- other complaints are about the sizes, not the sub-configs
        return True
    return all(getattr(built, n, None) is not None for n in subs)


def _generic_kwargs(config: PretrainedConfig, ids: dict[int, int], own: bool = False) -> dict[str, Any]:
    values = config.to_dict()
    derived = {k for k in values if isinstance(getattr(type(config), k, None), property)}  # falcon's head_dim
    kwargs = _sizes({k: v for k, v in values.items() if k not in derived}, config.attribute_map)
    for key, cap in _AT_MOST.items():
        if isinstance(values.get(key), int):
            kwargs[key] = min(values[key], cap)
    if own:
        kwargs.update(_own_kinds(values, kwargs, config.attribute_map))
    mrope = _MROPE.get(type(config).__name__)
    for key in ("rope_parameters", "rope_scaling"):
        rope = values.get(key, 0)
        if rope is None and key == "rope_scaling" and mrope is not None and "rope_parameters" not in values:
            rope = {"type": mrope[1], "rope_type": mrope[1]}  # 4.x: M-RoPE is read from rope_scaling
        sections = rope.get("mrope_section", mrope and mrope[0]) if isinstance(rope, dict) else None
        if isinstance(rope, dict) and isinstance(sections, list):
            kwargs[key] = {**rope, "mrope_section": _mrope_sections(sections, {**values, **rope})}
        elif isinstance(rope, dict) and _rope_factors(rope, values) != rope:
            kwargs[key] = _rope_factors(rope, values)
    offsets = sorted((v, k) for k, v in values.items() if k.endswith("_token_offset") and isinstance(v, int))
    kwargs.update({k: _CODE_IDS + i * _SIZES["codebook_size"] for i, (_, k) in enumerate(offsets)})
    for key, value in values.items():
        if key == "per_layer_config" and isinstance(value, dict):
            # per-layer overrides keyed by layer index: the same sizes (the index is cut to the tiny layers later)
            kwargs[key] = {i: {**layer, **_sizes(layer, {})} for i, layer in value.items()}
        elif ("dropout" in key or "pdrop" in key or key.endswith("layerdrop")) and isinstance(value, float):
            kwargs[key] = 0.0
        elif key == "initializer_range" and isinstance(value, float) and value < 1e-3:
            kwargs[key] = 0.02  # SAM towers' 1e-10: their random weights would make every image alike
        elif _is_token_key(key, config.attribute_map) and value is not None:
            kwargs[key] = [ids.get(v, v) for v in value] if isinstance(value, list) else ids.get(value, value)
    return kwargs


def _own_kinds(values: dict[str, Any], kwargs: dict[str, Any], attribute_map: dict[str, str]) -> dict[str, Any]:
    """`shrunk_config`'s changes to the tiny sizes in ``kwargs``: windows and routing capped at the config's own
    ``values``, and as many key/value heads as query heads (multi-head) or one (multi-query) where the config has."""
    out: dict[str, Any] = {}
    for key in _CAPPED_OWN:
        real = attribute_map.get(key, key)
        if isinstance(values.get(real), int) and isinstance(kwargs.get(real), int):
            out[real] = min(values[real], kwargs[real])
    heads, kv = (attribute_map.get(k, k) for k in ("num_attention_heads", "num_key_value_heads"))
    if isinstance(values.get(heads), int) and isinstance(values.get(kv), int) and "kv_lora_rank" not in values:
        if values[kv] == values[heads]:
            out[kv] = _SIZES["num_attention_heads"]
        elif values[kv] == 1:
            out[kv] = 1
    return out


def _rope_factors(rope: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """``rope`` (or each of its per-layer-type dicts) with longrope's per-frequency ``short_factor`` / ``long_factor``
    resampled to the tiny head's rotary frequencies (head_dim 16 times the rotary fraction, halved)."""
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return {k: _rope_factors(v, values) for k, v in rope.items()}
    fraction = rope.get("partial_rotary_factor") or values.get("partial_rotary_factor") or 1.0
    n = int(_SIZES["head_dim"] * fraction) // 2
    return {**rope, **{k: [v[i * len(v) // n] for i in range(n)] for k, v in rope.items()
                       if k in ("short_factor", "long_factor") and isinstance(v, list) and v and len(v) != n}}


def _mrope_sections(sections: list[int], values: dict[str, Any]) -> list[int]:
    """M-RoPE's (t, h, w) split of the tiny head's rotary frequencies
    (head_dim 16, or qk_rope_head_dim 8 where the config has one, times the rotary fraction, halved)."""
    # the rotary part of the head: MLA rotates qk_rope_head_dim only (HunYuan-VL v4)
    rotary = _SIZES["qk_rope_head_dim"] if isinstance(values.get("qk_rope_head_dim"), int) else _SIZES["head_dim"]
    total = max(len(sections), round(rotary * values.get("partial_rotary_factor", 1.0) / 2))
    scaled = [max(1, s * total // sum(sections)) for s in sections]
    scaled[-1] += total - sum(scaled)
    return scaled


def _sizes(values: dict[str, Any], attribute_map: dict[str, str]) -> dict[str, Any]:
    """The `_SIZES` of the keys `values` has (`attribute_map` names their stored keys), with the MLA rules."""
    kwargs: dict[str, Any] = {}
    for key, size in _SIZES.items():
        real = attribute_map.get(key, key)
        value = values.get(real, 0.5)  # 0.5: absent
        if value == 0 and not isinstance(value, bool):
            continue  # a role that is off stays off (GLM-5 Next's NoPE indexed attention: qk_rope_head_dim 0)
        if (isinstance(value, int) and not isinstance(value, bool)) or (value is None and key in _DERIVED):
            kwargs[real] = size
        elif isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            kwargs[real] = [size] * len(value)  # one size per layer
    if isinstance(values.get("qk_rope_head_dim"), int) and values.get("head_dim") == values["qk_rope_head_dim"]:
        kwargs["head_dim"] = _SIZES["qk_rope_head_dim"]  # MLA: `head_dim` names the rotary part of q and k
    elif isinstance(values.get("qk_rope_head_dim"), int) and isinstance(values.get("qk_nope_head_dim"), int) and (
            values.get("head_dim") == values["qk_rope_head_dim"] + values["qk_nope_head_dim"]):
        kwargs["head_dim"] = _SIZES["qk_head_dim"]  # or the whole q/k head (dots3's sliding layers)
    channels = values.get("downsample_channels")
    if isinstance(channels, list) and channels and all(isinstance(c, int) for c in channels):
        # a SAM neck's downsampling convolutions whose last feeds the next tower (DeepSeek-OCR 2's encoder, Unlimited
        # OCR's CLIP) at its hidden size: halving up to the tiny hidden size (full size [512, 896] / [512, 1024])
        kwargs["downsample_channels"] = [_SIZES["hidden_size"] >> (len(channels) - 1 - i) for i in range(len(channels))]
    if "kv_lora_rank" in values and "num_key_value_heads" in values:
        kwargs["num_key_value_heads"] = _SIZES["num_attention_heads"]  # MLA expands K and V to every head
    return kwargs


def _per_layer_patterns(config: PretrainedConfig) -> dict[str, list[Any]]:
    """The config's lists with one entry per layer (`layer_types`, `no_rope_layers`, ...)."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 2:
        return {}
    return {k: list(v) for k, v in config.to_dict().items()
            if isinstance(v, (list, tuple)) and len(v) == layers and k not in _NOT_PATTERNS}


_NOT_PATTERNS = {"architectures"}
_META = {"model_type", "transformers_version", "architectures"}


def _layers_needed(config: PretrainedConfig, patterns: dict[str, list[Any]]) -> int:
    """Two layers, or the shortest prefix of every per-layer pattern that holds each of its kinds."""
    needed = 2
    for pattern in patterns.values():
        firsts: dict[str, int] = {}
        for i, kind in enumerate(pattern):
            firsts.setdefault(repr(kind), i)
        needed = max(needed, max(firsts.values()) + 1)
    for key in ("first_k_dense_replace", "num_dense_layers"):
        if isinstance(getattr(config, key, None), int) and getattr(config, key) > 0:
            needed = max(needed, 2)
    return min(needed, _MAX_LAYERS)
