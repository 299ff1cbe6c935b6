"""Benchmark (not a test): sm80 variants next to fla's chunk_kda, same inputs, same run.

    PYTHONPATH=$PWD python benchmarks/bench_sm80.py [--all]

Cases (bf16, D=128, lower_bound=-5, fp32 state, q/k L2 norm in kernel): B1 T8192 H96 and
B1 T65536 H24 (issue 4), plus the other rows of DESIGN.md section 5 with --all.
Prints the median ms (CUDA events) per variant and fla, and the rel RMSE of o vs fla.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_sm80 import _strides, sm80_variants  # noqa: E402

from kdagen.abi import KdaCall  # noqa: E402
from kdagen.targets.sm80 import Sm80Launcher  # noqa: E402

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


def make_inputs(T: int, H: int, N: int = 1, D: int = 128, dev: str = "cuda") -> dict:
    """The benchmark inputs (seed 0): bf16 q, k, v, g [1, T, H, D], beta [1, T, H], A_log, dt_bias,
    and h0 [N, H, D, D]; the scripts that time sm80 builds use the same ones."""
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
    beta = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16)
    A_log = torch.rand(H, device=dev) * 2 - 1
    dt_bias = torch.randn(H * D, device=dev) * 0.5
    h0 = torch.randn(N, H, D, D, device=dev) * 0.1  # [N, HV, V, K]
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, h0=h0)


def make_call(inp: dict, o: torch.Tensor, ht: torch.Tensor, cu: torch.Tensor | None = None,
              max_len: int | None = None) -> KdaCall:
    """An sm80 launcher call on make_inputs' tensors (BSND, lower_bound -5, q/k L2 norm in kernel)."""
    q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
    _, T, H, D = q.shape
    return KdaCall(q=q, k=k, v=v, g=g, beta=beta, o=o, q_strides=_strides(q, "BSND"),
                   k_strides=_strides(k, "BSND"), v_strides=_strides(v, "BSND"), g_strides=_strides(g, "BSND"),
                   beta_strides=_strides(beta.unsqueeze(-1), "BSND"), o_strides=_strides(o, "BSND"),
                   B=1, T=T, N=inp["h0"].shape[0], H=H, HV=H, K=D, V=D, cu_seqlens=cu, A_log=inp["A_log"],
                   dt_bias=inp["dt_bias"].view(H, D), scale=D ** -0.5, lower_bound=-5.0, use_qk_l2norm=True,
                   allow_neg_eigval=False, initial_state=inp["h0"], final_state=ht, state_kv=False,
                   chunk_states=None, chunk_offsets=None, max_len=T if max_len is None else max_len)


def timeit(fn, warmup=3, iters=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--filter", default="")
    ap.add_argument("--cases", default="", help="comma-separated substrings of case names")
    args = ap.parse_args()
    cases = dict(CASES, **(MORE if args.all else {}))
    if args.cases:
        cases = {n: c for n, c in cases.items() if any(x in n for x in args.cases.split(","))}
    variants = [(v, a) for v, a in sm80_variants()
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
        N = len(lens) if lens else 1
        inp = make_inputs(T, H, N, D, dev)
        q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
        A_log, dt_bias, h0 = inp["A_log"], inp["dt_bias"], inp["h0"]
        cu = None
        if lens:
            cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
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
            o = torch.empty_like(v)
            ht = torch.empty(N, H, D, D, device=dev)
            call = make_call(inp, o, ht, cu, max(lens) if lens else T)
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
