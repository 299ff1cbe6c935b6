"""The host fast path: a plan per call signature (validated and selected once), caller-owned
outputs and workspace, host offsets never read from the device when the caller gives them or
promises valid input, and the sm80 bound launch passing the kernels exactly the parameter
struct the general path builds (checked on the CPU with a recording stand-in for the driver)."""

from __future__ import annotations


import pytest
import torch

import kdagen
import kdagen.runtime as rt
from kdagen.reference import kda_reference, rel_rmse
from kdagen_dev.launch import bound_args

from .runtime_env import fresh_runtime  # noqa: F401
from . import fake_cuda
from .fake_cuda import sm80_on_cpu
from .test_runtime_errors import inputs



def _ref(kw, **extra):
    ref = {n: t for n, t in {**kw, **extra}.items() if n in (
        "q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "output_final_state", "cu_seqlens", "layout",
        "state_layout", "lower_bound", "gate")}
    return kda_reference(**ref)


def test_a_repeated_signature_is_validated_and_selected_once(monkeypatch):
    kw = inputs()
    o1, _ = kdagen.kda_prefill(**kw)
    assert len(rt._PLANS) == 1
    calls = []

    def validated(*a, **k):
        calls.append("validated")
        raise RuntimeError("validated")

    monkeypatch.setattr(rt, "check_signature", validated)
    monkeypatch.setattr(rt, "_dispatch", validated)
    kw2 = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    kw2["q"].mul_(0.5)  # new values, same signature
    o2, _ = kdagen.kda_prefill(**kw2)
    assert calls == [] and len(rt._PLANS) == 1
    assert rel_rmse(o2, _ref(kw2)[0]) < 1e-5 and not torch.equal(o1, o2)
    # another signature (shape) is a new plan: it validates and selects
    with pytest.raises(RuntimeError, match="validated"):
        kdagen.kda_prefill(**inputs(T=21))
    assert calls == ["validated"]


def test_outputs_written_in_place_into_poisoned_buffers():
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    kw = dict(inputs(), initial_state=torch.randn(2, 2, 32, 32), cu_seqlens=cu, chunk_size=16)
    bufs = rt.allocate_outputs(**kw, output_final_state=True, return_chunk_states=True, fill=float("nan"))
    assert [tuple(b.shape) for b in bufs.values()] == [(1, 20, 2, 32), (2, 2, 32, 32), (2, 2, 32, 32)]
    ptrs = {n: b.data_ptr() for n, b in bufs.items()}
    o, st, cs = kdagen.kda_prefill(**kw, **bufs)  # final_state= / chunk_states= imply the outputs
    assert {"out": o.data_ptr(), "final_state": st.data_ptr(), "chunk_states": cs.data_ptr()} == ptrs
    assert all(torch.isfinite(t).all() for t in (o, st, cs))
    ro, rs, rc = kda_reference(**{n: kw[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias",
                                                     "initial_state", "cu_seqlens")},
                               output_final_state=True, chunk_states_size=16)
    assert rel_rmse(o, ro) < 1e-5 and rel_rmse(st, rs) < 1e-5 and rel_rmse(cs, rc) < 1e-5


def test_host_offsets_are_never_read_from_cu_seqlens_when_given_or_promised(monkeypatch):
    kw = inputs()
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    want, _ = kdagen.kda_prefill(**kw, cu_seqlens=cu)
    reads = []
    real = torch.Tensor.tolist

    def spy(t):
        reads.append(t.data_ptr())
        return real(t)

    monkeypatch.setattr(torch.Tensor, "tolist", spy)
    cpu = cu.clone()
    for _ in range(2):
        o1, _ = kdagen.kda_prefill(**kw, cu_seqlens=cu, cu_seqlens_cpu=cpu)
        o2, _ = kdagen.kda_prefill(**kw, cu_seqlens=cu, assume_valid=True)
    assert cu.data_ptr() not in reads and cpu.data_ptr() in reads
    assert torch.equal(o1, want) and torch.equal(o2, want)
    kdagen.kda_prefill(**kw, cu_seqlens=cu)  # neither: the offsets are read (validated)
    assert cu.data_ptr() in reads


def test_bad_host_offsets_are_caught_on_a_cached_signature():
    kw = inputs()
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    kdagen.kda_prefill(**kw, cu_seqlens=cu, cu_seqlens_cpu=cu)
    with pytest.raises(kdagen.runtime.KdaInputError, match="cu_seqlens: expected non-decreasing offsets from 0 to "
                                                           r"T=20, found \[0, 9, 7\]"):
        kdagen.kda_prefill(**kw, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 9, 7], dtype=torch.int32))


def test_workspace_size_and_a_caller_workspace():
    kw = inputs()
    assert kdagen.workspace_size(**kw) == 0  # the Triton variants take none
    o1, _ = kdagen.kda_prefill(**kw)
    o2, _ = kdagen.kda_prefill(**kw, workspace=torch.empty(16, dtype=torch.uint8))
    assert torch.equal(o1, o2)


def test_plan_uses_the_launchers_bound_launch_after_the_first_call(monkeypatch):
    kw = inputs()
    kdagen.kda_prefill(**kw)
    plan = next(iter(rt._PLANS.values()))
    log = []

    class Bound:
        def launch(self, q, k, v, g, beta, o, A, dt, cu, h0, ht, hc, co, ws, max_len):
            log.append(("fast", q.data_ptr(), o.shape, max_len))
            o.fill_(1.0)
            return True

    class Launcher:
        def __call__(self, call):
            log.append(("general", call.q.data_ptr()))
            call.o.fill_(2.0)

        def bind(self, call):
            log.append(("bind", call.T))
            return Bound()

    plan.launcher, plan.fast = Launcher(), rt._UNBOUND
    o1, _ = kdagen.kda_prefill(**kw)
    o2, _ = kdagen.kda_prefill(**kw)
    q = kw["q"].data_ptr()
    assert log == [("general", q), ("bind", 20), ("fast", q, torch.Size([1, 20, 2, 32]), 20)]
    assert (o1 == 2).all() and (o2 == 1).all()


def test_beta_probabilities_reach_the_kernel_as_given(monkeypatch):
    """beta_is_logit=False: the launcher gets the caller's beta tensor itself with beta_mode 2
    (no logit pass on the host), on its own plan; b above 1 is used as given, allow_neg_eigval
    changes nothing, and b = sigmoid(x) gives the logit call's result."""
    kw = inputs()
    b = torch.sigmoid(kw["beta"])
    want, _ = kdagen.kda_prefill(**kw)
    seen = []
    real = rt.Plan._kda_call
    monkeypatch.setattr(rt.Plan, "_kda_call", lambda self, *a, **k: seen.append(real(self, *a, **k)) or seen[-1])
    got, _ = kdagen.kda_prefill(**dict(kw, beta=b), beta_is_logit=False)
    assert seen and seen[-1].beta is b and seen[-1].beta_mode == 2 and len(rt._PLANS) == 2
    assert rel_rmse(got, want) < 1e-6
    monkeypatch.undo()
    b2 = 1.8 * b  # some of it above 1: a coefficient no logit call reaches without allow_neg_eigval
    o1, _ = kdagen.kda_prefill(**dict(kw, beta=b2), beta_is_logit=False)
    o2, _ = kdagen.kda_prefill(**dict(kw, beta=b2), beta_is_logit=False, allow_neg_eigval=True)
    ro, _, _ = kda_reference(**dict(kw, beta=b2), beta_is_logit=False)
    assert torch.equal(o1, o2) and rel_rmse(o1, ro) < 1e-5
    assert rel_rmse(ro, kda_reference(**dict(kw, beta=b))[0]) > 1e-2  # the coefficient matters


# ----------------------------------------------------------------------------- the sm80 bound launch

