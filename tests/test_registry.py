"""The registry reads the manifests; stale or missing compiled artifacts are never launched; an
on-demand build goes where the registry was told to build."""

from __future__ import annotations

import json

import pytest

import kdagen.build as kbuild
from kdagen.errors import NoVariantError
from kdagen.paths import GENERATED_DIR
from kdagen.registry import Registry, artifact_status
from kdagen.select import NEEDS_BUILD, READY


def test_registry_lists_every_generated_variant_once():
    reg = Registry.load(GENERATED_DIR)
    names = set()
    for man in GENERATED_DIR.glob("*/manifest.json"):
        names |= {e["name"] for e in json.loads(man.read_text())["variants"]}
    assert set(reg.entries) == names
    assert all(artifact_status(e) in ("jit", "built", "not built") for e in reg.entries.values())


def _one_sm80_spec(tmp_path, toolchain=None, key=None):
    """A registry over a one-variant copy of the a100 spec with a fake fatbin where the build
    puts it; its build-manifest key is `key` (default: the right one for `toolchain`)."""
    gen = tmp_path / "generated" / "s"
    gen.mkdir(parents=True)
    src = json.loads((GENERATED_DIR / "a100" / "manifest.json").read_text())
    entry = src["variants"][0]
    (gen / "manifest.json").write_text(json.dumps({**src, "spec": "s", "variants": [entry]}))
    reg = Registry.load(tmp_path / "generated", tmp_path / "build")
    e = reg.entries[entry["name"]]
    e.artifact.parent.mkdir(parents=True)
    e.artifact.write_bytes(b"not really a fatbin")
    if key is None:
        key = kbuild.cache_key(e.variant, e.source_sha256, toolchain)
    rec = {"artifact": str(e.artifact), "cache_key": key, "target": "sm80", "build": "nvcc"}
    if toolchain:
        rec["toolchain"] = toolchain
    (tmp_path / "build" / "s" / "manifest.json").write_text(json.dumps({"variants": {entry["name"]: rec}}))
    return Registry.load(tmp_path / "generated", tmp_path / "build"), entry["name"]


def test_stale_cuda_artifact_without_nvcc_is_refused(tmp_path, monkeypatch):
    reg, name = _one_sm80_spec(tmp_path, key="0" * 64)
    monkeypatch.setattr(kbuild, "nvcc_path", lambda: None)
    assert reg.status(name) == (NEEDS_BUILD, "not built, and nvcc is not available (PATH, CUDACXX, "
                                f"/usr/local/cuda/bin) to build it (`kdagen build --spec s --filter {name}` elsewhere)")
    with pytest.raises(NoVariantError) as ei:
        reg.launcher(name, "cuda:0")
    msg = str(ei.value)
    assert "was built from other sources or another toolchain" in msg
    assert f"kdagen build --spec s --filter {name}" in msg


def test_prebuilt_artifact_is_trusted_without_nvcc_by_its_recorded_toolchain(tmp_path, monkeypatch):
    # A cache built elsewhere (nvcc V13.0.88) and copied to a machine without the CUDA toolkit.
    monkeypatch.setattr(kbuild, "nvcc_path", lambda: None)
    reg, name = _one_sm80_spec(tmp_path, toolchain="V13.0.88")
    assert reg.status(name) == (READY, None)
    assert reg._artifact(reg.entries[name]) == reg.entries[name].artifact
    # the same artifact recorded under another compiler is stale where that compiler is missing
    reg2, _ = _one_sm80_spec(tmp_path / "other", key=kbuild.cache_key(reg.entries[name].variant,
                                                                      reg.entries[name].source_sha256, "V12.4"))
    assert reg2.status(name)[0] == NEEDS_BUILD


def test_disable_jit_refuses_to_build_and_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KDAGEN_DISABLE_JIT", "1")
    monkeypatch.setattr(kbuild, "nvcc_path", lambda: "/usr/bin/true")
    reg, name = _one_sm80_spec(tmp_path, key="0" * 64)
    assert reg.status(name) == (NEEDS_BUILD, "not built, and KDAGEN_DISABLE_JIT=1 forbids building it now "
                                f"(`kdagen build --spec s --filter {name}`)")
    with pytest.raises(NoVariantError, match="KDAGEN_DISABLE_JIT=1 forbids building it now"):
        reg._artifact(reg.entries[name])


@pytest.mark.skipif(kbuild.nvcc_path() is None, reason="needs nvcc")
def test_missing_cuda_artifact_is_built_on_demand_into_the_given_build_dir(tmp_path, caplog, capfd):
    reg = Registry.load(GENERATED_DIR, tmp_path)
    name = next(n for n, e in sorted(reg.entries.items()) if e.variant.target == "sm80" and e.variant.chunk == 16
                and e.variant.k == 64)
    entry = reg.entries[name]
    assert entry.built is None and artifact_status(entry) == "not built" and reg.status(name) == (NEEDS_BUILD, None)
    with caplog.at_level("WARNING", logger="kdagen"):
        art = reg._artifact(entry)
    assert art.exists() and art.suffix == ".fatbin" and art.is_relative_to(tmp_path)
    logs = [r.getMessage() for r in caplog.records]
    assert any(f"is not built; building it now into {tmp_path}" in m for m in logs), logs
    assert any(m.startswith(f"kdagen: built {name} in ") for m in logs), logs
    assert f"[1/1] nvcc {name}" in capfd.readouterr().err  # ninja's progress line, on stderr
    assert artifact_status(entry) == "built" and reg.status(name) == (READY, None)
    assert Registry.load(GENERATED_DIR, tmp_path).status(name) == (READY, None)  # and a new process finds it
