"""The KDA chunk recurrence as affine maps of the state (torch reference, any float dtype).

Over one chunk (DESIGN.md section 1, S is [V, K], Inv = (I + L)^-1):

    u = b (v - Kd S0^T),   U = Inv u = U0 - Wd S0^T   with U0 = Inv (b v), Wd = Inv (b Kd)
    S1 = S0 diag(Gamma_C) + U^T Kr = S0 A + B         A = diag(Gamma_C) - Wd^T Kr   [K, K]
                                                      B = U0^T Kr                   [V, K]
    o  = Qd S0^T + Mqk U = O0 + S0-part               O0 = Mqk U0                   [C, V]
                                                      Qe = Qd - Mqk Wd              [C, K]
    o  = O0 + Qe S0^T

Maps compose: applying (A1, B1) then (A2, B2) is S -> S A1 A2 + (B1 A2 + B2). A sequence split
into segments runs in three steps: each segment's composed map (parallel), a short sequential
chain of the segment boundary states, and a rerun of every segment from its true entering state.
Nothing is truncated: KDA's gate may stay near 1, so A need not decay.

Tensors carry arbitrary leading batch dims (chunks, segments, heads); the chunk axis of the
per-chunk inputs is the one before the feature axis ([..., C, K]). Everything is computed in the
dtype of the inputs (float32 or float64).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from ..reference import _chunk_step, _intra_chunk_matrices, block_inverse_64, neumann_inverse_16

__all__ = [
    "ChunkMaps",
    "chunk_maps",
    "apply_map",
    "compose",
    "fold",
    "identity_map",
    "segment_maps",
    "chain",
    "rerun",
    "ieee_fp32",
]


@contextlib.contextmanager
def ieee_fp32() -> Iterator[None]:
    """fp32 products without TF32 inside (a caller may have enabled it globally): the chain and
    the corrections multiply transitions that must stay exact to fp32 rounding."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@dataclass
class ChunkMaps:
    """Per-chunk affine maps: S1 = S0 A + B and o = O0 + Qe S0^T."""

    A: Tensor  # [..., K, K] transition
    B: Tensor  # [..., V, K] state built from zero
    Qe: Tensor  # [..., C, K] o's linear part in S0
    O0: Tensor  # [..., C, V] o from zero state


def chunk_maps(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, scale: float) -> ChunkMaps:
    """Affine maps of chunks. q, k, a: [..., C, K] (q, k as the recurrence reads them: normalised,
    expanded to value heads, q unscaled); v: [..., C, V]; b: [..., C] activated beta; C in {16, 64}.
    Padded positions (a = 0, b = 0) change nothing."""
    *lead, C, K = q.shape
    V = v.shape[-1]
    if C not in (16, 64):
        raise ValueError(f"q: expected a chunk axis of 16 or 64 at dim -2, found {C}")
    for name, t, last in (("k", k, K), ("a", a, K), ("v", v, V)):
        if tuple(t.shape) != (*lead, C, last):
            raise ValueError(f"{name}: expected shape {(*lead, C, last)}, found {tuple(t.shape)}")
    if tuple(b.shape) != (*lead, C):
        raise ValueError(f"b: expected shape {(*lead, C)}, found {tuple(b.shape)}")
    flat = lambda x: x.reshape(-1, *x.shape[len(lead):])  # noqa: E731
    q, k, v, a, b = flat(q), flat(k), flat(v), flat(a), flat(b)
    G = torch.cumsum(a, dim=-2)
    Kd = k * torch.exp(G)
    Qd = scale * q * torch.exp(G)
    Kr = k * torch.exp(G[:, -1:] - G)  # a decay: exp(G_C - G_j) <= 1
    gamma_C = torch.exp(G[:, -1])  # [X, K]
    L, Mqk = _intra_chunk_matrices(q, k, G, b, scale)
    inv = neumann_inverse_16(L) if C == 16 else block_inverse_64(L)
    Wd = inv @ (b[..., None] * Kd)  # [X, C, K]
    U0 = inv @ (b[..., None] * v)  # [X, C, V]
    A = torch.diag_embed(gamma_C) - Wd.transpose(-1, -2) @ Kr
    B = U0.transpose(-1, -2) @ Kr
    Qe = Qd - Mqk @ Wd
    O0 = Mqk @ U0
    unflat = lambda x: x.reshape(*lead, *x.shape[1:])  # noqa: E731
    return ChunkMaps(unflat(A), unflat(B), unflat(Qe), unflat(O0))


def apply_map(S: Tensor, A: Tensor, B: Tensor) -> Tensor:
    """S A + B for states S [..., V, K]."""
    return S @ A + B