def _call_of(q, k, v, g, beta, A_log, dt_bias, h0, *, cu, max_len: int, ws=None, cs=None, co=None) -> rt.KdaCall:
    """A KdaCall of [B, T, heads, K] tensors for the stand-in driver's tests: fresh o and final
    state, scale 0.125, the bounded gate at -5, L2 norm in the kernel, state V x K."""
    st = lambda x: (x.stride(0), x.stride(1), x.stride(2))  # noqa: E731
    o, fs = torch.empty_like(v), torch.empty_like(h0)
    (B, T, H, K), HV = q.shape, v.shape[2]
    return rt.KdaCall(q=q, k=k, v=v, g=g, beta=beta, o=o, q_strides=st(q), k_strides=st(k), v_strides=st(v),
                      g_strides=st(g), beta_strides=st(beta.unsqueeze(-1)), o_strides=st(o), B=B, T=T,
                      N=h0.shape[0], H=H, HV=HV, K=K, V=K, cu_seqlens=cu, A_log=A_log, dt_bias=dt_bias, scale=0.125,
                      lower_bound=-5.0, use_qk_l2norm=True, allow_neg_eigval=False, initial_state=h0, final_state=fs,
                      state_kv=False, chunk_states=cs, chunk_offsets=co, max_len=max_len, workspace=ws)


class _FakeStream:
    """A torch stream stand-in whose event records and waits go to the driver's record."""

    def __init__(self, drv, raw: int) -> None:
        self.drv, self.cuda_stream = drv, raw

    def wait_event(self, ev) -> None:
        self.drv.launches.append(("wait", self.cuda_stream, ev.stream))


class _FakeEvent:
    def __init__(self, *a, **kw) -> None:
        self.stream = None

    def record(self, stream) -> None:
        self.stream = stream.cuda_stream
        stream.drv.launches.append(("record", stream.cuda_stream))


def _segment_300_tokens(la, drv, monkeypatch) -> None:
    """The stand-in sm80 launcher cuts 300 tokens into segments of 128, 128 and 44, its side
    stream's event records and waits going to the driver's record."""
    import dataclasses

    la.settings = dataclasses.replace(la.settings, min_segment_tokens=64, min_hidden_prep_us=None,
                                      prep_blocks_beside_recur=None)
    main = _FakeStream(drv, fake_cuda.STREAM)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream(drv, 9))
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)


