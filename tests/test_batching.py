"""`tfcompat.registry.batching`: the axis a processor batches its items along, read from its source, and the index
inputs a packed row shifts; `tfcompat.pack` places them so (the differential proof is
tests/test_every_vlm.py::test_packs_what_the_processor_batches_its_own_way)."""

from __future__ import annotations

import ast

import pytest
import torch

import tfcompat
from tests.every_type import build, vlm_examples
from tfcompat.errors import InvalidInputError
from tfcompat.registry import batching
from tfcompat.tiny_models import model_types

TYPES = model_types("image_text_to_text")


@pytest.mark.parametrize("source,axis", [
    ("torch.cat(patches, dim=-1).unsqueeze(0)", -1),  # MiniCPM-V's torchvision processor
    ("np.concatenate(patches, axis=-1)[np.newaxis, ...]", -1),  # its PIL one
    ("torch.cat(patches, 0)[None]", 0),
    ("np.expand_dims(np.concatenate(patches, axis=1), 0)", 1),
    ("torch.cat(patches, dim=0)", None),  # items on dim 0: the default
    ("torch.stack(patches).unsqueeze(0)", None),
    ("torch.cat(patches, dim=axis).unsqueeze(0)", None),  # not a literal: unread
])
def test_a_batch_of_one_is_read_with_its_concatenation_axis(source, axis):
    assert batching._leading_one(ast.parse(source, mode="eval").body) == axis


def test_the_returned_tensor_is_named_by_its_output_key():
    tree = ast.parse('''
class P:
    def _preprocess(self, images):
        pixel_values = torch.cat(images, dim=-1).unsqueeze(0)
        sizes = torch.cat(shapes).unsqueeze(0)
        return BatchFeature(data={"pixel_values_videos": pixel_values, "other": torch.cat(images)})
''')
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    assert list(batching._batch_of_one(cls)) == [("pixel_values_videos", -1)]  # sizes is returned under no key


def test_item_axes_of_real_processors():
    if "minicpmv4_6" not in TYPES:
        pytest.skip("transformers ships no MiniCPM-V 4.6")
    assert batching.item_axes("minicpmv4_6") == (("pixel_values", -1),)
    if "minicpmv4_7" in TYPES:  # 5.24+
        assert batching.item_axes("minicpmv4_7") == (("pixel_values", -1),)  # 4.6's image processor
    assert batching.item_axes("llava") == ()
    resolved = tfcompat.resolve("minicpmv4_6")
    assert resolved.entry.derived_vision.item_axes == (("pixel_values", -1),)
    assert "pixel_values on dim -1 of one entry" in resolved.explain()


class _Owner(torch.nn.Module):
    """Indices handed on with the pixels they index, into the batch's patches (Molmo2 on 5.24)."""

    def forward(self, pixel_values=None, image_token_pooling=None, **kwargs):
        return self.get_image_features(pixel_values, image_token_pooling)

    def get_image_features(self, pixel_values, image_token_pooling):
        return self.pool(pixel_values, image_token_pooling)


class _Offsetting(_Owner):
    """The model offsets each image's indices itself (Molmo2 on 5.25): none to shift."""

    def get_image_features(self, pixel_values, image_token_pooling):
        return self.inner(pixel_values, pooling=image_token_pooling)

    def inner(self, pixel_values, pooling):
        pooling = torch.where(pooling >= 0, pooling + self.offsets, pooling)
        return pooling


def test_batch_indices_pair_the_indices_with_their_pixels_unless_offset_inside():
    assert batching.batch_indices(_Owner, ["image_token_pooling"]) == (("image_token_pooling", "pixel_values"),)
    assert batching.batch_indices(_Offsetting, ["image_token_pooling"]) == ()


def test_shifted_indices_follow_the_rows_of_earlier_examples():
    from tfcompat.inputs.derived_vision import _shifted_indices

    r = tfcompat.resolve("llava")  # any resolved entry: only its error template is used
    examples = [{"pixel_values": torch.zeros(2, 3, 5), "image_token_pooling": torch.tensor([[0, 5, -1]])},
                {"input_ids": torch.ones(1, 2)},
                {"pixel_values": torch.zeros(1, 3, 5), "image_token_pooling": torch.tensor([[2, -1]])}]
    got = _shifted_indices(r, examples, "image_token_pooling", "pixel_values")
    assert got.tolist() == [[0, 5, -1], [2 + 6, -1, -1]]  # 2 crops x 3 patches before; -1 stays, pads with -1
    examples[2]["pixel_values"] = torch.zeros(1, 4, 5)
    with pytest.raises(InvalidInputError, match="differ in shape after dim 0"):
        _shifted_indices(r, examples, "image_token_pooling", "pixel_values")


def test_pack_concatenates_navit_patches_on_the_last_dim():
    if "minicpmv4_6" not in TYPES:
        pytest.skip("transformers ships no MiniCPM-V 4.6")
    model = build("minicpmv4_6", "sdpa", kind="image_text_to_text")
    examples = vlm_examples(model)
    inputs = tfcompat.pack(model, examples).model_inputs
    parts = [ex["pixel_values"] for ex in examples if "pixel_values" in ex]
    assert torch.equal(inputs["pixel_values"], torch.cat(parts, dim=-1))  # (1, C, p, N_1 p + N_2 p)
    assert torch.equal(inputs["target_sizes"], torch.cat([ex["target_sizes"] for ex in examples
                                                          if "target_sizes" in ex]))
    with pytest.raises(InvalidInputError, match="differ outside their item axis -1"):
        tfcompat.pack(model, [examples[0], {**examples[2], "pixel_values": examples[2]["pixel_values"][:, :1]}])
