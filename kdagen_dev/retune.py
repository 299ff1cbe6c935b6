"""A tuning file's rules derived again from its own evidence (CPU, no GPU).

Each rule of a file `kdagen tune` wrote keeps, per case of its regime, every (chunk, block_v)
time of its target: the measurements tuning.derive_rules took. Read back and placed by the case's
regime (the bench case of that name: tokens per sequence, sequences x value heads per SM on the
file's SM count), they give the rules today's regime edges derive from the same run, without
measuring again. Used when the edges change (session 54: 0.125 in SEQ_HEAD_EDGES).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

from kdagen import tuning
from kdagen.bench import CASE_SETS, Case, case_regime


class RetuneError(ValueError):
    """Evidence that cannot be read back into measurements (names the rule and what is missing)."""


def _cases() -> dict[str, Case]:
    return {c.name: c for cases in CASE_SETS.values() for c in cases}


def measurements(t: tuning.Tuning) -> list[dict]:
    """The measurements (tuning.derive_rules' input) the rules of `t` record in their evidence."""
    cases = _cases()
    out: dict[tuple, dict] = {}
    for i, r in enumerate(t.rules):
        if "filled_from" in r.evidence:
            continue  # (a copy of its coarse cell's evidence)
        ms = r.evidence.get("ms")
        if not isinstance(ms, dict) or not ms:
            raise RetuneError(f"rules[{i}] ({r.target}): no per-case times in its evidence")
        for name, times in ms.items():
            case = cases.get(name)
            if case is None:
                raise RetuneError(f"rules[{i}] ({r.target}): case {name!r} is no bench case of this tree "
                                  f"(its regime is unknown)")
            key = (r.target, r.dtype, r.head_dim, r.gate, name)
            if key in out:
                continue
            parsed = {}
            for setting, ms_ in times.items():
                cb = tuning.parse_setting(setting)
                if cb is None:
                    raise RetuneError(f"rules[{i}] ({r.target}): setting {setting!r} of case {name!r}: expected "
                                      f"c<chunk>_bv<block_v>")
                parsed[cb] = float(ms_)
            tps, shs = case_regime(case, t.sm_count)
            out[key] = {"case": name, "target": r.target, "dtype": r.dtype, "head_dim": r.head_dim, "gate": r.gate,
                        "tokens_per_seq": tps, "seq_heads_per_sm": shs, "times": parsed}
    return list(out.values())


def rederive(t: tuning.Tuning, note: str) -> tuning.Tuning:
    """`t` with its rules derived again from its evidence; `note` is added to made_by."""
    rules = tuning.derive_rules(measurements(t))
    made_by = t.meta.get("made_by", "kdagen tune")
    return replace(t, rules=tuple(rules), meta={**t.meta, "made_by": f"{made_by}; {note}"})


def changes(old: tuning.Tuning, new: tuning.Tuning) -> list[str]:
    """Per measured case whose first-ranked (target, chunk, block_v) differs between the files: a line."""
    lines = []
    seen = set()
    for m in measurements(old):
        key = (m["case"], m["dtype"], m["head_dim"], m["gate"])
        if key in seen:
            continue
        seen.add(key)
        a, b = _first(old, m), _first(new, m)
        if a != b:
            lines.append(f"{m['case']} ({m['gate']}): {a[1:] if a else None} -> {b[1:] if b else None}")
    return lines


def _first(t: tuning.Tuning, m: dict) -> Optional[tuple]:
    """(rank, target, chunk, block_v) of the first-ranked rule of `t` in measurement m's regime."""
    picks = []
    for target in sorted({r.target for r in t.rules}):
        r = t.rule_for(target, m["dtype"], m["head_dim"], m["tokens_per_seq"], m["seq_heads_per_sm"], m["gate"])
        if r is not None:
            picks.append((99 if r.rank is None else r.rank, target, r.chunk, r.block_v))
    return min(picks) if picks else None


def main(paths: list[Path], note: str, write: bool) -> int:
    for p in paths:
        old = tuning.load(p)
        new = rederive(old, note)
        print(f"{p}: {len(old.rules)} rules -> {len(new.rules)}")
        for line in changes(old, new) or ["no measured case changes its first-ranked target or setting"]:
            print(f"  {line}")
        if write:
            tuning.save(new, p)
    return 0