@pytest.mark.parametrize("chunks", [False, True], ids=["no-chunk-states", "chunk-states-every-4th"])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "one-varlen-sequence"])
def test_sm80_segmented_bound_launch_passes_the_general_paths_launches(monkeypatch, varlen, chunks):
    """A time-segmented signature's bound launch (Sm80SegmentedBound) against the general segmented
    path on the same tensors and caller workspace: the same kernels, grids, streams, event records
    and waits in the same order, and every byte of every segment's struct; with chunk states
    (every 4th chunk of 16: a row per 64 tokens), each segment's pointer at its first row."""
    import dataclasses

    import kdagen.targets.sm80 as sm80

    T, H, HV, K = 300, 1, 2, 64
    B, N = (1, 1) if varlen else (2, 2)
    gen = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    t = dict(q=r(B, T, H, K).bfloat16(), k=r(B, T, H, K).bfloat16(), v=r(B, T, HV, K).bfloat16(),
             g=r(B, T, HV, K), beta=r(B, T, HV), A_log=r(HV), dt_bias=r(HV, K), h0=r(N, HV, K, K))
    cu = torch.tensor([0, T], dtype=torch.int32) if varlen else None
    with sm80_on_cpu() as (la, drv):
        _segment_300_tokens(la, drv, monkeypatch)

        R = -(-T // 64)  # chunk-state rows a sequence: 5
        cs = torch.empty(N * R, HV, K, K) if chunks else None
        co = torch.arange(0, (N + 1) * R, R, dtype=torch.int32) if chunks else None

        def call_of(ws):
            return dataclasses.replace(_call_of(**t, cu=cu, max_len=T, ws=ws, cs=cs, co=co),
                                       chunk_stride=4 if chunks else 1)

        need = la.workspace_bytes(call_of(None), torch.device("cpu"))
        ws = torch.empty(need + 512, dtype=torch.uint8)
        ws = ws[(-ws.data_ptr()) % 256:][:need]
        c = call_of(ws)
        la(c)
        assert la.last_segments == 3
        general = drv.launches[:]
        bound = la.bind(c)
        assert isinstance(bound, sm80.Sm80SegmentedBound), bound
        drv.launches.clear()
        assert bound.launch(c.q, c.k, c.v, c.g, c.beta, c.o, c.A_log, c.dt_bias, cu, c.initial_state,
                            c.final_state, cs, co, ws, T)
        assert drv.launches == general
        kinds = [x[0] for x in general]
        assert kinds[:2] == ["record", "wait"] and kinds.count("kda_prep") == kinds.count("kda_recur") == 3
        # every segment's inputs start at its first token; the varlen offsets are not read
        from kdagen.targets.cuda_launch import KdaParams

        preps = [KdaParams.from_buffer_copy(x[5]) for x in general if x[0] == "kda_prep"]
        assert [p.q - c.q.data_ptr() for p in preps] == [a * c.q_strides[1] * 2 for a in (0, 128, 256)]
        assert [p.T for p in preps] == [128, 128, 44] and all(p.cu_seqlens == 0 for p in preps)
        # chunk states: rows 0, 2, 4 of every sequence (its rows start at chunk_offsets[n])
        row = HV * K * K * 4
        assert [p.hc for p in preps] == ([cs.data_ptr() + i * row for i in (0, 2, 4)] if chunks else [0] * 3)
        assert [p.chunk_offsets for p in preps] == [co.data_ptr() if chunks else 0] * 3
        assert all(p.chunk_stride == (4 if chunks else 1) for p in preps)
        # a caller workspace a byte short: declined (the general path then runs in one piece)
        drv.launches.clear()
        assert not bound.launch(c.q, c.k, c.v, c.g, c.beta, c.o, c.A_log, c.dt_bias, cu, c.initial_state,
                                c.final_state, cs, co, ws[:-1], T)
        assert drv.launches == []
        la(call_of(ws[:-1]))
        assert la.last_segments == 0
        # a refused launch is named and declines: the general path reruns the whole call
        drv.launches.clear()
        drv.fail("kda_recur", 1, 700)
        assert not bound.launch(c.q, c.k, c.v, c.g, c.beta, c.o, c.A_log, c.dt_bias, cu, c.initial_state,
                                c.final_state, cs, co, ws, T)
        assert bound.last_failure.startswith("cuLaunchKernel(kda_recur, grid=(2, %d, 2), block=(160, 1, 1), "
                                             "smem=6000) failed: CUresult 700" % N), bound.last_failure



@pytest.mark.parametrize("shim", [False, True], ids=["bindings", "shim"])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_sm80_bound_launch_passes_the_general_paths_struct(varlen, shim):
    """Through cuda-bindings' cuLaunchKernel or the launch shim (compiled here, over a C stand-in
    for libcuda that records what the C ABI passed): the general path's launches, byte for byte."""
    with sm80_on_cpu(shim=shim) as (la, drv):
        _bound_against_general(la, drv, varlen)


def _bound_against_general(la, drv, varlen):
    import kdagen.targets.sm80 as sm80
    from kdagen.targets.cuda_launch import KdaParams

    rec = fake_cuda.META[0]
    T, H, HV, K = 48, 2, 4, 64
    lens = [5, 0, 43] if varlen else None

    def make(seed):
        gen = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
        N = len(lens) if varlen else 2
        B = 1 if varlen else 2
        cu = torch.tensor([0, 5, 5, 48], dtype=torch.int32) if varlen else None
        t = dict(q=r(B, T, H, K).bfloat16(), k=r(B, T, H, K).bfloat16(), v=r(B, T, HV, K).bfloat16(),
                 g=r(B, T, HV, K), beta=r(B, T, HV), A_log=r(HV), dt_bias=r(HV, K), cu_seqlens=cu,
                 initial_state=r(N, HV, K, K), output_final_state=True)
        return t, B, N

    def call_of(t, B, N, ws):
        return _call_of(t["q"], t["k"], t["v"], t["g"], t["beta"], t["A_log"], t["dt_bias"], t["initial_state"],
                        cu=t["cu_seqlens"], max_len=43 if varlen else T, ws=ws)

    t, B, N = make(0)
    ws_bytes = ((B * T) // 16 + N + 1) * HV * rec
    ws = torch.empty(ws_bytes + 512, dtype=torch.uint8)
    ws = ws[(-ws.data_ptr()) % 256:][:ws_bytes]  # a 256-byte aligned caller workspace
    bound = la.bind(call_of(t, B, N, ws))
    assert bound is not None and bound.ws_bytes == ws_bytes
    assert ("through the launch shim" in bound.launch_path) == (drv.clib is not None), bound.launch_path
    assert la.workspace_bytes(call_of(t, B, N, None), torch.device("cpu")) == ws_bytes
    t2, _, _ = make(1)  # other tensors, same signature
    c2 = call_of(t2, B, N, ws)
    la(c2)
    general = drv.launches[:]
    drv.launches.clear()
    assert bound.launch(c2.q, c2.k, c2.v, c2.g, c2.beta, c2.o, c2.A_log, c2.dt_bias, c2.cu_seqlens, c2.initial_state,
                        c2.final_state, None, None, ws, c2.max_len)
    assert drv.launches == general  # kernels, grids, blocks, shared memory, stream, every byte of the struct
    assert [x[1] for x in general] == [(3, N, HV), (2, N, HV)]  # ceil(43 or 48 / 16) chunks; V / block_v
    p = KdaParams.from_buffer_copy(general[0][5])
    assert (p.q, p.o, p.ws, p.max_len, p.T, p.N) == (c2.q.data_ptr(), c2.o.data_ptr(), ws.data_ptr(),
                                                     43 if varlen else T, T, N)
    # an unaligned input is not the bound launch's job: it declines (launching nothing), the
    # general path copies it
    drv.launches.clear()
    q_off = torch.empty(c2.q.numel() + 8, dtype=c2.q.dtype)[1:1 + c2.q.numel()].view(c2.q.shape)
    assert q_off.data_ptr() % 16 and not bound.launch(q_off, c2.k, c2.v, c2.g, c2.beta, c2.o, c2.A_log, c2.dt_bias,
                                                      c2.cu_seqlens, c2.initial_state, c2.final_state, None, None,
                                                      ws, c2.max_len)
    # nor a caller workspace a byte short: the general path refuses it by name
    assert not bound.launch(c2.q, c2.k, c2.v, c2.g, c2.beta, c2.o, c2.A_log, c2.dt_bias, c2.cu_seqlens,
                            c2.initial_state, c2.final_state, None, None, ws[:-1], c2.max_len)
    assert drv.launches == []
    # without a caller workspace: one scratch buffer per (device, stream), reused by the next call;
    # not under capture; the legacy default stream (handle 0) cannot capture and is not asked
    drv.capturing = False
    sm80.Sm80Bound.drop_arenas()
    args = (c2.q, c2.k, c2.v, c2.g, c2.beta, c2.o, c2.A_log, c2.dt_bias, c2.cu_seqlens, c2.initial_state,
            c2.final_state, None, None, None, c2.max_len)
    drv.launches.clear()
    assert bound.launch(*args) and bound.launch(*args)
    ws_of = [KdaParams.from_buffer_copy(x[5]).ws for x in drv.launches]
    arena, arena_ptr, arena_bytes = sm80.Sm80Bound._ARENAS[0][fake_cuda.STREAM]
    assert len(set(ws_of)) == 1 and ws_of[0] == arena.data_ptr() == arena_ptr
    assert arena.numel() == arena_bytes == ws_bytes
    drv.capturing = True
    drv.launches.clear()
    assert bound.launch(*args)
    assert KdaParams.from_buffer_copy(drv.launches[0][5]).ws != ws_of[0]
    drv.stream = 0

    def never_asked():
        raise AssertionError("the legacy default stream was asked whether it captures")

    drv.is_capturing = never_asked
    drv.launches.clear()
    assert bound.launch(*args) and bound.launch(*args)
    on_default = {KdaParams.from_buffer_copy(x[5]).ws for x in drv.launches}
    assert on_default == {sm80.Sm80Bound._ARENAS[0][0][1]} and on_default != {ws_of[0]}
    # the same stream handle on another device (handle 0 is every device's default stream):
    # another arena, on that device
    module0 = la._module
    la._module = lambda dev: (1, module0(dev)[1])
    bound1 = la.bind(call_of(t, B, N, ws))
    drv.launches.clear()
    assert bound1.launch(*args)
    assert KdaParams.from_buffer_copy(drv.launches[0][5]).ws == sm80.Sm80Bound._ARENAS[1][0][1] \
        != sm80.Sm80Bound._ARENAS[0][0][1]
    assert bound1.lock is not bound.lock
    # another thread launching on the device (it holds the device's lock) makes a call decline
    # rather than wait, with a caller workspace or without
    drv.launches.clear()
    with bound.lock:
        assert not bound.launch(*args)
        assert not bound.launch(c2.q, c2.k, c2.v, c2.g, c2.beta, c2.o, c2.A_log, c2.dt_bias, c2.cu_seqlens,
                                c2.initial_state, c2.final_state, None, None, ws, c2.max_len)
    assert drv.launches == []


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
@pytest.mark.parametrize("shim", [False, True], ids=["bindings", "shim"])
def test_sm90_bound_launch_passes_the_general_paths_struct(varlen, shim):
    """The sm90 launcher's bound launch (kda_fused alone; through the launch shim, whose second launch it uses,
    or cuda-bindings): the general path's launch byte for byte, for other tensors of the same signature
    (chunk states too); it declines unaligned data, a realigned signature is not bound, and a refused launch
    sends the call back to the general path, named."""
    from kdagen.targets.cuda_launch import KdaParams
    from kdagen.variant import Variant

    var = Variant("sm90", 16, 64, 64, "bf16", "bounded", "fp32", 64)
    T, H, HV, K = 48, 2, 4, 64
    lens = [5, 0, 43] if varlen else None
    N, B = (len(lens), 1) if varlen else (2, 2)

    def call_of(seed, max_len=None, q=None):
        gen = torch.Generator().manual_seed(seed)
        r = lambda *sh: torch.randn(*sh, generator=gen)  # noqa: E731
        qq = r(B, T, H, K).bfloat16() if q is None else q
        kk, vv, gg = r(B, T, H, K).bfloat16(), r(B, T, HV, K).bfloat16(), r(B, T, HV, K)
        beta, h0 = r(B, T, HV), r(N, HV, K, K)
        cs = torch.empty(12, HV, K, K)
        co = torch.tensor([0, 1, 1, 4] if varlen else [0, 3, 6], dtype=torch.int32)
        return _call_of(qq, kk, vv, gg, beta, r(HV), r(HV, K), h0,
                        cu=torch.tensor([0, 5, 5, 48], dtype=torch.int32) if varlen else None,
                        max_len=(max_len or 43) if varlen else T, cs=cs, co=co)

    with fake_cuda.sm90_on_cpu(var, shim=shim) as (la, drv):
        bound = la.bind(call_of(0))
        assert bound is not None and ("through the launch shim" in bound.launch_path) == shim, bound.launch_path
        c2 = call_of(1, max_len=40)
        la(c2)
        general = drv.launches[:]
        drv.launches.clear()
        assert bound.launch(*bound_args(c2)) and drv.launches == general
        (f, grid, block, smem, stream, raw), = general
        assert (f, grid, block, smem, stream) == ("kda_fused", (HV, N, 1), (fake_cuda.NT90, 1, 1), fake_cuda.SMEM90,
                                                 fake_cuda.STREAM)
        p = KdaParams.from_buffer_copy(raw)
        assert (p.q, p.o, p.hc, p.chunk_offsets, p.ws) == (c2.q.data_ptr(), c2.o.data_ptr(),
                                                           c2.chunk_states.data_ptr(), c2.chunk_offsets.data_ptr(), 0)
        assert p.max_len == (40 if varlen else T)
        # unaligned q: declined, nothing launched (the general path realigns it)
        drv.launches.clear()
        q_off = torch.empty(c2.q.numel() + 8, dtype=c2.q.dtype)[1:1 + c2.q.numel()].view(c2.q.shape)
        assert not bound.launch(*bound_args(call_of(2, q=q_off))) and drv.launches == []
        # a signature whose q the general path realigns has no bound launch
        assert la.bind(call_of(3, q=q_off)) is None
        # a refused launch: False, named, and the next call launches again
        drv.fail("kda_fused", 1, 700)
        assert not bound.launch(*bound_args(c2)) and "kda_fused" in bound.last_failure
        drv.launches.clear()
        assert bound.launch(*bound_args(c2)) and drv.launches == general


@pytest.mark.parametrize("shim", [False, True], ids=["bindings", "shim"])
def test_sm80_bound_launch_of_no_tokens_launches_only_the_recurrence(shim):
    """T = 0 (B sequences of no tokens): no prep chunks, so only kda_recur runs (it writes the
    initial states through), the bound launch as the general one."""
    with sm80_on_cpu(shim=shim) as (la, drv):
        B, H, K = 2, 2, 64
        r = torch.randn
        q, v = r(B, 0, H, K).bfloat16(), r(B, 0, H, K).bfloat16()
        o, h0, ht = torch.empty_like(v), r(B, H, K, K), torch.empty(B, H, K, K)
        st = (0, K * H, K)
        call = rt.KdaCall(q=q, k=q.clone(), v=v, g=r(B, 0, H, K), beta=r(B, 0, H), o=o, q_strides=st, k_strides=st,
                          v_strides=st, g_strides=st, beta_strides=(0, H, 1), o_strides=st, B=B, T=0, N=B, H=H,
                          HV=H, K=K, V=K, cu_seqlens=None, A_log=r(H), dt_bias=r(H, K), scale=0.125,
                          lower_bound=-5.0, use_qk_l2norm=True, allow_neg_eigval=False, initial_state=h0,
                          final_state=ht, state_kv=False, chunk_states=None, chunk_offsets=None, max_len=0)
        la(call)
        general = drv.launches[:]
        assert [x[0] for x in general] == ["kda_recur"]
        bound = la.bind(call)
        drv.launches.clear()
        assert bound.launch(call.q, call.k, call.v, call.g, call.beta, o, call.A_log, call.dt_bias, None, h0, ht, None,
                            None, None, 0)
        assert [x[:5] for x in drv.launches] == [x[:5] for x in general]


# ----------------------------------------------------------------------------- the runtime over it

def _sm80_case(lens, seed=0):
    from kdagen.variant import Variant

    from kdagen.cases import make_case

    var = Variant("sm80", 16, 64, 64, "bf16", "bounded", "fp32", 32)
    kw = make_case(var, "cpu", B=2, T=32, H=2, HV=4, lens=lens, seed=seed)
    if lens is not None:
        kw["cu_seqlens_cpu"] = kw["cu_seqlens"].clone()
    return var, kw


def _fields(raw: bytes) -> dict:
    from kdagen.targets.cuda_launch import KdaParams

    p = KdaParams.from_buffer_copy(raw)
    return {n: (list(getattr(p, n)) if hasattr(getattr(p, n), "__len__") else getattr(p, n))
            for n, _ in KdaParams._fields_}


def test_flat_dt_bias_runs_through_the_bound_launch():
    """fla's flat dt_bias [HV * K] (fp32, contiguous) is the memory the kernels read: its signature
    binds like [HV, K] does, and the bound launch passes its own pointer (no per-call reshape)."""
    from .fake_cuda import route_launcher

    var, kw = _sm80_case(None)
    flat = kw["dt_bias"].reshape(-1).clone()
    with sm80_on_cpu(var) as (la, drv), route_launcher(la):
        kdagen.kda_prefill(**dict(kw, dt_bias=flat))
        plan = list(rt._PLANS.values())[-1]
        assert plan.run == plan._run_bound
        drv.launches.clear()
        flat2 = flat.clone()
        kdagen.kda_prefill(**dict(kw, dt_bias=flat2))
        assert drv.launches and all(_fields(x[5])["dt_bias"] == flat2.data_ptr() for x in drv.launches)


def test_int64_offsets_with_their_host_copy_run_through_the_bound_launch():
    """fla's int64 cu_seqlens with cu_seqlens_cpu: the signature binds, and every call's launches
    read one int32 device copy made from the host offsets and kept for those values (a model's
    layers repeat one batch's offsets), not a conversion per call; other offsets, another copy."""
    from kdagen.scan.layout import device_ints

    from .fake_cuda import route_launcher

    var, kw = _sm80_case([5, 0, 27])
    kw64 = dict(kw, cu_seqlens=kw["cu_seqlens"].long(), cu_seqlens_cpu=kw["cu_seqlens_cpu"].long())
    with sm80_on_cpu(var) as (la, drv), route_launcher(la):
        kdagen.kda_prefill(**kw64)
        plan = list(rt._PLANS.values())[-1]
        assert plan.run == plan._run_bound
        want = device_ints([0, 5, 5, 32], "cpu").data_ptr()
        for _ in range(2):
            drv.launches.clear()
            kdagen.kda_prefill(**kw64)
            assert drv.launches and all(_fields(x[5])["cu_seqlens"] == want for x in drv.launches)
        other = dict(kw64, cu_seqlens=torch.tensor([0, 9, 9, 32]), cu_seqlens_cpu=torch.tensor([0, 9, 9, 32]))
        drv.launches.clear()
        kdagen.kda_prefill(**other)
        assert all(_fields(x[5])["cu_seqlens"] == device_ints([0, 9, 9, 32], "cpu").data_ptr()
                   for x in drv.launches)


@pytest.mark.parametrize("lens", [None, [5, 0, 27]], ids=["batch", "varlen"])
def test_runtime_runs_a_bound_signature_through_the_bound_launch(lens):
    """kda_prefill end to end over the sm80 launcher (fake driver): the first call of a
    signature launches the general way and binds; every later one goes through the bound
    launch whole, with exactly the general path's launches (owned buffers: every byte; fresh
    outputs: all but the output and scratch addresses, which are this call's)."""
    from .fake_cuda import route_launcher

    var, kw = _sm80_case(lens)
    with sm80_on_cpu(var) as (la, drv), route_launcher(la):
        out, fs = torch.empty_like(kw["v"]), torch.empty_like(kw["initial_state"])
        nbytes = kdagen.workspace_size(**kw)
        ws = torch.empty(nbytes + 256, dtype=torch.uint8)
        ws = ws[(-ws.data_ptr()) % 256:][:nbytes]
        owned = dict(kw, out=out, final_state=fs, workspace=ws)
        assert kdagen.kda_prefill(**owned) == (out, fs)
        plan = list(rt._PLANS.values())[-1]
        assert plan.run == plan._run_bound and type(plan.fast).__name__ == "Sm80Bound"
        general = drv.launches[:]
        assert len(general) == 2
        drv.launches.clear()
        kw2 = {n: (t.clone() if isinstance(t, torch.Tensor) and n in ("q", "k", "v", "g", "beta") else t)
               for n, t in owned.items()}  # new tensors, same signature
        assert kdagen.kda_prefill(**kw2) == (out, fs)
        assert [x[:5] for x in drv.launches] == [x[:5] for x in general]
        for got, want in zip(drv.launches, general):
            g_, w_ = _fields(got[5]), _fields(want[5])
            assert {n: g_[n] for n in ("q", "k", "v", "g", "beta")} == \
                {n: kw2[n].data_ptr() for n in ("q", "k", "v", "g", "beta")}
            assert {n: x for n, x in g_.items() if n not in ("q", "k", "v", "g", "beta")} == \
                {n: x for n, x in w_.items() if n not in ("q", "k", "v", "g", "beta")}
        # fresh outputs: the plain call's own plan, bound on its first call
        drv.launches.clear()
        kdagen.kda_prefill(**kw)
        general = drv.launches[:]
        drv.launches.clear()
        o, st = kdagen.kda_prefill(**kw)
        assert list(rt._PLANS.values())[-1].run == list(rt._PLANS.values())[-1]._run_bound and len(rt._PLANS) == 2
        assert (o.shape, o.dtype, o.is_contiguous()) == (kw["v"].shape, kw["v"].dtype, True)
        assert (st.shape, st.dtype, st.is_contiguous()) == (kw["initial_state"].shape, torch.float32, True)
        assert [x[:5] for x in drv.launches] == [x[:5] for x in general]
        for got, want in zip(drv.launches, general):
            g_, w_ = _fields(got[5]), _fields(want[5])
            assert (g_["o"], g_["ht"]) == (o.data_ptr(), st.data_ptr())
            assert g_["ws"] == sm80_arena_ptr()
            assert {n: x for n, x in g_.items() if n not in ("o", "ht", "ws")} == \
                {n: x for n, x in w_.items() if n not in ("o", "ht", "ws")}
        # host offsets are still checked on every call of the signature
        if lens is not None:
            with pytest.raises(kdagen.runtime.KdaInputError, match="non-decreasing offsets"):
                kdagen.kda_prefill(**dict(kw, cu_seqlens_cpu=torch.tensor([0, 9, 5, 32], dtype=torch.int32)))


def test_bound_outputs_come_from_the_allocator_entry_when_it_behaves(monkeypatch):
    guards = torch._C._dynamo.guards
    cpu = torch.device("cpu")
    empty, general, current, _ = rt._allocator(cpu)
    assert empty is guards._empty_strided_cpu and current is None  # no current device to check on the CPU
    t = empty((2, 5, 3), (15, 3, 1), torch.bfloat16)
    assert (t.shape, t.stride(), t.dtype, t.device, t.requires_grad) == ((2, 5, 3), (15, 3, 1), torch.bfloat16, cpu,
                                                                         False)
    assert general((2, 3), (1, 2), torch.bfloat16).stride() == (1, 2)
    with torch.inference_mode():  # like torch.empty there: an inference tensor
        assert empty((1,), (1,), torch.float32).is_inference()
    # an entry that answers unlike torch.empty_strided (or is missing) is not used
    monkeypatch.setattr(guards, "_empty_strided_cpu", lambda shape, strides, dtype: torch.empty(shape))
    empty, general, current, _ = rt._allocator(cpu)
    assert empty is general and current is None and empty((2, 3), (1, 2), torch.bfloat16).stride() == (1, 2)
    monkeypatch.delattr(guards, "_empty_strided_cpu")
    empty, general, _, _ = rt._allocator(cpu)
    assert empty is general and empty((4,), (1,), torch.int32).dtype == torch.int32
    if not torch.cuda.is_available():  # the CUDA entry of a CPU-only torch raises: not used
        empty, general, current, _ = rt._allocator(torch.device("cuda", 0))
        assert empty is general and current is None


@pytest.mark.gpu
def test_gpu_bound_outputs_follow_the_current_device():
    """The raw allocator entry allocates on the current device: a plan for cuda:0 called while
    another device is current gets its outputs on cuda:0 all the same."""
    kw = _gpu_case([64])
    plan_device = kw["q"].device
    o, fs = kdagen.kda_prefill(**kw)
    o, fs = kdagen.kda_prefill(**kw)  # the bound launch
    assert o.device == fs.device == plan_device
    if torch.cuda.device_count() > 1:
        with torch.cuda.device(1):
            o2, fs2 = kdagen.kda_prefill(**kw)
        assert o2.device == fs2.device == plan_device and torch.equal(o2, o)


def sm80_arena_ptr() -> int:
    import kdagen.targets.sm80 as sm80

    (arena,) = [a for arenas in sm80.Sm80Bound._ARENAS.values() for a in arenas.values()]
    return arena[1]


def test_bound_signature_falls_back_to_the_general_path_when_the_launch_declines():
    """Same signature, unaligned q (the bound launch declines): the general path realigns it."""
    from .fake_cuda import route_launcher

    var, kw = _sm80_case(None)
    with sm80_on_cpu(var) as (la, drv), route_launcher(la):
        kdagen.kda_prefill(**kw)
        q = kw["q"]
        q_off = torch.empty(q.numel() + 8, dtype=q.dtype)[1:1 + q.numel()].view(q.shape).copy_(q)
        assert q_off.data_ptr() % 16
        drv.launches.clear()
        o, _ = kdagen.kda_prefill(**dict(kw, q=q_off))
        assert list(rt._PLANS.values())[-1].run == list(rt._PLANS.values())[-1]._run_bound and len(rt._PLANS) == 1
        assert len(drv.launches) == 2
        q_seen = {_fields(x[5])["q"] for x in drv.launches}
        assert len(q_seen) == 1 and q_seen != {q_off.data_ptr()} and q_seen.pop() % 16 == 0  # a realigned copy


@pytest.mark.parametrize("guarded", [True, False], ids=["guard", "key_only"])
def test_a_cached_plan_serves_only_calls_of_its_signature(monkeypatch, guarded):
    """Which plan serves a call (torch's tensor guard first, else the Python key): another
    stride, a missing tensor, autograd, grad and inference modes, one tensor in two slots."""
    from kdagen import signature_guard

    from .fake_cuda import route_launcher

    if guarded:
        assert signature_guard.available()
    else:
        monkeypatch.setattr(rt, "make_check", lambda args: None)
    served = []
    for name in ("_run_bound", "__call__"):
        real = getattr(rt.Plan, name)
        monkeypatch.setattr(rt.Plan, name, (lambda f: lambda self, *a: served.append(self) or f(self, *a))(real))
    var, kw = _sm80_case(None)

    def call(**over):
        served.clear()
        kdagen.kda_prefill(**dict(kw, **over))
        return served[0]

    with sm80_on_cpu(var) as (la, _drv), route_launcher(la):
        base = call()
        assert call() is base and (rt._LAST[3] is base) == guarded
        strided = kw["q"].transpose(1, 2).contiguous().transpose(1, 2)
        assert strided.shape == kw["q"].shape and strided.stride() != kw["q"].stride()
        other = call(q=strided)
        assert other is not base and call(q=strided) is other and call() is base
        no_dt = call(dt_bias=None)
        assert no_dt not in (base, other) and call(dt_bias=None) is no_dt and call() is base
        with torch.no_grad():
            assert call() is base and call() is base
        with torch.inference_mode():
            assert call() is base and call() is base
        with pytest.raises(kdagen.runtime.KdaInputError, match="forward-only"):
            call(q=kw["q"].clone().requires_grad_())
        with torch.no_grad():  # allowed there, with the plan of its facts
            assert call(q=kw["q"].clone().requires_grad_()) is base
        # one tensor in two slots (k is q: same facts): the Python key serves it; a guard cannot
        # (it fails such calls), and the plan stops getting new ones
        builds = base.guard_builds
        assert builds == 3 or not guarded  # the first; inference mode in and out (its dispatch keys)
        assert all(call(k=kw["q"]) is base for _ in range(12))
        assert base.guard_builds == (rt._GUARD_BUILDS if guarded else builds)
        assert call() is base and len(rt._PLANS) == 3


def test_the_latest_signature_shortcut_never_serves_another_signature(monkeypatch):
    """Alternating signatures, and flags whose hashes collide (hash(-1.0) == hash(-2.0)), each
    get their own plan and the right result."""
    made = []
    real = rt._make_plan
    monkeypatch.setattr(rt, "_make_plan", lambda *a, **k: made.append(k["lower_bound"]) or real(*a, **k))
    a, b = inputs(T=20), inputs(T=21)
    assert hash(-1.0) == hash(-2.0)
    want = {}
    for kw, lb in ((a, -1.0), (a, -1.0), (b, -1.0), (a, -2.0), (a, -1.0), (b, -1.0), (a, -2.0)):
        o, _ = kdagen.kda_prefill(**kw, lower_bound=lb)
        ref = _ref(dict(kw, lower_bound=lb))[0]
        assert rel_rmse(o, ref) < 1e-5
        want.setdefault((kw["q"].shape[1], lb), o)
        assert torch.equal(o, want[(kw["q"].shape[1], lb)])
    assert made == [-1.0, -1.0, -2.0] and len(rt._PLANS) == 3
    assert not torch.equal(want[(20, -1.0)], want[(20, -2.0)])


def test_a_bad_flag_after_a_cached_call_is_named():
    kw = inputs()
    kdagen.kda_prefill(**kw, scale=0.25)  # the latest call's flags hold a float scale
    with pytest.raises(kdagen.runtime.KdaInputError, match="scale: expected a float or None, found Tensor"):
        kdagen.kda_prefill(**kw, scale=torch.tensor([0.25, 0.5]))  # would not compare with it


def test_torch_op_and_kda_prefill_share_one_plan_and_its_checks(monkeypatch):
    kw = inputs()
    h0 = torch.randn(1, 2, 32, 32)
    out, fs = torch.empty_like(kw["v"]), torch.empty_like(h0)
    o1, s1 = kdagen.kda_prefill(**kw, initial_state=h0, output_final_state=True, out=out, final_state=fs)
    o1, s1 = o1.clone(), s1.clone()
    made = []
    monkeypatch.setattr(rt, "check_signature", lambda *a, **k: made.append(1))
    out.fill_(float("nan"))
    fs.fill_(float("nan"))
    args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], kw["A_log"], kw["dt_bias"], h0, None, None, out, fs,
            None, None)
    assert torch.ops.kdagen.kda_prefill(*args) is None
    assert made == [] and len(rt._PLANS) == 1  # the plan kda_prefill made
    assert torch.equal(out, o1) and torch.equal(fs, s1)
    monkeypatch.undo()
    bad = (kw["q"], kw["k"][:, :, :, :16], *args[2:])  # a new signature: checked like kda_prefill's
    with pytest.raises(kdagen.runtime.KdaInputError, match="k: expected shape"):
        torch.ops.kdagen.kda_prefill(*bad)


