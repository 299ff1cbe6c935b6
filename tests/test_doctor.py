"""`kdagen doctor`: one line per fact, what this machine can run."""

from __future__ import annotations

import dataclasses

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


def test_doctor_names_the_tuning_file_in_use_per_cuda_gpu(monkeypatch, tmp_path):
    """A faked CUDA device (nothing runs on it): the tuning line says which file dispatch reads
    there and where it comes from, the shipped one included."""
    import torch

    import kdagen.doctor as doctor
    import kdagen.select as sel
    from kdagen import tuning

    from .test_tuning import a_tuning

    gpu = "NVIDIA Test GPU"
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(tuning.ENV, raising=False)
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setattr(tuning, "_device_name", lambda index: gpu)
    monkeypatch.setattr(sel, "_sm_count", lambda device: 132)
    monkeypatch.setattr(sel, "device_reason", lambda target, device: None)
    cpu_only = doctor._devices
    monkeypatch.setattr(doctor, "_devices", lambda: [d for d in cpu_only() if d[0] is not None]
                        + [(cuda, f"cuda:0: {gpu}, compute capability 9.0, 132 SMs, 141 GiB")])

    def line() -> str:
        res = CliRunner().invoke(main, ["doctor"])
        assert res.exit_code == 0, res.output
        found = [ln for ln in res.output.splitlines() if ln.startswith("tuning cuda:0: ")]
        assert len(found) == 1, res.output
        return found[0]

    cache = tmp_path / "cache" / "tuning" / "NVIDIA_Test_GPU.json"
    shipped = tmp_path / "shipped" / "NVIDIA_Test_GPU.json"
    assert line() == (f"tuning cuda:0: none for {gpu!r}: the targets' constants (`kdagen tune` writes {cache})")
    tuning.save(a_tuning(gpu=gpu), shipped)
    assert line() == f"tuning cuda:0: {shipped} (shipped with kdagen), 2 rule(s) (date 2026-12-01, commit abc)"
    tuning.save(a_tuning(gpu=gpu, rules=a_tuning().rules[:1], meta={}), cache)
    assert line() == f"tuning cuda:0: {cache} (the cache's, from `kdagen tune`), 1 rule(s)"
    cache.unlink()
    # rules that name their gate form: counted per form, and a form without any is named
    gated = [dataclasses.replace(r, gate="bounded") for r in a_tuning().rules]
    tuning.save(a_tuning(gpu=gpu, rules=gated, meta={}), cache)
    assert line() == (f"tuning cuda:0: {cache} (the cache's, from `kdagen tune`), 2 rule(s); per gate form: bounded 2, "
                      "unbounded 0, precomputed 0; no rule for the unbounded and precomputed gates (`kdagen tune` "
                      "measures every form by default)")
    tuning.save(a_tuning(gpu=gpu, rules=gated + [dataclasses.replace(gated[0], gate="unbounded"),
                                                 dataclasses.replace(gated[0], gate="precomputed")], meta={}), cache)
    assert line().endswith("4 rule(s); per gate form: bounded 2, unbounded 1, precomputed 1")
    cache.unlink()
    tuning.save(a_tuning(gpu=gpu, sm_count=66), shipped)
    assert line() == (f"tuning cuda:0: {shipped} (shipped with kdagen) ignored: made for 66 SMs, the device has "
                      "132: the targets' constants")
    tuning.save(a_tuning(gpu="NVIDIA Other"), shipped)
    assert "was made on 'NVIDIA Other', the device is 'NVIDIA Test GPU'" in line()
    monkeypatch.setenv(tuning.ENV, "off")
    assert line() == "tuning cuda:0: off (KDAGEN_TUNING=off): the targets' constants"
    monkeypatch.setenv(tuning.ENV, str(tmp_path / "nowhere.json"))
    assert line() == (f"tuning cuda:0: {tmp_path / 'nowhere.json'} (from KDAGEN_TUNING) does not exist: "
                      "the targets' constants")
