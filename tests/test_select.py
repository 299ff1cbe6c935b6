"""Variant selection: functional key first, then preference; every rejection has a reason."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import logging

import pytest
import torch

import kdagen.select as sel
from kdagen.inputs import CallInfo
from kdagen.variant import Variant


def info(**over) -> CallInfo:
    base = dict(device=torch.device("cuda", 0), dtype="bf16", layout="bsnd", B=1, T=8192, N=1, H=16, HV=16,
                K=128, V=128, gate="bounded", state="fp32", varlen=False, chunk_size=None, max_len=8192,
                cu_seqlens_host=None)
    base.update(over)
    return CallInfo(**base)


def var(target="sm80", chunk=64, bv=32, state="fp32", **over) -> Variant:
    kw = dict(target=target, chunk=chunk, k=128, v=128, dtype="bf16", gate="bounded", state=state, block_v=bv)
    kw.update(over)
    return Variant(**kw)


@pytest.fixture
def any_device(monkeypatch):
    monkeypatch.setattr(sel, "device_reason", lambda target, device: None)
    monkeypatch.setattr(sel, "_sm_count", lambda device: 132)


def test_cuda_target_preferred_over_triton(any_device):
    cands = [var("triton", 64), var("sm80", 16), var("sm80", 64)]
    assert sel.select(cands, info()).target == "sm80"


def test_chunk_preference_measured_per_target_else_by_length(any_device):
    # sm80: chunk 16 measured faster at every benchmarked length
    assert sel.select([var("sm80", 16), var("sm80", 64)], info()).chunk == 16
    # triton: chunk 16 measured faster (H200, 2026-12-01), at every length
    tri = [var("triton", 16), var("triton", 64)]
    assert sel.select(tri, info()).chunk == 16
    assert sel.select(tri, info(T=256, max_len=256)).chunk == 16


def test_chunk_by_length_where_a_target_has_no_measurement(any_device, monkeypatch):
    # without a measured preference long sequences take chunk 64, short ones chunk 16
    monkeypatch.setitem(sel.TARGETS, "triton", dataclasses.replace(sel.TARGETS["triton"], preferred_chunk=None))
    tri = [var("triton", 16), var("triton", 64)]
    assert sel.select(tri, info()).chunk == 64
    assert sel.select(tri, info(T=256, max_len=256)).chunk == 16


def test_v_split_widest_block_that_still_fills_the_gpu(any_device):
    # triton: at least 2 programs per SM. 96 heads x 128/bv: bv=32 gives 384 >= 264, bv=64 192 < 264
    tri = [var(target="triton", bv=b) for b in (16, 32, 64, 128)]
    assert sel.select(tri, info(H=96, HV=96)).block_v == 32
    # 8 heads never fill the GPU: the narrowest split, most programs
    assert sel.select(tri, info(H=8, HV=8)).block_v == 16
    # sm80 (split-K warps, measured): block_v 32 where it gives 0.7 programs per SM (92.4 of 132),
    # else the widest that does, else the narrowest
    cands = [var(bv=b) for b in (16, 32, 64)]
    assert sel.select(cands, info(H=96, HV=96)).block_v == 32   # 384 programs (64 would give 192)
    assert sel.select(cands, info(H=24, HV=24)).block_v == 32   # 96 programs
    assert sel.select(cands[::2], info(H=96, HV=96)).block_v == 64  # no 32: the widest that fills
    assert sel.select(cands, info(H=8, HV=8)).block_v == 16


def test_state_none_prefers_a_variant_without_state_io(any_device):
    cands = [var(state="fp32"), var(state="none"), var(state="bf16")]
    assert sel.select(cands, info(state="none")).state == "none"
    assert sel.select(cands, info(state="bf16")).state == "bf16"
    with pytest.raises(sel.NoVariantError, match="state none != fp32"):
        sel.select([var(state="none")], info(state="fp32"))


@pytest.mark.parametrize("over, reason", [
    (dict(dtype="fp16"), "dtype bf16 != fp16"),
    (dict(K=64, V=64), "head dims K=128,V=128 != K=64,V=64"),
    (dict(gate="unbounded"), "gate bounded != unbounded"),
    (dict(layout="bnsd"), "layout bnsd not in bsnd"),
    (dict(varlen=True), "no varlen"),
    (dict(HV=32), "no GQA"),
    (dict(chunk_size=16), "chunk 64 != 16"),
])
def test_rejection_reasons(any_device, over, reason):
    v = var(layouts=("bsnd",), varlen=False, gqa=False)
    assert sel.functional_reason(v, info(**over)) == reason


def test_device_reasons_come_from_the_targets_self_description(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert sel.device_reason("triton", cpu) == "triton on cpu needs TRITON_INTERPRET=1"
    assert sel.device_reason("sm80", cpu) == "sm80 runs on cuda, not on cpu"
    assert sel.device_reason("ascend", cpu) == "ascend runs on npu, not on cpu"
    assert sel.device_reason("nope", cpu) == "unknown target nope"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert sel.device_reason("triton", cpu) is None
    # compute capability: sm80 needs 8.0
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(sel, "_capability", lambda index: (7, 5))
    assert sel.device_reason("sm80", cuda) == "sm80 needs compute capability 8.0, the device has 7.5"
    monkeypatch.setattr(sel, "_capability", lambda index: (9, 0))
    assert sel.device_reason("sm80", cuda) is None and sel.device_reason("triton", cuda) is None


def test_select_names_no_target():
    import pathlib

    from kdagen.targets import TARGETS

    src = pathlib.Path(sel.__file__).read_text()
    for name in TARGETS:
        assert f'"{name}"' not in src and f"'{name}'" not in src, f"select.py names target {name}"


def test_rank_then_what_is_built(any_device):
    built16, unbuilt32 = sel.Candidate(var(bv=16)), sel.Candidate(var(bv=32), sel.NEEDS_BUILD)
    # block_v 32 is preferred at H96, but the built 16 wins: no compile inside a forward pass
    best, _ = sel.choose([unbuilt32, built16], info(H=96, HV=96))
    assert best is built16
    # a better-ranked target that needs a build still beats a ready one of a lower rank...
    tri = sel.Candidate(var("triton"))
    assert sel.choose([tri, unbuilt32], info())[0] is unbuilt32
    # ...unless it cannot be built here: then the reason is kept
    blocked = sel.Candidate(var(bv=32), sel.NEEDS_BUILD, "not built, and nvcc is not available")
    best, rejected = sel.choose([tri, blocked], info())
    assert best is tri and rejected == [(blocked, "not built, and nvcc is not available")]
    # listed-but-unbuilt before generated-for-this-call
    gen = sel.Candidate(var(bv=16), sel.GENERATE)
    assert sel.choose([gen, unbuilt32], info())[0] is unbuilt32


def test_loglevel_2_logs_every_rejected_candidate(any_device, caplog):
    cands = [var(dtype="fp16"), var(k=64, v=64), var(gate="unbounded"), var()]
    with caplog.at_level(logging.DEBUG, logger="kdagen"):
        best, rejected = sel.choose(cands, info())
    assert best.variant == cands[3] and len(rejected) == 3
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert lines == [f"kdagen: rejected {c.name}: {why}" for c, why in
                     zip(cands[:3], ("dtype fp16 != bf16", "head dims K=64,V=64 != K=128,V=128",
                                     "gate unbounded != bounded"))]


def test_miss_names_a_variant_that_would_fit_if_built(any_device):
    blocked = sel.Candidate(var(), sel.NEEDS_BUILD, "not built, and KDAGEN_DISABLE_JIT=1 forbids building it now "
                            "(`kdagen build --spec h800 --filter x`)")
    with pytest.raises(sel.NoVariantError) as ei:
        sel.select([blocked], info())
    assert f"Would fit if built: {var().name}: not built, and KDAGEN_DISABLE_JIT=1" in str(ei.value)
    assert "kdagen build --spec h800 --filter x" in str(ei.value)


def test_choice_is_logged_once(caplog):
    from .test_runtime_errors import inputs

    import kdagen.runtime as rt

    kw = inputs()
    rt.reset()  # no plan left by another test (a plan, not only the log, makes the first call new)
    with caplog.at_level(logging.INFO, logger="kdagen"):
        rt.kda_prefill(**kw)
        rt.kda_prefill(**kw)
    lines = [r.getMessage() for r in caplog.records if r.name == "kdagen"]
    assert len(lines) == 1 and lines[0].startswith("kdagen: kda_fwd_triton_") and "T=20" in lines[0]


def test_precise_variant_before_its_plain_twin(any_device):
    """A precise variant (o's products in hi + lo) wins the tie with its plain twin, in either order, and only
    the tie: a plain variant that fits better (chunk, block_v) still wins over a precise one, and a plain
    variant alone is taken."""
    plain, precise = var(chunk=16, bv=32), var(chunk=16, bv=32, precise=True)
    assert precise.name == plain.name + "_hl"
    assert sel.select([plain, precise], info()) == precise
    assert sel.select([precise, plain], info()) == precise
    assert sel.select([plain], info()) == plain
    assert sel.select([var(chunk=64, bv=32, precise=True), plain], info()) == plain  # sm80 measured chunk 16 faster
    bv16 = var(chunk=16, bv=16)
    assert sel.select([bv16, plain], info()) == bv16  # the block_v dispatch prefers for this call ...
    assert sel.select([precise, bv16], info()) == bv16  # ... outranks precision


def test_sm90_first_in_its_preferred_regimes(any_device, monkeypatch):
    """No tuning file: sm90 (ranked after sm80) comes first where both measured Hopper files rank it
    fastest, D128 calls of >= 512 tokens per sequence and >= 0.25 sequence-heads per SM; sm80 elsewhere."""
    monkeypatch.setenv("KDAGEN_TUNING", "off")
    cands = [var("sm80", 16, 32), var("sm80", 16, 16), var("sm90", 16, 64), var("sm90", 16, 128)]

    def target(**over):
        return sel.select(cands, info(**over)).target

    assert target(T=16384, H=48, HV=48) == "sm90"           # 0.36 a SM
    lens48 = dict(varlen=True, cu_seqlens_host=None, H=8, HV=8)
    assert target(T=6 * 1024, N=6, max_len=2048, **lens48) == "sm80"  # 0.36 a SM of 1024-token sequences (eng mix6 H8)
    # block_v 64 on sm90, at every head count (the widest-block rule took 128 at 0.7 CTAs a SM)
    for h in (48, 96, 400):
        assert sel.select(cands, info(T=8192, H=h, HV=h)).block_v == 64, h
    assert target(T=8192, H=33, HV=33) == "sm90"            # 0.25: the edge is in
    assert target(T=32768, H=32, HV=32) == "sm80"           # 0.24
    assert target(T=8192, H=4, HV=4) == "sm80"
    assert target(B=4, T=4096, N=4, H=32, HV=32) == "sm90"  # a batch: 4 x 32 sequence-heads
    lens = dict(varlen=True, cu_seqlens_host=None, H=32, HV=32)
    assert target(T=8192, N=8, max_len=1024, **lens) == "sm90"   # 8 x 1024 tokens
    assert target(T=4096, N=16, max_len=256, **lens) == "sm90"   # 16 x 256 tokens: 3.9 sequence-heads a SM
    assert target(T=2048, N=32, max_len=64, **lens) == "sm80"    # 64-token sequences, 7.8 a SM
    assert target(T=64, H=32, HV=32) == "sm80"                   # one 64-token sequence
    d64 = [dataclasses.replace(v, k=64, v=64) for v in cands]
    assert sel.select(d64, info(T=16384, H=48, HV=48, K=64, V=64)).target == "sm80"  # D128 only
    # the regime is a preference among what fits, nothing more: without sm90, sm80
    assert sel.select(cands[:2], info(T=16384, H=48, HV=48)).target == "sm80"
    # CPU calls have no regimes
    assert not sel.in_preferred_regime(sel.TARGETS["sm90"], info(T=16384, H=48, HV=48, device=torch.device("cpu")), 132)


def test_the_choice_cache_keeps_preferred_regimes_apart(any_device, monkeypatch):
    """runtime._dispatch caches a choice per call signature: calls of one (N, HV, K) on either side of
    a regime edge (2048 tokens per sequence at 0.36 sequence-heads per SM) must each get their own."""
    import kdagen.runtime as rt

    for t in sel.TARGETS.values():
        for dims, tokens, seq_heads in t.preferred_regimes:
            assert dims and tokens[0] < tokens[1] and 0 <= seq_heads[0] < seq_heads[1], (t.name, tokens, seq_heads)
    short, long = info(T=1024, max_len=1024, H=48, HV=48), info(T=4096, max_len=4096, H=48, HV=48)
    assert sel.regime_key(short) != sel.regime_key(long)
    entries = {n: SimpleNamespace(name=n) for n in ("a", "b")}
    monkeypatch.setattr(rt, "registry", lambda: SimpleNamespace(entries=entries))
    monkeypatch.setattr(rt, "_select_entry", lambda reg, c, forced, variant: entries["a" if c.T < 2048 else "b"])
    monkeypatch.setattr(rt, "_CHOICES", {})
    assert [rt._dispatch(c, None).name for c in (short, long, short)] == ["a", "b", "a"]
