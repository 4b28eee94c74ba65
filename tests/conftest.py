"""Shared fixtures: the installed transformers must be the one the nox session asked for; the ``broad`` tier.

Tests in `BROAD` files check what does not change from one registry entry to the next (version-independent
kernels, property tests, the misuse probes, trainers, the doctor: it self-checks every family whatever the release's
CI list) or repeat at length what the per-entry tests and the doctor's self-check already cover (rotary hypothesis
runs, checkpointing every family, controls of stock); single tests elsewhere carry the marker themselves for the same
reasons; and the derived families' tests (the
named derived types: not registry entries, so CI runs them on its newest version, the matrix on every release; the
sweeps over every type transformers ships carry ``sweep`` too, of which CI runs one reference on its newest version);
they carry the ``broad`` marker, so
the CI subset runs them on its newest version only (noxfile.py), every other CI version the per-entry tests, and
``nox -s matrix`` all of them on every release.

``TFCOMPAT_CI_FAMILIES`` (set by ``nox -s ci`` from matrix.yaml's ``ci`` lists, comma-separated) deselects the tests
parametrized with another family (their id starts with a family key): the CI subset runs each registry entry on one
of its releases, not every family on every release; there the per-entry tests run with one stock reference (their
``eager`` twins, which check the same patched path against the eager implementation, run on the newest version).
"""

from __future__ import annotations

import os

import pytest

from tfcompat.registry import families
from tfcompat.registry.versions import installed_transformers

BROAD = {
    "test_a2a.py", "test_attention_backends.py", "test_attention_features.py", "test_checkpoint_keep.py",
    "test_checkpointing.py", "test_cli.py", "test_configs.py", "test_custom_mask.py", "test_derived.py",
    "test_every_causal_lm.py", "test_every_vlm.py", "test_fused.py", "test_heads.py", "test_heads_triton.py",
    "test_integrations_verl.py", "test_linear_attention.py", "test_misuse.py", "test_mixers.py",
    "test_model_logprobs.py", "test_packing.py", "test_rotary.py", "test_tiny_models.py", "test_trainer.py",
    "test_versions.py",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in BROAD:
            item.add_marker(pytest.mark.broad)
    only = os.environ.get("TFCOMPAT_CI_FAMILIES")
    if only is None:
        return
    wanted = set(only.split(",")) - {""}
    known = set(families())
    kept, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        parts = callspec.id.split("-") if callspec is not None else []
        family = parts[0] if parts else None
        # the patched path of an entry is the same whichever stock reference it is compared with: one (sdpa) here
        eager_twin = "eager" in parts and "sdpa" in item.name.replace("eager", "sdpa")
        (dropped if (family in known and family not in wanted) or (family in known and eager_twin) else kept
         ).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_report_header(config: pytest.Config) -> str:
    return f"transformers {installed_transformers()}"


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module of tiny-model sweeps: tiny matmuls run 10-40x faster than on several threads
    of a shared machine (OpenMP spin-waits)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def _expected_transformers() -> None:
    expected = os.environ.get("TFCOMPAT_EXPECT_TRANSFORMERS")
    if expected and installed_transformers() != expected:
        pytest.exit(f"nox asked for transformers {expected}, the venv has {installed_transformers()}", returncode=3)
