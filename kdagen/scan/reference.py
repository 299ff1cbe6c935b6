"""The three-step scan in torch, with kda_reference's contract (a check of the scheme itself).

    1. per chunk its affine map, per segment their composition (all segments at once)
    2. the sequential chain of segment boundary states, from each sequence's initial state
    3. every segment rerun from its true entering state (o, chunk states, final state)

in float32 or float64, vectorised over chunks, segments and heads.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ..inputs import chunk_stride, kept_chunk_rows
from ..reference import CHUNK_SIZES, _finish, _prepare
from .layout import split
from .maps import chain, chunk_maps, rerun, segment_maps

__all__ = ["kda_scan_reference", "reference_prefill"]


def _chunked(x: Tensor, bounds: list[tuple[int, int, int]], C: int) -> Tensor:
    """Token ranges (batch row, start, end) of a [B, T, HV, ...] tensor as chunks
    [n, HV, C, ...], each range zero-padded to whole chunks (gate 0 and beta 0 change nothing)."""
    parts = []
    for bi, s, e in bounds:
        y = x[bi, s:e]
        pad = -(e - s) % C
        if pad:
            y = torch.cat([y, y.new_zeros(pad, *y.shape[1:])])
        parts.append(y.reshape(-1, C, *y.shape[1:]).movedim(1, 2))
    return torch.cat(parts) if parts else x.new_zeros(0, x.shape[2], C, *x.shape[3:])


def kda_scan_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
    segments: int | Sequence[int] = 2,
    dtype: torch.dtype = torch.float64,
    chunk_size: int = 64,
    output_final_state: bool = False,
    return_chunk_states: bool = False,
    **kw,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """KDA through the three-step scan, each sequence cut into `segments` (one count, or one per
    sequence) on chunk boundaries, computed in `dtype`. Other keywords (gate, states, varlen,
    layouts) as kdagen.reference.kda_reference; returns (o, final_state or None, chunk_states or
    None) like it."""
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES}, found {chunk_size!r}")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype: expected torch.float32 or torch.float64, found {dtype}")
    opts = dict(A_log=None, dt_bias=None, scale=None, lower_bound=-5.0, gate=None, initial_state=None,
                cu_seqlens=None, layout="BSND", state_layout="VK", use_qk_l2norm=True, allow_neg_eigval=False)
    unknown = sorted(set(kw) - set(opts))
    if unknown:
        raise TypeError(f"kda_scan_reference: unexpected keyword argument(s) {', '.join(unknown)}")
    p = _prepare(q, k, v, g, beta, **{**opts, **kw})
    C = chunk_size
    Bsz, T = p.q.shape[:2]
    # One packed token axis over all sequences: sequence n is [cu[n], cu[n+1]).
    cu = [0]
    for _, s, e in p.segments:
        cu.append(cu[-1] + e - s)
    lay = split(cu, segments, C)
    # Segment n's packed range back to (batch row, start, end) of the inputs.
    seg_src = []
    for n, (bi, s, _) in enumerate(p.segments):
        for j in range(lay.first[n], lay.first[n] + lay.counts[n]):
            a, b = lay.bounds[j], lay.bounds[j + 1]
            seg_src.append((bi, s + a - cu[n], s + b - cu[n]))
    cast = lambda x: x.to(dtype)  # noqa: E731
    qc, kc, vc, ac = (_chunked(cast(x), seg_src, C) for x in (p.q, p.k, p.v, p.a))
    bc = _chunked(cast(p.b)[..., None], seg_src, C)[..., 0]
    n_chunks = lay.chunks(C)

    # 1. every chunk's map, composed per segment
    maps = chunk_maps(qc, kc, vc, ac, bc, p.scale)
    A_seg, B_seg = segment_maps(maps.A, maps.B, n_chunks)
    # 2. the chain of boundary states
    S_in, _ = chain(A_seg, B_seg, cast(p.S0), list(lay.counts))
    # 3. every segment from its true entering state
    oc, entering, exits = rerun(S_in, qc, kc, vc, ac, bc, p.scale, n_chunks)

    o = torch.zeros(Bsz, T, *p.v.shape[2:], dtype=dtype, device=p.v.device)
    at = 0
    for (bi, s, e), nc in zip(seg_src, n_chunks):
        tok = oc[at:at + nc].movedim(1, 2).reshape(nc * C, *oc.shape[1:2], oc.shape[-1])
        o[bi, s:e] = tok[: e - s]
        at += nc
    finals_rerun = [exits[j] for j in lay.last]
    cs = list(entering) if return_chunk_states else None
    return _finish(p, o, finals_rerun, cs, output_final_state)


def reference_prefill(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                      chunk_size: int | None = None, state_dtype: torch.dtype | None = None,
                      return_chunk_states: bool = False, out: Tensor | None = None,
                      final_state: Tensor | None = None, chunk_states: Tensor | None = None,
                      cu_seqlens_cpu: Tensor | None = None, variant: str | None = None,
                      assume_valid: bool = False, workspace: Tensor | None = None, **kw):
    """kdagen.kda_prefill's contract computed by the float64 chunked reference (o in v's dtype,
    states in the state dtype): a drop-in `prefill=` for the scan engine and kdagen.cp where no
    kernel runs (fast CPU tests of the plumbing around the kernels)."""
    from ..checkpoints import host_lengths
    from ..reference import kda_chunked_reference

    m = max(1, chunk_stride(return_chunk_states))
    C = chunk_size or 64
    want_final = bool(kw.pop("output_final_state", False)) or final_state is not None
    want_cs = return_chunk_states or chunk_states is not None
    h0 = kw.get("initial_state")
    st = next((t.dtype for t in (h0, final_state, chunk_states) if t is not None), state_dtype or torch.float32)
    o, fs, cs = kda_chunked_reference(q, k, v, g, beta, output_final_state=want_final, chunk_size=C,
                                      chunk_states_size=C if want_cs else None, **kw)
    o = o.to(v.dtype)
    if out is not None:
        o = out.copy_(o)
    if fs is not None:
        fs = fs.to(st)
        if final_state is not None:
            fs = final_state.copy_(fs)
    if want_cs:
        if m > 1:  # the state entering chunks 0, m, 2m, ... of each sequence
            T = q.shape[1] if str(kw.get("layout", "BSND")).upper() == "BSND" else q.shape[2]
            lens = host_lengths(q.shape[0], T, kw.get("cu_seqlens"), cu_seqlens_cpu, "return_chunk_states")
            cs = cs[kept_chunk_rows(lens, C, m)]
        cs = cs.to(st)
        if chunk_states is not None:
            chunk_states[: cs.shape[0]].copy_(cs)
            cs = chunk_states
        return o, fs, cs
    return o, fs
