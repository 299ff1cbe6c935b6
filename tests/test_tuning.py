"""The tuning file (kdagen/tuning.py): its round trip, its errors, and dispatch reading it."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest
import torch

import kdagen.select as sel
from kdagen import tuning
from kdagen.inputs import CallInfo
from kdagen.tuning import Rule, Tuning, TuningError
from kdagen.variant import Variant

from .runtime_env import fresh_runtime  # noqa: F401
from .test_select import info as select_info

GPU = "NVIDIA Test GPU"


def info(**over) -> CallInfo:
    """test_select's call (cuda:0, bf16, D128, T8192), with 96 heads unless `over` says otherwise."""
    return select_info(**{"H": 96, "HV": 96, **over})


def sm80(chunk: int, bv: int) -> Variant:
    return Variant(target="sm80", chunk=chunk, k=128, v=128, dtype="bf16", gate="bounded", state="fp32", block_v=bv)


# every sm80 chunk/block_v pair the target builds at K = 128
SM80 = [sm80(16, 16), sm80(16, 32), sm80(16, 64), sm80(64, 16), sm80(64, 32)]


def a_tuning(**over) -> Tuning:
    rules = (
        Rule(target="sm80", dtype="bf16", head_dim=128, tokens_per_seq=(2048, 32768), seq_heads_per_sm=(0.25, 1.0),
             chunk=64, block_v=16, evidence={"cases": ["B1 T8192 H96"]}),
        Rule(target="sm80", tokens_per_seq=(32768, math.inf), seq_heads_per_sm=(0, 0.25), block_v=64),
    )
    kw = dict(gpu=GPU, sm_count=132, rules=rules, meta={"made_by": "test", "date": "2026-12-01", "commit": "abc"})
    kw.update(over)
    return Tuning(**kw)


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """A CUDA device named GPU with 132 SMs (nothing runs), and KDAGEN_TUNING pointing at a file."""
    monkeypatch.setattr(sel, "device_reason", lambda target, device: None)
    monkeypatch.setattr(sel, "_sm_count", lambda device: 132)
    monkeypatch.setattr(tuning, "_device_name", lambda index: GPU)
    path = tmp_path / "tuning.json"
    monkeypatch.setenv(tuning.ENV, str(path))
    tuning.forget()
    yield path
    tuning.forget()


def test_round_trip(tmp_path):
    t = a_tuning()
    path = tuning.save(t, tmp_path / "t" / "gpu.json")
    back = tuning.load(path)
    assert back == t
    assert back.rules[0].evidence == {"cases": ["B1 T8192 H96"]}
    assert back.meta == t.meta
    data = json.loads(path.read_text())
    assert (data["format"], data["version"], data["gpu"], data["sm_count"]) == ("kdagen-tuning", 1, GPU, 132)
    # an unbounded range is written as null and read back as infinity
    assert data["rules"][1]["tokens_per_seq"] == [32768, None]
    assert back.rules[1].tokens_per_seq == (32768.0, math.inf)


def test_default_location_is_per_gpu_in_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv(tuning.ENV, raising=False)
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path / "shipped")
    cache = tmp_path / "c" / "tuning" / "NVIDIA_H200.json"
    # default_path is the cache's file, where `kdagen tune` writes, whether or not it exists
    assert tuning.default_path("NVIDIA H200") == tuning.write_path("NVIDIA H200") == cache
    assert tuning.path_for("NVIDIA H200") is None  # nothing written yet, nothing shipped
    tuning.save(a_tuning(gpu="NVIDIA H200"), cache)
    assert tuning.lookup("NVIDIA H200") == (cache, tuning.FROM_CACHE)
    assert tuning.path_for("NVIDIA H200") == cache
    monkeypatch.setenv(tuning.ENV, "off")
    assert tuning.path_for("NVIDIA H200") is None and tuning.disabled()
    assert tuning.write_path("NVIDIA H200") == cache  # tune still writes the cache's
    monkeypatch.setenv(tuning.ENV, str(tmp_path / "mine.json"))
    assert tuning.write_path("NVIDIA H200") == tmp_path / "mine.json"


