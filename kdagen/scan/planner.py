"""Whether to split a call's sequences into scan segments, and into how many (pure Python).

A cost model of one GPU. The chunk recurrence of a program is a serial chain, one step per
chunk. A step alone on an SM takes `step_us` (latency); p programs sharing an SM slow each other
only once their SM time per step adds up: a step takes max(step_us, p * step_sm_us), with at
most `programs_per_sm` resident. Recurrence time is the longer of the longest chain at that pace
and the total chunk-steps spread over all SMs. The token-parallel prep is throughput-bound over
the whole GPU:

    one piece  = call + prep + recur(sequence chunks, HV * v_blocks programs each)
    scan       = 2 calls + copies + prep * (map_prep + rerun_prep)            (steps 1 and 3)
               + recur(segment chunks, map_programs * HV * v_blocks each)    (step 1)
               + call + segments of the longest sequence * compose           (step 2)
               + recur(segment chunks, HV * v_blocks each)                   (step 3)

Segments are whole `align`-token units; every sequence is cut into pieces of about one target
length (long ones into many, short ones left whole), and the target is the one the model rates
fastest. The scan is chosen only when it beats one piece by `margin`: the model is rough and a
wrong split costs up to 3x the work.

The "h200-engine" costs are measured (tree 96455e8, benchmarks/results/2026-12-01_s10_h200_scan_issue17.md):
one program's chunk step already takes about a whole SM's throughput (step_sm_us ~ step_us), so
the scan's doubled and repeated work only pays where the one-piece call leaves most SMs idle.
"h200-kernels" stays a set of design targets for dedicated kernels, marked unmeasured.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

__all__ = ["ScanCosts", "ScanPlan", "COSTS", "plan_segments"]


@dataclass(frozen=True)
class ScanCosts:
    """Costs of the scan's pieces on one GPU. Times in microseconds unless named _ns."""

    name: str
    measured: bool  # False: placeholders (see `source`); never present them as measurements
    source: str
    step_us: dict[int, float]  # one chunk step of a recurrence program alone on an SM, by chunk
    step_sm_us: dict[int, float]  # SM time one such step occupies (throughput), by chunk
    map_step_us: dict[int, float]  # the same two for a transition-building program (step 1)
    map_step_sm_us: dict[int, float]
    map_programs: float  # step-1 programs per one-piece program (2: the B and A calls)
    prep_ns: dict[int, float]  # token-parallel prep per token and head, whole GPU, by chunk
    map_prep: float  # step-1 prep in units of the one-piece prep (1: the prep once, shared with step 3)
    rerun_prep: float  # step-3 prep in units of the one-piece prep (0: step 1's workspace reused)
    copy_ns: float  # per token and head: inputs step 1 needs rearranged (none since session 29)
    compose_us: float  # one segment of the chain pass (one [BV, K] x [K, K] product, dependent)
    call_us: float  # host and launch cost of one more kernel call
    programs_per_sm: int = 4  # recurrence programs resident on one SM


