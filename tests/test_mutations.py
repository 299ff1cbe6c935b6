"""The mutation check (kdagen_dev/mutate.py): the catalogue applies to today's tree, and a fixed
sample of it is killed by the CPU tests named for it (the whole catalogue: scripts/mutate.py)."""

from __future__ import annotations

import pytest

from kdagen_dev.mutate import ROOT, Workspace, check_imports_copy, stale_reason
from kdagen_dev.mutations import CATALOGUE, SAMPLE, by_name

from .conftest import HAS_CUDA


def test_catalogue_covers_the_named_bugs_and_applies_to_this_tree():
    names = [m.name for m in CATALOGUE]
    assert len(names) == len(set(names)) and len(names) >= 30
    files = {m.file for m in CATALOGUE}
    assert {"templates/triton/kda_fused.py.j2", "kdagen/runtime.py", "kdagen/inputs.py"} <= files
    # issue 23's four survivors
    assert {"kv_state_offset_k_for_v", "k_loaded_with_q_strides", "launch_dt_flag_from_a_log",
            "runtime_fixed_lower_bound"} <= set(names)
    assert set(SAMPLE) <= set(names)
    stale = {m.name: why for m in CATALOGUE if (why := stale_reason(m, ROOT))}
    assert not stale, f"retarget these mutations to the code as it is now (kdagen_dev/mutations.py): {stale}"
    for m in CATALOGUE:
        assert m.kills and all(k.startswith("tests/") for k in m.kills), m.name


@pytest.fixture(scope="module")
def workspace():
    with Workspace() as ws:
        check_imports_copy(ws)
        yield ws


@pytest.mark.mutation
@pytest.mark.skipif(HAS_CUDA, reason="the kill tests run under the CPU interpreter")
@pytest.mark.parametrize("m", by_name(SAMPLE), ids=lambda m: m.name)
def test_sample_mutation_is_killed(m, workspace):
    out = workspace.run(m, timeout=240)
    assert out.status == "killed", f"{m.name} ({m.why}): {out.status} {out.killer}\n{out.output[-2000:]}"
