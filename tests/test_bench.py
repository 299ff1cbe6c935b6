"""`kdagen bench` / `kdagen tune` without a GPU: the engine on the CPU (Triton interpreter) with
fake timers, the report (markdown, JSON, PNG) from fake timings, the case files and the CLI's
argument errors. The real measurement is scripts/gpu_check.sh bench on the H200."""

from __future__ import annotations

import dataclasses
import json
import sys
import types

import pytest
from click.testing import CliRunner

from kdagen import bench as b
from kdagen import tuning
from kdagen.bench_report import markdown, write_report
from kdagen.cli import main
from kdagen.timing import Timing, summarize

from .runtime_env import fresh_runtime  # noqa: F401


def fake_timers(values):
    """time_calls gives the next of `values` (ms) after running the call once; copy at 4 TB/s."""
    it = iter(values)

    def time_calls(fn, sets, **kw):
        fn(sets[0])
        v = next(it)
        return Timing(median=v, p10=0.9 * v, p90=1.2 * v, min=0.8 * v, n=20)

    return types.SimpleNamespace(time_calls=time_calls, copy_bandwidth=lambda: 4e12,
                                 graph_calls=lambda fn, sets, **kw: Timing(0.25, 0.24, 0.27, 0.2, 30))


TINY = b.Case("tiny T37", H=1, T=37, D=32, dtype="fp32")


def test_summarize_percentiles():
    t = summarize([5.0, 1.0, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0, 9.0, 10.0])
    assert (t.median, t.p10, t.p90, t.min, t.n) == (5.5, 1.0, 9.0, 1.0, 10)
    assert t.spread == pytest.approx(8.0 / 5.5)
    with pytest.raises(ValueError):
        summarize([])


def test_compulsory_bytes_and_floor_of_an_issue_row():
    # issue 16's B1 T8192 H96: ~1.28 KB per token-head (q, k, v, g, o in bf16) + beta + fp32 states
    c = next(x for x in b.CASE_SETS["default"] if x.name == "B1 T8192 H96")
    assert c.compulsory_bytes() == 8192 * 96 * (5 * 128 * 2 + 2) + 2 * 96 * 128 * 128 * 4
    assert c.compulsory_bytes() / 4.2e12 * 1e3 == pytest.approx(0.243, abs=1e-3)  # the issue's 0.24 ms
    gqa = b.Case("g", H=2, HV=8, T=10, D=64)
    assert gqa.compulsory_bytes() == 10 * 2 * (2 * 2 * 64 + 3 * 8 * 64 + 8) + 2 * 8 * 64 * 64 * 4


def test_default_cases():
    names = [c.name for c in b.CASE_SETS["default"]]
    assert len(names) == len(set(names))
    assert {"B1 T8192 H96", "B1 T65536 H24", "B1 T131072 H4", "GQA B1 T8192 H16 HV64", "B1 T8192 H16 D256",
            "B1 T8192 H32 D64", "varlen 32x64 H32"} <= set(names)
    short = [c for c in b.CASE_SETS["short"]]
    assert all(c.short for c in short) and min(c.longest for c in short) == 64
    assert not any(c.short for c in b.CASE_SETS["issue17"])


