"""`kdagen doctor`: one line per fact, what this machine can run."""

from __future__ import annotations

from click.testing import CliRunner

import kdagen
from kdagen.cli import main
from kdagen.targets import TARGETS


def test_doctor_reports_machine_cache_and_targets(monkeypatch, tmp_path):
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    res = CliRunner().invoke(main, ["doctor"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].startswith(f"kdagen {kdagen.__version__}: ")
    assert any(ln.startswith("python ") and " torch " in ln for ln in lines)
    assert any(ln.startswith("device cpu: ") for ln in lines)
    assert any(ln.startswith("nvcc: ") for ln in lines)
    assert f"cache: {tmp_path / 'cache'} (" in res.output
    assert f"env KDAGEN_CACHE_DIR={tmp_path / 'cache'} (" in res.output
    for name in TARGETS:
        assert sum(ln.startswith(f"target {name}: ") for ln in lines) == 1, name
    tri = next(ln for ln in lines if ln.startswith("target triton: "))
    assert "ready; runs here on cpu" in tri
    sm80 = next(ln for ln in lines if ln.startswith("target sm80: "))
    assert "runs here on" in sm80 and ("sm80 runs on cuda" in sm80 or "cuda:" in sm80)
