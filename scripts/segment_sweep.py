"""Time-segment settings of the sm80 launcher on one few-heads, long-sequence shape (GPU).

    python scripts/segment_sweep.py [--T 65536 --H 24 --filter c16_k128_v128_bf16_gb_sfp32_bv32]

Prints the median ms of the full call for: one piece, and each (min_segment_tokens,
max_segments) setting, so the launcher's defaults rest on a measurement; with --beside 0,1,2,none
also for each limit on the prep blocks beside a recurrence block."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_sm80 import timeit  # noqa: E402
from test_sm80 import _strides, sm80_variants  # noqa: E402

from kdagen.abi import KdaCall  # noqa: E402
from kdagen.targets.sm80 import Sm80Launcher  # noqa: E402

SETTINGS = [(None, 1), (8192, 4), (4096, 8), (4096, 12), (2048, 16), (2048, 32)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--H", type=int, default=24)
    ap.add_argument("--filter", default="c16_k128_v128_bf16_gb_sfp32_bv32")
    ap.add_argument("--beside", default="", help="comma-separated prep blocks allowed beside a recurrence "
                    "block (or 'none'), timed at the default segments")
    a = ap.parse_args()
    T, H, D = a.T, a.H, 128
    torch.manual_seed(0)
    dev = "cuda"
    q, k, v, g = (torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
    beta = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16)
    A_log = torch.rand(H, device=dev) * 2 - 1
    dt_bias = torch.randn(H * D, device=dev) * 0.5
    h0 = torch.randn(1, H, D, D, device=dev) * 0.1
    for var, art in sm80_variants():
        if a.filter not in var.name:
            continue
        o = torch.empty_like(v)
        ht = torch.empty(1, H, D, D, device=dev)
        call = KdaCall(q=q, k=k, v=v, g=g, beta=beta, o=o, q_strides=_strides(q, "BSND"),
                       k_strides=_strides(k, "BSND"), v_strides=_strides(v, "BSND"), g_strides=_strides(g, "BSND"),
                       beta_strides=_strides(beta.unsqueeze(-1), "BSND"), o_strides=_strides(o, "BSND"),
                       B=1, T=T, N=1, H=H, HV=H, K=D, V=D, cu_seqlens=None, A_log=A_log,
                       dt_bias=dt_bias.view(H, D), scale=D ** -0.5, lower_bound=-5.0, use_qk_l2norm=True,
                       allow_neg_eigval=False, initial_state=h0, final_state=ht, state_kv=False,
                       chunk_states=None, chunk_offsets=None, max_len=T)
        la = Sm80Launcher(var, art)
        ref = None
        row = [f"{var.name} T{T} H{H}"]
        for tokens, segs in SETTINGS:
            la.min_segment_tokens, la.max_segments = tokens, segs
            t = timeit(lambda: la(call), warmup=3, iters=15)
            o_now = o.float().clone()
            ref = o_now if ref is None else ref
            diff = ((o_now - ref).norm() / ref.norm()).item()
            row.append(f"seg {tokens}/{segs} [{la.last_segments}]: {t:.3f} ms (d {diff:.0e})")
        la.min_segment_tokens, la.max_segments = 4096, 8
        for kb in [x for x in a.beside.split(",") if x]:
            la.prep_blocks_beside_recur = None if kb == "none" else int(kb)
            t = timeit(lambda: la(call), warmup=3, iters=15)
            diff = ((o.float() - ref).norm() / ref.norm()).item()
            row.append(f"seg 4096/8, prep blocks beside a recurrence block {kb}: {t:.3f} ms (d {diff:.0e})")
        print("\n  ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
