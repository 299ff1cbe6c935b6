"""Dispatch replayed against a bench's measured times (CPU, no GPU).

For each case of a `kdagen bench` JSON: the variant this tree's selection would pick among the
variants that bench timed, on a stand-in CUDA device with the bench GPU's name (its tuning file,
unless KDAGEN_TUNING says otherwise) and SM count; its measured time against the fastest measured.
A change to selection's defaults or a tuning file can so be judged on earlier measurements before
device time is spent. The times are the bench's: a replay predicts, a bench run measures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kdagen.bench import DISPATCH_TOLERANCE as TOLERANCE


@dataclass(frozen=True)
class Replayed:
    case: str
    pick: str
    ms: Optional[float]  # None: the bench did not time the pick's call (a routed call of another variant)
    best: float
    bench_auto: str

    @property
    def ok(self) -> bool:
        return self.ms is not None and self.ms <= self.best * (1 + TOLERANCE)


def replay(bench_json: Path) -> list[Replayed]:
    import torch

    import kdagen.select as sel
    from kdagen import tuning
    from kdagen.bench import case_from_dict
    from kdagen.inputs import CallInfo
    from kdagen.ondemand import parse_name

    d = json.loads(Path(bench_json).read_text())
    env = d["env"]
    saved = (sel._sm_count, sel.device_reason, tuning._device_name)
    sel._sm_count = lambda device: env["sm_count"]
    sel.device_reason = lambda target, device: None
    tuning._device_name = lambda index: env["gpu"]
    tuning.forget()
    try:
        out = []
        for row in d["cases"]:
            c = case_from_dict(row["case"], row["case"]["name"])
            timed = {x["variant"]: x["timing"]["median"] for x in row["variants"] if "timing" in x}
            if not timed:
                continue
            names = {n.split(" (")[0] for n in timed if n.startswith("kda_fwd_")}
            varlen = c.lens is not None
            info = CallInfo(device=torch.device("cuda", 0), dtype=c.dtype, layout="bsnd", B=1 if varlen else c.B,
                            T=c.tokens if varlen else c.longest, N=c.N, H=c.H, HV=c.hv, K=c.D, V=c.D, gate=c.gate,
                            state="fp32", varlen=varlen, chunk_size=None, max_len=c.longest, cu_seqlens_host=None)
            pick = sel.select([parse_name(n) for n in sorted(names)], info).name
            ms = timed.get(pick)
            auto = row.get("auto") or ""
            if auto != pick and auto.split(" (")[0] == pick:  # the bench timed the pick's routed call (the scan)
                ms = timed.get(auto)
            elif " (" in auto:  # the call routes (the scan) with another variant: the pick's route was not timed
                ms = None
            out.append(Replayed(c.name, pick, ms, min(timed.values()), auto))
        return out
    finally:
        sel._sm_count, sel.device_reason, tuning._device_name = saved
        tuning.forget()


def report(rows: list[Replayed], source: str) -> str:
    def status(r: Replayed) -> str:
        return "ok" if r.ok else "-" if r.ms is None else "MISS"

    lines = [f"{r.case[:40]:40s} {r.pick.removeprefix('kda_fwd_'):45s} "
             f"{'untimed' if r.ms is None else f'{r.ms:.3f}':>7} best {r.best:.3f} {status(r)}"
             f"  (the bench's auto: {r.bench_auto.removeprefix('kda_fwd_')})" for r in rows]
    untimed = sum(r.ms is None for r in rows)
    lines.append(f"{sum(r.ok for r in rows)} of {len(rows) - untimed} within {TOLERANCE:.0%} of the fastest measured"
                 f"{f', {untimed} not timed by the bench' if untimed else ''} (replayed on {source})")
    return "\n".join(lines)
