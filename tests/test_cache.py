"""The cache directory as an installed package uses it: shipped specs rendered there once
(stamped by content), builds there, under a lock."""

from __future__ import annotations

import json
import os

import pytest

import kdagen.registry as kreg
from kdagen import build as kbuild
from kdagen.cache import STAMP_NAME, ensure_generated, ensure_shipped_specs
from kdagen.paths import SPECS_DIR
from kdagen.registry import Registry
from kdagen.spec import expand, load_spec


@pytest.fixture
def installed(monkeypatch, tmp_path):
    """The registry as an installed package sees it: no checkout generated/, only the cache."""
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kreg, "SOURCE_GENERATED_DIR", None)
    return tmp_path / "cache"


def test_installed_registry_renders_the_shipped_specs_into_the_cache(installed):
    reg = Registry.load()
    shipped = {v.name for p in SPECS_DIR.glob("*.yaml") for v in expand(load_spec(p))}
    assert set(reg.entries) == shipped
    assert all(e.generated_root == installed / "generated" and e.build_root == installed / "build"
               for e in reg.entries.values())
    # a Triton variant's artifact is its rendered source in the cache
    tri = next(e for e in reg.entries.values() if e.variant.target == "triton")
    assert reg._artifact(tri) == installed / "generated" / tri.spec / tri.name / "kernel.py"
    # rendered once: a second load rewrites nothing
    files = {p: p.stat().st_mtime_ns for p in (installed / "generated").rglob("*") if p.is_file()}
    Registry.load()
    assert {p: p.stat().st_mtime_ns for p in (installed / "generated").rglob("*") if p.is_file()} == files


def test_the_stamp_follows_the_spec_content(tmp_path):
    spec = tmp_path / "mine.yaml"
    spec.write_text((SPECS_DIR / "ci.yaml").read_text().replace("name: ci", "name: mine"))
    out = tmp_path / "gen"
    ensure_generated(spec, out)
    stamp = (out / "mine" / STAMP_NAME).read_text()
    man = out / "mine" / "manifest.json"
    n = len(json.loads(man.read_text())["variants"])
    os.utime(man, (1, 1))
    ensure_generated(spec, out)  # same content: not rendered again
    assert man.stat().st_mtime == 1
    spec.write_text(spec.read_text().replace("head_dim: 64", "head_dim: 128"))
    ensure_generated(spec, out)  # changed content: rendered again
    assert (out / "mine" / STAMP_NAME).read_text() != stamp
    assert len(json.loads(man.read_text())["variants"]) == n
    assert all(e["k"] in (32, 128) for e in json.loads(man.read_text())["variants"])


def test_build_into_the_cache_under_its_lock(installed, capfd, monkeypatch):
    gen = ensure_shipped_specs()
    name = sorted(v.name for v in expand(load_spec(SPECS_DIR / "ci.yaml")))[0]
    held = []
    real = kbuild._build_locked

    def spy(spec_name, build_root, *a, **k):
        from filelock import FileLock, Timeout

        try:  # the build holds the folder's lock: nobody else gets it meanwhile
            FileLock(str(build_root / ".kdagen.lock")).acquire(timeout=0)
            held.append(False)
        except Timeout:
            held.append(True)
        return real(spec_name, build_root, *a, **k)

    monkeypatch.setattr(kbuild, "_build_locked", spy)
    man = kbuild.build_spec("ci", names=[name], generated_dir=gen, jobs=1)
    assert held == [True]
    out = capfd.readouterr().out
    assert f"[1/1] check {name}" in out and "kdagen: spec ci done in " in out
    assert (installed / "build" / "ci" / name / "checked.stamp").exists()
    assert man["variants"][name]["cache_key"] == (installed / "build" / "ci" / name / "cache_key").read_text().strip()
    assert Registry.load().status(name) == ("ready", None)
