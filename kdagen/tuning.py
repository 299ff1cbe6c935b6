"""The tuning file: per GPU, which chunk size and V-split width dispatch prefers in each shape
regime, written by `kdagen tune` from measurements and read by selection (kdagen/select.py).

Where no file exists (or no rule matches a call) the targets' constants apply
(TargetInfo.preferred_chunk, preferred_block_v, vsplit_min_waves): they are the defaults.

Which file dispatch reads for a GPU (path_for, lookup), first found:
1. KDAGEN_TUNING: that file (absent: no tuning); "off", "0" or "none": no tuning file at all;
2. <cache dir>/tuning/<slug(GPU name)>.json, where `kdagen tune` writes (default_path);
3. kdagen/tuning_data/<slug(GPU name)>.json, shipped with kdagen for GPUs measured (shipped_path),
   or the one of a GPU of the same silicon (SAME_SILICON: the H800 reads the H100 SXM's).
Either way a file made on another GPU name is an error, one of another SM count is ignored.
Format (JSON, versioned)::

    {"format": "kdagen-tuning", "version": 1, "gpu": "NVIDIA H200", "sm_count": 132,
     "made_by": "kdagen tune", "date": "...", "commit": "...",
     "rules": [{"target": "sm80", "dtype": "bf16", "head_dim": 128, "gate": "bounded",
                "tokens_per_seq": [2048, 8192], "seq_heads_per_sm": [0.25, 1.0],
                "chunk": 16, "block_v": 32, "rank": 0, "evidence": {...}}]}

A rule applies to a call of its target (dtype, head_dim and gate: null matches any) whose average
tokens per sequence (T * B / N) and sequences x value heads per SM (N * HV / SMs) lie in its
ranges [lo, hi) (hi null: no bound); the first matching rule of a target wins. `chunk` and
`block_v` (null: the default rule) become that target's preference for the call. `rank` (optional)
orders the targets measured in the regime, fastest first: dispatch prefers a lower rank over the
targets' own order, and a ranked target over one the file does not rank there.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from .errors import KdagenError

log = logging.getLogger("kdagen")

FORMAT = "kdagen-tuning"
VERSION = 1
ENV = "KDAGEN_TUNING"
# The tuning files shipped inside the package, one per GPU measured: <slug(GPU name)>.json.
SHIPPED_DIR = Path(__file__).resolve().parent / "tuning_data"
# The regimes `kdagen tune` writes rules for: edges of tokens per sequence and of sequences x
# value heads per SM (chunk size follows the serial chain's length; V-split the programs per SM).
# 16384 and 0.5 split the cell of B1 T8192 H96 / H64 and T16384 H48, whose fastest targets and
# V-splits differ (H200 2026-12-02: sm90's CTA pair at H64, sm80 block_v 32 at H96, 16 at H48).
# 0.125 parts eng T8192 H16 from H32 (H100 2026-12-06: sm80 block_v 16 1.46x faster at H16, sm90 at
# H32; one rule for both sent H32 to sm80 at 1.10x the time). A cell of SEQ_HEAD_EDGES that no tuned
# case falls in takes the rule of its cell of COARSE_SEQ_HEAD_EDGES (the grid before that edge).
TOKEN_EDGES: tuple[float, ...] = (0, 512, 2048, 8192, 16384, 32768, math.inf)
SEQ_HEAD_EDGES: tuple[float, ...] = (0, 0.0625, 0.125, 0.25, 0.5, 1.0, 4.0, math.inf)
COARSE_SEQ_HEAD_EDGES: tuple[float, ...] = (0, 0.0625, 0.25, 0.5, 1.0, 4.0, math.inf)


class TuningError(KdagenError):
    """A tuning file that cannot be read: names the file, the entry and what was expected."""


@dataclass(frozen=True)
class Rule:
    target: str
    tokens_per_seq: tuple[float, float]
    seq_heads_per_sm: tuple[float, float]
    dtype: Optional[str] = None
    head_dim: Optional[int] = None
    chunk: Optional[int] = None
    block_v: Optional[int] = None
    rank: Optional[int] = None  # order among the targets measured in this regime (0: fastest)
    # The gate form measured (null: any). The forms' kernels can differ in speed on one target (sm90's
    # unbounded gate took 1.5x its bounded gate's time per chunk until session 38), so a rule measured on
    # one gate says nothing certain of another.
    gate: Optional[str] = None
    evidence: dict = field(default_factory=dict, compare=False)

    def matches(self, target: str, dtype: str, head_dim: int, tokens_per_seq: float, seq_heads_per_sm: float,
                gate: Optional[str] = None) -> bool:
        return (self.target == target and self.dtype in (None, dtype) and self.head_dim in (None, head_dim)
                and self.gate in (None, gate)
                and _inside(tokens_per_seq, self.tokens_per_seq) and _inside(seq_heads_per_sm, self.seq_heads_per_sm))

    def as_dict(self) -> dict:
        return {"target": self.target, "dtype": self.dtype, "head_dim": self.head_dim, "gate": self.gate,
                "tokens_per_seq": [_num(x) for x in self.tokens_per_seq],
                "seq_heads_per_sm": [_num(x) for x in self.seq_heads_per_sm],
                "chunk": self.chunk, "block_v": self.block_v, "rank": self.rank, "evidence": self.evidence}


@dataclass(frozen=True)
class Tuning:
    gpu: str
    sm_count: int
    rules: tuple[Rule, ...]
    meta: dict = field(default_factory=dict, compare=False)  # made_by, date, commit

    def rule_for(self, target: str, dtype: str, head_dim: int, tokens_per_seq: float,
                 seq_heads_per_sm: float, gate: Optional[str] = None) -> Optional[Rule]:
        for r in self.rules:
            if r.matches(target, dtype, head_dim, tokens_per_seq, seq_heads_per_sm, gate):
                return r
        return None

    def as_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "gpu": self.gpu, "sm_count": self.sm_count, **self.meta,
                "rules": [r.as_dict() for r in self.rules]}


def _inside(x: float, rng: tuple[float, float]) -> bool:
    return rng[0] <= x < rng[1]


def _num(x: float) -> Optional[float]:
    return None if math.isinf(x) else (int(x) if float(x).is_integer() else x)


def slug(gpu_name: str) -> str:
    """A file name for a GPU name: 'NVIDIA H200' -> 'NVIDIA_H200'."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", gpu_name).strip("_") or "gpu"


