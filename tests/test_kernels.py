"""Every kernel variant against the float64 reference, through kda_prefill and the one case
harness (kdagen.cases), the same cases on every target.

GPU (`pytest -m gpu`): every registered variant of the kernel targets (sm80, Triton, ...: every
shipped spec) runs every case. CPU: the Triton interpreter runs the shape cases on every Triton
variant of specs/ci.yaml and each path case on the variants that reach its code (a chunk-16 and
a chunk-64 variant, plus the gate forms and head dims the path concerns), so that CI stays fast.
Test ids carry the variant's canonical name, the case and the device.
"""

from __future__ import annotations

import math

import pytest
import torch

from kdagen import kda_prefill
from kdagen.errors import KdaInputError
from kdagen.cases import (GATE_SCENARIOS, PATHS, check_chunk_stride, errors, make_case, path_case, path_reason, path_tolerance,
                          run_and_compare, run_poisoned, tolerances)
from kdagen.paths import GENERATED_DIR
from kdagen.registry import Registry
from kdagen.select import device_reason
from kdagen.variant import Variant

from .conftest import HAS_CUDA

# The checkout's specs only (as in every module that parametrizes over variants): Registry.load()
# adds the user's cache, whose on-demand variants would make the test ids depend on past runs.
REGISTRY = Registry.load(GENERATED_DIR)
# Targets whose variants this module runs; the Ascend kernel and its Triton twin have their own
# tests (tests/test_ascend.py: the twin's stage decomposition and limits), and so has sm90 while it
# is in development (tests/test_sm90.py, the same harness; add it here once GPU-validated).
KERNEL_TARGETS = ("sm80", "triton")
GPU_VARIANTS = [v for v in REGISTRY.variants() if v.target in KERNEL_TARGETS]
CPU_VARIANTS = [e.variant for _, e in sorted(REGISTRY.entries.items())
                if e.variant.target == "triton" and e.spec == "ci"]
_CPU_SKIP = pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only without a GPU")


def _params(cases: dict, cpu_pick, gpu_pick=lambda v, case: True) -> list:
    """(variant, device, case) parameters: the case loop outside, so that variants sharing inputs
    (and so one cached reference) run one after the other."""
    out = []
    for case in cases:
        for v in CPU_VARIANTS:
            if cpu_pick(v, case):
                out.append(pytest.param(v, "cpu", case, id=f"{v.name}-{case}-cpu", marks=_CPU_SKIP))
        for v in GPU_VARIANTS:
            if gpu_pick(v, case):
                out.append(pytest.param(v, "cuda", case, id=f"{v.name}-{case}-cuda", marks=pytest.mark.gpu))
    return out


def _skip_unless_runs(v: Variant, dev: str) -> None:
    why = device_reason(v.target, torch.device(dev))
    if why:
        pytest.skip(why)


# ----------------------------------------------------------------------------- shapes

def _lengths(T: int):
    # two sequences, GQA 2 -> 4, layouts and state layouts alternating with T
    return dict(B=2, T=T, H=2, HV=4, layout="BSND" if T % 2 else "BNSD", state_layout="KV" if T % 3 == 0 else "VK",
                chunk_states=True, seed=T)


SHAPES = {
    # ragged for both chunk sizes, two sequences, GQA 1 -> 2, [V, K] states
    "ragged": lambda v: dict(B=2, T=37, H=1, HV=2, seed=1),
    # empty and length-1 sequences, one of 17 tokens (two chunks of 16), BNSD, [K, V] states and
    # chunk states; HV = 2 so the head stride of v, g and beta matters (a size-1 head axis has none)
    "varlen_bnsd_kv": lambda v: dict(lens=[0, 1, 17, 0, 5], H=1, HV=2, layout="BNSD",
                                     state_layout="KV", chunk_states=True, seed=2),
    **{f"T{T}": (lambda v, T=T: _lengths(T)) for T in (1, 15, 16, 17, 63, 64, 65, 1000)},
    "varlen6": lambda v: dict(lens=[1300, 547, 2048, 963, 271, 3063], H=2, HV=4, chunk_states=True, seed=6),
    "varlen_empty": lambda v: dict(lens=[0, 5, 0, 64, 0, 130, 0], H=2, HV=2, chunk_states=True, seed=7),
    "T8192": lambda v: dict(lens=[8192], H=1, HV=2, chunk_states=True, seed=8),
}
CPU_SHAPES = ("ragged", "varlen_bnsd_kv")


