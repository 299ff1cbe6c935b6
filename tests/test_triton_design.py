"""The chunk-parallel Triton design (templates/triton/kda_fused.py.j2) beyond the ci matrix.

Variants the specs do not ship (K != V, head dims that are not powers of two) are rendered into
a temporary folder and registered for the test, so every head-dim path runs under the CPU
interpreter against the float64 reference. GPU tests check the production shapes, the
compile time of a first call and that later shapes reuse the compiled kernels.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kdagen.runtime as rt
from kdagen.generate import render_variant, sha256_bytes
from kdagen.paths import GENERATED_DIR, ROOT
from kdagen.registry import Entry
from kdagen.variant import Variant

from .conftest import HAS_CUDA
from kdagen.cases import make_case, run_and_compare

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="interpreter runs only without a GPU"), id="cpu"),
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
]


@pytest.fixture
def variant_of(tmp_path):
    """Render a Triton variant into tmp_path and register it with the runtime for the test."""
    reg = rt.registry()

    def make(**kw) -> Variant:
        fields = dict(target="triton", chunk=16, k=32, v=32, dtype="fp32", gate="bounded", state="fp32", block_v=16)
        fields.update(kw)
        v = Variant(**fields)
        d = tmp_path / v.name
        d.mkdir(exist_ok=True)
        data = render_variant(v)["kernel.py"]
        (d / "kernel.py").write_bytes(data)
        if v.name not in reg.entries:
            reg.entries[v.name] = Entry(v, "test", d, sha256_bytes(data))
        return v

    yield make
    rt.reset()  # the test's entries, launchers and cached plans go; the next call reloads the registry


def _head_dim_cases():
    # On the GPU only the padded dims at chunk 64: every GPU case compiles its own variant, and
    # the ci spec's K != V variants run there in test_triton.py.
    for dev in DEVICES:
        for chunk in (16, 64):
            for k, v, bv in ((32, 64, 32), (64, 32, 16), (48, 80, 16), (16, 16, 16)):
                if dev.id == "cuda" and (chunk == 16 or k in (32, 64)):
                    continue
                yield pytest.param(dev.values[0], chunk, k, v, bv, marks=dev.marks, id=f"{dev.id}-c{chunk}-k{k}-v{v}")


@pytest.mark.parametrize("dev, chunk, k, v, bv", list(_head_dim_cases()))
def test_head_dims_k_ne_v_and_padded(variant_of, dev, chunk, k, v, bv):
    # K != V both ways, and dims that are not powers of two (padded tiles, masked channels);
    # ragged lengths, GQA, varlen with an empty sequence, [K, V] states.
    var = variant_of(chunk=chunk, k=k, v=v, block_v=bv)
    run_and_compare(var, make_case(var, dev, B=2, T=chunk + 7, H=1, HV=2, seed=11))
    kw = make_case(var, dev, lens=[0, 3, chunk + 17], H=2, HV=2, layout="BNSD", state_layout="KV",
                   chunk_states=True, seed=12)
    assert "chunk_states" in run_and_compare(var, kw)


# The fast prep overflows on the chunks it flags (the exact pass redoes them): the interpreter says so.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("chunk", [16, 64])
def test_bf16_exact_diagonal_fallback(variant_of, dev, chunk):
    # exp(A_log) ~ 50, g + dt_bias ~ +4: a_t ~ -200 per step. Every diagonal block spans far
    # more than exp(85), so the 16-bit prep flags every chunk for its exact pass; the result
    # must be finite and as accurate as with mild gates.
    var = variant_of(chunk=chunk, k=32, v=32, dtype="bf16", gate="unbounded")
    kw = make_case(var, dev, B=1, T=2 * chunk + 5, H=1, HV=2, gate_scenario="dt=+4", seed=13)
    kw["A_log"] = torch.full_like(kw["A_log"], 3.9)
    run_and_compare(var, kw)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dev", DEVICES)
def test_bf16_mixed_strong_and_mild_gates(variant_of, dev):
    # One head decays hard (exact path), the other mildly (anchored products): both in one launch.
    var = variant_of(chunk=64, k=32, v=32, dtype="bf16", gate="unbounded")
    kw = make_case(var, dev, B=1, T=150, H=1, HV=2, seed=14)
    kw["A_log"] = torch.tensor([3.9, -1.0], device=kw["A_log"].device)
    run_and_compare(var, kw)


@pytest.mark.parametrize("dev", DEVICES)
def test_chunk_records_of_packed_sequences(variant_of, dev):
    # Sequences starting mid-chunk, of every length class around the sub-block and chunk sizes:
    # each chunk's workspace record (first token // C + sequence index + chunk) must be its own.
    var = variant_of(chunk=64, k=32, v=32, dtype="bf16", state="fp32", block_v=16)
    lens = [1, 15, 16, 17, 0, 33, 63, 64, 65, 130, 2]
    kw = make_case(var, dev, lens=lens, H=1, HV=2, chunk_states=True, seed=15)
    errs = run_and_compare(var, kw)
    assert errs["chunk_states"] < 5e-3


@pytest.mark.parametrize("dev", DEVICES)
def test_fp16_inputs_and_fp32_g_beta(variant_of, dev):
    var = variant_of(chunk=64, k=32, v=32, dtype="fp16", gate="bounded", block_v=32)
    kw = make_case(var, dev, B=1, T=90, H=1, HV=1, seed=16)
    kw["g"] = kw["g"].float()
    kw["beta"] = kw["beta"].float()
    run_and_compare(var, kw)
    kw = make_case(var, dev, B=1, T=90, H=1, HV=1, seed=17)
    kw["g"] = kw["g"].half()
    kw["beta"] = kw["beta"].half()
    run_and_compare(var, kw)


# Launch options that change the generated code's schedule, not its arithmetic (A/B candidates,
# benchmarks/results/2026-12-01_triton_c64_cpu_analysis.md): Gamma_C loaded one chunk ahead, a
# 3-stage recurrence pipeline, other prep warp counts.
LAUNCH_OPTIONS = [
    pytest.param({"recur_gam_next": 1, "recur_stages": 3}, id="gamnext-s3"),
    pytest.param({"recur_gam_next": 1, "prep_warps": 4}, id="gamnext-w4"),
]


@contextlib.contextmanager
def _forced(var: Variant, dev: str, config: dict):
    """The runtime's launcher of `var` on `dev` launches with `config` inside the block."""
    d = torch.empty(0, device=dev).device
    la = rt.registry().launcher(var.name, f"{d.type}:{d.index}")  # the runtime's key
    la.config = dict(config)
    try:
        yield
    finally:
        la.config = None


