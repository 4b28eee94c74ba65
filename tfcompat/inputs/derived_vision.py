"""`embed_inputs`, `rope_index` and `pack` for derived vision-language families (text models behind a
vision tower: `tfcompat.registry.records.VisionDerivation`).

Nothing family-specific is written here: the model's own forward embeds the tokens, runs the tower and scatters the
features (image sizes, patch masks, tiles and all), and `embed_inputs` captures the ``inputs_embeds`` its owner hands
the language model (a forward pre-hook that records them and stops the forward). Position ids are the text row,
``0 .. L-1`` per sequence over attended tokens, and where the model numbers M-RoPE itself, below it the rows its own
method numbers for each sequence alone (`mrope_positions`). A packed row concatenates the examples' tokens and their
vision inputs in sequence order: on dim 0 (``(images, ...)``), or on dim 1 where the owner reads ``(B, images,
...)``, zero-padded to the largest trailing shape as processors pad a batch; an input the processors return as one
entry holding every item along an axis (``VisionDerivation.item_axes``: MiniCPM-V's patches on the last dim) is
concatenated on that axis; indices into the whole batch's patches (``VisionDerivation.batch_indices``: Molmo2's
``image_token_pooling``) are shifted by the patches of the sequences before.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from ..core.context import CrossItems
from ..core.extras import Embedded, VisualExtras
from ..core.labels import mask_starts, shift_labels
from ..core.packing import PackedSeqs, from_lengths
from ..core.position_ids import text_row_from_mask
from ..errors import InvalidInputError, PatchError
from ..registry import Resolved
from .token_types import token_type_rule
from .vision_inputs import check_token_ids

__all__ = ["dummy_features", "embed_derived", "is_derived_vision", "mrope_positions", "owner_of", "pack_derived",
           "text_positions"]

# forward parameters that are not vision inputs of an example
_NOT_VISION = frozenset({"self", "input_ids", "attention_mask", "position_ids", "labels", "inputs_embeds", "cache",
                         "past_key_values", "past_key_value", "use_cache", "cache_position", "return_dict",
                         "output_attentions", "output_hidden_states", "logits_to_keep", "kwargs"})


class _Captured(Exception):
    """Stops the owner's forward at its language model once the input embeddings are recorded."""


def is_derived_vision(r: Resolved) -> bool:
    return r.entry.derived_vision is not None


def _is_blank_segments(name: str, value: Any) -> bool:
    """Whether ``value`` is a tokenizer's ``token_type_ids`` of one segment (all zeros): no information for a forward
    that takes none (the stock forward swallows them), and generic tokenizers return them by default (4.x
    ``PreTrainedTokenizerFast``, as a processor's tokenizer); `pack_derived` drops them there."""
    return name == "token_type_ids" and isinstance(value, torch.Tensor) and not bool(value.any())


