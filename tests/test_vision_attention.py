"""`patch(model, vision_attention=True)`: a tower that splits its patches at ``cu_seqlens`` runs one varlen call per
block through tfcompat's backends (`tfcompat.hf.vision_attention`).

Oracle: the stock model (sdpa: one attention call per image or window). Rules: the routed tower gives the stock
logits per token, unpacked and packed with images, forward and backward, with one attention call per block where
stock makes one per window; every image-text-to-text type whose tower routes so passes the every-type check with it
or is refused with a typed error; a model without such a tower, a transformers without the rule, attention dropout
and a non-bool option are refused at ``patch()``; undo restores the tower's implementation.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from packaging.version import Version

import tfcompat
import tfcompat.hf.vision_attention as va
from tests.every_type import vlm_check
from tfcompat.registry.derive import module_name
from tfcompat.registry.versions import installed_transformers
from tfcompat.tiny_models import model_types, sample_examples, tiny_config, tiny_model

ROUTES = Version(installed_transformers()) >= Version("5.0")  # 4.x towers hand boundaries to "flash_attention_2" alone
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "glm4v", "qwen3_vl"]


def _routed_types() -> list[str]:
    """The image-text-to-text types whose modeling module, or a sub-config's (a Pixtral tower in Mistral 3), holds a
    forward that routes boundaries by a flash name."""
    def routes(model_type: str) -> bool:
        try:
            source = inspect.getsource(importlib.import_module(module_name(model_type)))
        except Exception:  # noqa: BLE001 -- a type without a module of its own is not routed
            return False
        return all(name in source for name in ("is_flash_attention_requested", "cu_seq_lens_q"))

    found = []
    for model_type in model_types("image_text_to_text"):
        try:
            config = tiny_config(model_type, "image_text_to_text")
        except Exception:  # noqa: BLE001 -- the sweep of every type reports it
            continue
        subs = {getattr(config, n).model_type for n in getattr(config, "sub_configs", {})
                if getattr(getattr(config, n, None), "model_type", None)}
        if any(routes(t) for t in {model_type, *subs}):
            found.append(model_type)
    return found


@pytest.fixture
def calls(monkeypatch):
    """Counts the tower attention calls that reach tfcompat's core (non-causal and causal)."""
    seen: list[tuple[int, ...]] = []

    def counted(fn):
        def run(q, *args, **kwargs):
            seen.append(tuple(q.shape))
            return fn(q, *args, **kwargs)
        return run

    monkeypatch.setattr(va, "cross_attention", counted(va.cross_attention))
    monkeypatch.setattr(va, "varlen_attention", counted(va.varlen_attention))
    return seen


def _model(model_type: str) -> torch.nn.Module:
    if model_type not in model_types("image_text_to_text"):
        pytest.skip(f"transformers {installed_transformers()} ships no {model_type}")
    return tiny_model(model_type, "image_text_to_text")


def _blocks(model: torch.nn.Module) -> int:
    vision = model.config.vision_config
    return next(getattr(vision, n) for n in ("depth", "num_hidden_layers") if hasattr(vision, n))


@pytest.mark.skipif(not ROUTES, reason="the towers of 4.x hand boundaries only to flash_attention_2")
@pytest.mark.parametrize("model_type", FAMILIES)
def test_routed_tower_gives_the_stock_logits_with_one_call_per_block(model_type, calls):
    model = _model(model_type)
    examples = sample_examples(model, (9, 7, 11), images=True)
    with torch.no_grad():
        expected = [model(**ex).logits for ex in examples]
    with tfcompat.patch(model, vision_attention=True):
        with torch.no_grad():
            got = [model(**ex).logits for ex in examples]
            assert len(calls) == 2 * _blocks(model)  # two sequences hold an image: one call per block each
            packed = model(**tfcompat.pack(model, examples).model_inputs).logits[0]
        assert len(calls) == 3 * _blocks(model)  # the packed row: both images in one call per block
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=0)
    lengths = [ex["input_ids"].shape[1] for ex in examples]
    for g, e in zip(packed.split(lengths), expected):
        torch.testing.assert_close(g, e[0], atol=1e-5, rtol=0)
    assert model.config.vision_config._attn_implementation == "sdpa"  # undone


