"""PPO critics and token-level reward models: ``AutoModelForTokenClassification`` (verl's critic, a value per token)
on every registered family (and text-only model) whose config transformers maps to one.

Oracle: the stock critic on each sequence alone, per token; control: the unpatched critic on the packed row.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import tfcompat
from tests.helpers import max_token_diff
from tfcompat.registry import installed_families
from tfcompat.selfcheck import tiny_model

KEYS = [k for f in installed_families().values() for k in (f.key, f.text_only.key if f.text_only else None) if k]


def _critic(key: str) -> torch.nn.Module:
    config = tiny_model(key, "sdpa").config
    config.num_labels = 1
    try:
        critic = transformers.AutoModelForTokenClassification.from_config(config, attn_implementation="sdpa")
    except ValueError:  # no token-classification head for this model type in this release
        pytest.skip(f"transformers {transformers.__version__} has no token-classification model for {key}")
    return critic.eval()


@pytest.mark.parametrize("family", KEYS)
@torch.no_grad()
def test_packed_values_equal_each_sequence_alone(family):
    torch.manual_seed(0)
    critic = _critic(family)
    lengths = [5, 9, 4]
    ids = [torch.randint(3, 60, (n,)) for n in lengths]
    stock = [critic(input_ids=x[None]).logits[0] for x in ids]
    row = torch.cat(ids)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    unpatched = critic(input_ids=row, position_ids=positions).logits[0]
    assert max_token_diff(unpatched, stock) > 1e-4  # control: the stock packed row mixes sequences
    with tfcompat.patch(critic):
        values = critic(input_ids=row, position_ids=positions).logits[0]  # (T, 1)
    assert max_token_diff(values, stock) <= 1e-5
