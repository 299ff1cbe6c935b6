"""What only the Triton target promises, beyond the cases every target runs (tests/test_kernels.py).

On a CPU machine these run under the Triton interpreter; with a GPU, `pytest -m gpu` runs them
with real Triton.
"""

from __future__ import annotations

import pytest

from kdagen.cases import make_case, run_and_compare
from kdagen.paths import GENERATED_DIR
from kdagen.registry import Registry

from .conftest import HAS_CUDA

VARIANTS = [v for v in Registry.load(GENERATED_DIR).variants() if v.target == "triton"]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="interpreter runs only without a GPU"), id="cpu"),
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("v", [pytest.param(v, id=v.name) for v in VARIANTS
                               if v.dtype == "fp32" and v.chunk == 64 and v.k == v.v == 32])
def test_fp32_strong_decay_is_accurate_to_rounding(v, dev):
    # Strong decays make |G| reach ~300 inside a 64-chunk; decays taken as differences of
    # prefix sums lose |G| * eps (measured 4e-6 here before the kernel summed them directly;
    # 1.6e-7 to 2.4e-7 since).
    kw = make_case(v, dev, B=1, T=128, H=1, HV=1, gate_scenario="U(-8,8)", seed=3)
    run_and_compare(v, kw, tol=1e-6)
