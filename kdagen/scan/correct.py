"""Step 3 of mode "correct" for o: o = o_B + o_A S_in^T per segment, in one pass over step 1's o.

Step 1 runs every segment as two value heads per head (B: the from-zero run, A: the transition
run from the identity), so its o [1, T, 2HV, V] interleaves o_B and o_A. The torch form
(kdagen.scan.engine.correct_step) makes fp32 copies of both halves and one einsum per segment.
The Triton kernel reads o2 once and writes o in o2's dtype. With the torch form, rank 1 of two
took 28.2 ms in all at T1048576 H8 on the H200; with the kernel it took 19.9 ms (different
leases, benchmarks/NOTES.md, twenty-eighth session). A program per (token tile, head); the tile
table is built on the host so that no tile straddles two segments.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .chain import triton_takes

__all__ = ["correct_o_fits", "correct_o_triton"]

try:  # Triton is optional at run time (the torch form needs none)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None

# Launch: (tokens per product tile, tokens per program, V rows per program, warps, pipeline
# stages). A program keeps its (segment, head)'s S_in rows in registers and walks its tokens
# tile by tile; the first form reread S_in from L2 for every 64-token tile (4 GB of L2 reads at
# 512K tokens, 8 heads) and moved 1.6 TB/s of HBM traffic (benchmarks/NOTES.md, session 28).
CONFIG = (64, 1024, 128, 8, 2)


if triton is not None:

    @triton.jit
    def _correct_kernel(O2, S_in, O, run_seg, run_start, run_end, skip, HV, K: tl.constexpr, V: tl.constexpr,
                        BT: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
        i = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
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
                row2 = rt.to(tl.int64) * (2 * HV * V)  # o2's token rows hold 2HV heads (B at 2h, A at 2h + 1)
                acc = tl.load(O2 + row2[:, None] + 2 * h * V + rv[None, :], mask=mt[:, None], other=0.0)
                oa = tl.load(O2 + row2[:, None] + (2 * h + 1) * V + rk[None, :], mask=mt[:, None], other=0.0)
                acc = tl.dot(oa.to(tl.float32), stT, acc.to(tl.float32), input_precision=PRECISION)
                tl.store(O + rt.to(tl.int64)[:, None] * (HV * V) + h * V + rv[None, :], acc.to(O.dtype.element_ty),
                         mask=mt[:, None])
        else:
            for t in range(t0, t1, BT):
                rt = t + tl.arange(0, BT)
                mt = rt < t1
                row2 = rt.to(tl.int64) * (2 * HV * V)
                ob = tl.load(O2 + row2[:, None] + 2 * h * V + rv[None, :], mask=mt[:, None], other=0.0)
                tl.store(O + rt.to(tl.int64)[:, None] * (HV * V) + h * V + rv[None, :], ob.to(O.dtype.element_ty),
                         mask=mt[:, None])


def correct_o_fits(o2: Tensor, S_in: Tensor) -> bool:
    """Whether the kernel takes these shapes here: power-of-two V = K >= 16, on a GPU or the
    Triton interpreter."""
    if S_in.dtype != torch.float32 or o2.dim() != 4 or S_in.dim() != 4:
        return False
    K, V = S_in.shape[-1], S_in.shape[-2]
    return K == V and o2.shape[-1] == V and triton_takes(o2, K)


def _runs(bounds: Sequence[int], GT: int) -> Tensor:
    """[3, runs] int32: each program's segment, first token, end (GT tokens, none across segments)."""
    b = torch.tensor(list(bounds), dtype=torch.int64)
    n = (b[1:] - b[:-1] + GT - 1) // GT  # runs per segment
    seg = torch.repeat_interleave(torch.arange(len(n)), n)
    first = torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
    start = b[:-1][seg] + (torch.arange(int(n.sum())) - first) * GT
    end = torch.minimum(start + GT, b[1:][seg])
    return torch.stack([seg, start, end]).to(torch.int32)


def correct_o_triton(o2: Tensor, S_in: Tensor, bounds: Sequence[int], skip: Sequence[bool],
                     config: Optional[tuple[int, int, int, int, int]] = None) -> Tensor:
    """o [1, T, HV, V] in o2's dtype from step 1's o2 [1, T, 2HV, V]: segment s (tokens
    [bounds[s], bounds[s+1])) gets o_B + o_A S_in[s]^T, or o_B alone where skip[s] (its entering
    state was applied in step 1). S_in [S, HV, V, K] fp32. config: CONFIG's fields (for timing)."""
    if not correct_o_fits(o2, S_in):
        raise ValueError(f"o2, S_in: the Triton correction needs V = K a power of two >= 16 and fp32 S_in, on a GPU "
                         f"or the interpreter; found o2 {tuple(o2.shape)} on {o2.device}, S_in {tuple(S_in.shape)} "
                         f"{S_in.dtype}")
    S, HV, V, K = S_in.shape
    T = o2.shape[1]
    if o2.shape[0] != 1 or o2.shape[2] != 2 * HV or len(bounds) != S + 1 or bounds[-1] != T or len(skip) != S:
        raise ValueError(f"o2, bounds, skip: expected o2 [1, T, {2 * HV}, {V}] with bounds of {S} segments ending at "
                         f"T and {S} skip flags, found o2 {tuple(o2.shape)}, bounds ending at {bounds[-1]} "
                         f"({len(bounds)}), {len(skip)} skip flags")
    o2 = o2.contiguous()
    o = torch.empty(1, T, HV, V, dtype=o2.dtype, device=o2.device)
    BT, GT, BV, warps, stages = config or CONFIG
    BV = min(BV, V)
    table = _runs(bounds, max(GT, BT) // BT * BT)
    if not table.shape[1] or not HV:
        return o
    dev = o2.device
    table = table.to(dev)
    flags = torch.tensor([int(bool(x)) for x in skip], dtype=torch.int32).to(dev)
    # o_A carries its dtype's rounding (bf16 2^-9, fp16 2^-11): TF32's rounding of S_in adds no more.
    # An fp32 o2 keeps IEEE products.
    precision = "ieee" if o2.dtype == torch.float32 else "tf32"
    _correct_kernel[(table.shape[1], HV, V // BV)](o2, S_in.contiguous(), o, table[0], table[1], table[2], flags, HV,
                                                   K=K, V=V, BT=BT, BV=BV, PRECISION=precision,
                                                   num_warps=warps, num_stages=stages)
    return o
    dev = o2.device
    table = table.to(dev)
    flags = torch.tensor([int(bool(x)) for x in skip], dtype=torch.int32).to(dev)
    # o_A carries its dtype's rounding (bf16 2^-9, fp16 2^-11): TF32's rounding of S_in adds no more.
    # An fp32 o2 keeps IEEE products.
    precision = "ieee" if o2.dtype == torch.float32 else "tf32"
    # The whole V per program: each (segment, head)'s S_in (64 KB at K = 128, L2-resident) is read
    # once per tile of BT tokens.
    BV = V
    _correct_kernel[(table.shape[1], HV, V // BV)](o2, S_in.contiguous(), o, table[0], table[1], table[2], flags, HV,
                                             K=K, V=V, BT=BT, BV=BV, BK=min(K, BK), PRECISION=precision,
                                             num_warps=warps, num_stages=stages)
    return o