def test_shipped_files_are_named_by_the_gpu_name_slug(monkeypatch, tmp_path):
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path)
    assert tuning.shipped_path("NVIDIA H200") is None
    tuning.save(a_tuning(gpu="NVIDIA H200"), tmp_path / "NVIDIA_H200.json")
    assert tuning.shipped_path("NVIDIA H200") == tmp_path / "NVIDIA_H200.json"
    assert tuning.shipped_path("NVIDIA H100 80GB HBM3") is None


def test_the_package_folder_of_shipped_files():
    assert tuning.SHIPPED_DIR == Path(tuning.__file__).resolve().parent / "tuning_data"
    assert tuning.SHIPPED_DIR.is_dir()


# distinct settings for T8192 H96, so a call's choice tells which file dispatch read
# (the defaults there: chunk 16, block_v 32)
SHIPPED, CACHED, FROM_ENV, DEFAULTS = (64, 16), (16, 64), (64, 32), (16, 32)


def whole_range(chunk: int, bv: int, **over) -> Tuning:
    """A file with one sm80 rule over every regime, setting (chunk, bv)."""
    return a_tuning(rules=(Rule(target="sm80", tokens_per_seq=(0, math.inf), seq_heads_per_sm=(0, math.inf),
                                chunk=chunk, block_v=bv),), **over)


def choice() -> tuple[int, int]:
    best = sel.select(SM80, info())
    return best.chunk, best.block_v


@pytest.fixture
def layers(monkeypatch, tmp_path):
    """A CUDA device named GPU with 132 SMs, KDAGEN_TUNING unset, the cache and the shipped folder
    in tmp_path: (the env file, the cache's file, the shipped file of GPU), none written yet."""
    monkeypatch.setattr(sel, "device_reason", lambda target, device: None)
    monkeypatch.setattr(sel, "_sm_count", lambda device: 132)
    monkeypatch.setattr(tuning, "_device_name", lambda index: GPU)
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setattr(tuning, "_LOGGED", set())
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv(tuning.ENV, raising=False)
    tuning.forget()
    yield (tmp_path / "env.json", tmp_path / "c" / "tuning" / "NVIDIA_Test_GPU.json",
           tmp_path / "shipped" / "NVIDIA_Test_GPU.json")
    tuning.forget()


def test_lookup_order_env_file_then_cache_then_shipped(layers, monkeypatch):
    env, cache, shipped = layers
    assert choice() == DEFAULTS and tuning.lookup(GPU) is None
    tuning.save(whole_range(*SHIPPED), shipped)
    assert tuning.lookup(GPU) == (shipped, tuning.FROM_SHIPPED)
    assert choice() == SHIPPED
    tuning.save(whole_range(*CACHED), cache)  # the user's own file wins over the shipped one
    assert tuning.lookup(GPU) == (cache, tuning.FROM_CACHE)
    assert choice() == CACHED
    tuning.save(whole_range(*FROM_ENV), env)
    monkeypatch.setenv(tuning.ENV, str(env))
    assert tuning.lookup(GPU) == (env, tuning.FROM_ENV)
    assert choice() == FROM_ENV
    # KDAGEN_TUNING names the file: one that does not exist means no tuning, not the next layer
    monkeypatch.setenv(tuning.ENV, str(env.with_name("missing.json")))
    assert choice() == DEFAULTS
    monkeypatch.delenv(tuning.ENV)
    cache.unlink()
    assert choice() == SHIPPED


@pytest.mark.parametrize("off", ["off", "0", "none", "OFF"])
def test_off_ignores_the_shipped_file_too(layers, monkeypatch, off):
    _, _, shipped = layers
    tuning.save(whole_range(*SHIPPED), shipped)
    assert choice() == SHIPPED
    monkeypatch.setenv(tuning.ENV, off)
    assert tuning.lookup(GPU) is None and tuning.for_device(torch.device("cuda", 0)) is None
    assert choice() == DEFAULTS


def test_a_shipped_file_of_another_gpu_name_is_not_read(layers):
    _, _, shipped = layers
    other = shipped.with_name("NVIDIA_Other_GPU.json")
    tuning.save(whole_range(*SHIPPED, gpu="NVIDIA Other GPU"), other)
    assert tuning.shipped_path(GPU) is None and tuning.lookup(GPU) is None
    assert choice() == DEFAULTS


