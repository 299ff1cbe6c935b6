"""Eager kda_prefill through a signature's bound launch against the general path, and a CUDA-graph replay
of the same call, in one process (GPU): what the host path adds to the time an eager call measures.

    PYTHONPATH=$PWD python scripts/bound_vs_general.py [--variants V1,V2] [--rounds 3] [--iters 30]

For each of issue 16's cases and each variant (forced with variant=): median ms per call, with CUDA events
around each call after warm-up (the bench's method: host work inside the call counts), of (1) the plan's
bound launch, (2) the same plan with its bound launch removed (every call takes the general path: checks,
struct building, one cuda-bindings launch), (3) replays of one captured call. Rounds take the three in turn;
the table gives each one's median over rounds. Outputs are compared bit for bit between (1) and (2).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import kdagen
import kdagen.runtime as rt
from kdagen.cases import bench_case
from kdagen.timing import graph_calls, time_calls

CASES = {
    "B1 T8192 H96": dict(T=8192, H=96),
    "B1 T8192 H64": dict(T=8192, H=64),
    "varlen [1300,547,2048,963,271,3063] H96": dict(lens=[1300, 547, 2048, 963, 271, 3063], H=96),
    "varlen 8x1024 H64": dict(lens=[1024] * 8, H=64),
    "B1 T16384 H48": dict(T=16384, H=48),
    "B4 T4096 H32": dict(T=4096, H=32, B=4),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="kda_fwd_sm90_c16_k128_v128_bf16_gb_sfp32_bv64,"
                                          "kda_fwd_sm80_c16_k128_v128_bf16_gb_sfp32_bv32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    print("| case | variant | bound ms | general ms | graph ms | general - bound (us) | bound - graph (us) |")
    print("|---|---|---|---|---|---|---|")
    for name, shape in CASES.items():
        kw = bench_case(shape.get("T"), shape["H"], lens=shape.get("lens"), B=shape.get("B", 1))
        for var in a.variants.split(","):
            call = dict(kw, variant=var)
            if "cu_seqlens" in call:  # (host offsets: no device read, and the call can be captured)
                call["cu_seqlens_cpu"] = call["cu_seqlens"].cpu()
            rt._PLANS.clear()
            first = [t.clone() for t in kdagen.kda_prefill(**call)]  # general path, binds
            (plan,) = rt._PLANS.values()
            bound = plan.fast
            if bound is None:
                print(f"| {name} | {var} | (no bound launch) | | | | |")
                continue
            got = kdagen.kda_prefill(**call)
            assert all(torch.equal(x, y) for x, y in zip(first, got)), f"{var}: bound != general"
            res: dict[str, list[float]] = {"bound": [], "general": [], "graph": []}
            for _ in range(a.rounds):
                plan.fast = bound
                res["bound"].append(time_calls(lambda _s: kdagen.kda_prefill(**call), [None], warmup=5,
                                               iters=a.iters).median)
                plan.fast = None
                res["general"].append(time_calls(lambda _s: kdagen.kda_prefill(**call), [None], warmup=5,
                                                 iters=a.iters).median)
                plan.fast = bound
                res["graph"].append(graph_calls(lambda _s: kdagen.kda_prefill(**call), [None],
                                                iters=a.iters).median)
            m = {k: statistics.median(v) for k, v in res.items()}
            print(f"| {name} | {var.replace('kda_fwd_', '')} | {m['bound']:.3f} | {m['general']:.3f} | "
                  f"{m['graph']:.3f} | {1e3 * (m['general'] - m['bound']):.0f} | "
                  f"{1e3 * (m['bound'] - m['graph']):.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
