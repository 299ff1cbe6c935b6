"""Float64 references of the KDA prefill contract (DESIGN.md section 1).

Two independent formulations of the same operator:

* ``kda_reference``: the token-by-token recurrence, the definition every variant is checked
  against.
* ``kda_chunked_reference``: the chunked algorithm the kernels implement (per-chunk cumulative
  gates, 16-row sub-tiles with per-sub-tile anchors, Neumann/block triangular inverse), in
  float64, so that the algorithm itself can be checked separately from kernel rounding.

Both upcast every input to float64 and run on the device of ``q``. They are written for
readability, not speed: the recurrence is a Python loop over tokens, vectorised over heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "activate_gate",
    "resolve_gate",
    "kda_reference",
    "kda_chunked_reference",
    "neumann_inverse_16",
    "block_inverse_64",
    "rel_rmse",
]

GATES = ("bounded", "unbounded", "precomputed")
LAYOUTS = ("BSND", "BNSD")
STATE_LAYOUTS = ("VK", "KV")
CHUNK_SIZES = (16, 64)
SUB_TILE = 16  # row/column tile of L and Mqk; also the Neumann block size
L2NORM_EPS = 1e-6


# ----------------------------------------------------------------------------- gates


def resolve_gate(gate: str | None, A_log: Tensor | None, lower_bound: float | None) -> str:
    """Return the gate form; ``gate=None`` infers it from which parameters are present."""
    if gate is None:
        if A_log is None:
            return "precomputed"
        return "unbounded" if lower_bound is None else "bounded"
    if gate not in GATES:
        raise ValueError(f"gate: expected one of {GATES} or None, found {gate!r}")
    return gate


def _softplus(x: Tensor) -> Tensor:
    # Exact everywhere; torch's softplus switches to the identity above a threshold (20), which
    # is an error of ~2e-9: too large for a float64 reference.
    return x.clamp(min=0) + torch.log1p(torch.exp(-x.abs()))


def activate_gate(
    g: Tensor,
    *,
    gate: str,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    layout: str = "BSND",
) -> Tensor:
    """Float64 log-decay ``a`` from the raw gate ``g`` (same shape as ``g``).

    ``g`` carries the value-head axis: ``[..., HV, K]`` for layout "BSND" (e.g. [B, T, HV, K] or
    [T, HV, K]) and ``[..., HV, T, K]`` for "BNSD". ``A_log`` is [HV]; ``dt_bias`` is [HV, K],
    [HV*K] or None (zeros).
    """
    if gate not in GATES:
        raise ValueError(f"gate: expected one of {GATES}, found {gate!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, found {layout!r}")
    if not isinstance(g, Tensor) or not g.is_floating_point():
        raise ValueError(f"g: expected a floating-point tensor, found {_describe(g)}")
    head_axis = -2 if layout == "BSND" else -3
    if g.dim() < -head_axis:
        raise ValueError(
            f"g: expected at least {-head_axis} dims with the value-head axis at {head_axis} "
            f"(layout {layout}), found shape {tuple(g.shape)}"
        )
    g64 = g.to(torch.float64)
    if gate == "precomputed":
        if A_log is not None:
            raise ValueError("A_log: must be None for gate='precomputed' (g is already the log-decay)")
        if dt_bias is not None:
            raise ValueError("dt_bias: must be None for gate='precomputed' (g is already the log-decay)")
        return g64

    HV, K = g.shape[head_axis], g.shape[-1]
    # Shape of a per-head [HV, K] parameter broadcast against g.
    bshape = (HV, K) if layout == "BSND" else (HV, 1, K)
    if A_log is None:
        raise ValueError(f"A_log: required for gate={gate!r}, found None")
    if not isinstance(A_log, Tensor) or tuple(A_log.shape) != (HV,):
        raise ValueError(f"A_log: expected shape [HV] with HV={HV}, found {_describe(A_log)}")
    if dt_bias is None:
        bias = torch.zeros(bshape, dtype=torch.float64, device=g.device)
    else:
        if not isinstance(dt_bias, Tensor) or tuple(dt_bias.shape) not in ((HV, K), (HV * K,)):
            raise ValueError(
                f"dt_bias: expected shape [HV, K] or [HV*K] with HV={HV}, K={K}, found {_describe(dt_bias)}"
            )
        bias = dt_bias.to(device=g.device, dtype=torch.float64).reshape(bshape)
    rate = torch.exp(A_log.to(device=g.device, dtype=torch.float64)).reshape(bshape[:-1] + (1,))
    x = g64 + bias
    if gate == "bounded":
        if lower_bound is None:
            raise ValueError("lower_bound: required for gate='bounded', found None")
        lb = float(lower_bound)
        if not (math.isfinite(lb) and lb <= 0):
            raise ValueError(f"lower_bound: expected a finite number <= 0, found {lower_bound!r}")
        # a in (lower_bound, 0): the decay per step is bounded below by exp(lower_bound).
        return lb * torch.sigmoid(rate * x)
    return -rate * _softplus(x)


# ------------------------------------------------------------------ triangular inverses


def neumann_inverse_16(L: Tensor) -> Tensor:
    """(I + L)^-1 for strictly lower triangular ``L`` of shape [..., 16, 16].

    L is nilpotent (L^16 = 0), so (I + L)^-1 = sum_{n<16} (-L)^n, which factors exactly into
    (I - L)(I + L^2)(I + L^4)(I + L^8): three squarings and three products.
    """
    if L.shape[-2:] != (SUB_TILE, SUB_TILE):
        raise ValueError(f"L: expected shape [..., 16, 16], found {tuple(L.shape)}")
    eye = torch.eye(SUB_TILE, dtype=L.dtype, device=L.device)
    L2 = L @ L
    L4 = L2 @ L2
    L8 = L4 @ L4
    return (eye - L) @ (eye + L2) @ (eye + L4) @ (eye + L8)


def _compose_lower_inverse(A_inv: Tensor, B_inv: Tensor, C: Tensor) -> Tensor:
    """[[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]]."""
    n, m = A_inv.shape[-1], B_inv.shape[-1]
    out = torch.zeros(*A_inv.shape[:-2], n + m, n + m, dtype=A_inv.dtype, device=A_inv.device)
    out[..., :n, :n] = A_inv
    out[..., n:, n:] = B_inv
    out[..., n:, :n] = -(B_inv @ C @ A_inv)
    return out


def block_inverse_64(L: Tensor) -> Tensor:
    """(I + L)^-1 for strictly lower triangular ``L`` of shape [..., 64, 64].

    The four 16x16 diagonal blocks are inverted by ``neumann_inverse_16``, then composed
    16 -> 32 -> 64 with the 2x2 block lower-triangular inverse.
    """
    if L.shape[-2:] != (64, 64):
        raise ValueError(f"L: expected shape [..., 64, 64], found {tuple(L.shape)}")
    t = SUB_TILE
    d = [neumann_inverse_16(L[..., i * t:(i + 1) * t, i * t:(i + 1) * t]) for i in range(4)]
    # Off-diagonal blocks of I + L are those of L.
    top = _compose_lower_inverse(d[0], d[1], L[..., t:2 * t, 0:t])
    bottom = _compose_lower_inverse(d[2], d[3], L[..., 3 * t:4 * t, 2 * t:3 * t])
    return _compose_lower_inverse(top, bottom, L[..., 2 * t:, :2 * t])


# ------------------------------------------------------------------------ validation


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"{tuple(x.shape)} {x.dtype}"
    return type(x).__name__


def _check_tensor(name: str, x: object, floating: bool = True) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, found {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, found dtype {x.dtype}")
    return x


def _check_shape(name: str, x: Tensor, dims: list[tuple[str, int | None]], context: str) -> tuple[int, ...]:
    """Check ``x`` against named dims; a dim bound to None is free. Returns the shape."""
    fixed = [(s, v) for s, v in dims if v is not None]
    ok = x.dim() == len(dims) and all(x.shape[i] == v for i, (_, v) in enumerate(dims) if v is not None)
    if not ok:
        pattern = ", ".join(s for s, _ in dims)
        with_ = (" with " + ", ".join(f"{s}={v}" for s, v in fixed)) if fixed else ""
        raise ValueError(f"{name}: expected shape [{pattern}]{with_} ({context}), found {tuple(x.shape)}")
    return tuple(x.shape)


def _seq_dims(layout: str, b: int | None, t: int | None, h: tuple[str, int | None], d: tuple[str, int | None] | None):
    """Named dims of a [B, T, H, D] (BSND) or [B, H, T, D] (BNSD) tensor; d=None drops D."""
    dims = [("B", b), ("T", t), h] if layout == "BSND" else [("B", b), h, ("T", t)]
    return dims + ([d] if d is not None else [])


@dataclass
class _Problem:
    """Inputs in canonical form: float64, token-major, q/k expanded to value heads."""

    q: Tensor  # [B, T, HV, K], l2-normalised if requested, NOT scaled
    k: Tensor  # [B, T, HV, K]
    v: Tensor  # [B, T, HV, V]
    a: Tensor  # [B, T, HV, K] log-decay
    b: Tensor  # [B, T, HV] activated beta
    S0: Tensor  # [N, HV, V, K]
    segments: list[tuple[int, int, int]]  # (batch row, start, end) per sequence
    scale: float
    layout: str
    state_layout: str


def _prepare(
    q, k, v, g, beta, *, A_log, dt_bias, scale, lower_bound, gate, initial_state, cu_seqlens,
    layout, state_layout, use_qk_l2norm, allow_neg_eigval, beta_is_logit=True,
) -> _Problem:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, found {layout!r}")
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout: expected one of {STATE_LAYOUTS}, found {state_layout!r}")
    ctx = f"layout {layout}"
    q = _check_tensor("q", q)
    if q.dim() != 4:
        raise ValueError(f"q: expected shape [{', '.join(s for s, _ in _seq_dims(layout, None, None, ('H', None), ('K', None)))}] "
                         f"({ctx}), found {tuple(q.shape)}")
    B, H, K = q.shape[0], q.shape[2 if layout == "BSND" else 1], q.shape[3]
    T = q.shape[1 if layout == "BSND" else 2]
    _check_shape("k", _check_tensor("k", k), _seq_dims(layout, B, T, ("H", H), ("K", K)), ctx)
    vs = _check_shape("v", _check_tensor("v", v), _seq_dims(layout, B, T, ("HV", None), ("V", None)), ctx)
    HV, V = vs[2 if layout == "BSND" else 1], vs[3]
    if HV == 0 or H == 0 or HV % H != 0:
        raise ValueError(f"v: expected the value-head count HV to be a positive multiple of H={H} (from q), found HV={HV}")
    _check_shape("g", _check_tensor("g", g), _seq_dims(layout, B, T, ("HV", HV), ("K", K)), ctx)
    _check_shape("beta", _check_tensor("beta", beta), _seq_dims(layout, B, T, ("HV", HV), None), ctx)

    device = q.device
    f64 = dict(dtype=torch.float64, device=device)

    # Sequences: rows of the batch, or cu_seqlens ranges of the single row.
    if cu_seqlens is None:
        segments = [(bi, 0, T) for bi in range(B)]
    else:
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens: expected a 1-D int32 or int64 tensor, found {_describe(cu_seqlens)}")
        if B != 1:
            raise ValueError(f"cu_seqlens: requires batch size B=1 (varlen packs sequences along T), found B={B}")
        cu = [int(x) for x in cu_seqlens.tolist()]
        if len(cu) < 2:
            raise ValueError(f"cu_seqlens: expected at least 2 entries ([N+1] with N >= 1), found {len(cu)}")
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens: expected first entry 0, found {cu[0]}")
        if any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens: expected non-decreasing entries, found {cu}")
        if cu[-1] != T:
            raise ValueError(f"cu_seqlens: expected last entry == total tokens T={T}, found {cu[-1]}")
        segments = [(0, s, e) for s, e in zip(cu, cu[1:])]
    N = len(segments)

    if scale is None:
        scale = K ** -0.5
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number or None, found {scale!r}")

    gate = resolve_gate(gate, A_log, lower_bound)

    # Canonical token-major layout [B, T, heads, D].
    def tok(x: Tensor) -> Tensor:
        x = x.to(**f64)
        return x if layout == "BSND" else x.transpose(1, 2)

    q64, k64, v64, g64, beta64 = tok(q), tok(k), tok(v), tok(g), tok(beta)
    a = activate_gate(g64, gate=gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, layout="BSND")
    if use_qk_l2norm:
        q64 = q64 / torch.sqrt((q64 * q64).sum(-1, keepdim=True) + L2NORM_EPS)
        k64 = k64 / torch.sqrt((k64 * k64).sum(-1, keepdim=True) + L2NORM_EPS)
    # GQA/GVA: value head h reads q/k head h // (HV // H).
    q64 = q64.repeat_interleave(HV // H, dim=2)
    k64 = k64.repeat_interleave(HV // H, dim=2)
    b = torch.sigmoid(beta64) * (2.0 if allow_neg_eigval else 1.0) if beta_is_logit else beta64

    st_dims = [("N", N), ("HV", HV)] + ([("V", V), ("K", K)] if state_layout == "VK" else [("K", K), ("V", V)])
    if initial_state is None:
        S0 = torch.zeros(N, HV, V, K, **f64)
    else:
        _check_shape("initial_state", _check_tensor("initial_state", initial_state), st_dims, f"state_layout {state_layout}")
        S0 = initial_state.to(**f64)
        if state_layout == "KV":
            S0 = S0.transpose(-1, -2)
        S0 = S0.contiguous()
    return _Problem(q64, k64, v64, a, b, S0, segments, scale, layout, state_layout)


def _finish(p: _Problem, o: Tensor, finals: list[Tensor], chunk_states: list[Tensor] | None,
            output_final_state: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Return outputs in the caller's layouts."""
    HV, V, K = p.S0.shape[1:]

    def st(x: Tensor) -> Tensor:
        return x if p.state_layout == "VK" else x.transpose(-1, -2).contiguous()

    o = o if p.layout == "BSND" else o.transpose(1, 2).contiguous()
    final = st(torch.stack(finals)) if output_final_state else None
    cs = None
    if chunk_states is not None:
        cs = torch.stack(chunk_states) if chunk_states else p.S0.new_zeros(0, HV, V, K)
        cs = st(cs)
    return o, final, cs