def test_a_gpu_of_the_same_silicon_reads_the_shipped_file_of_its_twin(layers, monkeypatch, caplog):
    """SAME_SILICON: the device has no shipped file of its own; its twin's serves it, the device's
    own (cache, KDAGEN_TUNING) files still first, and only shipped files stand in."""
    env, cache, shipped = layers
    monkeypatch.setitem(tuning.SAME_SILICON, GPU, "NVIDIA Twin GPU")
    twin = shipped.with_name("NVIDIA_Twin_GPU.json")
    tuning.save(whole_range(*SHIPPED, gpu="NVIDIA Twin GPU"), twin)
    assert tuning.shipped_path(GPU) == twin and tuning.lookup(GPU) == (twin, tuning.FROM_SHIPPED)
    caplog.set_level(logging.DEBUG, logger="kdagen")
    assert choice() == SHIPPED
    assert any("measured on the same silicon: NVIDIA Twin GPU" in r.getMessage() for r in caplog.records)
    tuning.save(whole_range(*CACHED), cache)
    assert choice() == CACHED
    # a file of the twin in the cache is not the device's own: an error, as for any other GPU
    tuning.save(whole_range(*CACHED, gpu="NVIDIA Twin GPU"), cache)
    with pytest.raises(TuningError, match="made on 'NVIDIA Twin GPU'"):
        choice()
    cache.unlink()
    # the device's own shipped file wins over its twin's
    tuning.save(whole_range(*FROM_ENV), shipped)
    assert tuning.shipped_path(GPU) == shipped and choice() == FROM_ENV


def test_the_shipped_files_and_twins():
    """Every shipped file parses and is named by its GPU's slug; every SAME_SILICON twin ships."""
    files = sorted(tuning.SHIPPED_DIR.glob("*.json"))
    assert {f.name for f in files} >= {"NVIDIA_H200.json", "NVIDIA_H100_80GB_HBM3.json"}
    for f in files:
        t = tuning.load(f)
        assert f.name == f"{tuning.slug(t.gpu)}.json" and t.sm_count > 0 and t.rules, f
    for gpu, twin in tuning.SAME_SILICON.items():
        assert tuning.shipped_path(twin) is not None, twin
        assert tuning.made_for(twin, gpu, tuning.FROM_SHIPPED) and not tuning.made_for(twin, gpu, tuning.FROM_CACHE)
    assert tuning.shipped_path("NVIDIA H800") == tuning.SHIPPED_DIR / "NVIDIA_H100_80GB_HBM3.json"


def test_a_shipped_file_under_the_device_slug_made_on_another_gpu_is_an_error(layers):
    _, _, shipped = layers
    # "NVIDIA Test-GPU" would slug differently; "NVIDIA Test  GPU" (two spaces) slugs the same
    tuning.save(whole_range(*SHIPPED, gpu="NVIDIA Test  GPU"), shipped)
    with pytest.raises(TuningError, match=f"made on 'NVIDIA Test  GPU'.*{tuning.ENV}=off"):
        choice()


def test_a_shipped_file_of_another_sm_count_is_ignored(layers):
    _, _, shipped = layers
    tuning.save(whole_range(*SHIPPED, sm_count=66), shipped)  # e.g. a MIG slice of the GPU measured
    assert tuning.lookup(GPU) == (shipped, tuning.FROM_SHIPPED)
    assert tuning.for_device(torch.device("cuda", 0)) is None
    assert choice() == DEFAULTS


