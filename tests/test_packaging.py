"""What ships in the wheel: every templates/ folder and every spec as package data (CI also
builds the wheel and runs it from outside the source tree: .ci/run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kdagen import paths

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_template_folder_and_spec_is_package_data():
    st = _pyproject()["tool"]["setuptools"]
    assert st["package-dir"]["kdagen.templates"] == "templates" and st["package-dir"]["kdagen.specs"] == "specs"
    for d in sorted(p for p in (ROOT / "templates").iterdir() if p.is_dir() and p.name != "__pycache__"):
        pkg = f"kdagen.templates.{d.name}"
        assert pkg in st["packages"], f"templates/{d.name} is not shipped: add {pkg} to pyproject.toml"
        globs = st["package-data"][pkg]
        for f in d.iterdir():
            if f.is_file():
                assert any(f.match(g) for g in globs), f"{f.relative_to(ROOT)} matches no package-data glob of {pkg}"
    assert st["package-data"]["kdagen.specs"] == ["*.yaml"]


def test_checkout_paths_and_cache_layout(monkeypatch, tmp_path):
    assert paths.SOURCE_TREE == ROOT and paths.TEMPLATES_DIR == ROOT / "templates"
    assert paths.SPECS_DIR == ROOT / "specs" and paths.SOURCE_GENERATED_DIR == ROOT / "generated"
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(tmp_path / "c"))
    assert paths.generated_dir_for(ROOT / "specs" / "ci.yaml") == ROOT / "generated"
    assert paths.generated_dir_for(tmp_path / "mine.yaml") == tmp_path / "c" / "generated"
    # the checkout's builds go to the cache when KDAGEN_CACHE_DIR is set, else to build/
    assert paths.build_dir_for(ROOT / "generated") == tmp_path / "c" / "build"
    monkeypatch.delenv("KDAGEN_CACHE_DIR")
    assert paths.build_dir_for(ROOT / "generated") == ROOT / "build"
    assert paths.build_dir_for(tmp_path / "x" / "generated") == tmp_path / "x" / "build"


def test_every_python_subpackage_of_kdagen_ships():
    st = _pyproject()["tool"]["setuptools"]
    for init in sorted((ROOT / "kdagen").rglob("__init__.py")):
        pkg = ".".join(init.parent.relative_to(ROOT).parts)
        assert pkg in st["packages"], f"{pkg} is not shipped: add it to [tool.setuptools] packages in pyproject.toml"


def test_shipped_tuning_files_are_package_data_and_valid():
    """kdagen/tuning_data/*.json ships in the wheel; each file there is a valid tuning file named
    by the slug of the GPU name it was made on (the name dispatch looks it up by)."""
    from kdagen import tuning

    st = _pyproject()["tool"]["setuptools"]
    assert "kdagen.tuning_data" in st["packages"]
    assert st["package-data"]["kdagen.tuning_data"] == ["*.json"]
    assert tuning.SHIPPED_DIR == ROOT / "kdagen" / "tuning_data"
    for f in sorted(tuning.SHIPPED_DIR.iterdir()):
        if f.name in ("README.md", "__pycache__"):
            continue
        assert f.suffix == ".json", f"{f.relative_to(ROOT)} matches no package-data glob of kdagen.tuning_data"
        t = tuning.load(f)
        assert f.name == f"{tuning.slug(t.gpu)}.json", f"{f.relative_to(ROOT)} was made on {t.gpu!r}"
        assert t.rules, f"{f.relative_to(ROOT)} has no rules"
