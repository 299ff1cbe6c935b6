"""Benchmark (not a test): sm80 variants next to fla's chunk_kda, same inputs, same run.

    PYTHONPATH=$PWD python benchmarks/bench_sm80.py [--all]

Cases (bf16, D=128, lower_bound=-5, fp32 state, q/k L2 norm in kernel): B1 T8192 H96 and
B1 T65536 H24 (issue 4), plus the other rows of DESIGN.md section 5 with --all.
Prints the median ms (CUDA events) per variant and fla, and the rel RMSE of o vs fla.
"""

from __future__ import annotations

import argparse

import torch

from kdagen.cases import bench_case
from kdagen.targets.sm80 import Sm80Launcher
from kdagen_dev.launch import built_variants, capture_call, timeit

CASES = {
    "B1 T8192 H96": dict(lens=None, T=8192, H=96),
    "B1 T65536 H24": dict(lens=None, T=65536, H=24),
}
MORE = {
    "B1 T8192 H64": dict(lens=None, T=8192, H=64),
    "varlen6 H96": dict(lens=[1300, 547, 2048, 963, 271, 3063], H=96),
    "varlen 8x1024 H64": dict(lens=[1024] * 8, H=64),
    "B1 T16384 H48": dict(lens=None, T=16384, H=48),
    "B1 T32768 H32": dict(lens=None, T=32768, H=32),
    "B1 T4096 H16": dict(lens=None, T=4096, H=16),
    "B1 T2048 H8": dict(lens=None, T=2048, H=8),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--filter", default="")
    ap.add_argument("--cases", default="", help="comma-separated substrings of case names")
    args = ap.parse_args()
    cases = dict(CASES, **(MORE if args.all else {}))
    if args.cases:
        cases = {n: c for n, c in cases.items() if any(x in n for x in args.cases.split(","))}
    variants = [(v, a) for v, a in built_variants("sm80")
                if v.k == 128 and v.dtype == "bf16" and v.gate == "bounded" and v.state == "fp32"
                and args.filter in v.name]
    try:
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001
        print(f"fla not importable ({e}); timing sm80 only")
        chunk_kda = None
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    dev = "cuda"
    D = 128
    for cname, c in cases.items():
        lens = c["lens"]
        T = sum(lens) if lens else c["T"]
        H = c["H"]
        inp = bench_case(T, H, lens=lens, D=D, device=dev)
        q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
        A_log, dt_bias, h0 = inp["A_log"], inp["dt_bias"].reshape(-1), inp["initial_state"]
        cu = inp.get("cu_seqlens")
        row = [f"{cname:22s}"]
        o_fla = None
        if chunk_kda is not None:
            def run_fla():
                return chunk_kda(q, k, v, g, beta, scale=D ** -0.5, initial_state=h0, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                 use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                                 A_log=A_log, dt_bias=dt_bias, state_v_first=True,
                                 cu_seqlens=cu.long() if cu is not None else None)
            with torch.inference_mode():
                o_fla = run_fla()[0]
                t = timeit(run_fla)
            row.append(f"fla {t:7.3f} ms")
        for var, art in variants:
            call = capture_call(inp, var.name)
            o = call.o
            launcher = Sm80Launcher(var, art)
            t = timeit(lambda: launcher(call))
            err = ""
            if o_fla is not None:
                err = f" (vs fla {((o.float() - o_fla.float()).norm() / o_fla.float().norm()).item():.1e})"
            prep, recur = launcher.with_settings(parts=("prep",)), launcher.with_settings(parts=("recur",))
            t1 = timeit(lambda: prep(call))
            t2 = timeit(lambda: recur(call))
            row.append(f"c{var.chunk}/bv{var.block_v} {t:7.3f} ms [prep {t1:.3f} + recur {t2:.3f}]{err}")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