# ----------------------------------------------------------------------------- on a GPU (sm80)

def _gpu_case(lens, chunk=False):
    from kdagen.variant import Variant

    from kdagen.cases import make_case

    v = Variant("sm80", 16, 128, 128, "bf16", "bounded", "fp32", 32)
    if len(lens) == 1:
        return make_case(v, "cuda", B=1, T=lens[0], H=2, HV=4, chunk_states=chunk)
    return make_case(v, "cuda", lens=lens, H=2, HV=4, chunk_states=chunk)


SM90_PAIR = "kda_fwd_sm90_c16_k128_v128_bf16_gb_sfp32_bv64"


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["sm80", "sm90"])
@pytest.mark.parametrize("how", ["batch", "varlen_host_offsets", "varlen_assume_valid", "chunk_states",
                                 "owned_buffers"])
def test_gpu_bound_launch_equals_the_general_path(how, target, monkeypatch):
    from kdagen.targets.sm80 import Sm80Bound
    from kdagen.targets.sm90 import Sm90Bound

    # sm80: dispatch by the targets' constants, which rank sm80 first (the H200's tuning file ranks sm90 first for
    # these small shapes since session 38)
    monkeypatch.setenv("KDAGEN_TUNING", "off")

    if target == "sm90" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm90 variants need an sm_90 GPU")
    lens = [64] if how in ("batch", "owned_buffers") else [300, 0, 17, 700]
    kw = _gpu_case(lens, chunk=how == "chunk_states")
    if target == "sm90":
        kw["variant"] = SM90_PAIR
    if how == "varlen_host_offsets":
        kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
    if how == "varlen_assume_valid":
        kw["assume_valid"] = True
    if how == "owned_buffers":
        ws = torch.empty(kdagen.workspace_size(**kw), dtype=torch.uint8, device="cuda")
        kw.update(out=torch.empty_like(kw["v"]), final_state=torch.empty_like(kw["initial_state"]), workspace=ws)
    first = [t.clone() for t in kdagen.kda_prefill(**kw)]  # the general path (and bind)
    plan = next(iter(rt._PLANS.values()))
    bound_type = Sm80Bound if target == "sm80" else Sm90Bound
    assert plan.entry.variant.target == target and isinstance(plan.fast, bound_type), (plan.entry.name, plan.fast)
    second = kdagen.kda_prefill(**kw)  # the bound launch
    assert all(torch.equal(a, b) for a, b in zip(first, second)), how
    ref = kda_reference(**{n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()
                           if n not in ("out", "final_state", "workspace", "assume_valid", "cu_seqlens_cpu",
                                        "return_chunk_states", "chunk_size", "state_dtype", "variant")},
                        chunk_states_size=16 if how == "chunk_states" else None)
    for got, want in zip(second, ref):
        if want is not None:
            assert rel_rmse(got.cpu(), want) < 5e-3, how


