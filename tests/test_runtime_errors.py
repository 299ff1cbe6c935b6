"""Bad calls to kda_prefill get errors naming the argument, the expectation and the finding."""

from __future__ import annotations

import pytest
import torch

from kdagen import kda_prefill
from kdagen.errors import KdaInputError, NoVariantError
from kdagen.reference import kda_reference, rel_rmse


def inputs(B=1, T=20, H=1, HV=2, K=32, V=32, dtype=torch.float32, layout="BSND"):
    g = torch.Generator().manual_seed(0)
    def r(*s):
        return torch.randn(*s, generator=g)
    if layout == "BSND":
        return dict(q=r(B, T, H, K).to(dtype), k=r(B, T, H, K).to(dtype), v=r(B, T, HV, V).to(dtype),
                    g=r(B, T, HV, K), beta=r(B, T, HV), A_log=r(HV), dt_bias=r(HV, K))
    return dict(q=r(B, H, T, K).to(dtype), k=r(B, H, T, K).to(dtype), v=r(B, HV, T, V).to(dtype),
                g=r(B, HV, T, K), beta=r(B, HV, T), A_log=r(HV), dt_bias=r(HV, K), layout="BNSD")


def call(**over):
    kw = inputs()
    kw.update(over)
    return kda_prefill(**kw)


@pytest.mark.parametrize("over, needle", [
    (dict(layout="BTHD"), "layout: expected 'BSND' or 'BNSD', found 'BTHD'"),
    (dict(state_layout="XY"), "state_layout: expected 'VK'"),
    (dict(k=torch.randn(1, 20, 1, 32).to(torch.bfloat16)), "k: expected dtype torch.float32 (same as q), found torch.bfloat16"),
    (dict(v=torch.randn(1, 21, 2, 32)), "v: expected shape [B, T, HV, V] = (1, 20, 2, 32)"),
    (dict(g=torch.randn(1, 20, 2, 16)), "g: expected shape [B, T, HV, K] = (1, 20, 2, 32)"),
    (dict(beta=torch.randn(1, 20)), "beta: expected shape (1, 20, 2)"),
    (dict(q=torch.randn(1, 20, 32)), "q: expected 4 dims"),
    (dict(v=torch.randn(1, 20, 3, 32), g=torch.randn(1, 20, 3, 32), beta=torch.randn(1, 20, 3), A_log=torch.randn(3), dt_bias=torch.randn(3, 32), q=torch.randn(1, 20, 2, 32), k=torch.randn(1, 20, 2, 32)),
     "v: expected a number of value heads HV that is a multiple of the q/k heads H=2, found HV=3"),
    (dict(A_log=torch.randn(5)), "A_log: expected 2 elements (one per value head)"),
    (dict(A_log=None, lower_bound=-5.0, gate="bounded"), "A_log: expected a tensor of shape (2,) for the bounded gate"),
    (dict(dt_bias=torch.randn(7)), "dt_bias: expected a tensor of shape (2, 32) or (64,)"),
    (dict(lower_bound=3.0), "lower_bound: expected a finite number <= 0"),
    (dict(gate="sigmoid"), "gate: expected one of bounded, unbounded, precomputed"),
    (dict(gate="precomputed"), "A_log: expected None for the precomputed gate (g is already the log-decay)"),
    (dict(gate="precomputed", A_log=None), "dt_bias: expected None for the precomputed gate"),
    (dict(cu_seqlens=torch.tensor([0, 5, 19], dtype=torch.int32)), "cu_seqlens: expected non-decreasing offsets from 0 to T=20, found [0, 5, 19]"),
    (dict(cu_seqlens=torch.tensor([0, 5, 20], dtype=torch.float32)), "cu_seqlens: expected a 1-D int32 or int64 tensor"),
    (dict(initial_state=torch.randn(1, 2, 32, 16)), "initial_state: expected shape [N, HV, V, K] = (1, 2, 32, 32)"),
    (dict(initial_state=torch.randn(1, 2, 32, 32).half()), "initial_state: expected dtype float32 or bfloat16"),
    (dict(chunk_size=32), "chunk_size: expected 16, 64 or None, found 32"),
    (dict(return_chunk_states=True), "chunk_size: expected 16 or 64 when return_chunk_states=True"),
    (dict(return_chunk_states=0, chunk_size=16), "return_chunk_states: expected True, False or a stride m >= 1 "
                                                 "(the state entering every m-th chunk), found 0"),
    (dict(return_chunk_states=2.0, chunk_size=16), "return_chunk_states: expected True, False or a stride m >= 1"),
    (dict(return_chunk_states=2, chunk_size=16, checkpoint_every=48),
     "checkpoint_every: expected a multiple of chunk_size x return_chunk_states = 32 (the chunk states kept), found 48"),
    (dict(return_chunk_states=True, checkpoint_every=64), "chunk_size: expected 16 or 64 when return_chunk_states=True"),
    (dict(q=torch.randn(1, 20, 1, 64)[..., ::2]), "q: expected a contiguous last (feature) dimension"),
])
def test_bad_call_messages(over, needle):
    with pytest.raises(KdaInputError) as ei:
        call(**over)
    assert needle in str(ei.value), str(ei.value)