def test_tune_measures_every_gate_form_and_the_engine_rows():
    """kdagen tune's default cases cover each gate form (rules are per form) and the engines' calls."""
    from click.testing import CliRunner

    from kdagen.cli import main

    cases = b.load_cases(b.TUNE_CASES)
    assert {c.gate for c in cases} == {"bounded", "unbounded", "precomputed"}
    eng = b.CASE_SETS["engine"]
    assert {c.H for c in eng} == {4, 8, 16, 32} and all(c.gate_fp32 and c.beta_prob for c in eng)
    assert max(c.tokens for c in eng) <= 16384 and any(c.N > 1 for c in eng)  # chunked-prefill steps
    vllm = [c for c in b.CASE_SETS["gates"] if c.gate_fp32]
    assert vllm and all(c.beta_prob and c.gate == "precomputed" for c in vllm)
    assert b.load_cases("eng mix6 H8") == [c for c in eng if c.name == "eng mix6 H8"]  # a name of any set
    # the cells between the engine rows' head counts hold several head counts of each gate form measured
    cross = b.CASE_SETS["crossover"]
    assert set(cross) <= set(cases) and {c.gate for c in cross} == {"bounded", "unbounded", "precomputed"}
    assert {c.H for c in cross if c.gate == "bounded"} == {20, 24, 28, 32} and all(c.T == 8192 for c in cross)
    assert {c.H for c in cross if c.gate == "unbounded"} == {16, 24, 32}
    assert "[default: default,gates,engine,crossover]" in " ".join(CliRunner().invoke(main, ["tune", "--help"]).output.split())
    assert "[default: default]" in CliRunner().invoke(main, ["bench", "--help"]).output


def test_engine_on_the_cpu_and_tune_from_its_results(tmp_path, monkeypatch):
    """The whole run on the CPU: candidates (triton c16 and c64 of the ci spec at K = 32),
    the auto one timed through dispatch, a case no variant serves, the peers left out, then
    the tuning file from the same kind of run."""
    none = b.Case("D256 T20", H=1, T=20, D=256, dtype="fp32")
    monkeypatch.setenv("KDAGEN_DISABLE_JIT", "1")  # no listed variant has D 256: a miss without generation
    opts = b.Options(compare=(), warm_procs=0, top=0)
    # auto (c16, preferred by the target) 1.0 ms, c64 0.5 ms
    seen = []
    res = b.run([TINY, none], opts, echo=lambda m: None, device="cpu", timers=fake_timers([1.0, 0.5]),
                partial=lambda r: seen.append(len(r["cases"])))
    assert seen == [1, 2]
    row, miss = res["cases"]
    assert [c["variant"] for c in row["variants"]] == ["kda_fwd_triton_c16_k32_v32_fp32_gb_sfp32_bv16",
                                                       "kda_fwd_triton_c64_k32_v32_fp32_gb_sfp32_bv16"]
    assert row["auto"] == row["variants"][0]["variant"] and row["variants"][0]["auto"]
    assert row["best"] == row["variants"][1]["variant"]
    assert row["dispatch_ok"] is False and "2.00x" in row["dispatch_note"] and "kdagen tune" in row["dispatch_note"]
    # the two variants' o agree (fp32 kernels): a real comparison, not a placeholder
    assert 0 < row["variants"][1]["rel_vs_auto"] < 1e-5
    assert row["graph"]["median"] == 0.25 and row["short"]
    assert row["floor_ms"] == pytest.approx(TINY.compulsory_bytes() / 4e12 * 1e3)
    assert miss["best"] is None and "NoVariantError" in miss["error"] and miss["dispatch_ok"] is None
    # the JSON round trip, then the report
    path = b.write_results(res, tmp_path)
    assert b.read_results(path)["cases"][0]["best"] == row["best"]
    md = markdown(b.read_results(path))
    assert "| tiny T37 | 37 | triton_c16_k32_v32_fp32_gb_sfp32_bv16 | 1.000 | 0.900-1.200 | 0.250 |" in md
    assert "on 0 of 1 cases" in md and "D256 T20: NoVariantError" in md

    # a glob (without the kda_fwd_ prefix) keeps the auto variant and the matching ones
    res = b.run([TINY], b.Options(compare=(), warm_procs=0, top=0, variants="triton_c64_*", graphs=False),
                echo=lambda m: None, device="cpu", timers=fake_timers([1.0, 0.5]))
    assert [c["chunk"] for c in res["cases"][0]["variants"]] == [16, 64] and res["cases"][0]["graph"] is None
    res = b.run([TINY], b.Options(compare=(), warm_procs=0, top=0, variants="*_c16_*", graphs=False),
                echo=lambda m: None, device="cpu", timers=fake_timers([1.0]))
    assert [c["chunk"] for c in res["cases"][0]["variants"]] == [16] and res["cases"][0]["dispatch_ok"]

    # tune: the same measurements give a rule for the tiny case's regime
    out = tmp_path / "tuning.json"
    path, _ = b.tune([TINY], opts, out, echo=lambda m: None, device="cpu", timers=fake_timers([1.0, 0.5]))
    t = tuning.load(path)
    assert path == out and len(t.rules) == 1
    r = t.rules[0]
    assert (r.target, r.dtype, r.head_dim, r.chunk, r.block_v) == ("triton", "fp32", 32, 64, 16)
    assert r.tokens_per_seq == (0, 512) and r.evidence["cases"] == ["tiny T37"]

    # without --out: KDAGEN_TUNING's file, else the cache's, never the file shipped for the GPU
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv(tuning.ENV, raising=False)
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path / "shipped")
    shipped = tuning.save(dataclasses.replace(t, rules=()), tmp_path / "shipped" / "cpu.json")
    before = shipped.read_bytes()
    path, _ = b.tune([TINY], opts, None, echo=lambda m: None, device="cpu", timers=fake_timers([1.0, 0.5]))
    assert path == tmp_path / "c" / "tuning" / "cpu.json" and len(tuning.load(path).rules) == 1
    assert shipped.read_bytes() == before