@pytest.mark.gpu
def test_gpu_workspace_too_small_is_refused():
    kw = _gpu_case([64])
    need = kdagen.workspace_size(**kw)
    assert need > 0
    with pytest.raises(RuntimeError, match=rf"workspace has {need // 2} bytes, this call needs {need}"):
        kdagen.kda_prefill(**kw, workspace=torch.empty(need // 2, dtype=torch.uint8, device="cuda"))


@pytest.mark.gpu
def test_gpu_workspace_size_follows_the_time_segments():
    # One long sequence with few heads runs in time segments (T131072 HV4 at block_v 16: 32 blocks),
    # two sequences of the same tokens never do: workspace_size asks room for the segments' carried
    # states only for the first, and each call runs in exactly the workspace it was told.
    from kdagen.cases import make_case
    from kdagen.variant import Variant

    v = Variant("sm80", 16, 128, 128, "bf16", "bounded", "fp32", 16)
    la = rt.registry().launcher(v.name, f"cuda:{torch.cuda.current_device()}")
    sizes, segments = {}, {}
    for lens in ([131072], [65536, 65536]):
        kw = make_case(v, "cuda", lens=lens, H=2, HV=4, seed=3)
        kw.update(variant=v.name, cu_seqlens_cpu=kw["cu_seqlens"].cpu())
        need = sizes[len(lens)] = kdagen.workspace_size(**kw)
        ws = torch.empty(need, dtype=torch.uint8, device="cuda")
        assert ws.data_ptr() % 256 == 0  # torch's allocator aligns: the call needs exactly `need` bytes
        torch.full((1 << 26,), float("nan"), device="cuda")  # freed at once: o likely reuses it
        o, fs = kdagen.kda_prefill(**kw, workspace=ws)
        segments[len(lens)] = la.last_segments
        assert torch.isfinite(o).all() and torch.isfinite(fs).all()
    assert segments == {1: 8, 2: 0}
    carry = 7 * 1 * 4 * 128 * 128 * 4  # 7 carried fp32 states of 4 heads
    assert sizes[1] >= sizes[2] + carry, sizes


def test_chunk_states_without_host_offsets_into_a_caller_buffer():
    """assume_valid with chunk states: chunk offsets are computed on the device; the caller's
    buffer has room for the most chunks T // C + N could need."""
    cu = torch.tensor([0, 7, 7, 20], dtype=torch.int32)
    kw = dict(inputs(), initial_state=torch.randn(3, 2, 32, 32), cu_seqlens=cu, chunk_size=16)
    want = kdagen.kda_prefill(**kw, output_final_state=True, return_chunk_states=True)
    rows = 20 // 16 + 3
    buf = torch.full((rows, 2, 32, 32), float("nan"))
    with pytest.raises(kdagen.runtime.KdaInputError, match="needs a chunk_states= buffer"):
        kdagen.kda_prefill(**kw, output_final_state=True, return_chunk_states=True, assume_valid=True)
    o, st, cs = kdagen.kda_prefill(**kw, output_final_state=True, chunk_states=buf, assume_valid=True)
    assert cs is buf and torch.equal(o, want[0]) and torch.equal(st, want[1])
    assert torch.equal(cs[:want[2].shape[0]], want[2]) and want[2].shape[0] == 2


def test_a_new_token_count_reuses_the_choice(monkeypatch):
    kdagen.kda_prefill(**inputs(T=20))
    scans = []
    real = rt._select_entry
    monkeypatch.setattr(rt, "_select_entry", lambda *a: scans.append(1) or real(*a))
    kdagen.kda_prefill(**inputs(T=23))  # new signature, same choice inputs: no candidate scan
    assert scans == [] and len(rt._PLANS) == 2
    kdagen.kda_prefill(**inputs(T=600))  # sequences now average >= 512 tokens: chunk preference may change
    assert scans == [1]


def test_host_overhead_script_on_the_cpu_stub(capsys, monkeypatch):
    """The script the H200 run uses, on the CPU stand-ins: its table, launch path and split
    lines (the GPU columns and pass/fail bars need the GPU)."""
    import importlib.util
    import re
    import sys

    from kdagen.paths import ROOT

    spec = importlib.util.spec_from_file_location("host_overhead", ROOT / "scripts" / "host_overhead.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", ["host_overhead.py", "--stub", "--calls", "30", "--rounds", "1"])
    assert mod.main() == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (tiny T64 H4|T64 H32|T1024 H8|T2048 H8|varlen 4x512 H32) \| "
                      r"kda_fwd_sm80_c16_k128_v128_bf16_gb_sfp32_bv(?:16|32) \(Sm80Bound\) \| (shim|bindings) \| "
                      r"([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", out, re.M)
    assert len(rows) == 10 and all(0 < float(x) < 1000 for r in rows for x in r[2:]), out
    assert [r[1] for r in rows] == ["shim", "bindings"] * 5, out
    assert "- launch path shim: kda_prep + kda_recur through the launch shim kdagen_launch_shim-" in out
    assert "- launch path bindings: cuLaunchKernel through the stand-in driver of tests/fake_cuda.py" in out
    for path in ("shim", "bindings"):
        assert re.search(rf"- tiny case split \({path}\), in the rounds: bound launch [\d.]+ us, signature check "
                         r"[\d.]+ us, two allocations [\d.]+ us, plain call [\d.]+ us", out), out
        assert re.search(rf"- tiny case split \({path}\), after the rounds: bound launch [\d.]+ us, signature check "
                         r"[\d.]+ us, two allocations [\d.]+ us, plain call [\d.]+ us, two empty like [\d.]+ us",
                         out), out
    # one path only
    monkeypatch.setattr(sys, "argv", ["host_overhead.py", "--stub", "--calls", "10", "--rounds", "1",
                                      "--paths", "bindings"])
    assert mod.main() == 0
    out = capsys.readouterr().out
    assert "| bindings |" in out and "| shim |" not in out and "launch path shim" not in out, out


def test_sm80_segments_read_and_write_a_pools_slots_only_where_the_states_are(monkeypatch):
    """A state pool's slots (KdaCall.h0_index/ht_index) in a time-segmented call: the first segment
    reads the pool at the slots, the last writes it there, and the states carried between segments
    are per sequence (no slots): every other struct has h0_idx and ht_idx 0."""
    import dataclasses

    T, H, HV, K, N, P = 300, 1, 2, 64, 2, 5
    gen = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    t = dict(q=r(N, T, H, K).bfloat16(), k=r(N, T, H, K).bfloat16(), v=r(N, T, HV, K).bfloat16(),
             g=r(N, T, HV, K), beta=r(N, T, HV), A_log=r(HV), dt_bias=r(HV, K), h0=r(N, HV, K, K))
    pool = r(P, HV, K, K)
    slots = torch.tensor([3, -1], dtype=torch.int32)
    with sm80_on_cpu() as (la, drv):
        _segment_300_tokens(la, drv, monkeypatch)
        c = dataclasses.replace(_call_of(**t, cu=None, max_len=T), initial_state=pool, final_state=pool,
                                h0_index=slots, ht_index=slots)
        la(c)
        assert la.last_segments == 3
        recurs = [_fields(x[5]) for x in drv.launches if x[0] == "kda_recur"]
        assert [p["h0_idx"] for p in recurs] == [slots.data_ptr(), 0, 0]
        assert [p["ht_idx"] for p in recurs] == [0, 0, slots.data_ptr()]
        assert recurs[0]["h0"] == pool.data_ptr() and recurs[-1]["ht"] == pool.data_ptr()
        assert pool.data_ptr() not in (recurs[1]["h0"], recurs[1]["ht"], recurs[0]["ht"], recurs[2]["h0"])
        # in one piece: both on the one launch
        la.settings = dataclasses.replace(la.settings, min_segment_tokens=None)
        drv.launches.clear()
        la(c)
        (p,) = [_fields(x[5]) for x in drv.launches if x[0] == "kda_recur"]
        assert (p["h0"], p["ht"], p["h0_idx"], p["ht_idx"]) == (pool.data_ptr(),) * 2 + (slots.data_ptr(),) * 2


def test_a_pool_calls_plan_is_kept_for_its_signature_the_pools_included(monkeypatch):
    """The latest pool call's plan serves the next call of its signature without a lookup, and
    only that: a pool of another dtype or size, or other inputs, plan again (a bf16 pool read as
    the fp32 one's plan would be garbage); what the guard kept launches with this call's pool."""
    from .fake_cuda import route_launcher

    var, kw = _sm80_case([5, 0, 27])
    monkeypatch.setenv("KDAGEN_POOL_SLOTS", "1")
    monkeypatch.setattr(rt, "_POOL_LAST", rt._NO_PLAN)
    N, HV, K = kw["initial_state"].shape[:3]
    kw.pop("initial_state")
    kw.pop("output_final_state", None)
    idx = torch.tensor([6, 2, 0], dtype=torch.int32)
    looked = []
    real = rt._plan_of
    monkeypatch.setattr(rt, "_plan_of", lambda *a: looked.append(a[7]) or real(*a))
    with sm80_on_cpu(var) as (la, drv), route_launcher(la):
        def recur_h0(pool):
            drv.launches.clear()
            kdagen.kda_prefill(**kw, state_pool=pool, state_indices=idx)
            return {_fields(x[5])["h0"] for x in drv.launches if x[0] == "kda_recur"}

        pool = torch.randn(7, HV, K, K)
        assert recur_h0(pool) == {pool.data_ptr()} and len(looked) == 1
        other = torch.randn(7, HV, K, K)  # the same signature, another pool: no lookup, its own slots
        assert recur_h0(other) == {other.data_ptr()} and len(looked) == 1
        bigger = torch.randn(9, HV, K, K)
        assert recur_h0(bigger) == {bigger.data_ptr()} and len(looked) == 2
        half = torch.randn(9, HV, K, K, dtype=torch.bfloat16)
        # planned again: a bf16-state variant is selected, and the stand-in launcher (fp32 states)
        # refuses it, where the kept plan's bound launch would have read bf16 as fp32
        with pytest.raises(RuntimeError, match="initial_state must be contiguous torch.float32"):
            recur_h0(half)
        assert len(looked) == 3 and looked[-1].dtype == torch.bfloat16
        kw["q"] = kw["q"].clone()  # a fresh tensor of the same signature: still the kept plan
        assert recur_h0(bigger) == {bigger.data_ptr()} and len(looked) == 4  # (after the refusal: looked up)
        assert recur_h0(bigger) == {bigger.data_ptr()} and len(looked) == 4


def test_sm90_pool_calls_launch_kda_fused_slots(monkeypatch):
    """A pool call over the sm90 launcher (fake driver) launches kda_fused_slots on the pool itself at the
    slots, no gather or scatter, checked then bound; the same signature's plain call launches kda_fused
    with no slots left in the struct (kda_fused never reads them: a second entry point, since reading them
    there cost plain calls up to 2.3%, session 52). An image without the entry point is refused by name, and
    a variant without a state takes no slots."""
    from kdagen.scan.layout import device_ints
    from kdagen.targets.cuda_launch import KdaParams
    from kdagen.variant import Variant

    from .fake_cuda import route_launcher

    monkeypatch.delenv("KDAGEN_POOL_SLOTS", raising=False)
    var = Variant("sm90", 16, 64, 64, "bf16", "bounded", "fp32", 64)
    _, kw = _sm80_case([5, 0, 27])
    N, HV, K = kw["initial_state"].shape[:3]
    kw.pop("initial_state")
    kw.pop("output_final_state", None)
    pool = torch.randn(7, HV, K, K)
    idx = torch.tensor([6, -1, 0], dtype=torch.int32)
    copies = []
    real_copy = torch.Tensor.index_copy_
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda self, *a: copies.append(a) or real_copy(self, *a))

    def params(name):
        return [KdaParams.from_buffer_copy(x[5]) for x in drv.launches if x[0] == name]

    with fake_cuda.sm90_on_cpu(var) as (la, drv), route_launcher(la):
        calls = []
        real_call = type(la).__call__
        monkeypatch.setattr(type(la), "__call__", lambda self, c: calls.append(c) or real_call(self, c))
        want = device_ints(idx.tolist(), "cpu").data_ptr()
        for _ in range(2):  # checked (binds), then bound
            drv.launches.clear()
            kdagen.kda_prefill(**kw, state_pool=pool, state_indices=idx)
            (p,) = params("kda_fused_slots")
            assert (p.h0, p.ht, p.h0_idx, p.ht_idx) == (pool.data_ptr(),) * 2 + (want,) * 2 and not params("kda_fused")
        assert not copies and len(calls) == 1
        plan = [p for p in rt._PLANS.values() if getattr(p, "launcher", None) is la][-1]
        assert type(plan.fast).__name__ == "Sm90Bound" and plan.fast.pool_slots == want
        # the signature's plain call, through the same bound launch
        drv.launches.clear()
        h0 = torch.randn(N, HV, K, K)
        kdagen.kda_prefill(**kw, initial_state=h0, final_state=torch.empty_like(h0), output_final_state=True)
        (p,) = params("kda_fused")
        assert p.h0_idx == p.ht_idx == 0 and p.h0 == h0.data_ptr() and not params("kda_fused_slots")
        assert len(calls) == 1 and plan.fast.pool_slots == 0
        # an image without kda_fused_slots: its checked launch refuses a call carrying slots
        call = calls[0]
        call.h0_index = call.ht_index = torch.tensor([0, 1, 2], dtype=torch.int32)
        real_module = la._module
        monkeypatch.setattr(la, "_module", lambda dev: real_module(dev)[:5] + (None,))
        with pytest.raises(RuntimeError, match="has no kda_fused_slots entry point"):
            la(call)
    with fake_cuda.sm90_on_cpu(Variant("sm90", 16, 64, 64, "bf16", "bounded", "none", 64)) as (la, drv):
        assert not la.pool_indices
        with pytest.raises(RuntimeError, match="take no state pool slots"):
            la(call)


