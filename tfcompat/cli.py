"""The ``tfcompat`` command: ``tfcompat doctor [--json | --markdown] [--types all|none|TYPE,...]``."""

from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
import warnings
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from . import __version__
from .errors import TfcompatError
from .registry import families, match, resolve
from .registry.versions import installed_transformers

__all__ = ["main", "doctor", "markdown"]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def doctor(types: str | Sequence[str] = "all") -> dict[str, Any]:
    """Resolve every family on the installed transformers and self-check each resolved one; then self-check the
    causal-LM and image-text-to-text types without a written table (derived): ``types`` "all" (every one the
    installed transformers ships), "none", or the model types to check."""
    from .selfcheck import run_check

    report: dict[str, Any] = {
        "tfcompat": __version__,
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": installed_transformers(),
        "flash_attn": _version("flash-attn") or _version("flash_attn"),
        # the Gated DeltaNet kernels linear_backend="auto" takes on CUDA where installed (else tfcompat's torch path)
        "flash_linear_attention": _version("flash-linear-attention") or _version("fla-core"),
        # why fla's own guard refuses its gated backward here (then "auto" takes the torch path), or None
        "flash_linear_attention_refused": _fla_refusal(),
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
            # and, where the family's tower routes its boundaries (5.x), sdpa with the tower through tfcompat
            found = [run_check(key, "eager"), run_check(key, "sdpa"), run_check(key, "sdpa", vision_attention=True)]
            checks = [c for c in found if c is not None]
            row["selfcheck"] = [
                {"attn_implementation": c.attn_implementation, "max_abs_diff": c.max_abs_diff, "tokens": c.tokens,
                 "vision": list(c.vision), "vision_attention": c.vision_attention, "ok": c.ok,
                 "seconds": round(c.seconds, 3)} for c in checks
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
    report["types"] = _check_types(types, {row["family"] for row in report["families"]}) \
        if report["transformers"] else []
    resolved = [row for row in report["families"] if row["status"] == "resolved"]
    report["ok"] = bool(resolved) and all(row["ok"] for row in report["families"]) \
        and not any(row["status"] == "fail" for row in report["types"])
    return report


def _check_types(types: str | Sequence[str], written: set[str]) -> list[dict[str, Any]]:
    """`tfcompat.selfcheck.check_type` of each causal-LM type asked for that is not a written family."""
    import torch

    from .selfcheck import check_type
    from .tiny_models import Kind, model_types

    if types == "none":
        return []
    images = set(model_types("image_text_to_text"))
    if types == "all":  # a type in both mappings (gemma3, ...) is checked with images
        asked = [*(t for t in model_types("causal_lm") if t not in images), *sorted(images)]
    else:
        asked = list(types)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is many times faster than several
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kinds: dict[str, Kind] = {t: "image_text_to_text" if t in images else "causal_lm" for t in asked}
            checks = [(kinds[t], check_type(t, kinds[t])) for t in asked if t not in written]
    finally:
        torch.set_num_threads(threads)
    return [{"model_type": c.model_type, "kind": kind, "status": c.status, "reason": c.reason,
             "max_rel_diff": c.max_rel_diff, "proof": c.proof, "ok": c.status != "fail"} for kind, c in checks]


def _module_present(module: str) -> bool:
    from importlib.util import find_spec

    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _fla_refusal() -> str | None:
    from .core import _linear_kernels

    return _linear_kernels.fla_rule_refusal() if _linear_kernels.fla_rule() is not None else None


def _print(report: dict[str, Any]) -> None:
    fla = report["flash_linear_attention"] or "not installed"
    if report["flash_linear_attention_refused"]:
        fla += f" (not used: {report['flash_linear_attention_refused']}; install tilelang or Triton >= 3.7.1)"
    print(f"tfcompat {report['tfcompat']}  python {report['python']}  torch {report['torch']}  "
          f"transformers {report['transformers']}  flash-attn {report['flash_attn'] or 'not installed'}  "
          f"flash-linear-attention {fla}  causal-conv1d {report['causal_conv1d'] or 'not installed'}")
    for row in report["families"]:
        mark = "FAIL" if not row["ok"] else "ok  " if row["status"] == "resolved" else "n/a "
        if row["status"] == "resolved":
            print(f"[{mark}] {row['family']:<16} resolved: entry {row['entry']} ({row['why']})")
            for w in row["warnings"]:
                print(f"       warning: {w}")
            for c in row["selfcheck"]:
                seen = f" ({', '.join(c['vision'])})" if c["vision"] else ""
                verdict = "pass" if c["ok"] else "FAIL"
                tower = ", tower through tfcompat" if c.get("vision_attention") else ""
                print(f"       self-check {c['attn_implementation']:<5} packed vs stock per-sequence: max abs diff "
                      f"{c['max_abs_diff']:.2e} over {c['tokens']} tokens{seen}{tower} ({verdict}, {c['seconds']} s)")
        else:
            print(f"[{mark}] {row['family']:<16} {row['status']}: " + row["why"].replace("\n", "\n       "))
    _print_types(report)
    if report["ok"]:
        print("all self-checks passed")
    elif not any(row["status"] == "resolved" for row in report["families"]):
        print(f"FAILED: no family resolves on transformers {report['transformers']} (each family's supported range is "
              "above); install a supported transformers")
    else:
        failed = [f"{r['family']} ({r['status']})" for r in report["families"] if not r["ok"]]
        failed += [f"{r['model_type']} (derived)" for r in report["types"] if not r["ok"]]
        print("SELF-CHECK FAILED: " + ", ".join(failed))


def _print_types(report: dict[str, Any]) -> None:
    """Per kind (causal LM, image-text-to-text) one summary line for the derived types, the refusal reasons counted,
    and every failing type by name."""
    for kind, what in (("causal_lm", "causal-LM"), ("image_text_to_text", "image-text-to-text")):
        rows = [row for row in report["types"] if row["kind"] == kind]
        if not rows:
            continue
        counts = collections.Counter(row["status"] for row in rows)
        worst = max((row["max_rel_diff"] for row in rows if row["status"] == "pass"), default=None)
        print(f"[{'FAIL' if counts['fail'] else 'ok  '}] derived {what} types on transformers "
              f"{report['transformers']}: {counts['pass']} of {len(rows)} pass the self-check (packed vs stock per "
              "sequence" + (" with images" if kind != "causal_lm" else "")
              + (f", max relative diff {worst:.1e}" if worst is not None else "") + f"), {counts['refused']} refused, "
              f"{counts['unbuildable']} not buildable as tiny models, {counts['fail']} fail")
        reasons = collections.Counter(_reason_kind(row["reason"]) for row in rows if row["status"] == "refused")
        for reason, n in reasons.most_common():
            print(f"       refused {n:>3}: {reason}")
        patched = [row for row in rows if row["proof"] not in ("", "refused")]
        print(f"       proven at patch time {sum(row['proof'].startswith('proven') for row in patched)} of the "
              f"{len(patched)} that patch; refused by the proof {sum(row['proof'] == 'refused' for row in rows)}")
        for row in rows:
            if row["proof"] and row["proof"] != "proven":
                print(f"       proof of {row['model_type']}: {row['proof']}")
        for row in rows:
            if row["status"] == "fail":
                print(f"       FAIL {row['model_type']}: {row['reason']}")


def markdown(report: dict[str, Any]) -> str:
    """The doctor's verdict per model type as README markdown (the list README.md carries for the newest release):
    the written families that resolve, then per kind the derived types that pass the self-check and those that do
    not, each with its reason."""
    lines = [f"<!-- generated by `tfcompat doctor --markdown` on transformers {report['transformers']} -->",
             f"On transformers {report['transformers']}:", ""]
    written = [row["family"] for row in report["families"] if row["status"] == "resolved" and row["ok"]]
    lines.append(f"- written families ({len(written)}): " + ", ".join(f"`{k}`" for k in written))
    for kind, what in (("causal_lm", "causal-LM"), ("image_text_to_text", "image-text-to-text")):
        rows = [row for row in report["types"] if row["kind"] == kind]
        passing = [row["model_type"] for row in rows if row["status"] == "pass"]
        lines.append(f"- derived {what} types that pass ({len(passing)} of {len(rows)}): "
                     + ", ".join(f"`{t}`" for t in passing))
        for status, label in (("refused", "refused at `patch()`"), ("unbuildable", "not buildable as tiny models "
                                                                                  "(untested)"), ("fail", "FAIL")):
            others = [row for row in rows if row["status"] == status]
            if others:
                lines.append(f"- {what} {label} ({len(others)}): " + "; ".join(
                    f"`{row['model_type']}` ({_reason_kind(row['reason']).rstrip('.').replace('`', '')})"
                    for row in others))  # only type names in backticks
        patched = [row for row in rows if row["proof"] not in ("", "refused")]
        unproven = [row for row in patched if row["proof"] != "proven"]
        lines.append(f"- {what} types proven at `patch()` on their own config ({len(patched) - len(unproven)} of the "
                     f"{len(patched)} that patch)" + (": all" if not unproven else "; not: " + "; ".join(
                         f"`{row['model_type']}` ({row['proof'].replace('`', '')})" for row in unproven)))
    return "\n".join(lines)


def _reason_kind(reason: str) -> str:
    """A refusal without the type's own names: "cannot derive X: Y holds ..." -> "holds ..."."""
    text = reason.split(": ", 2)[-1]
    words = text.split(" ")
    return " ".join(words[1:]) if words and words[0][:1].isupper() and len(words) > 1 else text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tfcompat", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="resolve every family on the installed transformers and self-check it")
    out = doc.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the report as JSON")
    out.add_argument("--markdown", action="store_true", help="print the verdict per model type as markdown")
    doc.add_argument("--types", default="all", metavar="all|none|TYPE,...",
                     help="causal-LM and image-text-to-text types without a written table to self-check "
                     "(default: all the installed transformers ships)")
    args = parser.parse_args(argv)
    report = doctor(args.types if args.types in ("all", "none") else [t for t in args.types.split(",") if t])
    if args.json:
        print(json.dumps(report, indent=2))
    elif args.markdown:
        print(markdown(report))
    else:
        _print(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
