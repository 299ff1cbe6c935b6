"""The three-step scan composed of kda_prefill calls (kdagen/scan/engine.py).

The plumbing (layouts, batched/varlen, state layouts and dtypes, chunk states, caller buffers,
modes) runs on the float64 chunked reference as the composed prefill (fast); the real kernels
run through kdagen.kda_prefill on the Triton interpreter (few tiny cases: it is slow on CPU),
and on a GPU the same cases with `pytest -m gpu`.
"""

from __future__ import annotations

import math

import pytest
import torch

import kdagen
from kdagen.errors import KdaInputError
from kdagen.reference import kda_reference, rel_rmse
from kdagen.scan.engine import scan_prefill
from kdagen.scan.reference import reference_prefill

from .conftest import HAS_CUDA


def make_kw(seed, *, B=1, T=100, lens=None, H=1, HV=1, K=16, dtype=torch.float32, layout="BSND",
            state_layout="VK", state_dtype=torch.float32, lower_bound=-1e-3, with_state=True, device="cpu"):
    gen = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=gen) * scale

    if lens is not None:
        B, T = 1, sum(lens)
    N = len(lens) if lens is not None else B
    t = dict(q=r(B, T, H, K).to(dtype), k=r(B, T, H, K).to(dtype), v=r(B, T, HV, K).to(dtype), g=r(B, T, HV, K),
             beta=r(B, T, HV))
    if layout == "BNSD":
        t = {n: x.transpose(1, 2).contiguous() for n, x in t.items()}
    kw = dict(t, A_log=r(HV, scale=0.5), dt_bias=r(HV, K), lower_bound=lower_bound, layout=layout,
              state_layout=state_layout)
    if lens is not None:
        kw["cu_seqlens"] = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    if with_state:
        kw["initial_state"] = r(N, HV, K, K, scale=0.5).to(state_dtype)
        kw["output_final_state"] = True
    return {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}