@pytest.mark.parametrize("config", LAUNCH_OPTIONS)
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.skipif(HAS_CUDA, reason="interpreter runs only without a GPU")
def test_launch_options_keep_the_result(variant_of, chunk, config):
    # Sequences of one chunk, several and none (the one-ahead Gamma_C load at each end), a
    # chunk-state output and an initial state: against the float64 reference, and equal to the
    # default launch's output.
    var = variant_of(chunk=chunk, k=32, v=32, dtype="bf16", block_v=16)
    kw = make_case(var, "cpu", lens=[chunk, 0, 2 * chunk + 9, 5], H=1, HV=2, chunk_states=True, seed=18)
    base = run_and_compare(var, kw)
    with _forced(var, "cpu", config):
        assert run_and_compare(var, kw) == base


def _h800(name: str) -> Variant:
    man = json.loads((GENERATED_DIR / "h800" / "manifest.json").read_text())
    for e in man["variants"]:
        if e["name"] == name:
            return Variant.from_dict(e)
    raise KeyError(name)


PRODUCTION = ["kda_fwd_triton_c16_k128_v128_bf16_gb_sfp32_bv32", "kda_fwd_triton_c64_k128_v128_bf16_gb_sfp32_bv32"]


@pytest.mark.parametrize("name", PRODUCTION)
def test_compiles_for_sm90_with_pipelined_recurrence(name):
    # Ahead-of-time compile (what `kdagen build` runs, no GPU needed) in a clean process: all
    # three kernels compile, no local memory in the PTX, the recurrence's workspace loads are
    # asynchronous copies (software-pipelined: without them each chunk step waits for memory),
    # and neither the prep nor the recurrence spills registers (ptxas' stack frame, read by the
    # build's own check, which must also see a known spill; the exact prep pass may spill).
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT)!r})
        from kdagen.build_step import stack_frames
        from kdagen.paths import GENERATED_DIR
        from kdagen.targets.loader import load_generated_module
        mod = load_generated_module({name!r}, GENERATED_DIR / "h800" / {name!r} / "kernel.py")
        ck = mod.compile_for(90)
        frames = stack_frames(ck)
        out = {{kn: dict(local=k.asm["ptx"].count("st.local"), cp_async=k.asm["ptx"].count("cp.async.cg"),
                        shared=k.metadata.shared, stack=frames[kn]) for kn, k in ck.kernels.items()}}
        # the build's spill check sees what ptxas spills: the chunk-64 prep at 2 warps (280 bytes)
        if "_c64_" in {name!r}:
            out["spilling_prep_stack"] = stack_frames(mod.compile_for(90, prep_warps=2))["kda_prep_kernel"]
        print(json.dumps(out))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    print(info)
    if "_c64_" in name:
        assert info.pop("spilling_prep_stack") > 0, info
    assert set(info) == {"kda_prep_kernel", "kda_prep_exact_kernel", "kda_recur_kernel"}
    assert all(i["local"] == 0 for i in info.values()), info
    assert info["kda_recur_kernel"]["cp_async"] > 0, info
    assert info["kda_recur_kernel"]["shared"] <= 227 * 1024, info
    assert info["kda_prep_kernel"]["stack"] == 0 and info["kda_recur_kernel"]["stack"] == 0, info


