"""Proving that a token mixer can run once per sequence: what each parameter of its forward is, and that it keeps
no state across calls.

A mixer other than softmax attention (Mamba's selective scan, a short convolution, a Gated DeltaNet, lightning
attention) carries state along the row. Run on each sequence alone, with no cache, it computes what the stock model
computes for that sequence alone, provided nothing else carries state into the call: `mixer_call` reads the
forward's signature (each parameter by name gets a role, `tfcompat.registry.records.MixerRole`; any other parameter
is refused) and its source, with the methods of ``self`` it calls and the forwards of the child modules it builds,
for writes to ``self`` (state kept on a module between calls is refused). Registry side: it reads source and builds
records, and runs nothing.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap

from .records import MixerCall, MixerRole
from .sources import defined

__all__ = ["LAYER_ROLES", "ROLES", "layer_call", "mixer_call"]

# parameter name -> role; the first parameter after ``self`` is the hidden states whatever its name
ROLES: dict[str, MixerRole] = {
    **dict.fromkeys(("cache", "cache_params", "past_key_values", "past_key_value", "layer_past"), "state"),
    **dict.fromkeys(("attention_mask", "conv_mask", "mask", "position_ids", "input_ids"), "per_token"),
    "cache_position": "cache_position",
    "position_embeddings": "position_embeddings",
    "use_cache": "no_cache",
    **dict.fromkeys(("output_attentions", "return_dict"), "flag"),
    "seq_idx": "none",  # transformers' padding-free index of the sequence of each token (from its flash kwargs)
}
# a decoder layer run per sequence (its attention inside): its parameters besides a mixer's; the mask the text model
# built for the packed row (`MixerRole` "mask"), ALiBi biases, per-layer head masks, encoder states (None)
LAYER_ROLES: dict[str, MixerRole] = {
    **ROLES,
    **dict.fromkeys(("attention_mask", "causal_mask", "self_attn_mask", "mask"), "mask"),
    **dict.fromkeys(("alibi", "position_bias", "relative_distance"), "key_bias"),  # (L, L): its diagonal block
    **dict.fromkeys(("head_mask", "layer_head_mask", "self_attn_prompt", "cross_attn_prompt"), "per_layer"),
    **dict.fromkeys(("encoder_hidden_states", "encoder_attention_mask", "encoder_attn_mask",
                     "cross_attn_layer_head_mask", "cross_attn_head_mask", "key_value_states"), "encoder"),
    **dict.fromkeys(("output_router_logits", "output_hidden_states"), "flag"),
    **dict.fromkeys(("token_type_ids", "ple_input_ids"), "per_token"),
    # what the previous layer returned per token of its sequence (top-k key indices, router states, the stack of
    # block outputs) or the embeddings: ``(B, L, ...)``
    **dict.fromkeys(("prev_topk_indices", "prev_router_hidden_states", "block_states", "original_hidden_states",
                     "transformer_hidden_states"),
                    "per_token_lead"),
    "state": "state",
    "layer_idx": "flag",
    "sinusoidal_pos": "row_prefix",  # RoFormer's sinusoidal table at the row index: a sequence takes its first rows
}
# in-place tensor methods (``self.state.copy_(...)``) besides any name ending in ``_``
_MUTATORS = {"append", "extend", "update", "setdefault", "pop", "clear", "insert", "add"}


def mixer_call(cls: type, roles_by_name: dict[str, MixerRole] = ROLES) -> MixerCall:
    """The `MixerCall` of ``cls.forward``; `ValueError` naming the parameter or attribute that could carry state
    (or is not proved per token) across a per-sequence call. roles_by_name: the parameter names known."""
    params = list(inspect.signature(cls.forward).parameters.values())[1:]  # type: ignore[attr-defined]
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise ValueError(f"{cls.__name__}.forward takes no hidden states first")
    roles: list[tuple[str, MixerRole]] = [(params[0].name, "tokens")]
    takes_kwargs = False
    for p in params[1:]:
        if p.kind is p.VAR_KEYWORD:
            takes_kwargs = True
        elif p.kind is p.VAR_POSITIONAL:
            raise ValueError(f"{cls.__name__}.forward takes *{p.name}, which cannot be proved per sequence")
        elif p.name in roles_by_name:
            roles.append((p.name, roles_by_name[p.name]))
        else:
            raise ValueError(f"{cls.__name__}.forward takes {p.name!r}, which tfcompat cannot prove is per token "
                             "or stateless (known: " + ", ".join(roles_by_name) + ")")
    for owner in _module_classes(cls):
        written = _writes_to_self(owner)
        if written:
            raise ValueError(f"{owner.__name__}.forward writes {written} (state kept on the module between calls)")
    return MixerCall(cls.__name__, tuple(roles), takes_kwargs)


def layer_call(cls: type) -> MixerCall:
    """The `MixerCall` of a decoder layer class run once per sequence with its own attention and mixers inside
    (`LAYER_ROLES`); `ValueError` as `mixer_call`, for the layer and every class of its module it builds."""
    return mixer_call(cls, LAYER_ROLES)


def _module_classes(cls: type) -> list[type]:
    """``cls`` and the classes of its modeling module its ``__init__`` names, recursively (its child modules, whose
    forwards it calls: RecurrentGemma's RG-LRU)."""
    module = sys.modules[cls.__module__]
    found = [cls]
    for owner in found:
        init = _method(owner, "__init__")
        # every name of the module read in __init__: classes called, or named through a local or a dict of the
        # module (RecurrentGemma's ``TEMPORAL_BLOCK_CLASSES[kind](config)``)
        names = [] if init is None else [n.id for n in ast.walk(init) if isinstance(n, ast.Name)]
        for name in names:
            value = getattr(module, name, None)
            for child in value.values() if isinstance(value, dict) else [value]:
                if isinstance(child, type) and child.__module__ == module.__name__ and child not in found:
                    found.append(child)
    return found


def _writes_to_self(cls: type) -> str:
    """The first write to ``self`` (an attribute assigned, or mutated in place) in ``cls.forward`` or a method of
    ``self`` it calls, as source; "" for none. `ValueError` when a method's source cannot be read."""
    seen: set[str] = set()
    todo = ["forward"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        fn = _method(cls, name)
        if fn is None:
            continue
        for node in ast.walk(fn):
            targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                       if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                if _on_self(t):
                    return ast.unparse(t)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if (node.func.attr.endswith("_") or node.func.attr in _MUTATORS) and _on_self(owner):
                    return ast.unparse(node.func)
                if isinstance(owner, ast.Name) and owner.id == "self" and callable(getattr(cls, node.func.attr, None)):
                    todo.append(node.func.attr)  # a method of self: read it too (a child module's call is its own)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"):
                return ast.unparse(node)
    return ""


def _on_self(node: ast.AST) -> bool:
    """``self.x``, ``self.x[...]``, ``self.x.y``: an attribute of the module (not a local)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
        if isinstance(node, ast.Name) and node.id == "self":
            return True
    return False


def _method(cls: type, name: str) -> ast.FunctionDef | None:
    owner = next((c for c in cls.__mro__ if name in vars(c)), None)
    if owner is None or owner.__module__.startswith("torch."):
        return None  # nn.Module's own methods (``self.register_buffer`` is not called in a forward we accept)
    fn = defined(owner, name)
    if not inspect.isfunction(fn):
        return None
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError):
        raise ValueError(f"the source of {cls.__name__}.{name} cannot be read") from None
    return node if isinstance(node, ast.FunctionDef) else None
