"""The CPU model of the DSL on its own: small kernels, each checking one semantic the Ascend
kernel's check relies on (slots, formats, casts, matmul operands, subblocks, races, syncs)."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

from kdagen.ascend_sim import ModelError, load_kernel_module

HEADER = """
import cannbotdsl as cb
from cannbotdsl import reg, dtypes as dt
CC = cb.ChannelKind.CrossCore
UB, L1, L0A, L0B, L0C = cb.MemLoc.UB, cb.MemLoc.L1, cb.MemLoc.L0A, cb.MemLoc.L0B, cb.MemLoc.L0C
F32, BF16 = dt.float32, dt.bfloat16
"""


def run(tmp_path, body: str, *tensors, blocks: int = 1, ctor=()):
    path = tmp_path / "k.py"
    path.write_text(HEADER + textwrap.dedent(body))
    mod = load_kernel_module(path)
    mod.K(*ctor)[blocks](*tensors)
    return mod


def test_depth1_channel_hands_out_one_slot_and_depth2_two(tmp_path):
    out = torch.zeros(2, 64)
    run(tmp_path, """
        @cb.kernel
        class K:
            def __init__(self):
                self.one = cb.Channel(L0C, shape=(64, 64), dtype=F32, depth=1)
                self.two = cb.Channel(L0C, shape=(64, 64), dtype=F32, depth=2)
            def __call__(self, out):
                a, b = self.one.produce(), self.one.produce()
                c, d, e = self.two.produce(), self.two.produce(), self.two.produce()
                out.st.data[0, 0] = float(a.st is b.st)
                out.st.data[0, 1] = float(c.st is d.st)
                out.st.data[0, 2] = float(c.st is e.st)
        """, out)
    assert out[0, :3].tolist() == [1.0, 0.0, 1.0]


def test_dma_does_not_convert_dtypes_but_the_fixpipe_rounds(tmp_path):
    x = torch.randn(16, 64)
    with pytest.raises(ModelError, match="does not convert dtypes"):
        run(tmp_path, """
            @cb.kernel
            class K:
                def __init__(self):
                    self.u = cb.Buffer(UB, (16, 64), BF16)
                def __call__(self, x):
                    cb.mem_copy(self.u, x)
            """, x)
    # GM fp32 -> L1 (NZ) -> L0A/L0B -> matmul with I -> L0C -> UB bf16 -> GM bf16: one RN rounding
    eye = torch.eye(64)
    o = torch.zeros(16, 64, dtype=torch.bfloat16)
    run(tmp_path, """
        @cb.kernel
        class K:
            def __init__(self):
                self.la = cb.Buffer(L1, (16, 64), F32)
                self.lb = cb.Buffer(L1, (64, 64), F32)
                self.a = cb.Buffer(L0A, (16, 64), F32)
                self.b = cb.Buffer(L0B, (64, 64), F32)
                self.c = cb.Buffer(L0C, (16, 64), F32)
                self.u = cb.Buffer(UB, (16, 64), BF16)
            def __call__(self, x, eye, o):
                cb.mem_copy(self.la, x)
                cb.mem_copy(self.lb, eye)
                cb.mem_copy(self.a, self.la)
                cb.mem_copy(self.b, self.lb)
                cb.matmul(self.c, self.a, self.b, init=True)
                cb.mem_copy(self.u, self.c, dst_subblock=0)
                cb.mem_copy(self.u, self.c, dst_subblock=1)   # both write o, with the same values
                cb.mem_copy(o, self.u)
        """, x, eye, o)
    assert torch.equal(o, x.to(torch.bfloat16))


def test_matmul_operands_and_transposed_copies(tmp_path):
    """dst = lhs @ rhs^T for L0 buffers of shapes (M, K) and (N, K); a transposed L1 -> L0 copy
    fills a buffer of the transposed shape (the seed's U^T Kr: (C, dv)^T x (C, D))."""
    u, kr = torch.randn(64, 32), torch.randn(64, 128)
    out = torch.zeros(32, 128)
    run(tmp_path, """
        @cb.kernel
        class K:
            def __init__(self):
                self.lu = cb.Buffer(L1, (64, 32), F32)
                self.lk = cb.Buffer(L1, (64, 128), F32)
                self.a = cb.Buffer(L0A, (32, 64), F32)
                self.b = cb.Buffer(L0B, (128, 64), F32)
                self.c = cb.Buffer(L0C, (32, 128), F32)
            def __call__(self, u, kr, out):
                cb.mem_copy(self.lu, u)
                cb.mem_copy(self.lk, kr)
                cb.mem_copy(self.a, self.lu, transpose=True)
                cb.mem_copy(self.b, self.lk, transpose=True)
                cb.matmul(self.c, self.a, self.b, init=True)
                cb.matmul(self.c, self.a, self.b, init=False)
                cb.mem_copy(out, self.c)
        """, u, kr, out)
    torch.testing.assert_close(out, 2 * u.T @ kr, rtol=1e-5, atol=1e-4)


def test_nz_staging_through_vector_stores(tmp_path):
    """Rows stored as NZ with vstore_strided (block_stride = rows), copied UB -> L1 and multiplied
    by I, come back as the ND rows; each subblock stages its own half of the rows."""
    x = torch.randn(32, 64)
    eye = torch.eye(64)
    out = torch.zeros(32, 64)
    run(tmp_path, """
        @cb.kernel
        class K:
            def __init__(self):
                self.u = cb.Buffer(UB, (16, 64), F32)
                self.nz = cb.Buffer(UB, (16, 64), F32, data_format="nz")
                self.l1 = cb.Channel(L1, shape=(32, 64), dtype=F32, depth=1, kind=CC)
                self.le = cb.Buffer(L1, (64, 64), F32)
                self.a = cb.Buffer(L0A, (32, 64), F32)
                self.b = cb.Buffer(L0B, (64, 64), F32)
                self.c = cb.Buffer(L0C, (32, 64), F32)
                self.r = cb.Channel(UB, shape=(16, 64), dtype=F32, depth=1, kind=CC)
            def __call__(self, x, eye, out):
                sub = cb.get_subblock_id()
                cb.mem_copy(self.u, cb.tile_slice(x, (16, 64), (sub, 0)))
                with cb.vf():
                    m = reg.create_mask("all", 32)
                    for r in cb.range(16):
                        reg.vstore_strided(self.nz, r * 8, reg.vload(self.u, r * 64), m, block_stride=16)
                cb.mem_copy(cb.tile_slice(self.l1.produce(), (16, 64), (sub, 0)), self.nz)
                cb.mem_copy(self.le, eye)
                cb.mem_copy(self.a, self.l1.consume())
                cb.mem_copy(self.b, self.le)
                cb.matmul(self.c, self.a, self.b, init=True)
                res = self.r.produce()
                for s in cb.range_constexpr(2):
                    cb.mem_copy(res, cb.tile_slice(self.c, (16, 64), (s, 0)), dst_subblock=s)
                cb.mem_copy(cb.tile_slice(out, (16, 64), (sub, 0)), self.r.consume())
        """, x, eye, out)
    assert torch.equal(out, x)


def test_subblocks_writing_one_l1_tile_differently_is_a_race(tmp_path):
    x = torch.randn(32, 64)
    with pytest.raises(ModelError, match="both vector subblocks write"):
        run(tmp_path, """
            @cb.kernel
            class K:
                def __init__(self):
                    self.u = cb.Buffer(UB, (16, 64), F32)
                    self.l1 = cb.Buffer(L1, (16, 64), F32, data_format="nd")
                def __call__(self, x):
                    cb.mem_copy(self.u, cb.tile_slice(x, (16, 64), (cb.get_subblock_id(), 0)))
                    cb.mem_copy(self.l1, self.u)
            """, x)


def test_gm_read_of_another_blocks_write_needs_a_global_sync(tmp_path):
    body = """
        @cb.kernel
        class K:
            def __init__(self, synced):
                self.synced = synced
                self.u = cb.Buffer(UB, (8, 64), F32)
            def __call__(self, x):
                b = cb.get_block_idx()
                cb.mem_copy(self.u, cb.tile_slice(x, (8, 64), (b, 0)))
                cb.mem_copy(cb.tile_slice(x, (8, 64), (b + 2, 0)), self.u)
                if cb.const_expr(self.synced):
                    cb.global_sync_all()
                cb.mem_copy(self.u, cb.tile_slice(x, (8, 64), (3 - b, 0)))
        """
    with pytest.raises(ModelError, match="same phase"):
        run(tmp_path, body, torch.randn(32, 64), blocks=2, ctor=(False,))
    run(tmp_path, body, torch.randn(32, 64), blocks=2, ctor=(True,))


def test_structure_errors(tmp_path):
    with pytest.raises(ModelError, match="inside `with cb.vf"):
        run(tmp_path, """
            @cb.kernel
            class K:
                def __call__(self, x):
                    reg.create_mask("all", 32)
            """, torch.zeros(8, 64))
    with pytest.raises(ModelError, match="different numbers of times|different numbers of global syncs"):
        run(tmp_path, """
            @cb.kernel
            class K:
                def __call__(self, x):
                    if cb.get_block_idx() == 0:
                        cb.global_sync_all()
            """, torch.zeros(8, 64), blocks=2)
    with pytest.raises(ModelError, match="same statements"):
        run(tmp_path, """
            @cb.kernel
            class K:
                def __call__(self, x):
                    if cb.get_subblock_id() == 0:
                        pass
            """, torch.zeros(8, 64))


def test_bf16_rounding_is_round_to_nearest_even():
    from kdagen.ascend_sim import memory as M

    x = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5e-3, np.inf, 3.0e38], dtype=np.float32)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(M.f32_to_bf16(x), want)
    assert np.array_equal(M.bf16_to_f32(want), torch.from_numpy(x).to(torch.bfloat16).float().numpy())
