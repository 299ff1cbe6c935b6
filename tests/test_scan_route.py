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
    monkeypatch.delenv("KDAGEN_SCAN", raising=False)
    monkeypatch.delenv("KDAGEN_FORCE_VARIANT", raising=False)


LONG = CallInfo(device=torch.device("cuda"), dtype="bf16", layout="bsnd", B=1, T=32768, N=1, H=8, HV=8, K=128,
                V=128, gate="bounded", state="fp32", varlen=False, chunk_size=None, max_len=32768,
                cu_seqlens_host=None)


def test_offered_signatures(monkeypatch):
    assert route.offered(LONG, "sm80", {})
    assert route.offered(replace(LONG, B=2, N=2), "sm80", {})
    assert route.offered(replace(LONG, varlen=True), "sm80", {"cu_seqlens_cpu": object()})
    # checkpoints' sparse chunk states ride along
    assert route.offered(LONG, "sm80", {"return_chunk_states": route.CS_MIN_SPACING // 16, "chunk_size": 16})
    refused = {
        "sm90 one piece": (LONG, "sm90", {}),
        "cpu": (replace(LONG, device=torch.device("cpu")), "sm80", {}),
        "fp16": (replace(LONG, dtype="fp16"), "sm80", {}),
        "K != V": (replace(LONG, V=64), "sm80", {}),
        "varlen, 2 sequences": (replace(LONG, varlen=True, N=2), "sm80", {}),
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
