"""State pools: kda_prefill(..., state_pool=P, state_indices=idx) reads sequence n's initial
state from P[idx[n]] and writes its final state back in place; -1 (a padding sequence) is
neither read nor written; results equal the plain call on the gathered states. Both state
layouts and dtypes, indices checked on the host or promised valid (the device path)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import kdagen
from kdagen.errors import KdaInputError
from kdagen.reference import kda_reference, rel_rmse
from kdagen.variant import Variant

from kdagen.cases import make_case
from .cuda_graphs import capture
from .runtime_env import fresh_runtime  # noqa: F401

LENS = [9, 5, 12, 6]


def _case(device, state_layout="VK", state="fp32", lens=LENS):
    v = Variant("triton", 16, 32, 32, "bf16", "bounded", state, 16)
    kw = make_case(v, device, H=1, HV=2, lens=lens, with_state=False, state_layout=state_layout)
    dtype = torch.float32 if state == "fp32" else torch.bfloat16
    shape = (6, 2, 32, 32)
    pool = (torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 0.5).to(dtype).to(device)
    return kw, pool


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("state_layout, state, assume_valid", [("VK", "fp32", False), ("KV", "bf16", True)],
                         ids=["VK-fp32-checked", "KV-bf16-assume_valid"])
def test_pool_is_updated_in_place_and_padding_slots_are_untouched(state_layout, state, assume_valid, device):
    kw, pool = _case(device, state_layout, state)
    idx = torch.tensor([4, -1, 1, 5], dtype=torch.int32, device=device)
    # Slots 0, 2, 3 are nobody's: NaN there would poison any result that read them (slot 0 is
    # where a padding row's clamped index points).
    pool[0], pool[2], pool[3] = float("nan"), float("nan"), float("nan")
    before = pool.clone()
    o, fs = kdagen.kda_prefill(**kw, state_pool=pool, state_indices=idx, output_final_state=True,
                               assume_valid=assume_valid)
    h0 = before[idx.clamp(min=0).long()].clone()
    h0[1] = 0  # the padding sequence starts from zeros
    o2, fs2 = kdagen.kda_prefill(**kw, initial_state=h0, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(fs, fs2)
    for n, slot in enumerate(idx.tolist()):
        if slot >= 0:
            assert torch.equal(pool[slot], fs2[n]), slot
    for slot in (0, 2, 3):
        assert torch.equal(_bits(pool[slot]), _bits(before[slot])), f"slot {slot} was written"
    # and the numbers: against the float64 reference
    ref = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    ro, rs, _ = kda_reference(**ref, initial_state=h0.cpu(), output_final_state=True)
    assert rel_rmse(o.cpu(), ro) < 6e-3 and rel_rmse(fs.cpu(), rs) < 6e-3


@pytest.mark.parametrize("indices", [[-1, -1, -1, -1], [3, 0, 5, 2]], ids=["all-padding", "all-valid"])
def test_device_path_without_host_indices(indices, device):
    """assume_valid: the indices are never read on the host; all padding writes nothing, all
    valid writes every final state."""
    kw, pool = _case(device)
    idx = torch.tensor(indices, dtype=torch.int64, device=device)
    before = pool.clone()
    _, fs = kdagen.kda_prefill(**kw, state_pool=pool, state_indices=idx, assume_valid=True, output_final_state=True)
    written = {s: n for n, s in enumerate(indices) if s >= 0}
    for slot in range(pool.shape[0]):
        want = fs[written[slot]] if slot in written else before[slot]
        assert torch.equal(_bits(pool[slot]), _bits(want)), slot


def test_host_slots_become_one_cached_device_copy():
    """Slots known on the host (as engines pass them) are copied to the device once per distinct
    list, not per call: every layer of a model's step passes the same slots."""
    from kdagen import state_pool as sp

    pool = torch.randn(6, 2, 4, 4)
    a = sp.gather(pool, torch.tensor([4, 1], dtype=torch.int32), N=2, HV=2, state_shape=(4, 4),
                  device=torch.device("cpu"), state_dtype=None, assume_valid=False)
    b = sp.gather(pool, torch.tensor([4, 1]), N=2, HV=2, state_shape=(4, 4), device=torch.device("cpu"),
                  state_dtype=None, assume_valid=False)
    c = sp.gather(pool, torch.tensor([1, 4]), N=2, HV=2, state_shape=(4, 4), device=torch.device("cpu"),
                  state_dtype=None, assume_valid=False)
    assert a.index is b.index and a.index.tolist() == [4, 1] and c.index.tolist() == [1, 4]
    assert torch.equal(a.initial_state, pool[[4, 1]])


def test_pool_result_is_none_unless_asked(device):
    kw, pool = _case(device, lens=[4, 3])
    o, fs = kdagen.kda_prefill(**kw, state_pool=pool, state_indices=torch.tensor([2, 0], device=device))
    assert fs is None and o.shape == kw["v"].shape


