"""A small ragged varlen case (an empty and a length-1 sequence among them) through one variant (and,
for sm80 fp32-state variants, the scan's twin launch of it; for sm80 and sm90 variants with a state, a
state pool call whose kernels read and write the pool's slots, padding among them), for compute-sanitizer
(scripts/gpu_check.sh sanitize runs every tool on every variant this picks, each in its own
process).

    python3 scripts/sanitize_case.py --list [--targets sm80,sm90,triton] [--match '*k128*']   # one variant per kernel shape
    python3 scripts/sanitize_case.py --variant NAME                       # run one
    python3 scripts/sanitize_case.py --variant NAME --fatbin PATH         # an A/B build of it
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import sys
from pathlib import Path

import torch

from kdagen import kda_prefill
from kdagen.cases import make_case
from kdagen.runtime import registry

LENS = [0, 1, 17, 70, 0, 33]


def picked(targets: set[str], match: str = "*") -> list:
    """One variant per kernel shape of the CUDA targets (chunk, head dims, V-split, state form, input
    dtype, record: the gate form changes only the activation arithmetic) and one per Triton chunk size,
    among those whose name matches the glob `match` (matched first: `*_gu_*` picks the unbounded gate's)."""
    seen, out = set(), []
    for v in registry().variants():
        if v.target not in targets or not fnmatch.fnmatchcase(v.name, match):
            continue
        key = ((v.target, v.chunk, v.k, v.v, v.block_v, v.state, v.dtype, v.precise) if v.target != "triton"
               else (v.target, v.chunk))
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="sm80,sm90,triton", help="comma-separated targets (with --list)")
    ap.add_argument("--list", action="store_true", help="print the variants to check, one per line")
    ap.add_argument("--match", default="*", help="glob on the variant name (with --list)")
    ap.add_argument("--variant", help="run this variant")
    ap.add_argument("--fatbin", help="with --variant: load this build of it (scripts/fatbin_ab.py --build)")
    a = ap.parse_args()
    if a.list:
        for v in picked(set(a.targets.split(",")), a.match):
            print(v.name)
        return 0
    if not a.variant or a.variant not in registry().entries:
        print(f"--variant: expected a registered variant name, found {a.variant!r}", file=sys.stderr)
        return 2
    v = registry().entries[a.variant].variant
    kw = make_case(v, "cuda", lens=LENS, H=2, HV=4, chunk_states=v.state != "none", seed=3)
    with contextlib.ExitStack() as stack:
        if a.fatbin:  # this build serves the call instead of the registry's
            from kdagen.targets import TARGETS
            from kdagen_dev.launch import launcher_swapped

            dev = torch.device("cuda", torch.cuda.current_device())
            stack.enter_context(launcher_swapped(v.name, f"{dev.type}:{dev.index}",
                                                 TARGETS[v.target].load_launcher()(v, Path(a.fatbin))))
        o = kda_prefill(**kw, variant=v.name)[0]
        strided = ""
        if v.state != "none":  # chunk states kept every 3rd chunk (prefix caching's store)
            res = kda_prefill(**dict(kw, return_chunk_states=3), variant=v.name)
            strided = f", strided chunk states finite {bool(torch.isfinite(res[2]).all())}"
        twin = ""
        if v.target == "sm80" and v.k == v.v and v.state == "fp32":
            # the scan's twin launch (state heads HV.. rerun with U = 0) on the same case
            from kdagen.runtime import kda_prefill_twins

            tw = {n: x for n, x in kw.items() if n not in ("initial_state", "output_final_state", "state_dtype")}
            h2 = torch.cat([kw["initial_state"], torch.eye(v.k, device="cuda").expand_as(kw["initial_state"])], 1)
            res = kda_prefill_twins(**tw, initial_state=h2.contiguous(), variant=v.name)
            if res is None:
                print(f"{v.name}: the twin launch was declined", file=sys.stderr)
                return 1
            twin = f", twin o finite {bool(torch.isfinite(res[0]).all())}"
        pooled = ""
        if v.target in ("sm80", "sm90") and v.state != "none":
            # the kernels take the slots themselves (KDAGEN_POOL_SLOTS's default); slots out of order, one -1
            # (padding: neither read nor written) and a pool row nobody names
            import kdagen.runtime as rt

            pk = {n: x for n, x in kw.items() if n not in ("initial_state", "output_final_state", "return_chunk_states")}
            N = len(LENS)
            st = kw["initial_state"]
            pool = torch.zeros(N + 2, *st.shape[1:], dtype=st.dtype, device="cuda")
            idx = torch.tensor([3, -1, 0, 6, 2, 5], dtype=torch.int32, device="cuda")
            pool[idx[idx >= 0].long()] = st[idx >= 0]
            took, real = [], rt.Plan.pool_call
            rt.Plan.pool_call = lambda self, *a: took.append(1) or real(self, *a)
            op = kda_prefill(**pk, state_pool=pool, state_indices=idx, variant=v.name)[0]
            rt.Plan.pool_call = real
            if not took:
                print(f"{v.name}: the pool call gathered (its kernels did not take the slots)", file=sys.stderr)
                return 1
            pooled = f", pool o finite {bool(torch.isfinite(op).all())} states finite {bool(torch.isfinite(pool).all())}"
        torch.cuda.synchronize()
    print(f"ran {v.name}: o finite {bool(torch.isfinite(o).all())}{strided}{twin}{pooled}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
