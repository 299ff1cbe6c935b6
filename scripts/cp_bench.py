"""Context-parallel prefill over the GPUs of one host (issue 19; GPU, not a test).

    NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD torchrun --nproc_per_node 2 scripts/cp_bench.py \
        [--T 1048576 --H 8] [--segments auto,4,8,16] [--modes rerun,correct] [--iters 5]
        [--out benchmarks/results/DATE_cp_h200.md]

A smoke run on CPU (gloo, the Triton interpreter): TRITON_INTERPRET=1 torchrun --nproc_per_node 2
scripts/cp_bench.py --device cpu --T 256 --H 1 --D 32 --segments auto,2 --iters 1

Every rank builds the same inputs (bench_kda.make_inputs: bf16, D=128, fp32 state, one sequence
of T tokens) and keeps its even slice. Rank 0 first times the single-GPU calls alone (kdagen's
one piece, and the one-GPU scan at the planner's segments); then all ranks time
kdagen.kda_prefill(..., cp_context=ctx) for each --segments value and mode ("rerun": step 3
reruns the segments; "correct": o corrected from step 1's outputs) (wall time between barriers,
median), gather o and the final state on rank 0 and compare them with the single-GPU call.
Done when (issue 19): on 2 GPUs at least 1.7x faster than one GPU, o and final state within
5e-3; on 4 GPUs at least 3x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off, before NCCL starts

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import kdagen  # noqa: E402
from bench_kda import make_inputs  # noqa: E402
from kdagen.cp import build_cp_context  # noqa: E402
from kdagen.reference import rel_rmse  # noqa: E402
from kdagen.scan.engine import scan_prefill  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_ms(fn, iters: int, group_sync: bool) -> float:
    """Median wall time of fn() between device syncs (and barriers when group_sync)."""
    times = []
    for _ in range(iters):
        if group_sync:
            dist.barrier()
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        if group_sync:
            dist.barrier()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=1 << 20)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--segments", default="auto,4,8,16", help="per-rank scan segments to time ('auto': planner)")
    ap.add_argument("--modes", default="rerun,correct")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--device", default="cuda", help="cuda (NCCL) or cpu (gloo: a smoke run)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    if a.device == "cuda":
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    kw, _ = make_inputs(T=a.T, H=a.H, D=a.D, seed=0, dev=a.device)
    call = dict(A_log=kw["A_log"], dt_bias=kw["dt_bias"], lower_bound=-5.0, output_final_state=True)
    lines = []

    def say(s: str) -> None:
        if rank == 0:
            print(s, flush=True)
            lines.append(s)

    dev_name = torch.cuda.get_device_name(0) if a.device == "cuda" else "CPU (smoke run)"
    say(f"# Context-parallel prefill: B1 T{a.T} H{a.H} D{a.D} bf16 on {world} x {dev_name}")
    say("")
    ref = None
    single = {}
    if rank == 0:
        t = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"])
        ref = kdagen.kda_prefill(*t, **call, initial_state=kw["initial_state"])
        single["one GPU, one piece"] = wall_ms(lambda: kdagen.kda_prefill(*t, **call, initial_state=kw["initial_state"]),
                                               a.iters, False)
        single["one GPU, scan (planner)"] = wall_ms(
            lambda: scan_prefill(*t, **call, initial_state=kw["initial_state"]), a.iters, False)
        single["one GPU, scan S=16"] = wall_ms(
            lambda: scan_prefill(*t, **call, initial_state=kw["initial_state"], segments=16), a.iters, False)
        for k, v in single.items():
            say(f"- {k}: {v:.2f} ms")
    dist.barrier()
    ctx = build_cp_context([0, a.T])
    lo, hi = ctx.rank_bounds[rank], ctx.rank_bounds[rank + 1]
    loc = {n: kw[n][:, lo:hi].contiguous() for n in ("q", "k", "v", "g", "beta")}
    h0 = ctx.local_initial_state(kw["initial_state"])
    del kw
    base = min(single.values()) if single else None
    for seg, mode in [(s, m) for m in a.modes.split(",") if m for s in a.segments.split(",") if s]:
        segs = None if seg == "auto" else int(seg)

        def run():
            from kdagen.cp import kda_prefill_cp

            return kda_prefill_cp(**loc, **call, initial_state=h0, cp_context=ctx, segments=segs, mode=mode)

        out = run()
        ms = wall_ms(run, a.iters, True)
        # o and final state back on rank 0 (even slices: all_gather of equal shapes)
        parts = [torch.empty_like(out[0]) for _ in range(world)]
        dist.all_gather(parts, out[0].contiguous())
        fs = out[1] if out[1].shape[0] else out[1].new_zeros(1, *out[1].shape[1:])  # only the last rank ends it
        fparts = [torch.empty_like(fs) for _ in range(world)]
        dist.all_gather(fparts, fs.contiguous())
        if rank == 0:
            o = torch.cat(parts, dim=1)
            final = fparts[world - 1]
            speed = f", {base / ms:.2f}x the best single-GPU call" if base else ""
            say(f"- {world} GPUs, {mode}, segments per rank {seg}: {ms:.2f} ms{speed}; o {rel_rmse(o, ref[0]):.2e}, "
                f"final state {rel_rmse(final, ref[1]):.2e} against the one-GPU one-piece call")
        del out, parts, fparts
    if rank == 0 and a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
