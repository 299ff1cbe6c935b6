"""torch.ops.kdagen.kda_prefill: the torch library op (schema, fake implementation, in-place
outputs), torch.compile(fullgraph=True) of a module calling kdagen with varlen input, opcheck,
and (on a GPU) a CUDA graph that replays with new values and new cu_seqlens contents.

CPU runs go through the Triton interpreter; `pytest -m gpu` runs the CUDA versions (the
variant selection picks what the GPU has built: sm80 for bf16 K=V=128)."""

from __future__ import annotations

import pytest
import torch

import kdagen
import kdagen.runtime as rt
from kdagen.reference import kda_reference, rel_rmse

from .cuda_graphs import capture
from .runtime_env import fresh_runtime  # noqa: F401
from .test_runtime_errors import inputs


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()


def _op_args(kw, cu, h0, out, fs):
    return (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], kw["A_log"], kw["dt_bias"], h0, cu, None, out, fs,
            None, None)


def _case(device="cpu", dtype=torch.float32, K=32, H=1, HV=2, lens=(7, 13), seed=0):
    kw = inputs(T=sum(lens), H=H, HV=HV, K=K, V=K, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    h0 = torch.randn(len(lens), HV, K, K, generator=gen) * 0.5
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = {n: t.to(device) for n, t in kw.items()}
    return kw, cu.to(device), h0.to(device)


def test_op_writes_its_outputs_in_place():
    kw, cu, h0 = _case()
    want_o, want_s = kdagen.kda_prefill(**kw, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    out, fs = torch.full_like(kw["v"], float("nan")), torch.full_like(h0, float("nan"))
    assert torch.ops.kdagen.kda_prefill(*_op_args(kw, cu, h0, out, fs)) is None
    assert torch.equal(out, want_o) and torch.equal(fs, want_s)
    ro, rs, _ = kda_reference(**kw, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    assert rel_rmse(out, ro) < 1e-5 and rel_rmse(fs, rs) < 1e-5


def test_op_with_beta_probabilities_matches_kda_prefill():
    kw, cu, h0 = _case()
    kw["beta"] = torch.sigmoid(kw["beta"])
    want_o, want_s = kdagen.kda_prefill(**kw, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                                        beta_is_logit=False)
    plans = len(rt._PLANS)
    out, fs = torch.full_like(kw["v"], float("nan")), torch.full_like(h0, float("nan"))
    torch.ops.kdagen.kda_prefill(*_op_args(kw, cu, h0, out, fs), beta_is_logit=False)
    # its own signature (out= and final_state= given), served by the op's positional entry
    assert torch.equal(out, want_o) and torch.equal(fs, want_s) and len(rt._PLANS) == plans + 1
    ro, rs, _ = kda_reference(**kw, cu_seqlens=cu, initial_state=h0, output_final_state=True, beta_is_logit=False)
    assert rel_rmse(out, ro) < 1e-5 and rel_rmse(fs, rs) < 1e-5


def test_opcheck_passes():
    kw, cu, h0 = _case()
    args = _op_args(kw, cu, h0, torch.empty_like(kw["v"]), torch.empty_like(h0))
    res = torch.library.opcheck(torch.ops.kdagen.kda_prefill.default, args)
    assert set(res.values()) == {"SUCCESS"}, res


def _engine_op_args(kw, cu, h0):
    """The op with a state pool (a padding slot), checkpoints and beta probabilities."""
    pool = torch.cat([h0, torch.randn(2, *h0.shape[1:])])
    idx = torch.tensor([3, -1], dtype=torch.int32)
    ckpt = torch.full((2, *h0.shape[1:]), float("nan"))  # 13 // 8 = 1 row (the 7-token sequence has none)
    args = (kw["q"], kw["k"], kw["v"], kw["g"], torch.sigmoid(kw["beta"]), kw["A_log"], kw["dt_bias"], None, cu,
            None, torch.empty_like(kw["v"]), None, None, None, pool, idx, ckpt, None)
    return args, dict(beta_is_logit=False, checkpoint_every=16, chunk_size=16)


def test_op_with_state_pool_checkpoints_and_beta_probabilities():
    kw, cu, h0 = _case(lens=(7, 20))
    args, kwargs = _engine_op_args(kw, cu, h0)
    pool, ckpt = args[14].clone(), args[16]
    torch.ops.kdagen.kda_prefill(*args, **kwargs)
    o, fs, ck = kdagen.kda_prefill(**dict(kw, beta=args[4]), beta_is_logit=False, cu_seqlens=cu, state_pool=pool,
                                   state_indices=args[15], checkpoint_every=16, chunk_size=16)
    assert torch.equal(args[10], o) and torch.equal(args[14], pool) and torch.equal(ckpt[:1], ck)
    assert torch.isnan(ckpt[1:]).all()
    res = torch.library.opcheck(torch.ops.kdagen.kda_prefill.default, args, kwargs)
    assert set(res.values()) == {"SUCCESS"}, res


class Mixer(torch.nn.Module):
    """What an engine's layer does around KDA: a projection in, the op, a projection out."""

    def forward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu):
        o, s = kdagen.kda_prefill(q * 1.0, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0,
                                  output_final_state=True, cu_seqlens=cu)
        return o * 2.0, s


def _compiled_matches_eager(device, backend, dtype=torch.float32, K=32):
    kw, cu, h0 = _case(device, dtype=dtype, K=K)
    args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], kw["A_log"], kw["dt_bias"], h0, cu)
    eager = Mixer()(*args)
    compiled = torch.compile(Mixer(), fullgraph=True, backend=backend, dynamic=True)
    got = compiled(*args)
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    # new offsets (same capacity) and new values: no recompile needed for a data change
    kw2, cu2, h02 = _case(device, dtype=dtype, K=K, lens=(15, 5), seed=3)
    args2 = (kw2["q"], kw2["k"], kw2["v"], kw2["g"], kw2["beta"], kw2["A_log"], kw2["dt_bias"], h02, cu2)
    got2, eager2 = compiled(*args2), Mixer()(*args2)
    assert torch.equal(got2[0], eager2[0]) and torch.equal(got2[1], eager2[1])


