"""The correction kernel of the scan's mode "correct" (kdagen/scan/correct.py) against float64
products: on the Triton interpreter here, on the GPU with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from kdagen.reference import rel_rmse
from kdagen.scan.correct import CONFIG, correct_cs_triton, correct_o_triton

from .conftest import HAS_CUDA

BT = CONFIG[0]

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="interpreter runs only without a GPU"), id="cpu"),
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
]

# Segments: a skipped one (its state applied in step 1), one over several tiles ending mid-tile,
# an empty one, one shorter than a tile.
BOUNDS = [0, 5, 5 + 2 * BT + 3, 5 + 2 * BT + 3, 5 + 2 * BT + 3 + 17]
SKIP = [True, False, False, False]


def problem(dtype, dev, HV=2, K=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    oB, oA = (torch.randn(1, BOUNDS[-1], HV, K, generator=gen).to(dtype).to(dev) for _ in range(2))
    S_in = torch.randn(len(BOUNDS) - 1, HV, K, K, generator=gen).to(dev)
    return oB, oA, S_in


def float64_correction(oB, oA, S_in, skip):
    o = oB.double().cpu().clone()
    oA, S = oA.double().cpu(), S_in.double().cpu()
    for s, (a, b) in enumerate(zip(BOUNDS, BOUNDS[1:])):
        if not skip[s]:
            o[0, a:b] += torch.einsum("thk,hvk->thv", oA[0, a:b], S[s])
    return o


# The default launch, and one whose programs split a segment's tokens and V (several runs and V
# blocks per segment and head).
LAUNCHES = [pytest.param(None, id="default"), pytest.param((16, 32, 16, 2, 1), id="small")]


@pytest.mark.parametrize("config", LAUNCHES)
@pytest.mark.parametrize("dev", DEVICES)
def test_fp32_matches_float64(dev, config):
    oB, oA, S_in = problem(torch.float32, dev)
    o = correct_o_triton(oB, oA, S_in, BOUNDS, SKIP, config=config)
    ref = float64_correction(oB, oA, S_in, SKIP)
    assert o.dtype == torch.float32 and o.shape == (1, BOUNDS[-1], 2, 32)
    assert rel_rmse(o.cpu(), ref) < 1e-6
    # The comparison can fail: segment 0 corrected although its state was applied.
    assert rel_rmse(o.cpu(), float64_correction(oB, oA, S_in, [False] + SKIP[1:])) > 1e-2


@pytest.mark.parametrize("dev", DEVICES)
def test_halves_of_the_twin_launch_are_read_in_place(dev):
    # The twin launch's o is [1, T, 2 HV, V]: o_B and o_A are its head halves (token stride 2 HV V),
    # read without copies; the result is contiguous.
    oB, oA, S_in = problem(torch.float32, dev, seed=1)
    o2 = torch.cat([oB, oA], dim=2)
    hB, hA = o2[:, :, :2], o2[:, :, 2:]
    o = correct_o_triton(hB, hA, S_in, BOUNDS, SKIP, config=LAUNCHES[1].values[0])
    assert o.is_contiguous() and hB.stride(1) == 4 * 32
    assert rel_rmse(o.cpu(), float64_correction(oB, oA, S_in, SKIP)) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("config", LAUNCHES)
def test_bf16_on_gpu_adds_little_to_the_rounding_of_o(config):
    # bf16 o_B and o_A, TF32 products (S_in rounded to 2^-11, o_A exact in TF32): the error against
    # float64 stays within a tenth above what rounding the exact o to bf16 costs by itself.
    oB, oA, S_in = problem(torch.bfloat16, "cuda", HV=4, K=128)
    o = correct_o_triton(oB, oA, S_in, BOUNDS, SKIP, config=config)
    ref = float64_correction(oB, oA, S_in, SKIP)
    assert o.dtype == torch.bfloat16
    floor = rel_rmse(ref.to(torch.bfloat16).double(), ref)
    assert rel_rmse(o.cpu().double(), ref) < 1.1 * floor, (rel_rmse(o.cpu().double(), ref), floor)


def test_shapes_are_named():
    oB, oA, S_in = problem(torch.float32, "cuda" if HAS_CUDA else "cpu")
    with pytest.raises(ValueError, match="expected oB and oA \\[1, T, 2, 32\\] of one dtype, bounds of 4 segments"):
        correct_o_triton(oB[:, :-1], oA[:, :-1], S_in, BOUNDS, SKIP)
    with pytest.raises(ValueError, match="found oB .* oA \\(1, 153, 2, 32\\) torch.float64"):
        correct_o_triton(oB, oA.double(), S_in, BOUNDS, SKIP)
    with pytest.raises(ValueError, match="needs V = K a power of two"):
        correct_o_triton(oB[..., :24], oA[..., :24], S_in[..., :24], BOUNDS, SKIP)


# Chunk-state rows per segment, as the scan packs them (a row per kept chunk, segments in order):
# a skipped segment, one of three rows, an empty one, one of one row.
ROWS = [0, 2, 5, 5, 6]


def cs_problem(dev, HV=2, K=32, seed=2):
    gen = torch.Generator().manual_seed(seed)
    R, S = ROWS[-1], len(ROWS) - 1
    both = torch.randn(R, 2 * HV, K, K, generator=gen).to(dev)  # the twin run's rows: B_c heads, then A_c's
    S_in = torch.randn(S, HV, K, K, generator=gen).to(dev) * K ** -0.5
    return both[:, :HV], both[:, HV:], S_in


def float64_cs(cB, cA, S_in, skip):
    cs = cB.double().cpu().clone()
    A, S = cA.double().cpu(), S_in.double().cpu()
    for s, (a, b) in enumerate(zip(ROWS, ROWS[1:])):
        if not skip[s]:
            cs[a:b] += torch.einsum("hvk,rhkj->rhvj", S[s], A[a:b])
    return cs


@pytest.mark.parametrize("K", [32, 64])  # 64: several [BK, BJ] = [32, 32] tiles per row
@pytest.mark.parametrize("dev", DEVICES)
def test_chunk_states_match_float64(dev, K):
    # B_c and A_c are the head halves of the twin run's rows, read in place (row stride 2 HV K K)
    cB, cA, S_in = cs_problem(dev, K=K)
    assert not cB.is_contiguous()
    cs = correct_cs_triton(cB, cA, S_in, ROWS, SKIP)
    assert cs.dtype == torch.float32 and cs.shape == (ROWS[-1], 2, K, K) and cs.is_contiguous()
    assert rel_rmse(cs.cpu(), float64_cs(cB, cA, S_in, SKIP)) < 1e-6
    # The comparison can fail: segment 0's rows corrected although its state was applied, or
    # segment 1's rows given segment 3's state.
    assert rel_rmse(cs.cpu(), float64_cs(cB, cA, S_in, [False] + SKIP[1:])) > 1e-2
    swapped = torch.stack([S_in[0], S_in[3], S_in[2], S_in[1]])
    assert rel_rmse(cs.cpu(), float64_cs(cB, cA, swapped, SKIP)) > 1e-2


def test_chunk_state_shapes_are_named():
    cB, cA, S_in = cs_problem("cuda" if HAS_CUDA else "cpu")
    with pytest.raises(ValueError, match="expected 2 heads, 5 first rows from 0 to 6 and 4 skip flags"):
        correct_cs_triton(cB, cA, S_in, ROWS[:-1] + [7], SKIP)
    with pytest.raises(ValueError, match="needs fp32 \\[R, HV, K, K\\] with contiguous matrices"):
        correct_cs_triton(cB, cA.double(), S_in, ROWS, SKIP)
