"""Test sessions over the transformers matrix in matrix.yaml.

    nox -l                                        # list sessions
    nox -s ci                                     # default: the CI subset (matrix.yaml `ci`), one venv per version
    nox -s matrix                                 # every version in matrix.yaml
    nox -s "tests(transformers='5.9.0')"          # one version; extra args after -- go to pytest
    nox -s newest                                 # the newest transformers pip resolves (unpinned): doctor + tests
    nox -s trainers                               # Hugging Face Trainer / TRL SFTTrainer (trl, accelerate, datasets)
    nox -s vision                                 # timm towers and torchvision processors (torch 2.14.1, not in ci)

Torch is always the CPU build, pinned ``torch==2.13.0+cpu``: from the local wheel folder ($PIP_FIND_LINKS,
default /opt/wheels) when it holds that wheel, else from PyTorch's CPU index ($TFCOMPAT_TORCH_INDEX, default
https://download.pytorch.org/whl/cpu); each session logs which. PyPI never carries a ``+cpu`` version, so no
session can fall back to PyPI's CUDA wheels (gigabytes).

``vision`` (not part of ``ci``): the image-text-to-text types whose vision tower is a timm model (fast_vlm, gemma3n,
perception_lm) and the processors that exist only as torchvision classes need timm and torchvision, and no
torchvision matches CPU torch 2.13; the session installs ``torch==2.14.1 torchvision==0.29.1`` with pip (which reads
the local wheel folder; uv does not), timm and the newest transformers of the matrix.

Tests marked ``dist`` (gloo worker processes, slow to spawn) run on the versions with ``dist: true`` in
matrix.yaml. The CI subset (``nox -s ci``) runs, on the newest version, every other test (of the ``sweep`` tests,
every model type transformers ships, only the ``ci_sweep`` ones), on the other versions the per-entry tests (not
``broad``: tests/conftest.py) of the families matrix.yaml's ``ci`` names there, and on the ``dist`` versions the
dist tests of `CI_DIST` (the newest) or `CI_DIST_OLDEST`, then ``newest``: `tfcompat doctor` on the transformers
pip resolves unpinned (and the tests, where that release is newer than the matrix). ``nox -s matrix`` and a plain
``tests(...)`` session run everything. Tests run on two pytest-xdist workers, dist tests serially.
"""

from __future__ import annotations

import ast
import os
import time
from pathlib import Path

import nox
import yaml

ROOT = Path(__file__).resolve().parent
MATRIX = yaml.safe_load((ROOT / "matrix.yaml").read_text())
PYTHON = str(MATRIX["python"])
VERSIONS = [str(item["transformers"]) for item in MATRIX["versions"]]
# matrix.yaml's `ci`: `all`, or the families whose per-entry tests CI runs on that release ([] = not in CI)
CI_FAMILIES = {str(item["transformers"]): item["ci"] for item in MATRIX["versions"] if item["ci"]}
CI_VERSIONS = list(CI_FAMILIES)
DIST_VERSIONS = {str(item["transformers"]) for item in MATRIX["versions"] if item.get("dist")}

TORCH_VERSION = "2.13.0+cpu"  # == 2.13.0, and only the CPU build
TORCH = f"torch=={TORCH_VERSION}"
FIND_LINKS = os.environ.get("PIP_FIND_LINKS") or "/opt/wheels"
TORCH_INDEX = os.environ.get("TFCOMPAT_TORCH_INDEX") or "https://download.pytorch.org/whl/cpu"
# scipy: Inkling's vision tower (5.24+) plans its scales with scipy's linear_sum_assignment (the zoo builds it)
TEST_DEPS = ["pytest", "pytest-xdist", "hypothesis", "pyyaml", "packaging", "pillow", "num2words", "scipy"]
# the dist tests of the CI subset: sp 2, one family of each kind, two derived types (sinks and windows; MLA head dims),
# one derived VLM and the image-block refusal, one fused-exchange dtype, two feature mixes;
# the matrix runs every family and derived type at sp 2 and 4
CI_DIST = ("not sp4 and not verl_actor and (not fsdp2 or glm4v-fsdp) and (not hybrid or qwen3_5-sp2 or "
           "linear_heads) and (not sample-sp2 or llama-kv1 or qwen2_5_vl-sample or glm4v-sample or qwen3_vl-sample "
           "or qwen3_5-sample) and (not test_derived_ulysses or gpt_oss-sp2 or deepseek_v3-sp2) and "
           "(not test_vlm_ulysses or internvl-sp2 or refused) and (not test_a2a_gloo or float32) and "
           "(not test_attention_features_gloo or all-kv1 or mla-sinks)")