def test_fullgraph_compile_with_varlen_traces_and_matches_eager():
    _compiled_matches_eager("cpu", "aot_eager")


class PoolMixer(torch.nn.Module):
    """An engine's layer with its state cache: slots per sequence, beta as probabilities."""

    def forward(self, q, k, v, g, beta, A_log, dt_bias, pool, idx, cu):
        o, _ = kdagen.kda_prefill(q, k, v, g, torch.sigmoid(beta), A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu,
                                  state_pool=pool, state_indices=idx, beta_is_logit=False, assume_valid=True)
        return o * 2.0


def test_fullgraph_compile_with_a_state_pool_matches_eager():
    kw, cu, h0 = _case()
    idx = torch.tensor([1, -1], dtype=torch.int32)
    pools = [torch.cat([torch.randn(1, *h0.shape[1:]), h0]) for _ in range(2)]
    pools[1].copy_(pools[0])
    start = pools[0].clone()
    args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], kw["A_log"], kw["dt_bias"])
    eager = PoolMixer()(*args, pools[0], idx, cu)
    got = torch.compile(PoolMixer(), fullgraph=True, backend="aot_eager")(*args, pools[1], idx, cu)
    assert torch.equal(got, eager) and torch.equal(pools[0], pools[1])
    assert not torch.equal(pools[1][1], start[1]) and torch.equal(pools[1][0], start[0])  # slot 1 written, 0 not


@pytest.mark.gpu
def test_gpu_fullgraph_compile_inductor():
    _compiled_matches_eager("cuda", "inductor", dtype=torch.bfloat16, K=128)


