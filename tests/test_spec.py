"""Spec loading, validation errors, expansion and the `kdagen list` command."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from kdagen.cli import main
from kdagen.errors import SpecError
from kdagen.paths import SPECS_DIR
from kdagen.spec import expand, expand_all, load_spec

GOOD = """
name: t
variants:
  - target: triton
    chunk: [16, 64]
    head_dim: [32, [64, 64]]
    dtype: [bf16]
    gate: [bounded, unbounded]
    state: fp32
    block_v: [16, 32]
exclude:
  - when: {chunk: 16, gate: unbounded}
    reason: not needed here
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_expand_is_sorted_deterministic_and_excludes(tmp_path):
    spec = load_spec(write(tmp_path, GOOD))
    kept, dropped = expand_all(spec)
    names = [v.name for v in kept]
    assert names == sorted(names) and len(set(names)) == len(names)
    # 2 chunks x 2 dims x 2 gates x 2 block_v = 16, minus chunk16/unbounded (4) = 12
    assert len(kept) == 12
    assert {d.reason for d in dropped} == {"not needed here"}
    assert all(not (v.chunk == 16 and v.gate == "unbounded") for v in kept)
    assert [v.name for v in expand(load_spec(write(tmp_path, GOOD)))] == names
    assert "kda_fwd_triton_c64_k64_v64_bf16_gb_sfp32_bv32" in names


def test_block_v_wider_than_v_is_dropped_with_reason(tmp_path):
    spec = load_spec(write(tmp_path, GOOD.replace("block_v: [16, 32]", "block_v: [64]")))
    kept, dropped = expand_all(spec)
    assert all(v.v == 64 for v in kept)
    assert any("wider than V = 32" in d.reason for d in dropped)


def test_target_rejects_are_dropped_with_reason(tmp_path):
    text = GOOD.replace("target: triton", "target: sm80").replace("block_v: [16, 32]", "block_v: [32, 128]")
    text = text.replace("head_dim: [32, [64, 64]]", "head_dim: [128]")
    kept, dropped = expand_all(load_spec(write(tmp_path, text)))
    assert not any(v.chunk == 64 and v.block_v == 128 for v in kept)
    assert any(v.chunk == 16 and v.block_v == 128 for v in kept)
    assert any("shared memory" in d.reason for d in dropped)


@pytest.mark.parametrize(
    "change, key, needle",
    [
        (("chunk: [16, 64]", "chunk: [16, 32]"), "variants[0].chunk", "32 is not allowed for target triton; allowed: 16, 64"),
        (("dtype: [bf16]", "dtype: [int8]"), "variants[0].dtype", "allowed: fp32, bf16, fp16"),
        (("target: triton", "target: sm75"), "variants[0].target", "'sm75' is not a target"),
        (("state: fp32", "state: fp32\n    colour: red"), "variants[0].colour", "unknown key"),
        (("name: t", "name: t\nvariant: []"), "variant", "unknown key; allowed: name, description, variants, exclude"),
        (("    gate: [bounded, unbounded]\n", ""), "variants[0].gate", "missing"),
        (("head_dim: [32, [64, 64]]", "head_dim: [[64, 64, 64]]"), "variants[0].head_dim", "pair [K, V]"),
        (("when: {chunk: 16, gate: unbounded}", "when: {colour: red}"), "exclude[0].when.colour", "unknown axis"),
        (("layouts", "layouts"), None, None),
    ],
)
def test_bad_spec_errors_name_file_key_and_allowed(tmp_path, change, key, needle):
    if key is None:  # layouts: a value the target lacks
        text = GOOD.replace("block_v: [16, 32]", "block_v: 16\n    layouts: [bshd]")
        key, needle = "variants[0].layouts", "'bshd' is not supported by target triton; allowed: bnsd, bsnd"
    else:
        text = GOOD.replace(*change)
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as ei:
        load_spec(path)
    msg = str(ei.value)
    assert msg.startswith(f"{path}: {key}: "), msg
    assert needle in msg, msg


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(write(tmp_path, "variants: [\n"))
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "nope.yaml")


def test_cli_reports_spec_error_without_traceback(tmp_path):
    path = write(tmp_path, GOOD.replace("chunk: [16, 64]", "chunk: 48"))
    res = CliRunner().invoke(main, ["list", "--spec", str(path)])
    assert res.exit_code == 2
    assert "kdagen: error:" in res.output and "variants[0].chunk: 48 is not allowed" in res.output
    assert "Traceback" not in res.output


