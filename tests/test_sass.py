"""Structure of the built sm80 kernels, read from their SASS (no GPU needed).

These pin design properties that only a GPU could otherwise reveal (as time): the recurrence
meets the whole block once per chunk, the split-K warp pairs meet at an mbarrier per V tile,
and the chunk-16 prep does its matrix products on tensor cores.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from kdagen.variant import Variant
from kdagen_dev.launch import built_variants
from kdagen_dev.sass import disassemble, find_cuobjdump

ARTIFACTS = built_variants("sm80")  # (Variant, fatbin) of the sm80 variants the specs name, where built
C16 = [(v, a) for v, a in ARTIFACTS if v.chunk == 16]
pytestmark = [
    pytest.mark.skipif(find_cuobjdump() is None, reason="cuobjdump/nvdisasm not installed"),
    pytest.mark.skipif(not ARTIFACTS, reason="no sm80 variant built (make build SPEC=specs/a100.yaml)"),
]


@pytest.mark.parametrize("var,art", ARTIFACTS, ids=[v.name for v, _ in ARTIFACTS])
def test_recurrence_barriers(var: Variant, art: Path):
    """The compute warps' chunk loop has one block-wide barrier per step and no named barrier; at
    K >= 128 the warp pair of a V tile meets at that tile's mbarrier: one arrive (the tile's address
    in a register) and one phase poll per step. (The copy warp's loop, which ptxas may unroll,
    meets the same block barrier once per step; the GPU tests would hang otherwise.)"""
    for arch in ("sm_80", "sm_90"):
        recur = disassemble(art, arch)["kda_recur"]
        lo, hi = recur.loop_with("HMMA")
        bars = recur.barriers(lo, hi)
        assert sum(b.endswith(" 0x0") for b in bars) == 1, f"{var.name} {arch}: {bars}"
        named = [b for b in bars if not b.endswith(" 0x0")]
        assert named == [], f"{var.name} {arch}: {named}"
        ops = collections.Counter(i.split()[0] for a, i in zip(recur.addresses, recur.instructions) if lo <= a <= hi)
        # sm_80: ATOMS.ARRIVE, then the poll is a plain LDS of the barrier word; sm_90: SYNCS.*
        arrive, poll = ("ATOMS.ARRIVE.64", None) if arch == "sm_80" else ("SYNCS.ARRIVE.TRANS64.A1T0", "SYNCS.PHASECHK.TRANS64")
        want = 1 if var.k >= 128 else 0
        assert ops[arrive] == want and (poll is None or ops[poll] == want), f"{var.name} {arch}: {ops}"


@pytest.mark.parametrize("var,art", C16, ids=[v.name for v, _ in C16])
def test_chunk16_prep_on_tensor_cores(var: Variant, art: Path):
    """L/Mqk (4 MMAs per 16-column K slice; the per-warp code holds one slice at K = 64, two at
    K >= 128) and [W | U0] (3 split-bf16 MMAs x 4 n-tiles per warp) are mma.sync."""
    prep = disassemble(art, "sm_90")["kda_prep"]
    hmma = sum(n for op, n in prep.opcodes().items() if op.startswith("HMMA"))
    assert hmma == 4 * (2 if var.k >= 128 else 1) + 12, (var.name, hmma)


def test_control_bits_decode():
    """The scheduling bits of three upper words cuobjdump printed for kda_recur (sm_90): a block
    barrier (stall 1, no scoreboards), an LDSM that signals scoreboard 1, and the HMMA that
    waits for it before issuing (its top bits are operand-reuse flags, not scoreboards)."""
    from kdagen_dev.sass import Control

    assert Control.decode(0x000FE20000010000) == Control(stall=1, write_sb=7, read_sb=7, wait_mask=0)
    assert Control.decode(0x000E680000000200) == Control(stall=4, write_sb=1, read_sb=7, wait_mask=0)
    assert Control.decode(0x042FEC00000418FF) == Control(stall=6, write_sb=7, read_sb=7, wait_mask=0b000010)
