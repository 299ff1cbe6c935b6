"""The measured errors of a test run, per kind of variant and output, next to their bounds.

    KDAGEN_ERRORS=errors.jsonl python -m pytest ...      (kdagen.cases appends one line per check)
    python -m kdagen_dev.error_table errors*.jsonl

For each (target, input dtype, state dtype, device) and output: how many checks, the largest
rel RMSE measured, and the check closest to its bound (error, bound, margin = bound / error, the
test); then how many variants and checks ran per target. This is what the tolerances in kdagen/cases.py rest on.
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
    groups: dict[tuple, dict] = defaultdict(lambda: {"n": 0, "max": 0.0, "margin": float("inf"), "at": None})
    variants: dict[str, set] = defaultdict(set)
    checks: dict[str, int] = defaultdict(int)
    for r in rows:
        variants[r["target"]].add(r["variant"])
        checks[r["target"]] += 1
        for out, err in r["errors"].items():
            g = groups[(r["target"], r["dtype"], r["state"], r["device"], out)]
            g["n"] += 1
            g["max"] = max(g["max"], err)
            margin = r["tolerance"][out] / err if err > 0 else float("inf")
            if margin < g["margin"]:
                g["margin"], g["at"] = margin, (err, r["tolerance"][out], r["case"])
    lines = [f"{'target':11s} {'dtype':5s} {'state':5s} {'device':6s} {'output':12s} {'checks':>6s} "
             f"{'max rel RMSE':>12s} | tightest: {'error':>8s} {'bound':>6s} {'margin':>6s}  case"]
    for key in sorted(groups):
        g = groups[key]
        err, bound, case = g["at"] or (0.0, 0.0, "")
        lines.append(f"{key[0]:11s} {key[1]:5s} {key[2]:5s} {key[3]:6s} {key[4]:12s} {g['n']:6d} {g['max']:12.2e} | "
                     f"{'':9s} {err:8.2e} {bound:6.0e} {g['margin']:6.1f}  {case}")
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
