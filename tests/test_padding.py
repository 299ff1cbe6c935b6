"""Head dims no variant has: zero padding to the next size one has, exact (the padded call is
the native call on zero-padded inputs, bit for bit, and the padded o columns come out 0),
finite under the strongest gates, and chosen by target rank first, then the least padding."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

import kdagen
import kdagen.runtime as rt
import kdagen.select as sel
from kdagen.cli import main
from kdagen.padding import choose_covering
from kdagen.reference import kda_reference, rel_rmse
from kdagen.select import Candidate
from kdagen.variant import Variant

from kdagen.cases import make_case
from .runtime_env import fresh_runtime  # noqa: F401
from .test_select import info, var


def _padded(t, n, dims=(-1,)):
    out = t
    for d in dims:
        shape = list(out.shape)
        shape[d] = n[d] if isinstance(n, dict) else n
        z = out.new_zeros(shape)
        z.narrow(d, 0, out.shape[d]).copy_(out)
        out = z
    return out


def test_padded_call_is_the_native_call_on_zero_padded_inputs(device):
    """K=60, V=40 (BNSD, KV state, caller's out/final_state/chunk_states buffers): equal, bit for
    bit, to the variant it pads to run on explicitly zero-padded inputs with scale 1/sqrt(60)."""
    v = Variant("triton", 16, 60, 40, "bf16", "bounded", "fp32", 16)
    kw = make_case(v, device, H=1, HV=2, lens=[9, 14], layout="BNSD", state_layout="KV", chunk_states=True)
    plan = rt.prepare(**kw)
    Kp, Vp = plan.variant.k, plan.variant.v
    assert Kp >= 60 and Vp >= 40 and (Kp, Vp) != (60, 40), plan.variant.name
    nan = float("nan")
    out = torch.full_like(kw["v"], nan)
    fs = torch.full_like(kw["initial_state"], nan)
    cs = torch.full((2, 2, 60, 40), nan, device=device)  # one chunk of 16 per sequence
    o, s, c = kdagen.kda_prefill(**kw, out=out, final_state=fs, chunk_states=cs)
    assert o is out and s is fs and c is cs

    native = dict(kw, q=_padded(kw["q"], Kp), k=_padded(kw["k"], Kp), g=_padded(kw["g"], Kp),
                  v=_padded(kw["v"], Vp), dt_bias=_padded(kw["dt_bias"], Kp),
                  initial_state=_padded(kw["initial_state"], {-2: Kp, -1: Vp}, dims=(-2, -1)), scale=60 ** -0.5)
    no, ns, nc = kdagen.kda_prefill(**native, variant=plan.variant.name)
    assert torch.equal(o, no[..., :40]) and torch.equal(no[..., 40:], torch.zeros_like(no[..., 40:]))
    assert torch.equal(s, ns[..., :60, :40]) and torch.equal(c, nc[..., :60, :40])
    # the padded state rows and columns stay exactly zero
    assert not ns[..., 60:, :].any() and not ns[..., :, 40:].any()
    ref = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items() if n not in ("state_dtype",)}
    cs_size = ref.pop("chunk_size")
    ref.pop("return_chunk_states")
    ro, rs, rc = kda_reference(**ref, chunk_states_size=cs_size)
    assert rel_rmse(o.cpu(), ro) < 6e-3 and rel_rmse(s.cpu(), rs) < 6e-3 and rel_rmse(c.cpu(), rc) < 6e-3


@pytest.mark.parametrize("gate, scenario", [("unbounded", "g=+8"), ("unbounded", "dt=+8"), ("precomputed", "normal")])
def test_padded_gate_channels_stay_finite_under_strong_decay(gate, scenario, device):
    """Padded channels get g = 0, dt_bias = 0: a finite decay on state columns that stay zero,
    whatever the real channels' gates do."""
    v = Variant("triton", 16, 60, 60, "bf16", gate, "fp32", 16)
    kw = make_case(v, device, H=1, HV=2, T=20, gate_scenario=scenario, A_log_scale=2.0)
    o, s = kdagen.kda_prefill(**kw)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    ref = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    ro, rs, _ = kda_reference(**ref)
    assert rel_rmse(o.cpu(), ro) < 6e-3 and rel_rmse(s.cpu(), rs) < 6e-3


@pytest.fixture
def any_device(monkeypatch):
    monkeypatch.setattr(sel, "device_reason", lambda target, device: None)
    monkeypatch.setattr(sel, "_sm_count", lambda device: 132)


def test_covering_choice_target_rank_then_least_padding(any_device):
    c = info(K=60, V=100)
    cands = [Candidate(x) for x in (var("triton", k=64, v=112), var("triton", k=64, v=128), var("triton", k=48, v=128),
                                    var("sm80", k=128, v=128), var("sm80", k=64, v=128))]
    best, binfo, rejected = choose_covering(cands, c)
    assert best.variant == var("sm80", k=64, v=128) and (binfo.K, binfo.V) == (64, 128)  # rank over padding
    best, binfo, rejected = choose_covering(cands[:3], c)
    assert best.variant == var("triton", k=64, v=112)  # least padding within a target
    assert [why for x, why in rejected] == ["head dims K=48,V=128 != K=60,V=100"]
    # the exact size wins over any padding of the same target
    best, _, _ = choose_covering(cands[:3] + [Candidate(var("triton", k=60, v=100))], c)
    assert (best.variant.k, best.variant.v) == (60, 100)


@pytest.mark.parametrize("K, V", [(256, 256), (192, 192), (160, 200), (256, 64), (129, 129)])
def test_head_dims_above_128_are_served_by_sm80_k256_on_sm90(K, V, monkeypatch):
    """On an sm_90 device with the shipped specs' variants (all taken as built): a D = 256 call is
    the sm80 K = 256 variant's own, and K or V above 128 is zero-padded to it (not to Triton's
    exact size: a CUDA kernel padded ranks first); B1 H16 takes block_v 32 (128 programs), with the precise
    record (specs/h800.yaml builds both records: dispatch takes the precise one)."""
    from kdagen.paths import GENERATED_DIR
    from kdagen.registry import Registry

    monkeypatch.setattr(sel, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(sel, "_sm_count", lambda device: 132)
    cands = [Candidate(v) for v in Registry.load(GENERATED_DIR).variants()]
    best, binfo, _ = choose_covering(cands, info(K=K, V=V, H=16, HV=16))
    assert best.variant.name == "kda_fwd_sm80_c16_k256_v256_bf16_gb_sfp32_bv32_hl"
    assert (binfo.K, binfo.V) == (256, 256)
    best, binfo, _ = choose_covering(cands, info(K=100, V=128, H=16, HV=16))
    assert (best.variant.target, best.variant.k, best.variant.v) == ("sm80", 128, 128)  # 128 stays 128


def test_d192_call_launches_the_k256_kernels_on_padded_inputs(monkeypatch):
    """kda_prefill at K = V = 192 over the sm80 launcher (fake driver, CPU tensors): the plan
    pads to the K = 256 variant, both kernels get contiguous K = 256 rows (strides of the
    padded q, k, v, g), the recurrence grid is 256 / block_v V blocks, and o and the final
    state come back at 192."""
    from kdagen.targets.cuda_launch import KdaParams

    from .fake_cuda import route_launcher, sm80_on_cpu

    monkeypatch.setattr(sel, "device_reason", lambda target, device: None)
    monkeypatch.setattr(sel, "_sm_count", lambda device: 132)
    v192 = Variant("sm80", 16, 192, 192, "bf16", "bounded", "fp32", 32)
    kw = make_case(v192, "cpu", B=1, T=40, H=2, HV=2, seed=5)
    with sm80_on_cpu(Variant("sm80", 16, 256, 256, "bf16", "bounded", "fp32", 32)) as (la, drv), \
            route_launcher(la):
        o, s = kdagen.kda_prefill(**kw)
        plan = rt.prepare(**kw)
    assert (plan.variant.target, plan.variant.chunk, plan.variant.k, plan.variant.v) == ("sm80", 16, 256, 256)
    assert o.shape == kw["v"].shape and s.shape == kw["initial_state"].shape
    prep, recur = drv.launches
    assert prep[1] == (3, 1, 2) and recur[1] == (256 // 32, 1, 2)  # 40 tokens: 3 chunks; V blocks of la's 32
    p = KdaParams.from_buffer_copy(recur[5])
    assert list(p.q_s)[:2] == [40 * 2 * 256, 2 * 256] and list(p.v_s)[:2] == [40 * 2 * 256, 2 * 256]
    assert list(p.g_s)[:2] == [40 * 2 * 256, 2 * 256] and p.scale == pytest.approx(192 ** -0.5)


def test_kdagen_list_v_shows_what_each_target_covers():
    res = CliRunner().invoke(main, ["list", "-v", "--spec", "ci", "--filter", "none"])
    assert res.exit_code == 0, res.output
    assert ("- triton: head dims 16/32/48/64/80/96/112/128/144/160/176/192/208/224/240/256 (other sizes up to 256 "
            "by padding)," in res.output)
    assert "- sm80: head dims 64/128/256 (other sizes up to 256 by padding)," in res.output
    assert "the runtime zero-pads any other K, V up to 256" in res.output


@pytest.mark.gpu
@pytest.mark.parametrize("K, V", [(60, 60), (100, 100), (32, 128), (96, 64), (192, 192), (256, 100)])
def test_gpu_padded_head_dims(K, V):
    """On the GPU (sm80 for bf16: 64/128/256, padded): matches the float64 reference."""
    v = Variant("sm80", 16, K, V, "bf16", "bounded", "fp32", 32)
    kw = make_case(v, "cuda", H=2, HV=4, lens=[300, 0, 724])
    o, s = kdagen.kda_prefill(**kw)
    print(K, V, rt.prepare(**kw).variant.name)
    ref = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    ro, rs, _ = kda_reference(**ref)
    assert rel_rmse(o.cpu(), ro) < 6e-3 and rel_rmse(s.cpu(), rs) < 6e-3


def test_padded_call_keeps_strided_chunk_states(device):
    """return_chunk_states=m through padding: the inner call keeps every m-th chunk state, sliced
    back; allocate_outputs sizes the buffer for that stride."""
    from kdagen.cases import check_chunk_stride

    v = Variant("triton", 16, 60, 40, "bf16", "bounded", "fp32", 16)
    lens = [40, 0, 70]
    kw = make_case(v, device, H=1, HV=2, lens=lens, chunk_states=True, seed=4)
    kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
    plan = rt.prepare(**kw)
    assert (plan.variant.k, plan.variant.v) != (60, 40)
    check_chunk_stride(plan.variant, kw, lens, strides=(2,))
    bufs = kdagen.allocate_outputs(**dict(kw, return_chunk_states=2))
    assert bufs["chunk_states"].shape == (2 + 0 + 3, 2, 40, 60)
