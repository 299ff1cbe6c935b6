"""The three-step scan composed of kda_prefill calls (kdagen/scan/engine.py).

The plumbing (layouts, batched/varlen, state layouts and dtypes, chunk states, caller buffers,
modes) runs on the float64 chunked reference as the composed prefill (fast); the real kernels
run through kdagen.kda_prefill on the Triton interpreter (few tiny cases: it is slow on CPU),
and on a GPU the same cases with `pytest -m gpu`.
"""

from __future__ import annotations

import inspect

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
    # the correct step's torch form (where its Triton kernels do not run: no GPU or interpreter, K
    # not a power of two, states not fp32)
    ("varlen-bnsd-kv-c64-correct-torch", dict(lens=[200, 65], layout="BNSD", state_layout="KV"), 64, [3, 2],
     "correct"),
    ("batched-gqa-c16-correct-torch", dict(B=2, T=90, H=1, HV=2), 16, 4, "correct"),
], ids=lambda c: c[0])
def test_scheme_on_the_reference_engine(case, monkeypatch):
    # fp32 inputs: the scheme must equal the float64 recurrence to fp32 rounding.
    import kdagen.scan.engine as engine

    _, pk, C, segs, mode = case
    if case[0].endswith("-torch"):
        monkeypatch.setattr(engine, "correct_o_fits", lambda *a: False)
        monkeypatch.setattr(engine, "correct_cs_fits", lambda *a: False)
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


def reference_twins(q, k, v, g, beta, *, initial_state, return_chunk_states=False, **kw):
    """kdagen.runtime.kda_prefill_twins' contract on the float64 reference: heads [:HV] run from
    initial_state[:, :HV], heads [HV:] with v = 0 from initial_state[:, HV:]; outputs concatenated
    along the heads."""
    HV = initial_state.shape[1] // 2
    kw = dict(kw, output_final_state=True, return_chunk_states=return_chunk_states)
    rb = reference_prefill(q, k, v, g, beta, initial_state=initial_state[:, :HV], **kw)
    ra = reference_prefill(q, k, torch.zeros_like(v), g, beta, initial_state=initial_state[:, HV:], **kw)
    return tuple(torch.cat([b, a], dim=2 if i == 0 else 1) for i, (b, a) in enumerate(zip(rb, ra)))


@pytest.mark.parametrize("mode", ["rerun", "correct"])
def test_twin_launch_serves_step_one(monkeypatch, mode):
    # Where the runtime runs both maps in one launch (sm80), step 1 makes no prefill call and reads
    # B's and A's results from the launch's head halves (o_B, o_A as strided views).
    import kdagen.scan.engine as engine

    twins = []
    monkeypatch.setattr(engine, "_twins_of", lambda prefill: lambda *a, **kw: twins.append(kw) or
                        reference_twins(*a, **kw))
    kw = make_kw(11, lens=[150, 7, 70], H=1, HV=2)
    spy = Spy()
    out = scan_prefill(**kw, chunk_size=16, return_chunk_states=True, segments=[4, 1, 3], mode=mode, prefill=spy)
    check(out, kw, 16, 1e-5)
    assert len(twins) == 1 and twins[0]["initial_state"].shape == (8, 4, 16, 16)
    assert len(spy.calls) == (1 if mode == "rerun" else 0)


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


