"""Ascend target: the CANNBot-DSL translation, what it says about the kernel, the launcher's
choices, the Triton twin, and the NPU test. The kernel's numerics on the CPU model of the DSL are
in test_ascend_model.py.

Translation facts come from the build of specs/ascend950.yaml (CI builds it before the tests;
here the build is incremental, so a missing or stale variant is translated on the spot).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from kdagen.paths import BUILD_DIR, GENERATED_DIR
from kdagen.variant import Variant

from .conftest import HAS_CUDA
from kdagen.cases import check_chunk_stride, make_case, run_and_compare, run_poisoned

HAS_NPU = importlib.util.find_spec("torch_npu") is not None
SPEC_DIR = GENERATED_DIR / "ascend950"
MANIFEST = json.loads((SPEC_DIR / "manifest.json").read_text())
ASCEND_VARIANTS = [Variant.from_dict(e) for e in MANIFEST["variants"] if e["target"] == "ascend"]
TWIN_VARIANTS = [Variant.from_dict(e) for e in MANIFEST["variants"] if e["target"] == "triton_twin"]
# The twin's block_v only changes its stage-2 grid; one twin per head dim runs on the interpreter.
TWINS_RUN = [v for v in TWIN_VARIANTS if v.block_v == 64]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="interpreter runs only without a GPU"), id="cpu"),
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
]


def source(variant: Variant):
    return SPEC_DIR / variant.name / "kernel.py"


_FACTS: dict[str, dict] = {}


def facts(variant: Variant) -> dict:
    """The translation facts of the variant's build (building it if it is missing or stale)."""
    if variant.name not in _FACTS:
        from kdagen.build import build_spec

        build_spec("ascend950", names=[variant.name], quiet=True)
        path = BUILD_DIR / "ascend950" / variant.name / "translated.json"
        _FACTS[variant.name] = json.loads(path.read_text())
    return _FACTS[variant.name]


# ----------------------------------------------------------------------------- translation

