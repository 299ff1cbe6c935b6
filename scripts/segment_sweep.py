"""Time-segment settings of the sm80 launcher on one few-heads, long-sequence shape (GPU).

    python scripts/segment_sweep.py [--T 65536 --H 24 --filter c16_k128_v128_bf16_gb_sfp32_bv32]

Prints the median ms of the full call for: the launcher's defaults, one piece, and each
(min_segment_tokens, max_segments) setting with no hidden-prep limit, so the launcher's defaults
rest on a measurement; with --beside 0,1,2,none
also for each limit on the prep blocks beside a recurrence block, and with --tails 0,2048,1024 for
each length of a shorter last segment (0: equal segments)."""

from __future__ import annotations

import argparse

from kdagen.cases import bench_case
from kdagen.targets.sm80 import Sm80Launcher
from kdagen.timing import timeit
from kdagen_dev.launch import built_variants, capture_call

SETTINGS = [(None, 1), (8192, 4), (4096, 8), (4096, 12), (2048, 16), (2048, 32)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--H", type=int, default=24)
    ap.add_argument("--filter", default="c16_k128_v128_bf16_gb_sfp32_bv32")
    ap.add_argument("--settings", default="", help="comma-separated MIN_TOKENS/MAX_SEGMENTS cuts to time "
                    "('none/1': one piece; default: " + ",".join(f"{t}/{n}" for t, n in SETTINGS).replace("None", "none")
                    + ")")
    ap.add_argument("--tails", default="", help="comma-separated last-segment lengths in tokens (0: equal "
                    "segments), timed at the default segments and limit")
    ap.add_argument("--beside", default="", help="comma-separated prep blocks allowed beside a recurrence "
                    "block (or 'none'), timed at the default segments")
    a = ap.parse_args()
    T, H = a.T, a.H
    inp = bench_case(T, H, D=128)
    for var, art in built_variants("sm80"):
        if a.filter not in var.name:
            continue
        call = capture_call(inp, var.name)
        o = call.o
        la = Sm80Launcher(var, art)
        defaults = (la.settings.min_segment_tokens, la.settings.max_segments)
        ref = None
        row = [f"{var.name} T{T} H{H}"]

        def measure(label: str, **settings) -> None:
            """Time the launcher with these settings; o's difference from the first setting's o."""
            nonlocal ref
            run = la.with_settings(**settings)
            t = timeit(lambda: run(call), warmup=3, iters=15)
            o_now = o.float().clone()
            ref = o_now if ref is None else ref
            diff = ((o_now - ref).norm() / ref.norm()).item()
            row.append(f"{label} [{run.last_segments}]: {t:.3f} ms (d {diff:.0e})")

        measure("default rule")  # the launcher's own choice, the hidden-prep limit included
        cuts = SETTINGS if not a.settings else [
            (None if t == "none" else int(t), int(n)) for t, n in (x.split("/") for x in a.settings.split(","))]
        for tokens, segs in cuts:  # each cut as set, however little prep it can hide
            measure(f"seg {tokens}/{segs}", min_segment_tokens=tokens, max_segments=segs, min_hidden_prep_us=None)
        at = f"seg {defaults[0]}/{defaults[1]}"
        for tl in [int(x) for x in a.tails.split(",") if x]:
            measure(f"{at}, last segment {tl or 'equal'}", last_segment_tokens=tl or None)
        for kb in [x for x in a.beside.split(",") if x]:
            measure(f"{at}, prep blocks beside a recurrence block {kb}",
                    prep_blocks_beside_recur=None if kb == "none" else int(kb))
        print("\n  ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
