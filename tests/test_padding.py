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


def test_kdagen_list_v_shows_what_each_target_covers():
    res = CliRunner().invoke(main, ["list", "-v", "--spec", "ci", "--filter", "none"])
    assert res.exit_code == 0, res.output
    assert ("- triton: head dims 16/32/48/64/80/96/112/128/144/160/176/192/208/224/240/256 (other sizes up to 256 "
            "by padding)," in res.output)
    assert "- sm80: head dims 64/128 (other sizes up to 128 by padding, none above 128)" in res.output
    assert "the runtime zero-pads any other K, V up to 256" in res.output


@pytest.mark.gpu
@pytest.mark.parametrize("K, V", [(60, 60), (100, 100), (32, 128), (96, 64)])
def test_gpu_padded_head_dims(K, V):
    """On the GPU (sm80 for bf16: 64/128, padded): matches the float64 reference."""
    v = Variant("sm80", 16, K, V, "bf16", "bounded", "fp32", 32)
    kw = make_case(v, "cuda", H=2, HV=4, lens=[300, 0, 724])
    o, s = kdagen.kda_prefill(**kw)
    print(K, V, rt.prepare(**kw).variant.name)
    ref = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    ro, rs, _ = kda_reference(**ref)
    assert rel_rmse(o.cpu(), ro) < 6e-3 and rel_rmse(s.cpu(), rs) < 6e-3
