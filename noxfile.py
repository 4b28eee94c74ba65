"""Test sessions over the transformers matrix in matrix.yaml.

    nox -l                                        # list sessions
    nox -s ci                                     # default: the CI subset (ci: true), one venv per version
    nox -s matrix                                 # every version in matrix.yaml
    nox -s "tests(transformers='5.9.0')"          # one version; extra args after -- go to pytest

Torch is always the CPU build, pinned ``torch==2.13.0+cpu`` and taken from the local wheel folder
($PIP_FIND_LINKS, default /opt/wheels): PyPI never carries a ``+cpu`` version, so no session can fall back to
PyPI's CUDA wheels (gigabytes); a missing CPU wheel fails the install instead.

Tests marked ``dist`` (gloo worker processes, slow to spawn) run on the versions with ``dist: true`` in
matrix.yaml; the other versions run ``-m "not dist"``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import nox
import yaml

ROOT = Path(__file__).resolve().parent
MATRIX = yaml.safe_load((ROOT / "matrix.yaml").read_text())
PYTHON = str(MATRIX["python"])
VERSIONS = [str(item["transformers"]) for item in MATRIX["versions"]]
CI_VERSIONS = [str(item["transformers"]) for item in MATRIX["versions"] if item.get("ci")]
DIST_VERSIONS = {str(item["transformers"]) for item in MATRIX["versions"] if item.get("dist")}

TORCH = "torch==2.13.0+cpu"  # == 2.13.0, and only the CPU build
FIND_LINKS = os.environ.get("PIP_FIND_LINKS") or "/opt/wheels"
TEST_DEPS = ["pytest", "hypothesis", "pyyaml", "packaging"]

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["ci"]


def _session_name(version: str) -> str:
    return f"tests(transformers='{version}')"


@nox.session(python=PYTHON)
@nox.parametrize("transformers", VERSIONS, ids=[f"transformers='{v}'" for v in VERSIONS])
def tests(session: nox.Session, transformers: str) -> None:
    """Install torch (CPU) + one transformers release + tfcompat, then run the test suite."""
    start = time.monotonic()
    session.install("--find-links", FIND_LINKS, TORCH, f"transformers=={transformers}", *TEST_DEPS)
    session.install("-e", ".", "--no-deps")
    session.log(f"install took {time.monotonic() - start:.1f} s (transformers=={transformers})")
    start = time.monotonic()
    default = ["tests"] if transformers in DIST_VERSIONS else ["tests", "-m", "not dist"]
    try:
        session.run(
            "python", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *(session.posargs or default),
            env={"TFCOMPAT_EXPECT_TRANSFORMERS": transformers},
        )
    finally:
        session.log(f"pytest took {time.monotonic() - start:.1f} s (transformers=={transformers})")


@nox.session(python=False)
def ci(session: nox.Session) -> None:
    """The CI subset of matrix.yaml (ci: true): first and last release of every registry range."""
    for version in CI_VERSIONS:
        session.notify(_session_name(version), posargs=session.posargs)


@nox.session(python=False)
def matrix(session: nox.Session) -> None:
    """Every transformers release in matrix.yaml."""
    for version in VERSIONS:
        session.notify(_session_name(version), posargs=session.posargs)


@nox.session(python=PYTHON)
def triton(session: nox.Session) -> None:
    """The Triton PPO-head kernels on CPU, in Triton's interpreter (TRITON_INTERPRET=1): triton is optional, so
    the matrix sessions run without it and this one installs it with the newest transformers of the matrix."""
    session.install("--find-links", FIND_LINKS, TORCH, f"transformers=={VERSIONS[-1]}", "triton", *TEST_DEPS)
    session.install("-e", ".", "--no-deps")
    tests = ["tests/test_heads_triton.py", "tests/test_model_logprobs.py"]
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *(session.posargs or tests),
                env={"TRITON_INTERPRET": "1"})