def test_varlen_needs_batch_one():
    kw = inputs(B=2)
    with pytest.raises(KdaInputError, match="q: expected batch size 1 when cu_seqlens is given"):
        kda_prefill(**kw, cu_seqlens=torch.tensor([0, 20]))


def test_miss_without_jit_names_the_variant_and_its_build_command(monkeypatch):
    # no registered variant has K = 192 and, without JIT, none may be generated for it
    monkeypatch.setenv("KDAGEN_DISABLE_JIT", "1")
    with pytest.raises(NoVariantError) as ei:
        kda_prefill(**inputs(K=192, V=192, T=4))
    msg = str(ei.value)
    assert "Would fit if built: kda_fwd_triton_c16_k192_v192_fp32_gb_snone_bv" in msg
    assert "KDAGEN_DISABLE_JIT=1 forbids generating it now (`kdagen build --variant kda_fwd_triton_c16_k192" in msg


def test_miss_shows_supported_found_and_what_targets_support(monkeypatch):
    # a target that may not generate variants on demand: the call at K = 192 fits nothing, built or not
    import dataclasses

    from kdagen.targets import TARGETS

    monkeypatch.setitem(TARGETS, "triton", dataclasses.replace(TARGETS["triton"], on_demand=False))
    kw = inputs(K=192, V=192, T=4)
    with pytest.raises(NoVariantError) as ei:
        kda_prefill(**kw)
    msg = str(ei.value)
    assert "Found:     dtype=fp32 K=192 V=192 layout=bsnd gate=bounded" in msg
    assert "Supported (" in msg and "candidate variants on cpu" in msg and "head dims K=32,V=32 != K=192,V=192" in msg
    assert "sm80:" not in msg.split("Rejections")[0], "variants of other devices crowd the list"
    assert "What the targets of this device support:" in msg
    assert "triton: dtype fp32/bf16/fp16, head dims 16/32/48/64/80/96/112/128/144/160/176/192/208/224/240/256" in msg
    assert "Head dims: K=192 V=192; a call whose head dims no variant has is zero-padded to the next size a " \
           "target builds (triton up to 256" in msg


def test_head_dims_above_256_are_rejected():
    with pytest.raises(KdaInputError, match="q: expected a head dim K from 1 to 256, found K=257"):
        kda_prefill(**inputs(K=257, V=32, T=4))
    with pytest.raises(KdaInputError, match="v: expected a head dim V from 1 to 256, found V=300"):
        kda_prefill(**inputs(K=32, V=300, T=4))


def test_forcing_an_unknown_variant():
    with pytest.raises(NoVariantError, match="variant 'kda_fwd_nope' is not registered and cannot be generated: "
                                             "'kda_fwd_nope' is not a variant name; expected kda_fwd_<target>_c"):
        call(variant="kda_fwd_nope")
    with pytest.raises(NoVariantError, match="triton has no head dim K 24"):
        call(variant="kda_fwd_triton_c16_k24_v24_fp32_gb_sfp32_bv16")