def reference(kw, chunk=None):
    ref = {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    for n in ("output_final_state", "chunk_size", "return_chunk_states", "state_dtype"):
        ref.pop(n, None)
    return kda_reference(**ref, output_final_state=True, chunk_states_size=chunk)


def check(out, kw, chunk, tol):
    ro, rs, rc = reference(kw, chunk)
    errs = {"o": rel_rmse(out[0].cpu(), ro)}
    assert torch.isfinite(out[0]).all()
    if kw.get("initial_state") is not None:
        assert out[1].dtype == kw["initial_state"].dtype
        errs["state"] = rel_rmse(out[1].cpu(), rs)
    if chunk is not None:
        assert out[2].shape == rc.shape
        errs["chunk_states"] = rel_rmse(out[2].cpu(), rc)
    assert max(errs.values()) < tol, errs
    return errs


class Spy:
    """A prefill that records its calls and computes them with the chunked reference."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, g, beta, **kw):
        self.calls.append((tuple(v.shape), kw.get("cu_seqlens_cpu"), v.stride(), bool(v.eq(0).all())))
        return reference_prefill(q, k, v, g, beta, **kw)


@pytest.mark.parametrize("case", [
    # (id, problem, chunk, segments, mode)
    ("varlen-bsnd-vk-c16-rerun", dict(lens=[150, 7, 0, 70]), 16, [4, 1, 1, 3], "rerun"),
    ("varlen-bnsd-kv-c64-correct", dict(lens=[200, 65], layout="BNSD", state_layout="KV"), 64, [3, 2], "correct"),
    ("batched-gqa-c16-rerun", dict(B=2, T=90, H=1, HV=2), 16, 3, "rerun"),
    ("batched-gqa-c16-correct", dict(B=2, T=90, H=1, HV=2), 16, 4, "correct"),
    ("no-state-strong-gate", dict(B=1, T=120, lower_bound=-5.0, with_state=False), 16, 5, "rerun"),
], ids=lambda c: c[0])
def test_scheme_on_the_reference_engine(case):
    # fp32 inputs: the scheme must equal the float64 recurrence to fp32 rounding.
    _, pk, C, segs, mode = case
    kw = make_kw(len(case[0]), **pk)
    spy = Spy()
    out = scan_prefill(**kw, chunk_size=C, return_chunk_states=True, segments=segs, mode=mode, prefill=spy)
    check(out, kw, C, 1e-5)
    # step 1 (B, then A: v a stride-0 zero view, no copy) and, for "rerun", step 3; all over the
    # segments as varlen sequences, with the caller's heads
    assert len(spy.calls) == (3 if mode == "rerun" else 2)
    HV = kw["v"].shape[2 if kw["layout"] == "BSND" else 1]
    assert all(c[0][2] == HV for c in spy.calls)
    assert [c[3] for c in spy.calls] == [False, True] + [False] * (mode == "rerun")
    assert spy.calls[1][2][1] == 0  # the time stride


def test_bf16_states_and_poisoned_caller_buffers():
    kw = make_kw(3, lens=[130, 40], state_dtype=torch.bfloat16, layout="BNSD", state_layout="KV")
    C = 16
    o_buf = torch.full_like(kw["v"], math.nan)
    fs_buf = torch.full_like(kw["initial_state"], math.nan)
    rows = math.ceil(130 / C) + math.ceil(40 / C)
    cs_buf = torch.full((rows, 1, 16, 16), math.nan, dtype=torch.bfloat16)
    out = scan_prefill(**kw, chunk_size=C, segments=[3, 2], out=o_buf, final_state=fs_buf, chunk_states=cs_buf,
                       prefill=reference_prefill)
    assert out[0] is o_buf and out[1] is fs_buf and out[2] is cs_buf
    assert torch.isfinite(cs_buf).all()
    check(out, kw, C, 5e-3)  # the states are bf16


def test_whole_calls_pass_through_and_bad_input_is_named():
    kw = make_kw(4, B=1, T=40)
    spy = Spy()
    out = scan_prefill(**kw, segments=1, prefill=spy)
    assert len(spy.calls) == 1 and spy.calls[0][1] is None  # the caller's own call, unchanged
    check(out, kw, None, 1e-5)
    spy = Spy()
    scan_prefill(**kw, prefill=spy)  # the planner leaves a 40-token call whole
    assert len(spy.calls) == 1
    with pytest.raises(KdaInputError, match="needs V == K; found K=16, V=8"):
        bad = dict(kw, v=kw["v"][..., :8].contiguous(), initial_state=None, output_final_state=False)
        scan_prefill(**bad, segments=2, prefill=reference_prefill)
    with pytest.raises(KdaInputError, match="mode: expected 'rerun' or 'correct'"):
        scan_prefill(**kw, segments=2, mode="fast", prefill=reference_prefill)
    with pytest.raises(KdaInputError, match="workspace"):
        scan_prefill(**kw, segments=2, chunk_size=16, workspace=torch.empty(8, dtype=torch.uint8),
                     prefill=reference_prefill)
    var = make_kw(5, lens=[64, 64])
    with pytest.raises(KdaInputError, match="cu_seqlens: the scan cuts sequences on the host"):
        scan_prefill(**var, segments=2, assume_valid=True, prefill=reference_prefill)


# ----------------------------------------------------------- real kernels (Triton / GPU)

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="interpreter runs only without a GPU"), id="cpu"),
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
]


@pytest.mark.parametrize("dev", DEVICES)
def test_kernels_varlen_split_with_states_and_chunk_states(dev):
    # 90 tokens cut in 3 (6 chunks of 16: 2 + 2 + 2, the last ragged), a short sequence whole,
    # an empty one, 30 tokens cut in 2; fp32, a gate that barely decays.
    kw = make_kw(6, lens=[90, 5, 0, 30], K=32, device=dev)
    out = scan_prefill(**kw, chunk_size=16, return_chunk_states=True, segments=[3, 1, 1, 2])
    check(out, kw, 16, 1e-5)


@pytest.mark.parametrize("dev", DEVICES)
def test_kernels_gqa_correct_mode(dev):
    # Both step-1 calls keep the caller's GQA (value head h reads q/k head h // (HV / H)).
    kw = make_kw(7, B=1, T=64, H=1, HV=2, K=32, device=dev)
    out = scan_prefill(**kw, chunk_size=16, segments=2, mode="correct")
    check(out, kw, None, 1e-5)


@pytest.mark.parametrize("dev", DEVICES)
def test_kernels_bf16_inputs_bf16_state_bnsd(dev):
    kw = make_kw(8, B=2, T=48, K=32, dtype=torch.bfloat16, state_dtype=torch.bfloat16, layout="BNSD",
                 state_layout="KV", device=dev)
    out = scan_prefill(**kw, chunk_size=16, segments=2)
    check(out, kw, None, 5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("T,segs", [(8192, 7), (65536, 16)])
def test_gpu_long_sequence_against_one_piece(T, segs):
    # bf16, D = 128, gates that barely decay; the scan against the one-piece call and the
    # float64 reference of a shorter prefix is too slow here: the one-piece call is the check.
    kw = make_kw(9, B=1, T=T, H=2, HV=2, K=128, dtype=torch.bfloat16, device="cuda")
    one = kdagen.kda_prefill(**kw)
    out = scan_prefill(**kw, segments=segs)
    assert rel_rmse(out[0], one[0]) < 5e-3 and rel_rmse(out[1], one[1]) < 5e-3
