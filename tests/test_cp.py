"""Context-parallel prefill (kdagen/cp.py): the context's bookkeeping, and 2 and 3 gloo ranks
(spawned processes, the Triton interpreter for the kernels) against the single-process call."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kdagen
from kdagen.cp import build_cp_context, from_fla, from_ranks
from kdagen.errors import KdaInputError
from kdagen.reference import rel_rmse
from kdagen.scan.reference import reference_prefill

from . import cp_worker
from .conftest import HAS_CUDA


def test_context_pieces_starts_and_ends():
    # seq 0 inside rank 0, seq 1 over all three ranks, seq 2 empty (at offset 108: rank 2),
    # seq 3 inside rank 2; 120 tokens split evenly.
    cu = [0, 8, 108, 108, 120]
    c = [build_cp_context(cu, rank=r, world=3) for r in range(3)]
    assert [x.rank_bounds for x in c] == [(0, 40, 80, 120)] * 3
    p0, p1, p2 = (x.pieces for x in c)
    assert [(p.seq, p.start, p.end, p.incoming, p.outgoing) for p in p0] == [(0, 0, 8, False, False),
                                                                            (1, 8, 40, False, True)]
    assert [(p.seq, p.start, p.end, p.incoming, p.outgoing) for p in p1] == [(1, 0, 40, True, True)]
    assert [(p.seq, p.start, p.end, p.incoming, p.outgoing) for p in p2] == [
        (1, 0, 28, True, False), (2, 28, 28, False, False), (3, 28, 40, False, False)]
    assert (c[0].starts, c[0].ends, c[1].starts, c[1].ends, c[2].starts, c[2].ends) == \
        ((0, 1), (0,), (), (), (2, 3), (1, 2, 3))
    assert c[2].local_cu == [0, 28, 28, 40] and c[0].holders(1) == [0, 1, 2]
    # every sequence starts exactly once and ends exactly once over the ranks
    assert sorted(sum((list(x.starts) for x in c), [])) == [0, 1, 2, 3]
    assert sorted(sum((list(x.ends) for x in c), [])) == [0, 1, 2, 3]
    h0 = torch.arange(4.0).reshape(4, 1, 1, 1)
    assert c[2].local_initial_state(h0).flatten().tolist() == [2.0, 3.0]


def test_context_uneven_and_empty_ranks():
    cu = [0, 8, 108, 112, 120]
    c = [build_cp_context(cu, rank=r, world=3, tokens_per_rank=[50, 0, 70]) for r in range(3)]
    assert c[1].pieces == () and c[1].local_tokens == 0
    assert c[2].holders(1) == [0, 2]  # the empty rank holds nothing of the spanning sequence
    # an empty sequence at the very end belongs to the last rank that holds tokens
    e = [build_cp_context([0, 10, 10], rank=r, world=2, tokens_per_rank=[10, 0]) for r in range(2)]
    assert e[0].ends == (0, 1) and e[1].pieces == ()
    with pytest.raises(KdaInputError, match="tokens_per_rank: expected 3 counts >= 0 summing to T=120"):
        build_cp_context(cu, rank=0, world=3, tokens_per_rank=[60, 60])
    with pytest.raises(KdaInputError, match="cu_seqlens: expected non-decreasing global offsets"):
        build_cp_context([0, 5, 3], rank=0, world=2)
    with pytest.raises(KdaInputError, match="torch.distributed is not initialised"):
        build_cp_context(cu)


def test_zigzag_context_holds_two_slots():
    # W = 2, T = 96 in 4 slots of 24: rank 0 holds slots 0 and 3, rank 1 slots 1 and 2.
    # Sequence 1 ([8, 78)) runs through all four; sequence 2 is empty at 78 (slot 3).
    cu = [0, 8, 78, 78, 96]
    c = [build_cp_context(cu, rank=r, world=2, layout="zigzag") for r in range(2)]
    assert c[0].slots == (0, 3) and c[1].slots == (1, 2) and c[0].slot_bounds == (0, 24, 48, 72, 96)
    assert c[0].local_ranges == ((0, 24), (72, 96)) and c[1].local_tokens == 48
    got = [[(p.seq, p.start, p.end, p.incoming, p.outgoing, p.part, p.chain, p.offset) for p in x.pieces] for x in c]
    assert got[0] == [(0, 0, 8, False, False, 0, (), 0), (1, 8, 24, False, True, 0, (), 0),
                      (1, 24, 30, True, False, 1, (0, 1, 2), 64), (2, 30, 30, False, False, 1, (), 0),
                      (3, 30, 48, False, False, 1, (), 0)]
    assert got[1] == [(1, 0, 24, True, True, 0, (0,), 16), (1, 24, 48, True, True, 1, (0, 1), 40)]
    assert (c[0].starts, c[0].ends, c[1].starts, c[1].ends) == ((0, 1, 2, 3), (0, 1, 2, 3), (), ())
    assert [c[0].slot_owner(s) for s in range(4)] == [(0, 0), (1, 0), (1, 1), (0, 1)]
    x = torch.arange(96).view(1, 96)
    assert c[0].take(x).tolist() == [list(range(24)) + list(range(72, 96))]
    with pytest.raises(KdaInputError, match="rank_bounds: a zigzag context's ranks hold 2 intervals"):
        c[0].rank_bounds
    with pytest.raises(KdaInputError, match="tokens_per_rank: expected None with layout='zigzag'"):
        build_cp_context(cu, rank=0, world=2, layout="zigzag", tokens_per_rank=[48, 48])
    with pytest.raises(KdaInputError, match="layout: expected one of contiguous, zigzag, found 'ring'"):
        build_cp_context(cu, rank=0, world=2, layout="ring")
    with pytest.raises(KdaInputError, match="pools: expected one of replicated, local, found 'sharded'"):
        build_cp_context(cu, rank=0, world=2, pools="sharded")


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(lens=st.lists(st.integers(0, 30), min_size=1, max_size=6), world=st.integers(1, 4),
       layout=st.sampled_from(["contiguous", "zigzag"]))
def test_contexts_cover_every_token_and_sequence_once(lens, world, layout):
    # Over the ranks: the slots partition [0, T); every sequence starts once and ends once; each
    # piece is its sequence's tokens in its slot; an entering piece's chain is every earlier slot
    # holding its sequence, and its offset the tokens before it.
    cu = cp_worker.cu_of(lens)
    T = cu[-1]
    c = [build_cp_context(cu, rank=r, world=world, layout=layout) for r in range(world)]
    assert sorted(t for x in c for a, b in x.local_ranges for t in range(a, b)) == list(range(T))
    assert sorted(n for x in c for n in x.starts) == list(range(len(lens)))
    assert sorted(n for x in c for n in x.ends) == list(range(len(lens)))
    for x in c:
        firsts = [a - sum(b_ - a_ for a_, b_ in x.local_ranges[:j]) for j, (a, _) in enumerate(x.local_ranges)]
        assert x.local_cu[-1] == x.local_tokens
        for p in x.pieces:
            a, b = firsts[p.part] + p.start, firsts[p.part] + p.end
            lo, hi = x.local_ranges[p.part]
            assert lo <= a <= b <= hi and cu[p.seq] <= a and b <= cu[p.seq + 1]
            assert p.offset == a - cu[p.seq] and p.incoming == (a > cu[p.seq]) and p.outgoing == (b < cu[p.seq + 1])
            slot = x.slots[p.part]
            assert p.chain == (tuple(s for s in x.holders(p.seq) if s < slot) if p.incoming else ())
    # the exchange reads slot s from maps[r][j] with (r, j) = slot_owner(s)
    n_slots = len(c[0].slot_bounds) - 1
    assert all(c[0].slot_owner(s) == (r, j) for r, x in enumerate(c) for j, s in enumerate(x.slots))
    assert sorted(s for x in c for s in x.slots) == list(range(n_slots))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_fla_contexts_give_the_same_pieces(layout):
    # fla's context (built without a group: world_size and rank given) against kdagen's for the
    # same offsets: the same pieces, chains and offsets; fla drops empty sequences and numbers
    # the rank's pieces itself.
    get_cp_cu_seqlens = pytest.importorskip("fla.ops.cp.context").get_cp_cu_seqlens

    gen = torch.Generator().manual_seed(0)
    for world in (2, 3, 4):
        for _ in range(6):
            lens = torch.randint(0, 40, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
            parts = world * (2 if layout == "zigzag" else 1)
            lens[-1] += -sum(lens) % parts + parts  # fla: T a positive multiple of the slots
            cu = cp_worker.cu_of(lens)
            for r in range(world):
                f = from_fla(get_cp_cu_seqlens(torch.tensor(cu), world_size=world, rank=r, layout=layout),
                             rank=r, world=world)
                k = build_cp_context(cu, rank=r, world=world, layout=layout)
                key = [(p.start, p.end, p.incoming, p.outgoing, p.part, p.chain, p.offset) for p in k.pieces
                       if p.end > p.start]
                assert [(p.start, p.end, p.incoming, p.outgoing, p.part, p.chain, p.offset) for p in f.pieces] == key
                assert (f.slots, f.slot_bounds, f.layout) == (k.slots, k.slot_bounds, k.layout)


def test_call_errors_are_named():
    ctx = build_cp_context([0, 8, 16], rank=0, world=2)
    t, kw = cp_worker.problem(dict(lens=[8, 8]))
    loc = cp_worker.local_slice(t, 0, 8, "BSND")
    with pytest.raises(KdaInputError, match="cu_seqlens: expected None with cp_context"):
        kdagen.kda_prefill(**loc, cp_context=ctx, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(KdaInputError, match="q: expected B = 1 and this rank's 8 tokens"):
        kdagen.kda_prefill(**t, cp_context=ctx)
    with pytest.raises(KdaInputError, match="initial_state: expected one row per sequence starting on rank 0"):
        kdagen.kda_prefill(**loc, **kw, cp_context=ctx)  # both sequences' rows; only seq 0 starts here
    with pytest.raises(KdaInputError, match="cp_context: expected a kdagen.cp.CPContext .build_cp_context. or fla's"):
        kdagen.kda_prefill(**loc, cp_context=[0, 8, 16])
    # strided chunk states keep a row every 32 tokens here: the slot boundary 16 tokens in is off that grid
    t48, _ = cp_worker.problem(dict(lens=[48]))
    cut16 = build_cp_context([0, 48], rank=0, world=2, tokens_per_rank=[16, 32])
    with pytest.raises(KdaInputError, match="return_chunk_states: a slot boundary falls inside a chunk of sequence 0 "
                                            "\\(16 tokens in\\); .* multiples of chunk_size x "
                                            "return_chunk_states = 32"):
        kdagen.kda_prefill(**cp_worker.local_slice(t48, 0, 16, "BSND"), cp_context=cut16, return_chunk_states=2,
                           chunk_size=16)
    with pytest.raises(KdaInputError, match="return_chunk_states: expected True, False or a stride m >= 1"):
        kdagen.kda_prefill(**loc, cp_context=ctx, return_chunk_states=0.5, chunk_size=16)
    # a rank holding no tokens raises it too, before the exchange it would otherwise wait in
    empty = build_cp_context([0, 8, 16], rank=1, world=2, tokens_per_rank=[16, 0])
    with pytest.raises(KdaInputError, match="v: context parallelism carries K x K transitions .* found K=32, V=16"):
        kdagen.kda_prefill(**{n: x[:, :0] for n, x in loc.items()} | {"v": loc["v"][:, :0, :, :16]}, cp_context=empty)


def test_state_pool_errors_are_named():
    # Raised before any collective (no process group here): each names its argument.
    from types import SimpleNamespace

    ctx = build_cp_context([0, 8, 16], rank=0, world=2)
    t, kw = cp_worker.problem(dict(lens=[8, 8]))
    loc = cp_worker.local_slice(t, 0, 8, "BSND")
    pool, idx = cp_worker.pool_of(dict(lens=[8, 8]), kw)
    with pytest.raises(KdaInputError, match="state_pool, state_indices: expected both .* found only state_pool"):
        kdagen.kda_prefill(**loc, cp_context=ctx, state_pool=pool)
    with pytest.raises(KdaInputError, match="initial_state: expected None with state_pool"):
        kdagen.kda_prefill(**loc, cp_context=ctx, state_pool=pool, state_indices=idx,
                           initial_state=kw["initial_state"][:1])
    with pytest.raises(KdaInputError, match="state_indices: expected a 1-D int32 or int64 tensor of 2 slot indices "
                                            "\\(one per sequence of the context"):
        kdagen.kda_prefill(**loc, cp_context=ctx, state_pool=pool, state_indices=idx[:1])
    with pytest.raises(KdaInputError, match="state_indices: expected slot indices in \\[0, 4\\) or -1 .padding., "
                                            "found 4 at position 0"):
        kdagen.kda_prefill(**loc, cp_context=ctx, state_pool=pool, state_indices=torch.tensor([4, 0]))
    with pytest.raises(KdaInputError, match="state_indices: expected distinct slots"):
        kdagen.kda_prefill(**loc, cp_context=ctx, state_pool=pool, state_indices=torch.tensor([2, 2]))
    with pytest.raises(KdaInputError, match="state_pool: expected a tensor of shape \\[P, HV, ...\\] = \\(P, 1, 32, 32\\)"):
        kdagen.kda_prefill(**loc, cp_context=ctx, state_pool=pool[:, :, :16], state_indices=idx)
    fla_like = SimpleNamespace(cu_seqlens=torch.tensor([0, 8]), pre_num_ranks=0, post_num_ranks=1,
                               pre_num_conv_tokens=0, group=None, layout="contiguous")
    with pytest.raises(KdaInputError, match="state_pool: expected a kdagen context .build_cp_context. with a state pool"):
        kdagen.kda_prefill(**loc, cp_context=from_fla(fla_like, rank=0, world=2), state_pool=pool, state_indices=idx)


def test_checkpoint_errors_are_named():
    # Raised alike on every rank before any collective (no process group here): rank 0 of 2 over
    # one 40-token sequence, cut 20 tokens in, off the grid of both kernel chunks.
    from types import SimpleNamespace

    ctx = build_cp_context([0, 40], rank=0, world=2)
    t, kw = cp_worker.problem(dict(lens=[40]))
    loc = cp_worker.local_slice(t, 0, 20, "BSND")
    h0 = kw["initial_state"]
    with pytest.raises(KdaInputError, match="checkpoint_every: a slot boundary falls inside a chunk of sequence 0 "
                                            "\\(20 tokens in\\); .* multiples of the chunk size \\(16\\)"):
        kdagen.kda_prefill(**loc, cp_context=ctx, initial_state=h0, checkpoint_every=32)
    with pytest.raises(KdaInputError, match="return_chunk_states: a slot boundary falls inside a chunk of sequence 0 "
                                            "\\(20 tokens in\\)"):
        kdagen.kda_prefill(**loc, cp_context=ctx, initial_state=h0, return_chunk_states=True, chunk_size=16)
    on_grid = build_cp_context([0, 40], rank=0, world=2, tokens_per_rank=[16, 24])
    loc16 = cp_worker.local_slice(t, 0, 16, "BSND")
    with pytest.raises(KdaInputError, match="checkpoint_every: expected the checkpoints' spacing"):
        kdagen.kda_prefill(**loc16, cp_context=on_grid, initial_state=h0, checkpoints=h0.new_zeros(3, 1, 32, 32))
    with pytest.raises(KdaInputError, match="checkpoint_every: expected a multiple of the kernels' chunk size"):
        kdagen.kda_prefill(**loc16, cp_context=on_grid, initial_state=h0, checkpoint_every=24)
    with pytest.raises(KdaInputError, match="checkpoints: expected a tensor of at least 2 rows, shape \\(rows, 1, 32, "
                                            "32\\)"):
        kdagen.kda_prefill(**loc16, cp_context=on_grid, initial_state=h0, checkpoint_every=16,
                           checkpoints=h0.new_zeros(1, 1, 32, 32))
    with pytest.raises(KdaInputError, match="checkpoint_offsets: sequence 0 .40 tokens, checkpoint_every=16. needs 2 "
                                            "rows"):
        kdagen.kda_prefill(**loc16, cp_context=on_grid, initial_state=h0, checkpoint_every=16,
                           checkpoint_offsets=torch.tensor([0, 1]))
    with pytest.raises(KdaInputError, match="chunk_size: expected 16 or 64 when return_chunk_states=True"):
        kdagen.kda_prefill(**loc16, cp_context=on_grid, initial_state=h0, checkpoint_every=16, return_chunk_states=True)
    with pytest.raises(KdaInputError, match="checkpoint_every: expected a multiple of chunk_size x return_chunk_states "
                                            "= 32 .the chunk states kept., found 16"):
        kdagen.kda_prefill(**loc16, cp_context=on_grid, initial_state=h0, checkpoint_every=16, chunk_size=16,
                           return_chunk_states=2)
    fla_like = SimpleNamespace(cu_seqlens=torch.tensor([0, 16]), pre_num_ranks=0, post_num_ranks=1,
                               pre_num_conv_tokens=0, group=None, layout="contiguous")
    with pytest.raises(KdaInputError, match="checkpoint_every: expected a kdagen context .build_cp_context. with "
                                            "checkpoints"):
        kdagen.kda_prefill(**loc16, cp_context=from_fla(fla_like, rank=0, world=2), checkpoint_every=16)


def test_checkpoints_keep_the_coarsest_chunk_states_the_slots_allow():
    # checkpoint_every=256 on chunk 16: a row every 16 m tokens, m the largest divisor of 16
    # whose grid every slot boundary inside a sequence lies on (one at a sequence's start is free)
    from kdagen.cp import checkpoint_stride

    def m(cu, tokens, every=256, chunk=16, world=2):
        return checkpoint_stride(build_cp_context(cu, rank=0, world=world, tokens_per_rank=tokens), chunk, every)

    assert m([0, 256], [96, 160]) == 2  # 96 tokens in: on the 32 grid, off the 64 one
    assert m([0, 256], [128, 128]) == 8
    assert m([0, 256], [112, 144]) == 1
    assert m([0, 100, 356], [100, 256]) == 16  # the cut is a sequence's start: every checkpoint's row alone
    assert m([0, 100, 356], [164, 192]) == 4  # 64 tokens into sequence 1
    assert m([0, 512], [192, 128, 192], world=3) == 4  # two cuts: 192 and 320 tokens in, both on the 64 grid
    assert m([0, 256], [128, 128], every=64, chunk=64) == 1


def test_graph_capture_is_refused(monkeypatch):
    # A captured call would replay one call's host plan and offset copies: refused by name.
    from kdagen import cp

    monkeypatch.setattr(cp, "_capturing", lambda device: True)
    ctx = build_cp_context([0, 8, 16], rank=0, world=2)
    t, kw = cp_worker.problem(dict(lens=[8, 8]))
    with pytest.raises(KdaInputError, match="cp_context: expected no CUDA graph capture"):
        kdagen.kda_prefill(**cp_worker.local_slice(t, 0, 8, "BSND"), cp_context=ctx)
    pool, idx = cp_worker.pool_of(dict(lens=[8, 8]), kw)
    with pytest.raises(KdaInputError, match="cp_context: expected no CUDA graph capture"):
        kdagen.kda_prefill(**cp_worker.local_slice(t, 0, 8, "BSND"), cp_context=ctx, state_pool=pool,
                           state_indices=idx)


def test_pieces_on_the_exchange_path_are_cut(monkeypatch):
    # Rank 0 of 2 (the exchange stubbed): its piece of sequence 1 goes on to rank 1, so it is cut
    # into segments although it needs no scan itself; sequence 0, wholly here, stays whole.
    from kdagen import cp

    assert cp.exchange_segments(524288, 64, 132) == 8  # H8 at block_v 16 on an H200: 512 programs a call
    assert cp.exchange_segments(524288, 256, 132) == 2
    assert cp.exchange_segments(cp.EXCHANGE_MIN_TOKENS - 1, 64, 132) == 1
    monkeypatch.setattr(cp, "EXCHANGE_MIN_TOKENS", 64)
    monkeypatch.setattr(cp, "_all_gather", lambda x, ctx: [x, torch.zeros_like(x)])
    seen = []

    def spy(q, k, v, g, beta, **kw):
        seen.append(kw.get("cu_seqlens_cpu"))
        return reference_prefill(q, k, v, g, beta, **kw)

    case = dict(lens=[8, 600])
    t, kw = cp_worker.problem(case)
    ctx = build_cp_context(cp_worker.cu_of(case["lens"]), rank=0, world=2)
    loc = cp_worker.local_slice(t, 0, ctx.local_tokens, "BSND")
    o, _ = cp.kda_prefill_cp(**loc, **dict(kw, initial_state=ctx.local_initial_state(kw["initial_state"])),
                             cp_context=ctx, prefill=spy)
    bounds = seen[0].tolist()
    assert bounds[:2] == [0, 8] and len(bounds) - 2 > 1 and bounds[-1] == 304, bounds  # at 1 "SM" here: 2-4
    cu = torch.tensor(cp_worker.cu_of(case["lens"]), dtype=torch.int32)
    ref = reference_prefill(**t, **kw, cu_seqlens=cu)
    assert rel_rmse(o, ref[0][:, :ctx.local_tokens]) < 1e-5


def test_twin_wave_model_matches_the_h200_sweep():
    # kda_recur_twins at 512K tokens H8 on the H200 (c16 bv32: 64 blocks a segment, 3 per SM,
    # 132 SMs), ms by segments (session 31): the model's ratios follow the measured ones.
    from kdagen import cp

    measured = {3: 8.43, 4: 6.31, 5: 6.53, 6: 5.53, 7: 7.30, 8: 6.40, 9: 6.41, 10: 5.79, 12: 5.51, 16: 5.63,
                18: 5.50, 24: 5.49}
    model = {S: cp.twin_wave_cost(S, 64, 3, 132) for S in measured}
    scale = measured[6] / model[6]
    for S, ms in measured.items():
        assert abs(model[S] * scale - ms) < 0.03 * ms, (S, model[S] * scale, ms)
    assert cp.twin_segments(524288, lambda S: (64, 3), 132) == 6  # not 8, the old rule's count
    assert cp.twin_segments(262144, lambda S: (64, 3), 132) == 6
    assert cp.twin_segments(4 * cp.EXCHANGE_MIN_TOKENS, lambda S: (64, 3), 132) == 4  # capped by segment length
    assert cp.twin_segments(cp.EXCHANGE_MIN_TOKENS - 1, lambda S: (64, 3), 132) == 1
    # the variant may change with S: fewer, wider-V blocks where they fill the GPU
    assert cp.twin_segments(524288, lambda S: (128, 3) if S < 3 else (64, 3), 132) == 6
    # a count with no twin launch (no variant built for it) is not priced
    assert cp.twin_segments(524288, lambda S: None if S == 6 else (64, 3), 132) == 12
    with pytest.raises(ValueError, match="no count from 1 to 16"):
        cp.twin_segments(524288, lambda S: None, 132)
    with pytest.raises(ValueError, match="blocks_per_sm=0"):
        cp.twin_wave_cost(4, 64, 0, 132)


def test_auto_segments_use_the_twin_waves_where_known(monkeypatch):
    # With the twin launch's occupancy known (stubbed: 64 blocks a segment, 3 per SM, 132 SMs),
    # the piece on the exchange path gets twin_segments' count; the piece wholly here keeps the
    # planner's choice (whole).
    from kdagen import cp
    import kdagen.select as select

    monkeypatch.setattr(cp, "EXCHANGE_MIN_TOKENS", 64)
    monkeypatch.setattr(cp, "_twin_occupancy", lambda P, lay, dev: (64, 3))
    monkeypatch.setattr(select, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(cp, "_all_gather", lambda x, ctx: [x, torch.zeros_like(x)])
    cp._AUTO_SEGMENTS.clear()
    case = dict(lens=[8, 1200])
    t, kw = cp_worker.problem(case)
    ctx = build_cp_context(cp_worker.cu_of(case["lens"]), rank=0, world=2)
    loc = cp_worker.local_slice(t, 0, ctx.local_tokens, "BSND")
    cp.kda_prefill_cp(**loc, **dict(kw, initial_state=ctx.local_initial_state(kw["initial_state"])),
                      cp_context=ctx, prefill=reference_prefill)
    cp._AUTO_SEGMENTS.clear()
    assert cp.last_counts == (1, 6), cp.last_counts


def test_exchange_pieces_sharing_a_launch_are_cut_together(monkeypatch):
    # Rank 1 of 2 in the zigzag layout holds slots 1 and 2 of one sequence: both pieces are on the
    # exchange path and run in one twin launch, so they share the count the wave model picks for
    # their combined 600 tokens (6: one round of 3 blocks an SM), not 4 each as two launches.
    from kdagen import cp
    import kdagen.select as select

    monkeypatch.setattr(cp, "EXCHANGE_MIN_TOKENS", 64)
    monkeypatch.setattr(cp, "_twin_occupancy", lambda P, lay, dev: (64, 3))
    monkeypatch.setattr(select, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(cp, "_all_gather", lambda x, ctx: [torch.zeros_like(x), x])
    cp._AUTO_SEGMENTS.clear()
    case = dict(lens=[1200])
    t, kw = cp_worker.problem(case)
    ctx = build_cp_context(cp_worker.cu_of(case["lens"]), rank=1, world=2, layout="zigzag")
    assert [(p.incoming, p.outgoing) for p in ctx.pieces] == [(True, True), (True, True)]
    cp.kda_prefill_cp(**cp_worker.local_part(t, ctx, "BSND"), **dict(kw, initial_state=None), cp_context=ctx,
                      prefill=reference_prefill)
    cp._AUTO_SEGMENTS.clear()
    assert cp.last_counts == (3, 3), cp.last_counts
    assert cp._shares(7, [300, 100, 600]) == [2, 1, 4] and cp._shares(1, [5, 5]) == [1, 1]


# Cases every rank runs in turn: "kernels" through kdagen.kda_prefill (Triton interpreter here,
# the GPU kernels with -m gpu), "ref" through the float64 chunked reference (fast plumbing checks).
# "zigzag": rank r holds slots r and 2W-1-r. At W = 2 and lens [8, 70, 0, 18] (slots of 24 tokens)
# sequence 1 runs through all four slots: rank 1's own front slot feeds its back slot, and rank
# 0's back slot chains the maps of slots 0, 1 and 2. "fla": fla's own context (fla.ops.cp), through
# kdagen.chunk_kda and through fla's chunk_kda served by kdagen's backend.
CASES = {
    2: [
        dict(lens=[8, 70, 0, 18], engine="kernels"),  # planner's segments; rank 1's first piece enters
        dict(lens=[8, 70, 0, 18], engine="ref", mode="correct", segments=2, layout="BNSD", state_layout="KV",
             state_dtype=torch.bfloat16, seed=1),
        # every 2nd chunk's state (rows every 32 tokens: the slot boundary is 32 tokens into sequence 1)
        dict(lens=[16, 70, 0, 10], engine="ref", chunk_states=2, segments=2, mode="rerun", seed=2),
        dict(lens=[8, 70, 0, 18], engine="kernels", cp_layout="zigzag", segments=2, seed=6),
        dict(lens=[30, 50, 0], engine="ref", cp_layout="zigzag", mode="rerun", seed=7),  # empty at T: slot 3
        dict(lens=[8, 70, 0, 18], engine="kernels", cp_layout="zigzag", pool=True, seed=12),
        # checkpoints every 32 tokens keep every 2nd chunk's state (the cut is 32 tokens into sequence 1)
        dict(lens=[32, 64, 0, 32], engine="kernels", cp_layout="zigzag", pool=True, ckpt=32, seed=14),
        # no chunk_size: checkpoints run the chunk the runtime plans (16), not 64, and leave o as without
        dict(lens=[64, 128, 0, 64], engine="kernels", cp_layout="zigzag", ckpt=64, chunk=None, same_o=True, seed=18),
        # the same stride with checkpoints inside the pieces (32 and 96 tokens into sequence 1)
        dict(lens=[8, 120, 0, 8], engine="ref", tokens_per_rank=[72, 64], ckpt=32, state_dtype=torch.bfloat16,
             seed=17),
        dict(lens=[8, 70, 0, 18], engine="fla", cp_layout="zigzag", seed=8, inter=True),
        dict(lens=[8, 70, 0, 18], engine="fla", seed=9, inter=True),
    ],
    3: [
        dict(lens=[8, 100, 4, 8], engine="kernels", segments=2, seed=3),  # the middle rank: in and out
        dict(lens=[8, 100, 4, 8], engine="ref", tokens_per_rank=[50, 0, 70], mode="rerun", seed=4),
        dict(lens=[8, 100, 4, 8], engine="ref", mode="correct", segments=3, H=1, HV=2, seed=5),
        dict(lens=[96, 0, 96], engine="ref", cp_layout="zigzag", segments=2, chunk_states=True, seed=10),
        dict(lens=[96, 0, 96], engine="ref", cp_layout="zigzag", segments=2, chunk_states=2, seed=16),
        # fla's grid: rows every 32 tokens from each piece's start (the cut 72 tokens into sequence 1 is off the
        # sequence's 32 grid)
        dict(lens=[8, 100, 4, 8], engine="ref", chunk_grid="piece", chunk_states=2, segments=2, seed=19),
        dict(lens=[8, 100, 4, 8], engine="kernels", pool=True, pools="local", seed=13),
        # the cut 80 tokens into sequence 1 is off the 32 grid: every chunk's state kept
        dict(lens=[8, 96, 4, 32], engine="ref", tokens_per_rank=[40, 48, 52], ckpt=32, pools="local", seed=15),
        dict(lens=[8, 100, 4, 8], engine="fla", cp_layout="zigzag", seed=11, inter=True),
    ],
}


def single_process(case: dict):
    t, kw = cp_worker.problem(case)
    cu = torch.tensor(cp_worker.cu_of(case["lens"]), dtype=torch.int32)
    if case["engine"] == "ref":
        return reference_prefill(**t, **kw, cu_seqlens=cu)
    if case["engine"] == "fla":
        args, fkw = cp_worker.fla_call(case, t, kw)
        return kdagen.chunk_kda(*args, **fkw, cu_seqlens=cu.long())
    return kdagen.kda_prefill(**t, **kw, cu_seqlens=cu)


def check_pools(case: dict, ranks: list[dict], ctxs: list, o: torch.Tensor) -> None:
    """Each rank's pool after a context-parallel call with a state pool: the slots of the
    sequences ending on it ("local"; every real sequence's, "replicated") hold the single call's
    final states, every other slot its old value; replicated pools stay bit-identical."""
    t, kw = cp_worker.problem(case)
    pool0, idx = cp_worker.pool_of(case, kw)
    pool_ref = pool0.clone()
    kw["initial_state"] = None
    o_ref = kdagen.kda_prefill(**t, **kw, cu_seqlens=torch.tensor(cp_worker.cu_of(case["lens"]), dtype=torch.int32),
                               state_pool=pool_ref, state_indices=idx)[0]
    assert rel_rmse(o, o_ref) < 1e-5
    local = case.get("pools") == "local"
    slot_seq = {int(i): n for n, i in enumerate(idx.tolist()) if i >= 0}
    written = check_rank_rows("pool", ranks, ctxs, pool0, pool_ref, 1e-5, replicated=not local,
                              mine_of=lambda ctx: {int(idx[n]) for n in (ctx.ends if local else range(len(idx)))
                                                   if idx[n] >= 0},
                              changed=lambda slot: case["lens"][slot_seq[slot]] > 0)  # an empty one keeps its state
    assert written == set(slot_seq)  # every real sequence ends on some rank


def check_rank_rows(key: str, ranks: list[dict], ctxs: list, before: torch.Tensor, want: torch.Tensor, tol: float,
                    replicated: bool, mine_of, changed) -> set:
    """Each rank's buffer x[key] after the call: the rows it received (mine_of(ctx)) within tol of
    `want` (and, where changed(row), no longer as before), every other row bit-identical to
    `before`; replicated buffers bit-identical to each other. Returns the rows written anywhere."""
    written = set()
    for ctx, x in zip(ctxs, ranks):
        mine = mine_of(ctx)
        written |= mine
        for row in range(before.shape[0]):
            if row in mine:
                assert rel_rmse(x[key][row], want[row]) < tol, (ctx.rank, row)
                if changed(row):
                    assert not torch.equal(x[key][row], before[row])
            else:
                assert torch.equal(x[key][row], before[row]), (ctx.rank, row)
    if replicated:
        assert all(torch.equal(x[key], ranks[0][key]) for x in ranks)
    return written


def check_checkpoints(case: dict, ranks: list[dict], ctxs: list, device: str = "cpu", tol: float = 1e-5) -> None:
    """Each rank's checkpoint buffer after a context-parallel call: the rows of the checkpoints
    it computed ("local": those in its slots or at the end of a sequence ending on it; every one,
    "replicated") hold the single call's, every other row its old value; replicated buffers stay
    bit-identical."""
    t, kw = cp_worker.problem(case, device)
    buf0, offs = cp_worker.checkpoints_of(case, kw)
    cu, every = cp_worker.cu_of(case["lens"]), case["ckpt"]
    call = dict(cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device), checkpoint_every=every,
                checkpoints=buf0.clone(), checkpoint_offsets=offs)
    if case.get("pool"):
        pool, idx = cp_worker.pool_of(case, kw)
        kw["initial_state"] = None
        call.update(state_pool=pool, state_indices=idx)
    want, buf0 = kdagen.kda_prefill(**t, **kw, **call)[-1].cpu(), buf0.cpu()
    local = case.get("pools") == "local"

    def mine_of(ctx) -> set:
        mine = set()
        for n, L in enumerate(case["lens"]):
            for j in range(L // every):
                pos = (j + 1) * every  # the state after pos tokens: entering token cu[n] + pos, or the final one
                here = n in ctx.ends if pos == L else any(a <= cu[n] + pos < b for a, b in ctx.local_ranges)
                if here or not local:
                    mine.add(int(offs[n]) + j)
        return mine

    written = check_rank_rows("ckpt", ranks, ctxs, buf0, want, tol, replicated=not local, mine_of=mine_of,
                              changed=lambda row: False)
    assert len(written) == sum(L // every for L in case["lens"]) > 0


def piece_intermediate_states(case: dict, ranks: list[dict]) -> torch.Tensor:
    """fla's intermediate states with a context, from single-process calls: each rank's pieces in
    its order, each run alone from its true entering state (the single call's state after the
    tokens of its sequence before it), with states every 64 tokens from the piece's start."""
    t, kw = cp_worker.problem(case)
    args, fkw = cp_worker.fla_call(case, t, kw)
    cu = cp_worker.cu_of(case["lens"])
    rows = []
    for x in ranks:
        for a, b in x["pieces"]:  # each piece's global range, in the rank's order
            s = max(c for c in cu if c <= a)  # the sequence's start (pieces are never empty here)
            part = [y[:, s:b] for y in args]
            h0 = None
            if a > s:  # the state entering the piece: the single call's over the sequence's earlier tokens
                h0 = kdagen.chunk_kda(*[y[:, :a - s] for y in part], **fkw, output_final_state=True)[1]
            rows.append(kdagen.chunk_kda(*[y[:, a - s:] for y in part], **fkw, initial_state=h0,
                                         return_intermediate_states=True)[2][0])
    return torch.cat(rows)


def piece_chunk_states(case: dict, ctxs: list) -> torch.Tensor:
    """The chunk states of a "piece" grid case from single-process reference calls: every rank's
    pieces in its order, each run alone from its true entering state (the reference's state
    after its sequence's earlier tokens), keeping its stride from the piece's start."""
    t, kw = cp_worker.problem(case)
    cu = cp_worker.cu_of(case["lens"])
    h0_all = kw.pop("initial_state")
    kw.update(output_final_state=True)
    rows = []
    for ctx in ctxs:
        for p in ctx.pieces:
            a, b = ctx.global_range(p)
            s = cu[p.seq]
            h0 = h0_all[p.seq:p.seq + 1]
            if a > s:
                h0 = reference_prefill(**cp_worker.local_slice(t, s, a, "BSND"), **dict(kw, return_chunk_states=False),
                                       initial_state=h0)[1]
            rows.append(reference_prefill(**cp_worker.local_slice(t, a, b, "BSND"), **kw, initial_state=h0)[2])
    return torch.cat(rows)


def contexts_of(case: dict, world: int) -> list:
    """Every rank's context of a case (a case on fla's contexts holds the same slots)."""
    return [build_cp_context(cp_worker.cu_of(case["lens"]), rank=r, world=world,
                             tokens_per_rank=case.get("tokens_per_rank"), layout=case.get("cp_layout", "contiguous"))
            for r in range(world)]


def chunk_rows(case: dict, ranks: list[dict], ctxs: list) -> torch.Tensor:
    """Every rank's chunk states in global order: each row sorted by its chunk's first token."""
    C = case.get("chunk", 16) * int(case["chunk_states"])  # a kept row every C m tokens
    rows = []
    for ctx, x in zip(ctxs, ranks):
        pos = [ctx.global_range(p)[0] + c for p in ctx.pieces for c in range(0, p.end - p.start, C)]
        assert len(pos) == x["out"][2].shape[0]
        rows += list(zip(pos, x["out"][2]))
    return torch.stack([row for _, row in sorted(rows, key=lambda t: t[0])])


@pytest.mark.skipif(HAS_CUDA, reason="the gloo ranks run the Triton interpreter, which runs only without a GPU")
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("contexts", ["kdagen", "fla"])
def test_gloo_ranks_equal_the_single_process_call(world, contexts, tmp_path):
    # kdagen's contexts and fla's in separate process groups, so that a failure names its side
    import torch.multiprocessing as mp

    cases = [c for c in CASES[world] if (c["engine"] == "fla") == (contexts == "fla")]
    mp.spawn(cp_worker.run_rank, args=(world, str(tmp_path / "store"), cases, str(tmp_path)), nprocs=world)
    for i, case in enumerate(cases):
        ranks = [torch.load(tmp_path / f"r{r}_{i}.pt") for r in range(world)]
        ctxs = contexts_of(case, world)
        dim = 1 if case.get("layout", "BSND") == "BSND" else 2
        o = from_ranks([x["out"][0] for x in ranks], ctxs, dim)
        ref = single_process(case)
        if case["engine"] == "fla":  # fla takes no states with a context: o only, both entries
            o_fla = from_ranks([x["out"][1] for x in ranks], ctxs, dim)
            errs = {"o": rel_rmse(o, ref[0]), "o via fla": rel_rmse(o_fla, ref[0])}
            if case.get("inter"):
                h_ref = piece_intermediate_states(case, ranks)
                errs.update({f"h{j}": rel_rmse(torch.cat([x["h"][j][0] for x in ranks]), h_ref) for j in (0, 1)})
            assert max(errs.values()) < 1e-5, (i, case, errs)
            continue
        if case.get("ckpt"):
            check_checkpoints(case, ranks, ctxs, tol=5e-3 if case.get("state_dtype") == torch.bfloat16 else 1e-5)
        if case.get("same_o"):
            assert all(torch.equal(x["out"][0], x["plain_o"]) for x in ranks), i
        if case.get("pool"):
            check_pools(case, ranks, ctxs, o)
            continue
        fs = torch.cat([x["out"][1] for x in ranks])
        ends = sum((x["ends"] for x in ranks), [])
        tol = 5e-3 if case.get("state_dtype") == torch.bfloat16 else 1e-5
        errs = {"o": rel_rmse(o, ref[0]), "state": rel_rmse(fs, ref[1][ends])}
        assert fs.dtype == ref[1].dtype
        if case.get("chunk_grid") == "piece":  # each piece's rows from its own start, in the ranks' order
            errs["chunk_states"] = rel_rmse(torch.cat([x["out"][2] for x in ranks]), piece_chunk_states(case, ctxs))
        elif case.get("chunk_states"):  # rows by (global sequence, chunk) order over the ranks' pieces
            errs["chunk_states"] = rel_rmse(chunk_rows(case, ranks, ctxs), ref[2])
        assert max(errs.values()) < tol, (i, case, errs)
    if contexts == "fla":
        return
    # The test can fail: the last rank's first piece from a zero state is far from the true o.
    case = CASES[world][0]
    last = torch.load(tmp_path / f"r{world - 1}_0.pt")
    t, kw = cp_worker.problem(case)
    ctx = build_cp_context(cp_worker.cu_of(case["lens"]), rank=world - 1, world=world)
    a, b = ctx.global_range(ctx.pieces[0])
    n_in = b - a
    loc = cp_worker.local_slice(t, a, b, "BSND")
    alone = reference_prefill(**loc, **dict(kw, initial_state=None))
    assert rel_rmse(alone[0], last["out"][0][:, :n_in]) > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 1])
