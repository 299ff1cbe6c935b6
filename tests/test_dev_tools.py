"""Developer tools that the GPU runs rest on, checked on the CPU: the error table of a test run
(kdagen_dev/error_table.py) and the GPU suite's sharding (tests/conftest.py --shard)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kdagen.variant import Variant
from kdagen_dev.error_table import load, table

from . import conftest


def test_error_table_reports_worst_case_bound_and_margin(tmp_path):
    rows = [
        {"variant": "a", "target": "sm80", "dtype": "bf16", "state": "fp32", "device": "cuda", "case": "t1",
         "errors": {"o": 3.0e-3, "state": 2.0e-3}, "tolerance": {"o": 5e-3, "state": 5e-3}},
        {"variant": "b", "target": "sm80", "dtype": "bf16", "state": "fp32", "device": "cuda", "case": "t2",
         "errors": {"o": 4.0e-3, "state": 1.0e-3}, "tolerance": {"o": 5e-3, "state": 5e-3}},
        {"variant": "c", "target": "triton", "dtype": "fp32", "state": "fp32", "device": "cuda", "case": "t3",
         "errors": {"o": 1.0e-7}, "tolerance": {"o": 1e-5}},
    ]
    path = tmp_path / "e.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = table(load([path])).splitlines()
    o_row = next(ln for ln in lines if ln.startswith("sm80") and " o " in ln).split()
    assert o_row[5:7] == ["2", "4.00e-03"] and o_row[8:] == ["4.00e-03", "5e-03", "1.2", "t2"]
    st_row = next(ln for ln in lines if ln.startswith("sm80") and " state " in ln).split()
    assert st_row[6] == "2.00e-03" and st_row[8:] == ["2.00e-03", "5e-03", "2.5", "t1"]
    assert lines[-1] == "3 variants, 3 checks: sm80 2 variants / 2 checks, triton 1 variants / 1 checks"


def _item(nodeid, v=None, markers=()):
    return SimpleNamespace(nodeid=nodeid, callspec=SimpleNamespace(params={"v": v} if v else {}),
                           get_closest_marker=lambda name: name if name in markers else None)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_shards_partition_the_run_and_keep_shared_inputs_together(n):
    a = Variant("triton", 16, 32, 32, "fp32", "bounded", "fp32", 16)
    b = Variant("triton", 64, 32, 32, "fp32", "bounded", "fp32", 16)  # same inputs as a
    c = Variant("sm80", 16, 64, 64, "bf16", "unbounded", "none", 32)
    items = [_item(f"t[{v.name}-{case}]", v) for case in range(4) for v in (a, b, c)] + [_item("t_plain")]
    items.append(_item("t_fla", markers=("fla_autotune",)))  # minutes of fla autotuning
    shards = []
    for i in range(n):
        kept = list(items)
        deselected = []
        config = SimpleNamespace(getoption=lambda _, i=i: f"{i}/{n}",
                                 hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
        conftest._select_shard(config, kept)
        assert len(kept) + len(deselected) == len(items)
        shards.append({it.nodeid for it in kept})
    assert set().union(*shards) == {it.nodeid for it in items}
    assert sum(len(s) for s in shards) == len(items)  # disjoint
    home = [i for i, s in enumerate(shards) if f"t[{a.name}-0]" in s]
    assert all(f"t[{v.name}-{case}]" in shards[home[0]] for v in (a, b) for case in range(4))
    if n > 1:  # the fla-autotuning test outweighs the rest: a shard of its own
        assert [s for s in shards if "t_fla" in s] == [{"t_fla"}]


def test_shard_option_is_checked():
    config = SimpleNamespace(getoption=lambda _: "3/3", hook=None)
    with pytest.raises(pytest.UsageError, match="--shard: expected I/N with 0 <= I < N, found '3/3'"):
        conftest._select_shard(config, [])


@pytest.mark.skipif(conftest.HAS_CUDA, reason="the interpreter runs only without a GPU")
def test_capture_call_is_the_runtimes_call():
    """kdagen_dev.launch.capture_call gives the KdaCall kda_prefill would launch (nothing runs), so
    a launcher called on it directly computes the reference's result."""
    from kdagen.cases import make_case, reference
    from kdagen.reference import rel_rmse
    from kdagen.runtime import registry
    from kdagen_dev.launch import capture_call

    v = next(v for v in registry().variants() if v.name == "kda_fwd_triton_c16_k32_v64_fp32_gb_sfp32_bv16")
    kw = make_case(v, "cpu", B=1, T=20, H=1, HV=2, seed=3)
    before = dict(registry()._launchers)
    call = capture_call(kw, v.name)
    assert registry()._launchers == before  # the recorder is gone again
    assert (call.K, call.V, call.HV, call.T) == (32, 64, 2, 20) and call.final_state.shape == (1, 2, 64, 32)
    call.o.fill_(float("nan"))
    registry().launcher(v.name, "cpu:None")(call)
    ro, rs, _ = reference(kw)
    assert rel_rmse(call.o, ro) < 1e-5 and rel_rmse(call.final_state, rs) < 1e-5