# Measured on the H200 (tree 96455e8; scripts/scan_bench.py and scripts/fatbin_ab.py in the same
# session, benchmarks/results/2026-12-01_s10_*):
# - step_us: the one-piece sm80 recurrence alone, 0.44 us a chunk-16 step at block_v 16 (T131072
#   H4) and 0.57 at block_v 32 (T65536 H24); 1.75-1.87 at chunk 64 (T65536 H24).
# - step_sm_us: step 1 with 2 programs per SM took 0.86 us a step (T131072 H4, S=4: 2.86 ms less
#   its doubled prep, over 2048 steps) and 1.51 with 3 (T65536 H24, S=2): 0.43-0.50 us of SM
#   time per program-step. Chunk 64 at several programs per SM is not measured: set equal.
# - prep_ns: kda_prep alone, 0.97-1.1 ns per token and head at chunk 16, 2.7 at chunk 64.
# - map_prep = 1, rerun_prep = 1: since session 30 step 1 is one sm80 launch with twin state heads
#   (one kda_prep, 3.29 ms, then one kda_recur over 2 HV heads, 6.34 ms, at 512K tokens, 8 heads, 8
#   segments; as two calls it took 2 x (3.29 + 2.79)); step 3 re-preps. Until then map_prep was 2.
#   With 1 the model splits B1 T131072 H4 (4.2 against 4.7 ms modeled), which the H200 then
#   measured at 3.03-3.57 ms (S = 4-16) against 4.31 in one piece, and still leaves T65536 H8 and
#   H24 and T8192 H4 whole, measured slower split (2026-12-04_s30_h200_twins.md).
# - copy_ns: 0. Step 1's doubled-head inputs cost ~1.0 ns per token and head (4.1 ms at 512K tokens,
#   8 heads, torch.profiler, session 29); the two calls since read the caller's tensors.
# - call_us: the scan's host work besides the steps, ~150 us at T8192 H4 (three calls' worth).
# - compose_us: the re-tiled Triton chain (tree ca546e0) took 0.08 ms at 4 segments and 0.20 at 16
#   (H4), 0.14 at 8 (H24): ~12 us a segment (0.3 ms before, when it held a whole [K, K] tile).
_H200_ENGINE = ScanCosts(
    name="h200-engine",
    measured=True,
    source="H200, trees 96455e8 and ca546e0 (benchmarks/results/2026-12-01_s10_h200_scan_issue17.md): the scan "
           "composed of kda_prefill calls (step 1 one twin launch since session 30; step 3 re-preps); "
           "chunk-64 step_sm_us estimated",
    step_us={16: 0.5, 64: 1.8},
    step_sm_us={16: 0.47, 64: 1.8},
    map_step_us={16: 0.5, 64: 1.8},
    map_step_sm_us={16: 0.47, 64: 1.8},
    map_programs=2.0,
    prep_ns={16: 1.0, 64: 2.7},
    map_prep=1.0,
    rerun_prep=1.0,
    copy_ns=0.0,
    compose_us=12.0,
    call_us=50.0,
)
# What dedicated kernels are to deliver (design targets, unmeasured): step 1 builds B and A in
# one program set without o and shares its prep workspace with step 3; steps at the measured
# one-piece pace, several programs per SM overlapping (step_sm_us a third of step_us).
_H200_KERNELS = replace(
    _H200_ENGINE,
    name="h200-kernels",
    measured=False,
    source="design targets for dedicated scan kernels (prep once, step 1 without o, overlapping programs), "
           "not measured",
    step_sm_us={16: 0.15, 64: 0.6},
    map_step_sm_us={16: 0.15, 64: 0.6},
    map_prep=1.0,
    rerun_prep=0.0,
    copy_ns=0.0,
    call_us=10.0,
)
COSTS: dict[str, ScanCosts] = {c.name: c for c in (_H200_ENGINE, _H200_KERNELS)}


@dataclass(frozen=True)
class ScanPlan:
    segments: tuple[int, ...]  # per sequence (1: whole)
    one_piece_us: float
    scan_us: float  # modeled time of the chosen split (= one_piece_us when not split)
    reason: str
    costs: str = ""
    measured_costs: bool = False
    candidates: tuple[tuple[int, float], ...] = field(default=(), repr=False)  # (target tokens, scan us)

    @property
    def split(self) -> bool:
        return any(s > 1 for s in self.segments)


