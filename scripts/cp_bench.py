"""Context-parallel prefill over the GPUs of one host (issue 19; GPU, not a test).

    NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD torchrun --nproc_per_node 2 scripts/cp_bench.py \
        [--T 1048576 --H 8] [--segments auto,4,8,16] [--modes rerun,correct] [--iters 5]
        [--lower-bound=-1e-3] [--layout zigzag] [--checkpoint-every 4096] [--out benchmarks/results/DATE_cp_h200.md]

Two runs for a host with fewer GPUs than ranks (neither is a measured speedup; both say so):
- `--backend gloo` with more ranks than GPUs: the ranks share GPUs and exchange over gloo, which
  checks the real collective path and the results at full size;
- `--emulate W` (no torchrun): one process runs the W ranks' calls one after another on one GPU,
  the all_gather replaced by every rank's maps, recorded by a first untimed run of each (a rank's
  maps depend on its own tokens only; a zigzag back slot needs later ranks'). Results are exact; each rank's
  times alone before and after its exchange give the W-GPU time as the slowest before plus the
  slowest after (a projection: the all_gather of 2 HV K K fp32 per rank is not in it). Two ways
  of cutting a rank's time at its exchange, both printed: CUDA events on the stream (the
  projection: NCCL's all_gather does not block the host, so the host queues the work after the
  exchange while step 1 still runs) and a host sync (an upper bound: the host's time after the
  exchange counted in full, as if every rank's host waited at the all_gather).

A smoke run on CPU (gloo, the Triton interpreter): TRITON_INTERPRET=1 torchrun --nproc_per_node 2
scripts/cp_bench.py --device cpu --T 256 --H 1 --D 32 --segments auto,2 --iters 1

Every rank builds the same inputs (kdagen.cases.bench_inputs: bf16, fp32 state, one sequence of T
tokens) and keeps its even slice. Rank 0 first times the single-GPU calls alone (kdagen.kda_prefill
as dispatched, which runs a call this long as the planner's scan; the one piece, KDAGEN_SCAN=0; the
one-GPU scan at the planner's segments and at 16, and in each other --modes mode at
--baseline-segments: the best of them is the baseline); then all ranks time
kdagen.kda_prefill(..., cp_context=ctx) for each --segments value and mode ("rerun": step 3
reruns the segments; "correct": o corrected from step 1's outputs) (wall time between barriers,
median), gather o and the final state on rank 0 and compare them with the one-GPU kda_prefill call.
Done when (issue 19): on 2 GPUs at least 1.7x faster than one GPU, o and final state within
5e-3; on 4 GPUs at least 3x.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional
from unittest import mock

os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off, before NCCL starts

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import kdagen  # noqa: E402
import kdagen.cp as cp  # noqa: E402
import kdagen.scan.correct as correct  # noqa: E402
from kdagen.cases import bench_inputs as make_inputs  # noqa: E402
from kdagen.cp import build_cp_context, from_ranks, kda_prefill_cp  # noqa: E402
from kdagen.reference import rel_rmse  # noqa: E402
from kdagen.scan.engine import scan_prefill  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_ms(fn: Callable[[], object], iters: int, group_sync: bool) -> float:
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


@contextlib.contextmanager
def emulated_exchange(world: int, rank: int, maps: dict, marks: list, host_sync: bool) -> Iterator[None]:
    """kdagen.cp's all_gather for rank `rank` of an emulated group: the maps recorded from every
    rank's earlier run (a rank's maps depend on its own inputs only; emulated() records them all
    before it times anything, since a zigzag back slot chains later ranks' maps too), its own
    (recorded again). Appends the exchange's moment to `marks`: a CUDA event recorded on the
    stream, or with host_sync the host's clock after a device sync."""
    real = cp._all_gather

    def gather(x: torch.Tensor, ctx) -> list[torch.Tensor]:
        maps[rank] = x.clone()
        if host_sync:
            _sync()
            marks.append(time.perf_counter())
        else:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append(ev)
        return [maps.get(r, torch.zeros_like(x)) for r in range(world)]

    cp._all_gather = gather
    try:
        yield
    finally:
        cp._all_gather = real


def phases_ms(fn: Callable[[], object], marks: list, iters: int, host_sync: bool) -> tuple[float, float]:
    """Median times of fn() before and after its exchange (the moment it appends to marks), from
    an idle device: host clocks around device syncs, or CUDA events (the first recorded on the
    idle stream when fn is entered, so the host's time before the first kernel counts)."""
    pre, post = [], []
    for _ in range(iters):
        _sync()
        if host_sync:
            t0 = time.perf_counter()
            fn()
            _sync()
            t1 = time.perf_counter()
            pre.append(1000 * (marks[-1] - t0))
            post.append(1000 * (t1 - marks[-1]))
        else:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            pre.append(e0.elapsed_time(marks[-1]))
            post.append(marks[-1].elapsed_time(e1))
    return statistics.median(pre), statistics.median(post)


