"""A/B timing of launch options of Triton variants on the same inputs (GPU).

    python scripts/triton_ab.py --variant kda_fwd_triton_c16_k128_v128_bf16_gb_sfp32_bv32 \
        [--variant ...] [--case 65536x24 --case 8192x96] base= s3=recur_stages=3 \
        g3=recur_gam_next=1,recur_stages=3 w4=prep_warps=4

Each LABEL=OPTIONS is one configuration: keyword arguments of the generated module's launch()
(prep_warps, prep_stages, prep_maxnreg, recur_warps, recur_stages, recur_gam_next); an empty
one is the template's defaults. A label may be limited to one chunk size with a suffix,
`w4@c64=prep_warps=4`. For every case (B1, T tokens, H heads, bf16 bounded gate, fp32 state),
variant and configuration: the median ms of the full call, of kda_prep alone and of kda_recur
alone (and its us per serial chunk step), and the relative difference of o and the final state
from the variant's first configuration (an option changes the schedule, not the arithmetic: it
must print 0 or rounding). Compile time is outside the timings (first call of each option set).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def parse_config(text: str) -> tuple[str, int | None, dict[str, int]]:
    """'LABEL[@cN]=k=v,k=v' -> (label, chunk or None, options)."""
    label, sep, opts = text.partition("=")
    if not sep or not label:
        raise SystemExit(f"configuration {text!r}: expected LABEL=OPTIONS (OPTIONS may be empty)")
    label, _, only = label.partition("@")
    chunk = int(only[1:]) if only else None
    cfg = {}
    for item in filter(None, opts.split(",")):
        k, sep, v = item.partition("=")
        if not sep:
            raise SystemExit(f"configuration {text!r}: option {item!r} is not key=value")
        cfg[k] = int(v)
    return label, chunk, cfg


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--case", action="append", default=None, help="TxH (default 65536x24 and 8192x96)")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("configs", nargs="+", help="LABEL[@cCHUNK]=OPTIONS")
    a = ap.parse_args()
    configs = [parse_config(c) for c in a.configs]
    cases = [tuple(int(x) for x in c.split("x")) for c in (a.case or ["65536x24", "8192x96"])]

    import torch

    from kdagen.cases import bench_case
    from kdagen.targets.triton import TritonLauncher
    from kdagen.timing import timeit
    from kdagen_dev.ab import FirstResult, entry
    from kdagen_dev.launch import capture_call

    rows = []
    print(f"on {torch.cuda.get_device_name()}, triton {__import__('triton').__version__}", flush=True)
    for T, H in cases:
        for name in a.variant:
            e = entry(name)
            var = e.variant
            inp = bench_case(T, H, D=var.k)
            call = capture_call(inp, name)
            la = TritonLauncher(var, e.source_dir / "kernel.py")
            first = FirstResult()
            print(f"== {name} B1 T{T} H{H}", flush=True)
            for label, only, cfg in configs:
                if only is not None and only != var.chunk:
                    continue
                la.config, la.parts = cfg, ("prep", "recur")
                call.o.fill_(float("nan"))
                call.final_state.fill_(float("nan"))
                full = timeit(lambda: la(call), warmup=3, iters=a.iters)
                diff, ok = first.check(call)
                diff = diff or 0.0
                la.parts = ("prep",)
                prep = timeit(lambda: la(call), warmup=2, iters=a.iters)
                la.parts = ("recur",)  # times only: reads the workspace the allocator hands back
                recur = timeit(lambda: la(call), warmup=2, iters=a.iters)
                steps = -(-T // var.chunk)
                rows.append(dict(variant=name, T=T, H=H, label=label, options=cfg, full_ms=full, prep_ms=prep,
                                 recur_ms=recur, us_per_step=recur * 1e3 / steps, rel_diff=diff, finite=ok))
                print(f"  {label:8s} full {full:7.3f} ms  prep {prep:7.3f}  recur {recur:7.3f} "
                      f"({recur * 1e3 / steps:.3f} us/step)  d(o, ht) vs first {diff:.1e}"
                      f"{'' if ok else '  NON-FINITE'}  {cfg}", flush=True)
            del call, inp
            torch.cuda.empty_cache()
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