def test_debug_log_names_the_file_and_where_it_comes_from_once(layers, caplog, monkeypatch):
    env, cache, shipped = layers
    caplog.set_level(logging.DEBUG, logger="kdagen")
    tuning.save(whole_range(*SHIPPED), shipped)
    for _ in range(3):
        assert choice() == SHIPPED
    said = [r.getMessage() for r in caplog.records if "tuning file" in r.getMessage()]
    assert said == [f"kdagen: tuning file for {GPU}: {shipped} (shipped with kdagen), 1 rule(s)"]
    assert all(r.levelno == logging.DEBUG for r in caplog.records if "tuning file" in r.getMessage())
    caplog.clear()
    tuning.save(whole_range(*CACHED), cache)
    choice()
    choice()
    said = [r.getMessage() for r in caplog.records if "tuning file" in r.getMessage()]
    assert said == [f"kdagen: tuning file for {GPU}: {cache} (the cache's, from `kdagen tune`), 1 rule(s)"]
    caplog.clear()
    tuning.save(whole_range(*SHIPPED, sm_count=66), env)
    monkeypatch.setenv(tuning.ENV, str(env))
    choice()
    said = [r.getMessage() for r in caplog.records if "tuning file" in r.getMessage()]
    assert said == [f"kdagen: tuning file for {GPU}: {env} (from {tuning.ENV}), 1 rule(s); ignored: made for "
                    "66 SMs, the device has 132"]


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(version=2), "version: expected 1"),
    (lambda d: d.update(format="other"), "format: expected 'kdagen-tuning'"),
    (lambda d: d.pop("sm_count"), "sm_count: expected a positive integer"),
    (lambda d: d["rules"][0].update(target="sm70"), "rules[0].target: expected one of"),
    (lambda d: d["rules"][0].update(chunk=32), "rules[0].chunk: expected one of (16, 64)"),
    (lambda d: d["rules"][1].update(block_v=0), "rules[1].block_v: expected a positive integer or null"),
    (lambda d: d["rules"][0].update(tokens_per_seq=[100, 10]), "rules[0].tokens_per_seq: expected [lo, hi]"),
    (lambda d: d["rules"][0].update(speed=1), "rules[0]: unknown key(s) speed"),
    (lambda d: d["rules"][0].update(rank=-1), "rules[0].rank: expected an integer >= 0 or null"),
])
def test_invalid_files_name_the_file_and_the_entry(tmp_path, edit, message):
    data = a_tuning().as_dict()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TuningError) as e:
        tuning.load(path)
    assert str(path) in str(e.value) and message in str(e.value)


def test_not_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"format": "kdagen-tuning",')
    with pytest.raises(TuningError, match=r"broken\.json: not valid JSON \(line 1"):
        tuning.load(path)


def test_dispatch_defaults_without_a_file(gpu):
    assert not gpu.exists()
    best = sel.select(SM80, info())
    # the target's constants: chunk 16, block_v 32 (96 heads x 4 blocks >= 0.7 x 132 SMs)
    assert (best.chunk, best.block_v) == (16, 32)


def test_dispatch_reads_the_rule_of_the_calls_regime(gpu):
    tuning.save(a_tuning(), gpu)
    # T8192 H96: 8192 tokens per sequence, 96 / 132 = 0.73 sequences x heads per SM: rule 0
    best = sel.select(SM80, info())
    assert (best.chunk, best.block_v) == (64, 16)
    # T65536 H24: rule 1 sets block_v only; the chunk stays the target's
    best = sel.select(SM80, info(T=65536, max_len=65536, H=24, HV=24))
    assert (best.chunk, best.block_v) == (16, 64)
    # a regime no rule covers (1024 tokens per sequence): the defaults
    best = sel.select(SM80, info(T=1024, max_len=1024))
    assert (best.chunk, best.block_v) == (16, 32)
    # another head dim than rule 0's: rule 0 does not apply (rule 1 does not match the regime)
    d64 = [dataclasses.replace(x, k=64, v=64) for x in SM80]
    best = sel.select(d64, info(K=64, V=64))
    assert (best.chunk, best.block_v) == (16, 32)


def test_dispatch_memo_key_follows_the_rules(gpu):
    assert tuning.memo_key(info()) == ()
    tuning.save(a_tuning(), gpu)
    assert tuning.memo_key(info()) == (0,)
    assert tuning.memo_key(info(T=65536, max_len=65536, H=24, HV=24)) == (1,)
    assert tuning.memo_key(info(T=1024, max_len=1024)) == ()


