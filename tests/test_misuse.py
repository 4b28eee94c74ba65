"""The misuse probes (issue 10): each test is one mistake a new user makes, parametrized over the registered
families where it applies, asserting either the typed error and its fix line, or the right (per-sequence /
stock) answer. Names: ``test_refuses_*`` end in a typed error, ``test_answers_*`` in the right answer.
"""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch
import torch.distributed as dist

import tfcompat
from tests.distributed import misuse_workers
from tests.distributed.harness import run_world
from tfcompat.inputs.reference_rope import REFERENCES
from tfcompat.registry import installed_families
from tfcompat.registry.derive import attention_call
from tfcompat.selfcheck import sample_sequences, stock_inputs, tiny_model

FAMILIES = list(installed_families())
VISION = [k for k, f in installed_families().items() if f.is_vision]
TEXT = [k for k, f in installed_families().items() if not f.is_vision]
IMAGE = (1, 4, 6)


def _typed(info, cls=tfcompat.InvalidInputError, family: str | None = None) -> None:
    """The error is ``cls`` (never a PatchError outside patch()), names the family, and has a fix line."""
    err = info.value
    assert type(err) is cls, type(err)
    assert err.fix and "\n  fix: " in str(err), str(err)
    if family is not None:
        assert err.family == family


def _one(model, item=IMAGE, n=8, seed=0):
    return sample_sequences(model, [n], [item], seed=seed)[0]


def _packed_rows(model, family):
    """Two sequences (the second with an image on vision families) as raw packed inputs."""
    item = IMAGE if family in VISION else None
    seqs = sample_sequences(model, [6, 8], [None, item], seed=1)
    return tfcompat.pack(model, [{"input_ids": s.input_ids[0], **s.vision_inputs()} for s in seqs]), seqs


# --- silent results -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_answers_labels_per_sequence(family):
    """Raw labels over a packed row: the loss is the per-sequence loss, not one crossing the boundary."""
    r = tfcompat.resolve(family)
    model = tiny_model(family, "sdpa")
    if not hasattr(model.config, "vocab_size"):  # 4.53's Qwen-VL loss reads it; real checkpoints carry it
        model.config.vocab_size = model.config.get_text_config().vocab_size
    packed, seqs = _packed_rows(model, family)
    stock = [model(**stock_inputs(r, model, s), use_cache=False).logits[0] for s in seqs]
    total = sum(torch.nn.functional.cross_entropy(lg[:-1], s.input_ids[0, 1:], reduction="sum")
                for lg, s in zip(stock, seqs))
    expected = total / sum(s.input_ids.shape[1] - 1 for s in seqs)
    inputs = {k: v for k, v in packed.model_inputs.items() if k != "tfcompat_context"}
    with tfcompat.patch(model):
        loss = model(**inputs, labels=inputs["input_ids"]).loss
    assert abs(float(loss) - float(expected)) <= 1e-5


@pytest.mark.parametrize("family", VISION)
def test_refuses_vision_tokens_with_text_only_position_ids(family):
    model = tiny_model(family, "sdpa")
    seq = _one(model)
    pos = torch.arange(seq.input_ids.shape[1])[None]
    with tfcompat.patch(model), pytest.raises(tfcompat.InvalidInputError,
                                              match="text-only \\(B, L\\) position ids") as info:
        model(input_ids=seq.input_ids, position_ids=pos, **seq.vision_inputs())
    _typed(info, family=family)


@pytest.mark.parametrize("family", VISION)
def test_refuses_whole_row_rope_index(family):
    """rope_index over the whole packed row with a per-sequence text row: the M-RoPE rows do not restart."""
    model = tiny_model(family, "sdpa")
    a, b = sample_sequences(model, [6, 8], [IMAGE, None], seed=2)
    ids = torch.cat([a.input_ids, b.input_ids], dim=1)
    pos = tfcompat.rope_index(model, ids, image_grid_thw=a.image_grid_thw)
    pos[0] = torch.cat([torch.arange(a.input_ids.shape[1]), torch.arange(b.input_ids.shape[1])])
    with tfcompat.patch(model), pytest.raises(tfcompat.InvalidInputError, match="not per sequence") as info:
        model(input_ids=ids, position_ids=pos, **a.vision_inputs())
    _typed(info, family=family)


@pytest.mark.parametrize("family", FAMILIES)
def test_refuses_negative_position_ids(family):
    model = tiny_model(family, "sdpa")
    packed, _ = _packed_rows(model, family)
    inputs = {k: v for k, v in packed.model_inputs.items() if k != "tfcompat_context"}
    inputs["position_ids"] = inputs["position_ids"] - 2
    with tfcompat.patch(model), pytest.raises(tfcompat.InvalidInputError, match="negative position ids") as info:
        model(**inputs)
    _typed(info, family=family)