@pytest.mark.skipif(not ROUTES, reason="the towers of 4.x hand boundaries only to flash_attention_2")
def test_gradients_through_the_routed_tower_under_checkpointing_equal_stock(calls):
    model = _model("qwen2_5_vl").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ex = sample_examples(model, (12,), images=True)[0]

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(**ex).logits.square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and "visual" in n}

    expected = grads()
    with tfcompat.patch(model, vision_attention=True):
        got = grads()
    assert calls and got.keys() == expected.keys() and expected
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.skipif(not ROUTES, reason="the towers of 4.x hand boundaries only to flash_attention_2")
def test_a_wrong_tower_attention_is_caught(monkeypatch):
    """Control: the oracle sees a tower attention that ignores the boundaries."""
    model = _model("qwen2_5_vl")
    examples = sample_examples(model, (9, 7, 11), images=True)
    with torch.no_grad():
        expected = torch.cat([model(**ex).logits[0] for ex in examples])
    stock = va.cross_attention

    def whole(q, k, v, q_seqs, k_seqs, **kwargs):  # every patch of the block sees every other image's
        return stock(q, k, v, *[va.PackedSeqs(s.cu_seqlens[[0, -1]], s.total, (s.total,)) for s in (q_seqs, k_seqs)],
                     **kwargs)

    monkeypatch.setattr(va, "cross_attention", whole)
    with tfcompat.patch(model, vision_attention=True), torch.no_grad():
        got = model(**tfcompat.pack(model, examples).model_inputs).logits[0]
    assert (got - expected).abs().max() > 1e-3


@pytest.mark.broad
@pytest.mark.sweep
@pytest.mark.ci_sweep
@pytest.mark.parametrize("model_type", _routed_types() if ROUTES else [])
def test_every_routed_type_packs_exactly_or_is_refused(request, model_type, calls):
    outcome = vlm_check(model_type, "sdpa", vision_attention=True)
    if outcome.status == "skipped":
        outcome = vlm_check(model_type, "eager", vision_attention=True)
    request.node.user_properties.append(("outcome", f"{outcome.status}: {outcome.reason}"))
    if outcome.status == "skipped":
        pytest.skip(f"{model_type}: {outcome.reason}")
    if outcome.status == "unbuildable":
        pytest.xfail(f"{model_type}: tiny model cannot be built or run with an image: {outcome.reason}")
    assert outcome.status in ("pass", "refused"), outcome.reason
    if outcome.status == "pass":
        assert calls, "the tower's attention never reached tfcompat"


def test_a_model_without_a_routed_tower_is_refused():
    model = tiny_model("qwen2")
    with pytest.raises(tfcompat.PatchError, match="hands its attention boundaries") as info:
        tfcompat.patch(model, vision_attention=True)
    assert info.value.family == "qwen2" and str(installed_transformers()) in str(info.value)
    assert not tfcompat.is_patched(model)


@pytest.mark.skipif(ROUTES, reason="4.x: the towers route to flash_attention_2 alone")
def test_a_4x_tower_is_refused():
    model = _model("qwen2_5_vl")
    with pytest.raises(tfcompat.PatchError, match="no such rule|no module here"):
        tfcompat.patch(model, vision_attention=True)


@pytest.mark.skipif(not ROUTES, reason="the towers of 4.x hand boundaries only to flash_attention_2")
def test_tower_dropout_and_bad_options_are_refused():
    model = _model("qwen2_5_vl")
    with pytest.raises(tfcompat.PatchError, match="True or False"):
        tfcompat.patch(model, vision_attention="yes")
    attention = next(m for m in model.model.visual.modules() if hasattr(m, "attention_dropout"))
    attention.attention_dropout = 0.1
    with pytest.raises(tfcompat.PatchError, match="attention dropout 0.1"):
        tfcompat.patch(model, vision_attention=True)


