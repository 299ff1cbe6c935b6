"""The segment scan on one GPU (issue 17): the one-piece call against the scan, its pieces' times
(to replace the planner's placeholder costs) and its accuracy (GPU; not a test).

    PYTHONPATH=$PWD python scripts/scan_bench.py [--rows issue17|all|NAME,...] [--segments 2,4,8,16,32]
                                                 [--accuracy] [--out benchmarks/results/DATE_scan_h200.md]

Inputs and timing are `kdagen bench`'s (bf16, D=128, fp32 state, median of CUDA-event
times over rotated input sets). Per row: kdagen's one-piece call (runtime's choice), the scan
composed of kda_prefill calls (kdagen.scan.engine) at each segment count, what the planner picks
under each cost set, and at the fastest count the time of step 1 (its two calls, B and A), the
chain (torch and Triton) and step 3 (the rerun), with per-chunk-step figures for the planner.
--routed times kda_prefill's route to the scan against one piece instead (KDAGEN_SCAN).
--accuracy adds the checks of issue 17: T = 1,048,576 H = 2 and a gate that barely decays
(lower_bound -1e-3) against the one-piece call, and T = 8192 H = 4 against the float64 reference.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import kdagen
from kdagen.cases import bench_inputs as make_inputs
from kdagen.reference import rel_rmse
from kdagen.scan.chain import chain_states
from kdagen.scan.engine import maps_step, pack, planned_segments, rerun_step, scan_prefill, validate
from kdagen.scan.layout import split
from kdagen.timing import median_ms, timeit
from kdagen.scan.planner import COSTS  # noqa: E402

ROWS = {
    # issue 17's rows (targets there), then rows where the planner must stay off
    "B1 T32768 H32": dict(T=32768, H=32),
    "B1 T65536 H24": dict(T=65536, H=24),
    "skew H32": dict(lens=[30000, 7, 1, 64, 999, 3000], H=32),
    "B1 T8192 H4": dict(T=8192, H=4),
    "B1 T32768 H8": dict(T=32768, H=8),
    "B1 T65536 H8": dict(T=65536, H=8),
    "B1 T131072 H4": dict(T=131072, H=4),
    "varlen 4x8192 H4": dict(lens=[8192] * 4, H=4),
    "B1 T8192 H96": dict(T=8192, H=96),
    "B1 T2048 H8": dict(T=2048, H=8),
    # longer few-head calls, a batch of two and one varlen sequence (kda_prefill's route to the scan)
    "B1 T262144 H4": dict(T=1 << 18, H=4),
    "B2 T65536 H4": dict(B=2, T=65536, H=4),
    "varlen 1x65536 H8": dict(lens=[65536], H=8),
    # a context-parallel rank's piece and issue 19's whole call (the one-GPU baseline)
    "B1 T524288 H8": dict(T=1 << 19, H=8),
    "B1 T1048576 H8": dict(T=1 << 20, H=8),
}
ISSUE17 = list(ROWS)[:8]


def call_kw(kw, cu, lower_bound=-5.0):
    return dict(A_log=kw["A_log"], dt_bias=kw["dt_bias"], lower_bound=lower_bound, initial_state=kw["initial_state"],
                output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu() if cu is not None else None)


def one_piece(s, lb=-5.0):
    kw, cu = s
    return kdagen.kda_prefill(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], **call_kw(kw, cu, lb))


def scanned(s, segments, lb=-5.0, mode="rerun"):
    kw, cu = s
    return scan_prefill(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], segments=segments, mode=mode,
                        **call_kw(kw, cu, lb))


def kernel_ms(fn) -> dict:
    """Device ms of one call of fn() by kernel role (torch.profiler), for fitting the planner."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    roles = {"kda_prep": "prep", "kda_recur_twins": "twins", "kda_recur": "recur", "_correct_kernel": "correct",
             "_chain_kernel": "chain"}
    out: dict = {}
    for e in prof.key_averages():
        if e.device_time_total <= 0:
            continue
        role = roles.get(e.key, "other")
        out[role] = out.get(role, 0.0) + e.device_time_total / 1000
    return out


def occupancy(s, segments) -> str:
    """block_v of the variant the scan's calls select at `segments`, and the kda_recur /
    kda_recur_twins blocks an SM holds (the planner's wave model takes both)."""
    from kdagen.runtime import prepare

    kw, cu = s
    P = pack(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], **call_kw(kw, cu))
    plan = P.call(prepare, split(P.cu, segments, 64), output_final_state=True)
    la, dev = plan.launcher, kw["q"].device
    res = [f"bv={plan.variant.block_v}"]
    if hasattr(la, "recur_blocks_per_sm"):
        res += [f"R={la.recur_blocks_per_sm(dev)}", f"R2={la.recur_blocks_per_sm(dev, twins=True)}"]
    return " ".join(res)


