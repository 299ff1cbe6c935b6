"""64-bit offsets into data tensors in every Triton kernel, read from its TTIR on the CPU.

tests/test_offsets.py runs the kernels past element 2^31 on a GPU; the scan's chain only passes it at
131072 segment-heads (a 26 GB call), which no test runs. kdagen/address_width.py reads the width of
each offset from the compiled kernel instead: the build applies it to the generated Triton variants
(tests/test_build.py), this file to the scan's kernels and the Ascend twin's, and to toy kernels that
show it finds a narrow offset where there is one. Compiles run in a subprocess without
TRITON_INTERPRET (triton.jit reads it at import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from kdagen.paths import GENERATED_DIR, ROOT

# A toy module: the kernel as one would write it (int32 products), and as it must be.
TOY = '''
import triton
import triton.language as tl


@triton.jit
def narrow(x_ptr, y_ptr, offs_ptr, w_ptr, stride, N: tl.constexpr):
    n = tl.program_id(0)
    t0 = tl.load(offs_ptr + n)                   # a table of i32: may be indexed in 32 bits
    r = tl.arange(0, N)
    a = tl.load(x_ptr + t0 * stride + r)         # a tile of x_ptr + i32: wraps
    tl.store(y_ptr + n * stride, tl.sum(a, 0) * tl.load(w_ptr + n))   # y_ptr + i32: wraps; w_ptr is bounded


@triton.jit
def wide(x_ptr, y_ptr, offs_ptr, w_ptr, stride, N: tl.constexpr):
    n = tl.program_id(0)
    t0 = tl.load(offs_ptr + n).to(tl.int64)
    r = tl.arange(0, N)
    row = x_ptr + t0 * stride                    # the 64-bit part first; the tile's i32 part on the moved pointer
    a = tl.load(row + r)
    tl.store(y_ptr + n.to(tl.int64) * stride, tl.sum(a, 0) * tl.load(w_ptr + n))
'''

PROBE = r'''
import json, sys
sys.path.insert(0, {root!r})
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kdagen import address_width
from kdagen.targets.loader import load_generated_module

TARGET = GPUTarget("cuda", 90, 32)


def compile_(fn, types, consts):
    """fn as the JIT sees it at run time: the given pointer and float types, other ints 32-bit."""
    sig = {{a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=TARGET)


def report(k, bounded=()):
    kernel, args = address_width.data_pointers(k.asm["ttir"], bounded)
    offs = address_width.data_offsets(k.asm["ttir"], bounded)
    return dict(args=args, seen=sorted({{o.arg for o in offs}}), narrow=sorted({{(o.arg, o.bits) for o in offs if o.bits != 64}}))


out = {{}}
toy = load_generated_module("toy", {toy!r})
for name, k in toy.compile_for().kernels.items():
    out["toy_" + name] = report(k, toy.BOUNDED_PTRS)
import kdagen.scan.chain as chain
import kdagen.scan.correct as correct
f, b, i = "*fp32", "*bf16", "*i32"
out["chain"] = report(compile_(chain._chain_kernel, dict(A=f, B=f, S0=f, S_in=f, S_out=f, offsets=i),
                               dict(K=128, V=128, BV=16, BJ=32, BK=32)))
out["correct_o"] = report(compile_(correct._correct_kernel, dict(OB=b, OA=b, S_in=f, O=b, run_seg=i, run_start=i,
                                                                 run_end=i, skip=i),
                                   dict(K=128, V=128, BT=32, BV=32, NVB=4, PRECISION="ieee")))
out["correct_cs"] = report(compile_(correct._correct_cs_kernel, dict(BC=f, AC=f, S_in=f, CS=f, seg_rows=i, skip=i),
                                    dict(K=128, V=128, BV=16, BJ=32, BK=32, NVB=8, BS=64)))
twin = load_generated_module({twin_name!r}, {twin_src!r})
ws = {{w: f for w in ("ws_qd", "ws_kr", "ws_w", "ws_u", "ws_m", "ws_gc")}}
out["twin_stage1"] = report(compile_(twin.kda_stage1, dict(q_ptr=b, k_ptr=b, v_ptr=b, g_ptr=b, beta_ptr=b, A_log_ptr=f,
                                                           dt_bias_ptr=f, chunk_info=i, scale="fp32",
                                                           lower_bound="fp32", **ws),
                                     dict(GATE_ID=0, USE_L2=False, BETA_MODE=0, K=twin.K, V=twin.V)),
                            twin.BOUNDED_PTRS)
out["twin_stage2"] = report(compile_(twin.kda_stage2, dict(o_ptr=b, chunk_info=i, seq_chunks=i, st_ptr=f, cs_ptr=f,
                                                           cs_off=i, **ws),
                                     dict(HAS_CS=True, STATE_KV=False, K=twin.K, V=twin.V, BV=twin.BV)),
                            twin.BOUNDED_PTRS)
print(json.dumps(out))
'''

TWIN = "kda_fwd_triton_twin_c64_k64_v64_bf16_gb_sfp32_bv32"  # the twin's size that runs on CUDA GPUs


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _probe(tmp_path: Path) -> dict:
    toy = tmp_path / "toy.py"
    toy.write_text(_toy_variant("narrow, wide"))
    code = PROBE.format(root=str(ROOT), toy=str(toy), twin_name=TWIN,
                        twin_src=str(GENERATED_DIR / "ascend950" / TWIN / "kernel.py"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_every_offset_into_a_data_tensor_is_64_bit(tmp_path):
    got = _probe(tmp_path)
    # the check sees a narrow offset where there is one: x's tile (through its splat) and y's scalar; not
    # the i32 table nor the bounded w; the wide form's tile offset on the moved pointer is not x's
    assert got["toy_narrow"] == dict(args=["x_ptr", "y_ptr"], seen=["x_ptr", "y_ptr"],
                                     narrow=[["x_ptr", 32], ["y_ptr", 32]]), got["toy_narrow"]
    assert got["toy_wide"] == dict(args=["x_ptr", "y_ptr"], seen=["x_ptr", "y_ptr"], narrow=[]), got["toy_wide"]
    # the scan's kernels and the Ascend twin's: every data argument is reached, by 64-bit offsets only
    want_args = {"chain": ["A", "B", "S0", "S_in", "S_out"], "correct_o": ["OB", "OA", "S_in", "O"],
                 "correct_cs": ["BC", "AC", "S_in", "CS"],
                 "twin_stage1": ["q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr"],
                 "twin_stage2": ["o_ptr", "st_ptr", "cs_ptr"]}
    for kernel, args in want_args.items():
        r = got[kernel]
        assert r["args"] == args and r["seen"] == sorted(args), (kernel, r)
        assert r["narrow"] == [], (kernel, r["narrow"])


def _toy_variant(kernels: str) -> str:
    """The toy module as a generated Triton variant: compile_for() as the fused template's (kernels by name)."""
    return TOY + textwrap.dedent(f'''
        BOUNDED_PTRS = ("w_ptr",)


        class Compiled:
            def __init__(self, kernels):
                self.kernels = kernels
                self.asm = {{"ptx": "\\n".join(k.asm["ptx"] for k in kernels.values())}}


        def compile_for(arch=90):
            from triton.backends.compiler import GPUTarget
            from triton.compiler import ASTSource

            sig = dict(x_ptr="*fp32", y_ptr="*fp32", offs_ptr="*i32", w_ptr="*fp32", stride="i32", N="constexpr")
            return Compiled({{fn.__name__: triton.compile(ASTSource(fn=fn, signature=sig, constexprs=dict(N=16)),
                                                          target=GPUTarget("cuda", arch, 32))
                              for fn in ({kernels},)}})
    ''')


def test_the_build_refuses_a_triton_variant_with_a_32_bit_data_offset(tmp_path):
    """kdagen build's Triton step (kdagen.build_step.check_jit) fails on a kernel whose offset into a
    data tensor is i32, and names the kernel and the argument."""
    src, out = tmp_path / "kernel.py", tmp_path / "checked.stamp"
    for kernels, rc in (("narrow, wide", 1), ("wide", 0)):
        src.write_text(_toy_variant(kernels))
        res = subprocess.run([sys.executable, "-m", "kdagen.build_step", "jit", "toy", str(src), str(out)],
                             capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
        assert res.returncode == rc, (kernels, res.stdout, res.stderr[-2000:])
        if rc:
            assert "narrow: x_ptr + an i32 offset" in res.stderr and "narrow: y_ptr + an i32 offset" in res.stderr, \
                res.stderr
            assert "wide:" not in res.stderr and not out.exists(), res.stderr
        else:
            assert out.read_text().splitlines()[1] == "toy: 2 offsets into data tensors, all 64-bit", out.read_text()
