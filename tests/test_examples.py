"""Every script in examples/ runs (on the GPU when there is one, else on Triton's interpreter)
and checks its own result; what it prints says what it showed."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from .runtime_env import fresh_runtime  # noqa: F401

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXPECT = {
    "fla_drop_in.py": "kdagen.chunk_kda: o (1, ",
    "vllm_state_pool.py": "pool updated in place: slots 5, 2, 7 written, 5 slots untouched",
    "prefix_cache_checkpoints.py": "tokens prefilled, rel. RMSE vs the full prefill",
    "context_parallel.py": "against one process, replicas identical: True",
}


def test_every_example_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECT)


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_example_runs(name, capsys):
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    assert EXPECT[name] in capsys.readouterr().out
