"""One bf16 D=128 call shape through named variants, for ncu (scripts/gpu_check.sh profile).

    python scripts/profile_case.py --T 16384 --H 24 --calls 3 VARIANT [VARIANT ...]

Each variant is called --calls times on the same inputs; profile the last call's kernels
with `ncu --launch-skip` (every sm80 call launches kda_prep then kda_recur)."""

from __future__ import annotations

import argparse
import sys

import torch

from kdagen import kda_prefill
from kdagen.cases import bench_case


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--H", type=int, default=24)
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args()
    kw = bench_case(a.T, a.H, D=128)
    for name in a.variants:
        for _ in range(a.calls):
            kda_prefill(**kw, variant=name)
        torch.cuda.synchronize()
        print(f"ran {name} x{a.calls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
