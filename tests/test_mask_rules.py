"""Rules a text model keeps in its mask construction, not in its attention call (`tfcompat.registry.mask_rules`).

Differential: the same tiny random model with a shrunk config other than the zoo's (windows that cut into the
sequences), stock per sequence against patched packed, per token; or a typed refusal at ``patch()``.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers

import tfcompat
from tfcompat.errors import PatchError
from tfcompat.registry.mask_rules import layer_mask, read_masks
from tfcompat.tiny_models import model_class_name, tiny_config

LENGTHS = (7, 13, 10)


def _model(model_type: str, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32,
           **fields: object) -> torch.nn.Module:
    """The tiny model of ``model_type`` rebuilt with ``fields`` set on its config (before the modules are built)."""
    config = tiny_config(model_type)
    values = {**config.to_dict(), **fields}
    for key in ("transformers_version", "model_type"):
        values.pop(key, None)
    torch.manual_seed(0)
    cls = getattr(transformers, model_class_name(model_type))
    return cls._from_config(type(config)(**values), attn_implementation=attn_implementation).to(dtype).eval()


def _packed_vs_alone(model: torch.nn.Module, lengths: tuple[int, ...] = LENGTHS) -> torch.Tensor:
    """Per-token max |packed - alone| over the logits ``(sum(lengths),)``, patched packed against stock alone."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, 200, (n,), generator=g) for n in lengths]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])
        with tfcompat.patch(model):
            positions = torch.cat([torch.arange(n) for n in lengths])[None]
            packed = model(input_ids=torch.cat(seqs)[None], position_ids=positions).logits[0]
    return (packed - alone).abs().amax(-1)


def _reading(module: str, cls: str):
    """``read_masks`` of a text model class, skipped where the release builds its masks without `masking_utils`
    (4.x ``_update_causal_mask``: the window is in the attention call there, which the derived patch records)."""
    reading = read_masks(getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls))
    if not reading.selectors:
        pytest.skip(f"{cls} on transformers {transformers.__version__} calls no masking_utils builder")
    return reading


class TestReading:
    """The reading names the builder each layer kind gets, resolved in the modeling module by identity."""

    def test_phimoe_picks_its_mask_by_config_sliding_window(self):
        reading = _reading("phimoe", "PhimoeModel")
        assert [(k, s) for k, s, _ in reading.selectors] == [
            ("", "create_causal_mask if self.config.sliding_window is None else create_sliding_window_causal_mask")]
        config = tiny_config("phimoe")
        config.sliding_window = 6
        assert layer_mask(reading, config, None)[:2] == ("window", 6)
        config.sliding_window = None
        assert layer_mask(reading, config, None)[:2] == ("causal", None)

    def test_a_builder_under_a_false_test_does_not_count(self):
        """BERT-style ``if self.config.is_decoder: create_causal_mask(...) else: create_bidirectional_mask(...)``."""
        reading = _reading("bert", "BertModel")
        config = tiny_config("bert")
        assert config.is_decoder
        assert layer_mask(reading, config, None)[:2] == ("causal", None)
        config.is_decoder = False
        assert layer_mask(reading, config, None)[:2] == ("bidirectional", None)

    def test_layer_types_key_the_builders(self):
        reading = _reading("qwen2_moe", "Qwen2MoeModel")
        config = tiny_config("qwen2_moe")
        config.sliding_window = 6
        assert layer_mask(reading, config, "sliding_attention")[:2] == ("window", 6)
        assert layer_mask(reading, config, "full_attention")[:2] == ("causal", None)

    def test_an_overlay_that_may_be_passed_is_named(self):
        reading = _reading("gemma3", "Gemma3TextModel")
        config = tiny_config("gemma3_text")
        if not hasattr(config, "use_bidirectional_attention"):
            pytest.skip(f"Gemma 3 on transformers {transformers.__version__} has no use_bidirectional_attention")
        config.use_bidirectional_attention = False
        assert not isinstance(layer_mask(reading, config, "full_attention"), str)
        config.use_bidirectional_attention = True
        assert "overlay" in layer_mask(reading, config, "full_attention")


