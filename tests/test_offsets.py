"""Offsets past 2^31 (GPU).

Elements: q, k, v, g, beta and o as views of one projection buffer whose rows are so wide that the
last sequences start past its element 2^31. An engine's fused projection gets there in an
ordinary prefill (a 128K-token call with 16K columns), so every kernel must compute token offsets
in 64 bits: an int32 product wraps and reads another row, the NaN gap between the views, or
faults. Each run is checked against the float64 reference (kdagen.cases).

Workspace bytes: the chunk records of a long packed batch (sm80 and Triton keep one per chunk and
head, >= 768 bytes per token and head at K = 128) pass byte 2^31 at 128K tokens and 32 heads. A
short sequence packed behind a long one must give what it gives alone, bit for bit."""

from __future__ import annotations

import pytest
import torch

import kdagen.runtime as rt
from kdagen.cases import make_case, run_and_compare, run_poisoned
from kdagen.paths import GENERATED_DIR
from kdagen.registry import Registry
from kdagen.scan.engine import scan_prefill
from kdagen.select import device_reason

EDGE = 2 ** 31
WIDTH = 1 << 19  # elements per token row: token 4096 starts at element 2^31
LENS = [3000, 1100, 250, 258]  # the second sequence straddles token 4096, the last two lie past it
T = sum(LENS)
REGISTRY = Registry.load(GENERATED_DIR)
# one variant per kernel code path (target, chunk size): K = V = 128 (the twin runs K <= 64 on a GPU), bf16, fp32 state
NAMES = ["kda_fwd_sm80_c16_k128_v128_bf16_gb_sfp32_bv16_hl", "kda_fwd_sm80_c64_k128_v128_bf16_gb_sfp32_bv16",
         "kda_fwd_sm90_c16_k128_v128_bf16_gb_sfp32_bv64", "kda_fwd_triton_c16_k128_v128_bf16_gb_sfp32_bv32",
         "kda_fwd_triton_c64_k128_v128_bf16_gb_sfp32_bv32", "kda_fwd_triton_twin_c64_k64_v64_bf16_gb_sfp32_bv32"]
PARAMS = [pytest.param(REGISTRY.entries[n].variant, id=n, marks=pytest.mark.gpu) for n in NAMES if n in REGISTRY.entries]
SCAN = [p for p in PARAMS if p.values[0].target == "sm80" and p.values[0].chunk == 16]


def _wide_case(v, device: str = "cuda") -> tuple[dict, torch.Tensor]:
    """The varlen case as views of a [1, T + 3, WIDTH] bf16 buffer (every chunk's state kept), and
    o as a view of the same buffer's NaN gap."""
    need = (T + 3) * WIDTH * 2
    if device == "cuda" and torch.cuda.mem_get_info()[0] < need + (2 << 30):
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory and 2 GiB to spare")
    kw = make_case(v, device, lens=LENS, H=2, HV=2, fused=True, fused_width=WIDTH, chunk_states=True, seed=31)
    buf = kw["q"]._base
    assert buf.numel() > EDGE and buf.stride(1) == WIDTH
    HV, V = kw["v"].shape[2], kw["v"].shape[3]
    o = buf[:, :T, WIDTH - 16 - HV * V:WIDTH - 16].view(1, T, HV, V)
    assert o.isnan().all()  # the gap: whatever the kernel leaves unwritten stays NaN
    return kw, o


def _rows_past_the_edge(o: torch.Tensor) -> int:
    """Sequences of LENS whose o rows all start past element 2^31 of o's buffer."""
    base = o._base.data_ptr()
    starts = [sum(LENS[:i]) for i in range(len(LENS))]
    return sum((o[0, s].data_ptr() - base) // o.element_size() >= EDGE for s in starts if s < T)


def _skip_unless_runs(v) -> None:
    why = device_reason(v.target, torch.device("cuda"))
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("v", PARAMS)
def test_offsets_past_2_31(v):
    _skip_unless_runs(v)
    kw, o = _wide_case(v)
    assert _rows_past_the_edge(o) == 2
    bufs = rt.allocate_outputs(**kw, fill=float("nan"))
    bufs["out"] = o
    out = rt.kda_prefill(**kw, **bufs, variant=v.name)
    assert out[0] is o
    errs = run_and_compare(v, kw, out=out)
    assert set(errs) == {"o", "state", "chunk_states"}


@pytest.mark.parametrize("v", SCAN)
def test_scan_offsets_past_2_31(v):
    # the scan reads the views into its packed row and writes o back through the caller's view
    kw, o = _wide_case(v)
    kw.pop("return_chunk_states"), kw.pop("chunk_size"), kw.pop("state_dtype")
    out = scan_prefill(**kw, out=o, variant=v.name, segments=[3, 1, 1, 1], mode="correct")
    assert out[0] is o
    run_and_compare(v, kw, out=out)


# Workspace: a first sequence long enough that the second's records start past byte 2^31 at
# >= 768 bytes per token and head (3 bf16 [C, K] rows per chunk at K = 128: W, Qd, Kr).
HV_WS = 8
FIRST = -(-EDGE // (768 * HV_WS)) + 4096
TAIL = 777
WS_PARAMS = [p for p in PARAMS if p.values[0].target != "triton_twin"]


@pytest.mark.parametrize("v", WS_PARAMS)
def test_records_past_byte_2_31(v):
    _skip_unless_runs(v)
    need = FIRST * HV_WS * (3 * v.k * 2 + 8 * v.k) * 3  # inputs, o and the records, roughly
    if torch.cuda.mem_get_info()[0] < need + (2 << 30):
        pytest.skip(f"needs about {need / 2**30:.1f} GiB of free GPU memory and 2 GiB to spare")
    _packed_behind(v, "cuda", FIRST, TAIL)


def _packed_behind(v, device: str, first: int, tail: int, every: int = 64) -> None:
    """A tail-token sequence alone (against float64) and packed behind a random first-token one:
    bit-equal o, final state and chunk states (every `every`-th chunk's)."""
    alone = make_case(v, device, lens=[tail], H=2, HV=HV_WS, chunk_states=True, seed=32)
    alone["return_chunk_states"] = every
    want = run_poisoned(v, alone)
    run_and_compare(v, alone, out=want)
    gen = torch.Generator(device=device).manual_seed(33)
    packed = dict(alone)
    for name in ("q", "k", "v", "g", "beta"):
        t = alone[name]
        head = torch.randn((1, first, *t.shape[2:]), generator=gen, device=device).to(t.dtype)
        packed[name] = torch.cat([head, t], dim=1)
    h0 = alone["initial_state"]
    packed["initial_state"] = torch.cat([torch.randn_like(h0) * 0.5, h0])
    packed["cu_seqlens"] = torch.tensor([0, first, first + tail], dtype=torch.int32, device=device)
    got = run_poisoned(v, packed)
    rows = -(-first // (v.chunk * every))
    assert got[2].shape[0] == rows + want[2].shape[0]
    assert torch.equal(got[0][:, first:], want[0]) and torch.equal(got[1][1:], want[1])
    assert torch.equal(got[2][rows:], want[2])
