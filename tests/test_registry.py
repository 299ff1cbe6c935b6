"""The registry reads the manifests; stale or missing compiled artifacts are never launched."""

from __future__ import annotations

import json

import pytest

import kdagen.build as kbuild
from kdagen.errors import NoVariantError
from kdagen.paths import BUILD_DIR, GENERATED_DIR, ROOT
from kdagen.registry import Registry, artifact_status


def test_registry_lists_every_generated_variant_once():
    reg = Registry.load()
    names = set()
    for man in GENERATED_DIR.glob("*/manifest.json"):
        names |= {e["name"] for e in json.loads(man.read_text())["variants"]}
    assert set(reg.entries) == names
    # JIT targets have nothing to build; a compiled one is "built" exactly when its spec's build
    # manifest names it and the artifact is on disk (read here from the files themselves)
    for name, e in reg.entries.items():
        if e.variant.target in ("triton", "triton_twin"):
            assert artifact_status(e) == "jit", name
            continue
        man = BUILD_DIR / e.spec / "manifest.json"
        built = json.loads(man.read_text())["variants"] if man.exists() else {}
        on_disk = name in built and (ROOT / built[name]["artifact"]).exists()
        assert artifact_status(e) == ("built" if on_disk else "not built"), name


def test_stale_cuda_artifact_without_nvcc_is_refused(tmp_path, monkeypatch):
    gen = tmp_path / "generated" / "s"
    gen.mkdir(parents=True)
    src = json.loads((GENERATED_DIR / "a100" / "manifest.json").read_text())
    entry = src["variants"][0]
    (gen / "manifest.json").write_text(json.dumps({**src, "spec": "s", "variants": [entry]}))
    built = tmp_path / "build" / "s"
    built.mkdir(parents=True)
    art = built / "x.fatbin"
    art.write_bytes(b"not really a fatbin")
    (built / "manifest.json").write_text(json.dumps({"variants": {entry["name"]: {
        "artifact": str(art), "cache_key": "0" * 64, "target": "sm80", "build": "nvcc"}}}))
    reg = Registry.load(tmp_path / "generated", tmp_path / "build")
    monkeypatch.setattr(kbuild, "nvcc_path", lambda: None)
    with pytest.raises(NoVariantError) as ei:
        reg.launcher(entry["name"], "cuda:0")
    msg = str(ei.value)
    assert "was built from other sources or another toolchain" in msg
    assert f"kdagen build --spec specs/s.yaml --filter {entry['name']}" in msg


@pytest.mark.skipif(kbuild.nvcc_path() is None, reason="needs nvcc")
def test_missing_cuda_artifact_is_built_on_demand(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(kbuild, "BUILD_DIR", tmp_path)
    reg = Registry.load(GENERATED_DIR, tmp_path)
    name = next(n for n, e in sorted(reg.entries.items()) if e.variant.target == "sm80" and e.variant.chunk == 16
                and e.variant.k == 64)
    entry = reg.entries[name]
    assert entry.built is None and artifact_status(entry) == "not built"
    with caplog.at_level("WARNING", logger="kdagen"):
        art = reg._artifact(entry)
    assert art.exists() and art.suffix == ".fatbin" and art.is_relative_to(tmp_path)
    assert any("is not built; building it now" in r.getMessage() for r in caplog.records)
    assert artifact_status(entry) == "built"