def test_a_pool_case_runs_the_engines_call_and_compares_from_its_initial_states(monkeypatch):
    """A pool case (the engines' state I/O) on the CPU: every timed call and the comparison call pass the
    state pool and slots (no initial_state, no final states asked); the comparison call starts from the
    input set's initial states, so the two variants' o agree though every timed call rewrote the slots;
    the pool set is the engine rows' pool twins, left out of what `kdagen tune` measures."""
    import torch

    import kdagen.runtime as rt

    case = dataclasses.replace(TINY, name="pool tiny", lens=(20, 0, 17), T=None, pool=True)
    kw, cu = case.inputs(seed=1, dev="cpu")
    ck = b.call_kwargs(case, kw, cu)
    pool, slots = ck["state_pool"], ck["state_indices"]
    assert "initial_state" not in ck
    assert ck["output_final_state"] is False and ck["assume_valid"] is True and slots.dtype == torch.int32
    assert pool.shape == (6, *kw["initial_state"].shape[1:]) and len(set(slots.tolist())) == 3
    assert torch.equal(pool[slots.long()], kw["initial_state"])  # the set's initial states at the slots
    assert "state_pool" not in b.plan_kwargs(case, kw, cu)
    seen = []  # the states each call starts from (its slots' contents)
    real = rt.kda_prefill

    def spy(*a, **k):
        assert k.get("state_pool") is not None and k.get("initial_state") is None and not k["output_final_state"]
        seen.append(k["state_pool"][k["state_indices"].long()].clone())
        return real(*a, **k)

    monkeypatch.setattr(rt, "kda_prefill", spy)
    opts = b.Options(compare=(), warm_procs=0, top=0, graphs=False)
    res = b.run([case], opts, echo=lambda m: None, device="cpu", timers=fake_timers([1.0, 0.5]))
    (row,) = res["cases"]
    assert len(row["variants"]) == 2 and all("timing" in c for c in row["variants"]), row
    assert 0 < row["variants"][1]["rel_vs_auto"] < 1e-5
    # two timed calls (the fake timers run each once), then the two comparison calls; the second timed one
    # started from the slots the first rewrote, each comparison from the input set's initial states
    h0 = case.inputs(seed=0, dev="cpu")[0]["initial_state"]
    assert len(seen) == 4 and torch.equal(seen[0], h0) and not torch.equal(seen[1], h0)
    assert torch.equal(seen[2], h0) and torch.equal(seen[3], h0)
    assert [c.name for c in b.CASE_SETS["pool"]] == ["pool eng T8192 H32", "pool eng T2048 H8", "pool eng mix6 H8",
                                                     "pool eng 32x256 H8"]
    assert all(c.pool and not c.compare for c in b.CASE_SETS["pool"])
    assert not any(c.pool for c in b.load_cases(b.TUNE_CASES))
    assert b.case_from_dict({"name": "p", "H": 1, "T": 8, "pool": True}, "x").pool