def default_path(gpu_name: str) -> Path:
    """The cache's tuning file for this GPU: where `kdagen tune` writes (it may not exist)."""
    from .paths import cache_dir

    return cache_dir() / "tuning" / f"{slug(gpu_name)}.json"


# GPUs that no shipped file was measured on, served by the shipped file of a GPU of the same die, SM
# count, memory and clocks (the cache's and KDAGEN_TUNING's files must still be their own GPU's).
# H800 SXM: the H100 SXM's GH100 with 132 SMs and 80 GB of HBM3; only NVLink and FP64 differ.
SAME_SILICON: dict[str, str] = {"NVIDIA H800": "NVIDIA H100 80GB HBM3"}


def shipped_path(gpu_name: str) -> Optional[Path]:
    """The tuning file shipped with kdagen for this GPU name (its own, else its SAME_SILICON
    GPU's), None where none ships."""
    for name in filter(None, (gpu_name, SAME_SILICON.get(gpu_name))):
        path = SHIPPED_DIR / f"{slug(name)}.json"
        if path.is_file():
            return path
    return None


def made_for(file_gpu: str, gpu_name: str, source: str) -> bool:
    """Whether a file made on `file_gpu` serves the device `gpu_name` when read from `source`:
    its own name, or a shipped file of its SAME_SILICON GPU."""
    return file_gpu == gpu_name or (source == FROM_SHIPPED and SAME_SILICON.get(gpu_name) == file_gpu)


