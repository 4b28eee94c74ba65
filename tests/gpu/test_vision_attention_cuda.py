"""Non-causal varlen attention on CUDA (`tfcompat.core.cross_attention`'s "flash" where installed, "torch", "auto")
against the "sdpa" backend, and a Qwen2.5-VL tower routed by ``patch(model, vision_attention=True)`` against stock.

Tolerances as tests/gpu/test_varlen_cuda.py: the inputs are drawn in fp32 and rounded to bf16, the reference is the
"sdpa" backend in fp32 on those rounded values; forward and backward (dq, dk, dv for a random output gradient), a
fast backend's max error against it is at most twice the bf16 "sdpa" backend's plus 1e-2 / 4. Routed tower: bf16
tower output within 5e-2 of stock bf16 (sdpa per window), and its error against the stock fp32 tower at most twice
stock bf16's plus 1e-2; the routed tower's host syncs per forward do not grow with its depth (zero per block).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import tfcompat
from tfcompat.core.cross_attention import cross_attention
from tfcompat.core.packing import from_lengths

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine")]

DEVICE = "cuda"
TOL = 1e-2


def _run(q, k, v, qs, ks, backend):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = cross_attention(q, k, v, qs, ks, scale=0.11, backend=backend)
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    grad = torch.randn(out.shape, generator=gen, device=DEVICE, dtype=torch.float32).to(out.dtype)
    out.backward(grad)
    return [out.float(), *(t.grad.float() for t in (q, k, v))]


@pytest.mark.parametrize("backend", ["flash", "torch", "auto"])
@pytest.mark.parametrize("case", ["windows", "images_gqa", "cross"])
def test_non_causal_backends_match_sdpa(backend, case):
    from tfcompat.core import attention

    if backend == "flash" and attention._flash_varlen(torch.device(DEVICE)) is None:
        pytest.skip("flash-attn is not installed")
    if backend == "torch" and attention._torch_varlen() is None:
        pytest.skip("this torch has no varlen_attn")
    q_lengths = {"windows": [64] * 37 + [20, 48], "images_gqa": [1810, 967, 2401], "cross": [33, 500, 129]}[case]
    k_lengths = [71, 260, 1000] if case == "cross" else q_lengths
    hq, hkv, d = (16, 16, 80) if case == "windows" else (16, 4, 128)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(sum(q_lengths), hq, d, generator=gen, device=DEVICE).bfloat16()
    k = torch.randn(sum(k_lengths), hkv, d, generator=gen, device=DEVICE).bfloat16()
    v = torch.randn(sum(k_lengths), hkv, d, generator=gen, device=DEVICE).bfloat16()
    qs, ks = from_lengths(q_lengths, DEVICE), from_lengths(k_lengths, DEVICE)
    if backend == "flash" and attention._flash_head_dim_gap(torch.device(DEVICE), d):
        from tfcompat.errors import InvalidInputError

        with pytest.raises(InvalidInputError, match=f"head dim {d}"):  # FA4 on Hopper at 80: refused, not wrong
            _run(q, k, v, qs, ks, backend)
        return
    ref = _run(q.float(), k.float(), v.float(), qs, ks, "sdpa")
    low = _run(q, k, v, qs, ks, "sdpa")
    got = _run(q, k, v, qs, ks, backend)
    for name, g, lo, r in zip(("out", "dq", "dk", "dv"), got, low, ref):
        scale = max(1.0, float(r.abs().max()))
        err, base = float((g - r).abs().max()) / scale, float((lo - r).abs().max()) / scale
        assert err <= 2 * base + TOL / 4, (name, err, base)


def _tower(depth: int, dtype: torch.dtype):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = dict(depth=depth, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=128,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[depth - 1])
    text = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                num_hidden_layers=1, vocab_size=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]})
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation="sdpa")
    return model.to(DEVICE, dtype).eval()


def _images():
    grid = torch.tensor([[1, 32, 48], [1, 16, 20], [1, 40, 24]], device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=gen, device=DEVICE)
    return pixels, grid


def _features(model, pixels, grid):
    out = model.model.visual(pixels.to(model.dtype), grid_thw=grid)
    return (out.pooler_output if hasattr(out, "pooler_output") else out).float()


def test_routed_tower_matches_stock_and_syncs_once_per_forward_not_per_block():
    pixels, grid = _images()
    exact = _tower(4, torch.float32)
    model = _tower(4, torch.bfloat16)
    with torch.no_grad():
        ref, stock = _features(exact, pixels, grid), _features(model, pixels, grid)
        with tfcompat.patch(model, vision_attention=True):
            got = _features(model, pixels, grid)
    assert float((got - stock).abs().max()) <= 5e-2
    assert float((got - ref).abs().max()) <= 2 * float((stock - ref).abs().max()) + 1e-2

    def syncs(depth: int) -> int:
        tower = _tower(depth, torch.bfloat16)
        with tfcompat.patch(tower, vision_attention=True), torch.no_grad():
            _features(tower, pixels, grid)  # warm
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    _features(tower, pixels, grid)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return sum("synchroniz" in str(w.message) for w in caught)

    assert syncs(8) == syncs(2)