def test_engine_adds_the_variants_a_jit_target_would_generate():
    """K = V = 16: no spec lists a variant (dispatch pads to the ci spec's K = 32 one); the Triton
    variants generated on demand for K = 16 are timed beside it."""
    case = b.Case("D16", H=1, T=37, D=16, dtype="fp32")
    res = b.run([case], b.Options(compare=(), warm_procs=0, top=2, graphs=False), echo=lambda m: None,
                device="cpu", timers=fake_timers([1.0, 0.9, 0.8]))
    row = res["cases"][0]
    assert [(c["variant"], c["listed"]) for c in row["variants"]] == [
        ("kda_fwd_triton_c16_k32_v32_fp32_gb_sfp32_bv16", True),
        ("kda_fwd_triton_c16_k16_v16_fp32_gb_sfp32_bv16", False),
        ("kda_fwd_triton_c64_k16_v16_fp32_gb_sfp32_bv16", False)]
    # zero padding is exact: the K = 16 kernels agree with the padded K = 32 one
    assert all(c["rel_vs_auto"] < 1e-6 for c in row["variants"][1:])
    assert row["dispatch_ok"] is False and "no spec lists" in row["dispatch_note"]


def fake_results() -> dict:
    def cell(name, ms, auto=False, rel=None, target="sm80"):
        c = {"variant": f"kda_fwd_{name}", "target": target, "chunk": 16, "block_v": 32, "auto": auto,
             "timing": {"median": ms, "p10": ms * 0.95, "p90": ms * 1.1, "min": ms * 0.9, "n": 50}, "TBps": 1.0 / ms}
        if rel is not None:
            c["rel_vs_auto"] = rel
        return c

    rows = [
        {"case": {"name": "B1 T8192 H96", "H": 96, "T": 8192}, "tokens": 8192, "N": 1, "short": False,
         "floor_ms": 0.243, "auto": "kda_fwd_sm80_a", "best": "kda_fwd_sm80_a", "dispatch_ok": True,
         "dispatch_note": "", "graph": None, "notes": [],
         "variants": [cell("sm80_a", 1.123, True), cell("sm80_b", 1.3, rel=1.1e-3),
                      cell("sm90_c", 2.9, rel=0.5, target="sm90")],
         "peers": {"fla": {"timing": {"median": 2.8, "p10": 2.7, "p90": 2.9, "min": 2.6, "n": 20}, "TBps": 0.36,
                           "rel_vs_auto": 2e-3},
                   "flashkda": {"skipped": "not importable (No module named 'flash_kda')"}}},
        {"case": {"name": "varlen 32x64 H32", "H": 32, "lens": [64] * 32}, "tokens": 2048, "N": 32, "short": True,
         "floor_ms": 0.02, "auto": "kda_fwd_sm80_a", "best": "kda_fwd_sm80_b", "dispatch_ok": False,
         "dispatch_note": "auto takes 1.50x the time of sm80_b", "notes": [],
         "graph": {"median": 0.05, "p10": 0.049, "p90": 0.052, "min": 0.048, "n": 100},
         "variants": [cell("sm80_a", 0.15, True), cell("sm80_b", 0.1, rel=1e-3)], "peers": {}},
    ]
    return {"kind": b.RESULTS_KIND, "version": b.RESULTS_VERSION, "copy_bandwidth_Bps": 4.2e12,
            "env": {"gpu": "NVIDIA H200", "sm_count": 132, "capability": "9.0", "driver": "570.1", "torch": "2.11",
                    "cuda_runtime": "12.8", "triton": "3.6.0", "fla": "0.6.0", "flashkda": None,
                    "date": "2026-12-01 10:00:00 UTC", "commit": "abc1234", "kdagen": "0.1.0"},
            "options": {"compare": ["fla", "flashkda"], "top": 3, "variants": None},
            "warm_up": [{"call": "fla B1 T8192 H96", "s": 98.0, "error": None}], "tuning_file": None, "cases": rows}


