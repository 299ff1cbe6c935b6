"""Generation is deterministic, writes only changed files, and --check finds staleness."""

from __future__ import annotations

import json
import os

from click.testing import CliRunner

from kdagen.cli import main
from kdagen.generate import generate
from kdagen.paths import SPECS_DIR
from kdagen.spec import load_spec


def test_generate_deterministic_and_write_if_different(tmp_path):
    spec = load_spec(SPECS_DIR / "ci.yaml")
    first = generate(spec, tmp_path)
    assert first.written and not first.removed
    root = tmp_path / "ci"
    snapshot = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}
    second = generate(spec, tmp_path)
    assert not second.changed
    for p, (data, mtime) in snapshot.items():
        assert p.read_bytes() == data and p.stat().st_mtime_ns == mtime, p
    man = json.loads((root / "manifest.json").read_text())
    assert [e["name"] for e in man["variants"]] == sorted(e["name"] for e in man["variants"])
    assert all(len(e["source_sha256"]) == 64 for e in man["variants"])
    assert "time" not in json.dumps(man).lower()


def test_check_detects_edits_and_extra_files(tmp_path):
    spec = load_spec(SPECS_DIR / "ci.yaml")
    generate(spec, tmp_path)
    assert not generate(spec, tmp_path, check=True).changed
    victim = next((tmp_path / "ci").glob("*/kernel.py"))
    victim.write_text(victim.read_text() + "# edited\n")
    extra = tmp_path / "ci" / "kda_fwd_old_variant" / "kernel.py"
    extra.parent.mkdir()
    extra.write_text("x = 1\n")
    res = generate(spec, tmp_path, check=True)
    assert victim in res.written and extra in res.removed
    assert victim.read_text().endswith("# edited\n"), "--check must not write"
    generate(spec, tmp_path)
    assert not extra.exists() and not generate(spec, tmp_path, check=True).changed


def test_committed_generated_tree_is_current():
    res = CliRunner().invoke(main, ["generate", "--all", "--check"])
    assert res.exit_code == 0, res.output


def test_generated_kernel_names_its_variant(tmp_path):
    spec = load_spec(SPECS_DIR / "ci.yaml")
    generate(spec, tmp_path)
    for d in sorted((tmp_path / "ci").iterdir()):
        if d.is_dir():
            text = (d / "kernel.py").read_text()
            assert f'NAME = "{d.name}"' in text
            assert os.path.getsize(d / "kernel.py") > 1000