def test_gpu_ranks(tmp_path, world):
    # The kernel cases on GPUs: NCCL with a GPU per rank (NVLink multicast off), else the two ranks
    # share one GPU over gloo. One rank runs over NCCL on any GPU: kdagen.cp's NCCL collectives (the
    # maps' all_gather, the checkpoints' all_reduce) at world 1, on a host with a single GPU too.
    # bf16 inputs (the built variants'); each rank's pieces start off the single call's chunk grid,
    # so the check is against the float64 reference at the library's bf16 tolerance.
    # scripts/cp_bench.py times the split.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    import torch.multiprocessing as mp

    backend = "nccl" if world == 1 or torch.cuda.device_count() >= world else "gloo"
    cases = [dict(c, K=128, chunk=c.get("chunk", 16), dtype=torch.bfloat16)
             for c in CASES[2] if c["engine"] == "kernels"]
    mp.spawn(_gpu_rank, args=(world, str(tmp_path / "store"), cases, str(tmp_path), backend), nprocs=world)
    for i, case in enumerate(cases):
        ctxs = contexts_of(case, world)
        ranks = [torch.load(tmp_path / f"r{r}_{i}.pt") for r in range(world)]
        o = from_ranks([x["out"][0] for x in ranks], ctxs)
        ends = sum((x["ends"] for x in ranks), [])
        t, kw = cp_worker.problem(case)
        t = {n: x.double() for n, x in t.items()}  # the bf16 inputs exactly, o in float64
        if case.get("ckpt"):  # against the one-GPU call on the same bf16 inputs
            check_checkpoints(case, ranks, ctxs, device="cuda", tol=5e-3)
        if case.get("same_o"):  # checkpoints left the planned kernel, and o, as without them
            assert all(torch.equal(x["out"][0], x["plain_o"]) for x in ranks), (backend, case)
        if case.get("pool"):  # initial states from the pool's slots (zeros for padding), finals in the ranks' pools
            pool0, idx = cp_worker.pool_of(case, kw)
            kw["initial_state"] = torch.stack([pool0[i] if i >= 0 else torch.zeros_like(pool0[0]) for i in idx.tolist()])
            fs = torch.stack([x["pool"][idx[n]] for x in ranks for n in x["ends"] if idx[n] >= 0])
            ends = [n for n in ends if idx[n] >= 0]
            if case.get("pools") != "local":  # every rank's pool got every final state, bit-identically
                assert all(torch.equal(ranks[0]["pool"], x["pool"]) for x in ranks[1:])
        else:
            fs = torch.cat([x["out"][1] for x in ranks])
        ref = reference_prefill(**t, **kw, cu_seqlens=torch.tensor(cp_worker.cu_of(case["lens"]), dtype=torch.int32))
        errs = (rel_rmse(o.float(), ref[0].float()), rel_rmse(fs.float(), ref[1][ends].float()))
        assert max(errs) < 5e-3, (backend, world, case, errs)