def compose(first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """The map of `first` followed by `second`: (A1 A2, B1 A2 + B2)."""
    A1, B1 = first
    A2, B2 = second
    return A1 @ A2, B1 @ A2 + B2


def identity_map(lead: tuple[int, ...], V: int, K: int, *, dtype: torch.dtype, device) -> tuple[Tensor, Tensor]:
    """(I, 0) of shape [*lead, K, K] and [*lead, V, K]."""
    eye = torch.eye(K, dtype=dtype, device=device).expand(*lead, K, K).clone()
    return eye, torch.zeros(*lead, V, K, dtype=dtype, device=device)


def fold(A: Tensor, B: Tensor, dim: int = 0) -> tuple[Tensor, Tensor]:
    """Compose the maps along `dim` in order (element 0 first), by a pairwise tree: log2(n)
    batched steps. A: [..., n, ..., K, K]; B: [..., n, ..., V, K] (dim counted on A and B alike,
    and not one of the last two)."""
    nd = A.dim()
    dim = dim % nd
    if dim >= nd - 2:
        raise ValueError(f"dim: expected a batch dim of A (shape {tuple(A.shape)}), found {dim}")
    A, B = A.movedim(dim, 0), B.movedim(dim, 0)
    if A.shape[0] == 0:
        raise ValueError("A: expected at least one map along dim, found none")
    while A.shape[0] > 1:
        n = A.shape[0]
        even = n - n % 2
        pA, pB = compose((A[0:even:2], B[0:even:2]), (A[1:even:2], B[1:even:2]))
        if n % 2:
            pA, pB = torch.cat([pA, A[-1:]]), torch.cat([pB, B[-1:]])
        A, B = pA, pB
    return A[0], B[0]


def _padded_index(counts: list[int], device) -> tuple[Tensor, Tensor]:
    """For groups of `counts` consecutive items: a [G, max] index into the items and its mask."""
    if not counts:
        return torch.zeros(0, 1, dtype=torch.long, device=device), torch.zeros(0, 1, dtype=torch.bool, device=device)
    m = max(counts)
    starts = torch.tensor([0] + list(counts[:-1]), dtype=torch.long).cumsum(0)
    j = torch.arange(max(m, 1))
    mask = j[None, :] < torch.tensor(counts, dtype=torch.long)[:, None]
    idx = torch.where(mask, starts[:, None] + j[None, :], torch.zeros((), dtype=torch.long))
    return idx.to(device), mask.to(device)


def segment_maps(A: Tensor, B: Tensor, counts: list[int]) -> tuple[Tensor, Tensor]:
    """Composed maps of groups of consecutive chunk maps. A [n, ..., K, K], B [n, ..., V, K]
    with the chunks of all segments in order; counts[s] chunks in segment s (0: the identity).
    Returns [len(counts), ..., K, K] and [len(counts), ..., V, K]; segments are padded with
    identity maps so the fold is one batched tree over all of them."""
    if sum(counts) != A.shape[0] or any(c < 0 for c in counts):
        raise ValueError(f"counts: expected non-negative chunk counts summing to {A.shape[0]}, found {counts}")
    idx, mask = _padded_index(counts, A.device)
    I, Z = identity_map(tuple(idx.shape) + tuple(A.shape[1:-2]), B.shape[-2], A.shape[-1], dtype=A.dtype,
                        device=A.device)
    if A.shape[0]:
        m = mask.reshape(*mask.shape, *([1] * (A.dim() - 1)))
        I = torch.where(m, A[idx], I)
        Z = torch.where(m, B[idx], Z)
    return fold(I, Z, dim=1)


def chain(A: Tensor, B: Tensor, S0: Tensor, counts: list[int]) -> tuple[Tensor, Tensor]:
    """The sequential pass: states entering every segment and each sequence's final state.

    A [S, ..., K, K], B [S, ..., V, K]: segment maps, the segments of all sequences in order;
    counts[n] segments in sequence n; S0 [N, ..., V, K] the states entering the sequences.
    Returns (S_in [S, ..., V, K], final [N, ..., V, K]); vectorised over sequences, one step
    per segment of the longest."""
    if len(counts) != S0.shape[0] or sum(counts) != A.shape[0]:
        raise ValueError(f"counts: expected {S0.shape[0]} sequences with {A.shape[0]} segments in all, found {counts}")
    S_in = torch.empty_like(B)
    S = S0.clone()
    idx, mask = _padded_index(counts, A.device)
    for j in range(idx.shape[1]):
        live = mask[:, j]
        rows = idx[:, j][live]
        S_in[rows] = S[live]
        S[live] = apply_map(S[live], A[rows], B[rows])
    return S_in, S


def rerun(S_in: Tensor, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, scale: float,
          counts: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """Every segment's chunks from its true entering state, all segments at once.

    S_in [S, HV, V, K]; q, k, a [n, HV, C, K], v [n, HV, C, V], b [n, HV, C]: the chunks of all
    segments in order, counts[s] of them in segment s. Returns (o [n, HV, C, V], the state
    entering each chunk [n, HV, V, K], the state leaving each segment [S, HV, V, K])."""
    n, HV, C, K = q.shape
    V = v.shape[-1]
    if S_in.shape[0] != len(counts) or sum(counts) != n:
        raise ValueError(f"counts: expected {S_in.shape[0]} segments with {n} chunks in all, found {counts}")
    idx, mask = _padded_index(counts, q.device)
    o = torch.zeros(n, HV, C, V, dtype=q.dtype, device=q.device)
    entering = torch.empty(n, HV, V, K, dtype=q.dtype, device=q.device)
    S = S_in.clone()
    for j in range(idx.shape[1]):
        live = mask[:, j]
        rows = idx[:, j][live]
        if not rows.numel():
            continue
        cnt = rows.numel()
        entering[rows] = S[live]
        oc, S1 = _chunk_step(S[live].reshape(cnt * HV, V, K), q[rows].reshape(cnt * HV, C, K),
                             k[rows].reshape(cnt * HV, C, K), v[rows].reshape(cnt * HV, C, V),
                             a[rows].reshape(cnt * HV, C, K), b[rows].reshape(cnt * HV, C), scale)
        o[rows] = oc.reshape(cnt, HV, C, V)
        S[live] = S1.reshape(cnt, HV, V, K)
    return o, entering, S
