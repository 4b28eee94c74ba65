"""matrix.yaml against the registry: every entry is tested, and CI runs its first and last release."""

from __future__ import annotations

from pathlib import Path

import yaml

from tfcompat.registry import families

MATRIX = yaml.safe_load((Path(__file__).resolve().parents[1] / "matrix.yaml").read_text())
VERSIONS = [str(v["transformers"]) for v in MATRIX["versions"]]
CI = {str(v["transformers"]) for v in MATRIX["versions"] if v.get("ci")}


def test_every_family_is_listed_on_every_version_it_supports():
    for item in MATRIX["versions"]:
        listed = set(item["families"])
        supported = {k for k, f in families().items() if any(str(item["transformers"]) in e.versions for e in f.entries)}
        assert listed == supported, (item["transformers"], sorted(listed ^ supported))


def test_ci_runs_the_first_and_last_release_of_every_entry():
    for key, fam in families().items():
        for entry in fam.entries:
            inside = [v for v in VERSIONS if v in entry.versions]
            assert inside, f"{key} entry {entry.versions} has no release in matrix.yaml"
            assert {inside[0], inside[-1]} <= CI, f"{key} entry {entry.versions}: CI must run {inside[0]} and {inside[-1]}"


def test_matrix_lists_each_minor_release_once_in_order():
    minors = [tuple(int(x) for x in v.split(".")[:2]) for v in VERSIONS]
    assert minors == sorted(set(minors))
