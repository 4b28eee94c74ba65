"""The ``tfcompat`` command: ``tfcompat doctor [--json]``."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import warnings
from importlib import metadata
from typing import Any

from . import __version__
from .errors import TfcompatError
from .registry import families, match, resolve
from .registry.versions import installed_transformers

__all__ = ["main", "doctor"]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def doctor() -> dict[str, Any]:
    """Resolve every family on the installed transformers and self-check each resolved one."""
    from .selfcheck import run_check

    report: dict[str, Any] = {
        "tfcompat": __version__,
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": installed_transformers(),
        "flash_attn": _version("flash-attn") or _version("flash_attn"),
        # the Gated DeltaNet kernels linear_backend="auto" takes on CUDA where installed (else tfcompat's torch path)
        "flash_linear_attention": _version("flash-linear-attention") or _version("fla-core"),
        "causal_conv1d": _version("causal-conv1d") or _version("causal_conv1d"),
        "families": [],
    }
    # each family, then its text-only model where it registers one (`Family.text_only`: qwen3_5_text, ...)
    listed = [f for _, parent in sorted(families().items()) for f in (parent, parent.text_only) if f is not None]
    for fam in listed:
        key = fam.key
        row: dict[str, Any] = {"family": key, "supported": fam.supported}
        try:
            if report["transformers"] is None:
                raise TfcompatError("transformers is not installed", fix="pip install transformers")
            entry, _ = match(key, report["transformers"])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                r = resolve(key)
            row.update(status="resolved", entry=str(entry.versions), why=entry.why,
                       warnings=[str(w.message) for w in caught])
            checks = [run_check(key, impl) for impl in ("eager", "sdpa")]
            row["selfcheck"] = [
                {"attn_implementation": c.attn_implementation, "max_abs_diff": c.max_abs_diff, "tokens": c.tokens,
                 "vision": list(c.vision), "ok": c.ok, "seconds": round(c.seconds, 3)} for c in checks
            ]
            row["ok"] = all(c.ok for c in checks)
            row["explain"] = r.explain()
        except TfcompatError as exc:  # unsupported is a failure; a family this transformers predates is not
            absent = bool(report["transformers"]) and not _module_present(fam.entries[-1].module)
            row.update(status="not present in this transformers" if absent else "unsupported", why=str(exc),
                       ok=absent)
        except Exception as exc:  # a self-check crash is a failure to report, not to hide
            row.update(status="selfcheck crashed", why=f"{type(exc).__name__}: {exc}", ok=False)
        report["families"].append(row)
    resolved = [row for row in report["families"] if row["status"] == "resolved"]
    report["ok"] = bool(resolved) and all(row["ok"] for row in report["families"])
    return report


def _module_present(module: str) -> bool:
    from importlib.util import find_spec

    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _print(report: dict[str, Any]) -> None:
    print(f"tfcompat {report['tfcompat']}  python {report['python']}  torch {report['torch']}  "
          f"transformers {report['transformers']}  flash-attn {report['flash_attn'] or 'not installed'}  "
          f"flash-linear-attention {report['flash_linear_attention'] or 'not installed'}  "
          f"causal-conv1d {report['causal_conv1d'] or 'not installed'}")
    for row in report["families"]:
        mark = "FAIL" if not row["ok"] else "ok  " if row["status"] == "resolved" else "n/a "
        if row["status"] == "resolved":
            print(f"[{mark}] {row['family']:<16} resolved: entry {row['entry']} ({row['why']})")
            for w in row["warnings"]:
                print(f"       warning: {w}")
            for c in row["selfcheck"]:
                seen = f" ({', '.join(c['vision'])})" if c["vision"] else ""
                verdict = "pass" if c["ok"] else "FAIL"
                print(f"       self-check {c['attn_implementation']:<5} packed vs stock per-sequence: max abs diff "
                      f"{c['max_abs_diff']:.2e} over {c['tokens']} tokens{seen} ({verdict}, {c['seconds']} s)")
        else:
            print(f"[{mark}] {row['family']:<16} {row['status']}: " + row["why"].replace("\n", "\n       "))
    if report["ok"]:
        print("all self-checks passed")
    elif not any(row["status"] == "resolved" for row in report["families"]):
        print(f"FAILED: no family resolves on transformers {report['transformers']} (each family's supported range is "
              "above); install a supported transformers")
    else:
        failed = [f"{r['family']} ({r['status']})" for r in report["families"] if not r["ok"]]
        print("SELF-CHECK FAILED: " + ", ".join(failed))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tfcompat", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="resolve every family on the installed transformers and self-check it")
    doc.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = doctor()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
