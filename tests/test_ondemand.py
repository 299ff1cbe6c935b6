"""Variants no spec lists: canonical names parse back, a call a target supports is generated on
first use into the cache (and found there by the next process), `kdagen build --variant`
makes one ahead of time."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from click.testing import CliRunner

import kdagen
import kdagen.runtime as rt
from kdagen.cache import ONDEMAND_SPEC
from kdagen.cli import main
from kdagen.errors import KdagenError
from kdagen.ondemand import parse_name, unsupported, variants_for
from kdagen.paths import GENERATED_DIR
from kdagen.reference import kda_reference, rel_rmse
from kdagen.registry import Registry
from kdagen.variant import Variant

from .runtime_env import fresh_runtime  # noqa: F401
from .test_runtime_errors import inputs



def test_every_registered_name_parses_back_to_its_variant():
    for name, e in Registry.load(GENERATED_DIR).entries.items():
        v = parse_name(name)
        assert v.name == name and (v.target, v.chunk, v.k, v.v, v.dtype, v.gate, v.state, v.block_v) == \
            (e.variant.target, e.variant.chunk, e.variant.k, e.variant.v, e.variant.dtype, e.variant.gate,
             e.variant.state, e.variant.block_v)


@pytest.mark.parametrize("name, needle", [
    ("kda_fwd_triton_c16_k32", "is not a variant name; expected kda_fwd_<target>_c<chunk>_k<K>_v<V>_"),
    ("kda_fwd_cuda9_c16_k64_v64_bf16_gb_sfp32_bv32", "unknown target 'cuda9'"),
    ("kda_fwd_sm80_c32_k64_v64_bf16_gb_sfp32_bv32", "sm80 has no chunk 32 (it has 16, 64)"),
    ("kda_fwd_sm80_c16_k64_v64_fp32_gb_sfp32_bv32", "sm80 has no dtype fp32 (it has bf16, fp16)"),
    ("kda_fwd_sm80_c64_k128_v128_bf16_gb_sfp32_bv64", "chunk 64 at K = 128 with block_v 64"),
    ("kda_fwd_triton_c16_k32_v32_fp32_gb_sfp32_bv64", "block_v 64 is wider than V = 32"),
    ("kda_fwd_triton_c16_k32_v32_fp32_gx_sfp32_bv16", "is not a variant name"),
])
def test_bad_names(name, needle):
    with pytest.raises(KdagenError) as ei:
        parse_name(name)
    assert needle in str(ei.value), str(ei.value)


def test_variants_a_target_could_make_for_a_call():
    names = [v.name for v in variants_for("triton", dtype="fp32", k=64, v=64, gate="unbounded", state="none")]
    assert "kda_fwd_triton_c16_k64_v64_fp32_gu_snone_bv64" in names and len(names) == 2 * 3 * 2  # c x bv x state
    assert variants_for("sm80", dtype="fp32", k=64, v=64, gate="bounded", state="fp32") == []
    assert variants_for("triton_twin", dtype="bf16", k=64, v=64, gate="bounded", state="fp32") == []  # a twin
    # sm80 offers the precise twin of every chunk-16 variant but where the target refuses it
    # (fp16; K = 256 with block_v 64; block_v 128), so dispatch's precise-first tie-break holds for them too
    sm80 = {v.name for v in variants_for("sm80", dtype="bf16", k=128, v=128, gate="unbounded", state="fp32")}
    assert {n for n in sm80 if n.endswith("_hl")} == \
        {f"kda_fwd_sm80_c16_k128_v128_bf16_gu_sfp32_bv{bv}_hl" for bv in (16, 32, 64)}
    assert {n[:-3] for n in sm80 if n.endswith("_hl")} <= sm80  # each beside its plain twin
    k256 = {v.name for v in variants_for("sm80", dtype="bf16", k=256, v=256, gate="precomputed", state="fp32")}
    assert {n for n in k256 if n.endswith("_hl")} == \
        {f"kda_fwd_sm80_c16_k256_v256_bf16_gp_sfp32_bv{bv}_hl" for bv in (16, 32)}
    assert not any(v.precise for v in variants_for("sm80", dtype="fp16", k=128, v=128, gate="bounded", state="fp32"))
    assert not any(v.precise for v in variants_for("triton", dtype="bf16", k=128, v=128, gate="bounded",
                                                   state="fp32"))
    assert unsupported(Variant("triton", 16, 24, 24, "fp32", "bounded", "fp32", 16)) == \
        "triton has no head dim K 24 (it has 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, " \
        "224, 240, 256)"


def test_a_call_no_spec_lists_is_generated_on_first_use(tmp_path, caplog):
    kw = inputs(K=64, V=64)  # fp32 at K = V = 64: no shipped spec lists it
    kw["initial_state"] = torch.randn(1, 2, 64, 64) * 0.5
    with caplog.at_level(logging.WARNING, logger="kdagen"):
        o, st = kdagen.kda_prefill(**kw, output_final_state=True)
    name = "kda_fwd_triton_c16_k64_v64_fp32_gb_sfp32_bv32"  # the measured preference: chunk 16, block_v 32
    assert next(iter(rt._PLANS.values())).entry.name == name
    assert any(f"no spec lists a variant for dtype=fp32 K=64 V=64" in r.getMessage() and f"generating {name}"
               in r.getMessage() and f"kdagen build --variant {name}" in r.getMessage() for r in caplog.records)
    ro, rs, _ = kda_reference(**kw, output_final_state=True)
    assert rel_rmse(o, ro) < 1e-5 and rel_rmse(st, rs) < 1e-5
    man = json.loads((tmp_path / "cache" / "generated" / ONDEMAND_SPEC / "manifest.json").read_text())
    assert [e["name"] for e in man["variants"]] == [name]
    # the next process finds it registered (no generation, no warning)
    caplog.clear()
    rt.reset()
    assert rt.registry().entries[name].spec == ONDEMAND_SPEC
    with caplog.at_level(logging.WARNING, logger="kdagen"):
        o2, _ = kdagen.kda_prefill(**kw, output_final_state=True)
    assert torch.equal(o, o2) and not caplog.records


def test_build_variant_ahead_of_time(tmp_path):
    name = "kda_fwd_triton_c16_k32_v32_fp32_gu_snone_bv32"  # not in any spec
    res = CliRunner().invoke(main, ["build", "--variant", name, "-j", "1"])
    assert res.exit_code == 0, res.output
    assert f"{ONDEMAND_SPEC}: 1 variant(s) built" in res.output
    built = json.loads((tmp_path / "cache" / "build" / ONDEMAND_SPEC / "manifest.json").read_text())
    assert list(built["variants"]) == [name]
    assert (tmp_path / "cache" / "build" / ONDEMAND_SPEC / name / "checked.stamp").exists()
    res = CliRunner().invoke(main, ["build", "--variant", "kda_fwd_sm80_c16_k32_v32_bf16_gb_sfp32_bv16"])
    assert res.exit_code == 2 and "sm80 has no head dim K 32" in res.output


def test_generation_is_blocked_where_its_compiler_is_missing(monkeypatch):
    import importlib.util

    import kdagen.build as kbuild

    v = parse_name("kda_fwd_sm80_c16_k64_v64_fp16_gu_sfp32_bv16")
    monkeypatch.setattr(kbuild, "nvcc_path", lambda: None)
    assert rt._generate_blocked(v) == ("no spec lists it, and nvcc is not available (PATH, CUDACXX, "
                                       "/usr/local/cuda/bin) to build it (`kdagen build --variant "
                                       "kda_fwd_sm80_c16_k64_v64_fp16_gu_sfp32_bv16` elsewhere)")
    assert rt._generate_blocked(parse_name("kda_fwd_triton_c16_k64_v64_fp16_gu_sfp32_bv16")) is None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "cannbotdsl" else real(n, *a))
    assert kbuild.compiler_reason("ascend") == "the CANNBot-DSL translator (pip install cannbot-dsl) is not installed"
    assert kbuild.compiler_reason("jit") is None
