"""Host cost of kdagen.kda_prefill on a GPU (issue 14): what an eager call costs the CPU, and
how close eager calls come to the same work replayed from a CUDA graph, through each launch path
of the sm80 bound launch (the C launch shim and cuda-bindings) in one process.

    PYTHONPATH=$PWD python scripts/host_overhead.py [--out DIR] [--calls 1000] [--paths shim,bindings]
    PYTHONPATH=$PWD python scripts/host_overhead.py --stub                       (no GPU: see below)

For each case (bf16, K = V = 128, bounded gate, fp32 state in and out) and launch path:
- host_us: median CPU wall time of one call over `--calls` back-to-back calls of a signature
  seen before, in `--rounds` rounds taken in turn over the cases and paths after one uncounted
  round (so no case is measured while the process is new, and both paths see the same
  machine); a sync every 100 calls keeps the launch queue from filling, so a GPU slower than
  the host does not show up as host time. Also with engine-owned out=/final_state=/workspace=,
  through torch.ops.kdagen.kda_prefill, with beta as probabilities (beta_is_logit=False) and
  through kdagen.chunk_kda with fla's keywords as fla's callers pass them (flat dt_bias, int64
  cu_seqlens with their host copy);
- eager_ms / graph_ms: GPU-timeline time per call of 100 back-to-back eager calls and of 100
  replays of one captured call (CUDA events), and their ratio.
It first checks that the fast path gives the general path's result bit for bit, says which launch
path the calls took, and splits the tiny case's host time: the bound launch alone, the signature
check a plain call passes first and the two output allocations, each measured inside every round
right after the plain call (the same context as the table) and once more after the rounds, with
the whole plain call, one driver call through cuda-bindings and through ctypes, the shim's call
alone, and the plain call with the GPU kept busy.
The path switch: every bound launch of the cases is switched with Sm80Bound.use_shim (a process
with KDAGEN_LAUNCH_SHIM=0 has only the cuda-bindings path). Exit status 1 when the tiny case
costs more than 20 us of host time or T2048 H8 runs eager more than 1.3x its graph time (the
issue's bars, on the path kdagen takes by default: the first of --paths it has); JSON and a
markdown table go to --out.

--stub runs the host columns on the CPU with CPU tensors: the sm80 launcher over a stand-in
module and driver (tests/fake_cuda.py) that drop every launch (the shim path: the real shim over
tests/fake_libcuda.c, which drops them in C), so it measures kdagen's own Python (signature, plan,
allocation of CPU tensors, the bound launch's struct filling, the Python -> driver transitions)
and leaves out the driver's launch cost and the CUDA caching allocator; it has no pass/fail bar.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

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
VARIANT = ("sm80", 16, 128, 128, "bf16", "bounded", "fp32", 32)


def make_inputs(lens: list[int], H: int, device: str, seed: int = 0) -> dict:
    """The shared test case builder's inputs (random, never zero), with host offsets."""
    from kdagen.cases import make_case
    from kdagen.variant import Variant

    kw = make_case(Variant(*VARIANT), device, B=1, T=sum(lens), H=H, HV=H, lens=lens if len(lens) > 1 else None,
                   seed=seed)
    kw["gate"] = VARIANT[5]  # named: the torch op below takes it explicitly
    if len(lens) > 1:
        kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu().clone()  # its own tensor also when device is the CPU
    return kw


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_times(fn, calls: int, busy_cycles: int = 0) -> list[float]:
    """Seconds of each of `calls` back-to-back calls (after 50 unmeasured ones). `busy_cycles`:
    each batch of 100 calls starts behind a GPU sleep of that many cycles, so the launches queue
    on a busy GPU (as an engine's do, between its other layers) instead of finding it idle."""
    for _ in range(50):
        fn()
    _sync()
    times = []
    clock = time.perf_counter
    for i in range(calls):
        if busy_cycles and i % 100 == 0:
            torch.cuda._sleep(busy_cycles)
        t0 = clock()
        fn()
        times.append(clock() - t0)
        if i % 100 == 99:
            _sync()
    _sync()
    return times


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


