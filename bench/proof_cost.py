"""The cost and the verdicts of the patch-time proof (`tfcompat.hf.proof`) over every derived type, CPU.

Per type (the doctor's list: causal-LM and image-text-to-text types without a written table), the proof of two
user configs, each with an empty cache: the doctor's tiny model (``tiny``), and the type's full-size default config
(``full``: the model built on the meta device, as a stand-in for a checkpoint; the proof reads its config only).
Prints the verdicts, the types the proof refuses on the full-size config although the doctor's check (without a
proof) passes, and the seconds per type (mean, max, total) that ``patch()`` spends in the proof.

    python bench/proof_cost.py [--types a,b] [--out proof_cost.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tfcompat.errors import TfcompatError  # noqa: E402
from tfcompat.hf import proof as hf_proof  # noqa: E402
from tfcompat.hf.patching import patch  # noqa: E402
from tfcompat.registry import families, resolve_model  # noqa: E402
from tfcompat.registry.versions import installed_transformers  # noqa: E402
from tfcompat.selfcheck import check_type  # noqa: E402
from tfcompat.tiny_models import (  # noqa: E402
    Kind,
    _config_class,
    attention_implementations,
    model_class_name,
    model_types,
    tiny_model,
)


def _full_size(model_type: str, kind: Kind) -> torch.nn.Module:
    """The type's mapped class on its full-size default config, on the meta device (no memory, no init cost)."""
    import transformers

    config_cls = _config_class(model_type, kind)
    config = config_cls()
    vision_cls = (getattr(config_cls, "sub_configs", None) or {}).get("vision_config")
    if kind == "image_text_to_text" and vision_cls is not None and getattr(config, "vision_config", 0) is None:
        config = config_cls(vision_config=vision_cls())
    with torch.device("meta"):
        return getattr(transformers, model_class_name(model_type, kind))._from_config(config)


def _prove(model: torch.nn.Module) -> tuple[str, str, float]:
    hf_proof._CACHE.clear()
    start = time.perf_counter()
    try:
        found = hf_proof.prove(model, resolve_model(model), functools.partial(patch, prove=False))
    except TfcompatError as exc:
        return "refused", str(exc).splitlines()[0] + " | " + exc.why, time.perf_counter() - start
    return found.status, found.reason, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="all")
    parser.add_argument("--out")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # as the doctor: tiny matmuls run many times faster on one thread
    images = set(model_types("image_text_to_text"))
    asked = [*(t for t in model_types("causal_lm") if t not in images), *sorted(images)] if args.types == "all" \
        else args.types.split(",")
    rows = []
    for t in (t for t in asked if t not in families()):
        kind: Kind = "image_text_to_text" if t in images else "causal_lm"
        os.environ[hf_proof.ENV] = "0"  # the doctor's own check, without the proof
        doctor = check_type(t, kind).status
        del os.environ[hf_proof.ENV]
        row = {"model_type": t, "kind": kind, "doctor": doctor}
        for name, build in (("tiny", lambda: tiny_model(t, kind, attn_implementation=attention_implementations(
                t, kind)[-1])), ("full", lambda: _full_size(t, kind))):
            try:
                model = build()
                resolve_model(model)
            except Exception as exc:  # noqa: BLE001 -- not buildable, or refused before any proof
                row[name] = {"status": "n/a", "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"}
                continue
            status, reason, seconds = _prove(model)
            row[name] = {"status": status, "reason": reason[:300], "seconds": round(seconds, 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"transformers {installed_transformers()}, {len(rows)} derived types")
    for name in ("tiny", "full"):
        timed = [r[name]["seconds"] for r in rows if "seconds" in r[name]]
        counts: dict[str, int] = {}
        for r in rows:
            counts[r[name]["status"]] = counts.get(r[name]["status"], 0) + 1
        if timed:
            print(f"{name}: {counts}; proof seconds per type mean {statistics.mean(timed):.3f}, max {max(timed):.3f}, "
                  f"total {sum(timed):.1f} over {len(timed)}")
        findings = [r["model_type"] for r in rows if r["doctor"] == "pass" and r[name]["status"] == "refused"]
        print(f"{name}: refused by the proof, passed by the doctor: {findings}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
