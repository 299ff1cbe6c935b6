"""kdagen.chunk_kda: fla's chunk_kda keywords with fla's meaning, checked against fla's naive
reference (fla.ops.kda.naive) on fla-shaped inputs: head dims 32 to 256 (60 and 100 by zero
padding), K != V, GVA, bf16 and fp16, both in-kernel gate forms and the precomputed one, beta as
probability or logit, both state layouts, varlen; intermediate states; what is not implemented
is rejected by name. CPU runs use the Triton interpreter; `pytest -m gpu` the GPU's kernels."""

from __future__ import annotations

import math

import pytest
import torch

import kdagen
from kdagen.errors import KdaInputError, NoVariantError
from kdagen.reference import kda_reference, rel_rmse

from .fla_cases import fla_case, fla_chunk_kda_args, fla_naive
from .runtime_env import fresh_runtime  # noqa: F401

pytest.importorskip("fla.ops.kda.naive")

# (id, fla_case keywords): each a different corner, kept small for the interpreter
CASES = [
    ("D32-bf16-bounded-varlen-logits", dict(D=32, lens=[7, 0, 13], gate="bounded")),
    ("D60-bf16-unbounded-prob-vfirst", dict(D=60, T=20, gate="unbounded", beta_logits=False, state_v_first=True)),
    ("D64-fp16-precomputed-nol2norm", dict(D=64, T=20, dtype=torch.float16, gate="precomputed", l2norm=False)),
    ("D100-bf16-bounded_noA-B2", dict(D=100, B=2, T=18, H=2, HV=4, gate="bounded_no_A")),
    ("D128-bf16-bounded-negeig-varlen", dict(D=128, lens=[9, 11], gate="bounded", neg_eigval=True)),
    ("D192-bf16-bounded", dict(D=192, T=20, gate="bounded")),
    ("D256-fp16-unbounded-varlen", dict(D=256, lens=[5, 12], dtype=torch.float16, gate="unbounded")),
    ("K32V60-fp16-unbounded-nostate", dict(D=32, V=60, T=20, dtype=torch.float16, gate="unbounded",
                                           with_state=False)),
]


def _check(kw, tol=6e-3):
    args, fkw = fla_chunk_kda_args(kw)
    with torch.inference_mode():
        o, s = kdagen.chunk_kda(*args, **fkw)
    ro, rs = fla_naive(kw)
    assert o.shape == kw["v"].shape and o.dtype == kw["v"].dtype
    assert torch.isfinite(o).all()
    errs = {"o": rel_rmse(o.float().cpu(), ro)}
    if rs is not None:
        assert s.dtype == torch.float32 and s.shape == kw["initial_state"].shape
        errs["state"] = rel_rmse(s.cpu(), rs)
    else:
        assert s is None
    for name, e in errs.items():
        assert e < tol and not math.isnan(e), (name, errs)
    return errs


@pytest.mark.parametrize("case", [c for _, c in CASES], ids=[n for n, _ in CASES])
def test_chunk_kda_matches_fla_naive(case, device):
    _check(fla_case(**case, device=device))


