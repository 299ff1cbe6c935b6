"""The affine-map pieces of the scan (kdagen/scan/maps.py, layout.py, chain.py) and the torch
three-step scheme (kdagen/scan/reference.py) against the float64 token-by-token reference."""

from __future__ import annotations

import zlib

import pytest
import torch

from kdagen.reference import _chunk_step, kda_reference, rel_rmse
from kdagen.scan.chain import chain_states, chain_triton
from kdagen.scan.layout import balanced, split
from kdagen.scan.maps import apply_map, chain, chunk_maps, compose, fold, identity_map, rerun, segment_maps
from kdagen.scan.reference import kda_scan_reference

f64 = torch.float64


def rnd(gen, *shape, scale=1.0, dtype=f64):
    return torch.randn(*shape, generator=gen, dtype=dtype) * scale


def chunk_inputs(gen, lead, C, K, V, decay=0.05):
    """Canonical per-chunk inputs: unit-norm q, k, weak log-decays, beta in (0, 1)."""
    q = torch.nn.functional.normalize(rnd(gen, *lead, C, K), dim=-1)
    k = torch.nn.functional.normalize(rnd(gen, *lead, C, K), dim=-1)
    v = rnd(gen, *lead, C, V)
    a = -decay * torch.rand(*lead, C, K, generator=gen, dtype=f64)
    b = torch.sigmoid(rnd(gen, *lead, C))
    return q, k, v, a, b


@pytest.mark.parametrize("C", [16, 64])
def test_chunk_map_is_the_chunk_step(C):
    # S1 = S0 A + B and o = O0 + Qe S0^T equal the chunk step itself, for any entering state.
    gen = torch.Generator().manual_seed(C)
    HV, K, V = 3, 16, 8
    q, k, v, a, b = chunk_inputs(gen, (HV,), C, K, V)
    m = chunk_maps(q, k, v, a, b, 0.25)
    for _ in range(2):
        S0 = rnd(gen, HV, V, K)
        o, S1 = _chunk_step(S0, q, k, v, a, b, 0.25)
        assert rel_rmse(apply_map(S0, m.A, m.B), S1) < 1e-13
        assert rel_rmse(m.O0 + m.Qe @ S0.transpose(-1, -2), o) < 1e-13
    # B is the state built from zero, A the linear part: the step from S0 = 0 gives (o=O0, S1=B).
    o, S1 = _chunk_step(torch.zeros(HV, V, K, dtype=f64), q, k, v, a, b, 0.25)
    assert rel_rmse(S1, m.B) < 1e-13 and rel_rmse(o, m.O0) < 1e-13
    # gate 0 and beta 0 everywhere: the identity map
    z = chunk_maps(q, k, v, torch.zeros_like(a), torch.zeros_like(b), 0.25)
    assert torch.allclose(z.A, torch.eye(K, dtype=f64).expand(HV, K, K)) and z.B.abs().max() == 0


def test_compose_is_associative_with_identity_and_fold_is_in_order():
    gen = torch.Generator().manual_seed(1)
    K, V, n = 8, 4, 7
    A = rnd(gen, n, 2, K, K, scale=K ** -0.5)
    B = rnd(gen, n, 2, V, K)
    m = [(A[i], B[i]) for i in range(n)]
    left = compose(compose(m[0], m[1]), m[2])
    right = compose(m[0], compose(m[1], m[2]))
    assert all(rel_rmse(x, y) < 1e-14 for x, y in zip(left, right))
    I, Z = identity_map((2,), V, K, dtype=f64, device="cpu")
    assert all(rel_rmse(x, y) < 1e-15 for x, y in zip(compose((I, Z), m[3]), m[3]))
    # the tree fold (odd count) equals the sequential left fold, not a reordered one
    seq = m[0]
    for x in m[1:]:
        seq = compose(seq, x)
    tree = fold(A, B, dim=0)
    assert all(rel_rmse(x, y) < 1e-13 for x, y in zip(tree, seq))
    rev = fold(A.flip(0), B.flip(0), dim=0)
    assert rel_rmse(rev[0], seq[0]) > 1e-2  # order matters: the test would see a reordering
    S0 = rnd(gen, 2, V, K)
    S = S0
    for x in m:
        S = apply_map(S, *x)
    assert rel_rmse(apply_map(S0, *tree), S) < 1e-12


