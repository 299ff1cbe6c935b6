"""Ascend target: CANNBot-DSL translation on CPU, the Triton twin's numerics, and an NPU test.

What is checked where:
- every Ascend variant translates to AscendC/MLIR on CPU (no CANN), with the expected number of
  cube matmuls per stage and on-chip buffers within the Ascend 950 capacities;
- the workspace holds one group of chunks: G x heads x per-chunk bytes within the L2 budget, with
  stage 1 still filling the blocks (the plan translate reports, and the kernel's own shapes);
- the same stage decomposition, as the Triton twin, matches the float64 reference under the
  Triton CPU interpreter;
- the kernel itself only on an NPU (``pytest -m npu``, needs torch_npu); not hardware-validated.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import torch

from kdagen.paths import GENERATED_DIR
from kdagen.variant import Variant

from .conftest import HAS_CUDA
from kdagen.cases import make_case, run_and_compare, run_poisoned

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAS_NPU = importlib.util.find_spec("torch_npu") is not None
SPEC_DIR = GENERATED_DIR / "ascend950"
MANIFEST = json.loads((SPEC_DIR / "manifest.json").read_text())
ASCEND_VARIANTS = [Variant.from_dict(e) for e in MANIFEST["variants"] if e["target"] == "ascend"]
TWIN_VARIANTS = [Variant.from_dict(e) for e in MANIFEST["variants"] if e["target"] == "triton_twin"]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="interpreter runs only without a GPU"), id="cpu"),
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
]


def _skip_cuda_k128(v: Variant, dev: str) -> None:
    from kdagen.targets.triton_twin import CUDA_MAX_K

    if dev == "cuda" and v.k > CUDA_MAX_K:
        pytest.skip(f"twin stage 2 at K={v.k} needs more shared memory than a CUDA block has")


def source(variant: Variant) -> pathlib.Path:
    return SPEC_DIR / variant.name / "kernel.py"


def test_every_ascend_variant_has_a_twin_and_is_marked_unvalidated():
    assert ASCEND_VARIANTS, "specs/ascend950.yaml must name Ascend variants"
    twins = {v.name for v in TWIN_VARIANTS}
    for v in ASCEND_VARIANTS:
        assert v.hardware_validated is False
        assert v.name.replace("_ascend_", "_triton_twin_") in twins


# ----------------------------------------------------------------------------- translation

@pytest.mark.parametrize("variant", ASCEND_VARIANTS, ids=lambda v: v.name)
def test_ascend_translates(variant, tmp_path):
    from kdagen.targets import ascend

    src = source(variant)
    facts = ascend.translate(variant, src, tmp_path / "out")
    assert facts["hardware_validated"] is False
    nk = variant.k // 64
    stage1 = 8 + 3 + 1 + 3 + 4 + nk + variant.v // 64   # L/Mqk, powers, seed, Neumann, compose, W, U
    stage2 = 3 + nk                                    # W S^T, Qd S^T, Mqk U, U^T Kr per 64 K columns
    assert (facts["stage1_matmuls"], facts["stage2_matmuls"]) == (stage1, stage2)
    for layout, lf in facts["layouts"].items():
        # one mix kernel split into a cube (AIC) and a vector (AIV) function
        assert len(lf["cube_functions"]) == 1 and len(lf["vector_functions"]) == 1, layout
        assert lf["cube_matmuls"] == stage1 + stage2, layout
        assert lf["vector_matmuls"] == 0
        assert lf["global_syncs"] >= 2           # stage 1 -> stage 2 barrier on both core kinds
        assert lf["vector_exp"] > 0 and lf["ascendc_has_mmad"]
        for mem, cap in lf["capacity_bytes"].items():
            assert 0 < lf["onchip_bytes"].get(mem, 0) <= cap, (layout, mem, lf["onchip_bytes"])
        assert (tmp_path / "out" / layout / "kda_fwd.asc").stat().st_size > 10000
    # the workspace plan: one group of chunks, within the L2 budget, stage 1 filling the blocks
    ws = facts["workspace"]
    per = ws["bytes_per_chunk_head"]
    assert per == ascend.ws_bytes_per_chunk_head(variant.chunk, variant.k, variant.v)
    assert ws["budget_bytes"] <= ws["l2_bytes_assumed"] // 2
    for plan in ws["plans"]:
        hv, g = plan["heads"], plan["group_chunks"]
        assert plan["within_budget"] and plan["workspace_bytes_per_group"] == g * hv * per <= ws["budget_bytes"]
        assert plan["stage1_tasks_per_group"] >= ws["blocks"], plan
        assert plan["groups"] * g >= plan["chunks"] > (plan["groups"] - 1) * g
        assert plan["workspace_bytes_whole_sequence"] > 8 * plan["workspace_bytes_per_group"], plan


def _kernel_module(variant):
    from kdagen.targets.loader import load_generated_module

    return load_generated_module(variant.name, source(variant))


@pytest.mark.parametrize("variant", ASCEND_VARIANTS, ids=lambda v: v.name)
def test_workspace_is_one_group_within_budget(variant):
    from kdagen.targets import ascend

    mod = _kernel_module(variant)
    C, K, V = variant.chunk, variant.k, variant.v
    per = ascend.ws_bytes_per_chunk_head(C, K, V)
    assert mod.WS_BYTES_PER_CHUNK_HEAD == per
    for hv in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128):
        for T in (64, 640, 4096, 65536, 1 << 20):
            nc = T // C
            g = ascend.group_chunks(C, K, V, hv, nc)
            # the buffers the launcher allocates (the kernel's own shapes) are exactly one group
            ws_bytes = sum(4 * r * c for r, c in mod.workspace_shapes(g * hv))
            assert ws_bytes == g * hv * per <= ascend.WORKSPACE_BUDGET, (hv, T, g)
            assert 1 <= g <= nc
            assert g * hv >= min(ascend.BLOCKS, nc * hv), (hv, T, g)       # stage 1 fills the blocks
            n_groups = -(-nc // g)
            # as few groups as the budget allows, and evened out (the last group is not small)
            assert n_groups == -(-nc // min(nc, ascend.WORKSPACE_BUDGET // (hv * per))), (hv, T, g)
            assert nc - (n_groups - 1) * g > g - n_groups, (hv, T, g)
    # G = 1 is the floor: a head count whose single chunk exceeds the budget is reported, not hidden
    huge = ascend.WORKSPACE_BUDGET // per + 1
    assert ascend.group_chunks(C, K, V, huge, 100) == 1
    assert not ascend.workspace_plan(C, K, V, huge, 6400)["within_budget"]


def test_capacity_table_matches_dsl():
    from cannbotdsl.ops import info

    from kdagen.targets import ascend

    table = info._ARCH_MEM_SIZES["dav-3510"]
    assert {m: table[m] for m in ascend.CAPACITY} == ascend.CAPACITY


def test_translate_reports_dsl_errors(tmp_path):
    from kdagen.targets import ascend

    v = ASCEND_VARIANTS[0]
    src = tmp_path / "bad" / "kernel.py"
    src.parent.mkdir()
    src.write_text(source(v).read_text().replace("depth=1, data_format=\"nz\")", "depth=8, data_format=\"nz\")", 1))
    with pytest.raises(ascend.AscendError, match="translation of"):
        ascend.translate(v, src, tmp_path / "out")
    assert (tmp_path / "out" / "translate.log").exists()


# ----------------------------------------------------------------------------- the twin

@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("v", TWIN_VARIANTS, ids=lambda v: v.name)
def test_twin_gqa_ragged(v, dev):
    _skip_cuda_k128(v, dev)
    # GQA, a partial last chunk, two sequences, initial and final state
    run_and_compare(v, make_case(v, dev, B=2, T=100, H=1, HV=2, seed=11))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("v", TWIN_VARIANTS, ids=lambda v: v.name)
def test_twin_varlen_bnsd_kv_state_chunk_states(v, dev):
    _skip_cuda_k128(v, dev)
    kw = make_case(v, dev, lens=[70, 0, 1, 64], H=1, HV=1, layout="BNSD", state_layout="KV",
                   chunk_states=True, seed=12)
    run_and_compare(v, kw)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("v", TWIN_VARIANTS[-1:], ids=lambda v: v.name)
def test_twin_chunk_groups(v, dev, monkeypatch):
    """Groups of 3 and 1 chunks (a sequence crossing a group edge, a short last group, an empty
    sequence) give the result of one group bit for bit; that one matches the reference."""
    _skip_cuda_k128(v, dev)
    import kdagen.runtime as rt
    from kdagen.targets import triton_twin

    kw = make_case(v, dev, lens=[70, 0, 200, 1, 64], H=1, HV=2, layout="BNSD", state_layout="KV",
                   chunk_states=True, seed=13)                    # chunks 2 + 0 + 4 + 1 + 1 = 8
    d = kw["q"].device
    launcher = rt.registry().launcher(v.name, f"{d.type}:{d.index}")
    run_and_compare(v, kw)
    assert launcher.last_group_chunks == 8                       # the budget gives one group here
    outs = {}
    for G in (None, 3, 1):
        monkeypatch.setattr(triton_twin, "GROUP_CHUNKS", G)
        outs[G] = run_poisoned(v, kw)
        assert launcher.last_group_chunks == (G or 8)
    for G in (3, 1):
        for a, b in zip(outs[None], outs[G]):
            assert torch.equal(a, b), G


# ----------------------------------------------------------------------------- on an NPU

@pytest.mark.npu
@pytest.mark.parametrize("group", [None, 3], ids=["one_group", "groups_of_3"])
@pytest.mark.parametrize("variant", ASCEND_VARIANTS, ids=lambda v: v.name)
def test_ascend_kernel_on_npu(variant, group, monkeypatch):  # pragma: no cover - no NPU in CI
    import torch_npu  # noqa: F401

    from kdagen import kda_prefill
    from kdagen.reference import kda_reference
    from kdagen.targets import ascend

    monkeypatch.setattr(ascend, "GROUP_CHUNKS", group)   # 4 chunks: groups of 3 and 1
    kw = make_case(variant, "npu", B=1, T=256, H=2, HV=4, seed=21)
    o, st = kda_prefill(**kw, variant=variant.name)
    torch.npu.synchronize()
    ro, rs, _ = kda_reference(**{n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()})
    torch.testing.assert_close(o.cpu().double(), ro, atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(st.cpu().double(), rs, atol=5e-3, rtol=5e-3)
