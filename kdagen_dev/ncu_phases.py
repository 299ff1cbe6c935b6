"""Per-phase summary of an ncu source-page export: instructions and stall samples between barriers
(the command line is scripts/ncu_phases.py).

A phase is the SASS between two block barriers (BAR.SYNC), in address order. For each: static
instructions, executed instructions per warp (normalised by the kernel's first instruction, which
every warp executes once), the share of all stall samples, and the largest stall reasons. Cold code
placed after the last barrier (fallback paths) lands in the last phase.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Phase:
    static: int = 0
    executed: int = 0
    samples: int = 0
    stalls: dict[str, int] = field(default_factory=dict)


def read_kernels(path: Path) -> dict[str, list[dict[str, str]]]:
    """Rows of each kernel in the export (an export holds one header block per kernel)."""
    kernels: dict[str, list[dict[str, str]]] = {}
    name, header = None, None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                name, header = row[1], None
                kernels.setdefault(name, [])
            elif name is not None and header is None:
                header = row
            elif name is not None:
                kernels[name].append(dict(zip(header, row)))
    return kernels


def phases(rows: list[dict[str, str]]) -> list[Phase]:
    """Split one kernel's rows at BAR.SYNC instructions."""
    stall_cols = [c for c in (rows[0] if rows else {}) if c.startswith("stall_") and "Not Issued" not in c]
    out = [Phase()]
    for r in rows:
        ph = out[-1]
        ph.static += 1
        ph.executed += int(r.get("Instructions Executed") or 0)
        ph.samples += int(r.get("# Samples") or 0)
        for c in stall_cols:
            reason = c[len("stall_"):]
            ph.stalls[reason] = ph.stalls.get(reason, 0) + int(r.get(c) or 0)
        if "BAR.SYNC" in r.get("Source", ""):
            out.append(Phase())
    return [p for p in out if p.static]


def report(name: str, rows: list[dict[str, str]], top: int = 3) -> str:
    if not rows:
        return f"{name}: no rows"
    warps = int(rows[0].get("Instructions Executed") or 0) or 1
    ph = phases(rows)
    total = sum(p.samples for p in ph) or 1
    lines = [f"{name}: {len(rows)} instructions, {sum(p.executed for p in ph) / warps:.0f} executed per warp, "
             f"{sum(p.samples for p in ph)} stall samples",
             "phase  static  exec/warp  samples  top stalls (% of all samples)"]
    for i, p in enumerate(ph):
        tops = sorted(p.stalls.items(), key=lambda kv: -kv[1])[:top]
        lines.append(f"{i:5d}  {p.static:6d}  {p.executed / warps:9.0f}  {100 * p.samples / total:6.1f}%  "
                     + "  ".join(f"{k} {100 * v / total:.1f}" for k, v in tops if v))
    return "\n".join(lines)
