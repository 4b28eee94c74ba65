"""``tfcompat doctor``: the README's main command."""

from __future__ import annotations

import json
import subprocess
import sys

import tfcompat
from tfcompat import cli, selfcheck
from tfcompat.cli import main
from tfcompat.registry import families, installed_families
from tfcompat.registry.versions import installed_transformers
from tfcompat.selfcheck import TypeCheck


def test_doctor_json_resolves_and_self_checks_every_family(capsys):
    assert main(["doctor", "--json", "--types", "qwen3_moe,xlnet,llama,llava"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["model_type"]: r for r in report["types"]}
    assert set(rows) == {"qwen3_moe", "xlnet", "llava"}  # llama is a written family: checked above, not twice
    assert rows["llava"]["kind"] == "image_text_to_text" and rows["llava"]["status"] == "pass", rows
    assert rows["qwen3_moe"]["status"] == "pass" and rows["qwen3_moe"]["max_rel_diff"] <= 1e-5, rows
    assert rows["xlnet"]["status"] == "refused" and "holds no attention that dispatches" in rows["xlnet"][
        "reason"], rows
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
    proc = subprocess.run([sys.executable, "-m", "tfcompat", "doctor", "--types", "mistral,xlnet"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "glm4v" in proc.stdout and "resolved" in proc.stdout and "all self-checks passed" in proc.stdout
    assert f"derived causal-LM types on transformers {installed_transformers()}: 1 of 2 pass the self-check" \
        in proc.stdout
    assert "refused   1: holds no attention that dispatches through AttentionInterface" in proc.stdout


def test_a_failing_derived_type_fails_the_doctor(monkeypatch, capsys):
    """Rule: a derived type patched and wrong is a failure the doctor names, and its exit status is 1."""
    wrong = TypeCheck("mistral", "fail", "packed differs from stock per sequence by 3.0e-01", 0.3)
    monkeypatch.setattr(selfcheck, "check_type", lambda model_type, kind: wrong)
    monkeypatch.setattr(cli, "families", lambda: {})  # the written families are the test above's
    assert main(["doctor", "--types", "mistral"]) == 1
    out = capsys.readouterr().out
    assert "FAIL mistral: packed differs from stock per sequence by 3.0e-01" in out
    assert "0 of 1 pass the self-check" in out and "1 fail" in out