def test_report_markdown_json_and_png_from_fake_timings(tmp_path):
    res = fake_results()
    made = write_report(res, tmp_path, command="kdagen bench --out x")
    md = made["report"].read_text()
    for text in ("# kdagen bench: NVIDIA H200, 2026-12-01", "commit abc1234", "driver 570.1", "torch 2.11",
                 "Triton 3.6.0", "Command: `kdagen bench --out x`", "copy bandwidth", "4.20 TB/s",
                 "![time per case](bench.png)",
                 "| B1 T8192 H96 | 8192 | sm80_a | 1.123 | 1.067-1.235 | - | sm80_a | 1.123 | yes | 2.800 | n/a | 0.243 |",
                 "| varlen 32x64 H32 | 2048 | sm80_a | 0.150 | 0.142-0.165 | 0.050 | sm80_b | 0.100 | **no** "
                 "(auto takes 1.50x the time of sm80_b) |",
                 "on 1 of 2 cases", "peer flashkda: not importable",
                 "| B1 T8192 H96 | sm90_c | 2.900 |", "| B1 T8192 H96 | fla | 2.800 |", "fla B1 T8192 H96 98 s"):
        assert text in md, text
    png = made["plot"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # the report is re-made from bench.json alone
    (tmp_path / "bench.json").write_text(json.dumps(res))
    again = tmp_path / "again"
    r = CliRunner().invoke(main, ["bench", "--from-json", str(tmp_path / "bench.json"), "--out", str(again)])
    assert r.exit_code == 0, r.output
    assert (again / "bench.md").read_text().replace("Command: `kdagen bench --out x`\n\n", "") == \
        md.replace("Command: `kdagen bench --out x`\n\n", "")
    assert (again / "bench.png").stat().st_size > 10_000


def test_report_names_the_tuning_file_and_where_it_comes_from():
    def said(**over) -> str:
        line = next(ln for ln in markdown({**fake_results(), **over}, plot=None).splitlines()
                    if ln.startswith("- tuning file: "))
        return line[len("- tuning file: "):]

    assert said() == "none (the targets’ constants)"
    shipped = "/site/kdagen/tuning_data/NVIDIA_H200.json"
    assert said(tuning_file=shipped) == shipped  # results of a kdagen before tuning_source
    assert said(tuning_file=shipped, tuning_source=tuning.FROM_SHIPPED) == f"{shipped} (shipped with kdagen)"
    assert said(tuning_file="/c/tuning/NVIDIA_H200.json", tuning_source=tuning.FROM_CACHE) == \
        "/c/tuning/NVIDIA_H200.json (the cache's, from `kdagen tune`)"


def test_report_without_matplotlib_says_how_to_make_the_plot(tmp_path, monkeypatch):
    import kdagen.bench_report as rep

    def no_mpl(*a, **k):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(rep, "plot", no_mpl)
    made = write_report(fake_results(), tmp_path)
    assert made["plot"] is None and "kdagen bench --from-json" in made["plot_error"]
    assert "![time per case]" not in made["report"].read_text()


def test_cases_files(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("- {name: a, H: 4, T: 128}\n- {name: b, H: 2, HV: 4, lens: [3, 0, 70], D: 64, compare: false}\n")
    a, c = b.load_cases(str(y))
    assert (a.tokens, a.N, a.hv, a.compare) == (128, 1, 4, True)
    assert (c.tokens, c.N, c.hv, c.D, c.compare, c.longest) == (73, 3, 4, 64, False, 70)
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"cases": [{"name": "x", "H": 1, "T": 5, "B": 2, "gate": "unbounded"}]}))
    assert b.load_cases(str(j))[0].tokens == 10
    # gate_fp32: g and beta in fp32 (an engine's call after fused_kda_gate); their bytes count 4 each
    f = tmp_path / "f.yaml"
    f.write_text("- {name: e, H: 2, T: 16, gate: precomputed, gate_fp32: true}\n- {name: d, H: 2, T: 16}\n")
    e, d = b.load_cases(str(f))
    assert (e.gate_fp32, d.gate_fp32) == (True, False)
    assert e.compulsory_bytes() - d.compulsory_bytes() == 16 * 2 * (1 + 128) * 2
    import torch

    kw, _ = e.inputs(dev="cpu")
    assert (kw["g"].dtype, kw["beta"].dtype, kw["q"].dtype) == (torch.float32, torch.float32, torch.bfloat16)
    # beta_prob: beta as sigmoid(logits), passed with beta_is_logit=False (vLLM's call)
    f.write_text("- {name: p, H: 2, T: 16, gate_fp32: true, beta_prob: true}\n")
    (p,) = b.load_cases(str(f))
    kp, _ = p.inputs(dev="cpu")
    assert 0 < float(kp["beta"].min()) and float(kp["beta"].max()) < 1 and float(kw["beta"].min()) < 0
    assert b.call_kwargs(p, kp, None)["beta_is_logit"] is False and "beta_is_logit" not in b.call_kwargs(e, kw, None)
    assert [c.name for c in b.load_cases("B1 T64 H32,B1 T8192 H96")] == ["B1 T64 H32", "B1 T8192 H96"]
    assert b.load_cases("issue17") == b.CASE_SETS["issue17"]
    both = b.load_cases("issue21, issue15")
    assert [c.name for c in both] == [c.name for c in b.CASE_SETS["issue21"] + b.CASE_SETS["issue15"]]
    assert (both[3].dtype, both[3].gate, both[4].D, both[4].gate, both[-1].D) == ("fp16", "unbounded", 64,
                                                                                 "precomputed", 256)
    # sets and files mix; names stay unique
    mixed = b.load_cases(f"issue15,{y}")
    assert [c.name for c in mixed] == [c.name for c in b.CASE_SETS["issue15"]] + ["a", "b"]
    with pytest.raises(b.BenchError, match="case names must be unique, found a, b more than once"):
        b.load_cases(f"{y},{y}")
    with pytest.raises(b.BenchError, match=r"\(unknown: nope\)"):
        b.load_cases(f"{y},nope")


