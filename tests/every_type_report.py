"""Counts of every causal-LM type on the installed transformers: pass / refused (by reason) / fail / unbuildable.

    PYTHONPATH=$PWD python -m tests.every_type_report [--stock] [--impl eager|sdpa|both] [--only TYPE ...]

`--stock` runs the zoo's own check (`stock_check`: builds, runs forward and backward, the control) instead of
`tfcompat.patch`. `--kind image_text_to_text` runs `vlm_check` (packed with images through `tfcompat.patch` and
`tfcompat.pack` vs stock per sequence; the reason of a pass is its control), or with `--stock` the zoo with one image
(`image_check`). A type's outcome over both references is the worst of them (fail, unbuildable, refused, pass);
a reference the class does not offer (sdpa) is left out. Prints a per-type table, then the totals out of how many
types transformers ships.
"""

from __future__ import annotations

import argparse
import collections
import re
import time
import warnings

import torch

from tests.every_type import Outcome, check, image_check, stock_check, vlm_check
from tfcompat.registry.versions import installed_transformers
from tfcompat.tiny_models import model_types


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stock", action="store_true", help="check the zoo without tfcompat")
    parser.add_argument("--impl", default="both", choices=["eager", "sdpa", "both"], help="stock reference(s)")
    parser.add_argument("--only", nargs="*", help="these types only")
    parser.add_argument("--kind", default="causal_lm", choices=["causal_lm", "image_text_to_text"],
                        help="image_text_to_text: packed rows with fake images (vlm_check; --stock: image_check)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny matmuls; see tests/test_every_causal_lm.py
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    types = model_types(args.kind)
    impls = ("eager", "sdpa") if args.impl == "both" else (args.impl,)
    outcomes = []
    missing = sorted(set(args.only or ()) - set(types))
    if missing:  # a type of another release: said, not run
        print(f"not {args.kind} types of transformers {installed_transformers()}: {', '.join(missing)}")
    for model_type in [t for t in args.only or types if t in types]:
        start = time.perf_counter()
        if args.kind == "image_text_to_text":
            outcome = image_check(model_type) if args.stock else _worst([vlm_check(model_type, i) for i in impls])
        else:
            outcome = stock_check(model_type) if args.stock else _worst([check(model_type, i) for i in impls])
        outcomes.append(outcome)
        diff = f"{outcome.diff:.1e}" if outcome.diff is not None else "-"
        print(f"{model_type:28} {outcome.status:11} {time.perf_counter() - start:5.2f}s {diff:>8}  {outcome.reason}",
              flush=True)
    counts = collections.Counter(o.status for o in outcomes)
    mode = ("stock zoo" + (" with an image" if args.kind != "causal_lm" else "") if args.stock
            else f"tfcompat.patch vs stock {args.impl}" + (", packed with images" if args.kind != "causal_lm" else ""))
    print(f"\ntransformers {installed_transformers()}, {mode}: {len(outcomes)} of {len(types)} {args.kind} types: "
          + ", ".join(f"{counts[s]} {s}" for s in ("pass", "refused", "fail", "unbuildable")))
    for status in ("refused", "unbuildable", "fail"):
        # one line per kind of reason: the type's own name and suggestions left out
        reasons = collections.Counter(re.sub(r"'[^']*'", "'...'", o.reason.split(" (why")[0].split(";")[0])
                                      for o in outcomes if o.status == status)
        for reason, n in reasons.most_common():
            print(f"  {status} x{n}: {reason}")
    return 1 if counts["fail"] else 0


_ORDER = ("fail", "unbuildable", "refused", "pass", "skipped")


def _worst(outcomes: list[Outcome]) -> Outcome:
    return min(outcomes, key=lambda o: _ORDER.index(o.status))


if __name__ == "__main__":
    raise SystemExit(main())
