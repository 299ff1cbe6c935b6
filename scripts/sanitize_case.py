"""A small ragged varlen case through one CUDA variant per kernel shape of the built specs (and one Triton
variant), for `compute-sanitizer --tool memcheck` (scripts/gpu_check.sh sanitize)."""

from __future__ import annotations

import argparse
import sys

import torch

from kdagen import kda_prefill
from kdagen.cases import make_case
from kdagen.runtime import registry


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="sm80,sm90,triton", help="comma-separated targets to run")
    targets = set(ap.parse_args().targets.split(","))
    reg = registry()
    # One CUDA variant per kernel shape (chunk, head dims, V-split, state form, input dtype):
    # the gate form changes only the activation arithmetic.
    seen, picked = set(), []
    for v in reg.variants():
        key = (v.target, v.chunk, v.k, v.block_v, v.state, v.dtype)
        if v.target in ("sm80", "sm90") and v.target in targets and key not in seen:
            seen.add(key)
            picked.append(v)
    if "triton" in targets:
        picked += [v for v in reg.variants() if v.target == "triton" and v.k == 64][:1]
    lens = [0, 1, 17, 70, 0, 33]
    for v in picked:
        kw = make_case(v, "cuda", lens=lens, H=2, HV=4, chunk_states=v.state != "none", seed=3)
        kda_prefill(**kw, variant=v.name)
        torch.cuda.synchronize()
        print(f"ran {v.name}")
    print(f"sanitize case: {len(picked)} variant(s) ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