@pytest.mark.skipif(conftest.HAS_CUDA, reason="the interpreter runs only without a GPU")
def test_capture_call_does_not_need_a_fresh_artifact():
    """An A/B script times its own builds: capture_call works while the registry's artifact of the
    variant is stale and cannot be rebuilt (KDAGEN_DISABLE_JIT=1 on the GPU machine), and leaves the
    registry's view of it as it was."""
    from kdagen.cases import make_case
    from kdagen.errors import NoVariantError
    import kdagen.runtime as rt
    from kdagen.runtime import kda_prefill, registry
    from kdagen.select import NEEDS_BUILD
    from kdagen_dev.launch import capture_call

    reg = registry()
    v = next(v for v in reg.variants() if v.name == "kda_fwd_triton_c16_k32_v64_fp32_gb_sfp32_bv16")
    kw = make_case(v, "cpu", B=1, T=20, H=1, HV=2, seed=3)
    stale = (NEEDS_BUILD, "not built, and KDAGEN_DISABLE_JIT=1 forbids building it now")
    saved = reg._status.get(v.name)
    reg._status[v.name] = stale
    rt._CHOICES.clear()  # (an earlier test's dispatch of this variant is memoised)
    rt._PLANS.clear()
    rt._LAST = rt._POOL_LAST = rt._NO_PLAN
    try:
        with pytest.raises(NoVariantError, match="forbids building it now"):
            kda_prefill(**kw, variant=v.name)
        call = capture_call(kw, v.name)
        assert (call.K, call.V, call.T) == (32, 64, 20)
        assert reg._status[v.name] == stale
    finally:
        if saved is None:
            reg._status.pop(v.name, None)
        else:
            reg._status[v.name] = saved
        rt._CHOICES.clear()


def test_sm90_stamp_segments_on_synthetic_stamps():
    """kdagen_dev/sm90_stamps.py: a bv128-like timeline (A 1000 cycles, then B 600, the consumers
    start 50 after the record is done and work 400, then 700 outside the products) comes back as those
    segments."""
    from kdagen_dev.sm90_stamps import EVENTS, segments

    ev = {n: i for i, n in enumerate(EVENTS)}
    st = []
    for cta in range(2):
        rows = []
        for c in range(8):
            t = 10_000 + 2_000 * c
            e = [[0, 0] for _ in EVENTS]
            for name, at in (("A_WAIT", t - 100), ("A_GO", t), ("A_DONE", t + 1000), ("B_WAIT", t + 900),
                             ("B_GO", t + 1010), ("B_DONE", t + 1610), ("C_WAIT", t + 1500),
                             ("C_GO", t + 1660), ("C_DONE", t + 2060), ("C_TOP", t + 1200),
                             ("C_VGO", t + 1420)):
                e[ev[name]] = [at, at]
            rows.append(e)
        st.append(rows)
    segs = segments(st, pair=False)
    want = {"A waits (slot, scratch, inputs)": 100, "A works (phases 0-1)": 1000, "B waits (scr_full)": 110,
            "B works (phases 2-5)": 600, "A done -> B starts": 10, "record done -> consumers start (own)": 50,
            "consumers wait (record)": 160, "consumers work (products)": 400,
            "consumer step (start to start)": 2000, "consumers: slot release, o store": 1140,
            "consumers: S to bf16, v wait": 220, "consumers: v fragments, v copies": 80,
            "A: done -> next chunk's waits (copies)": 900, "A cycle (start to start)": 2000,
            "B cycle (start to start)": 2000}
    assert {k: set(v) for k, v in segs.items()} == {k: {x} for k, x in want.items()}
    assert all(len(v) == 2 * 4 for v in segs.values())  # 2 CTAs x (8 - 4) chunks
    # read as a pair (CTA 0 preps the even chunks, CTA 1 the odd ones), the record waits split by whose record
    pseg = segments(st, pair=True)
    assert set(pseg["consumers wait (own record)"]) == {160} and len(pseg["consumers wait (own record)"]) == 4
    assert set(pseg["consumers wait (peer record)"]) == {160} and len(pseg["consumers wait (peer record)"]) == 4
    assert set(pseg["A cycle (start to start)"]) == {4000}  # a CTA's own chunks are two apart


