"""Shared fixtures: the installed transformers must be the one the nox session asked for."""

from __future__ import annotations

import os

import pytest

from tfcompat.versions import installed_transformers


def pytest_report_header(config: pytest.Config) -> str:
    return f"transformers {installed_transformers()}"


@pytest.fixture(scope="session", autouse=True)
def _expected_transformers() -> None:
    expected = os.environ.get("TFCOMPAT_EXPECT_TRANSFORMERS")
    if expected and installed_transformers() != expected:
        pytest.exit(f"nox asked for transformers {expected}, the venv has {installed_transformers()}", returncode=3)
