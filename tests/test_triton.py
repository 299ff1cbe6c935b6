"""The Triton variants of specs/ci.yaml against the float64 reference.

On a CPU machine these run under the Triton interpreter; with a GPU, `pytest -m gpu`
runs the same cases (and larger ones) with real Triton.
"""

from __future__ import annotations

import json

import pytest
import torch

from kdagen.paths import GENERATED_DIR
from kdagen.variant import Variant

from .conftest import HAS_CUDA
from .kda_cases import GATE_SCENARIOS, make_case, run_and_compare

MANIFEST = json.loads((GENERATED_DIR / "ci" / "manifest.json").read_text())
VARIANTS = [Variant.from_dict(e) for e in MANIFEST["variants"] if e["target"] == "triton"]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="interpreter runs only without a GPU"), id="cpu"),
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
]


def by_name(pred) -> list:
    return [pytest.param(v, id=v.name) for v in VARIANTS if pred(v)]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("v", by_name(lambda v: True))
def test_gqa_ragged_with_state(v, dev):
    # T = 37: ragged for both chunk sizes; B = 2 sequences; GQA 1 -> 2 heads.
    run_and_compare(v, make_case(v, dev, B=2, T=37, H=1, HV=2, seed=1))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("v", by_name(lambda v: True))
def test_varlen_bnsd_kv_state_chunk_states(v, dev):
    # Empty and length-1 sequences, a sequence of exactly one chunk + 1, BNSD, [K, V] states.
    # "none" variants are compiled without any state I/O, chunk states included.
    lens = [0, 1, v.chunk + 1, 0, 5]
    with_cs = v.state != "none"
    kw = make_case(v, dev, lens=lens, H=2, HV=2, layout="BNSD", state_layout="KV", chunk_states=with_cs, seed=2)
    errs = run_and_compare(v, kw)
    assert ("chunk_states" in errs) == with_cs


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("v", by_name(lambda v: v.dtype == "fp32" and v.state == "fp32"))
@pytest.mark.parametrize("scenario", sorted(GATE_SCENARIOS))
def test_gate_sweep(v, dev, scenario):
    if v.gate == "precomputed" and scenario.startswith("dt"):
        pytest.skip("dt_bias is not used by the precomputed gate")
    run_and_compare(v, make_case(v, dev, B=1, T=40, H=1, HV=1, gate_scenario=scenario, seed=3))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("v", by_name(lambda v: v.dtype == "fp32" and v.gate == "unbounded"))
def test_unbounded_gate_with_huge_decay_stays_finite(v, dev):
    # exp(A_log) ~ 50 and g + dt_bias ~ +2: a_t ~ -100 per step, exp(-6400) over a chunk.
    kw = make_case(v, dev, B=1, T=70, H=1, HV=1, gate_scenario="dt=+4", seed=4)
    kw["A_log"] = torch.full_like(kw["A_log"], 3.9)
    run_and_compare(v, kw)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("v", by_name(lambda v: v.dtype == "fp32" and v.gate == "bounded" and v.state == "fp32"))
def test_no_state_no_l2norm_neg_eigval_single_token(v, dev):
    kw = make_case(v, dev, B=3, T=1, H=1, HV=1, with_state=False, seed=5)
    kw.update(use_qk_l2norm=False, allow_neg_eigval=True, scale=0.3)
    # unnormalised q/k make the values larger; the relative bound is the same
    run_and_compare(v, kw)
    kw = make_case(v, dev, B=1, T=50, H=1, HV=1, with_state=False, seed=6)
    kw.update(use_qk_l2norm=True, allow_neg_eigval=True)
    run_and_compare(v, kw)


@pytest.mark.gpu
@pytest.mark.parametrize("v", by_name(lambda v: v.dtype == "bf16" and v.gate == "bounded"))
@pytest.mark.parametrize("T", [1, 15, 16, 17, 63, 64, 65, 1000])
def test_gpu_lengths(v, T):
    run_and_compare(v, make_case(v, "cuda", B=2, T=T, H=2, HV=4, seed=T))


@pytest.mark.gpu
@pytest.mark.parametrize("v", by_name(lambda v: v.dtype == "bf16" and v.gate == "bounded" and v.state == "fp32"))
def test_gpu_varlen_design_lengths(v):
    lens = [1300, 547, 2048, 0, 963, 271, 3063]
    run_and_compare(v, make_case(v, "cuda", lens=lens, H=2, HV=4, seed=7))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("v", by_name(lambda v: v.dtype == "fp32" and v.chunk == 64))
def test_fp32_strong_decay_is_accurate_to_rounding(v, dev):
    # Strong decays make |G| reach ~300 inside a 64-chunk; decays taken as differences of
    # prefix sums lose |G| * eps (measured 4e-6 here before the kernel summed them directly).
    kw = make_case(v, dev, B=1, T=128, H=1, HV=1, gate_scenario="U(-8,8)", seed=3)
    errs = run_and_compare(v, kw, tol=1e-6)
    assert max(errs.values()) < 1e-6