def owner_of(r: Resolved, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The module holding the language model (`VisionDerivation.owner`) and the language model; `PatchError` where
    ``model`` holds none."""
    v = r.entry.derived_vision
    cls = r.classes["model"]
    owner = model if isinstance(model, cls) else next((m for m in model.modules() if isinstance(m, cls)), None)
    language_model = getattr(owner, v.language_model_attr, None) if owner is not None and v is not None else None
    if owner is None or not isinstance(language_model, torch.nn.Module):
        raise r.error(PatchError, f"{type(model).__name__} holds no {cls.__name__} with a language model",
                      why=f"the {r.family} entry reads the vision path of {cls.__name__}",
                      fix="pass the model transformers builds for this vision-language config")
    return owner, language_model


def mrope_axes(r: Resolved, model: torch.nn.Module) -> int:
    """The number of M-RoPE rows ``model``'s text model takes after the contract's text row: 3, or the value on the
    instance of the expression its forward checks them against (`VisionDerivation.mrope_axes`: HunYuan-VL's
    ``len(self.rotary_emb.mrope_section or [])``); `PatchError` where it is not a positive int."""
    v = r.entry.derived_vision
    if v is None or not v.mrope_axes:
        return 3
    cls = r.classes["text_model"]
    text_model = next((m for m in model.modules() if isinstance(m, cls)), None)
    try:  # the text model's own expression of itself (read from its forward: names `self` and `len` only)
        axes = eval(v.mrope_axes, {"__builtins__": {}, "len": len}, {"self": text_model})  # noqa: S307
    except Exception as exc:  # noqa: BLE001 -- a text model without the attributes its forward reads
        axes = f"{type(exc).__name__}: {exc}"
    if not isinstance(axes, int) or isinstance(axes, bool) or axes < 1:
        raise r.error(PatchError, f"{type(model).__name__}'s text model takes no number of M-RoPE rows tfcompat can "
                      "read", why=f"{v.mrope_axes} gave {axes!r} on {cls.__name__}", fix="run the model unpatched")
    return axes


def text_positions(r: Resolved, input_ids: Any, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``(B, L)`` text positions: ``0 .. L-1`` per row over attended tokens (padding 1), the contract's text row."""
    check_token_ids(r, input_ids, "rope_index")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise r.error(InvalidInputError, "attention_mask and input_ids differ in shape",
                      why=f"attention_mask {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}",
                      fix="pass one mask entry per token, or no mask")
    return text_row_from_mask(attention_mask, input_ids.shape[0], input_ids.shape[1], device=input_ids.device)


@torch.no_grad()
def mrope_positions(r: Resolved, owner: torch.nn.Module, call: tuple[str, tuple[tuple[str, str], ...]],
                    input_ids: torch.Tensor, inputs: Mapping[str, Any],
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``(1 + A, B, L)`` = ``[text; t; h; w]`` (A = `mrope_axes`: 3, HunYuan-VL's 4) for ``input_ids (B, L)`` of a
    derived M-RoPE family: the M-RoPE rows from
    the owner's own numbering ``call`` (`tfcompat.registry.records.VisionDerivation.positions_call`: what its
    forward computes when given no positions), called with ``inputs`` (its forward's vision inputs by name) and no
    cache, after the forward's own statements computing the locals it reads from those inputs
    (`VisionDerivation.positions_locals`); the owner's state (``rope_deltas``) is left as it was. Rows it numbers
    none for (text only) count like
    the text row. ``mm_token_type_ids`` it needs and is not given: 1 at the image token, 2 at the video token
    (the processors' convention)."""
    method, keywords = call
    text = text_row_from_mask(attention_mask, input_ids.shape[0], input_ids.shape[1], device=input_ids.device)
    # the mask as the caller gives it: some owners number M-RoPE only with one (Qwen2.5-Omni)
    given = {"input_ids": input_ids, "attention_mask": attention_mask,
             **{k: x for k, x in inputs.items() if x is not None}}
    if "mm_token_type_ids" in (n for _, n in keywords) and given.get("mm_token_type_ids") is None:
        given["mm_token_type_ids"] = _token_types(owner.config, input_ids)
    if "inputs_embeds" in (n for _, n in keywords):
        given["inputs_embeds"] = cast(Any, owner).get_input_embeddings()(input_ids)
    v = r.entry.derived_vision
    for name, statement in v.positions_locals if v is not None else ():  # read from the forward: its parameters
        scope = {k: given.get(k) for k in inspect.signature(owner.forward).parameters}  # and torch alone
        exec(statement, {"torch": torch}, scope)  # noqa: S102 -- the owner's own statement (`_local_of_params`)
        given[name] = scope[name]
    state = dict(vars(owner))  # the method records rope_deltas for generation: a call from here must not
    if "rope_deltas" in state:  # and reads those of an earlier call (some releases): numbered as a fresh model
        setattr(owner, "rope_deltas", None)  # noqa: B010 -- a plain attribute of the owner, not a submodule
    try:
        mrope = getattr(owner, method)(**{k: given.get(n) for k, n in keywords})
    finally:
        for key in [k for k in vars(owner) if k not in state or vars(owner)[k] is not state[k]]:
            if key in state:
                setattr(owner, key, state[key])
            else:
                delattr(owner, key)
    axes = mrope_axes(r, owner)
    if mrope is None:  # no vision input: the text model numbers the row itself, every row alike
        mrope = text[None].expand(axes, -1, -1)
    if not isinstance(mrope, torch.Tensor) or tuple(mrope.shape) != (axes, *input_ids.shape):
        raise r.error(InvalidInputError, f"{type(owner).__name__}.{method} numbered no ({axes}, B, L) M-RoPE "
                      "positions",
                      why=f"got {tuple(mrope.shape) if isinstance(mrope, torch.Tensor) else type(mrope).__name__} "
                      f"for input_ids {tuple(input_ids.shape)}",
                      fix="report it: this release changed the owner's numbering")
    return torch.cat([text[None].to(mrope.device, mrope.dtype), mrope], dim=0)  # (1, B, L) + (A, B, L)


def _token_types(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` modality of each token: 0 text, 1 at ``config.image_token_id``, 2 at ``config.video_token_id``."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    for value, attr in ((1, "image_token_id"), (2, "video_token_id")):
        token = getattr(config, attr, None)
        if isinstance(token, int):
            types[input_ids == token] = value
    return types


def embed_derived(r: Resolved, model: torch.nn.Module, input_ids: Any, vision: dict[str, Any], *,
                  dummy: bool = True) -> Embedded:
    """The ``(B, L, H)`` embeddings the model's owner hands its language model for ``input_ids`` and ``vision``
    (its own forward's vision keyword arguments: pixel values, image sizes, patch masks, ...), with the features it
    hands it for the visual tokens (`VisionDerivation.visual_extras`: DeepStack's) as `VisualExtras`.

    Without vision inputs the tower still runs, on a dummy image (`dummy_features`), and ``0 * its mean`` is added:
    the tower gets zero gradients rather than none, and every rank runs the same collectives (``dummy=False``: not,
    for one sequence of a row whose others hold images).
    """
    check_token_ids(r, input_ids, "embed_inputs")
    v = r.entry.derived_vision
    if v is not None and v.embeds_need_ids:
        raise r.error(InvalidInputError, f"{r.family} cannot take embeddings computed outside its forward",
                      why=f"{v.model}'s forward on this release takes no inputs_embeds without input_ids (or "
                      "without pixel values)",
                      fix="pass input_ids and the vision inputs to the model (the tower runs inside its forward); "
                      "Ulysses with images needs a release whose forward takes inputs_embeds")
    if v is not None and v.cross_states is not None:
        raise r.error(InvalidInputError, f"{r.family} cannot take embeddings computed outside its forward",
                      why=f"{v.owner} hands its language model the images as {v.cross_states.states}, which its "
                      "cross-attention layers attend to; the token embeddings carry no image",
                      fix="pass input_ids and the vision inputs to the model (the tower runs inside its forward); "
                      "packed rows with images work so (tfcompat.pack), Ulysses rows with images do not")
    if v is not None and v.inline_extras:
        raise r.error(InvalidInputError, f"{r.family} cannot take embeddings computed outside its forward",
                      why=f"{v.owner} also hands its language model {', '.join(v.inline_extras)}, features its text "
                      "model adds at the image tokens in its own loop, which embeddings alone do not carry",
                      fix="pass input_ids and the vision inputs to the model (the tower runs inside its forward); "
                      "packed rows with images work so, Ulysses rows with images do not")
    if v is not None and v.written_at_mask:
        raise r.error(InvalidInputError, f"{r.family} cannot take embeddings computed outside its forward",
                      why=f"its text model writes {v.written_at_mask[1]} into its own token embeddings at "
                      f"{v.written_at_mask[0]}; embeddings computed outside carry no image",
                      fix="pass input_ids and the vision inputs to the model (the tower runs inside its forward); "
                      "packed rows with images work so (tfcompat.pack), Ulysses rows with images do not")
    if v is not None and v.token_inputs:
        raise r.error(InvalidInputError, f"{r.family} cannot take embeddings computed outside its forward",
                      why=f"{v.owner} also hands its language model {', '.join(v.token_inputs)}, computed from the "
                      "token ids (image tokens read as padding); embeddings holding image features cannot be read "
                      "back into ids", fix="pass input_ids and the vision inputs to the model (the tower runs inside "
                      "its forward); packed rows with images work so, Ulysses rows with images do not")
    owner, language_model = owner_of(r, model)
    params = inspect.signature(owner.forward).parameters
    unknown = sorted(k for k in vision if k not in params or k in _NOT_VISION)
    if unknown:
        raise r.error(InvalidInputError, f"embed_inputs got {unknown}, which {type(owner).__name__}.forward does not "
                      "take as vision inputs", supported=", ".join(k for k in params if k not in _NOT_VISION),
                      fix="pass the processor's vision outputs by their names")
    captured: dict[str, Any] = {}

    def record(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        captured.update(kwargs)
        raise _Captured

    hook = language_model.register_forward_pre_hook(record, with_kwargs=True)
    # positions given (any: the capture stops the forward before they are used), so that an owner numbering M-RoPE
    # itself does not (it would want mm_token_type_ids, which are not vision inputs)
    given = {"position_ids": input_ids} if v is not None and v.positions_call else {}
    try:
        owner(input_ids=input_ids, **given, **{k: v for k, v in vision.items() if v is not None})
    except _Captured:
        pass
    finally:
        hook.remove()
    embeds = captured.get("inputs_embeds")
    if not isinstance(embeds, torch.Tensor):
        raise r.error(PatchError, f"{type(owner).__name__} handed its language model no inputs_embeds",
                      why=f"it passed {sorted(captured)}", fix="report it: this release changed the owner's forward")
    if dummy and all(v is None for v in vision.values()):
        for x in dummy_features(r, owner):
            embeds = embeds + 0 * x.float().mean().to(embeds.dtype)
    visual = None
    if v is not None and v.visual_extras and isinstance(captured.get(v.visual_extras[0]), torch.Tensor):
        mask, features = (captured[k] for k in v.visual_extras)  # (B, L) and one (n_visual, H) per DeepStack layer
        visual = VisualExtras(mask, tuple(features))
    return Embedded(embeds, visual)


def dummy_features(r: Resolved, owner: torch.nn.Module) -> list[torch.Tensor]:
    """The tower's features of one zero image, in the first layout ``get_image_features`` takes (`dummy_layouts`);
    `InvalidInputError` where none fits."""
    features = getattr(owner, "get_image_features", None)
    vision = getattr(owner.config, "vision_config", None)
    if features is None or vision is None:
        raise r.error(InvalidInputError, f"no dummy image for {r.family}: {type(owner).__name__} has no "
                      "get_image_features or vision_config", fix="give every batch at least one image")
    device = next(owner.parameters()).device
    dtype = next(p for p in owner.parameters() if p.is_floating_point()).dtype
    reasons = []
    for layout in dummy_layouts(vision, inspect.signature(owner.forward).parameters):
        inputs = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in layout.items()}
        try:
            out = features(**inputs)
        except Exception as exc:  # noqa: BLE001 -- the next layout may fit
            reasons.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:100])
            continue
        found = _tensors(out)
        if found:
            return found
    raise r.error(InvalidInputError, f"no dummy image fits {r.family}'s get_image_features", why="; ".join(reasons),
                  fix="give every batch at least one image")


def dummy_layouts(vision: Any, params: Mapping[str, Any]) -> list[dict[str, torch.Tensor]]:
    """Zero images in the layouts transformers' vision-language models take, in order: one ``(1, C, S, S)`` image,
    ``(1, 1, C, S, S)`` (a batch of image lists), with ``image_sizes`` (any resolution: the image and one tile),
    one crop's patches ``(1, N, C * p * p)`` pooled 2 x 2 by index (Molmo2), NaViT-packed patches ``(1, C, p, N * p)``
    with their ``target_sizes``, NaFlex patches ``(1, N, C * p * p)`` with ``spatial_shapes`` and a patch mask. S is
    the config's image size."""
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", None) or 3
    size = getattr(vision, "image_size", 224)
    size = size[0] if isinstance(size, (list, tuple)) else size
    patch = getattr(vision, "patch_size", 14)
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    image = torch.zeros(1, channels, size, size)
    layouts: list[dict[str, torch.Tensor]] = [{"pixel_values": image}, {"pixel_values": image[:, None]}]
    if "image_sizes" in params:  # any-resolution towers: the image and its size (a tile of its own)
        sizes = torch.tensor([[size, size]])
        layouts += [{"pixel_values": image, "image_sizes": sizes},
                    {"pixel_values": torch.cat([image, image])[None], "image_sizes": sizes}]
    if "image_token_pooling" in params and "image_grids" in params:  # Molmo2: one crop's patches, pooled by index
        side = max(2, size // patch) // 2 * 2
        windows = torch.arange(side * side).view(side // 2, 2, side // 2, 2)  # (h/2, 2, w/2, 2) -> (h*w/4, 4)
        layouts.append({"pixel_values": torch.zeros(1, side * side, channels * patch * patch),
                        "image_token_pooling": windows.permute(0, 2, 1, 3).reshape(-1, 4),
                        "image_grids": torch.tensor([[side // 2, side // 2, 0, 0]])})  # [low h, low w, high h, high w]
    if "target_sizes" in params:  # NaViT-packed (MiniCPM-V): one entry of the patches along the last dim, its grid
        side = max(1, size // patch)
        layouts.append({"pixel_values": torch.zeros(1, channels, patch, side * side * patch),  # (1, C, p, N * p)
                        "target_sizes": torch.tensor([[side, side]], dtype=torch.int32)})
    if "spatial_shapes" in params:
        side = max(1, size // patch)
        layouts.append({"pixel_values": torch.zeros(1, side * side, channels * patch * patch),
                        "spatial_shapes": torch.tensor([[side, side]]),
                        "pixel_attention_mask": torch.ones(1, side * side, dtype=torch.bool)})
    return layouts


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    for key in ("pooler_output", "last_hidden_state"):
        if getattr(out, key, None) is not None:
            return _tensors(getattr(out, key))
    return []


def pack_derived(r: Resolved, model: torch.nn.Module, examples: Sequence[Mapping[str, Any]],
                 ignore_index: int) -> tuple[dict[str, Any], torch.Tensor | None, PackedSeqs, CrossItems | None]:
    """`tfcompat.pack` of a derived vision-language family: ``(model_inputs, shift_labels, seqs, cross)``.

    Each example: ``input_ids`` ``(L,)`` or ``(1, L)``, optional ``labels``, ``attention_mask`` (all ones), and
    the vision inputs its processor returned under the owner forward's names; per-token ``*token_type_ids`` and the
    mask at which the text model writes image features (`VisionDerivation.written_at_mask`: Kosmos-2's
    ``image_embeds_position_mask``) are concatenated like the ids (zeros, text, for an example without them);
    ``token_type_ids`` of one segment (all zeros) where the forward takes none are dropped. Where the owner hands
    its text model cross-attention states (`VisionDerivation.cross_states`: Mllama), the per-token mask over items
    is laid out block by block (`_cross_items`) and ``cross`` says how many items each sequence holds (the forward
    context carries it); else ``cross`` is None.
    """
    owner, _ = owner_of(r, model)
    # the owner's vision inputs, and those the model above it takes (GLM-5 Next's takes the processor's token types)
    params = {**inspect.signature(model.forward).parameters, **inspect.signature(owner.forward).parameters}
    vision_keys = {k for k in params if k not in _NOT_VISION}
    ids_list: list[torch.Tensor] = []
    for i, ex in enumerate(examples):
        what = f"tfcompat.pack example {i}"
        if not isinstance(ex, Mapping):
            raise r.error(InvalidInputError, f"{what} is not a mapping", why=f"got {type(ex).__name__}",
                          fix="pass one dict per sequence: {'input_ids': ..., 'labels': ..., 'pixel_values': ...}")
        unknown = sorted(k for k in set(ex) - vision_keys - {"input_ids", "labels", "attention_mask"}
                         if not _is_blank_segments(k, ex[k]))
        if unknown:
            raise r.error(InvalidInputError, f"{what} has unknown keys {unknown}", why="pack places only the keys "
                          f"{type(owner).__name__}.forward takes", supported=", ".join(sorted(vision_keys)),
                          fix="drop them, or pack them yourself")
        raw = ex.get("input_ids")
        ids = raw[None] if isinstance(raw, torch.Tensor) and raw.ndim == 1 else raw
        check_token_ids(r, ids, what)
        ids = cast(torch.Tensor, ids)  # checked: an integer (B, L) tensor
        if ids.shape[0] != 1 or ids.shape[1] == 0:
            raise r.error(InvalidInputError, f"{what}: input_ids must hold one non-empty sequence",
                          why=f"got shape {tuple(ids.shape)}", fix="pass (L,) or (1, L) ids per example")
        for name in ("labels", "attention_mask"):
            value = ex.get(name)
            if value is not None and (not isinstance(value, torch.Tensor) or value.numel() != ids.shape[1]):
                raise r.error(InvalidInputError, f"{what}: {name} and input_ids differ in length",
                              fix=f"pass one {name} entry per token")
        mask = ex.get("attention_mask")
        if mask is not None and not bool(mask.bool().all()):
            raise r.error(InvalidInputError, f"{what} has padding", why="attention_mask has zeros; a packed row "
                          "carries no padding", fix="drop the padded tokens (ids[mask.bool()]) before packing")
        ids_list.append(ids[0])
    has_labels = [ex.get("labels") is not None for ex in examples]
    if any(has_labels) and not all(has_labels):
        raise r.error(InvalidInputError, "tfcompat.pack got labels for some examples only",
                      why=f"examples without labels: {[i for i, h in enumerate(has_labels) if not h]}",
                      fix=f"give every example labels (all {ignore_index} where no loss is wanted), or none")
    ids = torch.cat(ids_list)[None]  # (T,) -> (1, T)
    seqs = from_lengths([len(x) for x in ids_list], device=ids.device)
    v = r.entry.derived_vision
    if v is not None and v.positions_call:  # each sequence numbered alone: (4, 1, L_i) -> (4, 1, T)
        positions = torch.cat([mrope_positions(r, owner, v.positions_call, x[None],
                                               {k: ex[k] for k in vision_keys if k in ex}, ex.get("attention_mask"))
                               for ex, x in zip(examples, ids_list)], dim=-1)
    else:
        positions = torch.cat([torch.arange(len(x), device=ids.device) for x in ids_list])[None]  # (T,) -> (1, T)
    inputs: dict[str, Any] = {"input_ids": ids, "position_ids": positions}
    batched = v is not None and v.batched_images
    item_axes = dict(v.item_axes) if v is not None else {}
    indexed = dict(v.batch_indices) if v is not None else {}
    for name in sorted(vision_keys):
        if name in indexed or (v is not None and v.cross_states is not None and name == v.cross_states.items):
            continue  # after the patches they index, or laid out by sequence (below)
        try:  # a processor called without return_tensors gives lists of numbers (LLaVA-OneVision's image counts)
            parts = [torch.as_tensor(ex[name]) for ex in examples if ex.get(name) is not None]
        except (TypeError, ValueError, RuntimeError) as exc:
            raise r.error(InvalidInputError, f"tfcompat.pack: {name} is not a tensor in every example", why=str(exc),
                          fix="pass the processor's outputs with return_tensors='pt'") from None
        if not parts:
            continue
        written = v is not None and name == next(iter(v.written_at_mask), None)  # Kosmos-2's image positions
        if name.endswith("token_type_ids") or written:  # per token: (1, L) or (L,); an example without them is text
            # (0), or for the owner's mask as a row without them (`token_types`: PaliGemma's 1, its 0 a bidirectional
            # prefix)
            fill = _untyped_fill(r, owner, name) if len(parts) < len(examples) and not written else 0
            types = [torch.as_tensor(ex[name]).reshape(-1) if ex.get(name) is not None else x.new_full((len(x),), fill)
                     for ex, x in zip(examples, ids_list)]
            if any(len(t) != len(x) for t, x in zip(types, ids_list)):
                raise r.error(InvalidInputError, f"tfcompat.pack: {name} and input_ids differ in length",
                              fix=f"pass one {name} entry per token")
            inputs[name] = torch.cat(types)[None].to(ids.device)  # (L_i,) each -> (1, T)
            continue
        mask = name.removesuffix("input_ids") + "attention_mask"
        if (name.endswith("_input_ids") and mask in vision_keys and len({p.shape[-1] for p in parts}) > 1
                and any(ex.get(name) is not None and ex.get(mask) is None for ex in examples)):
            raise r.error(InvalidInputError, f"tfcompat.pack: {name} differ in length and some example has no {mask}",
                          why=f"pack pads {name} with zeros at the end; without {mask} the padding would be read "
                          "as tokens", fix=f"pass each example's {mask} (its processor returns it)")
        axis = item_axes.get(name)
        if axis is not None and all(p.ndim > 1 and p.shape[0] == 1 for p in parts):  # one entry holding the items
            inputs[name] = _items_along(r, name, parts, axis)
            continue
        inputs[name] = _concat(parts, dim=1 if batched and all(p.ndim >= 2 and p.shape[0] == 1 for p in parts) else 0)
    for name, pixels in indexed.items():
        if any(ex.get(name) is not None for ex in examples):
            inputs[name] = _shifted_indices(r, examples, name, pixels).to(ids.device)
    cross = None
    if v is not None and v.cross_states is not None:
        inputs.pop(v.cross_states.items, None)
        cross_mask, cross = _cross_items(r, v.cross_states.items, examples, ids_list)
        if cross_mask is not None:
            inputs[v.cross_states.items] = cross_mask.to(ids.device)
    if v is not None and v.kinds_share_placeholder and len({k for ex in examples for k in _kinds(ex, vision_keys)}) > 1:
        inputs = _embedded_per_sequence(r, model, examples, ids_list, vision_keys, inputs)
    shifted = None
    if all(has_labels):
        labels = torch.cat([ex["labels"].reshape(-1) for ex in examples])[None].to(ids.device)  # (T,) -> (1, T)
        inputs["labels"] = mask_starts(labels, seqs, ignore_index)
        shifted = shift_labels(labels, seqs, ignore_index)
    return inputs, shifted, seqs, cross


def _kinds(ex: Mapping[str, Any], vision_keys: set[str]) -> set[str]:
    """The kinds of vision item ``ex`` holds: "video" for inputs named so, "image" for its other pixel inputs."""
    return {"video" if "video" in k else "image" for k in vision_keys
            if ex.get(k) is not None and "pixel_values" in k}


def _embedded_per_sequence(r: Resolved, model: torch.nn.Module, examples: Sequence[Mapping[str, Any]],
                           ids_list: list[torch.Tensor], vision_keys: set[str], inputs: dict[str, Any]
                           ) -> dict[str, Any]:
    """A row holding images and videos the owner cannot take together (`VisionDerivation.kinds_share_placeholder`):
    each sequence embedded alone, as its owner embeds it stock (`embed_derived`), the row's ``inputs_embeds
    (1, T, H)`` those back to back; the ids and vision inputs are left out, the per-token inputs kept."""
    parts = [embed_derived(r, model, x[None], {k: ex[k] for k in vision_keys if ex.get(k) is not None
                                               and not k.endswith("token_type_ids")}, dummy=False)
             for ex, x in zip(examples, ids_list)]
    if any(p.visual is not None for p in parts):
        raise r.error(InvalidInputError, f"tfcompat.pack: {r.family} takes no images and videos in one row",
                      why="its owner finds both at one token id, and the features it hands its text model besides "
                      "the embeddings (DeepStack's) cannot be joined per sequence here",
                      fix="pack images and videos in separate rows")
    kept = {k: x for k, x in inputs.items() if k != "input_ids" and (k not in vision_keys or k.endswith(
        "token_type_ids"))}
    return {**kept, "inputs_embeds": torch.cat([p.inputs_embeds for p in parts], dim=1)}  # (1, L_i, H) -> (1, T, H)


def _cross_items(r: Resolved, name: str, examples: Sequence[Mapping[str, Any]], ids_list: list[torch.Tensor]
                 ) -> tuple[torch.Tensor | None, CrossItems]:
    """The packed row's per-token mask over its cross-attention items (``name``: Mllama's ``cross_attention_mask``),
    ``(1, T, sum M_i, max n_i)``: example ``i``'s ``(1, L_i, M_i, n_i)`` at its tokens and its items, zero elsewhere
    (a token sees only its own sequence's items; 1 attends), its last dim (tiles) zero-padded as the processor pads
    a batch; and how many items each sequence holds, from its ``pixel_values`` ``(1, M_i, ...)`` (0 without). None
    for the mask where no example has items. `InvalidInputError` where an example with pixel values has no such mask
    (the processor returns it), or one whose shape does not match its tokens and images."""
    counts: list[int] = []
    parts: list[torch.Tensor | None] = []
    for i, (ex, x) in enumerate(zip(examples, ids_list)):
        pixels, mask = ex.get("pixel_values"), ex.get(name)
        if pixels is None:  # the stock text model skips its cross-attention layers: a mask alone is read by nothing
            counts.append(0)
            parts.append(None)
            continue
        items = torch.as_tensor(pixels).shape[1] if torch.as_tensor(pixels).ndim > 1 else -1
        if mask is None:
            raise r.error(InvalidInputError, f"tfcompat.pack example {i} has pixel_values but no {name}",
                          why=f"{name} says which tokens attend to which image tiles; the stock forward without it "
                          "attends otherwise than the processor's (its attention implementation decides)",
                          fix=f"pass the processor's {name} with each example's images")
        mask = torch.as_tensor(mask)
        if mask.ndim < 3 or mask.shape[0] != 1 or mask.shape[1] != len(x) or mask.shape[2] != items:
            raise r.error(InvalidInputError, f"tfcompat.pack example {i}: {name} does not match its tokens and images",
                          why=f"{name} {tuple(mask.shape)}, input_ids ({len(x)} tokens), pixel_values "
                          f"{tuple(torch.as_tensor(pixels).shape)}", supported=f"{name} (1, L, images, tiles) and "
                          "pixel_values (1, images, tiles, C, H, W), as the processor returns them for one sample",
                          fix="pass the processor's outputs for this sample")
        counts.append(items)
        parts.append(mask)
    given = [p for p in parts if p is not None]
    if not given:
        return None, CrossItems(tuple(counts))
    tail = [max(p.shape[d] for p in given) for d in range(3, given[0].ndim)]
    out = given[0].new_zeros(1, sum(len(x) for x in ids_list), sum(counts), *tail)  # (1, T, sum M_i, n)
    token, item = 0, 0
    for part, x, n in zip(parts, ids_list, counts):
        if part is not None:  # (L_i, M_i, n_i, ...) into (T, sum M_i, max n, ...) at its tokens and items
            where = (slice(token, token + len(x)), slice(item, item + n), *(slice(0, s) for s in part.shape[3:]))
            out[0][where] = part[0]
        token, item = token + len(x), item + n
    return out, CrossItems(tuple(counts))


def _untyped_fill(r: Resolved, owner: torch.nn.Module, name: str) -> int:
    """The value of ``name`` that masks a token as an example without token types is masked: 0 (text) where the
    owner's mask does not read ``name``; `InvalidInputError` where no value does (module `token_types`)."""
    v = r.entry.derived_vision
    if v is None or name not in v.mask_inputs:
        return 0
    rule = token_type_rule(r, owner, getattr(owner, v.language_model_attr), v.mask_inputs)
    if not rule.untyped_causal or not rule.causal:
        raise r.error(InvalidInputError, f"tfcompat.pack: some examples have {name} and some have none",
                      why=f"{type(owner).__name__} masks a sequence without {name} as no value of it does" + (
                          "" if rule.untyped_causal else " (stock attends both ways over such a sequence alone, "
                          "causally in a padded batch)"), fix=f"pass {name} in every example (the processor returns "
                      "it)")
    return rule.causal[0]


def _shifted_indices(r: Resolved, examples: Sequence[Mapping[str, Any]], name: str, pixels: str) -> torch.Tensor:
    """Each example's ``name`` ``(n_i, k_i)`` (indices into the rows of its own ``pixels`` flattened to ``(rows, D)``,
    as Molmo2's adapter flattens ``(crops, patches, D)``; -1 a padding slot) shifted by the rows of every earlier
    example's ``pixels``, as the processor offsets a batch's images; ``(sum n_i, max k_i)``, padded with -1.
    `InvalidInputError` where an example has indices without pixels, or the examples' pixels differ in their rows'
    layout (the concatenation would pad them, moving the rows)."""
    offset, parts = 0, []
    layouts = {tuple(torch.as_tensor(ex[pixels]).shape[1:]) for ex in examples if ex.get(pixels) is not None}
    if len(layouts) > 1:
        raise r.error(InvalidInputError, f"tfcompat.pack: the examples' {pixels} differ in shape after dim 0",
                      why=f"{name} indexes the rows of the flattened {pixels}; shapes {sorted(layouts)} would be "
                      "padded, which moves the rows", fix="process every example with the same processor settings")
    for i, ex in enumerate(examples):
        if ex.get(name) is not None:
            if ex.get(pixels) is None:
                raise r.error(InvalidInputError, f"tfcompat.pack example {i} has {name} but no {pixels}",
                              why=f"{name} indexes the rows of its {pixels}", fix=f"pass its {pixels}, or neither")
            index = torch.as_tensor(ex[name])
            parts.append(torch.where(index >= 0, index + offset, index))
        if ex.get(pixels) is not None:
            offset += torch.as_tensor(ex[pixels]).shape[:-1].numel()  # (crops, patches, D): crops * patches rows
    width = max(p.shape[-1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[-1]), value=-1) for p in parts])


def _items_along(r: Resolved, name: str, parts: list[torch.Tensor], axis: int) -> torch.Tensor:
    """``parts`` ``(1, ..., n_i, ...)`` concatenated on ``axis`` (their items: MiniCPM-V's patches, ``(1, C, p,
    n_i * p)`` -> ``(1, C, p, sum n_i * p)``), as the processor batches them; `InvalidInputError` where the other
    dims differ."""
    others = {tuple(s for d, s in enumerate(p.shape) if d != axis % p.ndim) for p in parts}
    if len({p.ndim for p in parts}) != 1 or len(others) != 1:
        raise r.error(InvalidInputError, f"tfcompat.pack: the examples' {name} differ outside their item axis {axis}",
                      why=f"shapes {[tuple(p.shape) for p in parts]}; the processor concatenates a batch's items on "
                      f"dim {axis} of one entry", fix="process every example with the same processor settings")
    return torch.cat(parts, dim=axis)


def _concat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``parts`` concatenated on ``dim``, each zero-padded (at the end) to the largest size of every later dim."""
    if len({p.ndim for p in parts}) != 1:
        return torch.cat(parts, dim)  # torch names the mismatch
    padded = []
    for p in parts:
        shape = [*p.shape[: dim + 1], *(max(q.shape[d] for q in parts) for d in range(dim + 1, p.ndim))]
        if list(p.shape) != shape:
            out = p.new_zeros(shape)
            out[tuple(slice(0, n) for n in p.shape)] = p
            p = out
        padded.append(p)
    return torch.cat(padded, dim)
