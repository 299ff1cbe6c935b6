"""Tests of the float64 KDA references (kdagen/reference.py)."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from kdagen.reference import (
    activate_gate,
    block_inverse_64,
    kda_chunked_reference,
    kda_reference,
    neumann_inverse_16,
    rel_rmse,
    resolve_gate,
)

f64 = torch.float64


def make_inputs(
    *,
    seed: int,
    B: int = 1,
    T: int = 45,
    H: int = 2,
    HV: int = 4,
    K: int = 16,
    V: int = 8,
    layout: str = "BSND",
    gate: str = "bounded",
    g_mode: str = "randn",
    dt_scale: float | None = 1.0,
    A_log_value: float | None = None,
    state: bool = True,
    N: int | None = None,
    state_layout: str = "VK",
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Random inputs in the given layout (never all-zero)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=f64)

    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, HV, V)
    beta = rnd(B, T, HV)
    if g_mode == "randn":
        g = rnd(B, T, HV, K)
    elif g_mode == "wide":  # N(0, 8)
        g = 8.0 * rnd(B, T, HV, K)
    else:  # a constant
        g = torch.full((B, T, HV, K), float(g_mode), dtype=f64)
    kw: dict = {"gate": gate}
    if gate == "precomputed":
        if g_mode == "randn":
            g = -torch.nn.functional.softplus(g)  # a log-decay must be <= 0
        elif g_mode == "wide":
            g = -g.abs()
        kw.update(A_log=None, lower_bound=None)
    else:
        A_log = rnd(HV) if A_log_value is None else torch.full((HV,), A_log_value, dtype=f64)
        kw.update(A_log=A_log.float(), lower_bound=-5.0 if gate == "bounded" else None)
        if dt_scale is not None:
            kw["dt_bias"] = (dt_scale * rnd(HV, K)).float()
    if state:
        n = B if N is None else N
        S0 = rnd(n, HV, V, K)
        kw["initial_state"] = S0 if state_layout == "VK" else S0.transpose(-1, -2).contiguous()
    kw["state_layout"] = state_layout
    if layout == "BNSD":
        q, k, v, g = (x.transpose(1, 2).contiguous() for x in (q, k, v, g))
        beta = beta.transpose(1, 2).contiguous()
    kw["layout"] = layout
    return dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.to(dtype), beta=beta.to(dtype), **kw)


def l2norm64(x: torch.Tensor) -> torch.Tensor:
    x = x.to(f64)
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


# --------------------------------------------------------------- against fla's naive


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", [(2, 37, 2, 4, 16, 8), (1, 53, 1, 3, 8, 12), (3, 29, 4, 4, 32, 16)])
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_matches_fla_naive_recurrent(seed, shape, gate):
    from fla.ops.kda.naive import naive_recurrent_kda

    B, T, H, HV, K, V = shape
    inp = make_inputs(seed=seed, B=B, T=T, H=H, HV=HV, K=K, V=V, gate=gate)
    o, S, _ = kda_reference(**inp, output_final_state=True)

    a = activate_gate(inp["g"], gate=gate, A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])
    o_fla, S_fla = naive_recurrent_kda(
        l2norm64(inp["q"]), l2norm64(inp["k"]), inp["v"].to(f64), a, torch.sigmoid(inp["beta"].to(f64)),
        initial_state=inp["initial_state"].to(f64).transpose(-1, -2),  # fla's state is [K, V]
        output_final_state=True,
    )
    # fla's naive casts every input to float32 internally (x.to(torch.float)), so it is only a
    # float32-accurate oracle: 1e-5, not the 1e-10 a float64 computation would allow.
    assert o.dtype == f64 and S.dtype == f64
    assert rel_rmse(o_fla, o) < 1e-5
    assert rel_rmse(S_fla.transpose(-1, -2), S) < 1e-5


# ------------------------------------------------------------ the conventions, by hand


def test_conventions_by_hand_two_steps():
    """Per-head loops with matrix-vector products: GQA map, scale, eps, beta x2, decay before update."""
    B, T, H, HV, K, V = 1, 2, 2, 4, 5, 3
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(B, T, H, K, generator=gen, dtype=f64), torch.randn(B, T, H, K, generator=gen, dtype=f64)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=f64)
    g = torch.randn(B, T, HV, K, generator=gen, dtype=f64)
    beta = torch.randn(B, T, HV, generator=gen, dtype=f64)
    A_log = torch.randn(HV, generator=gen, dtype=f64)
    dt_bias = torch.randn(HV * K, generator=gen, dtype=f64)
    S0 = torch.randn(1, HV, V, K, generator=gen, dtype=f64)
    scale = 0.3
    o, S, _ = kda_reference(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, lower_bound=-3.0,
                            initial_state=S0, output_final_state=True, allow_neg_eigval=True)
    for h in range(HV):
        hq = h // (HV // H)
        Sh = S0[0, h].clone()
        for t in range(T):
            qt = q[0, t, hq] / math.sqrt(float((q[0, t, hq] ** 2).sum()) + 1e-6)
            kt = k[0, t, hq] / math.sqrt(float((k[0, t, hq] ** 2).sum()) + 1e-6)
            at = torch.tensor([
                -3.0 / (1.0 + math.exp(-math.exp(A_log[h]) * (g[0, t, h, i] + dt_bias[h * K + i])))
                for i in range(K)
            ], dtype=f64)
            bt = 2.0 / (1.0 + math.exp(-float(beta[0, t, h])))
            Sh = Sh @ torch.diag(torch.exp(at))
            Sh = Sh + bt * torch.outer(v[0, t, h] - Sh @ kt, kt)
            assert rel_rmse(o[0, t, h], scale * (Sh @ qt)) < 1e-13
        assert rel_rmse(S[0, h], Sh) < 1e-13


def test_activate_gate_formulas():
    gen = torch.Generator().manual_seed(3)
    HV, K = 3, 4
    g = 6 * torch.randn(2, 5, HV, K, generator=gen, dtype=f64)
    A_log = torch.randn(HV, generator=gen, dtype=f64)
    dt = 4 * torch.randn(HV, K, generator=gen, dtype=f64)
    bounded = activate_gate(g, gate="bounded", A_log=A_log, dt_bias=dt, lower_bound=-5.0)
    unbounded = activate_gate(g, gate="unbounded", A_log=A_log, dt_bias=dt.flatten())
    for idx in [(0, 0, 0, 0), (1, 4, 2, 3), (0, 3, 1, 2)]:
        h, kk = idx[2], idx[3]
        x = float(g[idx] + dt[h, kk])
        rate = math.exp(float(A_log[h]))
        assert bounded[idx].item() == pytest.approx(-5.0 / (1 + math.exp(-rate * x)), rel=1e-14)
        assert unbounded[idx].item() == pytest.approx(-rate * math.log1p(math.exp(x)), rel=1e-14)
    # softplus must be exact in the tail, where torch's thresholded softplus is off by ~2e-9.
    big = torch.full((1, 1, 1, 1), 25.0, dtype=f64)
    a = activate_gate(big, gate="unbounded", A_log=torch.zeros(1, dtype=f64))
    assert a.item() == pytest.approx(-(25.0 + math.log1p(math.exp(-25.0))), rel=1e-15)
    assert a.item() != -25.0
    # dt_bias None == zeros; precomputed is the identity (upcast); BNSD head axis is 1.
    z = activate_gate(g, gate="unbounded", A_log=A_log)
    assert torch.equal(z, activate_gate(g, gate="unbounded", A_log=A_log, dt_bias=torch.zeros(HV, K)))
    assert torch.equal(activate_gate(g.float(), gate="precomputed"), g.float().to(f64))
    bn = activate_gate(g.transpose(1, 2), gate="bounded", A_log=A_log, dt_bias=dt, lower_bound=-5.0, layout="BNSD")
    assert torch.equal(bn.transpose(1, 2), bounded)


def test_resolve_gate():
    A = torch.zeros(2)
    assert resolve_gate(None, None, -5.0) == "precomputed"
    assert resolve_gate(None, A, None) == "unbounded"
    assert resolve_gate(None, A, -5.0) == "bounded"
    assert resolve_gate("unbounded", A, -5.0) == "unbounded"
    with pytest.raises(ValueError, match="gate"):
        resolve_gate("safe", A, -5.0)


def test_layouts_varlen_state_layouts_and_chunk_states_are_consistent():
    """BNSD == BSND transposed; KV == VK transposed; varlen == separate calls; chunk states == prefix states."""
    inp = make_inputs(seed=11, B=1, T=90, N=4)
    lens = [0, 1, 70, 19]
    cu = torch.tensor([0, 0, 1, 71, 90], dtype=torch.int32)
    o, S, cs = kda_reference(**inp, cu_seqlens=cu, output_final_state=True, chunk_states_size=16)
    assert cs.shape == (0 + 1 + 5 + 2, 4, 8, 16)

    # Each sequence alone, with its own initial state.
    pos, ci = 0, 0
    for n, L in enumerate(lens):
        part = {key: (val[:, pos:pos + L] if key in ("q", "k", "v", "g", "beta") else val) for key, val in inp.items()}
        part["initial_state"] = inp["initial_state"][n:n + 1]
        o_n, S_n, _ = kda_reference(**part, output_final_state=True)
        if L:
            assert rel_rmse(o[:, pos:pos + L], o_n) < 1e-14
        assert rel_rmse(S[n:n + 1], S_n) < 1e-14
        if L == 0:
            assert torch.equal(S[n], inp["initial_state"][n].to(f64))  # passes through
        # chunk state c == final state of the prefix of length 16c
        for c in range(math.ceil(L / 16)):
            pre = {key: (val[:, :16 * c] if key in ("q", "k", "v", "g", "beta") else val)
                   for key, val in part.items()}
            _, S_pre, _ = kda_reference(**pre, output_final_state=True)
            assert rel_rmse(cs[ci], S_pre[0]) < 1e-14
            ci += 1
        pos += L
    assert ci == cs.shape[0]

    # int64 cu_seqlens gives the same result.
    o64, _, _ = kda_reference(**inp, cu_seqlens=cu.long())
    assert torch.equal(o64, o)

    # BNSD and KV.
    inp_b = make_inputs(seed=11, B=1, T=90, N=4, layout="BNSD", state_layout="KV")
    o_b, S_b, cs_b = kda_reference(**inp_b, cu_seqlens=cu, output_final_state=True, chunk_states_size=16)
    assert rel_rmse(o_b.transpose(1, 2), o) < 1e-15
    assert rel_rmse(S_b.transpose(-1, -2), S) < 1e-15
    assert rel_rmse(cs_b.transpose(-1, -2), cs) < 1e-15


def test_optional_outputs_and_qk_norm_off():
    inp = make_inputs(seed=5, B=2, T=20, state=False)
    o, S, cs = kda_reference(**inp)
    assert S is None and cs is None and o.shape == (2, 20, 4, 8) and o.dtype == f64
    # use_qk_l2norm=False: feeding pre-normalised q/k must give the same output.
    pre = dict(inp, q=l2norm64(inp["q"]), k=l2norm64(inp["k"]))
    o2, _, _ = kda_reference(**pre, use_qk_l2norm=False)
    assert rel_rmse(o2, o) < 1e-14
    o3, _, _ = kda_reference(**inp, use_qk_l2norm=False)
    assert rel_rmse(o3, o) > 1e-2  # raw q/k really are not normalised


# -------------------------------------------------------------- chunked vs recurrence

CASES = {
    "bsnd": dict(B=2, T=150),
    "bnsd": dict(B=2, T=77, layout="BNSD"),
    "gqa_h1": dict(T=70, H=1, HV=4),
    "no_state": dict(T=100, state=False),
    "unbounded": dict(T=130, gate="unbounded"),
    "precomputed": dict(T=130, gate="precomputed"),
    "precomputed_wide": dict(T=130, gate="precomputed", g_mode="wide"),
    "precomputed_-8": dict(T=81, gate="precomputed", g_mode="-8"),
    "precomputed_0": dict(T=81, gate="precomputed", g_mode="0"),
    "kv_state": dict(B=2, T=70, state_layout="KV"),
    "k64_v32": dict(T=66, H=1, HV=2, K=64, V=32),
    "nodt": dict(T=70, dt_scale=None),
    # a_t ~ -100 per step: exp(G) spans exp(-6400) inside one 64-chunk; 1/Gamma would be inf.
    # (softplus(0) = log 2, so A_log = log(150) gives a = -104 per step.)
    "unbounded_huge_decay": dict(T=140, gate="unbounded", A_log_value=math.log(150.0), g_mode="0", dt_scale=None),
    "unbounded_huge_decay_randn": dict(T=140, gate="unbounded", A_log_value=math.log(150.0)),
}
for _gate in ("bounded", "unbounded"):
    for _gm in ("-8", "0", "8", "wide"):
        CASES[f"{_gate}_g{_gm}"] = dict(T=97, gate=_gate, g_mode=_gm)
    for _dt in (4.0, -4.0, 8.0, -8.0):
        CASES[f"{_gate}_dt{_dt:+g}"] = dict(T=97, gate=_gate, dt_scale=_dt)


def _check_chunked(inp: dict, C: int, **extra) -> None:
    ref = kda_reference(**inp, output_final_state=True, chunk_states_size=C, **extra)
    got = kda_chunked_reference(**inp, output_final_state=True, chunk_states_size=C, chunk_size=C, **extra)
    for name, r, x in zip(("o", "final_state", "chunk_states"), ref, got):
        assert x.dtype == f64 and x.shape == r.shape, name
        assert torch.isfinite(x).all(), name
        err = rel_rmse(x, r)
        assert err < 1e-9, f"{name}: rel rmse {err:.3e}"


@pytest.mark.parametrize("C", [16, 64])
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_matches_recurrence(case, C):
    _check_chunked(make_inputs(seed=zlib.crc32(case.encode()) % 1000, **CASES[case]), C)


@pytest.mark.parametrize("C", [16, 64])
@pytest.mark.parametrize("layout", ["BSND", "BNSD"])
def test_chunked_matches_recurrence_varlen(C, layout):
    # empty, length-1, exact multiples, ragged, and a sequence longer than two 64-chunks
    lens = [0, 1, 64, 0, 16, 37, 1, 150]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    inp = make_inputs(seed=21, B=1, T=sum(lens), N=len(lens), layout=layout, state_layout="KV")
    _check_chunked(inp, C, cu_seqlens=cu)


@pytest.mark.parametrize("C", [16, 64])
def test_chunked_matches_recurrence_neg_eigval(C):
    _check_chunked(make_inputs(seed=4, B=2, T=100), C, allow_neg_eigval=True)


@pytest.mark.parametrize("C", [16, 64])
def test_chunked_huge_decay_is_not_trivial(C):
    # With a = -104 the state is forgotten each step and o_t = scale * b_t v_t <k_t, q_t> up to
    # exp(-104); check the chunked output is this (nonzero) value, not a collapse to zero.
    inp = make_inputs(seed=9, T=70, gate="unbounded", A_log_value=math.log(150.0), g_mode="0", dt_scale=None)
    o, _, _ = kda_chunked_reference(**inp, chunk_size=C)
    q, k = l2norm64(inp["q"]).repeat_interleave(2, 2), l2norm64(inp["k"]).repeat_interleave(2, 2)
    b = torch.sigmoid(inp["beta"].to(f64))
    approx = 16 ** -0.5 * b[..., None] * inp["v"].to(f64) * (q * k).sum(-1, keepdim=True)
    assert o.abs().max() > 1e-2
    assert rel_rmse(o, approx) < 1e-12


# -------------------------------------------------------------------------- inverses


def _strictly_lower(n: int, seed: int, scale: float, batch: tuple[int, ...] = (3,)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*batch, n, n, generator=gen, dtype=f64)).tril(-1)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("scale", [0.1, 0.5])
def test_neumann_inverse_16(seed, scale):
    L = _strictly_lower(16, seed, scale)
    ref = torch.linalg.inv(torch.eye(16, dtype=f64) + L)
    got = neumann_inverse_16(L)
    assert rel_rmse(got, ref) < 1e-13
    assert (got - torch.eye(16, dtype=f64)).abs().max() > scale / 2  # not the identity


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("scale", [0.1, 0.3])
def test_block_inverse_64(seed, scale):
    L = _strictly_lower(64, seed, scale, batch=(2, 2))
    ref = torch.linalg.inv(torch.eye(64, dtype=f64) + L)
    got = block_inverse_64(L)
    assert rel_rmse(got, ref) < 1e-12
    # The off-diagonal 16-blocks matter: dropping them changes the answer.
    bd = L.clone()
    for i in range(4):
        bd[..., 16 * i:16 * (i + 1), :16 * i] = 0
    assert rel_rmse(block_inverse_64(bd), ref) > 1e-2


def test_inverse_shape_errors():
    with pytest.raises(ValueError, match=r"L: expected shape \[\.\.\., 16, 16\]"):
        neumann_inverse_16(torch.zeros(32, 32))
    with pytest.raises(ValueError, match=r"L: expected shape \[\.\.\., 64, 64\]"):
        block_inverse_64(torch.zeros(16, 16))


# --------------------------------------------------------------------------- rel_rmse


def test_rel_rmse():
    ref = torch.tensor([3.0, 4.0], dtype=f64)
    assert rel_rmse(ref * 1.1, ref) == pytest.approx(0.1, rel=1e-12)
    assert rel_rmse(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1, rel=1e-12)
    assert rel_rmse(torch.tensor([float("nan"), 4.0]), ref) == math.inf
    assert rel_rmse(torch.tensor([float("inf"), 4.0]), ref) == math.inf
    assert rel_rmse(torch.tensor([3.0, 4.0]), torch.zeros(2)) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="x: expected the shape of ref"):
        rel_rmse(torch.ones(3), ref)


# ----------------------------------------------------------------------------- errors


def _bad(inp: dict, **changes) -> dict:
    out = dict(inp)
    out.update(changes)
    return out


BASE = make_inputs(seed=0, B=1, T=37, H=2, HV=4, K=16, V=8)
ERRORS = {
    "v_shape": (_bad(BASE, v=BASE["v"][:, :36]),
                r"v: expected shape \[B, T, HV, V\] with B=1, T=37 \(layout BSND\), found \(1, 36, 4, 8\)"),
    "k_shape": (_bad(BASE, k=BASE["k"][..., :8]), r"k: expected shape \[B, T, H, K\] with B=1, T=37, H=2, K=16"),
    "q_ndim": (_bad(BASE, q=BASE["q"][0]), r"q: expected shape \[B, T, H, K\]"),
    "hv_multiple": (_bad(BASE, v=torch.randn(1, 37, 3, 8), g=torch.randn(1, 37, 3, 16), beta=torch.randn(1, 37, 3),
                         A_log=torch.randn(3), dt_bias=None, initial_state=None),
                    r"v: expected the value-head count HV to be a positive multiple of H=2"),
    "g_shape": (_bad(BASE, g=BASE["g"][..., :4]), r"g: expected shape \[B, T, HV, K\]"),
    "beta_shape": (_bad(BASE, beta=BASE["beta"][..., None]), r"beta: expected shape \[B, T, HV\]"),
    "beta_int": (_bad(BASE, beta=torch.ones(1, 37, 4, dtype=torch.int64)), r"beta: expected a floating-point tensor"),
    "layout": (_bad(BASE, layout="BHSD"), r"layout: expected one of"),
    "state_layout": (_bad(BASE, state_layout="kv"), r"state_layout: expected one of"),
    "state_shape": (_bad(BASE, initial_state=torch.randn(1, 4, 16, 8)),
                    r"initial_state: expected shape \[N, HV, V, K\] with N=1, HV=4, V=8, K=16 \(state_layout VK\)"),
    "A_log_shape": (_bad(BASE, A_log=torch.randn(2)), r"A_log: expected shape \[HV\] with HV=4"),
    "A_log_missing": (_bad(BASE, A_log=None, gate="unbounded"), r"A_log: required for gate='unbounded'"),
    "A_log_precomputed": (_bad(BASE, gate="precomputed"), r"A_log: must be None for gate='precomputed'"),
    "dt_bias_shape": (_bad(BASE, dt_bias=torch.randn(4, 8)), r"dt_bias: expected shape \[HV, K\] or \[HV\*K\]"),
    "lower_bound_none": (_bad(BASE, lower_bound=None, gate="bounded"), r"lower_bound: required for gate='bounded'"),
    "lower_bound_positive": (_bad(BASE, lower_bound=5.0), r"lower_bound: expected a finite number <= 0"),
    "gate_name": (_bad(BASE, gate="safe"), r"gate: expected one of"),
    "cu_batch": (_bad(make_inputs(seed=0, B=2, T=10, N=1), cu_seqlens=torch.tensor([0, 10])),
                 r"cu_seqlens: requires batch size B=1"),
    "cu_dtype": (_bad(BASE, cu_seqlens=torch.tensor([0.0, 37.0])), r"cu_seqlens: expected a 1-D int32 or int64"),
    "cu_last": (_bad(BASE, cu_seqlens=torch.tensor([0, 36])), r"cu_seqlens: expected last entry == total tokens T=37"),
    "cu_first": (_bad(BASE, cu_seqlens=torch.tensor([1, 37])), r"cu_seqlens: expected first entry 0"),
    "cu_order": (_bad(BASE, initial_state=None, cu_seqlens=torch.tensor([0, 20, 10, 37])),
                 r"cu_seqlens: expected non-decreasing"),
    "cu_state_n": (_bad(BASE, cu_seqlens=torch.tensor([0, 20, 37])), r"initial_state: expected shape .* N=2"),
    "chunk_states_size": (_bad(BASE, chunk_states_size=32), r"chunk_states_size: expected (one of|None or chunk_size)"),
    "q_type": (_bad(BASE, q=BASE["q"].numpy()), r"q: expected a torch.Tensor, found ndarray"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_inputs_raise(case):
    inp, pattern = ERRORS[case]
    with pytest.raises(ValueError, match=pattern):
        kda_reference(**inp)
    with pytest.raises(ValueError, match=pattern):
        kda_chunked_reference(**inp, chunk_size=16)


def test_chunked_specific_errors():
    with pytest.raises(ValueError, match=r"chunk_size: expected one of \(16, 64\), found 32"):
        kda_chunked_reference(**BASE, chunk_size=32)
    with pytest.raises(ValueError, match=r"chunk_states_size: expected None or chunk_size=64, found 16"):
        kda_chunked_reference(**BASE, chunk_size=64, chunk_states_size=16)


def test_bnsd_error_names_layout():
    inp = make_inputs(seed=0, T=37, layout="BNSD")
    with pytest.raises(ValueError, match=r"v: expected shape \[B, HV, T, V\] with B=1, T=37 \(layout BNSD\)"):
        kda_reference(**_bad(inp, v=inp["v"][:, :, :36]))
