"""The measured errors of a test run, per kind of variant and output, next to their bounds.

    KDAGEN_ERRORS=errors.jsonl python -m pytest ...      (kdagen.cases appends one line per check)
    python -m kdagen_dev.error_table errors*.jsonl

For each (target, input dtype, state dtype, device) and output: how many checks, the largest
rel RMSE measured, the bound it was held to and the margin (bound / largest); then how many
variants and checks ran per target. This is what the tolerances in kdagen/cases.py rest on.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def load(paths) -> list[dict]:
    rows = []
    for p in paths:
        for line in Path(p).read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    return rows


def table(rows: list[dict]) -> str:
    worst: dict[tuple, dict] = defaultdict(lambda: {"n": 0, "max": 0.0, "bound": 0.0, "case": ""})
    variants: dict[str, set] = defaultdict(set)
    checks: dict[str, int] = defaultdict(int)
    for r in rows:
        variants[r["target"]].add(r["variant"])
        checks[r["target"]] += 1
        for out, err in r["errors"].items():
            w = worst[(r["target"], r["dtype"], r["state"], r["device"], out)]
            w["n"] += 1
            w["bound"] = max(w["bound"], r["tolerance"][out])
            if err > w["max"]:
                w["max"], w["case"] = err, r["case"]
    lines = [f"{'target':8s} {'dtype':5s} {'state':5s} {'device':6s} {'output':12s} {'checks':>6s} "
             f"{'max rel RMSE':>12s} {'bound':>8s} {'margin':>7s}  worst case"]
    for key in sorted(worst):
        w = worst[key]
        margin = w["bound"] / w["max"] if w["max"] > 0 else float("inf")
        lines.append(f"{key[0]:8s} {key[1]:5s} {key[2]:5s} {key[3]:6s} {key[4]:12s} {w['n']:6d} {w['max']:12.2e} "
                     f"{w['bound']:8.0e} {margin:7.1f}  {w['case']}")
    total_v = sum(len(s) for s in variants.values())
    lines.append(f"{total_v} variants, {sum(checks.values())} checks: "
                 + ", ".join(f"{t} {len(variants[t])} variants / {checks[t]} checks" for t in sorted(variants)))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    print(table(load(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