@pytest.mark.skipif(not ROUTES, reason="the towers of 4.x hand boundaries only to flash_attention_2")
def test_an_explicit_flash_that_cannot_run_the_towers_head_dim_is_refused_at_patch(monkeypatch):
    """FlashAttention-4 on Hopper computes wrong gradients at head dims that are not multiples of 32 (80 in
    Qwen2.5-VL's tower): an explicit backend="flash" is a `PatchError` at patch() naming the head dim; "auto"
    patches (it takes the next backend per call)."""
    from tfcompat.core import attention

    def fa4(*args, **kwargs):
        raise AssertionError("not called")

    fa4.__module__ = "flash_attn.cute.interface"
    monkeypatch.setattr(attention, "_flash_varlen", lambda device: fa4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    attention._gap.cache_clear()
    attention._flash_head_dim_gap.cache_clear()
    from tfcompat.tiny_models import tiny_config

    _model("qwen2_5_vl")  # skips where the release ships none
    config = tiny_config("qwen2_5_vl", "image_text_to_text")  # text head dim 32 (FA4 runs it), the tower's 16
    config.text_config.hidden_size = config.vision_config.out_hidden_size = 128
    config.text_config.rope_parameters["mrope_section"] = [4, 6, 6]
    model = tiny_model("qwen2_5_vl", "image_text_to_text", config=config)
    assert model.model.language_model.layers[0].self_attn.head_dim == 32
    dims = {m.head_dim for m in model.model.visual.modules() if isinstance(getattr(m, "head_dim", None), int)}
    assert dims and all(d % 32 for d in dims), dims  # the tiny tower's head dim is not a multiple of 32
    try:
        with pytest.raises(tfcompat.PatchError, match=f"(?s)'flash' cannot run the tower.*head dim {min(dims)}"):
            tfcompat.patch(model, backend="flash", vision_attention=True)
        assert not tfcompat.is_patched(model)
        with tfcompat.patch(model, backend="flash"):  # the text stack alone: FA4 runs head dim 32
            pass
        with tfcompat.patch(model, vision_attention=True):  # "auto"
            pass
    finally:
        attention._gap.cache_clear()
        attention._flash_head_dim_gap.cache_clear()


@pytest.mark.skipif(not ROUTES, reason="the towers of 4.x hand boundaries only to flash_attention_2")
def test_a_call_without_boundaries_is_refused():
    model = _model("qwen2_5_vl")
    with tfcompat.patch(model, vision_attention=True):
        attention = next(m for m in model.model.visual.modules() if va.BACKEND_ATTR in vars(m))
        q = torch.zeros(1, 2, 4, 8)
        with pytest.raises(tfcompat.PatchedModelError, match="without boundaries"):
            va.vision_attention(attention, q, q, q, None)
        with pytest.raises(tfcompat.PatchedModelError, match="an attention mask"):
            va.vision_attention(attention, q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool),
                                cu_seq_lens_q=torch.tensor([0, 4], dtype=torch.int32))


def test_non_causal_core_backends_on_cpu():
    """`cross_attention`'s backend: "flex" and "cudnn" (a text model's choice) run per-sequence SDPA, exactly; "torch"
    and "flash" cannot run on CPU and say so; q/k/v of different dtypes are refused."""
    from tfcompat.core.cross_attention import cross_attention
    from tfcompat.core.packing import from_lengths

    g = torch.Generator().manual_seed(0)
    seqs = from_lengths((5, 9, 3))
    q, k, v = (torch.randn(17, 4, 16, generator=g) for _ in range(3))
    reference = cross_attention(q, k, v, seqs, seqs, backend="sdpa")
    for backend in ("auto", "flex", "cudnn"):
        assert torch.equal(cross_attention(q, k, v, seqs, seqs, backend=backend), reference)
    for backend in ("torch", "flash"):
        with pytest.raises(tfcompat.InvalidInputError, match=f"'{backend}' cannot run this non-causal attention"):
            cross_attention(q, k, v, seqs, seqs, backend=backend)
    with pytest.raises(tfcompat.InvalidInputError, match="one floating dtype"):
        cross_attention(q, k.double(), v, seqs, seqs)