def pieces(s, segments) -> dict:
    """Times (ms) of the scan's steps on their own, at `segments`."""
    kw, cu = s
    P = pack(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], **call_kw(kw, cu))
    lay = split(P.cu, segments, 64)
    known = [True] * lay.num_sequences
    prefill = kdagen.kda_prefill
    A, B, _, _ = maps_step(P, lay, known, prefill)
    S_in, _ = chain_states(A, B, P.h0, lay.counts)
    res = {"step1 ms": timeit(lambda: maps_step(P, lay, known, prefill)),
           "chain torch ms": timeit(lambda: chain_states(A, B, P.h0, lay.counts, impl="torch")),
           "chain triton ms": timeit(lambda: chain_states(A, B, P.h0, lay.counts, impl="triton")),
           "step3 ms": timeit(lambda: rerun_step(P, lay, S_in, prefill, False))}
    longest = max(lay.chunks(16))
    res["step1 us/chunk-step"] = 1000 * res["step1 ms"] / longest
    res["step3 us/chunk-step"] = 1000 * res["step3 ms"] / longest
    return res


def routed(names, iters) -> list[str]:
    """kda_prefill as a user calls it (the route to the scan on, kdagen/scan/route.py) against the
    same call with KDAGEN_SCAN=0 (one piece), in alternating rounds, and both against the float64
    chunked reference with the bench gate and with one that barely decays."""
    import os

    from kdagen import runtime as rt
    from kdagen.reference import kda_chunked_reference

    lines = ["", "kda_prefill with the route to the scan (KDAGEN_SCAN=1, the default) against KDAGEN_SCAN=0 "
             "(one piece); median ms per round (on / off, on / off); o and final state against float64:", "",
             "| case | route | on ms | off ms | on / off | lower_bound | o on | o off | state on | state off |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def setting(on: bool) -> None:
        os.environ["KDAGEN_SCAN"] = "1" if on else "0"

    for name in names:
        c = ROWS[name]
        sets = [make_inputs(**c, seed=i) for i in range(2)]
        kw, cu = sets[0]
        label = rt.route_of(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], **call_kw(kw, cu)) or "one piece"
        ms = {True: [], False: []}
        for _ in range(2):
            for on in (True, False):
                setting(on)
                ms[on].append(median_ms(one_piece, sets, iters=iters))
        setting(True)
        on_ms, off_ms = min(ms[True]), min(ms[False])
        timing = (f"{' / '.join(f'{x:.3f}' for x in ms[True])} | {' / '.join(f'{x:.3f}' for x in ms[False])} | "
                  f"{on_ms / off_ms:.2f}x")
        del sets
        for lb in (-5.0, -1e-3):
            s = make_inputs(**c, seed=7)
            kw, cu = s
            ref = kda_chunked_reference(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], A_log=kw["A_log"],
                                        dt_bias=kw["dt_bias"], lower_bound=lb, initial_state=kw["initial_state"],
                                        output_final_state=True, cu_seqlens=cu)
            errs = {}
            for on in (True, False):
                setting(on)
                out = one_piece(s, lb)
                errs[on] = (rel_rmse(out[0], ref[0]), rel_rmse(out[1], ref[1]))
            setting(True)
            lines.append(f"| {name} | {label} | {timing} | {lb:g} | {errs[True][0]:.2e} | {errs[False][0]:.2e} | "
                         f"{errs[True][1]:.2e} | {errs[False][1]:.2e} |")
            print(lines[-1], flush=True)
            timing = " | | "
            del s, ref
            torch.cuda.empty_cache()
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="issue17", help="issue17 | all | comma-separated row names")
    ap.add_argument("--segments", default="2,4,8,16,32")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--modes", default="rerun", help="scan modes to time: rerun, correct or both")
    ap.add_argument("--kernels", action="store_true",
                    help="also print each call's device ms by kernel role (KERN lines, for the planner's costs)")
    ap.add_argument("--routed", action="store_true",
                    help="only kda_prefill's route to the scan against one piece (time, accuracy against float64)")
    ap.add_argument("--out", default=None, help="write the markdown report here too")
    a = ap.parse_args()
    names = {"issue17": ISSUE17, "all": list(ROWS)}.get(a.rows) or a.rows.split(",")
    if a.routed:
        torch.backends.cuda.matmul.allow_tf32 = False
        text = "\n".join([f"# Route to the scan ({torch.cuda.get_device_name(0)})"] + routed(names, a.iters)) + "\n"
        print(text)
        if a.out:
            Path(a.out).write_text(text)
        return 0
    counts = [int(x) for x in a.segments.split(",") if x]
    modes = [m for m in a.modes.split(",") if m]
    torch.backends.cuda.matmul.allow_tf32 = False
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = [f"# Segment scan on one GPU ({torch.cuda.get_device_name(0)}, {sms} SMs)", "",
             "kdagen one piece (runtime's choice) against the scan composed of kda_prefill calls; median ms; "
             "d: rel RMSE of o against the one-piece o.", "",
             "| case | mode | one piece | " + " | ".join(f"scan S={s}" for s in counts)
             + " | planner's S (engine / kernels costs) | segments=None |",
             "|---" * (5 + len(counts)) + "|"]
    detail = []
    for name in names:
        c = ROWS[name]
        sets = [make_inputs(**c, seed=i) for i in range(2)]
        one = median_ms(one_piece, sets, iters=a.iters)
        ref = one_piece(sets[0])
        kw, cu = sets[0]
        info, cuts = validate(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], **call_kw(kw, cu))
        if a.kernels:
            print(f"KERN {name} | one | 1 | {one:.3f} | " + _roles(kernel_ms(lambda: one_piece(sets[0]))) + " | "
                  + occupancy(sets[0], 1), flush=True)
        best = (None, float("inf"))
        for mode in modes:
            cells = []
            for S in counts:
                try:
                    ms = median_ms(lambda s: scanned(s, S, mode=mode), sets, warmup=2, iters=max(3, a.iters // 2))
                    out = scanned(sets[0], S, mode=mode)
                    d = rel_rmse(out[0], ref[0])
                    cells.append(f"{ms:.3f} (d {d:.0e})")
                    if mode == "rerun" and ms < best[1]:
                        best = (S, ms)
                    if a.kernels:
                        km = kernel_ms(lambda: scanned(sets[0], S, mode=mode))
                        print(f"KERN {name} | {mode} | {S} | {ms:.3f} | " + _roles(km) + " | "
                              + occupancy(sets[0], S), flush=True)
                except Exception as e:  # a count too large for memory: say so, keep going
                    cells.append(f"error: {str(e).splitlines()[0][:40]}")
            plans = [max(planned_segments(info, cuts, mode=mode, costs=k)) for k in COSTS]
            cells.append(" / ".join(str(p) if p > 1 else "off" for p in plans))
            # what a caller gets from segments=None: the planner's cut, timed like the others
            ms = median_ms(lambda s: scanned(s, None, mode=mode), sets, warmup=2, iters=max(3, a.iters // 2))
            cells.append(f"{ms:.3f} ({ms / one:.2f}x one piece)")
            lines.append(f"| {name} | {mode} | {one:.3f} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
        if best[0] is not None:
            pc = pieces(sets[0], best[0])
            detail.append(f"- {name}, S={best[0]}: " + ", ".join(f"{k} {v:.3f}" for k, v in pc.items()))
            print(detail[-1], flush=True)
        del sets
        torch.cuda.empty_cache()
    lines += ["", "Pieces at the fastest segment count (us/chunk-step: step time over the longest segment's "
              "chunk-16 steps):", ""] + detail
    if a.accuracy:
        lines += ["", "Accuracy against the one-piece call:", ""]
        # The bench gate (lower_bound -5) underflows every segment's transition to 0, which makes
        # the long check trivially exact; a barely decaying gate carries state across segments.
        for label, c, S, lb in (("B1 T1048576 H2 lower_bound -1e-3", dict(T=1 << 20, H=2), 64, -1e-3),
                                ("B1 T65536 H8 lower_bound -1e-3", dict(T=65536, H=8), 16, -1e-3)):
            s = make_inputs(**c, seed=5)
            t0 = time.time()
            ref = one_piece(s, lb)
            out = scanned(s, S, lb)
            lines.append(f"- {label}, S={S}: o {rel_rmse(out[0], ref[0]):.2e}, final state "
                         f"{rel_rmse(out[1], ref[1]):.2e} ({time.time() - t0:.1f} s)")
            print(lines[-1], flush=True)
            del s
            torch.cuda.empty_cache()
        # against the float64 token-by-token recurrence (a Python loop: a short case)
        from kdagen.reference import kda_reference

        s = make_inputs(T=8192, H=4, seed=6)
        kw, _ = s
        out = scanned(s, 8, -1e-3)
        ro, rs, _ = kda_reference(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], A_log=kw["A_log"],
                                  dt_bias=kw["dt_bias"], lower_bound=-1e-3, initial_state=kw["initial_state"],
                                  output_final_state=True)
        lines.append(f"- B1 T8192 H4 lower_bound -1e-3, S=8, against float64: o {rel_rmse(out[0], ro):.2e}, "
                     f"final state {rel_rmse(out[1], rs):.2e}")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


def _roles(km: dict) -> str:
    return " ".join(f"{k}={v:.3f}" for k, v in sorted(km.items()))


if __name__ == "__main__":
    sys.exit(main())