def test_whole_signatures_skip_validation_and_planning(monkeypatch):
    # segments=None remembers the signatures it left whole: the next such call goes straight to
    # the prefill (which validates), with no scan validation or planning. Another signature (here
    # other host offsets) is validated and planned again; a bad call is still named.
    from kdagen.scan import engine as E

    E._WHOLE.clear()
    seen = []
    real = E.validate
    monkeypatch.setattr(E, "validate", lambda *a, **k: seen.append(1) or real(*a, **k))
    var = make_kw(6, lens=[40, 24])
    var["cu_seqlens_cpu"] = var["cu_seqlens"].clone()
    spy = Spy()  # the prefill is part of the signature
    for i in range(3):
        out = scan_prefill(**var, prefill=spy)
        assert len(spy.calls) == i + 1
        check(out, {n: x for n, x in var.items() if n != "cu_seqlens_cpu"}, None, 1e-5)
    assert len(seen) == 1 and len(E._WHOLE) == 1
    other = make_kw(6, lens=[24, 40])
    other["cu_seqlens_cpu"] = other["cu_seqlens"].clone()
    scan_prefill(**other, prefill=spy)
    assert len(seen) == 2 and len(E._WHOLE) == 2
    # device offsets alone: no key (the offsets are not read to make one), validated every call
    scan_prefill(**make_kw(6, lens=[40, 24]), prefill=spy)
    scan_prefill(**make_kw(6, lens=[40, 24]), prefill=spy)
    assert len(seen) == 4
    with pytest.raises(KdaInputError, match="mode: expected 'rerun' or 'correct'"):
        scan_prefill(**var, mode="fast", prefill=Spy())


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
    out = scan_prefill(**kw, chunk_size=16, return_chunk_states=True, segments=[3, 1, 1, 2], mode="rerun")
    check(out, kw, 16, 1e-5)
    assert inspect.signature(scan_prefill).parameters["mode"].default == "correct"  # the route's and cp's mode