def _gpu_rank(rank, world, store, cases, out_dir, backend):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    cp_worker.run_rank(rank, world, store, cases, out_dir, backend=backend, device="cuda")


@pytest.mark.gpu
def test_gpu_twin_occupancy_is_the_drivers():
    # What the wave model is given on a GPU: the twin launch's blocks per segment (2 HV x V blocks
    # of the variant the call selects) and the driver's resident count for kda_recur_twins.
    from kdagen import cp
    from kdagen.runtime import prepare
    from kdagen.scan.engine import pack
    from kdagen.scan.layout import split

    t, kw = cp_worker.problem(dict(lens=[4096], H=8, HV=8, K=128, dtype=torch.bfloat16), device="cuda")
    kw.pop("initial_state", None)
    P = pack(**t, **kw)
    lay = split([0, 4096], [4], 64)
    occ = cp._twin_occupancy(P, lay, P.q.device)
    if occ is None:
        pytest.skip("no sm80 twin launch built for this shape")
    plan = prepare(P.q, P.k, P.v, P.g, P.beta, A_log=P.A_log, dt_bias=P.dt_bias, cu_seqlens=lay.bounds_tensor().cuda(),
                   cu_seqlens_cpu=lay.bounds_tensor(), output_final_state=True, **P.kw)
    blocks, per_sm = occ
    assert blocks == 2 * 8 * (128 // plan.variant.block_v)
    # kda_recur_twins holds ~66 KB of shared memory and 160+ threads: 1 to 4 blocks fit an SM
    assert 1 <= per_sm <= 4, per_sm