@pytest.mark.parametrize("text, message", [
    ("- {name: a, T: 128}\n", "case 0: H: expected a positive integer, found None"),
    ("- {name: a, H: 4}\n", "case 0: T: expected T (tokens per sequence) or lens"),
    ("- {name: a, H: 4, T: 8, lens: [1, 2]}\n", "case 0: lens: expected without T and B"),
    ("- {name: a, H: 3, HV: 4, T: 8}\n", "case 0: HV: expected a multiple of H=3"),
    ("- {name: a, H: 4, T: 8, gate: soft}\n", "case 0: gate: expected one of"),
    ("- {name: a, H: 4, T: 8, heads: 2}\n", "case 0: unknown key(s) heads"),
    ("- {name: a, H: 4, T: 8, gate_fp32: 1}\n", "case 0: gate_fp32: expected true or false, found 1"),
    ("- {name: a, H: 4, T: 8, beta_prob: yes please}\n", "case 0: beta_prob: expected true or false, found 'yes please'"),
    ("- {name: a, H: 4, T: 8}\n- {name: a, H: 4, T: 9}\n", "case names must be unique, found a"),
    ("{}\n", "expected a non-empty list of cases"),
    ("- [unclosed\n", "not valid YAML"),
])
def test_bad_cases_file_names_the_file_and_the_key(tmp_path, text, message):
    p = tmp_path / "cases.yaml"
    p.write_text(text)
    with pytest.raises(b.BenchError) as e:
        b.load_cases(str(p))
    assert str(p) in str(e.value) and message in str(e.value)