PATHS = ("shim", "bindings")  # launch paths of the sm80 bound launch (Sm80Bound.use_shim)
COLUMNS = ("host_us", "host_us_owned_buffers", "host_us_torch_op", "host_us_beta_prob", "host_us_chunk_kda")
IN_ROUND_SPLIT = ("bound_launch_us", "signature_check_us", "two_allocations_us")


def _median_us(times: list[float]) -> float:
    return statistics.median(times) * 1e6


class Case:
    """One case's inputs, the calls whose host time is measured, and the bound launches of its
    signatures (plain and owned buffers), switched between the launch paths."""

    def __init__(self, name: str, lens: list[int], H: int, device: str) -> None:
        import kdagen
        import kdagen.runtime as rt

        self.name = name
        kw = self.kw = make_inputs(lens, H, device)
        call = self.call = lambda: kdagen.kda_prefill(**kw)  # noqa: E731
        before = set(map(id, rt._PLANS.values()))
        # the first call of a signature takes the general path (and binds), the next the fast one
        o_general, s_general = [t.clone() for t in call()]
        o_fast, s_fast = call()
        self.plan = list(rt._PLANS.values())[-1]  # plans are kept in insertion order
        self.same = bool(torch.equal(o_general, o_fast) and torch.equal(s_general, s_fast))
        out, fs = torch.empty_like(kw["v"]), torch.empty_like(kw["initial_state"])
        nbytes = kdagen.workspace_size(**kw)
        ws = torch.empty(nbytes + 256, dtype=torch.uint8, device=device)  # 256-byte aligned (CPU tensors
        ws = self.ws = ws[(-ws.data_ptr()) % 256:][:nbytes]                 # are not, CUDA ones are)
        self.out, self.fs = out, fs
        self.owned = lambda: kdagen.kda_prefill(**kw, out=out, final_state=fs, workspace=ws)  # noqa: E731
        op_args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], kw["A_log"], kw["dt_bias"], kw["initial_state"],
                   kw.get("cu_seqlens"), kw.get("cu_seqlens_cpu"), out, fs, None, ws)
        self.op = lambda: torch.ops.kdagen.kda_prefill(*op_args, gate=kw["gate"], layout=kw["layout"])  # noqa: E731
        # beta as probabilities (beta_is_logit=False: the engines' form), and the same call through
        # kdagen.chunk_kda with fla's keywords as fla's callers pass them (flat dt_bias, int64 offsets)
        b = torch.sigmoid(kw["beta"])
        self.prob = lambda: kdagen.kda_prefill(**dict(kw, beta=b), beta_is_logit=False)  # noqa: E731
        cu = kw.get("cu_seqlens")
        fla_kw = dict(initial_state=kw["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                      use_gate_in_kernel=True, lower_bound=-5.0, A_log=kw["A_log"], dt_bias=kw["dt_bias"].reshape(-1),
                      state_v_first=True, cu_seqlens=cu.long() if cu is not None else None,
                      cu_seqlens_cpu=kw["cu_seqlens_cpu"].long() if cu is not None else None)
        self.compat = lambda: kdagen.chunk_kda(kw["q"], kw["k"], kw["v"], kw["g"], b, **fla_kw)  # noqa: E731
        for fn in (self.owned, self.prob, self.compat):
            fn()
            fn()  # binds the signature (the op shares the owned buffers' plan)
        self.bounds = [p.fast for p in rt._PLANS.values() if id(p) not in before and hasattr(p.fast, "use_shim")]
        # path -> column -> every call's seconds; path -> column -> each round's median (us)
        self.times = {path: {col: [] for col in COLUMNS + IN_ROUND_SPLIT} for path in PATHS}
        self.round_us = {path: {col: [] for col in COLUMNS + IN_ROUND_SPLIT} for path in PATHS}

    def set_path(self, path: str) -> str:
        """Switch this case's bound launches to `path`; returns the plain call's launch path."""
        for b in self.bounds:
            b.use_shim(path == "shim")
        fast = self.plan.fast
        return getattr(fast, "launch_path", "general path (no bound launch)")

    def split_calls(self) -> dict:
        """The pieces of a plain call, each callable alone: the bound launch (buffers given, the
        driver calls inside), the signature check a plain call passes first, the two output
        allocations as the plan makes them."""
        kw, fast, plan = self.kw, self.plan.fast, self.plan
        calls = {}
        if fast is not None and hasattr(fast, "launch"):
            args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], self.out, kw["A_log"], kw["dt_bias"],
                    kw.get("cu_seqlens"), kw["initial_state"], self.fs, None, None, None, kw["q"].shape[1])
            calls["bound_launch_us"] = lambda: fast.launch(*args)  # noqa: E731
        if plan.guard is not None:
            slots = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], kw["A_log"], kw["dt_bias"], kw["initial_state"],
                     kw.get("cu_seqlens"), kw.get("cu_seqlens_cpu"), None, None, None, None)
            calls["signature_check_us"] = lambda: plan.guard(*slots)  # noqa: E731
        if plan.empty is not None:
            calls["two_allocations_us"] = lambda: (plan.empty(plan.o_shape, plan.o_cstrides, plan.o_dtype),  # noqa: E731
                                                   plan.empty(plan.fs_shape, plan.fs_cstrides, plan.st_dtype))
        return calls

    def round(self, calls: int, paths: list[str], record: bool = True, split: bool = False) -> None:
        """Every column on every path; `split`: the plain call's pieces too, right after it."""
        for path in paths:
            self.set_path(path)
            todo = [("host_us", self.call)]
            if split:
                todo += list(self.split_calls().items())
            todo += [("host_us_owned_buffers", self.owned), ("host_us_torch_op", self.op),
                     ("host_us_beta_prob", self.prob), ("host_us_chunk_kda", self.compat)]
            for col, fn in todo:
                times = host_times(fn, calls)
                if record:
                    self.times[path][col] += times
                    self.round_us[path][col].append(_median_us(times))

    def row(self, path: str) -> dict:
        launch_path = self.set_path(path)
        launcher_variant = getattr(self.plan.launcher, "variant", self.plan.variant)  # --stub: the sm80 one
        row = {"case": self.name, "path": path, "variant": launcher_variant.name,
               "fast_path": type(self.plan.fast).__name__, "launch_path": launch_path,
               "fast_equals_general": self.same}
        for col in COLUMNS:
            row[col] = _median_us(self.times[path][col])
        row["host_us_per_round"] = self.round_us[path]["host_us"]
        row["split_in_rounds"] = {col: _median_us(ts) for col, ts in self.times[path].items()
                                  if col in IN_ROUND_SPLIT and ts}
        return row

    def breakdown(self, calls: int, stub: bool, path: str) -> dict:
        """After the rounds, on `path`: the split's pieces again, the whole plain call, one driver
        call through each binding and the shim's call alone (GPU only), two torch.empty_like and
        the plain call behind a busy GPU (GPU only)."""
        self.set_path(path)
        kw = self.kw
        res = {col: _median_us(host_times(fn, calls)) for col, fn in self.split_calls().items()}
        if not stub:  # right after the bound launch: its struct points at this case's live buffers
            try:
                res.update(self.driver_calls(calls, path))
            except Exception as e:  # the table matters more than this line
                print(f"host_overhead: driver calls not measured: {type(e).__name__}: {e}")
        res["plain_call_us"] = _median_us(host_times(self.call, calls))
        if not stub:  # ~5 ms of sleep covers 100 calls: every launch of the batch queues
            res["plain_call_gpu_busy_us"] = _median_us(host_times(self.call, calls, 10_000_000))
        v, h0 = kw["v"], kw["initial_state"]
        res["two_empty_like_us"] = _median_us(host_times(lambda: (torch.empty_like(v), torch.empty_like(h0)), calls))
        return res

    def driver_calls(self, calls: int, path: str) -> dict:
        """Host us of one kda_recur launch (the bound struct as the bound launch left it) through
        cuda-bindings, as the bound launch calls it, and through ctypes straight into libcuda's
        cuLaunchKernel (argument types set once); on the shim path the shim's one call of both
        launches: what each binding costs on this machine."""
        import ctypes

        from kdagen.targets.cuda_driver import current_stream_handle

        fast = self.plan.fast
        raw = current_stream_handle(fast.idx)
        res = {}
        if path == "shim":
            addr, prep_x, _pair = fast.shim_args[raw]  # made by the bound launch timed before, on this stream
            res["shim_call_both_kernels_us"] = _median_us(host_times(lambda: fast.shim_call(addr, prep_x), calls))
            return res
        stream = fast.streams[raw]
        gx, gy, gz = fast.recur_grid
        args = (fast.f2, gx, gy, gz, fast.nt2, 1, 1, fast.smem2, stream, fast.argv_addr, 0)
        res["driver_call_cuda_bindings_us"] = _median_us(host_times(lambda: fast.launch_kernel(*args)[0], calls))
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
            cargs = (int(fast.f2), gx, gy, gz, fast.nt2, 1, 1, fast.smem2, raw, fast.argv_addr, None)
            err = fn(*cargs)
            if err:
                raise RuntimeError(f"cuLaunchKernel returned {err}")
            res["driver_call_ctypes_us"] = _median_us(host_times(lambda: fn(*cargs), calls))
        except Exception as e:  # the table matters more than this line
            print(f"host_overhead: ctypes launch not measured: {e}")
        return res


