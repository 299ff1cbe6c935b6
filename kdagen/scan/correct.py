"""Step 3 of mode "correct" for o: o = o_B + o_A S_in^T per segment, in one pass over step 1's o.

Step 1 runs every segment twice over the caller's tensors (kdagen.scan.engine.maps_step): B, the
from-zero run, and A, the transition run from the identity with v = 0. o is affine in the entering
state: o = o_B + o_A S_in^T. The torch form (kdagen.scan.engine.correct_step) makes fp32 copies of
both and one einsum per segment; this Triton kernel reads o_B and o_A once and writes o in their
dtype. A program per (run of GT tokens inside one segment, head, V block) keeps S_in's rows for
its V block and walks its tokens BT at a time; the run table is built on the host.

Chunk states are affine in the entering state too: B_c + S_in A_c per kept row. A second kernel
(correct_cs_triton) writes them in one launch; in torch that was a clone, an einsum and an add
(~230 us of host time a call on an H100's host, session 48).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import Tensor

from .chain import triton_takes
from .layout import host_to_device

__all__ = ["correct_cs_fits", "correct_cs_triton", "correct_o_fits", "correct_o_triton"]

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

    @triton.jit
    def _correct_cs_kernel(BC, AC, S_in, CS, seg_rows, skip, S, HV, b_r, b_h, a_r, a_h, K: tl.constexpr,
                           V: tl.constexpr, BV: tl.constexpr, BJ: tl.constexpr, BK: tl.constexpr, NVB: tl.constexpr,
                           BS: tl.constexpr):
        # A program per (kept row, head, BV rows of V): CS[c, h] = B_c + S_in[s, h] A_c for the
        # row's segment s (B_c alone where skip[s]), in [BV, BJ] column tiles, operands at most
        # [BK, BJ] (as the chain kernel: a whole [K, K] tile in registers spills).
        c = tl.program_id(0) // NVB
        vb = tl.program_id(0) % NVB
        h = tl.program_id(1)
        # the row's segment: how many segments start at or before it (seg_rows: S + 1 first rows)
        i = tl.arange(0, BS)
        firsts = tl.load(seg_rows + i, mask=i < S + 1, other=2147483647)
        s = tl.sum((firsts <= c).to(tl.int32)) - 1
        apply = tl.load(skip + s) == 0  # skip has S + 1 flags: a row past the last segment copies
        rv = vb * BV + tl.arange(0, BV)
        rj = tl.arange(0, BJ)
        rk = tl.arange(0, BK)
        bc = BC + c.to(tl.int64) * b_r + h * b_h
        ac = AC + c.to(tl.int64) * a_r + h * a_h
        st = S_in + (s.to(tl.int64) * HV + h) * V * K
        out = CS + (c.to(tl.int64) * HV + h) * V * K
        for j in range(0, K, BJ):
            acc = tl.load(bc + rv[:, None] * K + j + rj[None, :]).to(tl.float32)
            if apply:
                for kk in range(0, K, BK):
                    x = tl.load(st + rv[:, None] * K + kk + rk[None, :])
                    a = tl.load(ac + (kk + rk)[:, None] * K + j + rj[None, :]).to(tl.float32)
                    acc += tl.dot(x, a, input_precision="ieee")
            tl.store(out + rv[:, None] * K + j + rj[None, :], acc.to(CS.dtype.element_ty))


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


def correct_cs_fits(cB: Tensor, cA: Tensor, S_in: Tensor) -> bool:
    """Whether correct_cs_triton takes these: fp32 throughout, V = K a power of two >= 16, each
    [V, K] matrix contiguous, on a GPU or the Triton interpreter."""
    if any(t.dtype != torch.float32 or t.dim() != 4 for t in (cB, cA, S_in)):
        return False
    K = S_in.shape[-1]
    return (S_in.shape[-2] == K and cB.shape == cA.shape and tuple(cB.shape[2:]) == (K, K)
            and all(t.stride()[2:] == (K, 1) for t in (cB, cA)) and triton_takes(cB, K))


@functools.lru_cache(maxsize=64)
def _row_tables(seg_rows: tuple[int, ...], skip: tuple[bool, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """On `device` (cached, read-only, as _tables): the segments' first rows (S + 1) and their skip
    flags with a trailing 1 (rows past the last segment are copied)."""
    return (host_to_device(list(seg_rows), device),
            host_to_device([int(x) for x in skip] + [1], device))


def correct_cs_triton(cB: Tensor, cA: Tensor, S_in: Tensor, seg_rows: Sequence[int], skip: Sequence[bool]
                      ) -> Tensor:
    """Chunk states [R, HV, V, K] (contiguous fp32) from step 1's B_c [R, HV, V, K] and A_c
    [R, HV, K, K] (read in place through their row and head strides): rows seg_rows[s] ..
    seg_rows[s + 1] - 1 belong to segment s and get B_c + S_in[s] A_c, or B_c alone where skip[s].
    S_in [S, HV, V, K] fp32."""
    if not correct_cs_fits(cB, cA, S_in):
        raise ValueError(f"cB, cA, S_in: the Triton chunk-state correction needs fp32 [R, HV, K, K] with contiguous "
                         f"matrices and power-of-two K >= 16 on a GPU or the interpreter; found cB {tuple(cB.shape)} "
                         f"{cB.dtype}, cA {tuple(cA.shape)} {cA.dtype}, S_in {tuple(S_in.shape)} {S_in.dtype} on "
                         f"{cB.device}")
    S, HV, V, K = S_in.shape
    R = cB.shape[0]
    if cB.shape[1] != HV or len(seg_rows) != S + 1 or len(skip) != S or seg_rows[0] != 0 or seg_rows[-1] != R:
        raise ValueError(f"cB, seg_rows, skip: expected {HV} heads, {S + 1} first rows from 0 to {R} and {S} skip "
                         f"flags; found cB {tuple(cB.shape)}, seg_rows {list(seg_rows)}, {len(skip)} skip flags")
    cs = torch.empty((R, HV, V, K), dtype=torch.float32, device=cB.device)
    if R and HV:
        rows, flags = _row_tables(tuple(int(x) for x in seg_rows), tuple(bool(x) for x in skip), cB.device)
        BV = min(32, V)
        _correct_cs_kernel[(R * (V // BV), HV)](cB, cA, S_in.contiguous(), cs, rows, flags, S, HV, cB.stride(0),
                                                cB.stride(1), cA.stride(0), cA.stride(1), K=K, V=V, BV=BV,
                                                BJ=min(K, 32), BK=min(K, 32), NVB=V // BV,
                                                BS=triton.next_power_of_2(S + 1))
    return cs
