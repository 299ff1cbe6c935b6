"""Checkpoints for prefix caching: checkpoint_every=n writes the state after every n tokens of
each sequence into a caller's buffer at per-sequence offsets; they equal the chunk states the
kernels write at those positions (and the final state where a sequence ends on one)."""

from __future__ import annotations

import pytest
import torch

import kdagen
import kdagen.checkpoints
import kdagen.runtime
from kdagen.errors import KdaInputError
from kdagen.reference import kda_reference, rel_rmse
from kdagen.variant import Variant

from kdagen.cases import make_case
from .runtime_env import fresh_runtime  # noqa: F401


def _case(device, lens, chunk=16, state="fp32"):
    v = Variant("triton", chunk, 32, 32, "bf16", "bounded", state, 16)
    return make_case(v, device, H=1, HV=2, lens=lens, seed=3)


def _chunk_rows(lens, chunk):
    """Row of each sequence's first chunk state."""
    first, at = [], 0
    for L in lens:
        first.append(at)
        at += -(-L // chunk)
    return first


def test_checkpoints_equal_the_chunk_states_at_those_positions(device):
    lens = [20, 0, 37, 16, 40]
    kw = _case(device, lens)
    # room for more than each needs (20//16=1, 0, 2, 1, 2): rows outside the written ones stay NaN
    offsets = torch.tensor([0, 2, 2, 6, 8, 11])
    buf = torch.full((12, 2, 32, 32), float("nan"), device=device)
    o, fs, ck = kdagen.kda_prefill(**kw, checkpoint_every=16, checkpoints=buf, checkpoint_offsets=offsets)
    assert ck is buf
    o2, fs2, cs = kdagen.kda_prefill(**kw, return_chunk_states=True, chunk_size=16)
    assert torch.equal(o, o2) and torch.equal(fs, fs2)
    first = _chunk_rows(lens, 16)
    written = set()
    for n, L in enumerate(lens):
        for j in range(L // 16):
            pos = (j + 1) * 16
            want = cs[first[n] + pos // 16] if pos < L else fs2[n]  # sequence 3 ends on its checkpoint
            row = int(offsets[n]) + j
            assert torch.equal(buf[row], want), (n, j)
            written.add(row)
    assert sorted(written) == [0, 2, 3, 6, 8, 9]
    assert all(torch.isnan(buf[r]).all() for r in range(12) if r not in written)
    # the same offsets without a buffer: a new one of offsets[-1] rows, the checkpoints at the same rows
    _, _, ck2 = kdagen.kda_prefill(**kw, checkpoint_every=16, checkpoint_offsets=offsets)
    assert ck2.shape == (11, 2, 32, 32) and all(torch.equal(ck2[r], buf[r]) for r in written)


def test_checkpoints_run_the_plain_calls_kernel_keeping_one_state_each(device, monkeypatch):
    """A multiple of 64 fits both kernel chunks: the call runs the kernel the call without
    checkpoints runs (o bit-identical), which keeps one chunk state per checkpoint."""
    lens = [70, 64, 200]
    kw = _case(device, lens, chunk=64)
    kept = []
    real = kdagen.checkpoints.Checkpoints.fill
    monkeypatch.setattr(kdagen.checkpoints.Checkpoints, "fill",
                        lambda self, stacked: (kept.append(stacked.shape[0]), real(self, stacked))[1])
    o, fs, ck = kdagen.kda_prefill(**kw, checkpoint_every=64)
    o2, fs2 = kdagen.kda_prefill(**kw)
    assert torch.equal(o, o2) and torch.equal(fs, fs2)
    assert ck.shape == (1 + 1 + 3, 2, 32, 32)  # packed in order
    # the call's chunk states, one row per 64 tokens started (the state entering chunk 0 included),
    # stacked with its 3 final states
    assert kept == [2 + 1 + 4 + 3]
    ref = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    _, rs, rc = kda_reference(**ref, chunk_states_size=64)
    assert torch.equal(ck[1], fs[1])  # sequence 1 ends on its checkpoint
    assert rel_rmse(ck[0].cpu(), rc[1]) < 6e-3 and rel_rmse(ck[1].cpu(), rs[1]) < 6e-3
    assert max(rel_rmse(ck[2 + j].cpu(), rc[2 + 1 + 1 + j]) for j in range(3)) < 6e-3


def test_checkpoints_with_a_state_pool_and_chunk_states(device):
    lens = [20, 33]
    kw = _case(device, lens)
    h0 = kw.pop("initial_state")
    kw.pop("output_final_state")
    pool = torch.zeros(3, 2, 32, 32, device=device)
    pool[2], pool[0] = h0[0], h0[1]
    o, fs, cs, ck = kdagen.kda_prefill(**kw, state_pool=pool, state_indices=torch.tensor([2, 0]),
                                       checkpoint_every=32, return_chunk_states=True, chunk_size=16)
    assert fs is None
    o2, fs2, cs2 = kdagen.kda_prefill(**kw, initial_state=h0, output_final_state=True, return_chunk_states=True,
                                      chunk_size=16)
    assert torch.equal(o, o2) and torch.equal(cs, cs2)
    assert torch.equal(pool[2], fs2[0]) and torch.equal(pool[0], fs2[1])
    assert ck.shape == (1, 2, 32, 32) and torch.equal(ck[0], cs2[2 + 2])  # sequence 1, after 32 tokens


def test_checkpoints_with_a_state_pool_gather_from_the_stacked_final_states(device, monkeypatch):
    """With a state pool (no chunk states of the caller's) the kernel writes the final states into
    the stacked tensor too: one gather makes the checkpoints, and the pool's scatter reads its
    final-state rows (a padding sequence's slot stays untouched)."""
    lens = [32, 20, 48]
    kw = _case(device, lens)
    h0 = kw.pop("initial_state")
    kw.pop("output_final_state")
    pool = torch.full((4, 2, 32, 32), 7.0, device=device)
    pool[3], pool[1], pool[0] = h0[0], h0[1], h0[2]
    pool_before = pool.clone()
    stacks = []
    real = kdagen.checkpoints.Checkpoints.fill
    monkeypatch.setattr(kdagen.checkpoints.Checkpoints, "fill",
                        lambda self, stacked: (stacks.append(stacked), real(self, stacked))[1])
    o, fs, ck = kdagen.kda_prefill(**kw, state_pool=pool, state_indices=torch.tensor([3, -1, 0]),
                                   checkpoint_every=16, output_final_state=True)
    h0p = h0.clone()
    h0p[1] = 0  # a padding sequence starts from zeros
    o2, fs2, cs2 = kdagen.kda_prefill(**kw, initial_state=h0p, output_final_state=True, return_chunk_states=True,
                                      chunk_size=16)
    assert len(stacks) == 1 and stacks[0].shape[0] == 2 + 2 + 3 + 3  # chunk rows, then the 3 final states
    assert torch.equal(o, o2) and torch.equal(fs, fs2)
    assert torch.equal(pool[3], fs2[0]) and torch.equal(pool[0], fs2[2])
    assert torch.equal(pool[1], pool_before[1]) and torch.equal(pool[2], pool_before[2])
    # after 16 and 32 tokens of sequence 0 (it ends there), 16 of sequence 1, 16, 32 and 48 of sequence 2
    want = [cs2[1], fs2[0], cs2[3], cs2[5], cs2[6], fs2[2]]
    assert ck.shape == (6, 2, 32, 32) and all(torch.equal(ck[i], w) for i, w in enumerate(want))


def test_plan_reuses_the_index_rows_of_a_layout_and_follows_the_offsets():
    """plan() keeps one device copy of a layout's row indices (a model's layers repeat it; a fresh
    copy waited for the stream): the same layout shares it, other offsets or lengths get their own;
    fill() gathers the rows from [chunk states; final states]."""
    kw = dict(HV=2, state_shape=(32, 32), dtype=torch.float32, device=torch.device("cpu"), chunk=16, buffer=None,
              assume_valid=False)
    P = kdagen.checkpoints.plan
    a, b = P(32, [70, 40], offsets=None, **kw), P(32, [70, 40], offsets=None, **kw)
    assert a.rows.chunk_src.data_ptr() == b.rows.chunk_src.data_ptr()
    assert a.rows.chunk_src.tolist() == [2, 4, 5 + 2] and a.rows.chunk_dst.tolist() == [0, 1, 2]  # 5 chunks of 70
    assert a.rows.final_src.tolist() == [] and a.buffer is None and a.packed and a.kept == 5 + 3
    assert a.stacked_src.tolist() == [2, 4, 7] and a.shape == (3, 2, 32, 32)
    c = P(32, [70, 40], offsets=torch.tensor([1, 4, 6]), **kw)
    assert c.rows.chunk_dst.tolist() == [1, 2, 4] and c.rows.chunk_src.tolist() == [2, 4, 7]
    assert not c.packed and c.stacked_dst.tolist() == [1, 2, 4] and c.shape == (6, 2, 32, 32)
    d = P(32, [64, 40], offsets=None, **kw)
    assert d.rows.chunk_src.tolist() == [2, 4 + 2] and d.rows.chunk_dst.tolist() == [0, 2]
    assert (d.rows.final_src.tolist(), d.rows.final_dst.tolist()) == ([0], [1])  # 64 tokens: the final state
    assert d.stacked_src.tolist() == [2, 4 + 3 + 0, 4 + 2]  # [chunk states (4 + 3 rows); final states]
    stacked = torch.randn(7 + 2, 2, 32, 32)
    assert torch.equal(d.fill(stacked), stacked[[2, 7, 6]])
    buf = torch.zeros(5, 2, 32, 32)
    e = P(32, [64, 40], offsets=torch.tensor([2, 4, 5]), **dict(kw, buffer=buf))
    assert e.fill(stacked) is buf and torch.equal(buf[2:5], stacked[[2, 7, 6]]) and not buf[:2].any()


@pytest.mark.parametrize("over, needle", [
    (dict(checkpoint_every=24), "checkpoint_every: expected a multiple of the kernels' chunk size (16 or 64), found 24"),
    (dict(checkpoint_every=16, chunk_size=64), "checkpoint_every: expected a multiple of chunk_size=64, found 16"),
    (dict(checkpoint_every=0), "checkpoint_every: expected a positive number of tokens, found 0"),
    (dict(checkpoint_every=16, checkpoint_offsets=torch.tensor([0, 1, 1])),
     "checkpoint_offsets: sequence 1 (37 tokens, checkpoint_every=16) needs 2 rows from offsets[1]=1, found room for 0"),
    (dict(checkpoint_every=16, checkpoint_offsets=torch.tensor([0, 1])), "checkpoint_offsets: expected a 1-D int32/int64"),
    (dict(checkpoint_every=16, checkpoints=torch.empty(2, 2, 32, 32)), "checkpoints: expected a tensor of at least 3 rows"),
    (dict(checkpoint_every=16, checkpoints=torch.empty(3, 2, 32, 32, dtype=torch.bfloat16)),
     "dtype torch.float32, on cpu, found shape (3, 2, 32, 32), dtype torch.bfloat16"),
    (dict(checkpoints=torch.empty(3, 2, 32, 32)), "checkpoint_every: expected the checkpoints' spacing in tokens"),
])
def test_bad_checkpoint_calls(over, needle):
    kw = _case("cpu", [20, 37])
    with pytest.raises(KdaInputError) as ei:
        kdagen.kda_prefill(**kw, **over)
    assert needle in str(ei.value), str(ei.value)


@pytest.mark.gpu
@pytest.mark.parametrize("every", [64, 128])
def test_gpu_checkpoints_match_chunk_states(every):
    lens = [1000, 0, 2048, 63, 512]
    v = Variant("sm80", 16, 128, 128, "bf16", "bounded", "fp32", 32)
    kw = make_case(v, "cuda", H=2, HV=4, lens=lens, seed=5)
    o, fs, ck = kdagen.kda_prefill(**kw, checkpoint_every=every, cu_seqlens_cpu=kw["cu_seqlens"].cpu())
    # checkpoints run the kernel the call without them plans (chunk 16 on the H200, not the coarsest that fits)
    chunk = kdagen.runtime.prepare(**kw, cu_seqlens_cpu=kw["cu_seqlens"].cpu()).variant.chunk
    o2, fs2, cs = kdagen.kda_prefill(**kw, return_chunk_states=True, chunk_size=chunk)
    assert torch.equal(o, o2)
    first, row = _chunk_rows(lens, chunk), 0
    for n, L in enumerate(lens):
        for j in range(L // every):
            pos = (j + 1) * every
            want = cs[first[n] + pos // chunk] if pos < L else fs2[n]
            assert torch.equal(ck[row], want), (n, j)
            row += 1
    assert row == ck.shape[0]