def test_a_repeated_pool_call_skips_the_general_path_but_still_checks_its_slots(monkeypatch):
    """The second pool call of a signature (a model's next layer) goes from kda_prefill to the plan's
    launch (runtime._pool_fast: no keyword dict, no re-check of the guarded pool), yet every call's slot
    values are checked (a duplicate or out-of-range slot raises as on the first call), and whatever the
    fast path does not serve (final states asked, KDAGEN_POOL_SLOTS=0, another signature) takes the
    general path."""
    from kdagen.errors import KdaInputError

    from .fake_cuda import route_launcher

    var, kw = _sm80_case([5, 0, 27])
    monkeypatch.delenv("KDAGEN_POOL_SLOTS", raising=False)
    N, HV, K = kw["initial_state"].shape[:3]
    kw.pop("initial_state")
    kw.pop("output_final_state", None)
    pool = torch.randn(7, HV, K, K)
    general = []
    real = rt._engine_call
    monkeypatch.setattr(rt, "_engine_call", lambda *a, **k: general.append(1) or real(*a, **k))
    with sm80_on_cpu(var) as (la, drv), route_launcher(la):
        def recur_slots():
            return [_fields(x[5])["h0_idx"] for x in drv.launches if x[0] == "kda_recur"]

        for i, slots in enumerate(([6, 2, 0], [1, -1, 3], [4, 5, 6])):
            drv.launches.clear()
            o, fs = kdagen.kda_prefill(**kw, state_pool=pool, state_indices=torch.tensor(slots, dtype=torch.int32))
            assert fs is None and recur_slots() and all(recur_slots())  # the kernels took the slots
            assert len(general) == 1  # the first call only
        for bad, msg in (([4, 4, 1], "expected distinct slots"), ([0, 1, 7], r"expected slot indices in \[0, 7\)"),
                         ([0, 1], "a 1-D int32 or int64 tensor of 3 slot indices")):
            with pytest.raises(KdaInputError, match=msg):
                kdagen.kda_prefill(**kw, state_pool=pool, state_indices=torch.tensor(bad))
        assert len(general) == 1
        idx = torch.tensor([6, 2, 0])
        kdagen.kda_prefill(**kw, state_pool=pool, state_indices=idx, output_final_state=True)  # final states: gathered
        monkeypatch.setenv("KDAGEN_POOL_SLOTS", "0")
        kdagen.kda_prefill(**kw, state_pool=pool, state_indices=idx)
        monkeypatch.delenv("KDAGEN_POOL_SLOTS")
        kdagen.kda_prefill(**kw, state_pool=torch.randn(9, HV, K, K), state_indices=idx)  # another pool size
        assert len(general) == 4
        drv.launches.clear()
        kdagen.kda_prefill(**kw, state_pool=pool, state_indices=idx)  # the pool of 9 is the latest signature now
        assert len(general) == 5 and recur_slots() and all(recur_slots())


