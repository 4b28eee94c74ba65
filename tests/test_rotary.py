"""The uniform rotary call against the installed version's own attention path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tfcompat
from tfcompat.registry import installed_families
from tfcompat.selfcheck import tiny_model

MROPE_FAMILIES = [k for k, f in installed_families().items() if f.is_vision]


@pytest.fixture(scope="module", params=MROPE_FAMILIES)
def setup(request):
    r = tfcompat.resolve(request.param)
    model = tiny_model(request.param, "sdpa")
    attn = next(m for m in model.modules() if isinstance(m, r.attention_cls))
    text_model = next(m for m in model.modules() if isinstance(m, r.text_model_cls))
    return r, model, attn, text_model


@st.composite
def mrope_rows(draw):
    """(3, 1, L) rows [t; h; w]: text runs (equal rows) and image blocks (h, w grids), as rope_index makes."""
    rows, pos = [], 0
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            n = draw(st.integers(1, 6))
            run = torch.arange(pos, pos + n)
            rows.append(torch.stack([run, run, run]))
            pos += n
        else:
            h, w = draw(st.integers(1, 3)), draw(st.integers(1, 3))
            hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            rows.append(torch.stack([torch.full((h * w,), pos), pos + hh.flatten(), pos + ww.flatten()]))
            pos += max(h, w)
    return torch.cat(rows, dim=1)[:, None]


class TestUniformRotary:
    """Rule: Resolved.apply_rotary(q, k, cos, sin, config) gives the q/k the version's attention computes."""

    @settings(max_examples=15, deadline=None)
    @given(rows=mrope_rows(), seed=st.integers(0, 2**16))
    def test_matches_attention_path(self, setup, rows, seed):
        r, model, attn, text_model = setup
        captured = {}
        interface = __import__("transformers.modeling_utils", fromlist=["x"]).AttentionInterface

        def spy(module, query, key, value, attention_mask, **kwargs):
            if module is attn:
                captured["qk"] = (query, key)
            return interface._global_mapping["sdpa"](module, query, key, value, attention_mask, **kwargs)

        def grab_inputs(module, args, kwargs):
            captured["hidden"] = kwargs.get("hidden_states", args[0] if args else None)
            captured["pe"] = kwargs["position_embeddings"]

        interface.register("tfcompat_test_spy", spy)
        old = attn.config._attn_implementation
        attn.config._attn_implementation = "tfcompat_test_spy"
        hook = attn.register_forward_pre_hook(grab_inputs, with_kwargs=True)
        try:
            length = rows.shape[-1]
            ids = torch.randint(0, 200, (1, length), generator=torch.Generator().manual_seed(seed))
            # the text model takes whatever this version takes: 3 rows everywhere it runs stock
            with torch.no_grad():
                text_model(input_ids=ids, position_ids=rows, attention_mask=torch.ones_like(ids), use_cache=False)
                hidden = captured["hidden"]
                b, length, _ = hidden.shape
                # (B, L, H, D), or (B, L, H, 2D) = [query | output gate] per head (Qwen3.5's gated attention)
                q = attn.q_proj(hidden).view(b, length, attn.config.num_attention_heads, -1)[..., : attn.head_dim]
                k = attn.k_proj(hidden).view(b, length, -1, attn.head_dim)
                if hasattr(attn, "q_norm"):  # Qwen3-style attention normalizes each head before the rotary
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, L, H, D) -> (B, H, L, D)
                cos, sin = captured["pe"]
                q_rot, k_rot = r.apply_rotary(q, k, cos, sin, model.config)
        finally:
            hook.remove()
            attn.config._attn_implementation = old
            interface._global_mapping.pop("tfcompat_test_spy")
        q_ref, k_ref = captured["qk"]
        torch.testing.assert_close(q_rot, q_ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(k_rot, k_ref, atol=1e-6, rtol=0)
        # rotary is position dependent: it must not be the identity on these rows
        assert not torch.allclose(q_rot, q) or rows.max() == 0

    def test_text_config_and_top_config_agree(self, setup):
        r, model, _, _ = setup
        assert r.rope_config(model.config)["mrope_section"] == r.rope_config(model.config.text_config)["mrope_section"]
        _, tiny = r.spec.tiny_config(r.entry)
        declared = tiny["text_config"][r.entry.rope_config_key]["mrope_section"]
        assert r.rope_config(model.config)["mrope_section"] == declared
