"""Host cost of kdagen.kda_prefill on a GPU (issue 14): what an eager call costs the CPU, and
how close eager calls come to the same work replayed from a CUDA graph.

    PYTHONPATH=$PWD python scripts/host_overhead.py [--out DIR] [--calls 1000]   (from the repository root)

For each case (bf16, K = V = 128, bounded gate, fp32 state in and out):
- host_us: median CPU wall time of one call over `--calls` back-to-back calls of a signature
  seen before (a sync every 100 calls keeps the launch queue from filling, so a GPU slower than
  the host does not show up as host time); also with engine-owned out=/final_state=/workspace=
  and through torch.ops.kdagen.kda_prefill;
- eager_ms / graph_ms: GPU-timeline time per call of 100 back-to-back eager calls and of 100
  replays of one captured call (CUDA events), and their ratio.
It first checks that the fast path gives the general path's result bit for bit. Exit status 1
when the tiny case costs more than 20 us of host time or T2048 H8 runs eager more than 1.3x its
graph time (the issue's bars); JSON and a markdown table go to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import kdagen
import kdagen.runtime as rt
from kdagen.variant import Variant
from tests.kda_cases import make_case

CASES = {
    # name: (sequence lengths, heads); one sequence unless several lengths
    "tiny T64 H4": ([64], 4),
    "T64 H32": ([64], 32),
    "T1024 H8": ([1024], 8),
    "T2048 H8": ([2048], 8),
    "varlen 4x512 H32": ([512] * 4, 32),
}
HOST_US_MAX = 20.0  # the tiny case
EAGER_OVER_GRAPH_MAX = 1.3  # T2048 H8


def make_inputs(lens: list[int], H: int, seed: int = 0) -> dict:
    """The shared test case builder's inputs (random, never zero), with host offsets."""
    kw = make_case(Variant("sm80", 16, 128, 128, "bf16", "bounded", "fp32", 32), "cuda", B=1, T=sum(lens), H=H,
                   HV=H, lens=lens if len(lens) > 1 else None, seed=seed)
    if len(lens) > 1:
        kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
    return kw


def host_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if i % 100 == 99:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def gpu_ms(fn, n: int = 100) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def measure(name: str, lens: list[int], H: int, calls: int) -> dict:
    kw = make_inputs(lens, H)
    call = lambda: kdagen.kda_prefill(**kw)  # noqa: E731
    # correctness of the fast path: the first call of a signature takes the general path
    rt.reset()
    o_general, s_general = call()
    o_fast, s_fast = call()
    plan = next(iter(rt._PLANS.values()))
    same = bool(torch.equal(o_general, o_fast) and torch.equal(s_general, s_fast))
    row = {"case": name, "variant": plan.entry.name, "fast_path": type(plan.fast).__name__,
           "fast_equals_general": same}
    row["host_us"] = host_us(call, calls)
    out, fs = torch.empty_like(kw["v"]), torch.empty_like(kw["initial_state"])
    ws = torch.empty(kdagen.workspace_size(**kw), dtype=torch.uint8, device="cuda")
    owned = lambda: kdagen.kda_prefill(**kw, out=out, final_state=fs, workspace=ws)  # noqa: E731
    row["host_us_owned_buffers"] = host_us(owned, calls)
    op_args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], kw["A_log"], kw["dt_bias"], kw["initial_state"],
               kw.get("cu_seqlens"), kw.get("cu_seqlens_cpu"), out, fs, None, ws)
    op = lambda: torch.ops.kdagen.kda_prefill(*op_args, gate=kw["gate"], layout=kw["layout"])  # noqa: E731
    row["host_us_torch_op"] = host_us(op, calls)
    row["eager_ms"] = gpu_ms(owned)
    graph = torch.cuda.CUDAGraph()
    gkw = {n: t for n, t in kw.items() if n not in ("cu_seqlens_cpu", "output_final_state")}
    step = lambda: kdagen.kda_prefill(**gkw, out=out, final_state=fs, workspace=ws, assume_valid=True)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
        step()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        step()
    row["graph_ms"] = gpu_ms(graph.replay)
    row["eager_over_graph"] = row["eager_ms"] / row["graph_ms"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write host_overhead.json and host_overhead.md here")
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("host_overhead: needs a CUDA GPU")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = [measure(name, lens, H, args.calls) for name, (lens, H) in CASES.items()]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    head = (f"kdagen host overhead, {time.strftime('%Y-%m-%d')}, commit {commit or 'unknown'}, "
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    lines = [head, "", "| case | variant | host us | host us, owned buffers | host us, torch op | eager ms | "
             "graph ms | eager/graph | fast path = general |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['variant']} ({r['fast_path']}) | {r['host_us']:.1f} | "
                     f"{r['host_us_owned_buffers']:.1f} | {r['host_us_torch_op']:.1f} | {r['eager_ms']:.4f} | "
                     f"{r['graph_ms']:.4f} | {r['eager_over_graph']:.2f} | {r['fast_equals_general']} |")
    tiny = next(r for r in rows if r["case"].startswith("tiny"))
    t2048 = next(r for r in rows if r["case"] == "T2048 H8")
    checks = [(f"host us per eager call (tiny) {tiny['host_us']:.1f} <= {HOST_US_MAX}", tiny["host_us"] <= HOST_US_MAX),
              (f"T2048 H8 eager/graph {t2048['eager_over_graph']:.2f} <= {EAGER_OVER_GRAPH_MAX}",
               t2048["eager_over_graph"] <= EAGER_OVER_GRAPH_MAX),
              ("fast path = general path, every case", all(r["fast_equals_general"] for r in rows))]
    lines += [""] + [f"- {'PASS' if ok else 'FAIL'} {what}" for what, ok in checks]
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "host_overhead.json").write_text(json.dumps({"header": head, "rows": rows}, indent=2) + "\n")
        (out / "host_overhead.md").write_text("\n".join(lines) + "\n")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
