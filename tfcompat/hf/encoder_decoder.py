"""Packed rows of an encoder-decoder model (`tfcompat.registry.derive_encoder_decoder`): the decoder's row is packed.

A packed call gives the model the decoder tokens of ``N`` sequences in one row ``(1, sum L_dec)`` with position ids
restarting at 0 per sequence, and the ``N`` sequences' encoder inputs as a batch (``tfcompat.pack`` builds both). The
patch changes three things:

- the model's forward decides packed or stock once per call, from the decoder's ids and position ids (under the
  keywords the derivation read: ``decoder_input_ids`` and ``decoder_position_ids`` for VisionEncoderDecoder), and hands
  the decision to the decoder's text model (`Router.pending`), which runs packed as a causal text model does;
- the encoder runs stock on every call: stock attention and masks (it may share its config with the decoder:
  Florence-2's BART), without the decoder's position ids or tfcompat's context in its kwargs;
- the decoder's text model packs the encoder states it is handed, ``(N, L_enc, D)`` with their mask ``(N, L_enc)``,
  into one row ``(1, sum L_enc_i, D)`` of each sequence's unpadded states (`pack_encoder_states`), and each
  cross-attention module (marked `tfcompat.hf.attention.CROSS_ATTR`) reads its own sequence's
  (`tfcompat.core.cross_attention`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..core.context import CONTEXT_KWARG, ForwardContext
from ..core.packing import from_lengths
from ..errors import InvalidInputError, PatchError
from ..registry import Resolved
from ..registry.derive import cross_attrs
from ..registry.records import EncoderDecoderDerivation
from .forward import CACHE_ARGS, Router

__all__ = ["EncoderDecoderPlan", "encoder_forward", "pack_encoder_states", "plan", "top_forward"]


class EncoderDecoderPlan(NamedTuple):
    """What `tfcompat.patch` changes in an encoder-decoder model: its decoder and encoder modules, and the decoder's
    cross-attention modules."""

    derivation: EncoderDecoderDerivation
    decoder: torch.nn.Module
    encoder: torch.nn.Module
    cross: list[torch.nn.Module]


def plan(model: torch.nn.Module, r: Resolved) -> EncoderDecoderPlan | None:
    """The plan for ``model`` (None for a model that is not encoder-decoder); `PatchError` where its decoder or
    encoder is not where the derivation read them, or the decoder holds no cross-attention module it can mark."""
    d = r.entry.encoder_decoder
    if d is None:
        return None

    def find(path: str, role: str) -> torch.nn.Module:
        try:
            return model.get_submodule(path)
        except AttributeError:
            raise r.error(PatchError, f"{type(model).__name__} has no {role} at {path!r}",
                          why=f"the {r.entry.versions} entry was derived from {d.model}, whose forward calls "
                          f"self.{path}", fix=f"pass the {d.model} built by transformers") from None

    decoder, encoder = find(d.decoder_path(), "decoder"), find(d.encoder_path(), "encoder")
    params = inspect.signature(decoder.forward).parameters
    if "position_ids" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        # 4.x MBartForCausalLM: the restarting position ids of a packed decoder row cannot reach it
        raise r.error(PatchError, f"the decoder of {type(model).__name__} takes no position ids",
                      why=f"{type(decoder).__name__}.forward has no position_ids parameter nor **kwargs: a packed "
                      "decoder row's positions would run across its sequences", supported=f"entry {r.entry.versions}",
                      fix="run it unpatched (padded), or use a transformers release whose decoder takes position_ids")
    layer_cls, attention_cls = r.decoder_layer_cls, r.attention_cls
    own = r.classes.get("cross_attention")  # a class of its own (BERT's), or the self-attention's (Bart's encoder_attn)
    attrs = cross_attrs(layer_cls, attention_cls) if r.entry.derived is not None else ()
    cross = [m for m in decoder.modules() if own is not None and isinstance(m, own)]
    cross += [getattr(layer, a) for layer in decoder.modules() if isinstance(layer, layer_cls) for a in attrs
              if isinstance(getattr(layer, a, None), torch.nn.Module)]
    layered = r.entry.derived is not None and bool(r.entry.derived.per_sequence_why)
    if not cross and not layered:  # (layers run per sequence, TrOCR's: each takes its own sequence's states)
        raise r.error(PatchError, f"the decoder of {type(model).__name__} holds no cross-attention module",
                      why=f"found no {own.__name__ if own is not None else attention_cls.__name__} reading encoder "
                      f"states in {type(decoder).__name__}", supported=f"entry {r.entry.versions}",
                      fix="build the decoder with cross-attention (add_cross_attention=True), as the model's "
                      "from_encoder_decoder_pretrained does")
    return EncoderDecoderPlan(d, decoder, encoder, cross)


def top_forward(original: Callable[..., Any], router: Router, d: EncoderDecoderDerivation) -> Callable[..., Any]:
    """Wrap the bound forward of the model given to `patch`: decide packed or stock once per call from the decoder's
    ids (``d.decoder_ids``) and position ids (``d.decoder_positions``, by name or in ``**kwargs``), or take
    `tfcompat.pack`'s context, and hand the decision to the decoder's text model (`Router.pending`); nothing else
    changes in the call."""
    sig = inspect.signature(original)
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        packed = kwargs.pop(CONTEXT_KWARG, None)  # tfcompat.pack's boundaries: not handed to the encoder
        a = sig.bind(*args, **kwargs).arguments
        extra = a.get(var_kw, {}) if var_kw is not None else {}
        given = {**extra, **a}
        router.check_key()
        if isinstance(packed, ForwardContext):
            ctx: Any = packed
        else:
            decoder = {"input_ids": given.get(d.decoder_ids), "position_ids": given.get(d.decoder_positions),
                       "inputs_embeds": given.get("decoder_inputs_embeds"), "use_cache": given.get("use_cache"),
                       "attention_mask": given.get(d.decoder_mask or "decoder_attention_mask"),
                       **{n: given.get(n) for n in CACHE_ARGS}}
            ctx = router.decide(decoder, user_call=True)
        keep = given.get(d.logits_to_keep) if d.logits_to_keep else None
        if isinstance(ctx, ForwardContext) and not (keep is None or (isinstance(keep, int) and keep == 0)):
            raise router.r.error(InvalidInputError, f"{d.logits_to_keep}={keep!r} on a packed decoder row",
                                 why="the decoder keeps the last logits of the row, which are the last sequence's",
                                 fix=f"pass {d.logits_to_keep}=0 (every logit) and pick each sequence's own from "
                                 "pack's boundaries")
        router.pending = ctx
        try:
            return original(*args, **kwargs)
        finally:
            router.pending = None

    return forward


def encoder_forward(original: Callable[..., Any], router: Router, d: EncoderDecoderDerivation) -> Callable[..., Any]:
    """Wrap the encoder's bound forward: always stock (its configs name their pre-patch attention, masks are stock);
    on a packed call its kwargs lose tfcompat's context and the decoder's position ids (where the owner hands the
    encoder and the decoder the same ``**kwargs``: Florence-2's), which stock the caller gives the decoder alone."""
    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop(CONTEXT_KWARG, None)
        if isinstance(router.pending, ForwardContext) and d.decoder_positions == "position_ids":
            kwargs.pop("position_ids", None)
        with router.stock_attention():
            return original(*args, **kwargs)

    return forward


def pack_encoder_states(r: Resolved, ctx: ForwardContext, tokens: torch.Tensor, states: Any, mask: Any
                        ) -> tuple[torch.Tensor, ForwardContext]:
    """One packed row of the sequences' encoder states, and the context with their boundaries.

    tokens: the packed decoder row, ``(1, T)`` ids or ``(1, T, D)`` embeddings; states: ``(N, L_enc, D)``, one row per
    sequence of ``ctx.seqs`` in order; mask: ``(N, L_enc)`` (1 at a state read, each row's 1s first: right padding)
    or None (every state read). Returns ``(1, sum L_i, D)`` (the states of each sequence's 1s, in order) and ``ctx``
    with ``encoder`` set. `InvalidInputError` where they do not fit the row."""
    def refuse(what: str, why: str, fix: str) -> InvalidInputError:
        return r.error(InvalidInputError, what, why=why, fix=fix)

    n = len(ctx.seqs.lengths)
    if tokens.shape[0] != 1:
        raise refuse(f"{r.family} takes one packed decoder row at a time", why=f"got {tokens.shape[0]} rows",
                     fix="pass one packed row per forward (tfcompat.pack)")
    if not isinstance(states, torch.Tensor) or states.ndim != 3 or states.shape[0] != n:
        shape = tuple(states.shape) if isinstance(states, torch.Tensor) else type(states).__name__
        raise refuse("the encoder states do not match the packed decoder row",
                     why=f"{n} decoder sequences, encoder states {shape}: one row of encoder states per sequence",
                     fix="pass each sequence's encoder inputs as one row of a batch, in the order of the packed "
                     "decoder row (tfcompat.pack)")
    if mask is None:
        return states.reshape(1, -1, states.shape[-1]), ctx._replace(  # (N, L, D) -> (1, N * L, D)
            encoder=from_lengths([states.shape[1]] * n, device=states.device))
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(states.shape[:2]):
        raise refuse("the encoder mask does not match the encoder states",
                     why=f"mask {tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}, "
                     f"states {tuple(states.shape)}", fix="pass the encoder inputs' (N, L_enc) attention mask")
    host = mask.detach().to("cpu", torch.long)  # (N, L): the call's one sync for the encoder lengths
    lengths = host.sum(-1)
    if not bool((host.cumprod(-1).sum(-1) == lengths).all()) or int(lengths.min()) == 0:
        raise refuse("the encoder mask is not right padding", why="each row's attended states must come first "
                     "(1s, then 0s) and be at least one", fix="pad the encoder inputs on the right (tfcompat.pack)")
    flat = states[mask.to(torch.bool)][None]  # (N, L, D) -> (1, sum L_i, D), row by row
    return flat, ctx._replace(encoder=from_lengths(lengths.tolist(), device=states.device))
