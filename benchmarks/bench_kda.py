"""Benchmark (not a test): kdagen's targets next to fla's chunk_kda on the same inputs.

    PYTHONPATH=$PWD python benchmarks/bench_kda.py [--cases all|issue4|issue16] [--targets sm80,triton] [--out F]

A --targets entry is a target (the runtime's selection among its variants) or a variant's name.

Cases are DESIGN.md section 5's rows (bf16, D=128, lower_bound=-5, fp32 state, q/k L2 norm
and gate in kernel). For each target the runtime's own selection (restricted to that target)
picks the variant. Times: CUDA events around one call, after warm-up, median of many runs,
inputs rotated among several sets so the L2 cache does not flatter small cases.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import kdagen
from kdagen.cases import bench_case
from kdagen.inputs import check_call
from kdagen.reference import rel_rmse
from kdagen.runtime import registry
from kdagen.select import select

CASES = {
    "B1 T8192 H96": dict(T=8192, H=96),
    "B1 T8192 H64": dict(T=8192, H=64),
    "varlen6 H96": dict(lens=[1300, 547, 2048, 963, 271, 3063], H=96),
    "varlen 8x1024 H64": dict(lens=[1024] * 8, H=64),
    "B1 T16384 H48": dict(T=16384, H=48),
    "B1 T32768 H32": dict(T=32768, H=32),
    "B1 T65536 H24": dict(T=65536, H=24),
    "B1 T4096 H16": dict(T=4096, H=16),
    "B1 T2048 H8": dict(T=2048, H=8),
    "B4 T4096 H32": dict(T=4096, H=32, B=4),
}
ISSUE4 = ["B1 T8192 H96", "B1 T65536 H24"]
ISSUE16 = ["B1 T8192 H96", "B1 T8192 H64", "varlen6 H96", "varlen 8x1024 H64", "B1 T16384 H48", "B4 T4096 H32"]
FLASHKDA_MS = {"B1 T8192 H96": 1.49, "B1 T8192 H64": 1.26, "varlen6 H96": 1.49, "varlen 8x1024 H64": 0.85,
               "B1 T16384 H48": 2.22, "B1 T32768 H32": 3.99, "B1 T65536 H24": 7.31, "B1 T4096 H16": 0.50,
               "B1 T2048 H8": 0.31}


def make_inputs(T=None, H=8, lens=None, D=128, seed=0, dev="cuda", B=1):
    """bench_case's tensors and the offsets apart (the rows below pass them explicitly)."""
    kw = bench_case(T, H, lens=lens, D=D, seed=seed, device=dev, B=B)
    return kw, kw.get("cu_seqlens")


def median_ms(fn, sets, warmup=5, iters=30) -> float:
    for i in range(warmup):
        fn(sets[i % len(sets)])
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(sets[i % len(sets)])
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def run_kdagen(variant, kw, cu):
    return kdagen.kda_prefill(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], A_log=kw["A_log"],
                              dt_bias=kw["dt_bias"], lower_bound=-5.0, initial_state=kw["initial_state"],
                              output_final_state=True, cu_seqlens=cu, variant=variant)


def run_fla(kw, cu):
    from fla.ops.kda import chunk_kda

    return chunk_kda(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], initial_state=kw["initial_state"],
                     output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=kw["A_log"],
                     dt_bias=kw["dt_bias"].reshape(-1), state_v_first=True,
                     cu_seqlens=cu.long() if cu is not None else None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="all", help="all | issue4 | issue16 | comma-separated case names")
    ap.add_argument("--targets", default="sm80,triton")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = ap.parse_args()
    lists = {"all": list(CASES), "issue4": ISSUE4, "issue16": ISSUE16}
    names = lists.get(args.cases) or args.cases.split(",")
    targets = [t for t in args.targets.split(",") if t]
    try:
        import fla.ops.kda  # noqa: F401
        have_fla = True
    except Exception as e:  # report, still time kdagen
        print(f"fla not importable ({e}); fla column empty")
        have_fla = False
    torch.backends.cuda.matmul.allow_tf32 = False
    reg = registry()
    rows = []
    header = f"{'case':<20}" + "".join(f"{t:>28}" for t in targets) + f"{'fla chunk_kda':>15}{'FlashKDA*':>11}"
    print(header)
    for name in names:
        c = CASES[name]
        sets = [make_inputs(**c, seed=s) for s in range(3)]
        kw0, cu0 = sets[0]
        info = check_call(kw0["q"], kw0["k"], kw0["v"], kw0["g"], kw0["beta"], A_log=kw0["A_log"],
                          dt_bias=kw0["dt_bias"], scale=None, lower_bound=-5.0, gate=None,
                          initial_state=kw0["initial_state"], output_final_state=True, cu_seqlens=cu0,
                          layout="BSND", state_layout="VK", state_dtype=None, chunk_size=None,
                          return_chunk_states=False)
        row = {"case": name}
        ref_o = run_fla(kw0, cu0)[0].float() if have_fla else None
        for t in targets:
            cands = [v for v in reg.variants() if t in (v.target, v.name)]
            try:
                v = select(cands, info)
            except Exception as e:
                row[t] = {"error": str(e).splitlines()[0]}
                continue
            ms = median_ms(lambda s: run_kdagen(v.name, *s), sets, iters=args.iters)
            o = run_kdagen(v.name, kw0, cu0)[0].float()
            row[t] = {"variant": v.name, "ms": ms, "rel_vs_fla": rel_rmse(o.cpu().double(), ref_o.cpu().double()) if ref_o is not None else None}
        if have_fla:
            row["fla_ms"] = median_ms(lambda s: run_fla(*s), sets, iters=args.iters)
        row["flashkda_ms_design"] = FLASHKDA_MS.get(name)
        rows.append(row)
        cells = "".join(f"{(str(round(row[t]['ms'], 3)) + ' ms') if 'ms' in row[t] else 'n/a':>28}" for t in targets)
        print(f"{name:<20}{cells}{row.get('fla_ms', float('nan')):>12.3f} ms{row['flashkda_ms_design'] or float('nan'):>8.2f} ms")
    print("* FlashKDA: DESIGN.md's H200 numbers (not measured in this run)")
    for row in rows:
        for t in targets:
            if "variant" in row.get(t, {}):
                print(f"  {row['case']}: {t} -> {row[t]['variant']} (rel RMSE of o vs fla {row[t]['rel_vs_fla']})")
            elif t in row:
                print(f"  {row['case']}: {t} -> {row[t]['error']}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