# ---------------------------------------------------------------------- recurrence


def kda_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    scale: float | None = None,
    lower_bound: float | None = -5.0,
    gate: str | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    layout: str = "BSND",
    state_layout: str = "VK",
    use_qk_l2norm: bool = True,
    allow_neg_eigval: bool = False,
    beta_is_logit: bool = True,
    chunk_states_size: int | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Token-by-token float64 KDA: returns (o, final_state or None, chunk_states or None)."""
    if chunk_states_size is not None and chunk_states_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_states_size: expected one of {CHUNK_SIZES} or None, found {chunk_states_size!r}")
    p = _prepare(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, lower_bound=lower_bound,
                 gate=gate, initial_state=initial_state, cu_seqlens=cu_seqlens, layout=layout,
                 state_layout=state_layout, use_qk_l2norm=use_qk_l2norm, allow_neg_eigval=allow_neg_eigval,
                 beta_is_logit=beta_is_logit)
    o = torch.zeros_like(p.v)
    finals: list[Tensor] = []
    chunk_states: list[Tensor] | None = [] if chunk_states_size is not None else None
    for n, (bi, start, end) in enumerate(p.segments):
        S = p.S0[n].clone()  # [HV, V, K]
        for t in range(start, end):
            if chunk_states is not None and (t - start) % chunk_states_size == 0:
                chunk_states.append(S.clone())  # state entering this chunk
            q_t, k_t, v_t, a_t, b_t = p.q[bi, t], p.k[bi, t], p.v[bi, t], p.a[bi, t], p.b[bi, t]
            S = S * torch.exp(a_t)[:, None, :]  # decay each K column of S
            err = v_t - torch.einsum("hvk,hk->hv", S, k_t)  # delta rule: v_t - S k_t
            S = S + b_t[:, None, None] * err[:, :, None] * k_t[:, None, :]
            o[bi, t] = p.scale * torch.einsum("hvk,hk->hv", S, q_t)
        finals.append(S)
    return _finish(p, o, finals, chunk_states, output_final_state)


# ------------------------------------------------------------------------- chunked


def _intra_chunk_matrices(q: Tensor, k: Tensor, G: Tensor, b: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """L (strictly lower, rows times b) and Mqk (lower incl. diagonal) of one chunk.

    q, k, G: [HV, C, K]; b: [HV, C]. Built from 16x16 sub-tiles as the kernels must: every
    exponent used is G_i - G_j with i >= j (a decay, <= 0 for a <= 0), so nothing overflows
    however strong the gate; raw 1/Gamma never appears.
    """
    HV, C, _ = k.shape
    t = SUB_TILE
    L = k.new_zeros(HV, C, C)
    M = k.new_zeros(HV, C, C)
    ii = torch.arange(t, device=k.device)
    lower_incl = ii[:, None] >= ii[None, :]  # j <= i
    for r in range(C // t):
        rows = slice(r * t, (r + 1) * t)
        for s in range(r + 1):
            cols = slice(s * t, (s + 1) * t)
            if s == r:
                # Diagonal block: pairwise exp(G_i - G_j), masked to j <= i BEFORE exp so the
                # upper triangle (positive exponents) never evaluates to inf.
                diff = G[:, rows, None, :] - G[:, None, cols, :]  # [HV, i, j, K]
                diff = diff.masked_fill(~lower_incl[None, :, :, None], -math.inf)
                E = torch.exp(diff)
                Lb = torch.einsum("hik,hjk,hijk->hij", k[:, rows], k[:, cols], E)
                Mb = scale * torch.einsum("hik,hjk,hijk->hij", q[:, rows], k[:, cols], E)
                L[:, rows, cols] = Lb.tril(-1)  # strictly lower
                M[:, rows, cols] = Mb
            else:
                # Off-diagonal block (r > s): anchor at the last row of block s, so
                # exp(G_i - G_anchor) and exp(G_anchor - G_j) are both decays (<= 1).
                anchor = G[:, (s + 1) * t - 1, None, :]  # [HV, 1, K]
                left = torch.exp(G[:, rows] - anchor)
                right = k[:, cols] * torch.exp(anchor - G[:, cols])
                L[:, rows, cols] = (k[:, rows] * left) @ right.transpose(-1, -2)
                M[:, rows, cols] = (scale * q[:, rows] * left) @ right.transpose(-1, -2)
    return b[:, :, None] * L, M


def _chunk_step(S0: Tensor, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, scale: float
                ) -> tuple[Tensor, Tensor]:
    """One chunk for all value heads. S0 [HV, V, K]; q, k, a [HV, C, K]; v [HV, C, V]; b [HV, C].

    Returns (o [HV, C, V], S1 [HV, V, K]).
    """
    C = q.shape[1]
    G = torch.cumsum(a, dim=1)  # inclusive cumsum inside the chunk
    Kd = k * torch.exp(G)  # k_i * Gamma_i
    Qd = scale * q * torch.exp(G)  # scale * q_i * Gamma_i
    Kr = k * torch.exp(G[:, -1:] - G)  # k_j * Gamma_C / Gamma_j, a decay
    gamma_C = torch.exp(G[:, -1])  # [HV, K]
    L, Mqk = _intra_chunk_matrices(q, k, G, b, scale)
    S0t = S0.transpose(-1, -2)  # [HV, K, V]
    u = b[:, :, None] * (v - Kd @ S0t)
    inv = neumann_inverse_16(L) if C == 16 else block_inverse_64(L)
    U = inv @ u  # (I + L)^-1 u
    o = Qd @ S0t + Mqk @ U
    S1 = S0 * gamma_C[:, None, :] + U.transpose(-1, -2) @ Kr
    return o, S1


def kda_chunked_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    scale: float | None = None,
    lower_bound: float | None = -5.0,
    gate: str | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    layout: str = "BSND",
    state_layout: str = "VK",
    use_qk_l2norm: bool = True,
    allow_neg_eigval: bool = False,
    beta_is_logit: bool = True,
    chunk_states_size: int | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Chunked float64 KDA (DESIGN.md section 1); same contract as ``kda_reference``."""
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES}, found {chunk_size!r}")
    if chunk_states_size is not None and chunk_states_size != chunk_size:
        raise ValueError(
            f"chunk_states_size: expected None or chunk_size={chunk_size}, found {chunk_states_size!r}"
        )
    p = _prepare(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, lower_bound=lower_bound,
                 gate=gate, initial_state=initial_state, cu_seqlens=cu_seqlens, layout=layout,
                 state_layout=state_layout, use_qk_l2norm=use_qk_l2norm, allow_neg_eigval=allow_neg_eigval,
                 beta_is_logit=beta_is_logit)
    C = chunk_size
    o = torch.zeros_like(p.v)
    finals: list[Tensor] = []
    chunk_states: list[Tensor] | None = [] if chunk_states_size is not None else None
    for n, (bi, start, end) in enumerate(p.segments):
        S = p.S0[n].clone()
        for c0 in range(start, end, C):
            c1 = min(c0 + C, end)
            if chunk_states is not None:
                chunk_states.append(S.clone())

            def chunk(x: Tensor) -> Tensor:
                # [len, HV, ...] -> [HV, C, ...]; a ragged tail is padded with zero rows, which
                # means gate 0 (no decay) and beta 0 (no update), so they change nothing.
                x = x[bi, c0:c1].movedim(0, 1)
                pad = C - (c1 - c0)
                if pad:
                    x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)
                return x

            oc, S = _chunk_step(S, chunk(p.q), chunk(p.k), chunk(p.v), chunk(p.a), chunk(p.b), p.scale)
            o[bi, c0:c1] = oc[:, : c1 - c0].movedim(1, 0)
        finals.append(S)
    return _finish(p, o, finals, chunk_states, output_final_state)


# --------------------------------------------------------------------------- metric


def rel_rmse(x: Tensor, ref: Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (||x - ref|| when ref is all zero; inf if x is not finite)."""
    x = torch.as_tensor(x)
    ref = torch.as_tensor(ref)
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"x: expected the shape of ref {tuple(ref.shape)}, found {tuple(x.shape)}")
    x64 = x.detach().to(device="cpu", dtype=torch.float64)
    r64 = ref.detach().to(device="cpu", dtype=torch.float64)
    if not torch.isfinite(r64).all():
        raise ValueError("ref: contains NaN or inf; a reference must be finite")
    if not torch.isfinite(x64).all():
        return math.inf
    err = torch.linalg.vector_norm(x64 - r64).item()
    den = torch.linalg.vector_norm(r64).item()
    return err / den if den > 0 else err
