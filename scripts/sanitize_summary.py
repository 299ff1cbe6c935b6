"""Summarise a `gpu_check.sh sanitize` run: one row per variant, the error count of each tool.

    python3 scripts/sanitize_summary.py OUT/sanitize   # exit 1 if any tool reported an error
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ERRORS = re.compile(r"(?:ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error)")


def summarise(folder: Path) -> tuple[str, bool]:
    variants = [v for v in (folder / "variants.txt").read_text().split() if v]
    tools = sorted(p.stem for p in folder.glob("*.rc"))
    lines = ["| variant | " + " | ".join(tools) + " |", "|---|" + "---|" * len(tools)]
    clean = bool(variants) and bool(tools)
    for v in variants:
        row = []
        for t in tools:
            log = folder / f"{t}-{v}.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            m = ERRORS.search(text)
            ran = f"ran {v}" in text
            if m and ran:
                n = int(m.group(1) or m.group(2))
                row.append(str(n))
                clean &= n == 0
            else:  # no summary line, or the case did not finish: a failure, not a pass
                row.append("did not finish")
                clean = False
        lines.append(f"| {v} | " + " | ".join(row) + " |")
    lines.append("")
    lines.append(f"{len(variants)} variant(s) x {len(tools)} tool(s): {'0 errors' if clean else 'ERRORS (see the logs)'}")
    return "\n".join(lines), clean


def main() -> int:
    text, clean = summarise(Path(sys.argv[1]))
    print(text)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
