"""One bf16 D=128 call shape through named variants, for ncu (scripts/gpu_check.sh profile).

    python scripts/profile_case.py --T 16384 --H 24 --calls 3 VARIANT [VARIANT ...]

Each variant is called --calls times on the same inputs; profile the last call's kernels
with `ncu --launch-skip` (every sm80 call launches kda_prep then kda_recur)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kdagen import kda_prefill  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--H", type=int, default=24)
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    T, H, D = a.T, a.H, 128
    q, k, v, gg = (r(1, T, H, D).bfloat16() for _ in range(4))
    beta = r(1, T, H).bfloat16()
    A_log, dt_bias, h0 = torch.rand(H, generator=g, device="cuda"), r(H, D) * 0.1, r(1, H, D, D) * 0.1
    for name in a.variants:
        for _ in range(a.calls):
            kda_prefill(q, k, v, gg, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, initial_state=h0,
                        output_final_state=True, variant=name)
        torch.cuda.synchronize()
        print(f"ran {name} x{a.calls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