def host_syncs(fn: Callable[[], object]) -> int:
    """How many times fn() made the host wait for the device through torch (sync debug mode)."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # the mode's own "prototype feature" notice (once a process) is not a sync
    return sum("called a synchronizing cuda operation" in str(w.message).lower() for w in seen)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=1 << 20)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--segments", default="auto,4,8,16", help="per-rank scan segments to time ('auto': planner)")
    ap.add_argument("--modes", default="rerun,correct")
    ap.add_argument("--baseline-segments", default="8,16,32",
                    help="segment counts of the one-GPU scan baselines in each --modes mode other than rerun")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--lower-bound", type=float, default=-5.0,
                    help="the gate's lower bound; near 0 (-1e-3) the state carries across ranks (a hard check)")
    ap.add_argument("--device", default="cuda", help="cuda or cpu (gloo, the Triton interpreter: a smoke run)")
    ap.add_argument("--backend", default=None, help="nccl (default on cuda) or gloo (default on cpu; on cuda "
                    "it lets ranks share a GPU)")
    ap.add_argument("--emulate", type=int, default=0, metavar="W",
                    help="no torch.distributed: run W ranks one after another in this process (a projection)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="with --emulate: each rank's call once under torch.profiler, its kernel table to DIR")
    ap.add_argument("--correct-config", default=None, metavar="BT,GT,BV,WARPS,STAGES",
                    help="the correction kernel's tile and launch (kdagen.scan.correct.CONFIG) for this run")
    ap.add_argument("--layout", default="contiguous", choices=("contiguous", "zigzag"),
                    help="how the tokens are split over the ranks (kdagen.cp.build_cp_context)")
    ap.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                    help="also time each run with prefix-cache checkpoints every N tokens (replicated buffers): "
                         "peak memory with and without, o against the run without, rows against one GPU's")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.checkpoint_every and a.emulate:
        print("--checkpoint-every: not with --emulate (the emulated exchange carries the maps only)", file=sys.stderr)
        return 2
    if a.correct_config:
        correct.CONFIG = tuple(int(x) for x in a.correct_config.split(","))
    if a.emulate:
        rank, world, local = 0, a.emulate, 0
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local = int(os.environ.get("LOCAL_RANK", rank))
    backend = a.backend or ("nccl" if a.device == "cuda" else "gloo")
    gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    shared = a.device == "cuda" and not a.emulate and world > gpus
    if a.device == "cuda":
        if shared and backend == "nccl":
            print(f"--backend nccl: {world} ranks on {gpus} GPU(s); NCCL needs a GPU per rank (use --backend gloo "
                  "to share, or --emulate)", file=sys.stderr)
            return 2
        local %= gpus
        torch.cuda.set_device(local)
    if not a.emulate:
        opts = dict(device_id=torch.device("cuda", local)) if backend == "nccl" else {}
        dist.init_process_group(backend, **opts)
    kw, _ = make_inputs(T=a.T, H=a.H, D=a.D, seed=0, dev=a.device)
    call = dict(A_log=kw["A_log"], dt_bias=kw["dt_bias"], lower_bound=a.lower_bound, output_final_state=True)
    lines = []

    def say(s: str) -> None:
        if rank == 0:
            print(s, flush=True)
            lines.append(s)

    dev_name = torch.cuda.get_device_name(local) if a.device == "cuda" else "CPU (smoke run)"
    how = (f"{world} ranks emulated one after another on 1 x {dev_name} (a projection, see below)" if a.emulate
           else f"{world} ranks on {max(gpus, 1) if shared else world} x {dev_name} over {backend}"
           + (" (ranks share GPUs: times are not a speedup)" if shared else ""))
    say(f"# Context-parallel prefill: B1 T{a.T} H{a.H} D{a.D} bf16, lower_bound {a.lower_bound:g}, {a.layout}; {how}; "
        f"correction tile {correct.CONFIG}")
    say("")
    ref = None
    single = {}
    if rank == 0:
        t = tuple(kw[n] for n in NAMES)

        def dispatched():
            return kdagen.kda_prefill(*t, **call, initial_state=kw["initial_state"])

        ref = dispatched()
        # kda_prefill as dispatched runs a call this long as the planner's scan; the one piece needs the route off
        single["one GPU, kda_prefill (dispatch)"] = wall_ms(dispatched, a.iters, False)
        with mock.patch.dict(os.environ, {"KDAGEN_SCAN": "0"}):  # read on every call: one piece in the block
            single["one GPU, one piece (KDAGEN_SCAN=0)"] = wall_ms(dispatched, a.iters, False)
        single["one GPU, scan rerun (planner)"] = wall_ms(
            lambda: scan_prefill(*t, **call, initial_state=kw["initial_state"], mode="rerun"), a.iters, False)
        single["one GPU, scan rerun S=16"] = wall_ms(
            lambda: scan_prefill(*t, **call, initial_state=kw["initial_state"], segments=16, mode="rerun"), a.iters,
            False)
        # the one-GPU scan in the modes timed below: the same rounding as the ranks' runs
        for mode in (m for m in a.modes.split(",") if m and m != "rerun"):
            for segs in (int(x) for x in a.baseline_segments.split(",")):
                single[f"one GPU, scan {mode} S={segs}"] = wall_ms(
                    lambda segs=segs, mode=mode: scan_prefill(*t, **call, initial_state=kw["initial_state"],
                                                              segments=segs, mode=mode),
                    a.iters, False)
        for k, v in single.items():
            say(f"- {k}: {v:.2f} ms")
        if a.checkpoint_every:  # the one-GPU call's checkpoints, what every rank's buffer must hold
            ref = (*ref, kdagen.kda_prefill(*t, **call, initial_state=kw["initial_state"],
                                            checkpoint_every=a.checkpoint_every)[-1])
    base = min(single.values()) if single else None
    runs = [(s, m) for m in a.modes.split(",") if m for s in a.segments.split(",") if s]
    if a.emulate:
        emulated(kw, call, runs, world, a, base, ref, say)
    else:
        ranks(kw, call, runs, rank, world, a, base, ref, shared, say)
    if rank == 0 and a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")
    if not a.emulate:
        dist.destroy_process_group()
    return 0


def profile(fn: Callable[[], object], path: Path) -> None:
    """fn() once under torch.profiler (the CUDA kernels by total time, the wall time, a chrome
    trace beside) and once under cProfile (the host's Python by cumulative time)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    _sync()
    t0 = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync()
    wall = 1000 * (time.perf_counter() - t0)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    prof.export_chrome_trace(str(path.with_suffix(".json")))
    host = cProfile.Profile()
    _sync()
    host.enable()
    fn()
    _sync()
    host.disable()
    out = io.StringIO()
    pstats.Stats(host, stream=out).sort_stats("cumulative").print_stats(40)
    pstats.Stats(host, stream=out).sort_stats("tottime").print_stats(25)
    path.write_text(f"wall (profiled) {wall:.2f} ms\n{table}\n\n{out.getvalue()}\n")


def emulated(kw: dict, call: dict, runs: list, world: int, a, base: float, ref, say) -> None:
    """Every (segments, mode) run with the W ranks emulated one after another (--emulate)."""
    ctxs = [build_cp_context([0, a.T], rank=r, world=world, layout=a.layout) for r in range(world)]
    locs = [{n: c.take(kw[n], 1).contiguous() for n in NAMES} for c in ctxs]
    h0s = [c.local_initial_state(kw["initial_state"]) for c in ctxs]
    ender = next(r for r, c in enumerate(ctxs) if 0 in c.ends)  # the rank holding the sequence's end
    kw.clear()
    half = wall_ms(lambda: kdagen.kda_prefill(**locs[0], **call, initial_state=h0s[0]), a.iters, False)
    say(f"- one GPU, kda_prefill (dispatch) of rank 0's {ctxs[0].local_tokens} tokens alone: {half:.2f} ms")
    cuts = (False, True) if a.device == "cuda" else (True,)  # host_sync per timing; events need CUDA
    for seg, mode in runs:
        segs = None if seg == "auto" else int(seg)
        maps: dict = {}
        outs, counts, syncs = [], [], []
        phases = {True: ([], []), False: ([], [])}  # host_sync -> (before, after) per rank
        for r, c in enumerate(ctxs):  # every rank's maps first: the timed runs read them all
            with emulated_exchange(world, r, maps, [], True):
                kda_prefill_cp(**locs[r], **call, initial_state=h0s[r], cp_context=c, segments=segs, mode=mode)
        for r, c in enumerate(ctxs):
            def run(r=r, c=c):
                return kda_prefill_cp(**locs[r], **call, initial_state=h0s[r], cp_context=c, segments=segs,
                                      mode=mode)

            for host_sync in cuts:
                marks: list = []
                with emulated_exchange(world, r, maps, marks, host_sync):
                    if host_sync is cuts[0]:
                        outs.append(run())
                    p0, p1 = phases_ms(run, marks, a.iters, host_sync)
                    phases[host_sync][0].append(p0)
                    phases[host_sync][1].append(p1)
                    if not host_sync:
                        syncs.append(host_syncs(run))
                    if a.profile and host_sync is cuts[0]:
                        profile(run, Path(a.profile) / f"cp_w{world}_r{r}_{mode}_seg{seg}.txt")
            counts.append(cp.last_counts)
            outs[-1] = (outs[-1][0], outs[-1][1] if r == ender else None)  # keep only what is compared
        o = from_ranks([x[0] for x in outs], ctxs)
        cut = "/".join("+".join(str(x) for x in c) for c in counts)
        # The ranks wait for each other at the exchange: its slowest rank's time before it, then
        # the slowest after it.
        for host_sync in cuts:
            pre, post = phases[host_sync]
            ms = max(pre) + max(post)
            each = ", ".join(f"{x:.2f}+{y:.2f}" for x, y in zip(pre, post))
            how = ("host clock, device synced at the exchange (upper bound)" if host_sync
                   else f"CUDA events, host syncs in a rank's call {'/'.join(map(str, syncs))}")
            say(f"- {world} ranks (emulated, {how}), {mode}, segments per rank {seg} ({cut}): {ms:.2f} ms (ranks "
                f"before+after the exchange {each}), {base / ms:.2f}x the best single-GPU call; o "
                f"{rel_rmse(o, ref[0]):.2e}, final state {rel_rmse(outs[ender][1], ref[1]):.2e} against the one-GPU "
                "kda_prefill call")
        del outs, o


def ranks(kw: dict, call: dict, runs: list, rank: int, world: int, a, base: Optional[float], ref, shared: bool,
          say) -> None:
    """Every (segments, mode) run on this rank of the torch.distributed group; rank 0 reports."""
    dist.barrier()
    ctx = build_cp_context([0, a.T], layout=a.layout)
    loc = {n: ctx.take(kw[n], 1).contiguous() for n in NAMES}
    every = [build_cp_context([0, a.T], rank=r, world=world, layout=a.layout) for r in range(world)]
    ender = next(r for r, c in enumerate(every) if 0 in c.ends)  # the rank holding the sequence's end
    h0 = ctx.local_initial_state(kw["initial_state"])
    kw.clear()
    for seg, mode in runs:
        segs = None if seg == "auto" else int(seg)

        def run(**more):
            return kda_prefill_cp(**loc, **call, initial_state=h0, cp_context=ctx, segments=segs, mode=mode, **more)

        out = run()
        ms = wall_ms(run, a.iters, True)
        # o and final state back on rank 0 (even slices: all_gather of equal shapes)
        parts = [torch.empty_like(out[0]) for _ in range(world)]
        dist.all_gather(parts, out[0].contiguous())
        fs = out[1] if out[1].shape[0] else out[1].new_zeros(1, *out[1].shape[1:])  # only the last rank ends it
        fparts = [torch.empty_like(fs) for _ in range(world)]
        dist.all_gather(fparts, fs.contiguous())
        if rank == 0:
            o = from_ranks(parts, every)
            final = fparts[ender]
            speed = f", {base / ms:.2f}x the best single-GPU call" if base and not shared else ""
            say(f"- {world} ranks, {mode}, segments per rank {seg}: {ms:.2f} ms{speed}; o {rel_rmse(o, ref[0]):.2e}, "
                f"final state {rel_rmse(final, ref[1]):.2e} against the one-GPU kda_prefill call")
        if a.checkpoint_every:
            checkpoints(run, out, rank, a, ref, say, f"{world} ranks, {mode}, segments per rank {seg}")
        del out, parts, fparts


def checkpoints(run: Callable[..., tuple], out: tuple, rank: int, a, ref, say, what: str) -> None:
    """The same run with checkpoints every a.checkpoint_every tokens: time, peak memory against the
    run without (the largest rank's), o bit-identical to the run's on every rank, the buffers
    identical on every rank and against the one-GPU call's checkpoints (rank 0 reports)."""
    every = a.checkpoint_every
    peaks = []
    for more in ({}, {"checkpoint_every": every}):
        _sync()
        if a.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        res = run(**more)
        _sync()
        peaks.append(torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else float("nan"))
    ms = wall_ms(lambda: run(checkpoint_every=every), a.iters, True)
    dev = out[0].device
    same = torch.tensor([int(torch.equal(res[0], out[0]))], device=dev)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    peak = torch.tensor(peaks, device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    buf = res[-1]
    parts = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, buf.contiguous())
    if rank == 0:
        replicas = all(torch.equal(x, parts[0]) for x in parts)
        mem = (f"peak memory {peak[1].item():.2f} GiB against {peak[0].item():.2f} without (largest rank)"
               if a.device == "cuda" else "no memory figure on the CPU")
        say(f"  - with a checkpoint every {every} tokens ({buf.shape[0]} rows): {ms:.2f} ms; {mem}; o "
            f"{'bit-identical to' if same.item() else 'DIFFERENT from'} the run's on every rank; rows "
            f"{rel_rmse(buf.float(), ref[2].float()):.2e} against the one-GPU call's, "
            f"{'identical' if replicas else 'DIFFERENT'} on every rank ({what})")


if __name__ == "__main__":
    sys.exit(main())