# the oldest release's dist tests in CI: sp 2, a Qwen-VL, GLM-4V and a dense family with one KV head
CI_DIST_OLDEST = "sp2 and (qwen2_5_vl-sample or glm4v-sample or llama-kv1)"
VERL = "verl==0.9.1"  # installed without its dependencies: the tests load only its pure-torch verl/utils/ulysses.py
VERL_TRANSFORMERS = "5.10.4"  # inside verl 0.9.1's own pin (>=5.5.3, <5.11, !=5.6.0)
# the `vision` session: a torch that torchvision has a wheel for (CUDA builds; they run on CPU), and the types whose
# vision tower is a timm model
VISION_TORCH = ["torch==2.14.1", "torchvision==0.29.1"]
TIMM_TYPES = ("fast_vlm", "gemma3n", "perception_lm")
LINT_DEPS = ["ruff==0.17.6", "mypy==2.4.1", "packaging"]
# Hugging Face Trainer / TRL: trl 1.16.0 requires transformers>=4.56.2; its floor and the newest release of the matrix.
# datasets is left to the resolver: 5.2 needs huggingface-hub>=1.31, transformers 4.x pins it below 1.0 (5.0.1 then)
TRAINER_DEPS = ["trl==1.16.0", "accelerate==1.15.0", "datasets>=4.7"]
TRAINER_TRANSFORMERS = ["4.56.2", VERSIONS[-1]]

# Every test process (pytest, its xdist workers, each gloo worker a dist test spawns) imports torch and transformers;
# with PYTHONDONTWRITEBYTECODE set (as on the CI machines) each one compiles those modules again (~5 s of a 12 s
# collection). The session venvs are throwaway: let the first process write the bytecode the others read.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
nox.options.default_venv_backend = "uv"
nox.options.sessions = ["ci"]


def _broad_files() -> set[str]:
    """tests/conftest.py's `BROAD`: the test files whose every test is ``broad`` (read, not imported: it imports
    tfcompat)."""
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "BROAD" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise RuntimeError("tests/conftest.py defines no BROAD set")


def _session_name(version: str) -> str:
    return f"tests(transformers='{version}')"


def _install_torch(session: nox.Session) -> None:
    """Install `TORCH` from a $PIP_FIND_LINKS folder that holds its wheel, else from `TORCH_INDEX`; log which."""
    folders = [f for f in FIND_LINKS.split() if any(Path(f).glob(f"torch-{TORCH_VERSION}-*.whl"))]
    if folders:
        session.log(f"{TORCH} from the local wheel folder {folders[0]}")
        session.install("--find-links", folders[0], TORCH)
    else:
        session.log(f"no {TORCH} wheel in {FIND_LINKS!r} ($PIP_FIND_LINKS); {TORCH} from {TORCH_INDEX} "
                    "($TFCOMPAT_TORCH_INDEX)")
        session.install("--index-url", TORCH_INDEX, TORCH)