@pytest.mark.parametrize("args, message", [
    (["bench", "--cases", "nope"], "--cases: expected a set (crossover, default, engine, gates, issue15, issue16, issue17, issue21, pool, shapes, short)"),
    (["bench", "--cases", "missing.yaml"], "--cases missing.yaml: cannot be read"),
    (["bench", "--compare", "fla,cudnn"], "--compare: expected a comma-separated list of fla, flashkda"),
    (["bench", "--top", "-1"], "--top: expected 0 (every candidate) or a positive count, found -1"),
    (["bench", "--budget-ms", "0"], "--budget-ms: expected a positive number"),
    (["tune", "--warm-procs", "-2"], "--warm-procs: expected 0 or more processes, found -2"),
    (["bench", "--from-json", "nothing.json"], "nothing.json: cannot be read"),
])
def test_cli_argument_errors(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "wrong.json").write_text("{}")
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and message in r.output, r.output


def test_cli_from_json_of_something_else(tmp_path):
    p = tmp_path / "wrong.json"
    p.write_text(json.dumps({"kind": "other"}))
    r = CliRunner().invoke(main, ["bench", "--from-json", str(p)])
    assert r.exit_code == 2 and "expected the bench.json of `kdagen bench`" in r.output


def test_cli_bench_without_a_gpu_says_so(tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    r = CliRunner().invoke(main, ["bench", "--cases", "B1 T64 H32", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "needs a CUDA GPU" in r.output


def test_candidates_are_timed_in_interleaved_rounds():
    """rounds = 3: each candidate is timed three times, in turn with the others (the fake timer's values come
    in call order), with a third of the budget each; its timing is the median of its rounds' medians, and the
    rounds' medians are kept. A drift that slows every third call ranks no candidate by its place."""
    opts = b.Options(compare=(), warm_procs=0, top=0, graphs=False, rounds=3, budget_ms=90.0)
    budgets = []
    base = fake_timers([1.0, 0.5, 1.3, 0.65, 0.9, 0.45])

    def time_calls(fn, sets, **kw):
        budgets.append(kw["budget_ms"])
        return base.time_calls(fn, sets, **kw)

    timers = types.SimpleNamespace(time_calls=time_calls, copy_bandwidth=base.copy_bandwidth,
                                   graph_calls=base.graph_calls)
    res = b.run([TINY], opts, echo=lambda m: None, device="cpu", timers=timers)
    a, c = res["cases"][0]["variants"]
    assert a["round_medians"] == [1.0, 1.3, 0.9] and c["round_medians"] == [0.5, 0.65, 0.45]
    assert a["timing"]["median"] == 1.0 and c["timing"]["median"] == 0.5
    assert a["timing"]["n"] == 60 and a["timing"]["p90"] == pytest.approx(1.2 * 1.3)
    assert budgets == [30.0] * 6 and res["options"]["rounds"] == 3
    assert res["cases"][0]["best"] == c["variant"]


def test_environment_names_a_peer_by_its_metadata(tmp_path, monkeypatch):
    # scripts/flashkda_peer.py's build: a flash_kda package without __version__ beside pip metadata naming the commit
    (tmp_path / "flash_kda").mkdir()
    (tmp_path / "flash_kda" / "__init__.py").write_text("")
    meta = tmp_path / "flash_kda-0.0.1+1ce47ea.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: flash_kda\nVersion: 0.0.1+1ce47ea\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_kda", raising=False)
    assert b.environment()["flashkda"] == "0.0.1+1ce47ea"
    (meta / "METADATA").unlink()
    meta.rmdir()
    monkeypatch.delitem(sys.modules, "flash_kda", raising=False)
    assert b.environment()["flashkda"] == "installed"