def test_a_file_of_another_gpu_is_an_error_and_another_sm_count_is_ignored(gpu):
    tuning.save(a_tuning(gpu="NVIDIA Other"), gpu)
    with pytest.raises(TuningError, match="made on 'NVIDIA Other'"):
        sel.select(SM80, info())
    tuning.save(a_tuning(sm_count=66), gpu)  # e.g. a MIG slice: regimes are per SM
    assert tuning.for_device(torch.device("cuda", 0)) is None
    assert (sel.select(SM80, info()).chunk, sel.select(SM80, info()).block_v) == (16, 32)


def test_off_ignores_the_file(gpu, monkeypatch):
    tuning.save(a_tuning(), gpu)
    monkeypatch.setenv(tuning.ENV, "off")
    assert (sel.select(SM80, info()).chunk, sel.select(SM80, info()).block_v) == (16, 32)


def test_derive_rules_takes_the_best_geomean_per_regime():
    def m(case, tps, shs, times):
        return {"case": case, "target": "sm80", "dtype": "bf16", "head_dim": 128, "tokens_per_seq": tps,
                "seq_heads_per_sm": shs, "times": times}

    ms = [
        # same regime (tokens [2048, 8192) x heads/SM [0.5, 1)): (16, 64) is best on one, close on the other
        m("a", 4096, 0.5, {(16, 32): 1.00, (16, 64): 0.90, (64, 16): 1.50}),
        m("b", 6000, 0.7, {(16, 32): 1.00, (16, 64): 1.02, (64, 16): 0.99}),
        # another regime, where only two settings ran
        m("c", 65536, 0.1, {(16, 16): 2.0, (16, 32): 1.8}),
        m("empty", 100, 0.1, {}),
    ]
    rules = tuning.derive_rules(ms)
    # c's cell, and the other half of its coarse cell [0.0625, 0.25) filled from it
    assert len(rules) == 3
    r = next(r for r in rules if r.tokens_per_seq == (2048, 8192))
    assert (r.chunk, r.block_v, r.seq_heads_per_sm) == (16, 64, (0.5, 1.0))
    # geomean of 0.90/0.90 and 1.02/0.99
    assert r.evidence["geomean_vs_best"] == pytest.approx(math.sqrt(1.02 / 0.99), abs=1e-4)
    assert r.evidence["cases"] == ["a", "b"]
    long = sorted((r for r in rules if r.tokens_per_seq == (32768, math.inf)), key=lambda r: r.seq_heads_per_sm)
    assert [(r.chunk, r.block_v, r.seq_heads_per_sm) for r in long] == [(16, 32, (0.0625, 0.125)),
                                                                        (16, 32, (0.125, 0.25))]
    assert "filled_from" not in long[0].evidence and long[1].evidence["filled_from"] == [0.0625, 0.25]