@nox.session(python=PYTHON)
@nox.parametrize("transformers", VERSIONS, ids=[f"transformers='{v}'" for v in VERSIONS])
def tests(session: nox.Session, transformers: str) -> None:
    """Install torch (CPU) + one transformers release + tfcompat, then run the test suite."""
    start = time.monotonic()
    _install_torch(session)
    session.install(f"transformers=={transformers}", *TEST_DEPS)
    session.install("-e", ".", "--no-deps")
    session.log(f"install took {time.monotonic() - start:.1f} s (transformers=={transformers})")
    start = time.monotonic()
    ci = session.posargs == ["--ci"]
    # two xdist workers on CI's two cores: one torch thread each (tiny matmuls; OpenMP threads spin-wait against
    # the other worker: 1.6x the wall time of the per-entry tests measured with the default)
    env = {"TFCOMPAT_EXPECT_TRANSFORMERS": transformers, "OMP_NUM_THREADS": "1"}
    if session.posargs and not ci:
        runs = [list(session.posargs)]
    else:
        full = transformers == VERSIONS[-1] or not ci  # CI: the broad tests on the newest release only
        marks = "not dist" if full else "not dist and not broad"
        if ci and full:  # the every-type sweeps: one reference
            marks += " and (not sweep or ci_sweep)"
        # a release outside the full ones collects only the files holding per-entry tests (collecting the broad
        # files imports every model type's config: ~10 s per pytest process)
        paths = ["tests"] if full else [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").glob("test_*.py"))
                                         if p.name not in _broad_files()]
        runs = [[*paths, "-n", "2", "-m", marks]]
        if transformers in DIST_VERSIONS:
            subset = CI_DIST if transformers == VERSIONS[-1] else CI_DIST_OLDEST
            runs.append(["tests", "-m", "dist", *(["-k", subset] if ci else [])])
        if ci and CI_FAMILIES.get(transformers, "all") != "all":  # a release outside the subset: every family
            env["TFCOMPAT_CI_FAMILIES"] = ",".join(CI_FAMILIES[transformers])
    try:
        for args in runs:
            session.run("python", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args, env=env)
    finally:
        session.log(f"pytest took {time.monotonic() - start:.1f} s (transformers=={transformers})")


@nox.session(python=False)
def ci(session: nox.Session) -> None:
    """The CI subset of matrix.yaml (its `ci` lists): every registry entry on one of its releases; lint first."""
    session.notify("lint")
    for version in CI_VERSIONS:
        session.notify(_session_name(version), posargs=session.posargs or ["--ci"])
    # verl's contract at sp 2 (the matrix-free `nox -s integrations` runs sp 1, 2 and 4)
    session.notify("integrations", posargs=["tests/distributed/test_verl.py", "-k", "not verl_actor or 2"])
    # the README's first command on whatever transformers pip resolves today
    session.notify("newest", posargs=["--ci"])


@nox.session(python=PYTHON)
def newest(session: nox.Session) -> None:
    """The newest transformers pip resolves today, unpinned (pyproject's ``transformers>=4.53``), as a new user's
    first command gets it: `tfcompat doctor` (every family and every derived type self-checked), then, for a
    release matrix.yaml does not list yet, the per-entry tests and the every-type sweeps. A new release shows up
    here as one failing session naming the types it broke. With ``--ci`` (from `ci`) a release the matrix lists
    runs the doctor only: its ``tests`` session covers the rest."""
    _install_torch(session)
    session.install("--upgrade", "transformers", *TEST_DEPS)
    session.install("-e", ".", "--no-deps")
    version = session.run("python", "-c", "import transformers; print(transformers.__version__)",
                          silent=True).strip()
    listed = version in VERSIONS
    session.log(f"newest transformers: {version} ({'in' if listed else 'newer than'} matrix.yaml)")
    session.run("tfcompat", "doctor", env={"OMP_NUM_THREADS": "1"})
    if listed and session.posargs == ["--ci"]:
        return
    args = [] if session.posargs == ["--ci"] else list(session.posargs)
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                *(args or ["tests", "-n", "2", "-m", "not dist and (not sweep or ci_sweep)"]),
                env={"TFCOMPAT_EXPECT_TRANSFORMERS": version, "OMP_NUM_THREADS": "1"})


@nox.session(python=False)
def matrix(session: nox.Session) -> None:
    """Every transformers release in matrix.yaml."""
    for version in VERSIONS:
        session.notify(_session_name(version), posargs=session.posargs)


