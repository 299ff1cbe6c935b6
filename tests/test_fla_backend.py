"""kdagen as a backend of fla-core 0.6's chunk_kda: registered when kdagen is imported (before
or after fla), serving fla's own chunk_kda under inference mode (seen in fla's log and in the
result, which equals kdagen.chunk_kda's), falling back to fla's own implementation with the
reason logged where the verifier declines, and switched off by KDAGEN_FLA_BACKEND=0."""

from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kdagen
from kdagen import fla_backend

from .fla_cases import fla_case, fla_chunk_kda_args, fla_naive
from .runtime_env import fresh_runtime  # noqa: F401

fla_kda = pytest.importorskip("fla.ops.kda")
from fla.backends import _function_registries  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _registry():
    return _function_registries[inspect.unwrap(fla_kda.chunk_kda)]


@pytest.fixture(autouse=True)
def fresh_backend(monkeypatch):
    """Each test sees fla's first-time log lines and kdagen's verifier memo afresh."""
    monkeypatch.setattr(_registry(), "_logged", set())
    fla_backend._MEMO.clear()
    fla_backend._LATEST[0] = None
    fla_backend._SHORTCUTS.clear()
    fla_backend._DECLINED.clear()
    monkeypatch.delenv("KDAGEN_FLA_BACKEND", raising=False)


def test_registered_in_fla_chunk_kda_registry():
    backend = _registry()._backends["kdagen"]
    assert fla_backend.registered() and backend.priority == fla_backend.PRIORITY == 2
    assert backend.env_var == "KDAGEN_FLA_BACKEND" and backend.is_available() and backend.is_enabled()
    # ahead of FlashKDA (priority 3) wherever both are installed
    order = [b.backend_type for b in _registry()._get_sorted_backends()]
    assert order.index("kdagen") < order.index("flash_kda")


def test_fla_chunk_kda_under_inference_mode_is_served_by_kdagen(caplog, device):
    kw = fla_case(D=32, lens=[9, 11], gate="bounded", state_v_first=True, device=device)
    args, fkw = fla_chunk_kda_args(kw)
    caplog.set_level(logging.INFO)
    with torch.inference_mode():
        o, s = fla_kda.chunk_kda(*args, **fkw)
        mine_o, mine_s = kdagen.chunk_kda(*args, **fkw)
    assert "[FLA Backend] fla.ops.kda.chunk.chunk_kda -> kdagen" in caplog.text
    assert torch.equal(o, mine_o) and torch.equal(s, mine_s)
    ro, rs = fla_naive(kw)
    from kdagen.reference import rel_rmse

    assert rel_rmse(o.float().cpu(), ro) < 6e-3 and rel_rmse(s.cpu(), rs) < 6e-3


class _FlaOwnPath(Exception):
    pass


@pytest.fixture
def fla_own_path(monkeypatch):
    """fla's own implementation, recognised: on the CPU its Triton kernels cannot run, so the
    autograd function fla's chunk_kda applies is replaced by one that says it was reached."""
    import fla.ops.kda.chunk as fla_chunk

    class Reached:
        @staticmethod
        def apply(*args):
            raise _FlaOwnPath()

    monkeypatch.setattr(fla_chunk, "ChunkKDAFunction", Reached)


@pytest.mark.parametrize("over, why", [
    ("grad", "kdagen serves inference only (grad mode is on"),
    (dict(cp_context=SimpleNamespace(cu_seqlens=torch.tensor([0, 4]), cu_seqlens_cpu=None, pre_num_ranks=0,
                                     post_num_ranks=0, group=None, layout="contiguous"),
          use_graph=True),
     "cp_context: expected None with use_graph"),
    (dict(D=192), "no kernel variant fits this call."),
], ids=["training", "context-parallel", "D192-not-built-no-jit"])
def test_declined_calls_fall_back_to_fla_with_the_reason_logged(over, why, caplog, fla_own_path, monkeypatch):
    over = dict(over) if isinstance(over, dict) else over
    D = over.pop("D", 32) if isinstance(over, dict) else 32
    if D != 32:
        monkeypatch.setenv("KDAGEN_DISABLE_JIT", "1")  # no variant of this size is built, none may be made
    kw = fla_case(D=D, T=4, with_state=not (isinstance(over, dict) and "cp_context" in over))
    if isinstance(over, dict):
        kw.update(over)
    args, fkw = fla_chunk_kda_args(kw)
    caplog.set_level(logging.INFO)
    ctx = torch.enable_grad() if over == "grad" else torch.inference_mode()
    with ctx, pytest.raises(_FlaOwnPath):
        fla_kda.chunk_kda(*args, **fkw)
    assert "[FLA Backend] fla.ops.kda.chunk.chunk_kda -> kdagen rejected: " in caplog.text
    assert why in caplog.text
    assert "kdagen: fla chunk_kda falls back to fla: " in caplog.text


