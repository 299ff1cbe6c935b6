"""Property test: on random shapes (ragged, varlen with empty sequences, GQA, both layouts),
the fp32 Triton variants equal the float64 reference."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdagen.paths import GENERATED_DIR
from kdagen.variant import Variant

from .conftest import HAS_CUDA
from .kda_cases import make_case, run_and_compare

VARIANTS = [Variant.from_dict(e) for e in json.loads((GENERATED_DIR / "ci" / "manifest.json").read_text())["variants"]
            if e["target"] == "triton" and e["dtype"] == "fp32"]


@st.composite
def problems(draw):
    v = draw(st.sampled_from(VARIANTS))
    H = draw(st.sampled_from([1, 2]))
    HV = H * draw(st.sampled_from([1, 2]))
    if draw(st.booleans()):
        lens = draw(st.lists(st.integers(0, 70), min_size=1, max_size=4))
        shape = dict(lens=lens)
    else:
        shape = dict(B=draw(st.integers(1, 2)), T=draw(st.integers(1, 70)))
    return v, dict(H=H, HV=HV, layout=draw(st.sampled_from(["BSND", "BNSD"])),
                   state_layout=draw(st.sampled_from(["VK", "KV"])),
                   gate_scenario=draw(st.sampled_from(["normal", "N(0,8)", "dt=-8", "g=+8"])),
                   seed=draw(st.integers(0, 2**16)), **shape)


@pytest.mark.skipif(HAS_CUDA, reason="runs under the CPU interpreter; GPU runs use the parametrised tests")
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_random_shapes_match_reference(problem):
    v, shape = problem
    if v.gate == "precomputed" and shape["gate_scenario"].startswith("dt"):
        shape["gate_scenario"] = "normal"
    run_and_compare(v, make_case(v, "cpu", **shape))