@pytest.mark.parametrize("over, needle", [
    (dict(state_indices=torch.tensor([4, 4, 1, 5])), "state_indices: expected distinct slots (-1 excepted), found slot "
                                                    "4 at positions 0 and 1"),
    (dict(state_indices=torch.tensor([4, 6, 1, 5])), "state_indices: expected slot indices in [0, 6) or -1 (padding), "
                                                    "found 6 at position 1"),
    (dict(state_indices=torch.tensor([4, -2, 1, 5])), "found -2 at position 1"),
    (dict(state_indices=torch.tensor([4, 1, 5])), "state_indices: expected a 1-D int32 or int64 tensor of 4 slot"),
    (dict(state_indices=torch.tensor([4., 1, 5, 0])), "state_indices: expected a 1-D int32 or int64 tensor"),
    (dict(state_pool=torch.zeros(6, 2, 32, 16)), "state_pool: expected a tensor of shape [P, HV, ...] = (P, 2, 32, 32)"),
    (dict(state_pool=torch.zeros(6, 2, 32, 32, dtype=torch.float16)), "state_pool: expected dtype float32 or bfloat16"),
    (dict(state_indices=None), "state_pool, state_indices: expected both"),
    (dict(initial_state=torch.zeros(4, 2, 32, 32)), "initial_state: expected None with state_pool"),
    (dict(state_dtype=torch.bfloat16), "state_dtype: expected torch.float32 (the state pool's dtype) or None"),
])
def test_bad_pool_calls(over, needle):
    kw, pool = _case("cpu")
    call = dict(kw, state_pool=pool, state_indices=torch.tensor([4, -1, 1, 5]))
    call.update(over)
    with pytest.raises(KdaInputError) as ei:
        kdagen.kda_prefill(**call)
    assert needle in str(ei.value), str(ei.value)


@pytest.mark.gpu
@pytest.mark.parametrize("state_layout, state", [("VK", "fp32"), ("KV", "bf16")])
def test_gpu_pool_under_cuda_graph_replays_new_indices(state_layout, state):
    """Captured once with device indices and assume_valid; replayed with new indices (padding
    included) and new contents, it gives what the eager pool call gives, bit for bit."""
    kw, pool = _case("cuda", state_layout, state, lens=[300, 0, 724, 50])
    kw = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v") else t) for n, t in kw.items()}
    idx = torch.tensor([4, -1, 1, 5], dtype=torch.int32, device="cuda")
    out = torch.empty_like(kw["v"])

    def step():
        kdagen.kda_prefill(**kw, out=out, state_pool=pool, state_indices=idx, assume_valid=True)

    graph = capture(step)
    for new in ([0, 3, -1, 2], [-1, -1, 5, 4]):
        idx.copy_(torch.tensor(new, dtype=torch.int32))
        start = (torch.randn(pool.shape, device="cuda") * 0.5).to(pool.dtype)
        pool.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        got_pool, got_o = pool.clone(), out.clone()
        pool.copy_(start)
        want_o, _ = kdagen.kda_prefill(**kw, state_pool=pool, state_indices=idx.cpu())
        assert torch.equal(got_o, want_o) and torch.equal(got_pool, pool), new


@pytest.mark.gpu
def test_gpu_capture_refuses_host_indices_and_host_checks():
    kw, pool = _case("cuda", lens=[20, 12])
    kdagen.kda_prefill(**kw, state_pool=pool, state_indices=torch.tensor([1, 0], device="cuda"))  # warm, eager
    for idx, av, needle in ((torch.tensor([1, 0]), True, "expected a tensor on the GPU under CUDA graph capture"),
                            (torch.tensor([1, 0], device="cuda"), False, "pass assume_valid=True")):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(KdaInputError, match=needle):
            with torch.cuda.graph(graph):
                kdagen.kda_prefill(**kw, state_pool=pool, state_indices=idx, assume_valid=av)


def test_triton_pool_calls_gather_and_its_launcher_refuses_slots(monkeypatch):
    """The Triton kernels take no pool slots: the runtime hands them per-sequence states (the
    gather), and a KdaCall carrying slots is refused rather than run on rows 0..N-1 of the pool."""
    import kdagen.runtime as rt
    from kdagen_dev.launch import capture_call

    kw, pool = _case("cpu")
    name = Variant("triton", 16, 32, 32, "bf16", "bounded", "fp32", 16).name
    idx = torch.tensor([4, -1, 0, 2], dtype=torch.int32)
    calls = []
    real = rt.Plan.pool_call
    monkeypatch.setattr(rt.Plan, "pool_call", lambda self, *a: calls.append(a) or real(self, *a))
    kdagen.kda_prefill(**kw, state_pool=pool, state_indices=idx, variant=name)
    assert not calls  # gathered: no plan took the slots
    call = capture_call(dict(kw, initial_state=pool[:4].clone(), output_final_state=True), name)
    assert call.initial_state.shape[0] == 4 and call.h0_index is None
    call.h0_index = call.ht_index = idx
    with pytest.raises(RuntimeError, match="take no state pool slots"):
        rt.registry().launcher(name, "cpu")(call)


