"""Whether to split a call's sequences into scan segments, and into how many (host arithmetic only).

A cost model of one GPU, per scan mode (kdagen.scan.engine):

    one piece = recur(sequence chunks, HV * v_blocks blocks each)
                + the prep: hidden behind the recurrence but for a rest where the sm80 launcher
                  overlaps them (one sequence or a batch, few blocks, long), else whole
    "correct" = fixed + prep + step 1 + chain + correction pass
    "rerun"   = fixed + prep * (1 + rerun_prep) + step 1 + chain + recur(segment chunks)
    step 1    = recur(segment chunks, 2 HV * v_blocks twin blocks each) where the variant has the
                twin launch; else two calls, each a prep and a recurrence

A recurrence launch is priced by its busiest SM: its blocks run in rounds of at most R resident,
and a round of c blocks takes (lone + c) units of one block's chunk-step time per step (the
model kdagen.cp uses for a rank's piece; it fits the H200 within a few percent from 1 to 8
blocks per SM). R and the block_v the scan's calls select come from the runtime where the caller
can ask it (`launch_of`), else from the cost set's defaults.

Segments are whole `align`-token units; every sequence is cut into pieces of about one target
length (long ones into many, short ones left whole), and the target is the one the model rates
fastest. The scan is chosen only when it beats one piece by `margin`: a wrong split costs up to
3x the work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence, Union

from .layout import balanced

__all__ = ["ScanCosts", "ScanLaunch", "ScanPlan", "COSTS", "plan_segments", "one_piece_us", "scan_us", "even_cut",
           "rounds_cost", "recur_us", "hidden_prep_us", "OVERLAP_MIN_HIDDEN_US"]

MODES = ("rerun", "correct")


@dataclass(frozen=True)
class ScanCosts:
    """Costs of the scan's pieces on one GPU. Times in microseconds unless named _ns."""

    name: str
    measured: bool  # False: placeholders (see `source`); never present them as measurements
    source: str
    unit_us: dict[int, dict[int, float]]  # chunk -> block_v -> one block's chunk step in a round slot
    lone: float  # a round of c blocks per SM takes (lone + c) units a step
    prep_ns: dict[int, float]  # kda_prep alone per token and head, whole GPU, by chunk
    rerun_prep: float  # step 3's prep in units of step 1's (0: step 1's workspace reused)
    correct_ns: float  # mode "correct"'s o pass, per token and head
    chain_us: float  # the chain, per segment of the most-cut sequence ...
    chain_head_us: float  # ... plus this per segment and value head
    scan_fixed_us: float  # the scan's host work and launch gaps besides its kernels
    call_us: float  # host and launch cost of a plain one-piece call
    overlap_us: float  # an overlapped one-piece call's cost besides its recurrence ...
    overlap_prep_ns: float  # ... plus this per token and head (the prep its overlap leaves exposed)
    resident: int = 3  # kda_recur blocks per SM where the runtime cannot say
    resident_twins: int = 3  # kda_recur_twins blocks per SM where the runtime cannot say
    scan_block_v: int = 32  # block_v of the scan's calls where the runtime cannot say


@dataclass(frozen=True)
class ScanLaunch:
    """What the scan's calls at one cut would launch (kdagen.scan.engine asks the runtime)."""

    block_v: int
    resident: int  # kda_recur blocks per SM
    resident_twins: int  # kda_recur_twins blocks per SM; 0: no twin launch (step 1 is two calls)


# launch_of(segments per sequence) -> ScanLaunch; None: not known (the cost set's defaults);
# False: that cut has no launch the model prices (another target): the cut is skipped.
LaunchOf = Callable[[tuple[int, ...]], Union[ScanLaunch, None, bool]]

