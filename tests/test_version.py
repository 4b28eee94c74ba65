"""`tfcompat.__version__` has one source: pyproject.toml's [project] version, read back from package metadata."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import tfcompat


def test_version_is_pyproject_version() -> None:
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert tfcompat.__version__ == importlib.metadata.version("tfcompat") == pyproject["project"]["version"]