@pytest.mark.parametrize("fla_chunk", [32, 64])
def test_intermediate_states_are_the_states_entering_fla_chunks(fla_chunk, device):
    """h: [B, NT, HV, K, V] in k's dtype, the state entering every chunk of fla's chunk_size
    (kdagen's kernels write chunk-16 or chunk-64 states; 32 is every other chunk-16 state)."""
    kw = fla_case(D=32, B=2, T=70, gate="bounded", device=device)
    args, fkw = fla_chunk_kda_args(kw)
    with torch.inference_mode():
        o, s, h = kdagen.chunk_kda(*args, **fkw, return_intermediate_states=True, chunk_size=fla_chunk)
    NT = math.ceil(70 / fla_chunk)
    assert h.shape == (2, NT, 2, 32, 32) and h.dtype == torch.bfloat16
    # float64 states at every 16 tokens (kdagen's reference, fla's KV layout), every (fla_chunk/16)-th
    ref_kw = dict(A_log=fkw["A_log"].cpu(), dt_bias=fkw["dt_bias"].cpu(), lower_bound=-5.0, gate="bounded",
                  initial_state=fkw["initial_state"].cpu(), output_final_state=True, state_layout="KV",
                  use_qk_l2norm=True)
    _, rs, rc = kda_reference(*(t.cpu() for t in args), **ref_kw, chunk_states_size=16)
    per_seq = math.ceil(70 / 16)
    want = torch.stack([rc[n * per_seq:(n + 1) * per_seq][::fla_chunk // 16] for n in range(2)])
    assert rel_rmse(h.float().cpu(), want) < 6e-3
    assert rel_rmse(s.cpu(), rs) < 6e-3


def test_head_dims_above_256_are_rejected_by_name(device):
    kw = fla_case(D=272, T=4, device=device)
    args, fkw = fla_chunk_kda_args(kw)
    with torch.inference_mode(), pytest.raises(KdaInputError, match="q: expected a head dim K from 1 to 256, "
                                                                     "found K=272"):
        kdagen.chunk_kda(*args, **fkw)


@pytest.mark.parametrize("over, needle", [
    (dict(cp_context=object()), "cp_context: expected fla's FLACPContext (fla.ops.cp.build_cp_context) or a "
                                "kdagen.cp.CPContext, found object"),
    (dict(cu_seqlens_typo=None), "cu_seqlens_typo: expected only fla-core 0.6's chunk_kda keywords"),
    (dict(use_beta_sigmoid_in_kernel=False, allow_neg_eigval=True), "allow_neg_eigval: expected False unless"),
    (dict(initial_state=torch.zeros(1, 2, 32, 32, dtype=torch.bfloat16)), "initial_state: expected dtype float32"),
    (dict(chunk_size=16), "chunk_size: expected 32 or 64 (fla's chunk sizes), found 16"),
    (dict(lower_bound=-6.0), "lower_bound: expected a value in fla's safe range [-5, 0)"),
    (dict(A_log=None, lower_bound=None, safe_gate=False), "A_log: expected a tensor when use_gate_in_kernel=True"),
    (dict(k=torch.zeros(1, 20, 1, 16)), "k: expected the shape of q (1, 20, 1, 32)"),
])
def test_what_kdagen_does_not_implement_is_rejected(over, needle):
    kw = fla_case(D=32)
    kw.update(over)
    args, fkw = fla_chunk_kda_args(kw)
    with torch.inference_mode(), pytest.raises(KdaInputError) as ei:
        kdagen.chunk_kda(*args, **fkw)
    assert needle in str(ei.value), str(ei.value)


@pytest.mark.parametrize("over, needle", [
    (dict(), "initial_state / output_final_state: expected None / False with cp_context"),
    (dict(initial_state=None, output_final_state=True), "initial_state / output_final_state: expected None / False"),
    (dict(initial_state=None, output_final_state=False, use_graph=True), "cp_context: expected None with use_graph"),
    (dict(initial_state=None, output_final_state=False, lens=None, B=2), "q: expected B = 1 with cp_context"),
])
def test_fla_context_rules(over, needle):
    # fla's own rules for a context (no states), and what kdagen does not run with one
    context = pytest.importorskip("fla.ops.cp.context")
    over = dict(over)
    kw = fla_case(D=32, lens=over.pop("lens", [8, 12]), B=over.pop("B", 1))
    kw.update(over)
    ctx = context.get_cp_cu_seqlens(torch.tensor([0, 8, 40]), world_size=2, rank=0)
    args, fkw = fla_chunk_kda_args(kw)
    with torch.inference_mode(), pytest.raises(KdaInputError) as ei:
        kdagen.chunk_kda(*args, **fkw, cp_context=ctx)
    assert needle in str(ei.value), str(ei.value)


def test_training_mode_is_rejected_not_ignored():
    kw = fla_case(D=32)
    kw["q"].requires_grad_(True)
    args, fkw = fla_chunk_kda_args(kw)
    with pytest.raises(KdaInputError, match="forward-only"):
        kdagen.chunk_kda(*args, **fkw)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [32, 60, 64, 100, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_chunk_kda_head_dims(D, dtype):
    """Every head dim of the issue on the GPU: served (natively or padded) and as accurate as
    fla's naive reference allows, or, above what any variant has, a NoVariantError."""
    from kdagen.targets import TARGETS

    kw = fla_case(D=D, lens=[300, 0, 724], H=2, HV=4, dtype=dtype, gate="bounded" if dtype == torch.bfloat16
                  else "unbounded", device="cuda")
    if D > max(max(t.head_dims) for t in TARGETS.values() if "cuda" in (t.devices or ())):
        args, fkw = fla_chunk_kda_args(kw)
        with torch.inference_mode(), pytest.raises(NoVariantError, match="zero-padded to the next size"):
            kdagen.chunk_kda(*args, **fkw)
        return
    errs = _check(kw)
    print(f"D={D} {dtype}: {errs}")