def test_derive_rules_part_h16_from_h32_and_fill_the_cells_no_case_covers():
    """eng T8192 H16 and H32 on 132 SMs (0.121 and 0.242 sequences x heads per SM) measured on an H100
    (session 50's tune; session 54's bench): sm80 block_v 16 1.46x faster at H16, sm90 at H32. In one cell
    their geomean sent H32 to sm80; 0.125 parts them. Cells without a case keep the coarse cell's rule."""
    def m(case, H, target, times, T=8192):
        tps, shs = tuning.regime(T, 1, 1, H, 132)
        return {"case": case, "target": target, "dtype": "bf16", "head_dim": 128, "gate": "precomputed",
                "tokens_per_seq": tps, "seq_heads_per_sm": shs, "times": times}

    ms = [m("eng T8192 H32", 32, "sm80", {(16, 16): 0.5429, (16, 32): 0.5112, (16, 64): 0.5402}),
          m("eng T8192 H16", 16, "sm80", {(16, 16): 0.3388, (16, 32): 0.4054, (16, 64): 0.5311}),
          m("eng T8192 H32", 32, "sm90", {(16, 64): 0.4967, (16, 128): 1.2006}),
          m("eng T8192 H16", 16, "sm90", {(16, 64): 0.4953, (16, 128): 1.2473}),
          # one case in [0.25, 0.5) of 8192-token sequences: its cell only (the coarse grid splits there too)
          m("eng T8192 H48", 48, "sm80", {(16, 16): 0.9, (16, 64): 0.8})]
    rules = tuning.derive_rules(ms)
    by = {(r.target, r.seq_heads_per_sm): r for r in rules}
    assert (by["sm80", (0.0625, 0.125)].block_v, by["sm80", (0.0625, 0.125)].rank) == (16, 0)
    assert (by["sm90", (0.0625, 0.125)].block_v, by["sm90", (0.0625, 0.125)].rank) == (64, 1)
    assert (by["sm80", (0.125, 0.25)].block_v, by["sm80", (0.125, 0.25)].rank) == (32, 1)
    assert (by["sm90", (0.125, 0.25)].block_v, by["sm90", (0.125, 0.25)].rank) == (64, 0)
    assert by["sm80", (0.25, 0.5)].block_v == 64 and len(rules) == 5
    assert not any("filled_from" in r.evidence for r in rules)
    # H16 alone: its coarse cell's other half takes H16's rules, ranks and all (what the coarse grid gave)
    rules = tuning.derive_rules([x for x in ms if x["case"] == "eng T8192 H16"])
    by = {(r.target, r.seq_heads_per_sm): r for r in rules}
    assert {k[1] for k in by} == {(0.0625, 0.125), (0.125, 0.25)}
    assert [(by[t, (0.125, 0.25)].block_v, by[t, (0.125, 0.25)].rank) for t in ("sm80", "sm90")] == [(16, 0), (64, 1)]
    assert by["sm80", (0.125, 0.25)].evidence["filled_from"] == [0.0625, 0.25]
    # a tuned file reads back: dispatch looks the H32 call up in the cell that ranks sm90 first
    t = tuning.Tuning(gpu="NVIDIA H100 80GB HBM3", sm_count=132, rules=tuple(tuning.derive_rules(ms)))
    shs32 = tuning.regime(8192, 1, 1, 32, 132)[1]
    assert t.rule_for("sm90", "bf16", 128, 8192, shs32, "precomputed").rank == 0
    assert t.rule_for("sm80", "bf16", 128, 8192, shs32, "precomputed").rank == 1


def triton(chunk: int, bv: int) -> Variant:
    return Variant(target="triton", chunk=chunk, k=128, v=128, dtype="bf16", gate="bounded", state="fp32",
                   block_v=bv)


def test_derive_rules_ranks_the_targets_of_a_regime():
    def m(case, tps, shs, target, times):
        return {"case": case, "target": target, "dtype": "bf16", "head_dim": 128, "tokens_per_seq": tps,
                "seq_heads_per_sm": shs, "times": times}

    ms = [
        # one regime, two targets on the same two cases: triton's best setting is faster on both
        m("a", 8192, 0.03, "sm80", {(16, 16): 0.50, (64, 16): 0.56}),
        m("b", 9000, 0.04, "sm80", {(16, 16): 1.00, (64, 16): 0.90}),
        m("a", 8192, 0.03, "triton", {(16, 16): 0.60, (64, 16): 0.40}),
        m("b", 9000, 0.04, "triton", {(16, 16): 1.10, (64, 16): 0.85}),
        # another regime where the two targets share no case: no ranks
        m("c", 65536, 0.1, "sm80", {(16, 32): 1.8}),
        m("d", 70000, 0.1, "triton", {(16, 32): 2.5}),
    ]
    rules = {(r.target, r.tokens_per_seq): r for r in tuning.derive_rules(ms)}
    s, t = rules["sm80", (8192, 16384)], rules["triton", (8192, 16384)]
    # each target's own setting first: triton c64 wins both cases; for sm80, c16 (1.0 and 1.11 of
    # the case's best, geomean 1.054) beats c64 (1.12 and 1.0: 1.058)
    assert (t.chunk, t.block_v, s.chunk, s.block_v) == (64, 16, 16, 16)
    assert (t.rank, s.rank) == (0, 1)
    # sm80 at its setting over the fastest target's, geomean over the shared cases a and b
    assert s.evidence["vs_fastest_target"] == pytest.approx(math.sqrt(0.50 / 0.40 * 1.00 / 0.85), abs=1e-4)
    assert t.evidence["vs_fastest_target"] == 1.0
    assert rules["sm80", (32768, math.inf)].rank is None and rules["triton", (32768, math.inf)].rank is None


