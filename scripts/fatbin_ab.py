"""A/B timing of alternative builds of one sm80 or sm90 variant on the same inputs (GPU).

    python scripts/fatbin_ab.py --variant kda_fwd_sm80_c16_k128_v128_bf16_gb_sfp32_bv32 \
        [--T 65536 --H 24 [--B 4]] base=build/h800/V/V.fatbin ns4=/tmp/ab/ns4.fatbin ...

Builds are made on the CPU machine with `scripts/fatbin_ab.py --build LABEL -D...` (below), so a
kernel experiment costs one GPU call. For each build: the median ms of the full call (the
launcher's default segmentation), of kda_prep alone and of kda_recur alone, and the relative
difference of o and the final state from the first build's (a changed kernel must not change
the result beyond rounding). --recur-only N runs the recurrence N times after one prep, for ncu.
sm90 variants (one fused kernel) report the full call only, launched as the runtime launches it (the bound
launch where the signature has one).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kdagen_dev.ab import FirstResult, build, entry
from kdagen_dev.launch import bound_args


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", required=True)
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--H", type=int, default=24)
    ap.add_argument("--B", type=int, default=1, help="batch (with --T; issue 16's B4 T4096 H32 row)")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--g-scale", type=float, default=1.0,
                    help="multiply the gate input g by this (data-dependent paths: the span fallback)")
    ap.add_argument("--lens", help="varlen: comma-separated sequence lengths (instead of --T)")
    ap.add_argument("--recur-only", type=int, default=0, help="run kda_recur this many times (for ncu)")
    ap.add_argument("--build", metavar="OUT", help="compile the variant with -D flags into OUT and exit")
    ap.add_argument("-D", dest="defines", action="append", default=[])
    ap.add_argument("-I", dest="includes", action="append", default=[], help="searched before templates/ (--build)")
    ap.add_argument("--allow-serialized", action="store_true",
                    help="(--build) keep a build whose wgmma ptxas serialized (C7511/C7512); refused otherwise")
    ap.add_argument("builds", nargs="*", help="LABEL=PATH.fatbin[@VARIANT] (default: --variant)")
    a = ap.parse_args()
    if a.build:
        build(a.variant, Path(a.build), a.defines, a.includes, allow_serialized=a.allow_serialized)
        return 0

    import torch

    from kdagen.cases import bench_case
    from kdagen.targets.sm80 import Sm80Launcher
    from kdagen.targets.sm90 import Sm90Launcher
    from kdagen.timing import timeit
    from kdagen_dev.launch import capture_call

    var0 = entry(a.variant).variant
    lens = [int(x) for x in a.lens.split(",")] if a.lens else None
    T, H, D = (sum(lens) if lens else a.T), a.H, var0.k
    if lens and a.B != 1:
        raise SystemExit("--B is for --T; --lens is one packed batch")
    inp = bench_case(None if lens else T, H, lens=lens, D=D, B=a.B, gate=var0.gate)  # (the variant's gate form)
    if a.g_scale != 1.0:
        inp["g"] = (inp["g"].float() * a.g_scale).to(inp["g"].dtype)
    first = FirstResult()
    shape = f"varlen {lens}" if lens else f"B{a.B} T{T}"
    print(f"{a.variant} {shape} H{H} D{D} on {torch.cuda.get_device_name()}", flush=True)
    for item in a.builds:
        label, _, path = item.partition("=")
        path, _, vname = path.partition("@")  # LABEL=PATH[@VARIANT]: another variant of the same shape
        var = entry(vname).variant if vname else var0
        call = capture_call(inp, var.name)
        call.o.fill_(float("nan"))
        call.final_state.fill_(float("nan"))
        if var.target == "sm90":  # one fused kernel: the full call only
            la = Sm90Launcher(var, Path(path))
            run, how = _sm90_run(la, call)
            t = timeit(run, warmup=3, iters=a.iters)
            diff, ok = _vs_first(first, call)
            print(f"{label:10s} full {t:7.3f} ms ({t * 1e3 / -(-T // var.chunk):.3f} us/chunk, {how}){diff}"
                  f"{'' if ok else '  NON-FINITE'}", flush=True)
            continue
        la = Sm80Launcher(var, Path(path))
        if a.recur_only:
            la.with_settings(min_segment_tokens=None, parts=("prep",))(call)  # timing only: the
            recur = la.with_settings(min_segment_tokens=None, parts=("recur",))  # workspace is not shared
            for _ in range(a.recur_only):
                recur(call)
            torch.cuda.synchronize()
            print(f"{label}: ran kda_recur x{a.recur_only}", flush=True)
            continue
        t = timeit(lambda: la(call), warmup=3, iters=a.iters)
        nseg = la.last_segments
        diff, ok = _vs_first(first, call)
        prep = la.with_settings(min_segment_tokens=None, parts=("prep",))
        t1 = timeit(lambda: prep(call), warmup=2, iters=a.iters)
        recur = la.with_settings(min_segment_tokens=None, parts=("recur",))
        t2 = timeit(lambda: recur(call), warmup=2, iters=a.iters)
        tn = ""
        if nseg:  # the same call without the launcher's limit on prep blocks beside the recurrence
            la2 = la.with_settings(prep_blocks_beside_recur=None)
            tn = f" ({timeit(lambda: la2(call), warmup=3, iters=a.iters):.3f} without the prep limit)"
        print(f"{label:10s} full {t:7.3f} ms [{nseg} seg]{tn}  prep {t1:.3f}  recur {t2:.3f} "
              f"({t2 * 1e3 / -(-T // var.chunk):.3f} us/step){diff}{'' if ok else '  NON-FINITE'}", flush=True)
    return 0


def _sm90_run(la, call):
    """The call as the runtime makes it: the bound launch where the signature has one (the general path's ~115 us
    of Python per call would otherwise sit inside every timed call), else the general path."""
    bound = la.bind(call)
    if bound is None:
        return (lambda: la(call)), "general path"
    args = bound_args(call)

    def run() -> None:
        if not bound.launch(*args):
            raise RuntimeError(f"the bound launch declined: {bound.last_failure or 'a concurrent call'}")

    return run, "bound"


def _vs_first(first: FirstResult, call) -> tuple[str, bool]:
    d, ok = first.check(call)
    return ("" if d is None else f"  d(o, ht) vs first {d:.1e}"), ok


if __name__ == "__main__":
    raise SystemExit(main())