def _env() -> Optional[str]:
    """KDAGEN_TUNING: "" when unset, None when off."""
    env = os.environ.get(ENV, "").strip()
    return None if env.lower() in ("off", "0", "none") else env


def disabled() -> bool:
    """KDAGEN_TUNING=off (or 0, none): no tuning file is read, the shipped ones included."""
    return _env() is None


# where a tuning file comes from (lookup's second value)
FROM_ENV, FROM_CACHE, FROM_SHIPPED = "KDAGEN_TUNING", "cache", "shipped"


def lookup(gpu_name: str) -> Optional[tuple[Path, str]]:
    """(the tuning file dispatch reads for this GPU, where it comes from: FROM_ENV, FROM_CACHE or
    FROM_SHIPPED), None when there is none or KDAGEN_TUNING=off. KDAGEN_TUNING's file is returned
    whether or not it exists (absent: no tuning); the cache's and the shipped one only if they do."""
    env = _env()
    if env is None:
        return None
    if env:
        return Path(env).expanduser(), FROM_ENV
    cache = default_path(gpu_name)
    if cache.is_file():
        return cache, FROM_CACHE
    shipped = shipped_path(gpu_name)
    return (shipped, FROM_SHIPPED) if shipped is not None else None


def path_for(gpu_name: str) -> Optional[Path]:
    """The tuning file dispatch reads for this GPU (see lookup), None where there is none."""
    found = lookup(gpu_name)
    return found[0] if found is not None else None


def write_path(gpu_name: str) -> Path:
    """Where `kdagen tune` writes this GPU's file: KDAGEN_TUNING's file, else the cache's (never
    the shipped one)."""
    env = _env()
    return Path(env).expanduser() if env else default_path(gpu_name)


# ----------------------------------------------------------------------------- reading, writing


def _range(path: Path, where: str, val: Any) -> tuple[float, float]:
    ok = isinstance(val, list) and len(val) == 2 and all(v is None or isinstance(v, (int, float)) for v in val)
    if ok:
        lo = 0.0 if val[0] is None else float(val[0])
        hi = math.inf if val[1] is None else float(val[1])
        if lo < hi:
            return lo, hi
    raise TuningError(f"{path}: {where}: expected [lo, hi] with lo < hi (hi null: no bound), found {val!r}")


def _opt_int(path: Path, where: str, val: Any, least: int = 1) -> Optional[int]:
    if val is None or (isinstance(val, int) and not isinstance(val, bool) and val >= least):
        return val
    what = "a positive integer" if least == 1 else f"an integer >= {least}"
    raise TuningError(f"{path}: {where}: expected {what} or null, found {val!r}")