def test_ab_build_refuses_serialized_wgmma():
    """kdagen_dev/ab.py finds ptxas's notes that it serialized a kernel's wgmma (the session-16 32-token step
    was timed that way in two calls), and ignores the other ptxas notes (injected fences, register counts)."""
    from kdagen_dev.ab import wgmma_serialized

    log = """ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function 'kda_fused'
ptxas info    : (C7519) warpgroup.arrive is injected in around line 3277 by compiler to allow use of registers in GMMA in function 'kda_fused'
ptxas info    : Used 168 registers, used 5 barriers"""
    assert wgmma_serialized(log) == [log.splitlines()[0].strip()]
    assert wgmma_serialized(log.replace("C7512", "C7511").replace("for the function", "for the wgmma pipeline in the function"))
    assert wgmma_serialized("\n".join(log.splitlines()[1:])) == []


def test_dispatch_replay_picks_as_selection_does_and_prices_by_the_bench(tmp_path, monkeypatch):
    """kdagen_dev/replay.py: the pick is the tree's selection among the bench's timed variants (a GPU
    with no tuning file here), its time the bench's, the routed call's time where the bench timed it."""
    from kdagen_dev.replay import replay, report

    monkeypatch.setenv("KDAGEN_TUNING", "off")

    def cell(name, ms, auto=False):
        return {"variant": f"kda_fwd_{name}", "auto": auto, "timing": {"median": ms}}

    hl16, bv16 = "sm80_c16_k128_v128_bf16_gb_sfp32_bv16_hl", "sm80_c16_k128_v128_bf16_gb_sfp32_bv16"
    hl32, sm90_64, sm90_128 = ("sm80_c16_k128_v128_bf16_gb_sfp32_bv32_hl", "sm90_c16_k128_v128_bf16_gb_sfp32_bv64",
                               "sm90_c16_k128_v128_bf16_gb_sfp32_bv128")
    routed = f"kda_fwd_{hl16} (scan correct x8)"
    cases = [
        ({"name": "B1 T16384 H48", "H": 48, "T": 16384}, f"kda_fwd_{hl32}",
         [cell(hl32, 1.40, True), cell(sm90_64, 1.00), cell(sm90_128, 1.20)]),
        ({"name": "B1 T8192 H4", "H": 4, "T": 8192}, f"kda_fwd_{hl16}",
         [cell(hl16, 0.275, True), cell(bv16, 0.260), cell(sm90_64, 0.50)]),
        ({"name": "B1 T131072 H4", "H": 4, "T": 131072}, routed,
         [{"variant": routed, "auto": True, "timing": {"median": 1.6}}, cell(hl16, 3.9), cell(bv16, 3.8)]),
    ]
    data = {"env": {"gpu": "NVIDIA Replay GPU", "sm_count": 132},
            "cases": [{"case": c, "auto": auto, "variants": v} for c, auto, v in cases]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    rows = replay(path)
    assert [(r.pick.removeprefix("kda_fwd_"), r.ms, r.ok) for r in rows] == [
        ("sm90_c16_k128_v128_bf16_gb_sfp32_bv64", 1.00, True),
        (hl16, 0.275, False),  # the precise default, 1.058x the plain one's time
        (hl16, 1.6, True),
    ]
    assert report(rows, "x").splitlines()[-1] == "2 of 3 within 5% of the fastest measured (replayed on x)"
    # a routed call of another variant: the pick's own call was not timed, so it is not compared
    data["cases"][2]["auto"] = data["cases"][2]["variants"][0]["variant"] = f"kda_fwd_{bv16} (scan correct x8)"
    path.write_text(json.dumps(data))
    rows = replay(path)
    assert rows[2].pick == f"kda_fwd_{hl16}" and rows[2].ms is None and not rows[2].ok
    assert report(rows, "x").splitlines()[-1] == ("1 of 2 within 5% of the fastest measured, 1 not timed by the bench "
                                                  "(replayed on x)")


def test_the_shipped_tuning_files_are_todays_derivation_of_their_evidence():
    """Each shipped file's rules are what tuning.derive_rules gives its own recorded measurements with
    this tree's regime edges (scripts/rederive_tuning.py --write after an edge changes)."""
    from kdagen import tuning
    from kdagen_dev import retune

    for f in sorted(tuning.SHIPPED_DIR.glob("*.json")):
        t = tuning.load(f)
        again = retune.rederive(t, "test")
        assert [(r.target, r.gate, r.tokens_per_seq, r.seq_heads_per_sm, r.chunk, r.block_v, r.rank) for r in t.rules] \
            == [(r.target, r.gate, r.tokens_per_seq, r.seq_heads_per_sm, r.chunk, r.block_v, r.rank)
                for r in again.rules], f"{f.name}: run scripts/rederive_tuning.py --write {f}"
        assert retune.changes(t, again) == []
    # session 55's crossover cases: at 8192 tokens the H100 ranks sm80 first at H16 (block_v 16) and
    # over H17-H32 (block_v 32: within 2% of sm90 at H28-H32, 1.06-1.10x ahead of it at H20-H24)
    h100 = tuning.load(tuning.SHIPPED_DIR / "NVIDIA_H100_80GB_HBM3.json")
    for gate in ("precomputed", "bounded", "unbounded"):
        for H, first in ((20, ("sm80", 32)), (32, ("sm80", 32)), (16, ("sm80", 16))):
            shs = tuning.regime(8192, 1, 1, H, 132)[1]
            picks = sorted((r.rank, r.target, r.block_v) for tg in ("sm80", "sm90")
                           if (r := h100.rule_for(tg, "bf16", 128, 8192, shs, gate)) is not None)
            assert picks[0][1:] == first, (gate, H, picks)


def test_retune_reads_back_the_measurements_and_names_what_it_cannot(tmp_path):
    from kdagen import tuning
    from kdagen_dev import retune

    def m(case, target, times):
        from kdagen.bench import CASE_SETS
        c = next(c for cs in CASE_SETS.values() for c in cs if c.name == case)
        return {"case": case, "target": target, "dtype": c.dtype, "head_dim": c.D, "gate": c.gate,
                "tokens_per_seq": c.tokens / c.N, "seq_heads_per_sm": c.N * c.hv / 132, "times": times}

    ms = [m("eng T8192 H16", "sm80", {(16, 16): 0.34, (16, 32): 0.41}),
          m("eng T8192 H32", "sm80", {(16, 16): 0.54, (16, 32): 0.51})]
    t = tuning.Tuning(gpu="NVIDIA Test", sm_count=132, rules=tuple(tuning.derive_rules(ms)))
    back = sorted(retune.measurements(t), key=lambda x: x["case"])
    assert [(x["case"], x["times"]) for x in back] == [(x["case"], x["times"]) for x in ms]
    assert [x["seq_heads_per_sm"] for x in back] == pytest.approx([x["seq_heads_per_sm"] for x in ms])
    bad = tuning.Tuning(gpu="NVIDIA Test", sm_count=132, rules=(tuning.Rule(
        target="sm80", tokens_per_seq=(0, 512), seq_heads_per_sm=(0, 1), evidence={"ms": {"no such case": {}}}),))
    with pytest.raises(retune.RetuneError, match="rules\\[0\\] \\(sm80\\): case 'no such case' is no bench case"):
        retune.measurements(bad)
    bad = tuning.Tuning(gpu="NVIDIA Test", sm_count=132, rules=(tuning.Rule(
        target="sm80", tokens_per_seq=(0, 512), seq_heads_per_sm=(0, 1),
        evidence={"ms": {"eng T8192 H16": {"16x32": 1.0}}}),))
    with pytest.raises(retune.RetuneError, match="setting '16x32' of case 'eng T8192 H16'"):
        retune.measurements(bad)
