"""``tfcompat doctor``: the README's main command."""

from __future__ import annotations

import json
import subprocess
import sys

from tfcompat.cli import main
from tfcompat.versions import installed_transformers


def test_doctor_json_resolves_and_self_checks_glm4v(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["transformers"] == installed_transformers()
    row = next(r for r in report["families"] if r["family"] == "glm4v")
    assert row["status"] == "resolved" and row["ok"]
    assert {c["attn_implementation"] for c in row["selfcheck"]} == {"eager", "sdpa"}
    assert all(c["max_abs_diff"] <= 1e-5 for c in row["selfcheck"])


def test_doctor_text_output_in_a_fresh_process():
    proc = subprocess.run([sys.executable, "-m", "tfcompat", "doctor"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "glm4v" in proc.stdout and "resolved" in proc.stdout and "all self-checks passed" in proc.stdout