def test_cli_list_verbose_and_filter(tmp_path):
    path = write(tmp_path, GOOD)
    res = CliRunner().invoke(main, ["list", "--spec", str(path), "--filter", "*c64*bv32", "-v"])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("kda_fwd_")]
    assert len(lines) == 4 and all("_c64_" in ln and ln.split()[0].endswith("bv32") for ln in lines)
    res = CliRunner().invoke(main, ["list", "--spec", str(path), "-v"])
    assert "# dropped: 4" in res.output and "not needed here" in res.output


@pytest.mark.parametrize("spec_file", sorted(p.name for p in SPECS_DIR.glob("*.yaml")))
def test_shipped_specs_load_and_expand(spec_file):
    spec = load_spec(SPECS_DIR / spec_file)
    variants = expand(spec)
    assert variants, spec_file
    assert len(variants) < 200, "a spec should not need hundreds of instantiations"


PRECISE = """
name: p
variants:
  - target: sm80
    chunk: [16, 64]
    head_dim: 128
    dtype: bf16
    gate: bounded
    state: fp32
    block_v: 32
    precise: [false, true]
"""


def test_precise_axis_names_expands_and_is_checked(tmp_path):
    """The optional `precise` axis (sm80: o's products in hi + lo) adds "_hl" variants; chunk 64 has no room for
    them (dropped with the reason), a target without it and a non-boolean are errors naming the key; the
    manifest entry of a plain variant is what it was before the field existed."""
    from kdagen.ondemand import parse_name
    from kdagen.variant import Variant

    kept, dropped = expand_all(load_spec(write(tmp_path, PRECISE)))
    names = [v.name for v in kept]
    assert names == ["kda_fwd_sm80_c16_k128_v128_bf16_gb_sfp32_bv32", "kda_fwd_sm80_c16_k128_v128_bf16_gb_sfp32_bv32_hl",
                     "kda_fwd_sm80_c64_k128_v128_bf16_gb_sfp32_bv32"]
    assert [d.variant.name for d in dropped] == ["kda_fwd_sm80_c64_k128_v128_bf16_gb_sfp32_bv32_hl"]
    assert "chunk 16 only" in dropped[0].reason
    kept16, dropped16 = expand_all(load_spec(write(tmp_path, PRECISE.replace("dtype: bf16", "dtype: [bf16, fp16]"))))
    assert "kda_fwd_sm80_c16_k128_v128_fp16_gb_sfp32_bv32" in [v.name for v in kept16]
    assert [d.variant.name for d in dropped16 if "fp16" in d.variant.name] == [
        "kda_fwd_sm80_c16_k128_v128_fp16_gb_sfp32_bv32_hl", "kda_fwd_sm80_c64_k128_v128_fp16_gb_sfp32_bv32_hl"]
    assert "bf16 only" in [d for d in dropped16 if d.variant.name.startswith("kda_fwd_sm80_c16_k128_v128_fp16")][0].reason
    _, dropped256 = expand_all(load_spec(write(tmp_path, PRECISE.replace("head_dim: 128", "head_dim: 256").replace(
        "chunk: [16, 64]", "chunk: 16").replace("block_v: 32", "block_v: [32, 64]"))))
    assert [d.variant.name for d in dropped256] == ["kda_fwd_sm80_c16_k256_v256_bf16_gb_sfp32_bv64_hl"]
    assert "more than 255 registers" in dropped256[0].reason
    kept128, dropped128 = expand_all(load_spec(write(tmp_path, PRECISE.replace("chunk: [16, 64]", "chunk: 16").replace(
        "block_v: 32", "block_v: [64, 128]"))))
    assert [d.variant.name for d in dropped128] == ["kda_fwd_sm80_c16_k128_v128_bf16_gb_sfp32_bv128_hl"]
    assert "spill 8 bytes" in dropped128[0].reason
    assert "kda_fwd_sm80_c16_k128_v128_bf16_gb_sfp32_bv128" in [v.name for v in kept128]
    for v in kept:
        assert parse_name(v.name) == dataclasses.replace(v, layouts=parse_name(v.name).layouts)
        assert Variant.from_dict(v.to_dict()) == v
    assert "precise" not in kept[0].to_dict() and kept[1].to_dict()["precise"] is True
    with pytest.raises(SpecError, match=r"variants\[0\]\.precise.*not allowed for target sm90; allowed: False"):
        load_spec(write(tmp_path, PRECISE.replace("sm80", "sm90").replace("[16, 64]", "16").replace("block_v: 32", "block_v: 64")))
    with pytest.raises(SpecError, match=r"variants\[0\]\.precise.*expected true or false, found 1"):
        load_spec(write(tmp_path, PRECISE.replace("[false, true]", "1")))