def _stub_setup():
    """CPU stand-ins: selection on the CPU, its launcher replaced by the sm80 one over the fake
    module and driver (launches dropped; the shim's in tests/fake_libcuda.c)."""
    from contextlib import ExitStack

    os.environ.setdefault("TRITON_INTERPRET", "1")  # lets selection pass on the CPU; no kernel runs
    from kdagen.variant import Variant
    from tests.fake_cuda import route_launcher, sm80_on_cpu

    stack = ExitStack()
    la, _drv = stack.enter_context(sm80_on_cpu(Variant(*VARIANT), record=False, shim=True))
    stack.enter_context(route_launcher(la))
    return stack


def _paths(arg: str, cases: list[Case]) -> tuple[list[str], str]:
    """The launch paths to measure (those asked that the bound launches have here) and why a path
    asked for is missing (or "")."""
    asked = [p.strip() for p in arg.split(",") if p.strip()]
    bad = [p for p in asked if p not in PATHS]
    if bad or not asked:
        raise SystemExit(f"--paths: expected a comma-separated subset of {','.join(PATHS)}, found {arg!r}")
    bounds = [b for c in cases for b in c.bounds]
    if "shim" in asked and (not bounds or any(b.shim is None for b in bounds)):
        why = next((b.launch_path for b in bounds if b.shim is None), "no bound launch")
        return [p for p in asked if p != "shim"] or ["bindings"], f"shim path not measured: {why}"
    return asked, ""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write host_overhead.json and host_overhead.md here")
    ap.add_argument("--calls", type=int, default=1000, help="calls per round and column")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, taken in turn over the cases and paths")
    ap.add_argument("--paths", default=",".join(PATHS),
                    help="launch paths of the sm80 bound launch to measure, the default one first")
    ap.add_argument("--stub", action="store_true", help="CPU only: host columns with launches dropped")
    args = ap.parse_args()
    stub = args.stub
    if not stub and not torch.cuda.is_available():
        print("host_overhead: needs a CUDA GPU (or --stub)")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    stack = _stub_setup() if stub else None
    import kdagen.runtime as rt

    rt.reset()
    cases = [Case(name, lens, H, "cpu" if stub else "cuda") for name, (lens, H) in CASES.items()]
    paths, missing = _paths(args.paths, cases)
    tiny_case = cases[0]
    for i in range(args.rounds + 1):  # the first round warms the process up and is not counted
        for c in cases:
            c.round(args.calls, paths, record=i > 0, split=c is tiny_case)
    rows = [c.row(p) for c in cases for p in paths]
    split = {p: tiny_case.breakdown(args.calls, stub, p) for p in paths}
    if not stub:
        for c in cases:
            for p in paths:
                r = next(r for r in rows if r["case"] == c.name and r["path"] == p)
                c.set_path(p)
                r["eager_ms"] = gpu_ms(c.owned)
                r["graph_ms"] = _graph_ms(c)
                r["eager_over_graph"] = r["eager_ms"] / r["graph_ms"]
    if stack is not None:
        stack.close()
    lines = _report(rows, split, paths, missing, stub, args)
    print("\n".join(lines[0]))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "host_overhead.json").write_text(json.dumps({"header": lines[0][0], "rows": rows,
                                                            "tiny_breakdown": split}, indent=2) + "\n")
        (out / "host_overhead.md").write_text("\n".join(lines[0]) + "\n")
    return 0 if all(ok for _, ok in lines[1]) else 1


