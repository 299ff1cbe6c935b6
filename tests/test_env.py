"""Every environment variable kdagen reads (kdagen/env.py, kdagen/paths.py) does what it says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kdagen
import kdagen.runtime as rt
from kdagen import env
from kdagen.errors import BuildError, KdagenError, NoVariantError
from kdagen.paths import cache_dir

from .runtime_env import fresh_runtime  # noqa: F401
from .test_runtime_errors import inputs

ROOT = Path(__file__).resolve().parents[1]



def _chosen() -> str:
    return next(iter(rt._PLANS.values())).entry.name


def test_every_variable_is_documented_for_doctor():
    src = "".join(p.read_text() for p in (ROOT / "kdagen").rglob("*.py"))
    used = {w.strip("\"'") for w in __import__("re").findall(r"[\"'](KDAGEN_[A-Z_]+)[\"']", src)}
    assert used <= set(env.VARIABLES), used - set(env.VARIABLES)


def test_cache_dir(monkeypatch, tmp_path):
    assert cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("KDAGEN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kdagen" / kdagen.__version__
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "kdagen" / kdagen.__version__


def test_force_variant(monkeypatch):
    kw = inputs()
    kdagen.kda_prefill(**kw)
    auto = _chosen()
    other = "kda_fwd_triton_c64_k32_v32_fp32_gb_sfp32_bv16" if "_c16_" in auto else \
        "kda_fwd_triton_c16_k32_v32_fp32_gb_sfp32_bv16"
    monkeypatch.setenv("KDAGEN_FORCE_VARIANT", other)
    rt.reset()
    kdagen.kda_prefill(**kw)
    assert _chosen() == other != auto
    monkeypatch.setenv("KDAGEN_FORCE_VARIANT", "kda_fwd_triton_c16_k64_v64_bf16_gb_sfp32_bv32")
    rt.reset()
    with pytest.raises(NoVariantError, match=r"\(from KDAGEN_FORCE_VARIANT\) cannot serve this call: dtype bf16 != "
                                             "fp32"):
        kdagen.kda_prefill(**kw)


def test_disable_jit_forbids_generating_a_variant_no_spec_lists(monkeypatch):
    kw = inputs(K=64, V=64)  # fp32 at K = 64: no shipped spec lists it, the triton target has it
    monkeypatch.setenv("KDAGEN_DISABLE_JIT", "1")
    rt.reset()
    with pytest.raises(NoVariantError) as ei:
        kdagen.kda_prefill(**kw)
    msg = str(ei.value)
    assert "Would fit if built: kda_fwd_triton_c16_k64_v64_fp32_gb_snone_bv32: no spec lists it, and " \
           "KDAGEN_DISABLE_JIT=1 forbids generating it now (`kdagen build --variant " \
           "kda_fwd_triton_c16_k64_v64_fp32_gb_snone_bv32` makes it ahead of time)" in msg, msg
    monkeypatch.setenv("KDAGEN_DISABLE_JIT", "maybe")
    with pytest.raises(KdagenError, match="KDAGEN_DISABLE_JIT: expected 1 or 0, found 'maybe'"):
        env.disable_jit()


def test_lock_timeout(monkeypatch, tmp_path):
    from filelock import FileLock

    from kdagen.cache import LOCK_NAME, locked

    monkeypatch.setenv("KDAGEN_LOCK_TIMEOUT", "0.2")
    assert env.lock_timeout() == 0.2
    folder = tmp_path / "b"
    folder.mkdir()
    holder = FileLock(str(folder / LOCK_NAME))  # another holder (flock: even in this process)
    holder.acquire()
    try:
        with pytest.raises(BuildError, match=rf"building x: another process held the lock {folder / LOCK_NAME} for "
                                             r"more than 0 s \(set KDAGEN_LOCK_TIMEOUT to wait longer\)"):
            with locked(folder, "building x"):
                pass
    finally:
        holder.release()
    with locked(folder, "building x"):  # free again
        pass
    monkeypatch.setenv("KDAGEN_LOCK_TIMEOUT", "-3")
    with pytest.raises(KdagenError, match="KDAGEN_LOCK_TIMEOUT: expected a positive number of seconds, found '-3'"):
        env.lock_timeout()


def _run_with_loglevel(level: str, tmp_path) -> subprocess.CompletedProcess:
    code = ("import torch, kdagen\n"
            "from tests.test_runtime_errors import inputs\n"
            "kdagen.kda_prefill(**inputs())\n")
    e = dict(os.environ, KDAGEN_LOGLEVEL=level, TRITON_INTERPRET="1", KDAGEN_CACHE_DIR=str(tmp_path / "c"),
             PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)


def test_loglevel(tmp_path):
    from kdagen.registry import Registry
    from kdagen.paths import GENERATED_DIR

    r2 = _run_with_loglevel("2", tmp_path)
    assert r2.returncode == 0, r2.stderr
    lines = r2.stderr.splitlines()
    chosen = [ln for ln in lines if ln.startswith("kdagen: kda_fwd_triton_c")]
    rejected = [ln for ln in lines if ln.startswith("kdagen: rejected ")]
    passed = [ln for ln in lines if ln.startswith("kdagen: passed over ")]
    # every registered variant but the chosen one, each once, with its reason
    names = {ln.removeprefix("kdagen: rejected ").removeprefix("kdagen: passed over ").split(":")[0]
             for ln in rejected + passed}
    assert len(chosen) == 1 and len(rejected) + len(passed) == len(names) == len(Registry.load(GENERATED_DIR).entries) - 1
    assert passed and all(ln.endswith(f": {chosen[0].split()[1]} is preferred (regime rank, preferred regime, target rank, "
                                      "padding, tuned chunk and block_v, readiness, state, chunk, block_v)") for ln in passed)
    assert any(ln.endswith(": gate unbounded != bounded") for ln in rejected)
    assert any(ln.endswith(": dtype bf16 != fp32") for ln in rejected)


def test_loglevel_sets_the_kdagen_logger(monkeypatch):
    import logging

    logger = logging.getLogger("kdagen")
    saved = (logger.level, list(logger.handlers), env._HANDLER)
    try:
        for val, level in (("0", logging.WARNING), ("1", logging.INFO), ("2", logging.DEBUG)):
            monkeypatch.setenv("KDAGEN_LOGLEVEL", val)
            assert env.configure_logging() == int(val) and logger.level == level
        assert sum(h is env._HANDLER for h in logger.handlers) == 1  # one stderr handler, however often
        monkeypatch.setenv("KDAGEN_LOGLEVEL", "verbose")
        with pytest.raises(KdagenError, match="KDAGEN_LOGLEVEL: expected 0, 1 or 2, found 'verbose'"):
            env.configure_logging()
    finally:
        monkeypatch.delenv("KDAGEN_LOGLEVEL")
        logger.setLevel(saved[0])
        logger.handlers[:] = saved[1]
        env._HANDLER = saved[2]


def test_max_jobs_is_read_by_the_build(monkeypatch):
    from kdagen.build import default_jobs

    monkeypatch.setenv("MAX_JOBS", "3")
    assert default_jobs() == 3
    monkeypatch.delenv("MAX_JOBS")
    assert default_jobs() == max(1, os.cpu_count() or 1)
