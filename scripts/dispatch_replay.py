"""Replay this tree's dispatch against `kdagen bench` JSON files (CPU): see kdagen_dev/replay.py.

    KDAGEN_TUNING=off python scripts/dispatch_replay.py benchmarks/results/logs/2026-12-05_s50_call7_bench_h200_off.json
"""

from __future__ import annotations

import sys
from pathlib import Path

from kdagen_dev.replay import replay, report

if __name__ == "__main__":
    if len(sys.argv) < 2 or any(a.startswith("-") for a in sys.argv[1:]):
        raise SystemExit(__doc__)  # (no options: -h/--help and anything else print the usage)
    for p in sys.argv[1:]:
        print(report(replay(Path(p)), p))
