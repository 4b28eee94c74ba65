"""The table shared by the dense decoder-only families (llama, qwen2, qwen3): same ranges, other names.

Boundaries read from the wheels: 4.56 renames the attention cache kwarg past_key_value -> past_key_values;
5.0 drops ``apply_rotary_pos_emb``'s unused ``position_ids`` and moves to ``rope_parameters``; 5.24 renames
the cache kwarg to ``cache``; 5.25 changes nothing the patch reads. Decoder layers forward ``**kwargs`` to
attention throughout.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..records import Entry, Family, Rotary
from ..versions import VersionRange


def dense_entries(family: str, prefix: str) -> tuple[Entry, ...]:
    """Entries for a dense family whose classes are ``{prefix}Attention``, ``{prefix}Model``, ..."""
    base = Entry(
        family=family,
        versions=VersionRange("4.53", "4.56"),
        module=f"transformers.models.{family}.modeling_{family}",
        classes={
            "attention": f"{prefix}Attention",
            "rotary": f"{prefix}RotaryEmbedding",
            "text_model": f"{prefix}Model",
            "decoder_layer": f"{prefix}DecoderLayer",
            "for_causal_lm": f"{prefix}ForCausalLM",
        },
        rotary=Rotary("apply_rotary_pos_emb", "folded"),
        rope_config_key="rope_scaling",
        text_model_positions="text",
        layer_forwards_kwargs=True,
        rope_index_mm_token_types=False,
        cache_kwarg="past_key_value",
        why="attention forward takes past_key_value; apply_rotary_pos_emb has an unused position_ids",
    )
    return (
        base,
        replace(base, versions=VersionRange("4.56", "5.0"), cache_kwarg="past_key_values",
                why="cache kwarg renamed past_key_value -> past_key_values"),
        replace(base, versions=VersionRange("5.0", "5.24"), cache_kwarg="past_key_values",
                rope_config_key="rope_parameters",
                why="rope_parameters; apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)"),
        replace(base, versions=VersionRange("5.24", "5.26"), cache_kwarg="cache", rope_config_key="rope_parameters",
                why="cache kwarg renamed past_key_values -> cache"),
    )


def dense_family(key: str, prefix: str, config_name: str, **tiny: Any) -> Family:
    """A dense family: the table above and a tiny config (2 layers, 4 query heads, 2 KV heads, head_dim 16).

    tiny: extra tiny-config keys (e.g. ``head_dim``).
    """

    def tiny_config(entry: Entry) -> tuple[str, dict[str, Any]]:
        return config_name, dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 rope_theta=10000.0, pad_token_id=0, **tiny)

    return Family(key=key, entries=dense_entries(key, prefix), tiny_config=tiny_config)