def _strided(cs, lens, C, m):
    """Rows 0, m, 2m, ... of each sequence's every-chunk states."""
    keep, at = [], 0
    for L in lens:
        keep += range(at, at + -(-L // C), m)
        at += -(-L // C)
    return cs[keep]


@pytest.mark.parametrize("mode", ["rerun", "correct"])
def test_chunk_state_stride_cuts_segments_on_its_grid(mode):
    # return_chunk_states=m: segments start on multiples of C m tokens of their sequence, so each
    # keeps the sequence's own rows; the reference engine keeps them alike (one piece)
    lens = [300, 7, 0, 130]
    kw = make_kw(12, lens=lens)
    _, _, every = reference_prefill(**kw, chunk_size=16, return_chunk_states=True)
    one = reference_prefill(**kw, chunk_size=16, return_chunk_states=3)
    assert torch.equal(one[2], _strided(every, lens, 16, 3))
    buf = torch.full((sum(-(-n // 48) for n in lens), *one[2].shape[1:]), float("nan"))
    out = scan_prefill(**kw, chunk_size=16, return_chunk_states=3, chunk_states=buf, segments=[4, 1, 1, 2], mode=mode,
                       prefill=reference_prefill)
    assert out[2] is buf
    for a, b in zip(out, one):
        assert rel_rmse(a, b) < 1e-5


@pytest.mark.parametrize("dev", DEVICES)
def test_kernels_chunk_state_stride(dev):
    # the correct mode's chunk states B_c + S_in A_c at every 2nd chunk of 16, segments cut on 32
    lens = [150, 5, 70]
    kw = make_kw(13, lens=lens, K=32, device=dev)
    out = scan_prefill(**kw, chunk_size=16, return_chunk_states=2, segments=[3, 1, 2], mode="correct")
    ro, rs, rc = reference(kw, 16)
    assert out[2].shape[0] == sum(-(-n // 32) for n in lens)
    assert rel_rmse(out[2].cpu(), _strided(rc, lens, 16, 2)) < 1e-5
    assert rel_rmse(out[0].cpu(), ro) < 1e-5 and rel_rmse(out[1].cpu(), rs) < 1e-5


@pytest.mark.parametrize("mode", ["rerun", "correct"])
@pytest.mark.parametrize("dev", DEVICES)
def test_kernels_beta_probabilities(dev, mode):
    # beta_is_logit=False reaches every call of the scan (maps, transitions, rerun), b up to 1.5
    kw = make_kw(11, lens=[70, 30], K=32, device=dev)
    kw.update(beta=1.5 * torch.sigmoid(kw["beta"]), beta_is_logit=False)
    out = scan_prefill(**kw, chunk_size=16, segments=[3, 2], mode=mode)
    check(out, kw, None, 1e-5)


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
    out = scan_prefill(**kw, chunk_size=16, segments=2, mode="rerun")
    check(out, kw, None, 5e-3)


def twin_problem(seed, dev, K=32, **shape):
    kw = make_kw(seed, H=1, HV=2, K=K, device=dev, **shape)
    if "cu_seqlens" in kw:
        kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
    kw.pop("output_final_state")
    h0 = kw.pop("initial_state")
    hA = torch.randn(h0.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dev)
    return kw, h0, torch.cat([h0, hA], dim=1)


def test_twin_launch_is_declined_without_one_and_bad_state_is_named():
    from kdagen.runtime import kda_prefill_twins

    kw, h0, h2 = twin_problem(12, "cuda" if HAS_CUDA else "cpu", lens=[40, 30])
    # K = 32 runs on the Triton target (no twin launch): the caller is told to make two calls
    assert kda_prefill_twins(**kw, initial_state=h2, chunk_size=16, return_chunk_states=True) is None
    with pytest.raises(KdaInputError, match=r"initial_state: expected a contiguous float32 \[N, 4, V, K\] tensor "
                                            r"\(both runs' heads\), found torch.float32 \[2, 2, 32, 32\]"):
        kda_prefill_twins(**kw, initial_state=h0)
    with pytest.raises(TypeError, match="unexpected keyword argument\\(s\\) out"):
        kda_prefill_twins(**kw, initial_state=h2, out=torch.empty_like(kw["v"]))


@pytest.mark.gpu
@pytest.mark.parametrize("variant,shape", [
    ("kda_fwd_sm80_c16_k128_v128_bf16_gb_sfp32_bv16", dict(lens=[1000, 37, 0, 2048])),
    ("kda_fwd_sm80_c16_k128_v128_bf16_gb_sfp32_bv64", dict(lens=[300, 129])),
    ("kda_fwd_sm80_c64_k128_v128_bf16_gb_sfp32_bv32", dict(B=2, T=333, layout="BNSD")),
    ("kda_fwd_sm80_c16_k256_v256_bf16_gb_sfp32_bv32", dict(lens=[200, 77])),
    # the precise record: U0 = P v in the recurrence, whose twin heads must not read v (one and two warps per V tile)
    ("kda_fwd_sm80_c16_k128_v128_bf16_gb_sfp32_bv32_hl", dict(lens=[1000, 37, 0, 2048])),
    ("kda_fwd_sm80_c16_k64_v64_bf16_gb_sfp32_bv32_hl", dict(B=2, T=333, layout="BNSD")),
], ids=lambda x: x if isinstance(x, str) else None)
def test_gpu_twin_launch_equals_two_calls(variant, shape):
    # One prep, twice the recurrence's heads: heads [:HV] must be kda_prefill from h0 bit for bit,
    # heads [HV:] kda_prefill with v = 0 from the second state (a random one: any state, not only
    # the identity), for o, final states and chunk states.
    from kdagen.runtime import kda_prefill_twins

    K = int(variant.split("_k")[1].split("_")[0])
    C = int(variant.split("_c")[1].split("_")[0])
    kw, h0, h2 = twin_problem(13, "cuda", K=K, dtype=torch.bfloat16, **shape)
    kw.update(variant=variant, chunk_size=C, return_chunk_states=True)
    torch.full((1 << 26,), math.nan, device="cuda")  # freed at once: the outputs below likely reuse it
    res = kda_prefill_twins(**kw, initial_state=h2)
    assert res is not None, f"{variant} declined the twin launch"
    b = kdagen.kda_prefill(**kw, initial_state=h0, output_final_state=True)
    a = kdagen.kda_prefill(**dict(kw, v=torch.zeros_like(kw["v"])), initial_state=h2[:, 2:].contiguous(),
                           output_final_state=True)
    hd = 2 if kw["layout"] == "BSND" else 1
    assert torch.equal(res[0].narrow(hd, 0, 2), b[0]) and torch.equal(res[0].narrow(hd, 2, 2), a[0])
    for i in (1, 2):
        assert torch.equal(res[i][:, :2], b[i]) and torch.equal(res[i][:, 2:], a[i]), i
    assert b[0].abs().max() > 0 and a[0].abs().max() > 0 and not torch.equal(b[1], a[1])
    # The first call bound the signature's launch; later calls take it (no checks, no struct
    # building) and must give the same bits on fresh (poisoned) outputs and moved inputs.
    from kdagen import runtime as rt

    plan = next(p for p in rt._PLANS.values()
                if getattr(p, "twins_fast", rt._UNBOUND) is not rt._UNBOUND and p.entry.name == variant)
    assert type(plan.twins_fast).__name__ == "Sm80Bound" and plan.twins_fast.recur_name == "kda_recur_twins"
    for _ in range(2):
        torch.full((1 << 26,), math.nan, device="cuda")
        moved = {n: (t.clone() if isinstance(t, torch.Tensor) and n in ("q", "k", "v") else t) for n, t in kw.items()}
        again = kda_prefill_twins(**moved, initial_state=h2.clone())
        for x, y in zip(again, res):
            assert torch.equal(x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["rerun", "correct"])
@pytest.mark.parametrize("T,segs", [(8192, 7), (65536, 16)])
def test_gpu_long_sequence_against_one_piece(T, segs, mode):
    # bf16, D = 128, gates that barely decay; the scan against the one-piece call and the
    # float64 reference of a shorter prefix is too slow here: the one-piece call is the check.
    kw = make_kw(9, B=1, T=T, H=2, HV=2, K=128, dtype=torch.bfloat16, device="cuda")
    one = kdagen.kda_prefill(**kw)
    out = scan_prefill(**kw, segments=segs, mode=mode)
    assert rel_rmse(out[0], one[0]) < 5e-3 and rel_rmse(out[1], one[1]) < 5e-3


@pytest.mark.gpu
def test_gpu_scan_launch_asks_the_runtime_and_never_builds(monkeypatch):
    # What the planner prices a cut with: the block_v and resident blocks of the variant the
    # scan's calls would select (sm80: both recurrences), or False for another target. Where that
    # variant is not built the answer is "not known" (None), and nothing is built to find out.
    from kdagen import runtime
    from kdagen.registry import Registry
    from kdagen.scan.engine import scan_launch, validate
    from kdagen.scan.layout import split
    from kdagen.scan.planner import ScanLaunch

    kw = make_kw(9, T=8192, H=4, HV=4, K=128, dtype=torch.bfloat16, device="cuda")
    info, cu = validate(**kw)
    got = scan_launch(info, split(cu, [4], 64))
    if got is False:
        pytest.skip("the scan's calls select a variant without the sm80 recurrence here")
    assert isinstance(got, ScanLaunch) and got.block_v in (16, 32, 64)
    assert 1 <= got.resident <= 4 and 1 <= got.resident_twins <= 4, got

    def no_build(self, entry):
        raise AssertionError(f"pricing built {entry.name}")

    reg = runtime.registry()
    monkeypatch.setattr(Registry, "_artifact", no_build)
    monkeypatch.setattr(reg, "_launchers", {})
    monkeypatch.setattr(reg, "status", lambda name: ("build", None))
    assert scan_launch(info, split(cu, [4], 64)) is None


@pytest.mark.gpu
def test_gpu_planner_splits_a_long_few_head_call_per_mode():
    # B1 T131072 H4 on the H200: the scan measured 1.74 ms ("correct", 8 segments) and 2.49
    # ("rerun") against 3.93 in one piece (2026-12-04_s33_h200_scan_host.md): segments=None
    # splits in both modes; T2048 H8 (0.45 against 0.11) stays whole.
    from kdagen.scan.engine import planned_segments, validate

    for T, H, split_expected in ((131072, 4, True), (2048, 8, False)):
        kw = make_kw(10, T=T, H=H, HV=H, K=128, dtype=torch.bfloat16, device="cuda")
        info, cu = validate(**kw)
        for mode in ("correct", "rerun"):
            segs = planned_segments(info, cu, mode=mode)
            assert (max(segs) > 1) == split_expected, (T, H, mode, segs)


def test_device_ints_are_cached_by_value_and_read_only_views_are_shared():
    from kdagen.scan.layout import device_ints

    a = device_ints([0, 64, 130], "cpu")
    assert a.dtype == torch.int32 and a.tolist() == [0, 64, 130]
    assert device_ints((0, 64, 130), "cpu") is a  # the same values: the same tensor, no new copy
    assert device_ints([0, 64, 131], "cpu") is not a
    b = device_ints([0, 64, 130], "cpu", torch.long)
    assert b is not a and b.dtype == torch.long


@pytest.mark.gpu
def test_gpu_device_ints_one_copy_per_stream_and_a_scan_on_a_side_stream():
    # A cached copy is queued on the stream that first asked; another stream gets its own, so it
    # never reads one still in flight. The scan on a side stream must then equal the main one's.
    from kdagen.scan.layout import device_ints

    vals = list(range(0, 4096 * 7, 64))
    main = device_ints(vals, "cuda")
    assert device_ints(vals, torch.device("cuda", torch.cuda.current_device())) is main
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        other = device_ints(vals, "cuda")
        assert other is not main and other.data_ptr() != main.data_ptr()
        assert device_ints(vals, "cuda") is other
    torch.cuda.synchronize()
    assert other.tolist() == vals and main.tolist() == vals

    kw = make_kw(21, B=1, T=8192, H=2, HV=2, K=128, dtype=torch.bfloat16, device="cuda")
    ref = scan_prefill(**kw, segments=4, mode="correct")
    torch.cuda.synchronize()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.full((1 << 24,), math.nan, device="cuda")  # freed at once: the outputs likely reuse it
        out = scan_prefill(**kw, segments=4, mode="correct")
    torch.cuda.synchronize()
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@pytest.mark.gpu
@pytest.mark.parametrize("mode,segments,T,H", [("correct", 4, 8192, 2), ("rerun", 4, 8192, 2),
                                               ("correct", None, 131072, 4)])
def test_gpu_direct_scan_under_capture_replays_new_values(mode, segments, T, H):
    # A direct scan_prefill on a fixed dense batch plans its cut on the host from shapes alone, so
    # a captured call must replay new values into caller buffers exactly as an eager scan computes
    # them (same cut, same kernels: same bits). segments=None asks the planner inside the capture.
    from .cuda_graphs import capture

    kw = make_kw(23, B=1, T=T, H=H, HV=H, K=128, dtype=torch.bfloat16, device="cuda")
    kw.pop("output_final_state")
    out, fs = torch.empty_like(kw["v"]), torch.empty_like(kw["initial_state"])
    graph = capture(lambda: scan_prefill(**kw, segments=segments, mode=mode, out=out, final_state=fs))
    for seed in (24, 25):
        new = make_kw(seed, B=1, T=T, H=H, HV=H, K=128, dtype=torch.bfloat16, device="cuda")
        for n, t in kw.items():
            if isinstance(t, torch.Tensor):
                t.copy_(new[n])
        out.fill_(math.nan)
        fs.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        want = scan_prefill(**kw, segments=segments, mode=mode, output_final_state=True)
        assert torch.equal(out, want[0]) and torch.equal(fs, want[1]), seed
        one = kdagen.kda_prefill(**kw, output_final_state=True)
        assert rel_rmse(out, one[0]) < 5e-3 and rel_rmse(fs, one[1]) < 5e-3, seed
