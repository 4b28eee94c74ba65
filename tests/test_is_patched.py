"""`tfcompat.is_patched`: true exactly while a `tfcompat.patch` of the model is active (and for its deep copies)."""

from __future__ import annotations

import copy

import pytest

import tfcompat
from tfcompat.registry import installed_families
from tfcompat.selfcheck import tiny_model

# a text family, a vision-language family and a hybrid (Gated DeltaNet) one, where the installed release has them
FAMILIES = [k for k in ("qwen2", "qwen2_vl", "qwen3_5") if k in installed_families()]


@pytest.mark.parametrize("family", FAMILIES)
def test_is_patched_follows_patch_undo_and_deepcopy(family):
    model = tiny_model(family, "sdpa")
    assert tfcompat.is_patched(model) is False
    handle = tfcompat.patch(model)
    assert tfcompat.is_patched(model) is True
    text_model = next(m for m in model.modules() if isinstance(m, handle.resolved.text_model_cls))
    assert tfcompat.is_patched(text_model) is False  # only the module given to patch carries the handle
    clone = copy.deepcopy(model)
    handle.undo()
    assert tfcompat.is_patched(model) is False
    assert tfcompat.is_patched(clone) is True  # the copy holds its own handle, untouched by the original's undo
    tfcompat.patch(clone).undo()  # patch() of a patched model returns its handle
    assert tfcompat.is_patched(clone) is False


def test_is_patched_is_public():
    assert "is_patched" in tfcompat.__all__
