"""The ninja build: progress lines, manifest, cache keys, ptxas report parsing."""

from __future__ import annotations

import json

import pytest

from kdagen import build as kbuild
from kdagen.errors import BuildError
from kdagen.generate import generate
from kdagen.paths import GENERATED_DIR, SPECS_DIR
from kdagen.spec import expand, load_spec


def test_build_ci_spec_with_ninja(tmp_path, capfd):
    spec = load_spec(SPECS_DIR / "ci.yaml")
    generate(spec)  # the committed tree is current (see test_generate); this is a no-op then
    man = kbuild.build_spec("ci", build_dir=tmp_path, jobs=2)
    out = capfd.readouterr().out
    n = len(expand(spec))
    assert f"[1/{n}]" in out and f"[{n}/{n}]" in out, out
    assert set(man["variants"]) == {v.name for v in expand(spec)}
    for name, entry in man["variants"].items():
        assert (tmp_path / "ci" / name / "cache_key").read_text().strip() == entry["cache_key"]
        # Triton variants are compiled for sm_90 at build time (no GPU needed), every kernel's
        # stack frame read from its cubin (only the SPILL_OK kernels may have one)
        stamp, width = (tmp_path / "ci" / name / "checked.stamp").read_text().splitlines()
        assert stamp.startswith(f"{name}: compiled for sm_90, no local memory (kda_prep_"), stamp
        # and every offset into a data tensor is 64-bit (kdagen/address_width.py): q, k, v, g, beta, o, the
        # workspace and the states, each prep and recurrence kernel at least 5
        checked = int(width.removeprefix(f"{name}: ").split()[0])
        assert width.endswith("offsets into data tensors, all 64-bit") and checked >= 10, width
        # the fp32 chunk-64 recurrence may keep a frame of at most 16 bytes (SPILL_OK, with its reason)
        allowed = {f"kda_recur_kernel stack {n}" for n in (8, 16)} if "_c64_" in name and "_fp32_" in name else set()
        frames = stamp.split("(", 1)[1].rstrip(")\n").split(", ")
        assert all(f.endswith(" stack 0") or f in allowed for f in frames), stamp
    on_disk = json.loads((tmp_path / "ci" / "manifest.json").read_text())
    assert on_disk == man
    # A second build has nothing to do.
    n = len(man["variants"])
    kbuild.build_spec("ci", build_dir=tmp_path, jobs=2)
    assert f"{n} of {n} up to date by content key" in capfd.readouterr().out
    # Nor has one after a copy scrambled the mtimes (artifacts older than their inputs):
    # the content keys decide.
    import os

    for name in man["variants"]:
        art = tmp_path / "ci" / name / "checked.stamp"
        os.utime(art, (1_000_000, 1_000_000))
    kbuild.build_spec("ci", build_dir=tmp_path, jobs=2)
    assert f"{n} of {n} up to date by content key" in capfd.readouterr().out
    # Nor has one from another path (build.ninja's command lines name other absolute paths).
    import shutil

    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "ci", moved / "ci")
    kbuild.build_spec("ci", build_dir=moved, jobs=2)
    out = capfd.readouterr().out
    assert f"{n} of {n} up to date by content key" in out and "[1/" not in out, out
    # A changed key is rebuilt even when the old artifact looks new.
    one = sorted(man["variants"])[0]
    (tmp_path / "ci" / one / "cache_key").write_text("stale\n")
    m = json.loads((tmp_path / "ci" / "manifest.json").read_text())
    m["variants"][one]["cache_key"] = "stale"
    (tmp_path / "ci" / "manifest.json").write_text(json.dumps(m))
    kbuild.build_spec("ci", build_dir=tmp_path, jobs=2)
    assert f"[1/1] check {one}" in capfd.readouterr().out


def test_cache_key_tracks_toolchain_version_and_source(monkeypatch):
    v = expand(load_spec(SPECS_DIR / "ci.yaml"))[0]
    k1 = kbuild.cache_key(v, "a" * 64)
    assert kbuild.cache_key(v, "b" * 64) != k1
    monkeypatch.setattr(kbuild, "__version__", "9.9.9")
    assert kbuild.cache_key(v, "a" * 64) != k1


def test_include_hash_covers_headers_not_documentation(tmp_path, monkeypatch):
    """A header edit makes a target's artifacts stale; an edit of its DESIGN.md does not."""
    (tmp_path / "templates" / "t").mkdir(parents=True)
    hdr, doc = tmp_path / "templates" / "t" / "k.cuh", tmp_path / "templates" / "t" / "DESIGN.md"
    hdr.write_text("// v1\n")
    doc.write_text("# notes\n")
    monkeypatch.setattr(kbuild, "TEMPLATES_DIR", tmp_path / "templates")

    def key() -> str:
        kbuild._include_hash.cache_clear()
        return kbuild._include_hash(("t",))

    try:
        k1 = key()
        doc.write_text("# notes, edited\n")
        assert key() == k1
        hdr.write_text("// v2\n")
        assert key() != k1
    finally:
        kbuild._include_hash.cache_clear()