@pytest.mark.parametrize("kind", ["fa2", "fa3", "fa4", "torch"])
@pytest.mark.parametrize("v_dim", [16, 8])
def test_non_causal_kernel_plumbing(kind, v_dim, monkeypatch):
    """Rule: the flash and torch backends hand each kernel non-causal attention, the boundaries, the scale and one
    head dim (v padded and the output sliced back), with grouped key heads; checked on CPU against emulators of the
    kernels' documented semantics (tests/test_attention_features.py; the kernels run in tests/gpu)."""
    import tfcompat.core.cross_attention as ca
    from tests.test_attention_features import _fa2, _fa3, _fa4, _torch_varlen_fake
    from tfcompat.core.packing import from_lengths

    if kind == "torch":
        found = (_torch_varlen_fake, frozenset(inspect.signature(_torch_varlen_fake).parameters))
        monkeypatch.setattr(ca, "_can_torch", lambda q, k: True)
        monkeypatch.setattr(ca, "_torch_varlen", lambda: found)
    else:
        monkeypatch.setattr(ca, "_can_flash", lambda q, k: True)
        monkeypatch.setattr(ca, "_flash_varlen", lambda device: {"fa2": _fa2, "fa3": _fa3, "fa4": _fa4}[kind])
    g = torch.Generator().manual_seed(3)
    seqs = from_lengths((9, 1, 20, 14))
    q, k = torch.randn(44, 6, 16, generator=g), torch.randn(44, 2, 16, generator=g)
    v = torch.randn(44, 2, v_dim, generator=g)
    got = ca.cross_attention(q, k, v, seqs, seqs, scale=0.3, backend="torch" if kind == "torch" else "flash")
    torch.testing.assert_close(got, ca.cross_attention(q, k, v, seqs, seqs, scale=0.3, backend="sdpa"),
                               atol=1e-5, rtol=1e-5)


def _derived_routed_model() -> torch.nn.Module:
    """A tiny model of the first derived vision-language type whose tower routes on this transformers (Mistral 3's
    Pixtral tower on 5.25, not on 5.18, ...): picked by the property, not by name."""
    for model_type in _routed_types():
        try:
            if tfcompat.resolve(model_type).entry.derived_vision is None:
                continue
            model = tiny_model(model_type, "image_text_to_text")
        except Exception:  # noqa: BLE001 -- refused or not buildable here: the next type
            continue
        if va.towers(model, [model.config.get_text_config()]):
            return model
    pytest.skip(f"no derived vision-language type routes its tower on transformers {installed_transformers()}")


@pytest.mark.skipif(not ROUTES, reason="the towers of 4.x hand boundaries only to flash_attention_2")
def test_the_patch_time_proof_routes_the_copys_tower(calls, monkeypatch):
    """A derived type's proof (a tiny copy, packed with images against stock) patches the copy as the model is patched:
    with vision_attention, its tower's attention reaches tfcompat before the model's first forward."""
    import tfcompat.hf.proof as hf_proof

    monkeypatch.setenv("TFCOMPAT_PROVE", "1")
    monkeypatch.setattr(hf_proof, "_CACHE", {})  # proven by an earlier test of this process: proven again here
    model = _derived_routed_model()
    with tfcompat.patch(model, vision_attention=True) as handle:
        assert handle.proof is not None and handle.proof.status.startswith("proven") and calls


@pytest.mark.skipif(not ROUTES, reason="the towers of 4.x hand boundaries only to flash_attention_2")
@pytest.mark.parametrize(("window", "full"), [(28, [0]), (56, [1, 3]), (112, []), (224, [2])])
def test_other_tower_configs_route_exactly(window, full, calls):
    """Configs other than the zoo's: windows smaller and larger than the images, full-attention blocks anywhere or
    none, images of several window counts; the routed tower equals the stock one (fp32, CPU: SDPA per window)."""
    from tfcompat.tiny_models import tiny_config

    if "qwen2_5_vl" not in model_types("image_text_to_text"):
        pytest.skip(f"transformers {installed_transformers()} ships no qwen2_5_vl")
    config = tiny_config("qwen2_5_vl", "image_text_to_text")
    config.vision_config.update({"depth": 4, "window_size": window, "fullatt_block_indexes": full})
    model = tiny_model("qwen2_5_vl", "image_text_to_text", config=config)
    vision = model.config.vision_config
    grid = torch.tensor([[1, 16, 12], [1, 8, 20], [2, 4, 4]])
    patch = getattr(vision, "in_channels", 3) * vision.temporal_patch_size * vision.patch_size ** 2
    pixels = torch.randn(int(grid.prod(-1).sum()), patch, generator=torch.Generator().manual_seed(0))

    def features() -> torch.Tensor:
        out = model.model.visual(pixels, grid_thw=grid)
        return out.pooler_output if hasattr(out, "pooler_output") else out

    with torch.no_grad():
        expected = features()
        with tfcompat.patch(model, vision_attention=True):
            got = features()
    assert len(calls) == 4  # one per block
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
