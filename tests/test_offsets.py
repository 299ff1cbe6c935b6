"""Element offsets past 2^31 (GPU): q, k, v, g, beta and o as views of one projection buffer whose
rows are so wide that the last sequences start past its element 2^31. An engine's fused projection
gets there in an ordinary prefill (a 128K-token call with 16K columns), so every kernel must
compute token offsets in 64 bits: an int32 product wraps and reads another row, the NaN gap
between the views, or faults. Each run is checked against the float64 reference (kdagen.cases)."""

from __future__ import annotations

import pytest
import torch

import kdagen.runtime as rt
from kdagen.cases import make_case, run_and_compare
from kdagen.registry import Registry
from kdagen.scan.engine import scan_prefill
from kdagen.select import device_reason

EDGE = 2 ** 31
WIDTH = 1 << 19  # elements per token row: token 4096 starts at element 2^31
LENS = [3000, 1100, 250, 258]  # the second sequence straddles token 4096, the last two lie past it
T = sum(LENS)
REGISTRY = Registry.load()
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


@pytest.mark.parametrize("v", PARAMS)
def test_offsets_past_2_31(v):
    why = device_reason(v.target, torch.device("cuda"))
    if why:
        pytest.skip(why)
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
