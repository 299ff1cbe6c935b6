"""The sequential pass over segment boundary states: S_in[first] = S0, S_in[j+1] = S_in[j] A_j + B_j.

Two implementations of one contract (kdagen.scan.maps.chain): torch (a batched step per segment
of the longest sequence: one launch each on a GPU) and one Triton kernel (a program per
(sequence, head, V block) walks all of its sequence's segments: one launch in all). On the H200
the torch form took 1-6 ms at 4-16 segments (each step gathers by a boolean mask, which
synchronises the host), the kernel 0.08-0.21 ms, hence the kernel wherever it runs. fp32 only,
products in IEEE fp32 (no TF32).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import Tensor

from .layout import device_ints
from .maps import chain as chain_torch
from .maps import ieee_fp32

__all__ = ["chain_states", "chain_triton", "triton_fits", "triton_takes"]

try:  # Triton is optional at run time (the torch form needs none)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None


if triton is not None:

    @triton.jit
    def _chain_kernel(A, B, S0, S_in, S_out, offsets, HV, a_s, a_h, b_s, b_h, K: tl.constexpr, V: tl.constexpr,
                      BV: tl.constexpr, BJ: tl.constexpr, BK: tl.constexpr):
        # One program per (sequence, head, BV rows of V) walks the sequence's segments. The state
        # lives in S_in (global, L2-resident): each segment reads S_in[s] in [BV, BK] tiles and
        # writes S_in[s] A + B to S_in[s + 1] (S_out after the last) in [BV, BJ] column tiles, so
        # no operand is larger than [BK, BJ] (a whole [K, K] tile in registers spilled: 0.3 ms a
        # segment at K = 128 on the H200, benchmarks/NOTES.md). A and B are read through their
        # segment and head strides (a_s, a_h, b_s, b_h): the twin run's heads are slices of one output.
        n = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        # 64-bit segment and sequence indices: S_in's offset (s HV + h) V K passes 2^31 at 131072
        # segment-heads for K = V = 128 (an 8 GiB S_in), and int32 wrapped there.
        s_begin = tl.load(offsets + n).to(tl.int64)
        s_end = tl.load(offsets + n + 1).to(tl.int64)
        rv = vb * BV + tl.arange(0, BV)
        rj = tl.arange(0, BJ)
        rk = tl.arange(0, BK)
        seq = (n.to(tl.int64) * HV + h) * V * K  # this (sequence, head)'s [V, K] state in S0 and S_out
        for j in range(0, K, BJ):  # S0 enters the first segment (or is the final state of none)
            tile = rv[:, None] * K + j + rj[None, :]
            s0 = tl.load(S0 + seq + tile)
            tl.store(S_in + (s_begin * HV + h) * V * K + tile, s0, mask=s_begin < s_end)
            tl.store(S_out + seq + tile, s0, mask=s_begin == s_end)
        a_seg = A + s_begin * a_s + h * a_h
        b_seg = B + s_begin * b_s + h * b_h
        for s in range(s_begin, s_end):
            tl.debug_barrier()  # S_in[s] was written by other threads of this program
            src = S_in + (s * HV + h) * V * K
            nxt = S_in + ((s + 1) * HV + h) * V * K
            for j in range(0, K, BJ):
                tile = rv[:, None] * K + j + rj[None, :]
                acc = tl.load(b_seg + tile)
                for kk in range(0, K, BK):
                    st = tl.load(src + rv[:, None] * K + kk + rk[None, :])
                    a = tl.load(a_seg + (kk + rk)[:, None] * K + j + rj[None, :])
                    acc += tl.dot(st, a, input_precision="ieee")
                tl.store(nxt + tile, acc, mask=s + 1 < s_end)
                tl.store(S_out + seq + tile, acc, mask=s + 1 == s_end)
            a_seg += a_s
            b_seg += b_s


def triton_takes(t: Tensor, *dims: int) -> bool:
    """Whether a scan Triton kernel runs on t's device here (a GPU, or the CPU interpreter) and
    every dim is a power of two >= 16 (its tiles' sizes)."""
    runs = t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    return triton is not None and runs and all(x >= 16 and x & (x - 1) == 0 for x in dims)


def triton_fits(A: Tensor, B: Tensor) -> bool:
    """Whether the Triton kernel takes these shapes (power-of-two K and V >= 16, fp32) here."""
    if A.dtype != torch.float32 or B.dtype != torch.float32:
        return False
    return triton_takes(A, A.shape[-1], B.shape[-2])


def chain_triton(A: Tensor, B: Tensor, S0: Tensor, counts: Sequence[int]) -> tuple[Tensor, Tensor]:
    """kdagen.scan.maps.chain in one Triton launch. A [S, HV, K, K], B [S, HV, V, K],
    S0 [N, HV, V, K], all fp32; counts[n] segments of sequence n. A and B are read in place where
    each of their matrices is contiguous (the twin run's head slices need no copies)."""
    if not triton_fits(A, B):
        raise ValueError(f"A, B: the Triton chain needs fp32 power-of-two K, V >= 16 on a GPU or the "
                         f"interpreter, found A {tuple(A.shape)} {A.dtype}, B {tuple(B.shape)} on {A.device}")
    S, HV, K, _ = A.shape
    V = B.shape[-2]
    N = S0.shape[0]
    if len(counts) != N or sum(counts) != S or tuple(B.shape) != (S, HV, V, K) or tuple(S0.shape) != (N, HV, V, K):
        raise ValueError(f"counts: expected {N} sequences with {S} segments in all and B [{S}, {HV}, V, {K}], "
                         f"S0 [{N}, {HV}, V, {K}], found counts {list(counts)}, B {tuple(B.shape)}, "
                         f"S0 {tuple(S0.shape)}")
    A, B = (x if x.stride()[2:] == (x.shape[3], 1) else x.contiguous() for x in (A, B))
    S0 = S0.contiguous()
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + int(c))
    offsets = device_ints(offs, A.device)
    S_in = torch.empty((S, HV, V, K), dtype=B.dtype, device=B.device)
    S_out = torch.empty_like(S0)
    if N and HV:
        BV = 16
        _chain_kernel[(N, HV, V // BV)](A, B, S0, S_in, S_out, offsets, HV, A.stride(0), A.stride(1), B.stride(0),
                                        B.stride(1), K=K, V=V, BV=BV, BJ=min(K, 32), BK=min(K, 32))
    return S_in, S_out


def chain_states(A: Tensor, B: Tensor, S0: Tensor, counts: Sequence[int], impl: str = "auto"
                 ) -> tuple[Tensor, Tensor]:
    """(states entering every segment, each sequence's final state); impl "torch", "triton" or
    "auto" (the kernel on a GPU where it fits, else torch)."""
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl: expected 'auto', 'torch' or 'triton', found {impl!r}")
    if impl == "triton" or (impl == "auto" and A.is_cuda and triton_fits(A, B)):
        return chain_triton(A, B, S0, counts)
    with ieee_fp32():
        return chain_torch(A, B, S0, list(counts))
