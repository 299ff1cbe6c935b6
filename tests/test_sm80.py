"""sm80 target: ptxas resource checks (CPU) and numerics against the float64 reference (GPU).

GPU tests build the KdaCall by hand and call Sm80Launcher directly, so they exercise exactly
the launcher and kernels of this target (the runtime's own tests cover selection). Variants
come from the registry (the built sm80 entries of the specs: `make build SPEC=specs/a100.yaml`).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kdagen.abi import KdaCall
from kdagen.variant import Variant

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
TOL = 5e-3


# ----------------------------------------------------------------------------- variants

def _registry_sm80() -> list[tuple[Variant, Path]]:
    try:
        from kdagen.registry import Registry
        from kdagen.paths import ROOT as R
        reg = Registry.load()
    except Exception:
        return []
    out = []
    for name, e in sorted(reg.entries.items()):
        if e.variant.target == "sm80" and e.built and (R / e.built["artifact"]).exists():
            out.append((e.variant, R / e.built["artifact"]))
    return out


def sm80_variants() -> list[tuple[Variant, Path]]:
    return _registry_sm80()


# ----------------------------------------------------------------------------- ptxas (CPU)

def _ptxas_reports() -> list[tuple[str, list[dict]]]:
    """ptxas reports of the sm80 variants the specs name now, from the build manifests
    (folders of variants no longer in a spec are ignored)."""
    import json

    from kdagen.paths import BUILD_DIR, GENERATED_DIR

    out = []
    for gen in sorted(GENERATED_DIR.glob("*/manifest.json")):
        names = {e["name"] for e in json.loads(gen.read_text())["variants"] if e["target"] == "sm80"}
        built = BUILD_DIR / gen.parent.name / "manifest.json"
        if names and built.exists():
            entries = json.loads(built.read_text())["variants"]
            out += [(n, entries[n]["ptxas"]) for n in sorted(names) if n in entries]
    return out


def _check_ptxas(text: str, who: str) -> None:
    from kdagen.build import parse_ptxas

    entries = parse_ptxas(text)
    assert entries, f"{who}: empty ptxas report"
    for e in entries:
        assert e["spill_stores"] == 0 and e["spill_loads"] == 0 and e["stack_bytes"] == 0, f"{who}: {e}"


def test_sm80_ptxas_reports_have_no_spills():
    reports = _ptxas_reports()
    if not reports:
        if shutil.which("nvcc"):
            pytest.fail("no sm80 variant built: run `make build SPEC=specs/a100.yaml` first (CI does)")
        pytest.skip("no nvcc here, so no sm80 build to check")
    for name, entries in reports:
        assert entries, f"{name}: empty ptxas report"
        for e in entries:
            assert e["spill_stores"] == 0 and e["spill_loads"] == 0 and e["stack_bytes"] == 0, f"{name}: {e}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("spec", [
    Variant("sm80", 64, 128, 128, "bf16", "bounded", "fp32", 32),  # largest accepted at K = 128
    Variant("sm80", 64, 64, 64, "bf16", "bounded", "fp32", 64),
    Variant("sm80", 16, 128, 128, "bf16", "precomputed", "fp32", 128),
    Variant("sm80", 16, 64, 64, "fp16", "unbounded", "bf16", 16),
], ids=lambda v: v.name)
def test_sm80_compiles_without_spills(spec: Variant, tmp_path: Path):
    """Render and compile corner variants from scratch (largest and smallest footprints): every
    one must fit the 163 KB shared-memory budget (a static_assert) and spill nothing."""
    from kdagen.generate import render_variant
    from kdagen.targets import TARGETS

    src = tmp_path / "kernel.cu"
    src.write_bytes(render_variant(spec)["kernel.cu"])
    cmd = ["nvcc", *TARGETS["sm80"].nvcc_flags, "-fatbin", "-Xptxas", "-v",
           f"-I{ROOT / 'templates/common'}", f"-I{ROOT / 'templates/sm80'}", str(src), "-o", str(tmp_path / "k.fatbin")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    _check_ptxas(r.stderr, spec.name)


# ----------------------------------------------------------------------------- GPU harness

def _strides(t: torch.Tensor, layout: str):
    return (t.stride(0), t.stride(1), t.stride(2)) if layout == "BSND" else (t.stride(0), t.stride(2), t.stride(1))


def make_inputs(variant: Variant, *, B=1, T=64, H=2, HV=None, lens=None, layout="BSND", gate_scale=None,
                g_mode="randn", dt=0.0, seed=0, device="cuda"):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    HV = HV or H
    K, V = variant.k, variant.v
    dt_ = {"bf16": torch.bfloat16, "fp16": torch.float16}[variant.dtype]
    if lens is not None:
        B, T = 1, sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    def lay(x):  # x is [B, T, heads, D] -> layout
        return x if layout == "BSND" else x.transpose(1, 2).contiguous()

    q = lay(rnd(B, T, H, K)).to(dt_)
    k = lay(rnd(B, T, H, K)).to(dt_)
    v = lay(rnd(B, T, HV, V)).to(dt_)
    if g_mode == "randn":
        g = rnd(B, T, HV, K) * (gate_scale or 1.0)
    elif g_mode == "uniform":
        g = (torch.rand(B, T, HV, K, generator=gen) * 2 - 1) * gate_scale
    else:  # constant
        g = torch.full((B, T, HV, K), float(gate_scale))
    if variant.gate == "precomputed":
        g = -torch.nn.functional.softplus(g) * 0.3  # log-decays <= 0
    g = lay(g).to(dt_)
    beta = rnd(B, T, HV)
    beta = (beta if layout == "BSND" else beta.transpose(1, 2).contiguous()).to(dt_)
    A_log = (torch.rand(HV, generator=gen) * 2 - 1).float()
    dt_bias = (rnd(HV, K) * 0.5 + dt).float()
    cu = None
    if lens is not None:
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    to = lambda x: None if x is None else x.to(device)
    return dict(q=to(q), k=to(k), v=to(v), g=to(g), beta=to(beta), A_log=to(A_log), dt_bias=to(dt_bias),
                cu_seqlens=to(cu), layout=layout, H=H, HV=HV)


def run_sm80(variant: Variant, artifact: Path, inp: dict, *, initial_state=None, output_final_state=True,
             state_layout="VK", chunk_states=False, scale=None, lower_bound=-5.0, use_qk_l2norm=True,
             allow_neg_eigval=False, launcher=None):
    from kdagen.targets.sm80 import Sm80Launcher

    q, k, v, g, beta = inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"]
    layout, H, HV = inp["layout"], inp["H"], inp["HV"]
    K, V = variant.k, variant.v
    dev = q.device
    B = q.shape[0]
    T = q.shape[1] if layout == "BSND" else q.shape[2]
    cu = inp["cu_seqlens"]
    lens = (cu[1:] - cu[:-1]).tolist() if cu is not None else [T] * B
    N = len(lens)
    st_t = {"fp32": torch.float32, "bf16": torch.bfloat16, "none": torch.float32}[variant.state]
    shape = (N, HV, V, K) if state_layout == "VK" else (N, HV, K, V)
    o = torch.full_like(v, float("nan"))
    ht = torch.full(shape, float("nan"), dtype=st_t, device=dev) if (output_final_state and variant.state != "none") else None
    hc = co = None
    if chunk_states:
        C = variant.chunk
        offs = [0]
        for n in lens:
            offs.append(offs[-1] + (n + C - 1) // C)
        co = torch.tensor(offs, dtype=torch.int32, device=dev)
        hc = torch.full((offs[-1], HV, *shape[2:]), float("nan"), dtype=st_t, device=dev)
    gate = variant.gate
    call = KdaCall(
        q=q, k=k, v=v, g=g, beta=beta, o=o,
        q_strides=_strides(q, layout), k_strides=_strides(k, layout), v_strides=_strides(v, layout),
        g_strides=_strides(g, layout), beta_strides=_strides(beta.unsqueeze(-1), layout), o_strides=_strides(o, layout),
        B=B, T=T, N=N, H=H, HV=HV, K=K, V=V, cu_seqlens=cu,
        A_log=inp["A_log"] if gate != "precomputed" else None,
        dt_bias=inp["dt_bias"] if gate != "precomputed" else None,
        scale=scale if scale is not None else K ** -0.5,
        lower_bound=lower_bound if gate == "bounded" else 0.0,
        use_qk_l2norm=use_qk_l2norm, allow_neg_eigval=allow_neg_eigval,
        initial_state=initial_state, final_state=ht, state_kv=state_layout == "KV",
        chunk_states=hc, chunk_offsets=co, max_len=max(lens) if lens else 0,
    )
    (launcher or Sm80Launcher(variant, artifact))(call)
    torch.cuda.synchronize()
    return o, ht, hc


def reference(variant: Variant, inp: dict, *, initial_state=None, state_layout="VK", chunk_states=False,
              lower_bound=-5.0, use_qk_l2norm=True, allow_neg_eigval=False):
    from kdagen.reference import kda_reference

    gate = variant.gate
    return kda_reference(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
        A_log=inp["A_log"] if gate != "precomputed" else None,
        dt_bias=inp["dt_bias"] if gate != "precomputed" else None,
        scale=variant.k ** -0.5, lower_bound=lower_bound if gate == "bounded" else None, gate=gate,
        initial_state=initial_state, output_final_state=True, cu_seqlens=inp["cu_seqlens"],
        layout=inp["layout"], state_layout=state_layout, use_qk_l2norm=use_qk_l2norm,
        allow_neg_eigval=allow_neg_eigval, chunk_states_size=variant.chunk if chunk_states else None)


def check_case(variant, artifact, inp, tol=TOL, **kw):
    from kdagen.reference import rel_rmse

    o, ht, hc = run_sm80(variant, artifact, inp, **kw)
    ref_kw = {key: kw[key] for key in ("initial_state", "state_layout", "chunk_states", "lower_bound",
                                       "use_qk_l2norm", "allow_neg_eigval") if key in kw}
    ro, rh, rc = reference(variant, inp, **ref_kw)
    errs = {"o": rel_rmse(o, ro)}
    if ht is not None:
        errs["state"] = rel_rmse(ht, rh)
    if hc is not None:
        errs["chunk_states"] = rel_rmse(hc, rc)
    bad = {k: e for k, e in errs.items() if not (e <= tol)}
    assert not bad, f"{variant.name}: rel RMSE {errs} > {tol}"
    return errs


# ----------------------------------------------------------------------------- GPU tests

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
VARIANTS = sm80_variants() if HAS_CUDA else []
VIDS = [v.name for v, _ in VARIANTS]


def _initial_state(variant, N, HV, state_layout="VK", seed=1):
    if variant.state == "none":
        return None
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (N, HV, variant.v, variant.k) if state_layout == "VK" else (N, HV, variant.k, variant.v)
    st = {"fp32": torch.float32, "bf16": torch.bfloat16}[variant.state]
    return (torch.randn(*shape, generator=gen) * 0.5).to(st).cuda()


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 15, 16, 17, 63, 64, 65, 1000])
@pytest.mark.parametrize("va", VARIANTS, ids=VIDS)
def test_sm80_lengths(va, T):
    variant, art = va
    inp = make_inputs(variant, T=T, B=2, H=2, HV=4, layout="BSND" if T % 2 else "BNSD", seed=T)
    h0 = _initial_state(variant, 2, 4, "KV" if T % 3 == 0 else "VK")
    check_case(variant, art, inp, initial_state=h0, state_layout="KV" if T % 3 == 0 else "VK", chunk_states=True)


@gpu
@needs_cuda
@pytest.mark.parametrize("gcase", ["c-8", "c-4", "c0", "c8", "u8", "n8", "dt4", "dt-4", "dt8", "dt-8"])
@pytest.mark.parametrize("va", VARIANTS, ids=VIDS)
def test_sm80_gate_sweep(va, gcase):
    variant, art = va
    kw = {"c-8": dict(g_mode="const", gate_scale=-8), "c-4": dict(g_mode="const", gate_scale=-4),
          "c0": dict(g_mode="const", gate_scale=0), "c8": dict(g_mode="const", gate_scale=8),
          "u8": dict(g_mode="uniform", gate_scale=8), "n8": dict(gate_scale=8),
          "dt4": dict(dt=4.0), "dt-4": dict(dt=-4.0), "dt8": dict(dt=8.0), "dt-8": dict(dt=-8.0)}[gcase]
    inp = make_inputs(variant, T=300, H=2, HV=2, **kw)
    check_case(variant, art, inp, initial_state=_initial_state(variant, 1, 2))


@gpu
@needs_cuda
@pytest.mark.parametrize("lens", [[1300, 547, 2048, 963, 271, 3063], [0, 5, 0, 64, 0, 130, 0], [8192]],
                         ids=["varlen6", "empty", "t8192"])
@pytest.mark.parametrize("va", VARIANTS, ids=VIDS)
def test_sm80_varlen(va, lens):
    variant, art = va
    inp = make_inputs(variant, lens=lens, H=1, HV=2, seed=len(lens))
    h0 = _initial_state(variant, len(lens), 2)
    check_case(variant, art, inp, initial_state=h0, chunk_states=True)


SEGMENT_VARIANTS = [va for va in VARIANTS if va[0].state == "fp32" and va[0].k == 128 and va[0].gate == "bounded"
                    and va[0].dtype == "bf16"][:3]


@gpu
@needs_cuda
@pytest.mark.parametrize("state_layout", ["VK", "KV"])
@pytest.mark.parametrize("va", SEGMENT_VARIANTS, ids=[v.name for v, _ in SEGMENT_VARIANTS])
def test_sm80_time_segments_match_one_piece(va, state_layout):
    """Prep of segment s + 1 overlapping the recurrence of segment s (few heads, long sequences)
    gives the one-piece result bit for bit, and both match the reference."""
    from kdagen.targets.sm80 import Sm80Launcher, Sm80Settings

    variant, art = va
    inp = make_inputs(variant, T=1000, B=2, H=2, HV=4, seed=21)
    h0 = _initial_state(variant, 2, 4, state_layout)
    whole = Sm80Launcher(variant, art, Sm80Settings(min_segment_tokens=None))
    split = Sm80Launcher(variant, art, Sm80Settings(min_segment_tokens=192))  # 1000 tokens -> 4 x 256
    tail = Sm80Launcher(variant, art, Sm80Settings(min_segment_tokens=192, last_segment_tokens=64))
    # tail: 256 x 3, 128, then 104 from token 896
    call_kw = dict(initial_state=h0, state_layout=state_layout)
    o1, h1, _ = run_sm80(variant, art, inp, launcher=whole, **call_kw)
    o2, h2, _ = run_sm80(variant, art, inp, launcher=split, **call_kw)
    o3, h3, _ = run_sm80(variant, art, inp, launcher=tail, **call_kw)
    assert (whole.last_segments, split.last_segments, tail.last_segments) == (0, 4, 5)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    assert torch.equal(o1, o3) and torch.equal(h1, h3)
    check_case(variant, art, inp, launcher=split, **call_kw)


def test_sm80_time_segments_plan(monkeypatch):
    """Which calls are cut into time segments (CPU: only the plan)."""
    from types import SimpleNamespace

    import kdagen.targets.sm80 as sm80

    monkeypatch.setattr(sm80, "_sm_count", lambda device: 132)
    var = Variant("sm80", 16, 128, 128, "bf16", "bounded", "fp32", 32)
    la = sm80.Sm80Launcher(var, Path("unused.fatbin"))
    call = lambda **kw: SimpleNamespace(**{**dict(cu_seqlens=None, chunk_states=None, N=1, HV=24,  # noqa: E731
                                                 q=torch.empty(1)), **kw})
    segs = la._segments(call(), var, 65536)  # issue 4's B1 T65536 H24: 96 programs < 132 SMs
    assert segs == [(a, a + 8192) for a in range(0, 65536, 8192)]
    assert la._segments(call(), var, 10000) == [(0, 5056), (5056, 10000)]  # whole chunks
    assert la._segments(call(HV=96), var, 8192) == []  # 384 programs fill the GPU
    assert la._segments(call(cu_seqlens=torch.zeros(2)), var, 65536) == []
    assert la._segments(call(chunk_states=torch.zeros(1)), var, 65536) == []
    assert la._segments(call(), var, 6000) == []  # too short
    la = la.with_settings(last_segment_tokens=2000)  # the last starts on a whole 64 (2048 tokens)
    assert [b - a for a, b in la._segments(call(), var, 65536)] == [9088] * 6 + [8960, 2048]
    la = la.with_settings(min_segment_tokens=192)
    assert la._segments(call(), var, 1000) == [(0, 256), (256, 512), (512, 768), (768, 1000)]  # tail too long
    la = la.with_settings(last_segment_tokens=64)
    assert la._segments(call(), var, 1000) == [(0, 256), (256, 512), (512, 768), (768, 896), (896, 1000)]
    la = la.with_settings(min_segment_tokens=4096)
    assert la._segments(call(), var, 10000) == [(0, 5056), (5056, 10000)]  # too few segments for a tail
    with pytest.raises(ValueError, match=r"Sm80Settings.parts: expected a non-empty subset"):
        la.with_settings(parts=("recurrence",))
    none = Variant("sm80", 16, 128, 128, "bf16", "bounded", "none", 32)
    assert sm80.Sm80Launcher(none, Path("x"))._segments(call(), none, 65536) == []


def test_sm80_shared_memory_check_names_kernel_and_sizes():
    """A device with less shared memory per block than a kernel needs gets a clear refusal."""
    from types import SimpleNamespace

    from kdagen.targets.sm80 import check_shared_memory

    a100 = SimpleNamespace(name="A100", shared_memory_per_block_optin=163 * 1024)
    check_shared_memory("v", {"kda_prep": 150_000, "kda_recur": 163 * 1024}, a100)  # fits exactly
    rtx = SimpleNamespace(name="RTX 4090", shared_memory_per_block_optin=99 * 1024)
    with pytest.raises(RuntimeError, match=r"v: kda_recur needs 146\.5 KB .*RTX 4090 allows 99\.0 KB"):
        check_shared_memory("v", {"kda_prep": 50_000, "kda_recur": 150_000}, rtx)


@pytest.mark.parametrize("total,optin", [(228 * 1024, 227 * 1024), (164 * 1024, 163 * 1024), (100 * 1024, 99 * 1024)],
                         ids=["H100/H200", "A100", "sm86"])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_sm80_recur_shared_memory_leaves_room_for_k_prep_blocks(total, optin, k):
    """In a segmented call a recurrence block claims enough shared memory that k prep blocks,
    not k + 1, fit beside it (1 KB reserved per block); never less than it needs."""
    from types import SimpleNamespace

    from kdagen.targets.sm80 import recur_smem_beside_prep

    props = SimpleNamespace(shared_memory_per_multiprocessor=total, shared_memory_per_block_optin=optin)
    for smem1, smem2 in [(49_600, 72_000), (20_000, 40_000), (30_000, 16_000)]:
        r = recur_smem_beside_prep(smem1, smem2, props, k)
        assert smem2 <= r <= optin
        if smem2 < r < optin:  # the claim is what limits the prep blocks
            assert r + 1024 + k * (smem1 + 1024) <= total < r + 1024 + (k + 1) * (smem1 + 1024)
    assert recur_smem_beside_prep(49_600, 72_000, SimpleNamespace()) == 72_000  # sizes unknown