@pytest.mark.parametrize("family", FAMILIES)
def test_refuses_packed_row_with_padding(family):
    model = tiny_model(family, "sdpa")
    packed, _ = _packed_rows(model, family)
    inputs = {k: v for k, v in packed.model_inputs.items() if k != "tfcompat_context"}
    mask = torch.ones_like(inputs["input_ids"])
    mask[0, 0] = 0  # left padding (right padding is a batch of packs: tests/test_padded_packs.py)
    with tfcompat.patch(model), pytest.raises(tfcompat.InvalidInputError, match="a packed row with padding") as info:
        model(**inputs, attention_mask=mask)
    _typed(info, family=family)


@pytest.mark.parametrize("family", VISION)
def test_refuses_three_row_position_ids(family):
    model = tiny_model(family, "sdpa")
    packed, _ = _packed_rows(model, family)
    inputs = {k: v for k, v in packed.model_inputs.items() if k != "tfcompat_context"}
    inputs["position_ids"] = inputs["position_ids"][1:]
    with tfcompat.patch(model), pytest.raises(tfcompat.InvalidInputError, match="no text row") as info:
        model(**inputs)
    _typed(info, family=family)


def test_refuses_world_group_before_init():
    assert not dist.is_initialized()
    model = tiny_model("qwen2", "sdpa")
    with pytest.raises(tfcompat.PatchError, match="not initialized") as info:
        tfcompat.patch(model, ulysses_group=dist.group.WORLD)  # None before init_process_group
    _typed(info, tfcompat.PatchError)
    with pytest.raises(tfcompat.PatchError, match="not a process group") as info:
        tfcompat.patch(model, ulysses_group=object())
    _typed(info, tfcompat.PatchError)
    assert not tfcompat.is_patched(model)


def test_refuses_shard_inputs_without_process_group():
    with pytest.raises(tfcompat.InvalidInputError, match="initialized torch.distributed") as info:
        tfcompat.ulysses.shard_inputs(torch.arange(6)[None], torch.arange(6)[None])
    _typed(info)


def test_refuses_ranks_disagreeing_on_boundaries():
    run_world(misuse_workers.boundaries_disagree, 2)


def test_refuses_bad_group_labels_and_sp_labels():
    run_world(misuse_workers.group_and_labels_checks, 2)