@pytest.mark.parametrize("lens", [None, [5, 0, 27]], ids=["batch", "varlen"])
def test_a_pool_call_passes_its_slots_to_the_kernels(lens, monkeypatch):
    """kda_prefill(state_pool=, state_indices=) over the sm80 launcher (fake driver): the launches
    read and write the pool itself at the slots (int32 device copy of the host indices), with no
    gather or scatter around them, checked then bound; asked for the final states (returned per
    sequence), with a launcher that takes no slots, or with KDAGEN_POOL_SLOTS=0, the call gathers
    and scatters instead."""
    from kdagen.scan.layout import device_ints

    from .fake_cuda import route_launcher

    var, kw = _sm80_case(lens)
    monkeypatch.delenv("KDAGEN_POOL_SLOTS", raising=False)  # the default
    N, HV, K = kw["initial_state"].shape[:3]
    kw.pop("initial_state")
    kw.pop("output_final_state", None)
    pool = torch.randn(7, HV, K, K)
    idx = torch.tensor([6, 2, -1, 0][:N], dtype=torch.int64)
    copies = []
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda self, *a: copies.append(a) or self)
    with sm80_on_cpu(var) as (la, drv), route_launcher(la):
        want = device_ints(idx.tolist(), "cpu").data_ptr()
        for _ in range(2):  # the checked launch (which binds the signature), then the bound one
            drv.launches.clear()
            o, fs = kdagen.kda_prefill(**kw, state_pool=pool, state_indices=idx)
            assert fs is None and o.shape == kw["v"].shape and not copies
            recurs = [_fields(x[5]) for x in drv.launches if x[0] == "kda_recur"]
            assert recurs and all((p["h0"], p["ht"], p["h0_idx"], p["ht_idx"]) ==
                                  (pool.data_ptr(),) * 2 + (want,) * 2 for p in recurs)
        plan = [p for p in rt._PLANS.values() if getattr(p, "launcher", None) is la][-1]
        assert type(plan.fast).__name__ == "Sm80Bound" and plan.fast.pool_slots == want
        # the same signature's plain call through the bound launch: no slots left in its struct
        drv.launches.clear()
        h0 = torch.randn(N, HV, K, K)
        kdagen.kda_prefill(**kw, initial_state=h0, final_state=torch.empty_like(h0), output_final_state=True)
        recurs = [_fields(x[5]) for x in drv.launches if x[0] == "kda_recur"]
        assert recurs and all(p["h0_idx"] == p["ht_idx"] == 0 and p["h0"] == h0.data_ptr() for p in recurs)
        assert plan.fast.pool_slots == 0
        drv.launches.clear()
        kdagen.kda_prefill(**kw, state_pool=pool, state_indices=idx, output_final_state=True)
        recurs = [_fields(x[5]) for x in drv.launches if x[0] == "kda_recur"]
        assert recurs and all(p["h0_idx"] == p["ht_idx"] == 0 and pool.data_ptr() not in (p["h0"], p["ht"])
                              for p in recurs)
        assert len(copies) == 1  # the scatter
        monkeypatch.setattr(type(la), "pool_indices", False)
        drv.launches.clear()
        kdagen.kda_prefill(**kw, state_pool=pool, state_indices=idx)
        recurs = [_fields(x[5]) for x in drv.launches if x[0] == "kda_recur"]
        assert recurs and all(p["h0_idx"] == p["ht_idx"] == 0 for p in recurs) and len(copies) == 2
        # and with KDAGEN_POOL_SLOTS=0 the pool is gathered and scattered
        monkeypatch.setattr(type(la), "pool_indices", True)
        monkeypatch.setenv("KDAGEN_POOL_SLOTS", "0")
        drv.launches.clear()
        kdagen.kda_prefill(**kw, state_pool=pool, state_indices=idx)
        recurs = [_fields(x[5]) for x in drv.launches if x[0] == "kda_recur"]
        assert recurs and all(p["h0_idx"] == p["ht_idx"] == 0 for p in recurs) and len(copies) == 3
