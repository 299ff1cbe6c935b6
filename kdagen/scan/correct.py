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

# Tile shape and launch: (tokens per tile, K per product, warps, pipeline stages). The fastest of
# nine swept alone on the H200 at 512K tokens, 8 heads (2.0 ms; the others 2.1-2.8): the kernel
# moves 1.6 TB/s, a third of what memory allows (benchmarks/NOTES.md, twenty-eighth session).
CONFIG = (64, 64, 4, 2)


if triton is not None:

    @triton.jit
    def _correct_kernel(O2, S_in, O, tile_seg, tile_start, tile_end, skip, HV, K: tl.constexpr, V: tl.constexpr,
                        BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
        i = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        s = tl.load(tile_seg + i)
        t0 = tl.load(tile_start + i)
        t1 = tl.load(tile_end + i)
        rt = t0 + tl.arange(0, BT)
        mt = rt < t1
        rv = vb * BV + tl.arange(0, BV)
        rk = tl.arange(0, BK)
        row2 = rt.to(tl.int64) * (2 * HV * V)  # o2's token rows hold 2HV heads (B at 2h, A at 2h + 1)
        acc = tl.load(O2 + row2[:, None] + 2 * h * V + rv[None, :], mask=mt[:, None], other=0.0).to(tl.float32)
        if tl.load(skip + s) == 0:
            st = S_in + (s.to(tl.int64) * HV + h) * V * K  # S_in[s, h]: [V, K]
            for kk in range(0, K, BK):
                oa = tl.load(O2 + row2[:, None] + (2 * h + 1) * V + kk + rk[None, :], mask=mt[:, None], other=0.0)
                sm = tl.load(st + rv[:, None] * K + kk + rk[None, :])  # [BV, BK], rows contiguous in memory
                acc += tl.dot(oa.to(tl.float32), tl.trans(sm), input_precision=PRECISION)
        tl.store(O + rt.to(tl.int64)[:, None] * (HV * V) + h * V + rv[None, :], acc.to(O.dtype.element_ty),
                 mask=mt[:, None])


def correct_o_fits(o2: Tensor, S_in: Tensor) -> bool:
    """Whether the kernel takes these shapes here: power-of-two V = K >= 16, on a GPU or the
    Triton interpreter."""
    if S_in.dtype != torch.float32 or o2.dim() != 4 or S_in.dim() != 4:
        return False
    K, V = S_in.shape[-1], S_in.shape[-2]
    return K == V and o2.shape[-1] == V and triton_takes(o2, K)


def _tiles(bounds: Sequence[int], BT: int) -> Tensor:
    """[3, tiles] int32: each tile's segment, first token, end (BT tokens, none across segments)."""
    b = torch.tensor(list(bounds), dtype=torch.int64)
    n = (b[1:] - b[:-1] + BT - 1) // BT  # tiles per segment
    seg = torch.repeat_interleave(torch.arange(len(n)), n)
    first = torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
    start = b[:-1][seg] + (torch.arange(int(n.sum())) - first) * BT
    end = torch.minimum(start + BT, b[1:][seg])
    return torch.stack([seg, start, end]).to(torch.int32)


def correct_o_triton(o2: Tensor, S_in: Tensor, bounds: Sequence[int], skip: Sequence[bool],
                     config: Optional[tuple[int, int, int, int]] = None) -> Tensor:
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
    BT, BK, warps, stages = config or CONFIG
    table = _tiles(bounds, BT)
    if not table.shape[1] or not HV:
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