def test_segment_maps_chain_and_rerun_equal_the_one_piece_recurrence():
    # Three sequences of 5, 1 and 0 chunks cut into 3 (2 + 2 + 1: 5 chunks do not divide), 1
    # and 1 segments; weak decay so the entering states matter.
    gen = torch.Generator().manual_seed(2)
    HV, C, K, V = 2, 16, 16, 8
    counts_chunks = [2, 2, 1, 1, 0]
    seg_per_seq = [3, 1, 1]
    n = sum(counts_chunks)
    q, k, v, a, b = chunk_inputs(gen, (n, HV), C, K, V, decay=0.01)
    m = chunk_maps(q, k, v, a, b, 0.3)
    A_seg, B_seg = segment_maps(m.A, m.B, counts_chunks)
    assert A_seg.shape == (5, HV, K, K)
    assert torch.allclose(A_seg[4], torch.eye(K, dtype=f64).expand(HV, K, K)) and B_seg[4].abs().max() == 0
    S0 = rnd(gen, 3, HV, V, K)
    S_in, final = chain(A_seg, B_seg, S0, seg_per_seq)
    o, entering, exits = rerun(S_in, q, k, v, a, b, 0.3, counts_chunks)
    # one piece: every chunk in order from each sequence's S0
    seq_chunks = [[0, 1, 2, 3, 4], [5], []]
    for s, chunks in enumerate(seq_chunks):
        S = S0[s]
        for c in chunks:
            assert rel_rmse(entering[c], S) < 1e-12
            oc, S = _chunk_step(S, q[c], k[c], v[c], a[c], b[c], 0.3)
            assert rel_rmse(o[c], oc) < 1e-12
        assert rel_rmse(final[s], S) < 1e-12
    assert rel_rmse(exits[2], final[0]) < 1e-12 and rel_rmse(exits[4], S0[2]) == 0
    # a chain that forgets the entering state is far off: the check above can fail
    wrong, _ = chain(A_seg, B_seg, torch.zeros_like(S0), seg_per_seq)
    assert rel_rmse(wrong[1], S_in[1]) > 0.1


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("K,counts", [(32, [3, 1, 4, 1]), (64, [2, 0, 3])])  # 64: the kernel's tiles
@pytest.mark.parametrize("twin", [False, True], ids=["packed", "twin_slices"])
def test_chain_implementations_match_float64(impl, K, counts, twin):
    # K = 64 walks the Triton kernel's [BK, BJ] = [32, 32] tiles; a count of 0 passes S0 through.
    # twin_slices: A and B are the head halves of one [S, 2 HV, K, K] output, as the twin run
    # gives them (read in place through their strides).
    gen = torch.Generator().manual_seed(3)
    S, HV, V = sum(counts), 2, K
    A = rnd(gen, S, HV, K, K, scale=K ** -0.5)
    B = rnd(gen, S, HV, V, K)
    S0 = rnd(gen, len(counts), HV, V, K)
    ref_in, ref_out = chain(A, B, S0, counts)
    f32 = lambda x: x.float()  # noqa: E731
    if twin:
        both = torch.cat([B, A], dim=1).float()
        f32 = lambda x: both[:, HV:] if x is A else both[:, :HV] if x is B else x.float()  # noqa: E731
        assert not f32(A).is_contiguous() and not f32(B).is_contiguous()
    if impl == "triton":
        got_in, got_out = chain_triton(f32(A), f32(B), f32(S0), counts)
    else:
        got_in, got_out = chain_states(f32(A), f32(B), f32(S0), counts, impl="torch")
    assert got_in.dtype == torch.float32
    assert rel_rmse(got_in, ref_in) < 1e-6 and rel_rmse(got_out, ref_out) < 1e-6


def test_chain_triton_rejects_what_it_cannot_run():
    A = torch.zeros(2, 1, 8, 8)
    with pytest.raises(ValueError, match="power-of-two K, V >= 16"):
        chain_triton(A, torch.zeros(2, 1, 8, 8), torch.zeros(1, 1, 8, 8), [2])


