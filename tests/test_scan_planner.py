"""The scan planner (kdagen/scan/planner.py): where it splits and where it stays off."""

from __future__ import annotations

import pytest

from kdagen.scan.layout import split
from kdagen.scan.planner import COSTS, plan_segments

H200 = dict(v_blocks=4, sm_count=132)


def test_costs_say_whether_they_are_measured():
    # The engine's costs come from an H200 run (scripts/scan_bench.py, named in `source`); the
    # dedicated kernels' are design targets and must never be shown as measured.
    assert COSTS["h200-engine"].measured and "96455e8" in COSTS["h200-engine"].source
    assert not COSTS["h200-kernels"].measured and "not measured" in COSTS["h200-kernels"].source
    p = plan_segments([131072], heads=4, **H200)
    assert p.measured_costs is True and p.costs == "h200-engine"


# The rows of benchmarks/results/2026-12-01_s10_h200_scan_issue17.md: the scan composed of
# kda_prefill calls measured slower than one piece at every segment count on every row
# (block_v as the runtime picked there: 16 at 4 and 8 heads, 32 above); T65536 H8 and H24 and
# T8192 H4 again with step 1 as one twin launch (2026-12-04_s30_h200_twins.md, S = 4, 8, 16).
MEASURED_SLOWER = [([32768], 32), ([65536], 24), ([30000, 7, 1, 64, 999, 3000], 32), ([8192], 4), ([32768], 8),
                   ([65536], 8), ([8192] * 4, 4)]


@pytest.mark.parametrize("lengths,heads", MEASURED_SLOWER)
def test_engine_costs_stay_off_where_the_scan_measured_slower(lengths, heads):
    p = plan_segments(lengths, heads=heads, v_blocks=8 if heads <= 8 else 4, sm_count=132, costs="h200-engine")
    assert not p.split and p.reason.startswith("off"), p.reason


def test_engine_costs_split_where_the_twin_scan_measured_faster():
    # B1 T131072 H4 (block_v 16): slower split in session 10, when step 1 prepped twice; with the
    # twin launch 3.57 / 3.37 / 3.03 ms at S = 4 / 8 / 16 against 4.31 in one piece (session 30).
    p = plan_segments([131072], heads=4, v_blocks=8, sm_count=132, costs="h200-engine")
    assert p.split and 4 <= p.segments[0] <= 16, p


@pytest.mark.parametrize("costs", sorted(COSTS))
@pytest.mark.parametrize("lengths,heads", [
    ([8192], 96),  # many heads: the one-piece recurrence already fills the GPU
    ([8192], 64),
    ([1300, 547, 2048, 963, 271, 3063], 96),
    ([2048], 8),  # short: call overheads outweigh a short chain
    ([64] * 8, 4),  # no sequence longer than one chunk (64 tokens at chunk 64)
    ([15], 1),
])
def test_stays_off_where_it_does_not_pay(costs, lengths, heads):
    p = plan_segments(lengths, heads=heads, costs=costs, chunk=64 if lengths == [64] * 8 else 16, **H200)
    assert not p.split and p.segments == tuple([1] * len(lengths)) and p.reason.startswith("off")
    assert p.scan_us == p.one_piece_us


@pytest.mark.parametrize("lengths,heads", [([131072], 4), ([65536], 8), ([32768], 8), ([1 << 20], 2)])
def test_splits_few_heads_and_long_sequences(lengths, heads):
    p = plan_segments(lengths, heads=heads, costs="h200-kernels", **H200)
    assert p.split and p.reason.startswith("split")
    assert p.scan_us < 0.9 * p.one_piece_us  # the margin
    # the cut the planner rated is the one the layout makes
    cu = [0, lengths[0]]
    assert split(cu, p.segments, 64).counts == p.segments


def test_skewed_varlen_splits_the_long_sequence_only():
    lens = [30000, 7, 1, 64, 999, 3000]
    p = plan_segments(lens, heads=4, costs="h200-kernels", **H200)
    assert p.segments[0] > 1 and p.segments[1:4] == (1, 1, 1)
    assert p.segments[0] >= p.segments[5] >= p.segments[4]


def test_engine_costs_are_more_reluctant_than_kernel_costs():
    # The composed engine repeats the prep twice and copies inputs: it pays for fewer shapes.
    rows = [([32768], 8), ([65536], 8), ([131072], 4), ([1 << 20], 2)]
    eng = [plan_segments(x, heads=h, costs="h200-engine", **H200).split for x, h in rows]
    ker = [plan_segments(x, heads=h, costs="h200-kernels", **H200).split for x, h in rows]
    assert all(ker) and sum(eng) < sum(ker)
    # the kernels' targets: a clear gain where one piece leaves most SMs idle
    p = plan_segments([131072], heads=4, v_blocks=8, sm_count=132, costs="h200-kernels")
    assert p.split and p.scan_us < 0.5 * p.one_piece_us


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