def test_dispatch_prefers_the_target_ranked_first_in_the_regime(gpu):
    cands = SM80 + [triton(16, 32), triton(64, 16)]
    # without a file: the targets' own order (sm80 before triton)
    assert sel.select(cands, info()).target == "sm80"
    rules = (
        Rule(target="triton", tokens_per_seq=(2048, 32768), seq_heads_per_sm=(0.25, 1.0), chunk=64, block_v=16,
             rank=0),
        Rule(target="sm80", tokens_per_seq=(2048, 32768), seq_heads_per_sm=(0.25, 1.0), chunk=16, block_v=32,
             rank=1),
        # a regime ranking nothing: the targets' own order, with this rule's setting
        Rule(target="sm80", tokens_per_seq=(32768, math.inf), seq_heads_per_sm=(0, 0.25), block_v=64),
    )
    tuning.save(a_tuning(rules=rules), gpu)
    best = sel.select(cands, info())  # T8192 H96: the first regime
    assert (best.target, best.chunk, best.block_v) == ("triton", 64, 16)
    best = sel.select(cands, info(T=65536, max_len=65536, H=24, HV=24))
    assert (best.target, best.block_v) == ("sm80", 64)
    # a target the file ranks beats one it does not rank in that regime, whatever their own order
    tuning.save(a_tuning(rules=rules[:1]), gpu)
    assert sel.select(cands, info()).target == "triton"


def test_a_rules_setting_beats_a_built_variant_of_another_setting(gpu):
    """The rule's chunk and block_v outrank readiness: dispatch builds the measured-fastest variant rather than
    take whichever of the target's variants earlier calls happened to build (the H200 wheel run of session 19
    kept a built block_v 64 where the shipped file said 128)."""
    from kdagen.select import GENERATE, NEEDS_BUILD, READY, Candidate

    tuning.save(a_tuning(), gpu)  # T8192 H96: chunk 64, block_v 16
    built = Candidate(sm80(16, 32), READY)
    for readiness in (NEEDS_BUILD, GENERATE):
        cands = [built, Candidate(sm80(64, 16), readiness), Candidate(sm80(64, 32), READY)]
        best, _ = sel.choose(cands, info())
        assert (best.variant.chunk, best.variant.block_v, best.readiness) == (64, 16, readiness)
    # one that cannot be built here is rejected, and the ready ones are ranked as before
    blocked = Candidate(sm80(64, 16), NEEDS_BUILD, blocked="no nvcc")
    best, rejected = sel.choose([built, blocked, Candidate(sm80(64, 32), READY)], info())
    assert (best.variant.chunk, best.variant.block_v) == (64, 32) and rejected == [(blocked, "no nvcc")]
    # without a rule for the regime, readiness still comes first
    best, _ = sel.choose([built, Candidate(sm80(16, 64), GENERATE)], info(T=1024, max_len=1024))
    assert best is built


def test_issue16_rows_fall_in_their_own_regimes():
    """B1 T8192 H96, B1 T8192 H64 and B1 T16384 H48 on a 132-SM GPU (H200) get three regimes: their
    fastest targets and V-splits differ (sm80 block_v 32, sm90's CTA pair, sm80 block_v 16 in one process,
    2026-12-02), so one rule for the three mis-dispatched two of them."""
    cells = {(T, H): tuple(tuning.bucket(x, e) for x, e in zip(tuning.regime(T, 1, 1, H, 132),
                                                              (tuning.TOKEN_EDGES, tuning.SEQ_HEAD_EDGES)))
             for T, H in [(8192, 96), (8192, 64), (16384, 48)]}
    assert len(set(cells.values())) == 3, cells
    assert cells[8192, 64] == ((8192, 16384), (0.25, 0.5))