def test_layout_split_on_chunk_boundaries():
    assert balanced(5, 3) == [2, 2, 1] and balanced(0, 1) == [0]
    lay = split([0, 300, 307, 307, 447], [3, 1, 4, 2], 64)
    # 300 tokens = 5 units of 64 into 3: 2 + 2 + 1 units, the last ragged
    assert lay.bounds == (0, 128, 256, 300, 307, 307, 435, 447)  # 140 tokens: 2 + 1 units
    assert lay.counts == (3, 1, 1, 2) and lay.first == [0, 3, 4, 5] and lay.last == [2, 3, 4, 6]
    assert lay.chunks(16) == [8, 8, 3, 1, 0, 8, 1]
    assert lay.sequence_of == [0, 0, 0, 1, 2, 3, 3] and lay.split_any
    assert not split([0, 64, 100], 1, 64).split_any
    with pytest.raises(ValueError, match="segments: expected one count >= 1 or 2"):
        split([0, 64, 100], [1], 64)
    with pytest.raises(ValueError, match="cu: expected non-decreasing"):
        split([0, 64, 10], 2, 64)
    with pytest.raises(ValueError, match="divisor of the layout's alignment 64"):
        lay.chunks(48)


def make_problem(seed, *, B=1, T=150, lens=None, H=1, HV=2, K=16, V=16, layout="BSND", state_layout="VK",
                 lower_bound=-1e-3, gate="bounded", with_state=True):
    gen = torch.Generator().manual_seed(seed)
    if lens is not None:
        B, T = 1, sum(lens)
    N = len(lens) if lens is not None else B
    t = dict(q=rnd(gen, B, T, H, K), k=rnd(gen, B, T, H, K), v=rnd(gen, B, T, HV, V), g=rnd(gen, B, T, HV, K),
             beta=rnd(gen, B, T, HV))
    if layout == "BNSD":
        t = {n: x.transpose(1, 2).contiguous() for n, x in t.items()}
    kw = dict(t, gate=gate, A_log=rnd(gen, HV, scale=0.5), dt_bias=rnd(gen, HV, K), layout=layout,
              state_layout=state_layout, lower_bound=lower_bound if gate == "bounded" else None)
    if lens is not None:
        kw["cu_seqlens"] = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
    if with_state:
        kw["initial_state"] = rnd(gen, N, HV, *((V, K) if state_layout == "VK" else (K, V)), scale=0.5)
    return kw


@pytest.mark.parametrize("case", [
    # (name, problem kwargs, chunk, segments)
    ("batched-bsnd-c16-seg3", dict(B=2, T=150), 16, 3),  # 10 chunks into 3
    ("varlen-bnsd-kv-c16", dict(lens=[150, 7, 0, 70], layout="BNSD", state_layout="KV"), 16, [4, 3, 1, 2]),
    ("varlen-c64-gqa", dict(lens=[200, 64, 65], H=1, HV=2), 64, [3, 2, 2]),
    ("unbounded-no-state", dict(B=1, T=100, gate="unbounded", with_state=False), 16, 5),
    ("lower-bound--5", dict(B=1, T=90, lower_bound=-5.0), 16, 4),
], ids=lambda c: c[0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_scan_reference_equals_the_recurrence(case, dtype):
    name, pk, C, segs = case
    kw = make_problem(zlib.crc32(name.encode()) % 1000, **pk)
    ro, rs, rc = kda_reference(**kw, output_final_state=True, chunk_states_size=C)
    o, s, c = kda_scan_reference(**kw, output_final_state=True, return_chunk_states=True, chunk_size=C,
                                 segments=segs, dtype=dtype)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    errs = (rel_rmse(o, ro), rel_rmse(s, rs), rel_rmse(c, rc))
    assert max(errs) < tol, errs
    assert o.shape == ro.shape and s.shape == rs.shape and c.shape == rc.shape


def test_scan_reference_weak_gate_depends_on_the_chain():
    # lower_bound -1e-3 keeps almost all of the state over 150 tokens: dropping the chained
    # entering states (every segment from zero) is far off, so the test above can fail.
    kw = make_problem(7, B=1, T=150)
    ro, _, _ = kda_reference(**kw)
    o, _, _ = kda_scan_reference(**kw, segments=3, chunk_size=16)
    kw0 = dict(kw, initial_state=None)
    o_zero, _, _ = kda_scan_reference(**kw0, segments=1, chunk_size=16)
    assert rel_rmse(o, ro) < 1e-12 and rel_rmse(o_zero, ro) > 0.05
