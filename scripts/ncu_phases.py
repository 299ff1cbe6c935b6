"""Per-phase summary of an ncu source-page export (kdagen_dev/ncu_phases.py).

    ncu -i REPORT.ncu-rep --page source --print-source sass --csv > SRC.csv
    python scripts/ncu_phases.py SRC.csv [--kernel kda_prep]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kdagen_dev.ncu_phases import read_kernels, report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", type=Path)
    ap.add_argument("--kernel", default="", help="only kernels whose name contains this")
    a = ap.parse_args()
    kernels = read_kernels(a.csv)
    if not kernels:
        print(f"{a.csv}: no kernel in the export (was it written with --page source --csv?)", file=sys.stderr)
        return 1
    for name, rows in kernels.items():
        if a.kernel in name:
            print(report(name, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