def test_a_rule_measured_on_one_gate_form_leaves_the_others_to_the_defaults(gpu, tmp_path):
    # On the H200 sm90's unbounded gate took 2.2-5x sm80's time where its bounded gate was the faster
    # (session 37): a rule ranks only the gate form it was measured on.
    cands = SM80 + [triton(16, 32), triton(64, 16)]
    rules = (Rule(target="triton", tokens_per_seq=(2048, 32768), seq_heads_per_sm=(0.25, 1.0), chunk=64, block_v=16,
                  rank=0, gate="bounded"),)
    tuning.save(a_tuning(rules=rules), gpu)
    assert tuning.load(gpu).rules[0].gate == "bounded"
    assert sel.select(cands, info()).target == "triton"
    gu = [dataclasses.replace(x, gate="unbounded") for x in cands]
    assert sel.select(gu, info(gate="unbounded")).target == "sm80"  # no rule: the targets' own order
    assert tuning.memo_key(info()) == (0,) and tuning.memo_key(info(gate="unbounded")) == ()
    # tune keeps the forms apart: one regime, one target, two gates -> two rules
    ms = [{"case": c, "target": "sm80", "dtype": "bf16", "head_dim": 128, "gate": g, "tokens_per_seq": 8192,
           "seq_heads_per_sm": 0.7, "times": t} for c, g, t in
          (("a", "bounded", {(16, 32): 1.0, (16, 64): 0.9}), ("b", "unbounded", {(16, 32): 0.8, (16, 64): 0.9}))]
    got = {r.gate: r.block_v for r in tuning.derive_rules(ms)}
    assert got == {"bounded": 64, "unbounded": 32}
    data = a_tuning(rules=rules).as_dict()
    data["rules"][0]["gate"] = "softplus"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(TuningError, match=r"rules\[0\]\.gate: expected null or one of"):
        tuning.load(bad)


def test_a_files_ranks_come_before_the_targets_preferred_regimes(gpu):
    """T16384 H48 lies in sm90's preferred regime: a rule ranking sm80 first there wins, a file with
    no rule there leaves the preference in force."""
    sm90 = Variant(target="sm90", chunk=16, k=128, v=128, dtype="bf16", gate="bounded", state="fp32", block_v=64)
    cands = SM80 + [sm90]
    call = info(T=16384, H=48, HV=48)
    elsewhere = (Rule(target="sm80", tokens_per_seq=(0, 2048), seq_heads_per_sm=(0, math.inf), rank=0),)
    tuning.save(a_tuning(rules=elsewhere), gpu)
    assert sel.select(cands, call).target == "sm90"
    here = (Rule(target="sm80", tokens_per_seq=(8192, 32768), seq_heads_per_sm=(0.25, 1.0), rank=0),)
    tuning.save(a_tuning(rules=here), gpu)
    assert sel.select(cands, call).target == "sm80"


def test_sm90_preferred_regimes_are_what_the_shipped_hopper_files_agree_on():
    """Every D128 (regime, gate) cell where the shipped H200 and H100 files rank the same target
    first: sm90's preferred regimes hold the cell exactly when that target is sm90. A retune that moves
    the files' consensus fails here until the targets' constants follow it."""
    files = [tuning.load(tuning.SHIPPED_DIR / f"{tuning.slug(g)}.json") for g in ("NVIDIA H200", "NVIDIA H100 80GB HBM3")]
    firsts: list[dict] = []
    for t in files:
        cells: dict[tuple, list] = {}
        for r in t.rules:
            if r.head_dim in (None, 128) and r.dtype in (None, "bf16") and r.rank is not None:
                cells.setdefault((r.gate, r.tokens_per_seq, r.seq_heads_per_sm), []).append((r.rank, r.target))
        firsts.append({k: min(v)[1] for k, v in cells.items()})
    agreed = {k: a for k, a in firsts[0].items() if firsts[1].get(k) == a}
    assert len(agreed) >= 20, len(agreed)
    sm90 = sel.TARGETS["sm90"]
    for (gate, (tlo, thi), (slo, shi)), first in agreed.items():
        tokens = int(tlo * 1.5) if math.isinf(thi) else int((tlo + thi) / 2)
        seq_heads = slo * 2 if math.isinf(shi) else (slo + shi) / 2
        hv = max(1, round(seq_heads * 132))
        call = info(T=tokens, max_len=tokens, H=hv, HV=hv, gate=gate or "bounded")
        assert sel.in_preferred_regime(sm90, call, 132) == (first == "sm90"), (gate, tlo, thi, slo, shi, first)