# The kernels that read and write a pool's slots: sm80 (precise record, plain c64, bf16 state) and sm90's
# kda_fused_slots (the pair, block_v 128, bf16 state)
KERNEL_SLOTS = ["kda_fwd_sm80_c16_k128_v128_bf16_gb_sfp32_bv16_hl", "kda_fwd_sm80_c64_k128_v128_bf16_gb_sfp32_bv32",
                "kda_fwd_sm80_c16_k128_v128_bf16_gb_sbf16_bv32", "kda_fwd_sm90_c16_k128_v128_bf16_gb_sfp32_bv64",
                "kda_fwd_sm90_c16_k128_v128_bf16_gb_sfp32_bv128", "kda_fwd_sm90_c16_k128_v128_bf16_gb_sbf16_bv128"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", KERNEL_SLOTS)
@pytest.mark.parametrize("state_layout, lens, segments", [("VK", [300, 0, 724, 50], False),
                                                           ("KV", [1000, 37, 650], False),
                                                           ("VK", [1536], True)],
                         ids=["VK-varlen", "KV-varlen", "one-sequence-in-time-segments"])
def test_gpu_kernels_read_and_write_the_pools_slots(name, state_layout, lens, segments, monkeypatch):
    """The sm80 and sm90 kernels take the pool's slots themselves (no gather or scatter): o and every
    slot bit for bit what the gathered call gives, padding and nobody's slots untouched (NaN there would
    poison any read), and the numbers against float64; sm80 also cut into time segments."""
    import kdagen.runtime as rt
    from kdagen.paths import GENERATED_DIR
    from kdagen.registry import Registry
    from kdagen_dev.launch import launcher_swapped

    monkeypatch.setenv("KDAGEN_POOL_SLOTS", "1")
    entry = Registry.load(GENERATED_DIR).entries.get(name)
    if entry is None:
        pytest.skip(f"{name} is not built")
    v = entry.variant
    if segments and (v.target != "sm80" or v.state != "fp32"):
        pytest.skip("time segments are sm80's, with an fp32 state")
    st = torch.float32 if v.state == "fp32" else torch.bfloat16
    kw = make_case(v, "cuda", H=2, HV=4, lens=lens, seed=3, with_state=False, state_layout=state_layout)
    N = len(lens)
    pool = (torch.randn(N + 3, 4, 128, 128, device="cuda") * 0.3).to(st)
    idx = torch.tensor([N + 2, -1, 0, 2][:N] if N > 1 else [2], dtype=torch.int32)
    nobody = [s for s in range(N + 3) if s not in idx.tolist()]
    pool[nobody] = float("nan")
    start = pool.clone()
    ctx = launcher_swapped(name, "cuda:0", rt.registry().launcher(name, "cuda:0").with_settings(
        min_segment_tokens=192, min_hidden_prep_us=None)) if segments else contextlib.nullcontext()
    calls = []
    real = rt.Plan.pool_call
    monkeypatch.setattr(rt.Plan, "pool_call", lambda self, *a: calls.append(self.launcher) or real(self, *a))
    with ctx:
        o = kdagen.kda_prefill(**kw, state_pool=pool, state_indices=idx, variant=name)[0]
        torch.cuda.synchronize()
        assert len(calls) == 1, "the kernels did not take the slots"
        # again, through the signature's bound launch (bound by the first call; sm80's segments have none)
        pool.copy_(start)
        o = kdagen.kda_prefill(**kw, state_pool=pool, state_indices=idx, variant=name)[0]
        torch.cuda.synchronize()
        assert len(calls) == 2
        if segments:
            assert calls[0].last_segments > 1
        got = pool.clone()
        pool.copy_(start)
        monkeypatch.setattr(rt, "_pool_in_kernel", lambda *a, **k: (None, None))  # gather and scatter
        o2 = kdagen.kda_prefill(**kw, state_pool=pool, state_indices=idx, variant=name)[0]
        torch.cuda.synchronize()
    assert torch.equal(o, o2)
    assert torch.equal(_bits(got), _bits(pool))  # every slot, NaN ones included, bit for bit
    assert torch.equal(_bits(got[nobody]), _bits(start[nobody]))
    h0 = start[idx.clamp(min=0).long()].float()
    h0[idx < 0] = 0
    ref = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    ro, rs, _ = kda_reference(**ref, initial_state=h0.cpu(), output_final_state=True)
    real_rows = [n for n in range(N) if idx[n] >= 0]
    assert rel_rmse(o.cpu(), ro) < 6e-3
    assert rel_rmse(got[idx[real_rows].long()].float().cpu(), rs[real_rows]) < 6e-3
