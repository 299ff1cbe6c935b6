"""Step 3 of mode "correct" for o: o = o_B + o_A S_in^T per segment, in one pass over step 1's o.

Step 1 runs every segment twice over the caller's tensors (kdagen.scan.engine.maps_step): B, the
from-zero run, and A, the transition run from the identity with v = 0. o is affine in the entering
state: o = o_B + o_A S_in^T. The torch form (kdagen.scan.engine.correct_step) makes fp32 copies of
both and one einsum per segment; this Triton kernel reads o_B and o_A once and writes o in their
dtype. A program per (run of GT tokens inside one segment, head, V block) keeps S_in's rows for
its V block and walks its tokens BT at a time; the run table is built on the host.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import Tensor

from .chain import triton_takes
from .layout import host_to_device

__all__ = ["correct_o_fits", "correct_o_triton"]

try:  # Triton is optional at run time (the torch form needs none)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None

# Launch: (tokens per product tile, tokens per program, V rows per program, warps, pipeline
# stages). A program keeps its (segment, head)'s S_in rows (in shared memory, as the product's
# operand) and walks its tokens tile by tile. The fastest of eight swept on the H200 at 512K
# tokens, 8 heads: 1.11 ms (2.9 TB/s), where torch.add(o_B, o_A) took 0.74 (benchmarks/NOTES.md,
# session 29).
CONFIG = (64, 1024, 64, 4, 3)


if triton is not None:

    @triton.jit
    def _correct_kernel(OB, OA, S_in, O, run_seg, run_start, run_end, skip, HV, TS, K: tl.constexpr, V: tl.constexpr,
                        BT: tl.constexpr, BV: tl.constexpr, NVB: tl.constexpr, PRECISION: tl.constexpr):
        # V blocks of one run are adjacent programs, so o_A's second read comes from L2
        i = tl.program_id(0) // NVB
        vb = tl.program_id(0) % NVB
        h = tl.program_id(1)
        s = tl.load(run_seg + i)
        t0 = tl.load(run_start + i)
        t1 = tl.load(run_end + i)
        rv = vb * BV + tl.arange(0, BV)
        rk = tl.arange(0, K)
        apply = tl.load(skip + s) == 0
        # S_in[s, h] rows rv: [BV, K], read once per program (rows contiguous in memory).
        st = tl.load(S_in + (s.to(tl.int64) * HV + h) * V * K + rv[:, None] * K + rk[None, :], mask=apply, other=0.0)
        stT = tl.trans(st)
        # Two loops, the branch outside them: Triton pipelines the loads of a loop without one.
        if apply:
            for t in range(t0, t1, BT):
                rt = t + tl.arange(0, BT)
                mt = rt < t1
                # o_B, o_A: token stride TS (2 HV V for the twin launch's halves), o: [T, HV, V] contiguous
                row = rt.to(tl.int64)[:, None] * TS + h * V
                out = rt.to(tl.int64)[:, None] * (HV * V) + h * V
                acc = tl.load(OB + row + rv[None, :], mask=mt[:, None], other=0.0)
                oa = tl.load(OA + row + rk[None, :], mask=mt[:, None], other=0.0)
                acc = tl.dot(oa.to(tl.float32), stT, acc.to(tl.float32), input_precision=PRECISION)
                tl.store(O + out + rv[None, :], acc.to(O.dtype.element_ty), mask=mt[:, None])
        else:
            for t in range(t0, t1, BT):
                rt = t + tl.arange(0, BT)
                mt = rt < t1
                row = rt.to(tl.int64)[:, None] * TS + h * V
                out = rt.to(tl.int64)[:, None] * (HV * V) + h * V
                ob = tl.load(OB + row + rv[None, :], mask=mt[:, None], other=0.0)
                tl.store(O + out + rv[None, :], ob.to(O.dtype.element_ty), mask=mt[:, None])


def correct_o_fits(oB: Tensor, S_in: Tensor) -> bool:
    """Whether the kernel takes these shapes here: power-of-two V = K >= 16, on a GPU or the
    Triton interpreter."""
    if S_in.dtype != torch.float32 or oB.dim() != 4 or S_in.dim() != 4:
        return False
    K, V = S_in.shape[-1], S_in.shape[-2]
    return K == V and oB.shape[-1] == V and triton_takes(oB, K)


@functools.lru_cache(maxsize=64)
def _tables(bounds: tuple[int, ...], skip: tuple[bool, ...], GT: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """On `device`: [3, runs] int32, each program's segment, first token and end (GT tokens, none
    across segments), and the segments' skip flags. Cached: a context-parallel rank repeats its
    layout every call, and building the table on the host took about a millisecond with the GPU
    idle behind it (torch.profiler on the H200, benchmarks/NOTES.md, session 29). Read-only."""
    seg: list[int] = []
    start: list[int] = []
    end: list[int] = []
    for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        firsts = range(lo, hi, GT)
        seg += [s] * len(firsts)
        start += firsts
        end += [min(a + GT, hi) for a in firsts]
    table = torch.tensor([seg, start, end], dtype=torch.int32)
    return host_to_device(table, device), host_to_device([int(x) for x in skip], device)


def correct_o_triton(oB: Tensor, oA: Tensor, S_in: Tensor, bounds: Sequence[int], skip: Sequence[bool],
                     config: Optional[tuple[int, int, int, int, int]] = None) -> Tensor:
    """o [1, T, HV, V] (contiguous) in o_B's dtype from step 1's o_B and o_A [1, T, HV, V] (read in
    place where both have one token stride and rows of V contiguous values): segment s (tokens
    [bounds[s], bounds[s+1])) gets o_B + o_A S_in[s]^T, or o_B alone where skip[s] (its entering
    state was applied in step 1). S_in [S, HV, V, K] fp32. config: CONFIG's fields (for timing)."""
    if not correct_o_fits(oB, S_in):
        raise ValueError(f"oB, S_in: the Triton correction needs V = K a power of two >= 16 and fp32 S_in, on a GPU "
                         f"or the interpreter; found oB {tuple(oB.shape)} on {oB.device}, S_in {tuple(S_in.shape)} "
                         f"{S_in.dtype}")
    S, HV, V, K = S_in.shape
    T = oB.shape[1]
    if (tuple(oB.shape) != (1, T, HV, V) or oA.shape != oB.shape or oA.dtype != oB.dtype or len(bounds) != S + 1
            or bounds[-1] != T or len(skip) != S):
        raise ValueError(f"oB, oA, bounds, skip: expected oB and oA [1, T, {HV}, {V}] of one dtype, bounds of {S} "
                         f"segments ending at T and {S} skip flags; found oB {tuple(oB.shape)} {oB.dtype}, oA "
                         f"{tuple(oA.shape)} {oA.dtype}, bounds ending at {bounds[-1]} ({len(bounds)}), {len(skip)} "
                         "skip flags")
    if oB.stride()[1:] != (oB.stride(1), V, 1) or oA.stride() != oB.stride():
        oB, oA = oB.contiguous(), oA.contiguous()
    o = torch.empty(oB.shape, dtype=oB.dtype, device=oB.device)
    BT, GT, BV, warps, stages = config or CONFIG
    BV = min(BV, V)
    table, flags = _tables(tuple(int(x) for x in bounds), tuple(bool(x) for x in skip), max(GT, BT) // BT * BT,
                           oB.device)
    if not table.shape[1] or not HV:
        return o
    # o_A carries its dtype's rounding (bf16 2^-9, fp16 2^-11): TF32's rounding of S_in adds no more.
    # An fp32 o_A keeps IEEE products.
    precision = "ieee" if oB.dtype == torch.float32 else "tf32"
    _correct_kernel[(table.shape[1] * (V // BV), HV)](oB, oA, S_in.contiguous(), o, table[0], table[1], table[2],
                                                      flags, HV, oB.stride(1), K=K, V=V, BT=BT, BV=BV, NVB=V // BV,
                                                      PRECISION=precision, num_warps=warps, num_stages=stages)
    return o
