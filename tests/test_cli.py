"""``tfcompat doctor``: the README's main command."""

from __future__ import annotations

import json
import subprocess
import sys

import tfcompat
from tfcompat.cli import main
from tfcompat.registry import families, installed_families
from tfcompat.registry.versions import installed_transformers


def test_doctor_json_resolves_and_self_checks_every_family(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["transformers"] == installed_transformers()
    text_only = {f.text_only.key: parent for parent, f in families().items() if f.text_only is not None}
    assert {r["family"] for r in report["families"]} == set(families()) | set(text_only)
    for row in report["families"]:
        if text_only.get(row["family"], row["family"]) not in installed_families():
            continue
        if row["family"] in text_only:  # a text-only model (Family.text_only): text sequences only
            assert row["status"] == "resolved" and row["ok"], row
            assert all(c["max_abs_diff"] <= 1e-5 for c in row["selfcheck"])
            continue
        assert row["status"] == "resolved" and row["ok"], row
        assert {c["attn_implementation"] for c in row["selfcheck"]} == {"eager", "sdpa"}
        assert all(c["max_abs_diff"] <= 1e-5 for c in row["selfcheck"])
        fam = families()[row["family"]]
        if fam.is_vision:  # images, and a video wherever the release's stock forward takes one
            kinds = {k for c in row["selfcheck"] for k in c["vision"]}
            videos = any(i and i[0] == "video" for i in fam.sample_vision)
            rejected = "videos_rejected" in tfcompat.resolve(row["family"]).entry.known_issues
            assert {"image"} | ({"video"} if videos and not rejected else set()) <= kinds, row


def test_doctor_text_output_in_a_fresh_process():
    proc = subprocess.run([sys.executable, "-m", "tfcompat", "doctor"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "glm4v" in proc.stdout and "resolved" in proc.stdout and "all self-checks passed" in proc.stdout
