"""GPU timing: CUDA events around calls after warm-up, inputs rotated so the L2 cache does not
flatter small cases; the one harness of `kdagen bench`, `kdagen tune` and the scripts.

Every function here needs a CUDA device (torch is imported on call, so the module imports on
machines without one).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence


@dataclass(frozen=True)
class Timing:
    """Milliseconds of `n` timed calls: median, 10th and 90th percentile, minimum."""

    median: float
    p10: float
    p90: float
    min: float
    n: int

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the relative spread of the timed calls."""
        return (self.p90 - self.p10) / self.median if self.median > 0 else math.inf


def summarize(times: Sequence[float]) -> Timing:
    """A Timing of per-call milliseconds (nearest-rank percentiles)."""
    if not times:
        raise ValueError("summarize: expected at least one time, found none")
    ts = sorted(times)

    def pct(p: float) -> float:
        return ts[min(len(ts) - 1, max(0, math.ceil(p * len(ts)) - 1))]

    return Timing(median=statistics.median(ts), p10=pct(0.1), p90=pct(0.9), min=ts[0], n=len(ts))


def combine(timings: Sequence[Timing]) -> Timing:
    """One Timing from several timed rounds of the same call: the median of the rounds' medians (a round
    that drifted does not move it far), the outer percentiles and the total count."""
    if not timings:
        raise ValueError("combine: expected at least one Timing, found none")
    return Timing(median=statistics.median(t.median for t in timings), p10=min(t.p10 for t in timings),
                  p90=max(t.p90 for t in timings), min=min(t.min for t in timings), n=sum(t.n for t in timings))


def _event_times(run: Callable[[int], Any], iters: int) -> list[float]:
    import torch

    times = []
    for i in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def time_calls(fn: Callable[[Any], Any], sets: Sequence[Any], warmup: int = 5, iters: Optional[int] = 30,
               budget_ms: float = 300.0, max_iters: int = 200) -> Timing:
    """Timing of `fn(s)` with the input sets `sets` in rotation, one CUDA event pair around each
    call (host work inside the call counts: an eager call's launch overhead is part of it).
    iters=None picks the count from the warm-up: enough calls to fill `budget_ms`, at least 20,
    at most `max_iters`."""
    import time

    import torch

    fn(sets[0])  # a first call may compile or load: not part of the estimate below
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(1, max(2, warmup)):
        fn(sets[i % len(sets)])
    torch.cuda.synchronize()
    if iters is None:
        per_call = (time.perf_counter() - t0) * 1e3 / max(1, warmup - 1)
        iters = int(min(max_iters, max(20, budget_ms / max(per_call, 1e-3))))
    return summarize(_event_times(lambda i: fn(sets[i % len(sets)]), iters))


def median_ms(fn: Callable[[Any], Any], sets: list, warmup: int = 5, iters: int = 30) -> float:
    """Median milliseconds of `fn(s)` over the rotated input sets `sets` (see time_calls)."""
    return time_calls(fn, sets, warmup=warmup, iters=iters).median


def timeit(fn: Callable[[], Any], warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of `fn()` on the current CUDA stream (CUDA events, after warm-up)."""
    return time_calls(lambda _: fn(), [None], warmup=warmup, iters=iters).median


def graph_calls(fn: Callable[[Any], Any], sets: Sequence[Any], warmup: int = 3, iters: Optional[int] = 30,
                budget_ms: float = 200.0) -> Timing:
    """Timing of CUDA-graph replays of `fn(s)`: one graph captured per input set (a graph keeps
    its tensors' addresses), replayed in rotation; what a serving engine's captured prefill costs
    without the host."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs = []
    with torch.cuda.stream(stream):
        for s in sets:  # warm the call once per set outside capture (allocator, plan caches)
            fn(s)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for s in sets:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(s)
        graphs.append(g)
    return time_calls(lambda g: g.replay(), graphs, warmup=warmup, iters=iters, budget_ms=budget_ms)


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device memory bandwidth in bytes per second, from a device-to-device copy of `nbytes`
    (each copy reads and writes nbytes; median of `iters`)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src.fill_(1)
    t = time_calls(lambda _: dst.copy_(src), [None], warmup=3, iters=iters)
    return 2.0 * nbytes / (t.median * 1e-3)