@nox.session(python=PYTHON)
def triton(session: nox.Session) -> None:
    """The Triton PPO-head kernels on CPU, in Triton's interpreter (TRITON_INTERPRET=1): triton is optional, so
    the matrix sessions run without it and this one installs it with the newest transformers of the matrix."""
    _install_torch(session)
    session.install(f"transformers=={VERSIONS[-1]}", "triton", *TEST_DEPS)
    session.install("-e", ".", "--no-deps")
    tests = ["tests/test_heads_triton.py", "tests/test_model_logprobs.py"]
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *(session.posargs or tests),
                env={"TRITON_INTERPRET": "1"})


@nox.session(python=PYTHON, venv_backend="venv")
def vision(session: nox.Session) -> None:
    """The tests that need timm and torchvision: the timm-tower types through the every-type VLM sweep and the
    processors' recipes (tests/processors.py), torchvision ones included. Torch is `VISION_TORCH` (the matrix pins a
    CPU torch no torchvision wheel matches), installed by pip so that $PIP_FIND_LINKS' wheels are found."""
    folders = [f for f in FIND_LINKS.split() if Path(f).is_dir()]
    links = ["--find-links", folders[0]] if folders else []
    session.run("python", "-m", "pip", "install", "-q", *links, *VISION_TORCH, "timm", f"transformers=={VERSIONS[-1]}",
                *TEST_DEPS)
    session.run("python", "-m", "pip", "install", "-q", "-e", ".", "--no-deps")
    session.run("python", "-c", "import timm, torch, torchvision, transformers; print('vision:', *(f'{m.__name__} "
                "{m.__version__}' for m in (torch, torchvision, timm, transformers)))")
    tests = ["tests/test_processors.py", "tests/test_every_vlm.py", "-n", "2", "-k",
             f"test_processor or ({' or '.join(TIMM_TYPES)})"]
    session.run("python", "-m", "pytest", "-q", "-rxs", "-p", "no:cacheprovider", *(session.posargs or tests),
                env={"TFCOMPAT_EXPECT_TRANSFORMERS": VERSIONS[-1], "OMP_NUM_THREADS": "1"})


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff and mypy with their config in pyproject.toml; mypy reads torch's and transformers' own annotations,
    so both are installed (the newest transformers of the matrix). No formatter runs."""
    _install_torch(session)
    session.install(f"transformers=={VERSIONS[-1]}", *LINT_DEPS)
    session.install("-e", ".", "--no-deps")
    session.run("ruff", "check", *(session.posargs or ["."]))
    session.run("mypy")


@nox.session(python=PYTHON)
def integrations(session: nox.Session) -> None:
    """Trainers' calling conventions: verl's apply_monkey_patch, driven by verl's own Ulysses functions on gloo.

    verl's dependency set (Ray, vLLM, ...) stays out: verl is installed with --no-deps, as files."""
    _install_torch(session)
    session.install(f"transformers=={VERL_TRANSFORMERS}", *TEST_DEPS)
    session.install("--no-deps", VERL)
    session.install("-e", ".", "--no-deps")
    session.run("python", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                *(session.posargs or ["tests/distributed/test_verl.py"]),
                env={"TFCOMPAT_EXPECT_TRANSFORMERS": VERL_TRANSFORMERS})


@nox.session(python=PYTHON)
@nox.parametrize("transformers", TRAINER_TRANSFORMERS, ids=[f"transformers='{v}'" for v in TRAINER_TRANSFORMERS])
def trainers(session: nox.Session, transformers: str) -> None:
    """Hugging Face Trainer (DataCollatorWithFlattening, tfcompat.integrations.hf.PackedCollator) and TRL's SFTTrainer
    on patched tiny models, against per-sequence stock loops: trl, accelerate and datasets stay out of the matrix
    (there tests/test_trainer.py runs only its collator tests)."""
    _install_torch(session)
    session.install(f"transformers=={transformers}", *TRAINER_DEPS, *TEST_DEPS)
    session.install("-e", ".", "--no-deps")
    session.run("python", "-c", "import accelerate, datasets, transformers, trl; "
                "print('trainers:', *(f'{m.__name__} {m.__version__}' "
                "for m in (transformers, trl, accelerate, datasets)))")
    session.run("python", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                *(session.posargs or ["tests/test_trainer.py"]), env={"TFCOMPAT_EXPECT_TRANSFORMERS": transformers})
