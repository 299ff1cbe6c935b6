"""The scan planner (kdagen/scan/planner.py): its model against the H200, where it splits and
where it stays off, per scan mode."""

from __future__ import annotations

import pytest

from kdagen.scan.layout import split
from kdagen.scan.planner import COSTS, ScanLaunch, even_cut, one_piece_us, plan_segments, recur_us, scan_us

H200 = dict(v_blocks=4, sm_count=132)


def test_costs_say_whether_they_are_measured():
    # The engine's costs come from an H200 run (scripts/scan_bench.py, named in `source`); the
    # dedicated kernels' are design targets and must never be shown as measured.
    assert COSTS["h200-engine"].measured and "c5abcf2" in COSTS["h200-engine"].source
    assert not COSTS["h200-kernels"].measured and "not measured" in COSTS["h200-kernels"].source
    p = plan_segments([131072], heads=4, **H200)
    assert p.measured_costs is True and p.costs == "h200-engine"


# The H200 at tree c5abcf2 (benchmarks/results/2026-12-04_s33_h200_scan_host.md; scan_bench
# --modes rerun,correct --kernels): (T, heads, mode, segments, block_v the scan's calls selected,
# measured ms of the whole scan), sm80 rows only (the twin launch). R = 3 for both recurrences.
MEASURED_SCANS = [
    (1 << 20, 8, "correct", 6, 32, 21.289), (1 << 20, 8, "correct", 8, 32, 21.821),
    (1 << 20, 8, "correct", 2, 16, 26.834), (1 << 20, 8, "rerun", 6, 32, 33.813),
    (1 << 20, 8, "rerun", 32, 32, 31.675), (1 << 19, 8, "rerun", 4, 32, 17.535),
    (131072, 4, "correct", 8, 32, 1.739), (131072, 4, "rerun", 8, 32, 2.486), (131072, 4, "rerun", 4, 16, 3.119),
    (65536, 8, "correct", 4, 32, 1.788), (65536, 24, "correct", 2, 32, 4.259), (65536, 24, "rerun", 12, 32, 6.213),
    (32768, 8, "correct", 6, 32, 0.940), (32768, 8, "rerun", 8, 32, 1.532),
    (32768, 32, "correct", 8, 32, 2.869), (32768, 32, "rerun", 16, 32, 4.204),
]


@pytest.mark.parametrize("T,heads,mode,S,bv,ms", MEASURED_SCANS)
def test_scan_model_is_within_16_percent_of_the_h200(T, heads, mode, S, bv, ms):
    us = scan_us([T], [even_cut(T, S)], heads=heads, sm_count=132, mode=mode, launch=ScanLaunch(bv, 3, 3))
    assert 0.84 < us / 1000 / ms < 1.16, (us / 1000, ms)


# The one-piece call: (T, heads, block_v the runtime picked, measured ms). Session 34 (d7c15e2, the
# segmented bound launch; benchmarks/results/2026-12-04_s34_h200_segments.md): time segments where
# the launcher now cuts them, else one piece; T1M H8 and T32768 H16 at 230c7d6, T512K H8 at c5abcf2.
MEASURED_ONE = [(1 << 20, 8, 16, 29.121), (1 << 19, 8, 16, 14.821), (262144, 4, 16, 6.996), (131072, 4, 16, 3.584),
                (131072, 8, 16, 3.775), (65536, 24, 32, 2.954), (65536, 16, 16, 2.561), (65536, 8, 16, 2.004),
                (65536, 4, 16, 1.842), (32768, 16, 16, 1.273), (32768, 8, 16, 0.982), (32768, 4, 16, 0.944),
                (16384, 4, 16, 0.505), (8192, 4, 16, 0.263)]


