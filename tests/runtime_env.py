"""A fresh runtime per test: its own cache directory, no KDAGEN_* settings from the caller's
environment, no plans or registry left from other tests. Import `fresh_runtime` into a test
module to use it there (it is autouse)."""

from __future__ import annotations

import pytest

import kdagen.runtime as rt
from kdagen import env


@pytest.fixture(autouse=True)
def fresh_runtime(monkeypatch, tmp_path):
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(tmp_path / "cache"))
    for name in env.VARIABLES:
        if name not in ("KDAGEN_CACHE_DIR", "MAX_JOBS"):
            monkeypatch.delenv(name, raising=False)
    rt.reset()
    yield
    # the caller's environment back first: reset() reads the registry again at once, and one read
    # under this test's cache directory left every later test in the process with its builds
    # "not built" (the GPU suite, session 30)
    monkeypatch.undo()
    rt.reset()