def parse(data: Any, path: Path) -> Tuning:
    """A Tuning from the JSON value of file `path`; TuningError naming the file and the entry."""
    if not isinstance(data, dict):
        raise TuningError(f"{path}: expected a JSON object, found {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise TuningError(f"{path}: format: expected {FORMAT!r}, found {data.get('format')!r}")
    if data.get("version") != VERSION:
        raise TuningError(f"{path}: version: expected {VERSION} (this kdagen reads version {VERSION}; "
                          f"run `kdagen tune` again), found {data.get('version')!r}")
    gpu, sms = data.get("gpu"), data.get("sm_count")
    if not isinstance(gpu, str) or not gpu:
        raise TuningError(f"{path}: gpu: expected the GPU name, found {gpu!r}")
    if not isinstance(sms, int) or isinstance(sms, bool) or sms <= 0:
        raise TuningError(f"{path}: sm_count: expected a positive integer, found {sms!r}")
    raw = data.get("rules")
    if not isinstance(raw, list):
        raise TuningError(f"{path}: rules: expected a list, found {type(raw).__name__}")
    from .targets import TARGETS

    rules = []
    for i, r in enumerate(raw):
        where = f"rules[{i}]"
        if not isinstance(r, dict):
            raise TuningError(f"{path}: {where}: expected an object, found {type(r).__name__}")
        unknown = sorted(set(r) - {"target", "dtype", "head_dim", "gate", "tokens_per_seq", "seq_heads_per_sm",
                                   "chunk", "block_v", "rank", "evidence"})
        if unknown:
            raise TuningError(f"{path}: {where}: unknown key(s) {', '.join(unknown)}")
        target = r.get("target")
        if target not in TARGETS:
            raise TuningError(f"{path}: {where}.target: expected one of {', '.join(sorted(TARGETS))}, found {target!r}")
        info = TARGETS[target]
        chunk = _opt_int(path, f"{where}.chunk", r.get("chunk"))
        bv = _opt_int(path, f"{where}.block_v", r.get("block_v"))
        if chunk is not None and chunk not in info.chunks:
            raise TuningError(f"{path}: {where}.chunk: expected one of {info.chunks} ({target}), found {chunk}")
        if bv is not None and bv not in info.block_v:
            raise TuningError(f"{path}: {where}.block_v: expected one of {info.block_v} ({target}), found {bv}")
        dtype = r.get("dtype")
        if dtype is not None and dtype not in info.dtypes:
            raise TuningError(f"{path}: {where}.dtype: expected null or one of {info.dtypes}, found {dtype!r}")
        gate = r.get("gate")
        if gate is not None and gate not in info.gates:
            raise TuningError(f"{path}: {where}.gate: expected null or one of {info.gates}, found {gate!r}")
        rules.append(Rule(target=target, dtype=dtype, head_dim=_opt_int(path, f"{where}.head_dim", r.get("head_dim")),
                          tokens_per_seq=_range(path, f"{where}.tokens_per_seq", r.get("tokens_per_seq", [0, None])),
                          seq_heads_per_sm=_range(path, f"{where}.seq_heads_per_sm",
                                                  r.get("seq_heads_per_sm", [0, None])),
                          chunk=chunk, block_v=bv, rank=_opt_int(path, f"{where}.rank", r.get("rank"), least=0),
                          gate=gate, evidence=dict(r.get("evidence") or {})))
    meta = {k: data[k] for k in ("made_by", "date", "commit") if k in data}
    return Tuning(gpu=gpu, sm_count=sms, rules=tuple(rules), meta=meta)


def load(path: Path) -> Tuning:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise TuningError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TuningError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    return parse(data, path)


def save(tuning: Tuning, path: Path) -> Path:
    """Write `tuning` to `path` (atomically: a reader sees the old file or the new one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(tuning.as_dict(), indent=2) + "\n")
    os.replace(tmp, path)
    forget()
    return path


# ----------------------------------------------------------------------------- what dispatch reads

_LOADED: dict[Path, tuple[int, Tuning]] = {}
_LOGGED: set[Path] = set()  # the files whose use was logged (once each)


def forget() -> None:
    """Forget the files read so far (they are also re-read when their mtime changes)."""
    _LOADED.clear()


@lru_cache(maxsize=None)
def _device_name(index: int) -> Optional[str]:
    """The CUDA device's name (None where torch cannot say: no GPU here)."""
    import torch

    try:
        return torch.cuda.get_device_name(index)
    except Exception:  # noqa: BLE001  (no driver, a CPU build of torch)
        return None


def for_device(device) -> Optional[Tuning]:
    """The tuning of a CUDA device (None on other devices, or where no file exists). A file made
    for another GPU name raises TuningError; one whose SM count differs (a MIG slice, a binned
    part) is ignored, since its regimes are in programs per SM."""
    if getattr(device, "type", None) != "cuda":
        return None
    index = device.index if device.index is not None else 0
    name = _device_name(index)
    if name is None:
        return None
    found = lookup(name)
    if found is None:
        return None
    path, source = found
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return None
    hit = _LOADED.get(path)
    if hit is None or hit[0] != mtime:
        t = load(path)
        if not made_for(t.gpu, name, source):
            fix = (f"unset {ENV}" if source == FROM_ENV else "remove it" if source == FROM_CACHE
                   else f"set {ENV}=off")
            raise TuningError(f"{path}: gpu: this file was made on {t.gpu!r}, the device is {name!r} "
                              f"(run `kdagen tune` here, or {fix})")
        hit = _LOADED[path] = (mtime, t)
    from .select import _sm_count

    sms = _sm_count(device)
    if path not in _LOGGED:
        _LOGGED.add(path)
        log.debug("kdagen: tuning file for %s: %s (%s%s), %d rule(s)%s", name, path, describe_source(source),
                  "" if hit[1].gpu == name else f", measured on the same silicon: {hit[1].gpu}",
                  len(hit[1].rules), "" if hit[1].sm_count == sms else
                  f"; ignored: made for {hit[1].sm_count} SMs, the device has {sms}")
    return hit[1] if hit[1].sm_count == sms else None


def describe_source(source: str) -> str:
    """Words for where a tuning file comes from (lookup's second value)."""
    return {FROM_ENV: f"from {ENV}", FROM_CACHE: "the cache's, from `kdagen tune`",
            FROM_SHIPPED: "shipped with kdagen"}.get(source, source)


def regime(T: int, B: int, N: int, HV: int, sms: int) -> tuple[float, float]:
    """(tokens per sequence, sequences x value heads per SM) of a call."""
    n = max(N, 1)
    return T * B / n, n * HV / max(sms, 1)


def rule_for_call(target: str, c, sms: int) -> Optional[Rule]:
    """The rule of `target` for CallInfo `c` on its device (None: the defaults apply)."""
    t = for_device(c.device)
    if t is None or not t.rules:
        return None
    tps, shs = regime(c.T, c.B, c.N, c.HV, sms)
    return t.rule_for(target, c.dtype, c.K, tps, shs, c.gate)


def memo_key(c) -> tuple:
    """What of the tuning a choice for CallInfo `c` depends on: the indices of the rules that
    match it (so a cached choice is not reused across the regimes of a tuning file)."""
    t = for_device(c.device)
    if t is None or not t.rules:
        return ()
    from .select import _sm_count

    tps, shs = regime(c.T, c.B, c.N, c.HV, _sm_count(c.device))
    return tuple(i for i, r in enumerate(t.rules) if r.matches(r.target, c.dtype, c.K, tps, shs, c.gate))


# ----------------------------------------------------------------------------- kdagen tune


def bucket(x: float, edges: Sequence[float]) -> tuple[float, float]:
    for lo, hi in zip(edges, edges[1:]):
        if lo <= x < hi:
            return lo, hi
    return edges[-2], edges[-1]


def setting_key(chunk: int, block_v: int) -> str:
    """A (chunk, block_v) setting as a rule's evidence names it ("c16_bv32")."""
    return f"c{chunk}_bv{block_v}"


def parse_setting(key: str) -> Optional[tuple[int, int]]:
    """(chunk, block_v) of an evidence key written by setting_key, or None where `key` is not one."""
    c, _, bv = key.partition("_bv")
    if not c.startswith("c") or not c[1:].isdigit() or not bv.isdigit():
        return None
    return int(c[1:]), int(bv)


def derive_rules(measurements: Iterable[dict]) -> list[Rule]:
    """Rules from measured cases. Each measurement: {"case", "target", "dtype", "head_dim", "gate",
    "tokens_per_seq", "seq_heads_per_sm", "times": {(chunk, block_v): ms}}. Cases are grouped by
    (target, dtype, head dim, gate, regime bucket of TOKEN_EDGES x SEQ_HEAD_EDGES); each group's rule
    takes the (chunk, block_v) with the least geometric mean of time / the case's best time over
    the group's cases (among the settings measured on all of them). A cell no case falls in, inside a
    cell of COARSE_SEQ_HEAD_EDGES that has cases, takes the coarse cell's rule (evidence "filled_from":
    its range). The targets of one regime are then ranked (see rank_targets)."""
    fine: dict[tuple, list[dict]] = {}
    coarse: dict[tuple, list[dict]] = {}
    for m in measurements:
        if not m["times"]:
            continue
        key = (m["target"], m["dtype"], m["head_dim"], m.get("gate"), bucket(m["tokens_per_seq"], TOKEN_EDGES))
        fine.setdefault((*key, bucket(m["seq_heads_per_sm"], SEQ_HEAD_EDGES)), []).append(m)
        coarse.setdefault((*key, bucket(m["seq_heads_per_sm"], COARSE_SEQ_HEAD_EDGES)), []).append(m)
    cells: dict[tuple, tuple[list[dict], Optional[tuple]]] = {k: (ms, None) for k, ms in fine.items()}
    for (*key, (lo, hi)), ms in coarse.items():
        for sub in zip(SEQ_HEAD_EDGES, SEQ_HEAD_EDGES[1:]):
            if lo <= sub[0] and sub[1] <= hi and (*key, sub) not in fine:
                cells[(*key, sub)] = ms, (lo, hi)
    rules = []
    for (target, dtype, hd, gate, tok, sh), (ms, filled) in sorted(cells.items(), key=lambda kv: str(kv[0])):
        rule = _best_rule(ms, Rule(target=target, dtype=dtype, head_dim=hd, tokens_per_seq=tok, seq_heads_per_sm=sh,
                                   gate=gate))
        if rule is not None:
            rules.append(rule if filled is None else
                         replace(rule, evidence={**rule.evidence, "filled_from": [_num(x) for x in filled]}))
    return rank_targets(rules)


def _best_rule(ms: list[dict], cell: Rule) -> Optional[Rule]:
    """`cell` with the (chunk, block_v) of least geometric mean of time / each case's best time over
    the cases `ms` (among the settings measured on all of them), or None when they share none."""
    common = set.intersection(*(set(m["times"]) for m in ms))
    if not common:
        return None

    def score(setting) -> float:
        return math.exp(sum(math.log(m["times"][setting] / min(m["times"].values())) for m in ms) / len(ms))

    best = min(sorted(common), key=score)
    evidence = {"cases": [m["case"] for m in ms], "geomean_vs_best": round(score(best), 4),
                "ms": {m["case"]: {setting_key(c, b): round(t, 4) for (c, b), t in sorted(m["times"].items())}
                       for m in ms}}
    return replace(cell, chunk=best[0], block_v=best[1], evidence=evidence)


def rank_targets(rules: Sequence[Rule]) -> list[Rule]:
    """`rules` with `rank` set per regime (dtype, head dim, ranges): the targets ordered by the
    geometric mean, over the cases every one of them was measured on, of the target's time at its
    rule's setting over the fastest target's time at its own (ties: the targets' own order). A
    regime whose targets share no case keeps no ranks."""
    from .targets import TARGETS

    def at_setting(r: Rule, case: str) -> Optional[float]:
        return r.evidence.get("ms", {}).get(case, {}).get(setting_key(r.chunk, r.block_v))

    regimes: dict[tuple, list[int]] = {}
    for i, r in enumerate(rules):
        regimes.setdefault((r.dtype, r.head_dim, r.gate, r.tokens_per_seq, r.seq_heads_per_sm), []).append(i)
    out = list(rules)
    for idx in regimes.values():
        group = [rules[i] for i in idx]
        cases = set.intersection(*({c for c in r.evidence.get("cases", []) if at_setting(r, c) is not None}
                                   for r in group))
        if not cases:
            continue
        fastest = {c: min(at_setting(r, c) for r in group) for c in cases}

        def score(r: Rule) -> float:
            return math.exp(sum(math.log(at_setting(r, c) / fastest[c]) for c in cases) / len(cases))

        own = {r.target: TARGETS[r.target].rank if TARGETS[r.target].rank is not None else 99 for r in group}
        order = sorted(range(len(group)), key=lambda j: (round(score(group[j]), 6), own[group[j].target]))
        for rank, j in enumerate(order):
            g = group[j]
            out[idx[j]] = replace(g, rank=rank, evidence={**g.evidence, "vs_fastest_target": round(score(g), 4)})
    return out