def test_forcing_a_variant_that_does_not_fit():
    with pytest.raises(NoVariantError, match=r"variant 'kda_fwd_triton_c16_k64_v64_bf16_gb_sfp32_bv32' \(from "
                                             r"variant=\) cannot serve this call: dtype bf16 != fp32"):
        call(variant="kda_fwd_triton_c16_k64_v64_bf16_gb_sfp32_bv32")


@pytest.mark.parametrize("over, needle", [
    (dict(out=torch.empty(1, 20, 2, 16)), "out: expected a tensor like v (shape (1, 20, 2, 32), dtype torch.float32"),
    (dict(out=torch.empty(1, 20, 2, 32, dtype=torch.float64)), "found shape (1, 20, 2, 32), dtype torch.float64"),
    (dict(out=torch.empty(1, 20, 2, 64)[..., ::2]), "last stride 2"),
    (dict(final_state=torch.empty(1, 2, 32, 16)), "final_state: expected shape [N, HV, V, K] = (1, 2, 32, 32)"),
    (dict(final_state=torch.empty(1, 2, 32, 32).half()), "final_state: expected dtype float32 or bfloat16"),
    (dict(final_state=torch.empty(1, 2, 32, 64)[..., ::2]), "final_state: expected a contiguous tensor"),
    (dict(initial_state=torch.randn(1, 2, 32, 32), final_state=torch.empty(1, 2, 32, 32, dtype=torch.bfloat16)),
     "final_state: expected dtype torch.float32 (as initial_state: one state dtype per call), found torch.bfloat16"),
    (dict(chunk_states=torch.empty(2, 2, 32, 32)), "chunk_size: expected 16 or 64 when return_chunk_states=True"),
    (dict(chunk_states=torch.empty(2, 3, 32, 32), chunk_size=16),
     "chunk_states: expected shape [rows, HV, V, K] = (rows, 2, 32, 32)"),
    (dict(chunk_states=torch.empty(1, 2, 32, 32), chunk_size=16),
     "chunk_states: expected at least 2 rows (one per chunk of every sequence), found 1"),
    (dict(workspace=torch.empty(64, dtype=torch.uint8)[::2]), "workspace: expected a contiguous tensor on cpu"),
    (dict(cu_seqlens_cpu=torch.tensor([0, 20])), "cu_seqlens_cpu: expected None without cu_seqlens"),
])
def test_bad_buffers(over, needle):
    with pytest.raises(KdaInputError) as ei:
        call(**over)
    assert needle in str(ei.value), str(ei.value)


def test_forward_only_refuses_autograd_inputs():
    kw = inputs()
    kw["q"].requires_grad_(True)
    with pytest.raises(KdaInputError, match="q: expected tensors without autograd history: kda_prefill is forward-only"):
        kda_prefill(**kw)
    with torch.no_grad():
        o, _ = kda_prefill(**kw)
    ro, _, _ = kda_reference(**{n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in kw.items()})
    assert rel_rmse(o, ro) < 1e-5  # fp32 inputs: rounding alone


def test_cu_seqlens_cpu_is_used_and_checked():
    kw = inputs()
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    o1, _ = kda_prefill(**kw, cu_seqlens=cu)
    o2, _ = kda_prefill(**kw, cu_seqlens=cu, cu_seqlens_cpu=cu.clone().long())
    ro, _, _ = kda_reference(**kw, cu_seqlens=cu)
    assert rel_rmse(o1, ro) < 1e-5 and torch.equal(o1, o2)  # the same call, its offsets read on the host
    with pytest.raises(KdaInputError, match=r"cu_seqlens_cpu: expected a CPU tensor of shape \(3\)"):
        kda_prefill(**kw, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 20]))
    with pytest.raises(KdaInputError, match="cu_seqlens: expected non-decreasing offsets from 0 to T=20"):
        kda_prefill(**kw, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 25, 20]))
