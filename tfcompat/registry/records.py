"""The registry's records: what a family looks like inside one transformers range (`Entry`), and a family
(`Family`: its entries and helpers). Family tables import this module only; nothing here imports
transformers, the lookup (`tfcompat.registry`) or the probing (`tfcompat.probing`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from . import versions

__all__ = [
    "TEXT_MODULE_ROLES", "TEXT_ROLES", "AttentionCall", "CacheKwarg", "CrossStates", "Derivation",
    "EncoderDecoderDerivation", "Entry", "Family",
    "LinearAttention", "LinearProjections", "MixerCall", "MixerRole", "RopeConfigKey", "Rotary", "RotaryLayout",
    "TextModelLayout", "VisionDerivation", "VisionItem", "VisionOutput", "VisionTower",
]

RotaryLayout = Literal["sectioned", "folded"]
RopeConfigKey = Literal["rope_scaling", "rope_parameters"]
TextModelLayout = Literal["mrope", "text+mrope", "text"]
CacheKwarg = Literal["past_key_value", "past_key_values", "cache", "layer_past"]
LinearProjections = Literal["qkv_z_b_a", "qkvz_ba"]
# what a per-sequence token mixer's forward parameter is (`MixerCall`)
MixerRole = Literal["tokens", "state", "per_token", "cache_position", "position_embeddings", "no_cache", "flag",
                    "none", "mask", "key_bias", "per_layer", "encoder", "per_token_lead", "row_prefix"]
# a vision item of a test/self-check sequence: ("image" | "video", (t, h, w) patch grid before the merge)
VisionItem = tuple[Literal["image", "video"], tuple[int, int, int]]
VisionOutput = Literal["tensors", "model_output"]
# the roles of the text model's own classes (in `Entry.text_module` where the text model comes from another module)
TEXT_ROLES = ("attention", "rotary", "text_model", "decoder_layer")
# the roles `Entry.text_module` holds: the text roles, a hybrid text model's linear-attention class and a decoder's
# cross-attention class of its own (BERT's)
TEXT_MODULE_ROLES = (*TEXT_ROLES, "linear_attention", "cross_attention")


@dataclass(frozen=True)
class Rotary:
    """How the attention applies rotary in one range.

    apply: the module function the attention calls. layout: "sectioned" = the rotary embedding returns
    ``(3, B, L, D)`` cos/sin and ``apply`` takes ``mrope_section``; "folded" = sectioning happens inside the
    embedding, ``(B, L, D)``. marker: an attribute of the rotary class only this range has (a layout check).
    """

    apply: str
    layout: RotaryLayout
    marker: str | None = None


@dataclass(frozen=True)
class VisionTower:
    """Where the vision tower lives and what it hands the text model.

    owner: the role in `Entry.classes` whose instance holds the tower at ``attr`` and owns
        ``get_image_features`` / ``get_video_features`` and ``get_rope_index``.
    output: what ``get_image_features`` returns: "tensors" = per-item feature tensors (a tuple; with
        ``deepstack``: ``(features, deepstack list)``), "model_output" = an output whose ``pooler_output``
        holds them (and ``deepstack_features`` with ``deepstack``).
    deepstack: the tower also returns intermediate-layer features that the text model adds to the hidden
        states of its first decoder layers at the visual tokens (Qwen3-VL's DeepStack): the text model then
        takes ``visual_pos_masks`` and ``deepstack_visual_embeds`` besides the input embeddings.
    """

    owner: str = "model"
    attr: str = "visual"
    output: VisionOutput = "tensors"
    deepstack: bool = False


@dataclass(frozen=True)
class LinearAttention:
    """A family's linear-attention (Gated DeltaNet) layers in one range; a patch replaces their forward with
    `tfcompat.hf_linear_attention`'s, which runs `tfcompat.linear_attention` over the packed sequences.

    The module class is ``Entry.classes["linear_attention"]``; it holds ``num_k_heads``, ``num_v_heads``,
    ``head_k_dim``, ``head_v_dim``, ``conv1d``, ``activation``, ``A_log``, ``dt_bias``, ``norm``, ``out_proj``.
    attr: the decoder layer's attribute holding it (the softmax layers hold ``Entry.classes["attention"]``).
    projections: how it projects the hidden states: "qkv_z_b_a" = ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
        ``in_proj_a`` (Qwen3.5); "qkvz_ba" = ``in_proj_qkvz`` and ``in_proj_ba``, split per key-head group by its
        ``fix_query_key_value_ordering`` (Qwen3-Next).
    layer_forwards_kwargs: the decoder layer passes ``**kwargs`` on to it (else a pre-hook hands it the context);
        its stock forward takes ``**kwargs`` exactly then (probed).
    """

    attr: str = "linear_attn"
    projections: LinearProjections = "qkv_z_b_a"
    layer_forwards_kwargs: bool = True


@dataclass(frozen=True)
class AttentionCall:
    """What an attention class's forward passes to the attention function it takes from transformers'
    ``ALL_ATTENTION_FUNCTIONS`` (read from its source by `tfcompat.registry.derive`).

    cls: the attention class name. keywords: ``(keyword, source expression)`` of each keyword argument, in order.
    passes_kwargs: the call passes the forward's ``**kwargs`` on. row_positions: one entry per place where the
    forward computes with positions counted over the row (``cache_position``, ``torch.arange``) rather than with
    ``position_ids``: the ``if`` tests guarding it (source, joined with ``and``), "" when unguarded.
    positional: how many arguments it passes by position (module, query, key, value, attention_mask: 5).
    mask: the source expression it passes as the attention mask ("" when none).
    """

    cls: str
    keywords: tuple[tuple[str, str], ...]
    passes_kwargs: bool
    row_positions: tuple[str, ...] = ()
    positional: int = 5
    mask: str = "attention_mask"

    def describe(self) -> str:
        args = [f"{k}={v}" for k, v in self.keywords] + (["**kwargs"] if self.passes_kwargs else [])
        return f"{self.cls} -> attention_interface(module, q, k, v, mask, {', '.join(args)})"


@dataclass(frozen=True)
class MixerCall:
    """A token mixer other than softmax attention (state space, convolution, recurrence, linear attention) that a
    patch runs once per sequence of a packed row (`tfcompat.hf.mixers`), read from its forward's signature and
    source by `tfcompat.registry.mixers`.

    cls: the mixer class name. params: ``(parameter, role)`` of its forward after ``self``, in order. Roles:
    "tokens" = the hidden states ``(B, L, D)``, split at the boundaries; "state" = a cache, None per sequence (fresh
    state); "per_token" = a tensor ending in the token dims ``(..., B, L)`` (masks, position or input ids) or None,
    sliced per sequence; "cache_position" = ``arange`` restarting at 0 per sequence; "position_embeddings" = a tuple
    of ``(B, L, D)`` tensors, sliced; "no_cache" = a use-cache flag, False; "flag" = a non-tensor option, unchanged;
    "none" = transformers' own packing index (``seq_idx``), which a packed forward through tfcompat leaves None;
    "mask" = a mask (or bias) the model built for the packed row: ``(B, L)`` sliced per token, ``(..., L, L)`` its
    diagonal block per sequence (exact for masks and biases that depend on ``i - j`` only: causal, sliding window,
    relative buckets); "key_bias" = an ALiBi bias per key ``(B H, 1, L)`` (or one spanning no row dim, unchanged):
    sliced at the sequence's keys and re-based to its first key (softmax is invariant to a constant per query row);
    "per_layer" = not per token (a head mask), unchanged; "encoder" = encoder states, None on a packed row;
    "per_token_lead" = a tensor starting with the token dims ``(B, L, ...)`` (what the previous layer returned per
    token of its sequence: GLM-DSA's top-k indices), sliced per sequence; "row_prefix" = a table at the row index
    ``(..., L, D)`` (RoFormer's sinusoidal positions, counted over the row), of which a sequence takes its first ``n``
    rows: what the sequence alone counts.
    takes_kwargs: its forward takes ``**kwargs`` (non-tensor keywords pass unchanged, the per-token ones by role).
    """

    cls: str
    params: tuple[tuple[str, MixerRole], ...]
    takes_kwargs: bool

    def describe(self) -> str:
        args = [f"{name}: {role}" for name, role in self.params] + (["**kwargs"] if self.takes_kwargs else [])
        return f"{self.cls}({', '.join(args)})"


@dataclass(frozen=True)
class Derivation:
    """Where a derived entry came from: the classes read, in the entry's module, and what its attention passes.

    causal_lm, text_model: class names; text_model_attr: the causal LM's attribute holding the text model (its
    ``base_model_prefix``); causal_lm and text_model_attr are "" for a text model derived without a causal LM (a
    vision-language model's text type: `tfcompat.registry.derive.derive_text_model`); decoder_layers: every
    decoder-layer class the text model builds;
    attention: the attention class's call (`AttentionCall`); config: the config class name; mixers: the token
    mixers other than softmax attention that run per sequence (`MixerCall`), none for an attention-only model.
    per_sequence: the decoder layers proved to run once per sequence with the model's own attention
    (`tfcompat.registry.mixers.layer_call`, a `MixerCall` each; empty when not proved); a patch runs them so
    (`tfcompat.hf.mixers`) where the packed core cannot express the attention: per_sequence_why says why when derive
    found it (it dispatches through no AttentionInterface, passes what the core does not implement, shares the layer
    with a mixer); else ``patch()`` falls back to them for a module whose features the core refuses (a layer type
    other than softmax attention). softmax_attention: False where no module dispatches through AttentionInterface
    for the packed core (the layers run per sequence, or hold per-sequence mixers alone: Mamba); ``attention`` then
    names the first decoder layer class and passes nothing.
    """

    causal_lm: str
    text_model: str
    text_model_attr: str
    decoder_layers: tuple[str, ...]
    attention: AttentionCall
    config: str
    mixers: tuple[MixerCall, ...] = ()
    per_sequence: tuple[MixerCall, ...] = ()
    per_sequence_why: str = ""
    softmax_attention: bool = True


@dataclass(frozen=True)
class CrossStates:
    """States a derived owner hands its text model for cross-attention layers (Mllama's image states), read from its
    source (`tfcompat.registry.derive_vision`): the text model skips those layers when given no states, and the
    owner prepares their mask from a per-token mask over items with one module-level function.

    states: the text model's keyword of the states (``cross_attention_states``, ``(items * k, n, H)``: each item's
    keys in order); mask: its keyword of the additive mask over them (``(B, 1, L, K)``, 0 attends); row_mask: its
    keyword of the per-token gate the owner prepares with it ("" where none); items: the owner's forward parameter
    of the per-token mask over items it prepares them from (``cross_attention_mask``, ``(B, L, items, ...)``, 1
    attends); prepare: that function; layers: the decoder layer classes holding the cross-attention (skipped without
    states); attentions: the cross-attention classes in them, which attend to the states, not to the packed row.
    """

    states: str
    mask: str
    row_mask: str
    items: str
    prepare: str
    layers: tuple[str, ...]
    attentions: tuple[str, ...]


@dataclass(frozen=True)
class VisionDerivation:
    """Where a derived vision-language entry came from (`tfcompat.registry.derive_vision`): a vision tower, a
    projector and placeholder tokens in front of a text model that tfcompat patches as its text family.

    model: the vision-language class; hops: ``(class, attribute)`` from it down to the text model, each class's
    forward proved to pass ``position_ids`` and ``**kwargs`` on to that attribute; owner: the class holding the
    language model (at ``language_model_attr``) and the vision tower (at ``tower_attrs``), whose forward embeds the
    tokens and scatters the image features; projector_attrs: its other submodules; text_family: the family the
    language model is patched as (its ``text_config.model_type``); placeholder: the config attribute holding the
    image token id ("" where the config names none); owner_mask: the source expression the owner passes as the
    language model's attention mask ("attention_mask": the caller's); mask_inputs: the owner's forward parameters
    that shape a mask it builds itself (token types: bidirectional attention within images); batched_images: the
    owner reads pixel values as ``(B, images, ...)`` (one row of the batch per text row), not ``(images, ...)``;
    embeds_need_ids: a forward on the way raises for ``inputs_embeds`` without ``input_ids`` (4.53's Idefics2) or
    requires ``pixel_values`` (BLIP-2), so
    embeddings computed outside it (`tfcompat.embed_inputs`, Ulysses) cannot be fed to it; token_inputs: what the
    owner computes from the token ids for its language model besides the embeddings (Gemma 4's ``per_layer_inputs``),
    which embeddings computed outside it do not carry; positions_call: where the owner numbers M-RoPE positions
    itself when given none (``position_ids = self.compute_3d_position_ids(...)``): the method and its keywords as
    ``(keyword, source)`` (() for a 1-D RoPE text model: the text row is all there is); visual_extras: the text
    model's keywords ``(mask, features)`` for features it adds at the masked tokens (DeepStack's
    ``visual_pos_masks``, ``deepstack_visual_embeds``), which the owner hands it (`tfcompat.embed_inputs` returns
    them as `tfcompat.core.extras.VisualExtras`); position_offset: where the owner, given no positions, starts each
    sequence's text row (PaliGemma's 1); a packed row's text model gets the contract's row plus it; positions_locals:
    ``(name, statement)`` for each local of the owner's forward that its numbering reads, computed from the forward's
    parameters alone (Qwen-Omni's ``audio_feature_lengths``), run on a sequence's inputs before the numbering;
    inline_extras: ``(mask, features)`` the text model's own loop adds at the masked tokens in a form `VisualExtras`
    does not carry (Granite 4 Vision's per-layer dict): packed rows take them from the owner, `embed_inputs` refuses;
    item_axes: ``(input, axis)`` of each vision input its processors
    return as one batch entry holding every item along ``axis`` (MiniCPM-V's ``pixel_values`` ``(1, C, p, N * p)``:
    -1), which a packed row concatenates there (`tfcompat.registry.batching`); the other inputs hold their items on
    dim 0 (or 1: ``batched_images``); batch_indices: ``(index input, pixel input)`` of each input holding indices into
    the rows of the whole batch's flattened patches of the pixel input (Molmo2's ``image_token_pooling``; -1 a padding
    slot), which a packed row shifts by the rows of every earlier sequence (`tfcompat.registry.batching`);
    mrope_axes: where the text model takes exactly as many M-RoPE rows as an expression of itself says (HunYuan-VL's
    ``len(self.rotary_emb.mrope_section or [])``: XD-RoPE's four axes), that expression, read from its forward and
    evaluated on the instance (`tfcompat.inputs.derived_vision.mrope_axes`); "" for three;
    cross_states: the states the owner hands its text model's cross-attention layers (`CrossStates`: Mllama's images,
    which reach the text model as keys and values, not in the embeddings), None where there are none;
    kwargs_shared: ``(class, path)`` of each call ``self.<path>(..., **kwargs)`` that a class of ``hops`` spreads the
    ``**kwargs`` carrying the position ids into besides the next hop (InstructBLIP-Video's ``get_video_features``: a
    method of the class, or a submodule it builds); a packed row's per-token keys are kept from them
    (`tfcompat.hf.vision.shared_kwargs`), as stock per sequence hands them none;
    written_at_mask: ``(mask, features)``, the parameters of the text model's forward whose features it writes into
    its own token embeddings at the masked tokens, in order (Kosmos-2's ``image_embeds`` at
    ``image_embeds_position_mask``): a packed row's mask is its sequences' masks back to back, its features theirs
    in order, and `tfcompat.embed_inputs` refuses (embeddings computed outside carry no image);
    kinds_share_placeholder: the owner's ``get_placeholder_mask`` finds images and videos at the same token id
    (GLM-OCR, as GLM-4.1V: video frames are image tokens), so its forward rejects a row holding both kinds (it counts
    the video's tokens as the images'); `tfcompat.pack` embeds such a row's sequences each alone, as stock does.
    """

    model: str
    hops: tuple[tuple[str, str], ...]
    owner: str
    language_model_attr: str
    tower_attrs: tuple[str, ...]
    projector_attrs: tuple[str, ...]
    text_family: str
    placeholder: str
    owner_mask: str
    mask_inputs: tuple[str, ...]
    batched_images: bool
    embeds_need_ids: bool = False
    token_inputs: tuple[str, ...] = ()
    positions_call: tuple[str, tuple[tuple[str, str], ...]] | tuple[()] = ()
    visual_extras: tuple[str, str] | tuple[()] = ()
    position_offset: int = 0
    positions_locals: tuple[tuple[str, str], ...] = ()
    inline_extras: tuple[str, str] | tuple[()] = ()
    item_axes: tuple[tuple[str, int], ...] = ()
    batch_indices: tuple[tuple[str, str], ...] = ()
    mrope_axes: str = ""
    cross_states: CrossStates | None = None
    kwargs_shared: tuple[tuple[str, str], ...] = ()
    written_at_mask: tuple[str, str] | tuple[()] = ()
    kinds_share_placeholder: bool = False


@dataclass(frozen=True)
class EncoderDecoderDerivation:
    """Where a derived encoder-decoder vision-language entry came from (`tfcompat.registry.derive_encoder_decoder`):
    an encoder (a vision tower, or a text encoder over image features and a prompt) whose states a decoder of a text
    family tfcompat patches reads through cross-attention. The decoder's row is the packed one: its tokens of ``N``
    sequences back to back with restarting position ids, cross-attending to each sequence's own encoder states.

    model: the class given to `patch`; owner: the class whose forward runs the encoder and calls the decoder with
    ``encoder_hidden_states`` (``model`` itself, or the class at ``owner_attr``, its base model prefix); decoder /
    encoder: attribute paths from the owner to them (``"decoder"``, ``"language_model.decoder"``); text_family: the
    decoder's family; decoder_ids: the forward parameter the owner hands the decoder as ``input_ids``;
    decoder_positions: the keyword the decoder's position ids take at the model's forward (``decoder_position_ids``
    where the forward strips a ``decoder_`` prefix off its ``**kwargs`` for the decoder, ``position_ids`` where the
    decoder takes the forward's ``**kwargs`` as they are); encoder_mask: the owner's parameter it passes the decoder
    as ``encoder_attention_mask`` ("" for none: every encoder state is read); labels_shift: ``(function, argument
    sources)`` of the module function the model's forward builds the decoder ids from ``labels`` with
    (``shift_tokens_right(labels, self.config.pad_token_id, ...)``; () for none), which `tfcompat.pack` runs per
    sequence; labels_loss: how the forward's loss reads ``labels``: ``"aligned"`` (each decoder token's own target:
    a loss over ``labels.reshape(-1)``, or ``shift_labels=`` given), ``"loss_function"`` (``self.loss_function`` given
    ``labels=labels`` alone, which shifts them where the model's loss function does: 4.x VisionEncoderDecoder's
    ``ForCausalLMLoss``; `tfcompat.pack` asks the instance), ``"shifted"`` (the owner hands the decoder its labels,
    and the decoder's own loss reads ``labels[:, 1:]`` against the logits before them: BLIP's text decoder), "" where
    no form tfcompat knows; decoder_mask: the owner's parameter it hands the decoder as ``attention_mask`` (BLIP's
    ``attention_mask``, VisionEncoderDecoder's ``decoder_attention_mask``; "" for none): all ones on a packed row;
    logits_to_keep: the owner's parameter it hands the decoder as ``logits_to_keep`` ("" for none), which a packed
    row takes as 0 only (its last logits are the last sequence's).
    """

    model: str
    owner: str
    owner_attr: str
    decoder: str
    encoder: str
    text_family: str
    decoder_ids: str
    decoder_positions: str
    encoder_mask: str
    labels_shift: tuple[str, tuple[str, ...]] | tuple[()] = ()
    labels_loss: str = ""
    decoder_mask: str = ""
    logits_to_keep: str = ""

    def decoder_path(self) -> str:
        """The decoder's path from the model given to `patch` (``"decoder"``, ``"model.language_model.decoder"``)."""
        return ".".join(p for p in (self.owner_attr, self.decoder) if p)

    def encoder_path(self) -> str:
        """The encoder's path from the model given to `patch`."""
        return ".".join(p for p in (self.owner_attr, self.encoder) if p)


@dataclass(frozen=True)
class Entry:
    """One row of a family table: what the family looks like inside one transformers range.

    classes: role -> class name in ``module``; roles: ``attention``, ``rotary``, ``text_model``,
        ``decoder_layer``, ``for_causal_lm``, for vision-language families ``model`` (`VisionTower.owner`), and
        for hybrid families ``linear_attention`` (`LinearAttention`).
    rotary: the rotary convention (`Rotary`); None for a derived entry (the stock forward applies rotary, and
        tfcompat replaces only the attention function).
    text_model_positions: "mrope" = the text model takes ``(3, B, L)`` and cannot take a text row;
        "text+mrope" = it splits ``(4, B, L)`` itself; "text" = a text-only model taking ``(B, L)``.
    layer_forwards_kwargs: the decoder layer passes ``**kwargs`` on to its attention, and the text model gives its
        layers them, under gradient checkpointing too (else a pre-hook hands the attention the context).
    rope_index_mm_token_types: ``get_rope_index`` requires ``mm_token_type_ids``.
    cache_kwarg: the attention forward's cache parameter name (None: a derived entry whose attention takes none).
    why: what sets this range apart from its neighbours.
    vision: where the vision tower lives (None for text-only families).
    rope_index_deviations: where the installed ``get_rope_index`` departs from the family's reference
        (`Family.reference_rope_index`; known transformers bugs), by name from that reference's ``DEVIATIONS``.
    known_issues: bugs of the stock forward in this range, by name (``"videos_rejected"``: the forward
        rejects every video; pass videos through `tfcompat.embed_inputs` instead).
    linear_attention: the family's linear-attention layers (None: every decoder layer is softmax attention).
    text_module: the module holding the text roles (`TEXT_MODULE_ROLES`) and the functions their attention calls
        (``rotary.apply``, ``repeat_kv``) when the model builds its text model from another family's module
        (GLM-4.6V: ``AutoModel.from_config(config.text_config)``); None: ``module``.
    derived: what a derived entry (`tfcompat.registry.derive`) was read from; None for a written table's entry.
    derived_vision: what a derived vision-language entry (`tfcompat.registry.derive_vision`) was read from (its text
        half is its text family's entry); None otherwise.
    encoder_decoder: what a derived encoder-decoder entry (`tfcompat.registry.derive_encoder_decoder`) was read
        from (its text half is its decoder's family's entry); None otherwise.
    """

    family: str
    versions: versions.VersionRange
    module: str
    classes: dict[str, str]
    rotary: Rotary | None
    rope_config_key: RopeConfigKey
    text_model_positions: TextModelLayout
    layer_forwards_kwargs: bool
    rope_index_mm_token_types: bool
    cache_kwarg: CacheKwarg | None
    why: str
    vision: VisionTower | None = None
    rope_index_deviations: tuple[str, ...] = ()
    known_issues: tuple[str, ...] = ()
    linear_attention: LinearAttention | None = None
    text_module: str | None = None
    derived: Derivation | None = None
    derived_vision: VisionDerivation | None = None
    encoder_decoder: EncoderDecoderDerivation | None = None

    def module_of(self, role: str) -> str:
        """The module holding ``classes[role]``."""
        return self.text_module if self.text_module is not None and role in TEXT_MODULE_ROLES else self.module


@dataclass(frozen=True)
class Family:
    """A model family: its entries (oldest first, contiguous) and the few family-specific helpers.

    key: transformers' ``config.model_type``.
    mm_token_types: ``(config, input_ids (B, L)) -> (B, L)`` int tensor, 0 text / 1 image / 2 video
        (None for text-only families).
    tiny_config: ``(entry) -> (config_class_name, kwargs)`` for a tiny random model (self-check, tests).
    reference_rope_index: the name of tfcompat's reference M-RoPE index for this family, a key of
        `tfcompat.reference_rope.REFERENCES` (None: no reference; ``rope_index(impl="reference")`` refuses).
    sample_vision: one vision item per sequence of the family's packed sample (None = text only), run by
        the self-check and the tests: images of different grids and, where the family takes them, a video.
    vision_placeholder: ``(config, kind, (t, h, w)) -> token ids`` of one vision item as the family's processor
        lays it out (tests and self-check); None: one run of the kind's placeholder token between the kind's
        (or the vision) start and end tokens.
    text_variants: ``text_config.model_type -> family key`` for a model whose text model follows its text config
        (GLM-4.6V: ``AutoModel.from_config(config.text_config)``): a model with such a text config takes the
        text half of its entry (`TEXT_ROLES` and their conventions) from that family's entry on the installed
        release (`tfcompat.registry.resolve_model`). Text configs not listed use the family's own entries.
    text_only: the family's text-only model, a family of its own keyed by the text config's ``model_type``
        (Qwen3.5: ``qwen3_5_text``, its ``*ForCausalLM`` on the text config alone, which ``AutoModelForCausalLM``
        builds from a checkpoint of the family): its entries are the text half of the family's, without vision.
        `tfcompat.registry.family` finds it by its key; `tfcompat.families.FAMILIES` does not list it (its tests
        are the parent's). None: the family has none.
    moe_token_types: ``(config, input_ids (B, L)) -> (B, L)`` int tensor for a family whose MoE routes each token by
        its modality (ERNIE-4.5-VL's text and vision experts): what the processor passes as
        ``moe_mm_token_type_ids`` (0 text, 1 image, 2 video, start/end tokens with their kind). `tfcompat.pack`
        builds it from the ids; `tfcompat.ulysses.shard_inputs` slices it to a rank's tokens. None: no such MoE.
    """

    key: str
    entries: tuple[Entry, ...]
    tiny_config: Callable[[Entry], tuple[str, dict[str, Any]]]
    mm_token_types: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    reference_rope_index: str | None = None
    sample_vision: tuple[VisionItem | None, ...] = ()
    vision_placeholder: Callable[[Any, str, tuple[int, int, int]], list[int]] | None = None
    text_variants: tuple[tuple[str, str], ...] = ()
    text_only: Family | None = None
    moe_token_types: Callable[[Any, torch.Tensor], torch.Tensor] | None = None

    @property
    def is_vision(self) -> bool:
        return self.mm_token_types is not None

    @property
    def supported(self) -> str:
        span = versions.VersionRange(self.entries[0].versions.low, self.entries[-1].versions.high)
        if self.entries[-1].derived is not None or self.entries[-1].derived_vision is not None:
            return f"transformers {span} (derived from the installed release's modeling module)"
        return f"transformers {span} (newer releases resolve by probing, with a warning)"
