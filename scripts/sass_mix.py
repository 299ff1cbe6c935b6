"""Instruction mix of built variants' kernels, from their SASS (no GPU needed).

    python scripts/sass_mix.py build/h800/<variant>/<variant>.fatbin [OTHER.fatbin] [--arch sm_90]

With two artifacts, prints both mixes side by side: a quick check of whether a source change
altered the machine code, and where (see kdagen_dev/sass.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kdagen_dev.sass import disassemble


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifacts", nargs="+", type=Path)
    ap.add_argument("--arch", default="sm_90")
    a = ap.parse_args()
    if len(a.artifacts) > 2:
        ap.error("one artifact, or two to compare")
    dumps = [disassemble(p, a.arch) for p in a.artifacts]
    for name in sorted(set().union(*dumps)):
        mixes = [d[name].mix() if name in d else {} for d in dumps]
        totals = [len(d[name].instructions) if name in d else 0 for d in dumps]
        print(f"{name}: " + " vs ".join(f"{t} instructions" for t in totals))
        for cls in sorted(set().union(*mixes), key=lambda c: -max(m.get(c, 0) for m in mixes)):
            print(f"  {cls:15s}" + "".join(f"{m.get(cls, 0):8d}" for m in mixes))
        bars = [d[name].barriers() if name in d else [] for d in dumps]
        print("  barriers       " + " | ".join(", ".join(b) or "-" for b in bars))
    return 0


if __name__ == "__main__":
    sys.exit(main())