def test_unknown_spec_and_variant_errors(tmp_path):
    with pytest.raises(BuildError, match="kdagen generate --spec specs/nope.yaml"):
        kbuild.build_spec("nope", build_dir=tmp_path)
    with pytest.raises(BuildError, match="not in spec ci: kda_fwd_bogus"):
        kbuild.build_spec("ci", names=["kda_fwd_bogus"], build_dir=tmp_path)


def test_max_jobs_validation(monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "3")
    assert kbuild.default_jobs() == 3
    monkeypatch.setenv("MAX_JOBS", "lots")
    with pytest.raises(BuildError, match="MAX_JOBS: expected a positive integer, found 'lots'"):
        kbuild.default_jobs()


def test_parse_ptxas_report():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kda_fwd' for 'sm_80'
ptxas info    : Function properties for kda_fwd
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 16384 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'kda_fwd' for 'sm_90'
ptxas info    : Function properties for kda_fwd
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 400 bytes cmem[0]
"""
    r = kbuild.parse_ptxas(log)
    assert [(x["arch"], x["registers"], x["stack_bytes"], x["spill_stores"], x["smem_bytes"]) for x in r] == [
        ("sm_80", 255, 8, 4, 16384), ("sm_90", 168, 0, 0, 0)]


def test_generated_manifest_is_what_the_build_reads():
    man = json.loads((GENERATED_DIR / "ci" / "manifest.json").read_text())
    assert man["spec"] == "ci" and man["spec_file"] == "specs/ci.yaml"


def test_compiler_failure_is_quoted_and_log_kept(tmp_path, monkeypatch, capfd):
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho 'kernel.cu(12): error: identifier \"oops\" is undefined' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(kbuild, "nvcc_path", lambda: str(fake))
    monkeypatch.setattr(kbuild, "nvcc_version", lambda: "V0.0-fake")
    man = json.loads((GENERATED_DIR / "a100" / "manifest.json").read_text())
    name = man["variants"][0]["name"]
    with pytest.raises(BuildError, match="build of spec a100 failed"):
        kbuild.build_spec("a100", names=[name], build_dir=tmp_path / "b", jobs=1)
    out = capfd.readouterr().out
    assert 'identifier "oops" is undefined' in out and f"nvcc {name}" in out
    assert 'identifier "oops"' in (tmp_path / "b" / "a100" / name / "build.log").read_text()


def test_failed_rebuild_leaves_no_artifact_to_trust(tmp_path, monkeypatch, capfd):
    # build, fail a rebuild (another toolchain: another key), then build the first key again: the
    # failure removed the artifact, so the variant is compiled again and its ptxas report (not the
    # failure's log) is what the manifest records
    good, bad = tmp_path / "nvcc_good", tmp_path / "nvcc_bad"
    good.write_text("#!/bin/sh\nout=''\nwhile [ $# -gt 0 ]; do [ \"$1\" = -o ] && out=\"$2\"; shift; done\n"
                    "echo \"ptxas info    : Compiling entry function 'kda_recur' for 'sm_80'\" >&2\n"
                    "echo '    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads' >&2\n"
                    "echo 'ptxas info    : Used 255 registers' >&2\nprintf fatbin > \"$out\"\n")
    bad.write_text("#!/bin/sh\necho 'kernel.cu(13): error: missing binary operator' >&2\nexit 1\n")
    for f in (good, bad):
        f.chmod(0o755)
    man = json.loads((GENERATED_DIR / "a100" / "manifest.json").read_text())
    name = man["variants"][0]["name"]
    art = tmp_path / "b" / "a100" / name / f"{name}.fatbin"

    def build(nvcc, version):
        monkeypatch.setattr(kbuild, "nvcc_path", lambda: str(nvcc))
        monkeypatch.setattr(kbuild, "nvcc_version", lambda: version)
        return kbuild.build_spec("a100", names=[name], build_dir=tmp_path / "b", jobs=1, quiet=True)

    assert build(good, "V0.0-fake")["variants"][name]["ptxas"][0]["spill_stores"] == 8
    with pytest.raises(BuildError, match="build of spec a100 failed"):
        build(bad, "V0.0-other")
    assert not art.exists()
    report = build(good, "V0.0-fake")["variants"][name]["ptxas"]
    assert [(e["kernel"], e["registers"], e["spill_loads"]) for e in report] == [("kda_recur", 255, 8)]
    capfd.readouterr()