@pytest.mark.parametrize("v,dev,case", _params(SHAPES, lambda v, case: case in CPU_SHAPES))
def test_shapes(v, dev, case):
    _skip_unless_runs(v, dev)
    run_and_compare(v, make_case(v, dev, **SHAPES[case](v)))


# ----------------------------------------------------------------------------- gate forms

def _gate_applies(v: Variant, scenario: str) -> bool:
    return not (v.gate == "precomputed" and scenario.startswith("dt"))  # no dt_bias there


def _cpu_gate_pick(v: Variant, scenario: str) -> bool:
    return v.dtype == "fp32" and v.state == "fp32" and v.k == v.v == 32 and _gate_applies(v, scenario)


@pytest.mark.parametrize("v,dev,case", _params(GATE_SCENARIOS, _cpu_gate_pick, _gate_applies))
def test_gates(v, dev, case):
    _skip_unless_runs(v, dev)
    shape = dict(T=40, H=1, HV=1) if dev == "cpu" else dict(T=300, H=2, HV=2)
    run_and_compare(v, make_case(v, dev, gate_scenario=case, seed=3, **shape))


# ----------------------------------------------------------------------------- paths

def _cpu_path_pick(v: Variant, path: str) -> bool:
    """Where a path's code is on the CPU: every path on the fp32 bounded variants at K = V = 32 (both
    chunk sizes); K != V for the strides and state offsets; the other gate forms where the path
    reads the gate; and the 16-bit variant's own code (16-bit g and beta, its exact prep pass for
    decays beyond exp(85)) on bf16 at chunk 16."""
    if path_reason(v, path):
        return False
    if v.dtype == "bf16":
        return (v.k == v.v == 32 and v.chunk == 16 and v.state == "fp32" and v.gate == "bounded"
                and path in ("fused_varlen", "lower_bound_-20"))
    if v.gate == "bounded" and v.k == v.v == 32:
        return True
    if v.chunk != 16:
        return False
    if v.k != v.v:
        return path in ("fused_varlen", "fused_bnsd", "gva_hv6")
    return path in ("no_dt_bias", "gva_hv4", "ill_conditioned")


@pytest.mark.parametrize("v,dev,case", _params(PATHS, _cpu_path_pick, lambda v, p: path_reason(v, p) is None))
def test_paths(v, dev, case):
    _skip_unless_runs(v, dev)
    kw = path_case(v, dev, case, seed=4)
    run_and_compare(v, kw, tol=path_tolerance(v, case))


# ----------------------------------------------------------------------------- extremes

EXTREMES = ("huge_decay", "single_tokens_no_state")


def _extreme_case(v: Variant, dev: str, case: str) -> dict:
    if case == "huge_decay":
        # exp(A_log) ~ 50 and g + dt_bias ~ +4: a_t ~ -200 per step, exp(-12800) over a chunk of 64
        kw = make_case(v, dev, B=1, T=70, H=1, HV=1, gate_scenario="dt=+4", chunk_states=True, seed=4)
        kw["A_log"] = torch.full_like(kw["A_log"], 3.9)
        return kw
    # sequences of one token without state I/O; unnormalised q/k, negative eigenvalues, scale. 16 of
    # them: o is then 16 dot products, not 3 (with 3, sm80's rel RMSE swung to 6.2e-3 on one seed)
    return make_case(v, dev, B=16, T=1, H=1, HV=1, with_state=False, use_qk_l2norm=False, allow_neg_eigval=True,
                     scale=0.3, seed=5)


def _extreme_applies(v: Variant, case: str) -> bool:
    return v.gate == "unbounded" if case == "huge_decay" else True


