"""kda_prefill's route to the segment scan (kdagen/scan/route.py): which signatures are offered
to the planner, and that a routed call returns what one piece returns, through the caller's
buffers and layouts, on the interpreter (CPU) and the GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import kdagen
import kdagen.runtime as rt
from kdagen.inputs import CallInfo
from kdagen.reference import rel_rmse
from kdagen.scan import engine, route

from .conftest import HAS_CUDA
from .test_scan_engine import make_kw


@pytest.fixture(autouse=True)
def own_plans(monkeypatch):
    # plans made here (routed ones among them) stay here
    monkeypatch.setattr(rt, "_PLANS", {})
    monkeypatch.setattr(rt, "_LAST", rt._NO_PLAN)
    monkeypatch.setattr(rt, "_POOL_LAST", rt._NO_PLAN)
    monkeypatch.delenv("KDAGEN_SCAN", raising=False)
    monkeypatch.delenv("KDAGEN_FORCE_VARIANT", raising=False)


LONG = CallInfo(device=torch.device("cuda"), dtype="bf16", layout="bsnd", B=1, T=32768, N=1, H=8, HV=8, K=128,
                V=128, gate="bounded", state="fp32", varlen=False, chunk_size=None, max_len=32768,
                cu_seqlens_host=None)


def test_offered_signatures(monkeypatch):
    assert route.offered(LONG, "sm80", {})
    assert route.offered(replace(LONG, B=2, N=2), "sm80", {})
    assert route.offered(replace(LONG, varlen=True), "sm80", {"cu_seqlens_cpu": object()})
    # several sequences (each call is planned from its offsets), on the host or read from the device
    assert route.offered(replace(LONG, varlen=True, N=2), "sm80", {"cu_seqlens_cpu": object()})
    assert route.offered(replace(LONG, varlen=True, N=2), "sm80", {})
    # checkpoints' sparse chunk states ride along
    assert route.offered(LONG, "sm80", {"return_chunk_states": route.CS_MIN_SPACING // 16, "chunk_size": 16})
    refused = {
        "sm90 one piece": (LONG, "sm90", {}),
        "cpu": (replace(LONG, device=torch.device("cpu")), "sm80", {}),
        "fp16": (replace(LONG, dtype="fp16"), "sm80", {}),
        "K != V": (replace(LONG, V=64), "sm80", {}),
        "varlen, 2 sequences, offsets promised": (replace(LONG, varlen=True, N=2), "sm80", {"assume_valid": True}),
        "no sequence": (replace(LONG, varlen=True, N=0), "sm80", {}),
        "short": (replace(LONG, T=route.MIN_TOKENS - 64), "sm80", {}),
        "forced variant": (LONG, "sm80", {"variant": "kda_fwd_sm80_c16_k128_v128_bf16_gb_sfp32_bv16_hl"}),
        "workspace": (LONG, "sm80", {"workspace": torch.empty(1)}),
        "chunk states": (LONG, "sm80", {"return_chunk_states": True, "chunk_size": 64}),
        "chunk state buffer": (LONG, "sm80", {"chunk_states": torch.empty(1), "chunk_size": 16}),
        "dense strided chunk states": (LONG, "sm80", {"return_chunk_states": route.CS_MIN_SPACING // 128,
                                                      "chunk_size": 64}),
        "assume_valid": (LONG, "sm80", {"assume_valid": True}),
    }
    for why, (info, target, kw) in refused.items():
        assert not route.offered(info, target, kw), why
    monkeypatch.setenv("KDAGEN_FORCE_VARIANT", "kda_fwd_sm80_c16_k128_v128_bf16_gb_sfp32_bv16_hl")
    assert not route.offered(LONG, "sm80", {})


class ScanSpy:
    def __init__(self, monkeypatch):
        self.calls = []
        real = engine.scan_prefill

        def spy(*a, **kw):
            self.calls.append((kw["segments"], kw["mode"]))
            return real(*a, **kw)

        monkeypatch.setattr(engine, "scan_prefill", spy)


DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="interpreter runs only without a GPU"), id="cpu"),
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("shape", [
    dict(B=2, T=80, layout="BSND", state_layout="VK", state_dtype=torch.float32),
    dict(B=1, T=96, layout="BNSD", state_layout="KV", dtype=torch.bfloat16, state_dtype=torch.bfloat16),
    dict(lens=[96], layout="BSND", state_layout="VK", state_dtype=torch.float32),
], ids=["batch2", "bnsd_kv_bf16state", "varlen1"])
def test_routed_call_equals_one_piece(monkeypatch, dev, shape):
    # Every signature offered with 3 segments a sequence (the planner would keep these short
    # calls whole): the routed call runs the scan once, its own calls run in one piece (no
    # recursion), and it writes the caller's poisoned buffers with what one piece returns.
    spy = ScanSpy(monkeypatch)
    monkeypatch.setattr(route, "segments_for",
                        lambda plan, kw: None if route._inside() else tuple([3] * plan.info.N))
    kw = make_kw(11, H=1, HV=2, K=32, device=dev, **shape)
    if "cu_seqlens" in kw:
        kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
    one = None
    for scan in ("0", "1"):
        monkeypatch.setenv("KDAGEN_SCAN", scan)
        out = torch.full_like(kw["v"], float("nan"))
        fs = torch.full_like(kw["initial_state"], float("nan"))
        res = kdagen.kda_prefill(**kw, chunk_size=16, out=out, final_state=fs)
        assert res[0] is out and res[1] is fs
        assert torch.isfinite(out).all() and torch.isfinite(fs).all()
        if one is None:
            one = (out, fs)
            assert spy.calls == []
    assert spy.calls == [((3,) * (2 if shape.get("B") == 2 else 1), "correct")]
    # bf16: o_A and the states round to bf16 in the scan where one piece keeps them in fp32
    tol = 1e-5 if shape["state_dtype"] == torch.float32 else 1e-2
    assert rel_rmse(out, one[0]) < tol and rel_rmse(fs.float(), one[1].float()) < tol


def test_several_sequences_are_offered_where_one_of_all_tokens_would_be_cut(monkeypatch):
    # The signature's probe: one sequence of all T tokens, planned as such; where the planner
    # keeps even that whole, no call of the signature is planned.
    from kdagen.scan import engine as eng

    seen = []

    def planner(info, cu, **kw):
        seen.append((info.N, info.max_len, tuple(cu), kw["align"]))
        return (4,) if info.HV <= 8 else (1,)

    monkeypatch.setattr(eng, "planned_segments", planner)
    from kdagen.runtime import Plan

    plan = object.__new__(Plan)  # what segments_for reads of a runtime plan: its info and variant's target
    plan.info = replace(LONG, varlen=True, N=3, T=40000, max_len=20000, cu_seqlens_host=[0, 20000, 30000, 40000])
    plan.variant = type("V", (), {"target": "sm80"})()
    kw = {"cu_seqlens_cpu": torch.tensor([0, 20000, 30000, 40000])}
    assert route.segments_for(plan, kw) == route.PER_CALL
    assert seen == [(1, 40000, (0, 40000), 64)]
    assert route.segments_for(plan, {}) == route.PER_CALL  # offsets on the device only: read per call
    assert route.segments_for(plan, {"assume_valid": True}) is None  # never read: not offered
    plan.info = replace(plan.info, H=16, HV=16)
    assert route.segments_for(plan, kw) is None


@pytest.mark.parametrize("host", [True, False], ids=["host_offsets", "device_offsets"])
@pytest.mark.parametrize("dev", DEVICES)
def test_several_sequences_route_per_call(monkeypatch, dev, host):
    # Varlen with several sequences, routed per call: a call whose longest sequence reaches
    # MIN_TOKENS runs the scan with segments=None (the planner, here cutting each sequence of 64
    # tokens or more in 3, asks about these offsets); a call of only short ones runs in one
    # piece; both equal one piece. Offsets given only as cu_seqlens are read once a call.
    from kdagen.scan import engine as eng

    spy = ScanSpy(monkeypatch)
    monkeypatch.setattr(route, "MIN_TOKENS", 64)
    monkeypatch.setattr(route, "segments_for",
                        lambda plan, kw: None if route._inside() or plan.info.N < 2 else route.PER_CALL)
    planned = []

    def planner(info, cu, **kw):
        lens = [b - a for a, b in zip(cu, cu[1:])]
        planned.append(tuple(lens))
        return tuple(3 if n >= 64 else 1 for n in lens)

    monkeypatch.setattr(eng, "planned_segments", planner)
    for lens, scanned in (([100, 30, 50], True), ([40, 30, 60], False)):
        kw = make_kw(15, lens=lens, H=1, HV=2, K=32, device=dev)
        if host:
            kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
        outs = {}
        for scan in ("0", "1"):
            monkeypatch.setenv("KDAGEN_SCAN", scan)
            outs[scan] = kdagen.kda_prefill(**kw, chunk_size=16)
        assert spy.calls == ([(None, "correct")] if scanned else []), lens
        assert planned == ([tuple(lens)] if scanned else []), lens
        assert kdagen.runtime.route_of(**kw, chunk_size=16) == \
            ("scan correct x3" if scanned else None)
        for a, b in zip(outs["0"], outs["1"]):
            assert torch.isfinite(b).all() and rel_rmse(a, b) < 1e-5
        spy.calls.clear()
        planned.clear()
    # checkpoints every 32 tokens (every 2nd chunk state kept): the scan cuts on that grid
    kw = make_kw(16, lens=[100, 30, 64], H=1, HV=2, K=32, device=dev)
    outs = {}
    for scan in ("0", "1"):
        monkeypatch.setenv("KDAGEN_SCAN", scan)
        outs[scan] = kdagen.kda_prefill(**kw, chunk_size=16, checkpoint_every=32)
    assert spy.calls == [(None, "correct")] and outs["1"][2].shape[0] == 3 + 0 + 2
    for a, b in zip(outs["0"], outs["1"]):
        assert torch.isfinite(b).all() and rel_rmse(a, b) < 1e-5


@pytest.mark.parametrize("dev", DEVICES)
def test_routed_checkpoints_equal_one_piece(monkeypatch, dev):
    # A checkpoint call keeps every 2nd chunk-16 state (checkpoint_every=32): routed, its segments
    # are cut on that grid and the checkpoints, o and the final state are one piece's.
    spy = ScanSpy(monkeypatch)
    monkeypatch.setattr(route, "segments_for",
                        lambda plan, kw: None if route._inside() else tuple([3] * plan.info.N))
    kw = make_kw(14, lens=[150], H=1, HV=2, K=32, device=dev)
    kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
    outs = {}
    for scan in ("0", "1"):
        monkeypatch.setenv("KDAGEN_SCAN", scan)
        outs[scan] = kdagen.kda_prefill(**kw, checkpoint_every=32)
    assert [c[0] for c in spy.calls] == [(3,)]
    assert outs["1"][2].shape[0] == 150 // 32
    for a, b in zip(outs["0"], outs["1"]):
        assert rel_rmse(a, b) < 1e-5


@pytest.mark.gpu
def test_gpu_planner_routes_long_few_head_calls():
    # On the H200 the routed call took 0.51x one piece's time at B1 T131072 H4 (8 segments) with
    # o as close to float64 (session 37); T2048 H8 stays one piece. The routed call against one
    # piece: both bf16, a gate that barely decays (the entering states matter).
    if torch.cuda.get_device_properties(0).multi_processor_count < 100:
        pytest.skip("the planner's costs are the H200's (132 SMs)")
    kw = make_kw(12, T=131072, H=4, HV=4, K=128, dtype=torch.bfloat16, device="cuda")
    short = make_kw(12, T=2048, H=8, HV=8, K=128, dtype=torch.bfloat16, device="cuda")
    assert rt.route_of(**short) is None
    label = rt.route_of(**kw)
    assert label is not None and label.startswith("scan correct x"), label
    spy_calls = []
    real = engine.scan_prefill
    with pytest.MonkeyPatch.context() as m:
        m.setattr(engine, "scan_prefill", lambda *a, **k: spy_calls.append(k["segments"]) or real(*a, **k))
        routed = kdagen.kda_prefill(**kw)
        m.setenv("KDAGEN_SCAN", "0")
        one = kdagen.kda_prefill(**kw)
    assert len(spy_calls) == 1 and max(spy_calls[0]) > 1
    assert rel_rmse(routed[0], one[0]) < 5e-3 and rel_rmse(routed[1], one[1]) < 5e-3


@pytest.mark.gpu
def test_gpu_planner_routes_a_long_sequence_among_short_ones():
    # An engine's packed batch: one long sequence with few heads among short ones is planned per
    # call (the long one cut); a batch of short ones runs in one piece; the routed call against
    # one piece as in the test above.
    if torch.cuda.get_device_properties(0).multi_processor_count < 100:
        pytest.skip("the planner's costs are the H200's (132 SMs)")
    kw = make_kw(17, lens=[131072, 2048, 2048], H=4, HV=4, K=128, dtype=torch.bfloat16, device="cuda")
    kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
    short = make_kw(17, lens=[8192] * 17, H=4, HV=4, K=128, dtype=torch.bfloat16, device="cuda")
    short["cu_seqlens_cpu"] = short["cu_seqlens"].cpu()
    label = rt.route_of(**kw)
    assert label is not None and label.startswith("scan correct x"), label
    assert rt.route_of(**short) is None
    spy_calls = []
    real = engine.scan_prefill
    with pytest.MonkeyPatch.context() as m:
        m.setattr(engine, "scan_prefill", lambda *a, **k: spy_calls.append(k["segments"]) or real(*a, **k))
        routed = kdagen.kda_prefill(**kw)
        kdagen.kda_prefill(**short)
        # the engine's usual call: offsets on the device only (read once, then planned the same)
        dev_only = {n: t for n, t in kw.items() if n != "cu_seqlens_cpu"}
        assert rt.route_of(**dev_only) == label
        routed_dev = kdagen.kda_prefill(**dev_only)
        m.setenv("KDAGEN_SCAN", "0")
        one = kdagen.kda_prefill(**kw)
    assert spy_calls == [None, None]
    assert rel_rmse(routed[0], one[0]) < 5e-3 and rel_rmse(routed[1], one[1]) < 5e-3
    assert torch.equal(routed_dev[0], routed[0]) and torch.equal(routed_dev[1], routed[1])