def test_verifier_answers_are_kept_per_signature(monkeypatch):
    calls = []
    real = fla_backend._verify
    monkeypatch.setattr(fla_backend, "_verify", lambda a, k: calls.append(1) or real(a, k))
    kw = fla_case(D=32, T=4)
    args, fkw = fla_chunk_kda_args(kw)
    with torch.inference_mode():
        assert fla_backend.verify(*args, **fkw) == (True, None)
        assert fla_backend.verify(*args, **fkw) == (True, None)
        args2, fkw2 = fla_chunk_kda_args(fla_case(D=32, T=5))
        assert fla_backend.verify(*args2, **fkw2) == (True, None)
        assert len(calls) == 2
        # the latest call's shortcut answers only calls of its own signature and values: not
        # another scale, nor a q of other strides, nor the first signature again (_MEMO)
        built = []
        monkeypatch.setattr(fla_backend, "_meta", lambda a, real=fla_backend._meta: built.append(1) or real(a))
        assert fla_backend.verify(*args2, **fkw2) == (True, None) and built == []
        assert fla_backend.verify(*args2, **dict(fkw2, scale=0.5)) == (True, None) and built
        built.clear()
        q2 = args2[0]
        qt = q2.new_empty((*q2.shape[:-1], 2 * q2.shape[-1]))[..., :q2.shape[-1]].copy_(q2)  # rows 2K apart
        assert fla_backend.verify(qt, *args2[1:], **fkw2) == (True, None) and built
        assert fla_backend.verify(*args, **fkw) == (True, None)
        # alternating signatures switch among their shortcuts: no guard built again
        import kdagen.signature_guard as sg

        monkeypatch.setattr(sg, "make_check", lambda *a: pytest.fail("a guard built again"))
        for _ in range(2):
            assert fla_backend.verify(*args2, **fkw2) == (True, None)
            assert fla_backend.verify(*args, **fkw) == (True, None)
    assert len(calls) == 4


def test_switched_off_at_call_time_by_the_environment(monkeypatch, fla_own_path):
    monkeypatch.setenv("KDAGEN_FLA_BACKEND", "0")
    args, fkw = fla_chunk_kda_args(fla_case(D=32, T=4))
    with torch.inference_mode(), pytest.raises(_FlaOwnPath):
        fla_kda.chunk_kda(*args, **fkw)


def test_install_honours_the_opt_out_and_registers_at_once_when_fla_is_loaded(monkeypatch):
    hooks = len(sys.meta_path)
    for value, registers in (("0", False), ("1", True)):
        monkeypatch.setattr(fla_backend, "_state", {"installed": False, "registered": False})
        monkeypatch.setenv("KDAGEN_FLA_BACKEND", value)
        fla_backend.install()
        assert fla_backend.registered() is registers and len(sys.meta_path) == hooks  # no hook: fla is loaded
    monkeypatch.setattr(fla_backend, "_state", {"installed": False, "registered": False})
    monkeypatch.setenv("KDAGEN_FLA_BACKEND", "maybe")
    fla_backend.install()
    assert not fla_backend.registered()


def test_importing_kdagen_before_fla_registers_when_fla_arrives():
    """In a fresh interpreter: kdagen alone imports neither torch nor fla; fla's import then
    registers the backend (the import hook); KDAGEN_FLA_BACKEND=0 leaves fla alone."""
    code = ("import sys, kdagen\n"
            "assert 'torch' not in sys.modules and 'fla' not in sys.modules\n"
            "import inspect, fla.ops.kda\n"
            "from fla.backends import _function_registries\n"
            "r = _function_registries[inspect.unwrap(fla.ops.kda.chunk_kda)]\n"
            "print('kdagen' in r._backends, kdagen.fla_backend.registered())\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    env.pop("KDAGEN_FLA_BACKEND", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["True", "True"]


@pytest.mark.gpu
@pytest.mark.fla_autotune
def test_gpu_fla_chunk_kda_served_and_fallback(monkeypatch):
    """On the GPU: fla's chunk_kda under inference mode is kdagen's result (bf16: D=128 and D=256
    on sm80, D=192 zero-padded to sm80's 256) and matches fla's naive reference; with grad mode on
    the backend declines; fp16 D=192 without JIT (no variant of that dtype covers it) falls back to
    fla's own kernels, under inference mode and with grad mode on, and still matches. fla's own
    kernels run for that one shape only: each new shape costs fla about 130 s of autotuning."""
    from kdagen.reference import rel_rmse

    for D, dtype, served in ((128, torch.bfloat16, True), (256, torch.bfloat16, True),
                             (192, torch.bfloat16, True), (192, torch.float16, False)):
        if not served:
            monkeypatch.setenv("KDAGEN_DISABLE_JIT", "1")
        kw = fla_case(D=D, lens=[300, 0, 724], H=2, HV=4, dtype=dtype, gate="bounded", state_v_first=True,
                      device="cuda")
        args, fkw = fla_chunk_kda_args(kw)
        ro, rs = fla_naive(kw)
        with torch.inference_mode():
            o, s = fla_kda.chunk_kda(*args, **fkw)
        assert fla_backend.verify(*args, **fkw)[0] is False  # grad mode is on here
        with torch.inference_mode():
            assert fla_backend.verify(*args, **fkw)[0] is served
            if served:
                mo, ms = kdagen.chunk_kda(*args, **fkw)
                assert torch.equal(o, mo) and torch.equal(s, ms)
        checked = [("o", o, ro), ("state", s, rs)]
        if not served:
            fo, fs = fla_kda.chunk_kda(*args, **fkw)  # grad mode: fla's own
            checked += [("fla o", fo, ro), ("fla state", fs, rs)]
        for name, x, ref in checked:
            e = rel_rmse(x.detach().float().cpu(), ref)
            print(f"D={D} {name}: {e:.2e}")
            assert e < 6e-3, (D, name, e)