@pytest.mark.parametrize("v,dev,case", _params(
    {c: None for c in EXTREMES},
    lambda v, c: (_extreme_applies(v, c) and v.k == v.v == 32 and v.state != "bf16"
                  and (v.dtype == "fp32" and v.gate != "precomputed" or c == "huge_decay")),
    _extreme_applies))
def test_extremes(v, dev, case):
    _skip_unless_runs(v, dev)
    run_and_compare(v, _extreme_case(v, dev, case))


# ----------------------------------------------------------------------------- selection

@pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only without a GPU")
@pytest.mark.parametrize("v", [pytest.param(v, id=v.name) for v in CPU_VARIANTS if v.k != v.v and v.chunk == 16])
def test_auto_selection_matches_k_and_v(v):
    """Without variant=, a K != V call runs a variant of its own K and V (every other test here
    forces one), with the reference's result."""
    kw = make_case(v, "cpu", B=1, T=20, H=1, HV=1, seed=9)
    errs = errors(v, kw, run_poisoned(None, kw))
    bound = tolerances(v, "cpu")
    assert all(e < bound[k] for k, e in errs.items()), errs


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only without a GPU")
@pytest.mark.parametrize("v", [pytest.param(v, id=v.name) for v in CPU_VARIANTS if v.k != v.v and v.chunk == 16
                               and v.k < v.v])
def test_runtime_allocated_outputs(v):
    """Without out= / final_state= / chunk_states= (the other tests pass NaN-filled ones), the
    runtime allocates them itself: the same shapes and values, in both state layouts."""
    for layout in ("VK", "KV"):
        kw = make_case(v, "cpu", B=1, T=20, H=1, HV=2, state_layout=layout, chunk_states=True, seed=10)
        mine = run_poisoned(v, kw)
        theirs = kda_prefill(**kw, variant=v.name)
        assert [tuple(t.shape) for t in theirs] == [tuple(t.shape) for t in mine], layout
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs)), layout


# ----------------------------------------------------------------------------- chunk-state stride

STRIDE_GPU = [v for v in REGISTRY.variants() if v.target in (*KERNEL_TARGETS, "sm90") and v.state != "none"]
STRIDE_CPU = [v for v in CPU_VARIANTS if v.name in ("kda_fwd_triton_c16_k32_v32_bf16_gb_sbf16_bv16",
                                                    "kda_fwd_triton_c64_k32_v32_bf16_gb_sfp32_bv16")]


@pytest.mark.parametrize("v,dev", [pytest.param(v, "cpu", id=f"{v.name}-cpu", marks=_CPU_SKIP) for v in STRIDE_CPU]
                         + [pytest.param(v, "cuda", id=f"{v.name}-cuda", marks=pytest.mark.gpu) for v in STRIDE_GPU])
def test_chunk_state_stride(v, dev):
    """return_chunk_states=m keeps exactly the states entering chunks 0, m, 2m, ... of every
    sequence (what prefix caching keeps): kdagen.cases.check_chunk_stride; a short buffer is
    refused by name."""
    _skip_unless_runs(v, dev)
    C = v.chunk
    # empty, shorter than a chunk, ragged, whole chunks; more chunks than 3 strides
    lens = [0, 5, 3 * C + 1, 2 * C, 7 * C + 3] if C == 16 else [0, 5, 3 * C + 1, 2 * C]
    kw = make_case(v, dev, lens=lens, H=1, HV=2, chunk_states=True, seed=11)
    kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
    check_chunk_stride(v, kw, lens)
    # the kept rows against the float64 reference's rows for chunks 0, 3, 6, ... (kdagen.cases.kept_rows)
    errs = run_and_compare(v, dict(kw, return_chunk_states=3))
    assert 0 < errs["chunk_states"] < math.inf, errs
    short = torch.empty((sum(-(-n // (2 * C)) for n in lens) - 1, *kw["initial_state"].shape[1:]),
                        dtype=kw["initial_state"].dtype, device=dev)
    with pytest.raises(KdaInputError, match=r"chunk_states: expected at least \d+ rows \(one per 2 chunks"):
        kda_prefill(**dict(kw, return_chunk_states=2), chunk_states=short, variant=v.name)