def test_refuses_a_rope_of_the_call_length_under_ulysses():
    run_world(misuse_workers.length_rope_under_ulysses, 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_refuses_sliding_layer_types_without_a_window(family):
    """A layer that config.layer_types marks sliding while its attention passes no window (set after the model was
    built, or a model that ignores layer types): its mask and its flash path would disagree, so it is refused."""
    r = tfcompat.resolve(family)
    model = tiny_model(family, "sdpa")
    attn = next(m for m in model.modules() if isinstance(m, r.attention_cls))
    types = ["full_attention"] * model.config.get_text_config().num_hidden_layers
    types[attn.layer_idx] = "sliding_attention"
    attn.config.layer_types, attn.config.sliding_window = types, 4
    # where the release's text model reads its masks from masking_utils (tfcompat.registry.mask_rules), the refusal
    # names the window its stock mask applies; else that the layer type is sliding
    with pytest.raises(tfcompat.PatchError, match="'sliding_attention', but .* passes no sliding_window|"
                       "attention call says window None, its stock mask .*window 4") as info:
        tfcompat.patch(model)
    _typed(info, tfcompat.PatchError, family)
    assert not tfcompat.is_patched(model)


@pytest.mark.parametrize("family", [f for f in FAMILIES if dict(attention_call(
    tfcompat.resolve(f).attention_cls).keywords).get("sliding_window") == "self.sliding_window"])
def test_refuses_windows_on_a_backend_without_them(family):
    """A window the attention passes is recorded on its module; a backend that cannot run windows (cudnn: plain
    causal attention only) is refused at patch(), naming the layer's features."""
    r = tfcompat.resolve(family)
    model = tiny_model(family, "sdpa")
    attn = next(m for m in model.modules() if isinstance(m, r.attention_cls))
    attn.sliding_window = 4
    text = model.config.get_text_config()  # its stock mask the same window (else the two disagree: refused too)
    types = ["full_attention"] * text.num_hidden_layers
    types[attn.layer_idx] = "sliding_attention"
    text.layer_types, text.sliding_window = types, 4
    with pytest.raises(tfcompat.PatchError, match=r"'cudnn' cannot run .*window 4") as info:
        tfcompat.patch(model, backend="cudnn")
    _typed(info, tfcompat.PatchError, family)
    assert not tfcompat.is_patched(model)
    with tfcompat.patch(model) as handle:
        assert vars(attn)["_tfcompat_features"].window == 4
        assert any(rec.target is attn and "window 4" in rec.note for rec in handle.records)


@pytest.mark.parametrize("family", FAMILIES)
def test_refuses_attention_changed_after_patch_and_undo_keeps_it(family):
    model = tiny_model(family, "sdpa")
    packed, _ = _packed_rows(model, family)
    handle = tfcompat.patch(model)
    configs = [c for c, _ in _router_configs(handle)]
    for c in configs:
        c._attn_implementation = "eager"  # what set_attn_implementation("eager") does to the text config
    with pytest.raises(tfcompat.PatchedModelError, match="changed to 'eager' after patch") as info:
        model(**packed.model_inputs)
    _typed(info, tfcompat.PatchedModelError, family)
    handle.undo()
    assert all(c._attn_implementation == "eager" for c in configs)


def _router_configs(handle):
    return [(r.target, r.old) for r in handle.records if r.scope == "config"]


@pytest.mark.parametrize("family", VISION)
class TestRopeIndexInputs:
    def test_refuses_bogus_impl(self, family):
        model = tiny_model(family, "sdpa")
        with pytest.raises(tfcompat.InvalidInputError, match="unknown rope_index impl 'bogus'") as info:
            tfcompat.rope_index(model, _one(model).input_ids, impl="bogus")
        _typed(info, family=family)

    @pytest.mark.parametrize("bad", ["float", "1d"])
    def test_refuses_ids_that_are_not_integer_b_l(self, family, bad):
        model = tiny_model(family, "sdpa")
        ids = torch.arange(6) + 3
        ids = ids.float()[None] if bad == "float" else ids
        with pytest.raises(tfcompat.InvalidInputError, match="integer input_ids of shape \\(B, L\\)") as info:
            tfcompat.rope_index(model, ids)
        _typed(info, family=family)

    @pytest.mark.parametrize("impl", ["installed", "reference"])
    @pytest.mark.parametrize("bad", ["extra", "missing"])
    def test_refuses_grids_that_disagree_with_placeholders(self, family, bad, impl):
        model = tiny_model(family, "sdpa")
        seq = _one(model)
        grid = torch.cat([seq.image_grid_thw, seq.image_grid_thw]) if bad == "extra" else None
        with pytest.raises(tfcompat.InvalidInputError,
                           match="image placeholder tokens and image_grid_thw disagree") as info:
            tfcompat.rope_index(model, seq.input_ids, image_grid_thw=grid, impl=impl)
        _typed(info, family=family)


@pytest.mark.parametrize("family", TEXT)
def test_refuses_rope_index_and_embed_inputs_on_a_text_family(family):
    model = tiny_model(family, "sdpa")
    for call in (lambda: tfcompat.rope_index(model, torch.arange(4)[None]),
                 lambda: tfcompat.embed_inputs(model, torch.arange(4)[None])):
        with pytest.raises(tfcompat.InvalidInputError, match="needs a vision-language family") as info:
            call()
        _typed(info, family=family)


def test_answers_decimal_seconds_like_the_installed_index():
    """Qwen2.5-VL: the reference's video times follow transformers' float32 torch arithmetic (0.7, 1.3, 2.6, ...)."""
    if "qwen2_5_vl" not in installed_families():
        pytest.skip("qwen2_5_vl is not in this transformers")
    r = tfcompat.resolve("qwen2_5_vl")
    if "seconds_truncated" in r.entry.rope_index_deviations:
        pytest.skip(f"transformers {r.transformers_version} truncates seconds (declared deviation)")
    model = tiny_model("qwen2_5_vl", "sdpa")
    seq = _one(model, ("video", (32, 2, 2)), n=4)
    owner = r.vision_modules(model, purpose="test").owner
    mismatched_f32 = mismatched_f64 = 0
    for k in range(1, 49):
        seconds = torch.tensor([k / 10], dtype=torch.float32)
        installed = tfcompat.rope_index(model, seq.input_ids, video_grid_thw=seq.video_grid_thw,
                                        second_per_grid_ts=seconds)[1:]
        for dtype in (torch.float32, torch.float64):
            ref = REFERENCES["qwen2_vl"].compute(owner.config, seq.input_ids, None, seq.video_grid_thw,
                                                 seconds.to(dtype), None, deviations=r.entry.rope_index_deviations)
            if not torch.equal(ref, installed):
                mismatched_f32 += dtype == torch.float32
                mismatched_f64 += dtype == torch.float64
    assert mismatched_f32 == 0
    assert mismatched_f64 > 0  # control: float64 arithmetic lands elsewhere for some decimal seconds


@pytest.mark.parametrize("impl", ["installed", "reference"])
def test_refuses_seconds_for_qwen2_vl_in_both_impls(impl):
    model = tiny_model("qwen2_vl", "sdpa")
    seq = _one(model, ("video", (2, 4, 4)))
    with pytest.raises(tfcompat.InvalidInputError, match="takes no second_per_grid_ts") as info:
        tfcompat.rope_index(model, seq.input_ids, video_grid_thw=seq.video_grid_thw,
                            second_per_grid_ts=torch.tensor([1.0]), impl=impl)
    _typed(info, family="qwen2_vl")


def test_refuses_unsupported_transformers_in_doctor(capsys, monkeypatch):
    import tfcompat.cli as cli

    monkeypatch.setattr(cli, "installed_transformers", lambda: "4.40.0")
    assert cli.main(["doctor", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert all(row["ok"] == (row["status"] == "not present in this transformers") for row in report["families"])
    assert any(row["status"] == "unsupported" for row in report["families"])
    assert cli.main(["doctor"]) == 1
    assert "FAILED: no family resolves on transformers 4.40.0" in capsys.readouterr().out


# --- generic exceptions -> typed ------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["missing_grid", "grid_vs_pixels", "grid_vs_placeholders"])
@pytest.mark.parametrize("family", VISION)
def test_refuses_vision_inputs_that_disagree(family, bad):
    model = tiny_model(family, "sdpa")
    seq = _one(model)
    vision = seq.vision_inputs()
    if bad == "missing_grid":
        vision.pop("image_grid_thw")
        match = "pixel_values without image_grid_thw"
    elif bad == "grid_vs_pixels":
        vision["pixel_values"] = vision["pixel_values"][:-4]
        match = "pixel_values and image_grid_thw disagree"
    else:
        vision["image_grid_thw"] = torch.tensor([[1, 2, 2]])
        vision["pixel_values"] = vision["pixel_values"][:4]
        match = "image placeholder tokens and image_grid_thw disagree"
    with tfcompat.patch(model):
        for call in (lambda: model(input_ids=seq.input_ids, **vision),
                     lambda: tfcompat.embed_inputs(model, seq.input_ids, **vision)):
            with pytest.raises(tfcompat.InvalidInputError, match=match) as info:
                call()
            _typed(info, family=family)


@pytest.mark.parametrize("family", ["qwen2"])
def test_refuses_meta_tensors(family):
    model = tiny_model(family, "sdpa")
    with tfcompat.patch(model), pytest.raises(tfcompat.InvalidInputError, match="meta tensors") as info:
        model.to("meta")(input_ids=torch.zeros(1, 6, dtype=torch.long, device="meta"),
                         position_ids=torch.arange(6, device="meta")[None])
    _typed(info, family=family)


@pytest.mark.parametrize("family", FAMILIES)
def test_refuses_pickle_and_answers_deepcopy(family):
    model = tiny_model(family, "sdpa")
    packed, _ = _packed_rows(model, family)
    handle = tfcompat.patch(model)
    with pytest.raises(tfcompat.PatchedModelError, match="cannot pickle a patched") as info:
        pickle.dumps(model)
    _typed(info, tfcompat.PatchedModelError, family)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        expected = model(**packed.model_inputs).logits
        handle.undo()  # the copy keeps its own patch
        got = clone(**packed.model_inputs).logits
    assert torch.equal(got, expected)
    assert tfcompat.patch(clone).model is clone and tfcompat.patch(clone).active
    tfcompat.patch(clone).undo()
    pickle.dumps(clone)  # unpatched again: plain pickling works


def test_answers_compile_fullgraph_with_pack_inputs():
    """torch.compile(fullgraph=True) traces a packed forward whose boundaries travel in the context (pack)."""
    model = tiny_model("qwen2", "sdpa")
    packed = tfcompat.pack(model, [{"input_ids": torch.arange(3, 9)}, {"input_ids": torch.arange(4, 9)}])
    with tfcompat.patch(model), torch.no_grad():
        eager = model(**packed.model_inputs).logits
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)(**packed.model_inputs).logits
    assert (compiled - eager).abs().max() <= 1e-5