@pytest.mark.gpu
def test_gpu_opcheck():
    kw, cu, h0 = _case("cuda", dtype=torch.bfloat16, K=128)
    args = _op_args(kw, cu, h0, torch.empty_like(kw["v"]), torch.empty_like(h0))
    res = torch.library.opcheck(torch.ops.kdagen.kda_prefill.default, args)
    assert set(res.values()) == {"SUCCESS"}, res


@pytest.mark.gpu
@pytest.mark.parametrize("through_op", [False, True], ids=["kda_prefill", "torch_op"])
def test_gpu_cuda_graph_replays_new_values_and_offsets(through_op):
    """Captured once with assume_valid=True; replayed with new inputs copied into the same
    buffers and new cu_seqlens contents of the same capacity, it gives what an eager call on
    those inputs gives (same variant, so bit for bit) and matches the reference."""
    lens_a, lens_b = (300, 0, 724), (1000, 20, 4)
    kw, cu, h0 = _case("cuda", dtype=torch.bfloat16, K=128, H=2, HV=4, lens=lens_a)
    out, fs = torch.empty_like(kw["v"]), torch.empty_like(h0)

    def step():
        if through_op:
            torch.ops.kdagen.kda_prefill(*_op_args(kw, cu, h0, out, fs), assume_valid=True)
        else:
            kdagen.kda_prefill(**kw, cu_seqlens=cu, initial_state=h0, out=out, final_state=fs, assume_valid=True)

    graph = capture(step)
    for lens, seed in ((lens_a, 5), (lens_b, 6)):
        new, new_cu, new_h0 = _case("cuda", dtype=torch.bfloat16, K=128, H=2, HV=4, lens=lens, seed=seed)
        for n in kw:
            kw[n].copy_(new[n])
        cu.copy_(new_cu)
        h0.copy_(new_h0)
        out.fill_(float("nan"))
        fs.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want_o, want_s = kdagen.kda_prefill(**new, cu_seqlens=new_cu, initial_state=new_h0, output_final_state=True)
        assert torch.equal(out, want_o) and torch.equal(fs, want_s), lens
        ro, rs, _ = kda_reference(**{n: t.cpu() for n, t in new.items()}, cu_seqlens=new_cu.cpu(),
                                  initial_state=new_h0.cpu(), output_final_state=True)
        assert rel_rmse(out.cpu(), ro) < 5e-3 and rel_rmse(fs.cpu(), rs) < 5e-3, lens


@pytest.mark.gpu
def test_gpu_capture_without_host_offsets_needs_assume_valid():
    kw, cu, h0 = _case("cuda", dtype=torch.bfloat16, K=128)
    out = torch.empty_like(kw["v"])
    kdagen.kda_prefill(**kw, cu_seqlens=cu, out=out)  # warm (this one reads the offsets: eager)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(kdagen.runtime.KdaInputError, match="cannot be read during CUDA graph capture; pass "
                                                           "assume_valid=True"):
        with torch.cuda.graph(graph):
            kdagen.kda_prefill(**kw, cu_seqlens=cu, out=out)


def test_compiled_calls_refuse_a_chunk_state_stride():
    # torch.compile's path sizes chunk_states from shapes alone and the op keeps every chunk's
    from kdagen.errors import KdaInputError
    from kdagen.ops import traced_prefill

    kw, cu, h0 = _case()
    flags = dict(scale=None, lower_bound=-5.0, gate=None, initial_state=h0, output_final_state=True, cu_seqlens=None,
                 cu_seqlens_cpu=None, layout="BSND", state_layout="VK", state_dtype=None, use_qk_l2norm=True,
                 allow_neg_eigval=False, chunk_size=16, variant=None, out=None, final_state=None, chunk_states=None,
                 workspace=None, assume_valid=False)
    with pytest.raises(KdaInputError, match="return_chunk_states: expected True or False under torch.compile"):
        traced_prefill(**kw, **dict(flags, return_chunk_states=2, initial_state=h0[:1]))