def _graph_ms(c: Case) -> float:
    kw = c.kw
    graph = torch.cuda.CUDAGraph()
    gkw = {n: t for n, t in kw.items() if n not in ("cu_seqlens_cpu", "output_final_state")}
    import kdagen

    step = lambda: kdagen.kda_prefill(**gkw, out=c.out, final_state=c.fs, workspace=c.ws,  # noqa: E731
                                      assume_valid=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
        step()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        step()
    return gpu_ms(graph.replay)


def _cpu_model() -> str:
    """The host CPU's model name (host times differ between machines of one kind)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _us_parts(parts: dict) -> str:
    return ", ".join(f"{n.replace('_us', '').replace('_', ' ')} {v:.1f} us" for n, v in parts.items())


def _report(rows: list[dict], split: dict, paths: list[str], missing: str, stub: bool,
            args) -> tuple[list[str], list[tuple[str, bool]]]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    where = ("CPU stub (launches dropped, CPU tensors)" if stub
             else f"{torch.cuda.get_device_name()}")
    head = (f"kdagen host overhead, {time.strftime('%Y-%m-%d')}, commit {commit or 'unknown'}, {where}, "
            f"host CPU {_cpu_model()}, torch {torch.__version__}, median of {args.rounds} x {args.calls} calls "
            "per cell")
    cols = ("| case | variant | launch | host us | host us, owned buffers | host us, torch op | host us, beta "
            "probabilities | host us, kdagen.chunk_kda |")
    rule = "|---|---|---|---|---|---|---|---|"
    if not stub:
        cols += " eager ms | graph ms | eager/graph | fast path = general |"
        rule += "---|---|---|---|"
    lines = [head, "", cols, rule]
    for r in rows:
        line = (f"| {r['case']} | {r['variant']} ({r['fast_path']}) | {r['path']} | {r['host_us']:.1f} | "
                f"{r['host_us_owned_buffers']:.1f} | {r['host_us_torch_op']:.1f} | {r['host_us_beta_prob']:.1f} | "
                f"{r['host_us_chunk_kda']:.1f} |")
        if not stub:
            line += f" {r['eager_ms']:.4f} | {r['graph_ms']:.4f} | {r['eager_over_graph']:.2f} | " \
                    f"{r['fast_equals_general']} |"
        lines.append(line)
    lines.append("")
    for p in paths:
        lines.append(f"- launch path {p}: {'; '.join(sorted({r['launch_path'] for r in rows if r['path'] == p}))}")
    if missing:
        lines.append(f"- {missing}")
    for p in paths:
        tiny = next(r for r in rows if r["path"] == p)
        lines.append(f"- tiny case split ({p}), in the rounds: {_us_parts(tiny['split_in_rounds'])}, "
                     f"plain call {tiny['host_us']:.1f} us")
        lines.append(f"- tiny case split ({p}), after the rounds: {_us_parts(split[p])}")
        per_round = ", ".join(f"{x:.1f}" for x in tiny["host_us_per_round"])
        lines.append(f"- tiny plain call ({p}), median of each round: {per_round} us")
    checks: list[tuple[str, bool]] = []
    if not stub:
        default = paths[0]
        tiny = next(r for r in rows if r["path"] == default)
        t2048 = next(r for r in rows if r["case"] == "T2048 H8" and r["path"] == default)
        checks = [(f"host us per eager call (tiny, {default}) {tiny['host_us']:.1f} <= {HOST_US_MAX}",
                   tiny["host_us"] <= HOST_US_MAX),
                  (f"T2048 H8 eager/graph ({default}) {t2048['eager_over_graph']:.2f} <= {EAGER_OVER_GRAPH_MAX}",
                   t2048["eager_over_graph"] <= EAGER_OVER_GRAPH_MAX),
                  ("fast path = general path, every case", all(r["fast_equals_general"] for r in rows))]
        lines += [f"- {'PASS' if ok else 'FAIL'} {what}" for what, ok in checks]
    return lines, checks


if __name__ == "__main__":
    sys.exit(main())
