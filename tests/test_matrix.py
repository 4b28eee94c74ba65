"""matrix.yaml against the registry: every entry is tested, and CI runs each entry on one of its releases.

Which families a release holds is the registry's answer (`registry.match`), not a list kept in matrix.yaml."""

from __future__ import annotations

from pathlib import Path

import yaml

from tfcompat.errors import UnsupportedVersionError
from tfcompat.registry import families, match

MATRIX = yaml.safe_load((Path(__file__).resolve().parents[1] / "matrix.yaml").read_text())
VERSIONS = [str(v["transformers"]) for v in MATRIX["versions"]]


def families_on(version: str) -> set[str]:
    """The families whose table declares ``version`` (matched, not resolved forward-compatibly)."""
    out = set()
    for key in families():
        try:
            _, forward_compatible = match(key, version)
        except UnsupportedVersionError:
            continue
        if not forward_compatible:
            out.add(key)
    return out


FAMILIES = {v: families_on(v) for v in VERSIONS}


def _ci_families(item: dict) -> set[str]:
    """The families whose per-entry tests CI runs on this matrix item (``ci: all`` = every family on it)."""
    return FAMILIES[str(item["transformers"])] if item["ci"] == "all" else set(item["ci"])


CI = {str(v["transformers"]): _ci_families(v) for v in MATRIX["versions"]}


def test_families_are_the_registrys():
    """Non-vacuity of the derived rows: a family is on the releases its ranges cover and no other."""
    assert FAMILIES["4.53.3"] >= {"glm4v", "qwen2_vl", "llama"} and "qwen3_5" not in FAMILIES["4.53.3"]
    assert "qwen3_5" in FAMILIES[VERSIONS[-1]]
    assert all("families" not in item for item in MATRIX["versions"]), "families are derived, not listed"


def test_ci_runs_every_entry_on_one_of_its_releases():
    for key, fam in families().items():
        for entry in fam.entries:
            inside = [v for v in VERSIONS if v in entry.versions]
            assert inside, f"{key} entry {entry.versions} has no release in matrix.yaml"
            assert any(key in CI[v] for v in inside), \
                f"{key} entry {entry.versions}: CI must run {key} on one of {inside}"


def test_ci_runs_the_first_and_last_release_of_the_ci_first_last_families():
    for key in MATRIX["ci_first_last"]:
        for entry in families()[key].entries:
            inside = [v for v in VERSIONS if v in entry.versions]
            assert key in CI[inside[0]] and key in CI[inside[-1]], f"{key} entry {entry.versions}: CI must run {key} " \
                f"on {inside[0]} and {inside[-1]}"


def test_ci_lists_only_families_of_its_version():
    for item in MATRIX["versions"]:
        assert item["ci"] == "all" or set(item["ci"]) <= FAMILIES[str(item["transformers"])], item["transformers"]


def test_ci_runs_every_family_on_the_dist_versions():
    for item in MATRIX["versions"]:
        if item.get("dist"):
            assert item["ci"] == "all", f"{item['transformers']}: the full CI versions run every family"


def test_matrix_lists_each_minor_release_once_in_order():
    minors = [tuple(int(x) for x in v.split(".")[:2]) for v in VERSIONS]
    assert minors == sorted(set(minors))