def _recur_us(chunks: Sequence[int], programs_each: float, sm_count: int, resident: int, step_us: float,
              step_sm_us: float) -> float:
    """Recurrence time: every item of `chunks` runs `programs_each` programs of that many steps."""
    if not chunks:
        return 0.0
    programs = len(chunks) * programs_each
    per_sm = min(resident, -(-programs // sm_count))
    pace = max(step_us, per_sm * step_sm_us)  # one step with per_sm programs sharing the SM
    total = sum(chunks) * programs_each
    return max(max(chunks) * pace, total * max(step_sm_us, step_us / resident) / sm_count)


def _units(n: int, align: int) -> int:
    return -(-n // align)


def _cut(length: int, target: int, align: int, max_segments: int) -> list[int]:
    """Chunk counts (of `align` units) of a sequence cut into pieces of about `target` tokens."""
    units = _units(length, align)
    s = max(1, min(max_segments, units, -(-length // target))) if length else 1
    return [units // s + (1 if i < units % s else 0) for i in range(s)]


def plan_segments(lengths: Sequence[int], *, heads: int, v_blocks: int, sm_count: int, chunk: int = 16,
                  costs: ScanCosts | str = "h200-engine", align: int = 64, max_segments: int = 64,
                  margin: float = 0.1, force: bool = False) -> ScanPlan:
    """Segments per sequence for a call of sequences `lengths` (tokens), `heads` value heads,
    `v_blocks` V-split programs per head, on `sm_count` SMs. force: the scan runs anyway (a
    context-parallel rank whose first sequence enters from another rank); pick its best cut,
    leaving every sequence whole included."""
    c = COSTS[costs] if isinstance(costs, str) else costs
    if chunk not in c.step_us or chunk not in c.map_step_us or chunk not in c.prep_ns:
        raise ValueError(f"chunk: expected one of {sorted(c.step_us)} (costs {c.name!r}), found {chunk}")
    if align % chunk:
        raise ValueError(f"align: expected a multiple of chunk={chunk}, found {align}")
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths) or heads < 1 or v_blocks < 1 or sm_count < 1:
        raise ValueError(f"plan_segments: expected lengths >= 0, heads, v_blocks, sm_count >= 1; found "
                         f"lengths {lengths[:8]}, heads={heads}, v_blocks={v_blocks}, sm_count={sm_count}")
    progs = heads * v_blocks
    res = c.programs_per_sm

    def recur(chunks, each, mapping=False):
        if mapping:
            return _recur_us(chunks, each, sm_count, res, c.map_step_us[chunk], c.map_step_sm_us[chunk])
        return _recur_us(chunks, each, sm_count, res, c.step_us[chunk], c.step_sm_us[chunk])

    tokens = sum(lengths)
    prep_us = c.prep_ns[chunk] * tokens * heads / 1000.0
    per = align // chunk  # chunks per unit
    seq_chunks = [-(-n // chunk) for n in lengths]
    one = c.call_us + prep_us + recur(seq_chunks, progs)
    base = ScanPlan(tuple([1] * len(lengths)), one, one, "", c.name, c.measured)
    if not lengths or (max(seq_chunks) <= 1 and not force):
        return ScanPlan(base.segments, one, one, "off: no sequence longer than a chunk", c.name, c.measured)

    fixed = 2 * c.call_us + c.copy_ns * tokens * heads / 1000.0 + prep_us * (c.map_prep + c.rerun_prep)
    best, best_us, tried = None, None, []
    targets = [align << i for i in range(64) if (align << i) < 2 * max(lengths)]
    for target in targets + ([1 << 62] if force else []):
        cuts = [_cut(n, target, align, max_segments) for n in lengths]
        if force or any(len(x) > 1 for x in cuts):
            seg_chunks = []
            for n, x in zip(lengths, cuts):
                tail = n - (sum(x) - x[-1]) * align  # the last piece may end mid-unit
                seg_chunks += [u * per for u in x[:-1]] + [-(-tail // chunk)]
            us = (fixed + recur(seg_chunks, c.map_programs * progs, mapping=True)
                  + c.call_us + max(len(x) for x in cuts) * c.compose_us + recur(seg_chunks, progs))
            tried.append((target, us))
            if best_us is None or us < best_us:
                best, best_us = tuple(len(x) for x in cuts), us
    if best is None:
        return ScanPlan(base.segments, one, one, "off: sequences too short to cut", c.name, c.measured)
    if force:
        return ScanPlan(best, one, best_us, f"forced: {best_us:.0f} us modeled (up to {max(best)} segments)", c.name,
                        c.measured, tuple(tried))
    if best_us >= one * (1.0 - margin):
        why = (f"off: the scan models {best_us:.0f} us against {one:.0f} us in one piece "
               f"({progs} programs per sequence, {sm_count} SMs)")
        return ScanPlan(base.segments, one, one, why, c.name, c.measured, tuple(tried))
    why = f"split: {best_us:.0f} us modeled against {one:.0f} us in one piece (up to {max(best)} segments)"
    return ScanPlan(best, one, best_us, why, c.name, c.measured, tuple(tried))