class TestWindowsFromTheMask:
    """A window only the text model's mask applies is honoured: packed equals stock per sequence."""

    def test_phimoe_window_past_the_sequences(self):
        model = _model("phimoe", sliding_window=6)
        if not read_masks(type(model.model)).selectors:  # 4.x: the call passes the window, or patch() refuses
            try:
                diff = _packed_vs_alone(model)
            except PatchError as exc:
                assert exc.family == "phimoe"
                return
            assert diff.max() <= 1e-5, diff
            return
        diff = _packed_vs_alone(model)
        assert diff.max() <= 1e-5, diff  # 0.26 at logit scale 0.63 when the window was dropped
        with tfcompat.patch(model) as handle:
            assert "window 6 (from the mask)" in handle.explain()

    def test_phimoe_control_the_window_changes_the_logits(self):
        """Non-vacuity: the window cuts into the sequences (stock with and without it differ)."""
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(5, 200, (1, 13), generator=g)
        with torch.no_grad():
            windowed = _model("phimoe", sliding_window=6)(input_ids=ids).logits
            full = _model("phimoe", sliding_window=None)(input_ids=ids).logits
        assert (windowed - full).abs().max() > 1e-2

    def test_qwen2_moe_sliding_layer_passes_no_keyword(self):
        """Qwen2-MoE keeps ``self.sliding_window`` on its sliding layers but passes it to no attention function."""
        model = _model("qwen2_moe", sliding_window=6, use_sliding_window=True, max_window_layers=1,
                       layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2)
        assert _packed_vs_alone(model).max() <= 1e-5


class TestDisagreementIsRefused:
    """Where the attention call and the mask say different windows, patch() refuses, naming both."""

    def test_call_window_differs_from_mask_window(self):
        model = _model("qwen2", sliding_window=6, use_sliding_window=True, max_window_layers=0,
                       layer_types=["sliding_attention", "sliding_attention"], num_hidden_layers=2)
        model.model.layers[0].self_attn.sliding_window = 4  # the call says 4, the mask config.sliding_window = 6
        with pytest.raises(PatchError, match=r"attention call says window 4, its stock mask .*window 6") as info:
            tfcompat.patch(model)
        assert info.value.transformers_version == transformers.__version__
        assert info.value.family == "qwen2"


@pytest.mark.skipif(not hasattr(transformers, "Gemma4ForCausalLM"), reason="no Gemma 4 in this transformers")
class TestGemma4Explained:
    """Gemma 4 packed against alone differed by ~1e-4 relative against a stock *eager* reference: Gemma 4 attends
    with ``scaling=1.0`` (q/k RMS-normed, logits of order head_dim: 256 sliding, 512 full) and its
    ``eager_attention_forward`` takes the softmax in float32 (``softmax(..., dtype=torch.float32).to(query.dtype)``),
    so eager rounds logits of size ~100 where sdpa does not; the gap grows with the keys summed. Stock eager
    differs from stock sdpa by as much, even in float64 (the softmax stays float32). Against stock sdpa, packed is
    exact: nothing is computed over the row."""

    SHRUNK = dict(head_dim=256, global_head_dim=512, initializer_range=0.1, num_hidden_layers=6,
                  layer_types=["sliding_attention"] * 5 + ["full_attention"])

    @staticmethod
    def _gemma4(attn_implementation: str, dtype: torch.dtype) -> torch.nn.Module:
        values = {k: v for k, v in tiny_config("gemma4_text").to_dict().items()
                  if k not in ("transformers_version", "model_type", "per_layer_config")}
        torch.manual_seed(0)
        config = transformers.Gemma4TextConfig(**{**values, **TestGemma4Explained.SHRUNK})
        return transformers.Gemma4ForCausalLM._from_config(config, attn_implementation=attn_implementation).to(
            dtype).eval()

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    def test_packed_equals_stock_sdpa(self, dtype):
        assert _packed_vs_alone(self._gemma4("sdpa", dtype), (20, 40)).max() <= 1e-6

    def test_control_stock_eager_is_the_gap(self):
        """The reference, not the packing: eager vs sdpa, both stock, one sequence, float64."""
        sdpa = self._gemma4("sdpa", torch.float64)
        eager = self._gemma4("eager", torch.float64)
        eager.load_state_dict(sdpa.state_dict())
        ids = torch.randint(5, 200, (1, 40), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            gap = (sdpa(input_ids=ids).logits - eager(input_ids=ids).logits).abs().amax(-1)[0]
        assert gap.max() > 1e-6  # float32 softmax over logits of order head_dim (measured 7.7e-6)
        assert gap[-10:].max() > gap[:10].max()  # growing along the sequence, as reported