@pytest.mark.parametrize("T,heads,bv,ms", MEASURED_ONE)
def test_one_piece_model_is_close_to_the_h200(T, heads, bv, ms):
    us = one_piece_us([T], heads=heads, v_blocks=128 // bv, sm_count=132, varlen=False)
    assert 0.8 < us / 1000 / ms < 1.1, (us / 1000, ms)  # low rather than high: the planner splits less


def test_rounds_reproduce_the_twin_recurrence():
    # kda_recur_twins alone (profiler), block_v 32, R = 3: one round of 3 blocks per SM at T1M H8
    # S = 6 (11.05 ms), two rounds (3 + 1) at S = 8 (12.84 ms), a round of 2 at T131072 H4 S = 8 (0.797).
    u = COSTS["h200-engine"].unit_us[16][32]
    for T, heads, S, ms in ((1 << 20, 8, 6, 11.05), (1 << 20, 8, 8, 12.84), (131072, 4, 8, 0.797)):
        got = recur_us([(T // S // 16, 2 * heads * 4)] * S, 132, 3, u, 1.4) / 1000
        assert abs(got / ms - 1) < 0.04, (T, S, got, ms)


# Best measured sm80 scan (c5abcf2, skew H32 at 7d66a0e) against one piece (session 34's, where the
# launcher's time segments changed it; else c5abcf2's). Split where the best cut beat one piece by
# over 20%, whole where no cut beat it; rows between are left to the margin (T65536 H8 and T32768
# H8 "correct": 1.79 against 2.10, 0.94 against 1.08).
DECISIONS = [
    ([1 << 20], 8, 8, "correct", True),  # 21.24 against 29.31
    ([1 << 20], 8, 8, "rerun", False),  # 31.68
    ([1 << 19], 8, 8, "rerun", False),  # 15.26 against 14.82
    ([1 << 19], 8, 8, "correct", True),  # 10.10
    ([131072], 4, 8, "correct", True),  # 1.74 against 3.71
    ([131072], 4, 8, "rerun", True),  # 2.49
    ([65536], 8, 8, "rerun", False),  # 2.45 against 2.10
    ([65536], 24, 4, "correct", False),  # 4.11 against 3.08
    ([65536], 24, 4, "rerun", False),
    ([8192], 4, 8, "correct", False),  # 0.45 against 0.26
    ([8192], 4, 8, "rerun", False),  # 0.48
    ([32768], 32, 4, "correct", False),  # 2.87 against 2.07
    ([8192] * 4, 4, 8, "correct", False),  # 0.69 against 0.37
    ([2048], 8, 8, "correct", False),  # 0.45 against 0.11
    ([8192], 96, 2, "correct", False),  # 2.31 against 1.02
    ([30000, 7, 1, 64, 999, 3000], 32, 4, "correct", False),  # 4.18 against 3.01 (7d66a0e)
]


@pytest.mark.parametrize("lengths,heads,vb,mode,split_measured", DECISIONS)
def test_engine_costs_split_where_the_h200_measured_the_scan_faster(lengths, heads, vb, mode, split_measured):
    p = plan_segments(lengths, heads=heads, v_blocks=vb, sm_count=132, mode=mode, varlen=len(lengths) > 1)
    assert p.split == split_measured, p.reason
    assert p.reason.startswith("split" if split_measured else "off")


def test_correct_mode_picks_whole_rounds_of_blocks():
    # T1M H8 in mode "correct": 6 segments (384 twin blocks, one round of 3 per SM) measured
    # 21.29 ms; 8 (a second round a third full) 21.82 (20.76 and 22.65 at 7d66a0e). Powers of
    # two alone could not pick 6.
    p = plan_segments([1 << 20], heads=8, v_blocks=8, sm_count=132, mode="correct", varlen=False)
    assert p.segments == (6,) and p.scan_us < 0.75 * p.one_piece_us, p


def test_runtime_launch_changes_the_price_and_unpriced_cuts_are_skipped():
    seen = []

    def launch_of(counts):
        seen.append(counts)
        return False if counts[0] % 2 else ScanLaunch(32, 3, 0)  # no twin launch: step 1 as two calls

    kw = dict(heads=8, v_blocks=8, sm_count=132, mode="correct", varlen=False, force=True)
    twins = plan_segments([1 << 20], **kw)
    two = plan_segments([1 << 20], **kw, launch_of=launch_of)
    assert seen and two.segments[0] % 2 == 0 and len(two.candidates) < len(twins.candidates)
    assert two.scan_us > twins.scan_us + 5000  # a second prep and a second recurrence
    # without the twin launch the scan no longer pays at T1M H8 (step 1 is two whole calls)
    assert not plan_segments([1 << 20], **dict(kw, force=False), launch_of=launch_of).split
    assert plan_segments([1 << 20], heads=8, v_blocks=8, sm_count=132, launch_of=lambda c: False).reason.startswith(
        "off: no cut to price")


@pytest.mark.parametrize("costs", sorted(COSTS))
@pytest.mark.parametrize("mode", ["rerun", "correct"])
@pytest.mark.parametrize("lengths,heads", [
    ([8192], 96),  # many heads: the one-piece recurrence already fills the GPU
    ([8192], 64),
    ([1300, 547, 2048, 963, 271, 3063], 96),
    ([2048], 8),  # short: call overheads outweigh a short chain
    ([64] * 8, 4),  # no sequence longer than one chunk (64 tokens at chunk 64)
    ([15], 1),
])
def test_stays_off_where_it_does_not_pay(costs, mode, lengths, heads):
    p = plan_segments(lengths, heads=heads, costs=costs, mode=mode, chunk=64 if lengths == [64] * 8 else 16, **H200)
    assert not p.split and p.segments == tuple([1] * len(lengths)) and p.reason.startswith("off")
    assert p.scan_us == p.one_piece_us


@pytest.mark.parametrize("lengths,heads", [([131072], 4), ([65536], 8), ([32768], 8), ([1 << 20], 2)])
def test_kernel_targets_split_few_heads_and_long_sequences(lengths, heads):
    p = plan_segments(lengths, heads=heads, costs="h200-kernels", **H200)
    assert p.split and p.reason.startswith("split")
    assert p.scan_us < 0.9 * p.one_piece_us  # the margin
    # the cut the planner rated is the one the layout makes
    cu = [0, lengths[0]]
    assert split(cu, p.segments, 64).counts == p.segments


def test_skewed_varlen_splits_the_long_sequence_only():
    lens = [300000, 7, 1, 64, 999, 3000]
    p = plan_segments(lens, heads=4, costs="h200-kernels", **H200)
    assert p.segments[0] > 1 and p.segments[1:4] == (1, 1, 1)
    assert p.segments[0] >= p.segments[5] >= p.segments[4]


def test_force_picks_a_cut_even_when_off():
    off = plan_segments([4096], heads=64, **H200)
    assert not off.split
    forced = plan_segments([4096], heads=64, force=True, **H200)
    assert forced.reason.startswith("forced") and len(forced.segments) == 1
    assert plan_segments([0], heads=1, force=True, **H200).segments == (1,)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="chunk: expected one of \\[16, 64\\]"):
        plan_segments([100], heads=1, chunk=32, **H200)
    with pytest.raises(ValueError, match="align: expected a multiple of chunk=64"):
        plan_segments([100], heads=1, chunk=64, align=16, **H200)
    with pytest.raises(ValueError, match="heads, v_blocks, sm_count >= 1"):
        plan_segments([100], heads=0, **H200)
    with pytest.raises(ValueError, match="mode: expected one of"):
        plan_segments([100], heads=1, mode="fast", **H200)