@pytest.mark.parametrize("variant", ASCEND_VARIANTS, ids=lambda v: v.name)
def test_translation_agrees_with_the_cpu_model(variant):
    """On-chip bytes per memory space within the Ascend 950 capacities and equal to what the CPU
    model allocates for the same program; the static cost model from the MLIR equal to the model's
    dynamic counts of one call (FLOPs and bytes per memory path exactly, vector instructions within
    10%: the DSL emits mask and barrier instructions the model does not count one for one)."""
    from kdagen.ascend_sim import dsl
    from kdagen.targets.ascend import CAPACITY, AscendSettings, model_prefill
    from kdagen.targets.ascend_cost import Shape, totals

    f = facts(variant)
    assert f["hardware_validated"] is False
    B, T, HV = 1, 128, 2
    kw = make_case(variant, "cpu", B=B, T=T, H=1, HV=HV, seed=3)
    model_prefill(variant, source(variant), settings=AscendSettings(group_chunks=1, blocks=1), **kw)
    stats, alloc = dsl.LAST_STATS[0], {k.name.lower(): v for k, v in dsl.LAST_ALLOCATED[0].items()}
    dyn = Counter()
    for (_, path), n in stats.bytes.items():
        dyn[path] += n
    for layout, lf in f["layouts"].items():
        assert len(lf["cube_functions"]) == 1 and len(lf["vector_functions"]) == 1, layout
        assert lf["ascendc_has_mmad"] and lf["global_syncs"] >= 2, layout
        for mem, cap in CAPACITY.items():
            assert 0 < lf["onchip_bytes"][mem] <= cap, (layout, mem, lf["onchip_bytes"])
        assert lf["onchip_bytes"] == alloc, (layout, lf["onchip_bytes"], alloc)
        tot = totals(lf["costs"], Shape(B=B, HV=HV, T=T, G=1, NV=variant.v // variant.block_v, blocks=1))
        stat = Counter()
        for unit, c in tot.items():
            for k, n in c.items():
                if k.startswith("bytes:"):
                    stat[k[6:]] += n * (2 if unit == "vector" else 1)   # both vector subblocks copy
        assert stat == dyn, (layout, stat, dyn)
        assert tot["cube"]["cube_flops"] == sum(stats.cube_flops.values()), layout
        vec = sum(stats.vector_ops.values())
        assert abs(tot["vector"]["vector_instr"] - vec) <= 0.1 * vec, (layout, tot["vector"]["vector_instr"], vec)
        assert "bytes_unresolved" not in tot["cube"] and "bytes_unresolved" not in tot["vector"], layout


def test_estimates_cover_the_seed_configurations_once():
    """Every (N, S) of the seed's table has an estimate from the one K = 128 variant selection
    runs there, with its parts adding up; the two the seed reports are compared in the summary."""
    from kdagen.targets.ascend_cost import SEED_HEADS, SEED_LENGTHS

    chosen: dict[tuple, dict] = {}
    for v in ASCEND_VARIANTS:
        rows = facts(v).get("estimates", [])
        assert bool(rows) == (v.k == 128), v.name
        for r in rows:
            if r["selected"]:
                assert (r["N"], r["S"]) not in chosen, (v.name, r)
                chosen[(r["N"], r["S"])] = r
    assert set(chosen) == {(n, s) for n in SEED_HEADS for s in SEED_LENGTHS}
    for r in chosen.values():
        assert 0 < r["stage1_ms"] and 0 < r["stage2_ms"] and 0 < r["sync_ms"]
        assert r["ms"] >= max(r["stage1_ms"] + r["stage2_ms"] + r["sync_ms"], r["bandwidth_floor_ms"]) - 2e-3
    # time grows with the sequence at every head count
    for n in SEED_HEADS:
        ms = [chosen[(n, s)]["ms"] for s in SEED_LENGTHS]
        assert ms == sorted(ms), (n, ms)
    summaries = "\n".join(facts(v).get("summary", "") for v in ASCEND_VARIANTS)
    assert summaries.count("(seed's kernel: 6.338 ms)") == 1 and summaries.count("(seed's kernel: 4.018 ms)") == 1


def test_translate_reports_dsl_errors(tmp_path):
    from kdagen.targets import ascend

    v = ASCEND_VARIANTS[0]
    src = tmp_path / "bad" / "kernel.py"
    src.parent.mkdir()
    text = source(v).read_text()
    assert "depth=2, kind=CC)" in text
    src.write_text(text.replace("depth=2, kind=CC)", "depth=9, kind=CC)", 1))   # cross-core depth <= 8
    with pytest.raises(ascend.AscendError, match="translation of"):
        ascend.translate(v, src, tmp_path / "out")
    assert "depth must be <= 8" in (tmp_path / "out" / "translate.log").read_text()


@pytest.mark.parametrize("variant", ASCEND_VARIANTS, ids=lambda v: v.name)
def test_global_memory_offsets_are_64_bit(variant):
    """Every global-memory address the translated AscendC forms is gmN + an int64 offset computed
    without a 32-bit value or cast on the way: an ordinary long prefill's element offsets pass 2^31
    (tests/test_offsets.py checks the CUDA and Triton kernels there; no NPU runs here)."""
    from kdagen.targets.ascend import LAYOUTS, gm_offset_facts

    facts(variant)  # (built and current)
    for layout in LAYOUTS:
        got = gm_offset_facts((BUILD_DIR / "ascend950" / variant.name / layout / "kda_fwd.asc").read_text())
        # q k v g beta o, the states, the identity and six workspaces: each read or written at least once
        assert got["offsets"] >= 17, (layout, got)
        assert set(got["by_type"]) <= {"int64_t", "uint64_t", "literal"}, (layout, got["by_type"])
        assert got["narrow"] == [], (layout, got["narrow"][:5])


def test_gm_offset_facts_trace_narrow_values():
    from kdagen.targets.ascend import gm_offset_facts

    asc = """
        int32_t a = b * 4;
        int64_t t = a + 1;
        copy(gm3 + t, 64);
        int64_t u = (int64_t)((uint32_t)x * (uint32_t)16);
        copy((__gm__ float*)gm4 + u, 64);
        for (int32_t i = 0; i < n; ++i) {
            int64_t w = i * 2;
            copy(gm5 + w, 64);
        }
        int64_t z = s * 8;
        copy(gm6 + z, gm7 + 0);
    """
    got = gm_offset_facts(asc)
    assert got["by_type"] == {"int64_t": 4, "literal": 1}
    assert [n.split(":")[0] for n in got["narrow"]] == ["t", "u", "w"]
    # and on a real translation: one offset's declaration narrowed is found
    v = ASCEND_VARIANTS[0]
    facts(v)
    real = (BUILD_DIR / "ascend950" / v.name / "bsnd" / "kda_fwd.asc").read_text()
    first = re.search(r"\bgm\d+ \+ (t\d+)", real).group(1)
    assert f"int64_t {first} = " in real
    assert gm_offset_facts(real)["narrow"] == []
    assert gm_offset_facts(real.replace(f"int64_t {first} = ", f"int32_t {first} = "))["narrow"]


def test_capacity_table_matches_dsl():
    from cannbotdsl.ops import info

    from kdagen.targets import ascend

    table = info._ARCH_MEM_SIZES["dav-3510"]
    assert {m: table[m] for m in ascend.CAPACITY} == ascend.CAPACITY


# ----------------------------------------------------------------------------- launcher choices

def test_group_size_fits_the_budget_and_fills_the_blocks():
    """group_chunks: one group's workspace (the kernel's own shapes) within the L2 budget, as few
    groups as that allows, groups evened out, and stage 1 with a task for every block."""
    from kdagen.ascend_sim import load_kernel_module
    from kdagen.targets import ascend

    for v in ASCEND_VARIANTS:
        mod = load_kernel_module(source(v))
        C, K, V = v.chunk, v.k, v.v
        per = ascend.ws_bytes_per_chunk_head(C, K, V)
        for heads in (1, 2, 4, 8, 24, 48, 96, 128):
            for T in (64, 640, 4096, 65536, 1 << 20):
                nc = T // C
                g = ascend.group_chunks(C, K, V, heads, nc)
                n_groups = -(-nc // g)
                assert sum(4 * r * c for r, c in mod.workspace_shapes(g * heads)) == g * heads * per <= ascend.WORKSPACE_BUDGET
                assert g * heads >= min(ascend.BLOCKS, nc * heads), (heads, T, g)
                if n_groups > 1:   # one group fewer would not fit
                    assert -(-nc // (n_groups - 1)) * heads * per > ascend.WORKSPACE_BUDGET, (heads, T, g)
                assert g - (nc - (n_groups - 1) * g) < n_groups, (heads, T, g)   # the last group is not short
    huge = ascend.WORKSPACE_BUDGET // ascend.ws_bytes_per_chunk_head(64, 128, 128) + 1
    assert ascend.group_chunks(64, 128, 128, huge, 100) == 1
    assert not ascend.workspace_plan(64, 128, 128, huge, 6400)["within_budget"]


def test_selection_reproduces_the_seeds_dv_split():
    """On an NPU, selection among the block_v variants follows the seed's get_dv_base_config:
    16, 32, 64, 128 for B x HV up to 4, 8, 16, and beyond (V = 128)."""
    from kdagen.inputs import CallInfo
    from kdagen.select import select

    k128 = [v for v in ASCEND_VARIANTS if v.k == 128]
    assert sorted(v.block_v for v in k128) == [16, 32, 64, 128]
    npu = SimpleNamespace(type="npu", index=0)
    for bh in range(1, 65):
        for B, HV in ((1, bh), (bh, 1)):
            c = CallInfo(device=npu, dtype="bf16", layout="bsnd", B=B, T=4096, N=B, H=HV, HV=HV, K=128, V=128,
                         gate="bounded", state="fp32", varlen=False, chunk_size=None, max_len=4096,
                         cu_seqlens_host=None)
            want = 16 if bh <= 4 else 32 if bh <= 8 else 64 if bh <= 16 else 128
            assert select(k128, c).block_v == want, (B, HV)


def test_launcher_rejects_what_the_kernel_does_not_do():
    from kdagen.targets.ascend import AscendError, AscendLauncher, AscendSettings, model_prefill

    v = next(v for v in ASCEND_VARIANTS if v.k == 64)
    kw = make_case(v, "cpu", B=1, T=100, H=1, HV=1, seed=4)
    with pytest.raises(AscendError, match="multiple of the chunk 64"):
        model_prefill(v, source(v), **kw)
    kw = make_case(v, "cpu", B=1, T=64, H=1, HV=1, seed=4, state_layout="KV")
    with pytest.raises(AscendError, match=r"state layout \[K,V\]"):
        model_prefill(v, source(v), **kw)
    with pytest.raises(AscendError, match="backend: expected 'npu' or 'model'"):
        AscendLauncher(v, source(v), dataclasses.replace(AscendSettings(), backend="gpu")).module()


# ----------------------------------------------------------------------------- the twin

def _skip_cuda_k128(v: Variant, dev: str) -> None:
    from kdagen.targets.triton_twin import CUDA_MAX_K

    if dev == "cuda" and v.k > CUDA_MAX_K:
        pytest.skip(f"twin stage 2 at K={v.k} needs more shared memory than a CUDA block has")


def test_every_ascend_variant_has_a_twin():
    twins = {v.name for v in TWIN_VARIANTS}
    assert {v.name.replace("_ascend_", "_triton_twin_") for v in ASCEND_VARIANTS} == twins


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("beta_prob", [False, True], ids=["beta_logits", "beta_prob"])
@pytest.mark.parametrize("v", TWINS_RUN, ids=lambda v: v.name)
def test_twin_gqa_ragged(v, beta_prob, dev):
    _skip_cuda_k128(v, dev)
    # GQA, a partial last chunk, two sequences, initial and final state; beta as logits or as b itself
    run_and_compare(v, make_case(v, dev, B=2, T=100, H=1, HV=2, beta_prob=beta_prob, seed=11))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("v", TWINS_RUN, ids=lambda v: v.name)
def test_twin_varlen_bnsd_kv_state_chunk_states(v, dev):
    _skip_cuda_k128(v, dev)
    kw = make_case(v, dev, lens=[70, 0, 1, 64], H=1, HV=1, layout="BNSD", state_layout="KV",
                   chunk_states=True, seed=12)
    run_and_compare(v, kw)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("v", TWINS_RUN[-1:], ids=lambda v: v.name)
def test_twin_chunk_state_stride(v, dev):
    """The twin keeps every m-th chunk state (return_chunk_states=m) across its chunk groups."""
    _skip_cuda_k128(v, dev)
    import kdagen.runtime as rt
    from kdagen.targets.triton_twin import TwinSettings

    lens = [70, 0, 200, 1, 64, 330]
    kw = make_case(v, dev, lens=lens, H=1, HV=2, chunk_states=True, seed=14)
    d = kw["q"].device
    launcher = rt.registry().launcher(v.name, f"{d.type}:{d.index}")
    saved = launcher.settings
    try:
        for G in (None, 3):  # one group; groups of 3 chunks, which sequences cross
            launcher.settings = TwinSettings(group_chunks=G)
            check_chunk_stride(v, kw, lens)
    finally:
        launcher.settings = saved


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("v", TWINS_RUN[-1:], ids=lambda v: v.name)
def test_twin_chunk_groups(v, dev):
    """Groups of 3 and 1 chunks (a sequence crossing a group edge, a short last group, an empty
    sequence) give the result of one group bit for bit; that one matches the reference."""
    _skip_cuda_k128(v, dev)
    import kdagen.runtime as rt
    from kdagen.targets.triton_twin import TwinSettings

    kw = make_case(v, dev, lens=[70, 0, 200, 1, 64], H=1, HV=2, layout="BNSD", state_layout="KV",
                   chunk_states=True, seed=13)                    # chunks 2 + 0 + 4 + 1 + 1 = 8
    d = kw["q"].device
    launcher = rt.registry().launcher(v.name, f"{d.type}:{d.index}")
    run_and_compare(v, kw)
    assert launcher.last_group_chunks == 8                       # the budget gives one group here
    saved = launcher.settings
    outs = {}
    try:
        for G in (None, 3, 1):
            launcher.settings = TwinSettings(group_chunks=G)
            outs[G] = run_poisoned(v, kw)
            assert launcher.last_group_chunks == (G or 8)
    finally:
        launcher.settings = saved
    for G in (3, 1):
        for a, b in zip(outs[None], outs[G]):
            assert torch.equal(a, b), G


# ----------------------------------------------------------------------------- on an NPU

@pytest.mark.npu
@pytest.mark.parametrize("layout", ["BSND", "BNSD"])
@pytest.mark.parametrize("group", [None, 3], ids=["one_group", "groups_of_3"])
@pytest.mark.parametrize("variant", ASCEND_VARIANTS, ids=lambda v: v.name)
def test_ascend_kernel_on_npu(variant, group, layout):  # pragma: no cover - no NPU in CI
    import torch_npu  # noqa: F401

    import kdagen.runtime as rt
    from kdagen.targets.ascend import AscendSettings

    kw = make_case(variant, "npu", B=2, T=256, H=2, HV=4, layout=layout, seed=21)   # 4 chunks: groups of 3 and 1
    h0 = kw["initial_state"].clone()
    launcher = rt.registry().launcher(variant.name, f"npu:{kw['q'].device.index}")
    saved = launcher.settings
    try:
        launcher.settings = AscendSettings(group_chunks=group)
        run_and_compare(variant, kw)
    finally:
        launcher.settings = saved
    torch.npu.synchronize()
    assert torch.equal(kw["initial_state"], h0), "the kernel modified the initial state"


def test_dispatch_rejects_twin_variants_above_their_cuda_head_dim():
    """A twin variant with K above what it runs on CUDA is rejected with the reason (the bench and
    dispatch read the same rejection), and the launcher's guard reads the same limit."""
    from kdagen.select import variant_device_reason
    from kdagen.targets.triton_twin import CUDA_MAX_K

    big = next(v for v in TWIN_VARIANTS if v.k > CUDA_MAX_K)
    small = next(v for v in TWIN_VARIANTS if v.k <= CUDA_MAX_K)
    why = variant_device_reason(big, torch.device("cuda", 0))
    assert why == (f"triton_twin runs K <= 64 on cuda (its stage 2 needs more shared memory than a CUDA block "
                   f"has), the variant has K={big.k}")
    assert variant_device_reason(small, torch.device("cuda", 0)) is None
    assert variant_device_reason(big, torch.device("cpu")) is None