@pytest.mark.gpu
@pytest.mark.parametrize("name", PRODUCTION + ["kda_fwd_triton_c64_k128_v128_fp16_gu_sfp32_bv32",
                                                "kda_fwd_triton_c64_k64_v64_bf16_gp_sfp32_bv32"])
def test_gpu_production_shapes(name):
    v = _h800(name)
    run_and_compare(v, make_case(v, "cuda", B=1, T=1500, H=2, HV=4, seed=21))
    run_and_compare(v, make_case(v, "cuda", lens=[700, 0, 1, 1111], H=4, HV=4, layout="BNSD", state_layout="KV",
                                 chunk_states=True, seed=22))


@pytest.mark.gpu
@pytest.mark.parametrize("config", LAUNCH_OPTIONS + [pytest.param({"recur_stages": 4}, id="s4"),
                                                     pytest.param({"prep_warps": 2}, id="w2")])
@pytest.mark.parametrize("name", PRODUCTION)
def test_gpu_production_shapes_with_launch_options(name, config):
    v = _h800(name)
    if config.get("prep_warps") == 2 and v.chunk == 64:
        pytest.skip("chunk-64 prep at 2 warps spills (280 bytes of stack)")
    if config.get("recur_stages") == 4 and v.chunk == 64 and v.k > 64:
        pytest.skip("chunk-64 recurrence at 4 stages: 244 KB of shared memory at K = 128 (H200 2026-12-01), "
                    "over sm_90's 227 KB")
    with _forced(v, "cuda", config):
        run_and_compare(v, make_case(v, "cuda", B=1, T=1500, H=2, HV=4, seed=21))
        run_and_compare(v, make_case(v, "cuda", lens=[700, 0, 1, 1111], H=4, HV=4, layout="BNSD",
                                     state_layout="KV", chunk_states=True, seed=22))


@pytest.mark.gpu
def test_gpu_first_call_compiles_fast_and_later_shapes_reuse_it(tmp_path):
    # A fresh process and Triton cache: the first call of a production variant compiles both
    # kernels in under 10 s, and calls of other shapes (lengths, heads, varlen, layout, with and
    # without states) add no compiled specialisation.
    name = PRODUCTION[1]
    code = textwrap.dedent(f"""
        import json, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import torch
        import kdagen
        from kdagen.runtime import registry
        dev = "cuda"
        def inputs(T, H, lens=None, layout="BSND"):
            if lens: T = sum(lens)
            r = lambda *s: torch.randn(*s, device=dev)
            q, k, v = (r(1, T, H, 128).bfloat16() for _ in range(3))
            g, beta = r(1, T, H, 128).bfloat16(), r(1, T, H).bfloat16()
            kw = dict(A_log=r(H), dt_bias=r(H, 128))
            if layout == "BNSD":
                q, k, v, g, beta = (x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta))
            cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev) if lens else None
            return (q, k, v, g, beta), dict(kw, cu_seqlens=cu, layout=layout)
        a, kw = inputs(300, 2)
        h0 = torch.zeros(1, 2, 128, 128, device=dev)
        registry()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        kdagen.kda_prefill(*a, **kw, initial_state=h0, output_final_state=True, variant={name!r})
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        for T, H, lens, layout, st in [(5000, 3, None, "BSND", True), (77, 8, None, "BNSD", False),
                                       (0, 4, [100, 0, 900], "BSND", True), (64, 1, None, "BSND", False)]:
            a, kw = inputs(T, H, lens, layout)
            N = len(lens) if lens else 1
            if st:
                kw.update(initial_state=torch.randn(N, H, 128, 128, device=dev), output_final_state=True)
            kdagen.kda_prefill(*a, **kw, variant={name!r})
        torch.cuda.synchronize()
        mod = registry().launcher({name!r}, "cuda:0").module
        counts = {{kn: sum(len(c[0]) for c in getattr(mod, kn).device_caches.values())
                   for kn in ("kda_prep_kernel", "kda_recur_kernel")}}
        print(json.dumps(dict(first=first, counts=counts)))
    """)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton_cache"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    print(out)
    assert out["counts"] == {"kda_prep_kernel": 1, "kda_recur_kernel": 1}, out
    assert out["first"] < 10.0, out