# Measured on the H200, chunk 16, K = V = 128, bf16 (scripts/scan_bench.py --modes rerun,correct
# --kernels; benchmarks/results/2026-12-04_s32_h200_scan_planner.md, tree 7d66a0e, and
# 2026-12-04_s33_h200_scan_host.md, tree c5abcf2):
# - unit_us: kda_recur_twins and kda_recur at 1-8 blocks per SM (R = 3) fit rounds of
#   (1.4 + c) x 0.23 us at block_v 32 (T32768-1M, H4-H32) and x 0.163-0.171 at block_v 16;
#   other block_v are interpolated. Chunk 64 is not measured since session 10 (1.8 us a lone
#   step and 2.7 ns of prep a token and head then): estimates.
# - prep_ns 0.8 (kda_prep alone, 0.79-0.81 over T65536 H24 to T1M H8); correct_ns 0.26 (0.24-0.28);
#   chain 7.5 us + 0.18 us a head per segment (8.7 at H8, 10.4 at H32, 25 at H96).
# - scan_fixed_us: the scan's wall time beyond its kernels, 0.22-0.31 ms on most sm80 rows at
#   6 or 8 segments since the bound twin launch and cached offsets (0.9-1.0 ms before).
# - one piece: the overlapped call's time beyond its recurrence is 0.23 ms at T8192 H4, 0.53-0.59
#   at 256K-512K token-heads, 0.9 at T65536 H24, 1.45 ms at T512K H8 and 3.8 at T1M H8:
#   0.2 ms + 0.35 ns a token and head, low on the middle rows (the planner then splits less).
#   Session 34 (segmented bound launch, time segments only where OVERLAP_MIN_HIDDEN_US of prep
#   can hide): the overlapped call is its recurrence + 0.12 ms + 0.3 ns a token-head, the plain one
#   piece (bound launch) its recurrence + 25 us + its prep: within 0.97-1.06 of 14 one-piece rows
#   from T8192 H4 to T1M H8 (tests/test_scan_planner.py).
# Model against measurement at c5abcf2, 116 sm80 cells of both modes: the 72 at T >= 32768 within
# 0.86-1.05 of it; host-bound rows (T2048, T8192) run up to 2.5x the model (the scan stays off there).
_H200_ENGINE = ScanCosts(
    name="h200-engine",
    measured=True,
    source="H200, trees 7d66a0e and c5abcf2 (benchmarks/results/2026-12-04_s32_h200_scan_planner.md, "
           "2026-12-04_s33_h200_scan_host.md; one piece: 2026-12-04_s34_h200_segments.md): the scan composed "
           "of kda_prefill calls, step 1 one twin launch; "
           "chunk 64 estimated",
    unit_us={16: {16: 0.17, 32: 0.23}, 64: {32: 0.75}},
    lone=1.4,
    prep_ns={16: 0.8, 64: 2.7},
    rerun_prep=1.0,
    correct_ns=0.26,
    chain_us=7.5,
    chain_head_us=0.18,
    scan_fixed_us=300.0,
    call_us=25.0,
    overlap_us=120.0,
    overlap_prep_ns=0.3,
)
# What dedicated kernels are to deliver (design targets, unmeasured): step 1 builds B and A in
# one program set without o and shares its prep workspace with step 3; several programs per SM
# overlap (a third of the SM time a step), a lone step as fast as today's; little host work.
_H200_KERNELS = replace(
    _H200_ENGINE,
    name="h200-kernels",
    measured=False,
    source="design targets for dedicated scan kernels (prep once, overlapping programs, little host work), "
           "not measured",
    unit_us={16: {16: 0.17 / 3, 32: 0.23 / 3}, 64: {32: 0.25}},
    lone=3 * 1.4 + 2,  # (lone + 1) x unit: a lone step unchanged
    rerun_prep=0.0,
    scan_fixed_us=100.0,
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
    mode: str = "rerun"

    @property
    def split(self) -> bool:
        return any(s > 1 for s in self.segments)


def rounds_cost(per_sm: int, resident: int, lone: float) -> float:
    """Units a step of the busiest SM takes with `per_sm` blocks, in rounds of at most `resident`."""
    full, rest = divmod(max(per_sm, 0), resident)
    return full * (lone + resident) + (lone + rest if rest else 0.0)


def recur_us(items: Sequence[tuple[int, int]], sm_count: int, resident: int, unit: float, lone: float) -> float:
    """A recurrence launch over items (chunks, blocks): the longest chain at its busiest SM's
    rounds. Blocks count by their length against the longest (exact for equal lengths)."""
    items = [(c, b) for c, b in items if c > 0 and b > 0]
    if not items:
        return 0.0
    longest = max(c for c, _ in items)
    blocks = sum(c * b for c, b in items) / longest
    return longest * unit * rounds_cost(max(1, math.ceil(blocks / sm_count - 1e-9)), resident, lone)


def _unit(c: ScanCosts, chunk: int, block_v: int) -> float:
    """One block's chunk step at block_v: the table's, else interpolated linearly in block_v
    (scaled from chunk 16's slope where the chunk has one entry)."""
    tab = c.unit_us[chunk]
    if block_v in tab:
        return tab[block_v]
    ref = tab if len(tab) >= 2 else c.unit_us[16]
    (x0, y0), (x1, y1) = sorted(ref.items())[:2]
    y = y0 + (y1 - y0) * (block_v - x0) / (x1 - x0)
    if ref is not tab:  # chunk 16's line through chunk `chunk`'s one point
        (xb, yb), = tab.items()
        y *= yb / (y0 + (y1 - y0) * (xb - x0) / (x1 - x0))
    return max(y, 1e-3)


def _units(n: int, align: int) -> int:
    return -(-n // align)


def _costs(costs: ScanCosts | str, chunk: int, align: int, mode: str) -> ScanCosts:
    c = COSTS[costs] if isinstance(costs, str) else costs
    if chunk not in c.unit_us or chunk not in c.prep_ns:
        raise ValueError(f"chunk: expected one of {sorted(c.unit_us)} (costs {c.name!r}), found {chunk}")
    if align % chunk:
        raise ValueError(f"align: expected a multiple of chunk={chunk}, found {align}")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, found {mode!r}")
    return c


# sm80's time segments have a fixed cost (host work, launch gaps): they run only where the prep
# they can hide is worth at least this much (Sm80Settings.min_hidden_prep_us). H200, session 34,
# with the segmented bound launch: they won at T32768 H4 (80 us hideable, +3%) and H8 (108, +10%),
# tied at T16384 H4 (40) and T65536 H16 (25), lost 5% at T8192 H4 (20).
OVERLAP_MIN_HIDDEN_US = 60.0


def hidden_prep_us(token_heads: int, programs: int, sm_count: int, chunk: int = 16,
                   costs: ScanCosts | str = "h200-engine") -> float:
    """The prep time that sm80's time segments can hide behind a recurrence of `programs` blocks:
    the prep's share on the SMs those blocks leave free."""
    c = COSTS[costs] if isinstance(costs, str) else costs
    free = max(0.0, 1.0 - programs / max(sm_count, 1))
    return c.prep_ns.get(chunk, c.prep_ns[16]) * token_heads / 1000.0 * free


def one_piece_us(lengths: Sequence[int], *, heads: int, v_blocks: int, sm_count: int, chunk: int = 16,
                 costs: ScanCosts | str = "h200-engine", head_v: int = 128, varlen: bool = True) -> float:
    """Modeled time of the one-piece call (see the module's docstring)."""
    c = _costs(costs, chunk, chunk, "rerun")
    token_heads = sum(lengths) * heads
    progs = heads * v_blocks
    recur = recur_us([(-(-n // chunk), progs) for n in lengths], sm_count, c.resident,
                     _unit(c, chunk, max(1, head_v // v_blocks)), c.lone)
    # sm80's time segmentation (Sm80Settings): one launch of B sequences (no cu_seqlens, or one
    # varlen sequence), fewer blocks than SMs, sequences of at least 2 x 4096 tokens, enough prep
    # to hide
    if ((not varlen or len(lengths) == 1) and progs * len(lengths) < sm_count and max(lengths, default=0) >= 8192
            and hidden_prep_us(token_heads, progs * len(lengths), sm_count, chunk, c) >= OVERLAP_MIN_HIDDEN_US):
        return recur + c.overlap_us + c.overlap_prep_ns * token_heads / 1000.0
    return recur + c.call_us + c.prep_ns[chunk] * token_heads / 1000.0


def scan_us(lengths: Sequence[int], cuts: Sequence[Sequence[int]], *, heads: int, sm_count: int,
            chunk: int = 16, costs: ScanCosts | str = "h200-engine", align: int = 64, mode: str = "rerun",
            head_v: int = 128, launch: Optional[ScanLaunch] = None) -> float:
    """Modeled time of the scan over `lengths` cut into `cuts` (per sequence, its segments'
    lengths in `align`-token units), in `mode`, launching `launch` (default: the cost set's)."""
    c = _costs(costs, chunk, align, mode)
    launch = launch or ScanLaunch(c.scan_block_v, c.resident, c.resident_twins)
    token_heads = sum(lengths) * heads
    prep = c.prep_ns[chunk] * token_heads / 1000.0
    per = align // chunk  # chunks per unit
    seg_chunks = []
    for n, x in zip(lengths, cuts):
        tail = n - (sum(x) - x[-1]) * align  # the last piece may end mid-unit
        seg_chunks += [u * per for u in x[:-1]] + [-(-tail // chunk)]
    vb = max(1, head_v // launch.block_v)
    unit = _unit(c, chunk, launch.block_v)
    plain = recur_us([(n, heads * vb) for n in seg_chunks], sm_count, launch.resident, unit, c.lone)
    if launch.resident_twins > 0:
        step1 = recur_us([(n, 2 * heads * vb) for n in seg_chunks], sm_count, launch.resident_twins, unit, c.lone)
    else:
        step1 = prep + 2 * plain  # two calls: a second prep (the first is counted below) and two recurrences
    chain = max(len(x) for x in cuts) * (c.chain_us + c.chain_head_us * heads)
    us = c.scan_fixed_us + prep + step1 + chain
    return us + (c.correct_ns * token_heads / 1000.0 if mode == "correct" else prep * c.rerun_prep + plain)


def even_cut(length: int, segments: int, align: int = 64) -> list[int]:
    """A sequence of `length` tokens cut into `segments` near-equal pieces of whole units, as
    kdagen.scan.layout.split cuts it."""
    units = _units(length, align)
    return balanced(units, max(1, min(segments, units)))


def _cut(length: int, target: int, align: int, max_segments: int) -> list[int]:
    """Unit counts of a sequence cut into pieces of about `target` tokens."""
    return even_cut(length, max(1, min(max_segments, -(-length // target))) if length else 1, align)


def plan_segments(lengths: Sequence[int], *, heads: int, v_blocks: int, sm_count: int, chunk: int = 16,
                  costs: ScanCosts | str = "h200-engine", align: int = 64, max_segments: int = 64,
                  margin: float = 0.1, force: bool = False, mode: str = "rerun", head_v: int = 128,
                  varlen: bool = True, launch_of: Optional[LaunchOf] = None) -> ScanPlan:
    """Segments per sequence for a call of sequences `lengths` (tokens), `heads` value heads of
    `head_v` columns, `v_blocks` V-split blocks per head in the one-piece call, on `sm_count`
    SMs, for scan mode `mode`. varlen: the one-piece call has cu_seqlens (the sm80 launcher
    overlaps prep and recurrence only without, or for a single sequence). launch_of: what the
    scan's calls would launch at a cut (see LaunchOf). force: the scan runs anyway (a context-parallel rank whose first
    sequence enters from another rank); pick its best cut, leaving every sequence whole
    included."""
    c = _costs(costs, chunk, align, mode)
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths) or heads < 1 or v_blocks < 1 or sm_count < 1 or head_v < v_blocks:
        raise ValueError(f"plan_segments: expected lengths >= 0, heads, v_blocks, sm_count >= 1 and head_v >= "
                         f"v_blocks; found lengths {lengths[:8]}, heads={heads}, v_blocks={v_blocks}, "
                         f"sm_count={sm_count}, head_v={head_v}")
    one = one_piece_us(lengths, heads=heads, v_blocks=v_blocks, sm_count=sm_count, chunk=chunk, costs=c,
                       head_v=head_v, varlen=varlen)
    base = ScanPlan(tuple([1] * len(lengths)), one, one, "", c.name, c.measured, mode=mode)
    if not lengths or (max(-(-n // chunk) for n in lengths) <= 1 and not force):
        return replace(base, reason="off: no sequence longer than a chunk")

    tried, cut_of = [], {}
    # target lengths of align x 2^i and 1.5 x that: counts like 6 and 12, which fill whole rounds
    # of blocks where powers of two leave a round part-empty
    targets = sorted({t for i in range(64) for t in (align << i, (3 * align << i) // 2) if t < 2 * max(lengths)})
    for target in targets + ([1 << 62] if force else []):
        cuts = [_cut(n, target, align, max_segments) for n in lengths]
        if not (force or any(len(x) > 1 for x in cuts)):
            continue
        launch = launch_of(tuple(len(x) for x in cuts)) if launch_of is not None else None
        if launch is False:
            continue
        us = scan_us(lengths, cuts, heads=heads, sm_count=sm_count, chunk=chunk, costs=c, align=align, mode=mode,
                     head_v=head_v, launch=launch)
        tried.append((target, us))
        cut_of[target] = tuple(len(x) for x in cuts)
    if not tried:
        return replace(base, reason="off: no cut to price (sequences too short, or no launch the model prices)")
    # the fewest segments within 2% of the fastest: the model is not finer than that, and fewer
    # segments mean less chain and less doubled work where it is wrong
    fastest = min(us for _, us in tried)
    target, best_us = min(((t, us) for t, us in tried if us <= fastest * 1.02), key=lambda x: (max(cut_of[x[0]]), x[1]))
    best = cut_of[target]
    if force:
        return replace(base, segments=best, scan_us=best_us, candidates=tuple(tried),
                       reason=f"forced: {best_us:.0f} us modeled (up to {max(best)} segments)")
    if best_us >= one * (1.0 - margin):
        why = (f"off: the scan ({mode}) models {best_us:.0f} us against {one:.0f} us in one piece "
               f"({heads * v_blocks} blocks per sequence, {sm_count} SMs)")
        return replace(base, reason=why, candidates=tuple(tried))
    why = f"split: {best_us:.0f} us modeled ({mode}) against {one:.0f} us in one piece (up to {max(best)} segments)"
    return replace(base, segments=best, scan_us=best_us, reason=why, candidates=tuple(tried))
