"""`kdagen bench` and `kdagen tune`: every candidate variant of each case beside the auto-selected
one and the peers (fla's chunk_kda, FlashKDA), in one run on one GPU.

Per case: inputs rotated among enough sets that the L2 cache cannot serve them (at least three,
more for small cases), CUDA-event times after warm-up (median and 10-90% spread), the memory
floor (compulsory bytes over the copy bandwidth measured in the same run) and the bandwidth each
implementation achieves; for short cases also the CUDA-graph replay time of the auto-selected
call beside its eager time. The first calls that compile or autotune (fla's autotuning takes
minutes per head count; every Triton variant compiles once) are made first, in worker processes
at once, so they overlap; fla and Triton keep what they produced in their on-disk caches, where
the timing process finds it. Results: bench.json, then the report and the plot from it
(kdagen/bench_report.py).
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from .errors import KdagenError
from .timing import combine as timing_combine

RESULTS_KIND = "kdagen-bench"
RESULTS_VERSION = 1
PEERS = ("fla", "flashkda")
# A candidate whose o differs from the auto-selected variant's by more than this (rel RMSE) is
# flagged in the report: bf16 variants of one call agree to about 1e-3 (each rounds its o).
MISMATCH = 2e-2
# Dispatch counts as right when the auto-selected variant is within this of the fastest measured.
DISPATCH_TOLERANCE = 0.05


class BenchError(KdagenError):
    pass


@dataclass(frozen=True)
class Case:
    """One benchmark problem: B sequences of T tokens (or varlen `lens`), H query/key heads and HV
    value heads (HV > H: GQA), head dim D, input dtype, gate form, fp32 state in and out."""

    name: str
    H: int
    T: Optional[int] = None
    B: int = 1
    lens: Optional[tuple[int, ...]] = None
    HV: Optional[int] = None
    D: int = 128
    dtype: str = "bf16"
    gate: str = "bounded"
    compare: bool = True  # time the peers (--compare) on this case
    gate_fp32: bool = False  # g and beta in fp32 (how engines pass them after fla's fused_kda_gate), else in dtype
    # beta passed as sigmoid(logits) with beta_is_logit=False (vLLM's and SGLang's call; fla's
    # use_beta_sigmoid_in_kernel=False), else as logits
    beta_prob: bool = False
    # The engines' state I/O: the states live in a state pool of 2N slots, each sequence's named out of
    # order (state_pool=, state_indices= int32 on the device, assume_valid=True: capturable), read and
    # written in place; no final state returned. The peers take no pool (they are not timed by default).
    pool: bool = False

    @property
    def hv(self) -> int:
        return self.HV if self.HV is not None else self.H

    @property
    def tokens(self) -> int:
        return sum(self.lens) if self.lens is not None else self.B * int(self.T or 0)

    @property
    def N(self) -> int:
        return len(self.lens) if self.lens is not None else self.B

    @property
    def longest(self) -> int:
        return max(self.lens) if self.lens else int(self.T or 0)

    @property
    def short(self) -> bool:
        """A prefill whose time the host can matter for: CUDA-graph times are taken too."""
        return self.longest <= 2048 and self.tokens <= 16384

    def inputs(self, seed: int = 0, dev: str = "cuda") -> tuple[dict, Any]:
        from .cases import bench_inputs

        return bench_inputs(self.T, self.H, list(self.lens) if self.lens else None, self.D, seed, dev, self.B,
                            self.dtype, self.gate, self.HV, gate_fp32=self.gate_fp32, beta_prob=self.beta_prob)

    def compulsory_bytes(self) -> int:
        """Bytes any implementation must move: q, k, v, g, beta in, o out (input dtype), the fp32
        state in and out; A_log and dt_bias are negligible."""
        el = 4 if self.dtype == "fp32" else 2
        gel = 4 if self.gate_fp32 else el
        t, H, HV, D = self.tokens, self.H, self.hv, self.D
        return t * (el * (2 * H * D + 2 * HV * D) + gel * (HV + HV * D)) + 2 * self.N * HV * D * D * 4

    def as_dict(self) -> dict:
        d = asdict(self)
        d["lens"] = list(self.lens) if self.lens is not None else None
        return {k: v for k, v in d.items() if v is not None}


_CASE_KEYS = {"name", "H", "T", "B", "lens", "HV", "D", "dtype", "gate", "compare", "gate_fp32", "beta_prob", "pool"}


def case_from_dict(d: Any, where: str) -> Case:
    """A Case from a mapping (a cases file's entry); BenchError naming `where` and the key."""
    from .dtypes import GATES

    if not isinstance(d, dict):
        raise BenchError(f"{where}: expected a mapping with name, H and T or lens, found {type(d).__name__}")
    unknown = sorted(set(d) - _CASE_KEYS)
    if unknown:
        raise BenchError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(_CASE_KEYS))})")

    def pos_int(key: str, default: Any = None, required: bool = False) -> Any:
        val = d.get(key, default)
        if val is None and not required:
            return None
        if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
            raise BenchError(f"{where}: {key}: expected a positive integer, found {val!r}")
        return val

    name = d.get("name")
    if not isinstance(name, str) or not name.strip():
        raise BenchError(f"{where}: name: expected a non-empty string, found {name!r}")
    lens = d.get("lens")
    if lens is not None:
        if not isinstance(lens, list) or not lens or any(not isinstance(x, int) or isinstance(x, bool) or x < 0
                                                         for x in lens) or sum(lens) == 0:
            raise BenchError(f"{where}: lens: expected a list of sequence lengths (integers >= 0, not all 0), "
                             f"found {lens!r}")
        if d.get("T") is not None or d.get("B", 1) != 1:
            raise BenchError(f"{where}: lens: expected without T and B (varlen packs the sequences in one row), "
                             f"found T={d.get('T')!r} B={d.get('B')!r}")
    elif d.get("T") is None:
        raise BenchError(f"{where}: T: expected T (tokens per sequence) or lens (varlen lengths), found neither")
    H = pos_int("H", required=True)
    HV = pos_int("HV")
    if HV is not None and HV % H:
        raise BenchError(f"{where}: HV: expected a multiple of H={H} (GQA), found {HV}")
    dtype, gate = d.get("dtype", "bf16"), d.get("gate", "bounded")
    if dtype not in ("bf16", "fp16", "fp32"):
        raise BenchError(f"{where}: dtype: expected bf16, fp16 or fp32, found {dtype!r}")
    if gate not in GATES:
        raise BenchError(f"{where}: gate: expected one of {', '.join(GATES)}, found {gate!r}")
    flags = {key: d.get(key, default) for key, default in (("compare", True), ("gate_fp32", False),
                                                         ("beta_prob", False), ("pool", False))}
    for key, val in flags.items():
        if not isinstance(val, bool):
            raise BenchError(f"{where}: {key}: expected true or false, found {val!r}")
    return Case(name=name.strip(), H=H, T=pos_int("T"), B=pos_int("B", 1), lens=tuple(lens) if lens else None,
                HV=HV, D=pos_int("D", 128), dtype=dtype, gate=gate, **flags)


def _c(name: str, compare: bool = False, **kw: Any) -> Case:
    if "lens" in kw:
        kw["lens"] = tuple(kw["lens"])
    return Case(name=name, compare=compare, **kw)


# Issue 16's rows (the sm90 target), issue 17's (long sequences, few heads), short prefills
# (T 64..2048, many sequences), GQA, D 64 and D 256. The peers are timed on four rows by default
# (fla autotunes for minutes per head count): --compare-all times them on every case.
CASE_SETS: dict[str, list[Case]] = {
    "issue16": [
        _c("B1 T8192 H96", T=8192, H=96, compare=True),
        _c("B1 T8192 H64", T=8192, H=64),
        _c("varlen [1300,547,2048,963,271,3063] H96", lens=[1300, 547, 2048, 963, 271, 3063], H=96),
        _c("varlen 8x1024 H64", lens=[1024] * 8, H=64),
        _c("B1 T16384 H48", T=16384, H=48),
        _c("B4 T4096 H32", T=4096, B=4, H=32),
    ],
    "issue17": [
        _c("B1 T32768 H32", T=32768, H=32),
        _c("B1 T65536 H24", T=65536, H=24, compare=True),
        _c("varlen [30000,7,1,64,999,3000] H32", lens=[30000, 7, 1, 64, 999, 3000], H=32),
        _c("B1 T8192 H4", T=8192, H=4),
        _c("B1 T32768 H8", T=32768, H=8),
        _c("B1 T65536 H8", T=65536, H=8),
        _c("B1 T131072 H4", T=131072, H=4, compare=True),
        _c("varlen 4x8192 H4", lens=[8192] * 4, H=4),
    ],
    "short": [
        _c("B1 T64 H32", T=64, H=32),
        _c("varlen 32x64 H32", lens=[64] * 32, H=32),
        _c("varlen 16x256 H32", lens=[256] * 16, H=32, compare=True),
        _c("varlen 8x512 H16", lens=[512] * 8, H=16),
        _c("B1 T2048 H8", T=2048, H=8),
    ],
    "shapes": [
        _c("GQA B1 T8192 H16 HV64", T=8192, H=16, HV=64),
        _c("B1 T8192 H32 D64", T=8192, H=32, D=64),
        _c("B1 T8192 H16 D256", T=8192, H=16, D=256),
    ],
}
# Issue 21's rows (the Triton target against fla; time it with --variants 'kda_fwd_triton_*') and
# issue 15's head dims against fla. Not in the default set: the peers are timed on every row.
_DEFINED = {c.name: c for cases in CASE_SETS.values() for c in cases}


def _peered(name: str) -> Case:
    """A case of the sets above, with the peers timed on it."""
    return replace(_DEFINED[name], compare=True)


CASE_SETS["issue21"] = [
    _peered("B1 T8192 H96"),
    _peered("B1 T65536 H24"),
    _peered("B1 T2048 H8"),
    _c("B1 T8192 H32 fp16 unbounded", T=8192, H=32, dtype="fp16", gate="unbounded", compare=True),
    _c("B1 T8192 H32 D64 precomputed", T=8192, H=32, D=64, gate="precomputed", compare=True),
    _peered("varlen [1300,547,2048,963,271,3063] H96"),
]
CASE_SETS["issue15"] = [_peered("B1 T8192 H32 D64"), _peered("B1 T8192 H16 D256")]
# The other gate forms on the default set's shapes: the unbounded gate is what vLLM's and SGLang's
# KDA layers compute, the precomputed one fla's use_gate_in_kernel=False. Many heads, the production
# shape, few heads (routed to the scan) and a varlen batch; the "fp32 gp" rows are vLLM's own call:
# g from fla's fused_kda_gate (a log-decay in fp32), beta in fp32 as sigmoid(logits) (beta_prob).
_GP32 = dict(gate="precomputed", gate_fp32=True, beta_prob=True)
CASE_SETS["gates"] = [
    _c("gu B1 T8192 H64", T=8192, H=64, gate="unbounded"),
    _c("gu B1 T65536 H24", T=65536, H=24, gate="unbounded"),
    _c("gu varlen 8x1024 H64", lens=[1024] * 8, H=64, gate="unbounded"),
    _c("gu B1 T131072 H4", T=131072, H=4, gate="unbounded"),
    _c("gp B1 T8192 H64", T=8192, H=64, gate="precomputed"),
    _c("gp B1 T65536 H24", T=65536, H=24, gate="precomputed"),
    _c("fp32 gp B1 T8192 H64", T=8192, H=64, **_GP32),
    _c("fp32 gp varlen 8x1024 H64", lens=[1024] * 8, H=64, **_GP32),
    _c("fp32 gp B1 T65536 H24", T=65536, H=24, **_GP32),
]
# Serving engines' prefill calls: Kimi Linear's 32 KDA heads of D 128 under tensor parallelism (H
# 32/16/8/4 per GPU) and chunked prefill (vLLM and SGLang cap a step at 2048-16384 tokens): one
# prompt's chunk, a mix of prompt lengths, many short prompts; in vLLM's argument forms (_GP32).
CASE_SETS["engine"] = [
    *(_c(f"eng T8192 H{H}", T=8192, H=H, **_GP32) for H in (32, 16, 8, 4)),
    _c("eng T2048 H8", T=2048, H=8, **_GP32),
    _c("eng mix6 H32", lens=[5000, 2000, 700, 300, 150, 42], H=32, **_GP32),
    _c("eng mix6 H8", lens=[5000, 2000, 700, 300, 150, 42], H=8, **_GP32),
    _c("eng 32x256 H8", lens=[256] * 32, H=8, **_GP32),
]
# Some of the engine rows with their states in a state pool, as engines keep them (Case.pool): what the
# kernels' in-place slots cost against the h0 + final-state rows above. Not in TUNE_CASES (the same
# regimes as their plain rows).
CASE_SETS["pool"] = [replace(c, name=f"pool {c.name}", compare=False, pool=True) for c in CASE_SETS["engine"]
                     if c.name in ("eng T8192 H32", "eng T2048 H8", "eng mix6 H8", "eng 32x256 H8")]
# Head counts between the engine rows at 8192 tokens (and the unbounded gate's H16-H32, which no
# other set has there): sm90's time stays flat there (one wave) while sm80's grows until they cross
# near H28-H32 on the H100. One H32 row per cell sent H17-H31 to sm90 at 1.10x sm80's time, one H4
# row sent gb H20-H32 to sm80 bv16 at 1.06x (H100, session 55).
CASE_SETS["crossover"] = [
    *(_c(f"x gb T8192 H{H}", T=8192, H=H) for H in (20, 24, 28, 32)),
    *(_c(f"x gp32 T8192 H{H}", T=8192, H=H, **_GP32) for H in (20, 24, 28)),
    *(_c(f"x gu T8192 H{H}", T=8192, H=H, gate="unbounded") for H in (16, 24, 32)),
]
# What `kdagen tune` measures by default: dispatch's rules are per gate form, and a form whose
# regimes no case covers gets no rule (benchmarks/NOTES.md, session 38).
TUNE_CASES = "default,gates,engine,crossover"
CASE_SETS["default"] = [c for name in ("issue16", "issue17", "short", "shapes") for c in CASE_SETS[name]]


def load_cases(spec: str) -> list[Case]:
    """--cases: comma-separated items, each a set name (CASE_SETS), a case name of a set, or a
    YAML/JSON file: a list of cases or {"cases": [...]}, each a mapping of name, H, and T (with B)
    or lens; optional HV, D, dtype, gate, compare, gate_fp32, beta_prob. Case names must be unique
    over the whole list."""
    items = [spec] if Path(spec).is_file() else [n.strip() for n in spec.split(",") if n.strip()]
    # a name in several sets is the default set's case (issue 21's and 15's copies time the peers)
    known = {c.name: c for cases in CASE_SETS.values() for c in cases}
    known.update((c.name, c) for c in CASE_SETS["default"])
    cases: list[Case] = []
    missing = []
    for item in items:
        p = Path(item)
        if p.suffix.lower() in (".yaml", ".yml", ".json") or p.is_file():
            cases += _cases_file(p)
        elif item in CASE_SETS:
            cases += CASE_SETS[item]
        elif item in known:
            cases.append(known[item])
        else:
            missing.append(item)
    if missing or not items:
        raise BenchError(f"--cases: expected a set ({', '.join(sorted(CASE_SETS))}), case names of the sets, "
                         f"or a .yaml/.json file, comma-separated, found {spec!r}"
                         + (f" (unknown: {', '.join(missing)})" if missing else ""))
    dup = sorted({c.name for c in cases if sum(x.name == c.name for x in cases) > 1})
    if dup:
        raise BenchError(f"--cases {spec}: case names must be unique, found {', '.join(dup)} more than once")
    return cases


def _cases_file(p: Path) -> list[Case]:
    import yaml

    try:
        text = p.read_text()
    except OSError as e:
        raise BenchError(f"--cases {p}: cannot be read ({e.strerror or e})") from None
    try:
        data = json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise BenchError(f"--cases {p}: not valid {'JSON' if p.suffix.lower() == '.json' else 'YAML'}: {e}") from None
    if isinstance(data, dict):
        data = data.get("cases")
    if not isinstance(data, list) or not data:
        raise BenchError(f"--cases {p}: expected a non-empty list of cases (or a mapping with 'cases'), "
                         f"found {type(data).__name__}")
    return [case_from_dict(d, f"--cases {p}: case {i}") for i, d in enumerate(data)]


def parse_compare(text: str) -> tuple[str, ...]:
    """--compare: comma-separated peers (fla, flashkda), or none."""
    names = tuple(n.strip().lower() for n in (text or "").split(",") if n.strip())
    if names in ((), ("none",)):
        return ()
    bad = [n for n in names if n not in PEERS]
    if bad:
        raise BenchError(f"--compare: expected a comma-separated list of {', '.join(PEERS)} (or none), "
                         f"found {', '.join(bad)}")
    return names


# ----------------------------------------------------------------------------- calls


def plan_kwargs(case: Case, kw: dict, cu) -> dict:
    """kda_prefill's keyword arguments for one input set (host offsets passed: no device read) with the
    states per sequence: the call whose plan a pool case's call runs (runtime.prepare takes no pool)."""
    return dict(A_log=kw["A_log"], dt_bias=kw["dt_bias"], gate=kw["gate"],
                lower_bound=-5.0 if kw["gate"] == "bounded" else None, initial_state=kw["initial_state"],
                output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu() if cu is not None else None,
                **({"beta_is_logit": False} if case.beta_prob else {}), **({"assume_valid": True} if case.pool else {}))


def call_kwargs(case: Case, kw: dict, cu) -> dict:
    """kda_prefill's keyword arguments for one input set: plan_kwargs, or for a pool case its state
    pool (the input set's initial states at 2N slots named out of order) and slots instead of the states."""
    ck = plan_kwargs(case, kw, cu)
    if not case.pool:
        return ck
    import torch

    h0 = ck.pop("initial_state")
    N = h0.shape[0]
    slots = torch.randperm(2 * N, generator=torch.Generator().manual_seed(N))[:N].to(torch.int32).to(h0.device)
    pool = torch.zeros((2 * N, *h0.shape[1:]), dtype=h0.dtype, device=h0.device)
    ck = dict(ck, output_final_state=False, state_pool=pool, state_indices=slots)
    reset_pool(case, (kw, cu, ck))
    return ck


def reset_pool(case: Case, s: tuple) -> None:
    """A pool case's slots set to the input set's initial states (every call rewrites them)."""
    if case.pool:
        ck = s[2]
        ck["state_pool"].index_copy_(0, ck["state_indices"].long(), s[0]["initial_state"])


def run_kdagen(case: Case, s: tuple, variant: Optional[str]):
    from .runtime import kda_prefill

    kw = s[0]
    return kda_prefill(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], variant=variant, **s[2])


_PEER_ENV = {"FLA_DISABLE_BACKEND_DISPATCH": "1", "KDAGEN_FLA_BACKEND": "0", "FLA_FLASH_KDA": "0"}


def peers_own_kernels() -> None:
    """The fla column times fla's own Triton kernels: fla's backend dispatch (to kdagen, or to
    FlashKDA where installed) is turned off. fla reads this when fla.backends is imported, so it is
    set before anything imports fla (run() calls it first; worker processes inherit it; run()
    gives the caller's values back when it returns)."""
    os.environ.update(_PEER_ENV)


def _fla_call(case: Case):
    peers_own_kernels()
    from fla.ops.kda import chunk_kda

    def run(s):
        kw, cu = s[0], s[1]
        gate = kw["gate"]
        extra = dict(A_log=kw["A_log"], dt_bias=kw["dt_bias"].reshape(-1)) if gate != "precomputed" else {}
        return chunk_kda(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], initial_state=kw["initial_state"],
                         output_final_state=True, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=gate != "precomputed", use_beta_sigmoid_in_kernel=not case.beta_prob,
                         safe_gate=gate == "bounded", lower_bound=-5.0 if gate == "bounded" else None,
                         state_v_first=True, cu_seqlens=cu.long() if cu is not None else None,
                         cu_seqlens_cpu=s[2]["cu_seqlens_cpu"].long() if cu is not None else None, **extra)
    return run


def _flashkda_call(case: Case):
    if (case.D, case.dtype, case.gate, case.hv, case.gate_fp32, case.beta_prob) != (128, "bf16", "bounded", case.H,
                                                                                     False, False):
        raise BenchError("FlashKDA takes K = V = 128, bf16 (g and beta too), beta as logits, the bounded gate and no "
                         "GQA")
    import flash_kda
    import torch

    def run(s):
        kw, cu = s[0], s[1]
        out = torch.empty_like(kw["v"])
        fs = torch.empty_like(kw["initial_state"])
        flash_kda.fwd(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], case.D ** -0.5, out, kw["A_log"],
                      kw["dt_bias"], -5.0, initial_state=kw["initial_state"], final_state=fs,
                      cu_seqlens=cu.long() if cu is not None else None)
        return out, fs
    return run


def peer_call(peer: str, case: Case) -> Callable:
    """The peer's call on one input set, or an exception saying why it cannot be made."""
    return _fla_call(case) if peer == "fla" else _flashkda_call(case)


# ----------------------------------------------------------------------------- candidates


@dataclass
class Candidate:
    name: str
    target: str
    chunk: int
    block_v: int
    state: str
    listed: bool = True  # False: no spec lists it (generated for this run, as a call would generate it)


def candidates(info, auto: str, pattern: Optional[str], top: int) -> list[Candidate]:
    """The variants that can serve the call `info` (a CallInfo) here (registered and built, or
    Triton's JIT), the auto one first; `pattern` (a glob on names, with or without the kda_fwd_
    prefix) filters them, then `top` keeps the most preferred of each target by dispatch's own
    order (0: all)."""
    from . import runtime as rt
    from .select import GENERATE
    from .select import Candidate as SelCand
    from .select import _sm_count, preference, rejection

    from . import ondemand
    from .paths import cache_build_dir
    from .targets import TARGETS

    reg = rt.registry()
    sms = _sm_count(info.device)

    def wanted(name: str) -> bool:
        return not pattern or name == auto or fnmatch.fnmatch(name, pattern) or fnmatch.fnmatch(_short(name), pattern)

    fits = []
    for v in reg.variants():
        cand = SelCand(v, *reg.status(v.name))
        if cand.readiness == "ready" and rejection(cand, info) is None and wanted(v.name):
            fits.append(cand)
    # A JIT target with no listed variant for the call (e.g. Triton at D 256): the variants it
    # would generate on demand (compiled on first call, no nvcc), registered when chosen below.
    have = {c.variant.target for c in fits if c.variant.name != auto}
    generated = set()
    for t, tinfo in TARGETS.items():
        if t in have or tinfo.build != "jit" or not tinfo.on_demand:
            continue
        for v in ondemand.variants_for(t, dtype=info.dtype, k=info.K, v=info.V, gate=info.gate, state=info.state,
                                       chunk=info.chunk_size):
            cand = SelCand(v, GENERATE, rt._generate_blocked(v))
            if v.name not in reg.entries and rejection(cand, info) is None and wanted(v.name):
                fits.append(cand)
                generated.add(v.name)
    fits.sort(key=lambda x: preference(x, info, sms))
    out, per_target = [], {}
    for cand in fits:
        v = cand.variant
        n = per_target.get(v.target, 0)
        if v.name != auto and top and n >= top:
            continue
        per_target[v.target] = n + 1
        out.append(Candidate(v.name, v.target, v.chunk, v.block_v, v.state, v.name not in generated))
    out.sort(key=lambda c: c.name != auto)
    new = [ondemand.parse_name(c.name) for c in out if c.name in generated]
    if new:
        reg.add_root(ondemand.register(new), cache_build_dir())
    if auto not in {c.name for c in out}:
        e = reg.entries[auto].variant
        out.insert(0, Candidate(auto, e.target, e.chunk, e.block_v, e.state))
    return out


# ----------------------------------------------------------------------------- warm-up workers


def _warm_task(task: tuple) -> tuple[str, float, Optional[str]]:
    """One first call in a worker process, on the case's own inputs: a peer's (fla autotunes per
    head count and kind of call) or one Triton variant's (Triton specializes its integer arguments,
    so the same shapes compile the same kernels the timing process loads). Returns (label,
    seconds, error or None)."""
    import torch

    kind, case_d, name = task
    case = Case(**{**case_d, "lens": tuple(case_d["lens"]) if case_d.get("lens") else None})
    label = " ".join(x for x in (kind if kind != "variant" else None, name and _short(name), case.name) if x)
    t0 = time.perf_counter()
    try:
        kw, cu = case.inputs(seed=0)
        s = (kw, cu, call_kwargs(case, kw, cu))
        if kind == "variant":
            run_kdagen(case, s, name)
        else:
            peer_call(kind, case)(s)
        torch.cuda.synchronize()
        return label, time.perf_counter() - t0, None
    except Exception as e:  # noqa: BLE001  (reported; the timing run says it again)
        return label, time.perf_counter() - t0, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def warm_up(tasks: list[tuple], procs: int, echo: Callable[[str], None]) -> list[tuple]:
    if not tasks or procs <= 0:
        return []
    import multiprocessing as mp

    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(min(procs, len(tasks))) as pool:
        done = pool.map(_warm_task, tasks, chunksize=1)
    echo(f"warm-up: {len(tasks)} first calls in {min(procs, len(tasks))} processes, {time.perf_counter() - t0:.0f} s; "
         "longest: " + ", ".join(f"{lab} {sec:.0f} s" for lab, sec, _ in sorted(done, key=lambda x: -x[1])[:3]))
    return done


# ----------------------------------------------------------------------------- the run


@dataclass
class Options:
    compare: tuple[str, ...] = PEERS
    compare_all: bool = False
    variants: Optional[str] = None  # glob on variant names
    top: int = 3  # most-preferred candidates per target (0: all)
    graphs: bool = True
    warm_procs: int = 8
    budget_ms: float = 200.0  # measured time per implementation and case (20..200 calls)
    # The candidates of a case are timed in this many interleaved rounds (budget split among them), the
    # result the median of the rounds' medians: timed one after another, a slow drift of the GPU (3-5% within
    # a process, H200 2026-12-02) ranks whichever variant came first or last.
    rounds: int = 1
    extra: dict = field(default_factory=dict)


def _n_sets(case: Case) -> int:
    """Input sets in rotation: together at least 3x the L2 cache (50 MB on an H200), 3 to 32."""
    import torch

    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0) or (50 << 20)
    per_set = max(1, case.compulsory_bytes())
    return int(min(32, max(3, math.ceil(3 * l2 / per_set))))


def _rel(a, b) -> Optional[float]:
    """rel RMSE of o against the auto variant's o, on the GPU in fp32 (None if either is missing)."""
    if a is None or b is None or a.shape != b.shape:
        return None
    a32, b32 = a.float(), b.float()
    den = b32.norm().item()
    return (a32 - b32).norm().item() / den if den > 0 else None


def environment() -> dict:
    """GPU, driver, versions and commit of this run."""
    import platform
    import subprocess

    import torch

    env: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
                           "torch": torch.__version__, "cuda_runtime": torch.version.cuda}
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        env["triton"] = None
    for mod, key, dist in (("fla", "fla", "fla-core"), ("flash_kda", "flashkda", "flash_kda")):
        try:
            m = __import__(mod)
        except Exception:  # noqa: BLE001
            env[key] = None
            continue
        version = getattr(m, "__version__", None)
        if version is None:  # FlashKDA has no __version__; its pip metadata names the commit (0.0.1+rev)
            try:
                version = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                version = "installed"
        env[key] = version
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=p.name, sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                   memory_gib=round(p.total_memory / 2**30, 1))
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        env["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:  # noqa: BLE001
        env["driver"] = None
    env["commit"] = _commit()
    import kdagen
    env["kdagen"] = kdagen.__version__
    return env


def _commit() -> Optional[str]:
    import subprocess

    from .paths import SOURCE_TREE

    if os.environ.get("KDAGEN_COMMIT"):
        return os.environ["KDAGEN_COMMIT"]
    if SOURCE_TREE is None:
        return None
    try:
        head = subprocess.run(["git", "-C", str(SOURCE_TREE), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=20)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(SOURCE_TREE), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=20)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except Exception:  # noqa: BLE001
        return None


class Progress:
    """What run() reports progress to: start(total steps), then advance(label) once per step."""

    def start(self, total: int) -> None:
        pass

    def advance(self, label: str) -> None:
        pass


def run(cases: Sequence[Case], opts: Options, echo: Callable[[str], None] = print,
        progress: Optional[Progress] = None, device: str = "cuda", timers: Any = None,
        partial: Optional[Callable[[dict], None]] = None) -> dict:
    """Measure `cases`; returns the results (what bench.json holds). `partial(results)` is called
    after each case with the cases so far (a run cut short still leaves them). `timers` (default
    kdagen.timing) provides time_calls, graph_calls and copy_bandwidth; tests pass fakes and run
    the rest on the CPU."""
    import torch

    saved = {n: os.environ.get(n) for n in _PEER_ENV}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        return _run(cases, opts, echo, progress, device, timers, partial)
    finally:  # the caller's process as it was (an fla imported meanwhile keeps its dispatch off)
        for n, val in saved.items():
            if val is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = val
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _run(cases, opts, echo, progress, device, timers, partial) -> dict:
    import torch

    from . import timing

    timers = timers or timing
    if "fla" in opts.compare:
        peers_own_kernels()
    if device == "cuda" and not torch.cuda.is_available():
        raise BenchError("kdagen bench: needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch.backends.cuda.matmul.allow_tf32 = False
    env = environment()
    bw = timers.copy_bandwidth()
    echo(f"{env.get('gpu')}: copy bandwidth {bw / 1e12:.2f} TB/s; {len(cases)} cases")
    # what to time, and the first calls to make in worker processes
    plans = []
    # fla's first calls (minutes of autotuning each) are queued first; then every Triton variant on
    # every case it serves (a compile per kind of call; a hit in Triton's cache costs little)
    peer_tasks, variant_tasks = [], []
    seen = set()
    for case in cases:
        plans.append(_plan_case(case, opts, device))
        p = plans[-1]
        variant_tasks += [("variant", case.as_dict(), c.name) for c in p["candidates"] if c.target.startswith("triton")]
        for peer in p["peers"]:
            # what fla's autotuning keys on: heads, head dims, varlen (not the length)
            key = (peer, case.H, case.hv, case.D, case.dtype, case.gate, case.lens is not None)
            if peer == "fla" and key not in seen:
                seen.add(key)
                peer_tasks.append((peer, case.as_dict(), None))
    warm = warm_up(peer_tasks + variant_tasks, opts.warm_procs, echo)
    progress = progress or Progress()
    progress.start(jobs_count(plans))
    rows: list[dict] = []
    results = {"kind": RESULTS_KIND, "version": RESULTS_VERSION, "env": env, "copy_bandwidth_Bps": bw,
               "options": {"compare": list(opts.compare), "compare_all": opts.compare_all, "variants": opts.variants,
                           "top": opts.top, "graphs": opts.graphs, "budget_ms": opts.budget_ms, "rounds": opts.rounds,
                           **opts.extra},
               "warm_up": [{"call": lab, "s": round(sec, 2), "error": err} for lab, sec, err in warm],
               **_tuning_file(device), "cases": rows}
    for case, plan in zip(cases, plans):
        rows.append(_measure_case(case, plan, opts, bw, timers, progress, device))
        echo(_summary_line(rows[-1]))
        if partial is not None:
            partial(results)
    return results


def _tuning_file(device: str) -> dict:
    """The tuning file dispatch reads here and where it comes from (tuning.lookup); None for both
    where there is none."""
    import torch

    from .tuning import lookup

    found = lookup(torch.cuda.get_device_name()) if device == "cuda" else None
    if found is None or not found[0].exists():
        return {"tuning_file": None, "tuning_source": None}
    return {"tuning_file": str(found[0]), "tuning_source": found[1]}


def _plan_case(case: Case, opts: Options, device: str) -> dict:
    """The auto-selected variant, the candidates and the peers of one case (or why none)."""
    from . import runtime as rt

    plan: dict[str, Any] = {"auto": None, "candidates": [], "peers": [], "error": None}
    try:
        kw, cu = case.inputs(seed=0, dev=device)
        p = rt.prepare(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], **plan_kwargs(case, kw, cu))
        plan["auto"] = p.entry.name
        plan["candidates"] = candidates(p.info, p.entry.name, opts.variants, opts.top)
        route = rt.route_of(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], **plan_kwargs(case, kw, cu))
        if route is not None:
            # the call a user makes runs as the scan: timed beside its variant in one piece (forced)
            e = p.entry.variant
            plan["auto"] = f"{p.entry.name} ({route})"
            plan["candidates"].insert(0, Candidate(plan["auto"], e.target, e.chunk, e.block_v, e.state))
        del kw, cu
    except Exception as e:  # noqa: BLE001  (the row says why; the other cases still run)
        plan["error"] = f"{type(e).__name__}: {e}"
    if case.compare or opts.compare_all:
        plan["peers"] = list(opts.compare)
    return plan


def jobs_count(plans: Sequence[dict]) -> int:
    return sum(len(p["candidates"]) + len(p["peers"]) + 1 for p in plans)


def _measure_case(case: Case, plan: dict, opts: Options, bw: float, timers: Any, progress: Progress,
                  device: str) -> dict:
    import torch

    floor_ms = case.compulsory_bytes() / bw * 1e3
    row: dict[str, Any] = {"case": case.as_dict(), "tokens": case.tokens, "N": case.N, "short": case.short,
                           "bytes": case.compulsory_bytes(), "floor_ms": floor_ms, "auto": plan["auto"],
                           "variants": [], "peers": {}, "graph": None, "notes": []}
    if plan["error"] and not plan["peers"]:
        row["error"] = plan["error"]
        progress.advance(case.name)
        _judge(row)
        return row
    n_sets = _n_sets(case) if device == "cuda" else 3
    sets = []
    for s in range(n_sets):
        kw, cu = case.inputs(seed=s, dev=device)
        sets.append((kw, cu, call_kwargs(case, kw, cu)))
    row["input_sets"] = n_sets
    ref_o = None
    if plan["error"]:
        row["error"] = plan["error"]
    cands = plan["candidates"]
    cells: list[dict[str, Any]] = [{"variant": c.name, "target": c.target, "chunk": c.chunk, "block_v": c.block_v,
                                    "auto": c.name == plan["auto"], "listed": c.listed} for c in cands]
    # the auto one through dispatch (variant=None): the call a user makes
    names = [None if c.name == plan["auto"] else c.name for c in cands]
    rounds = max(1, opts.rounds)
    timed: list[list[Any]] = [[] for _ in cands]
    for r in range(rounds):
        for i, cell in enumerate(cells):
            if "error" not in cell:
                try:
                    timed[i].append(timers.time_calls(lambda s, n=names[i]: run_kdagen(case, s, n), sets, iters=None,
                                                      budget_ms=opts.budget_ms / rounds))
                except Exception as e:  # noqa: BLE001
                    cell["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if r == rounds - 1:
                progress.advance(f"{case.name}: {cell['variant']}")
    for i, (cand, cell) in enumerate(zip(cands, cells)):
        if "error" not in cell:
            try:
                t = timing_combine(timed[i])
                cell["timing"] = t.as_dict()
                if rounds > 1:
                    cell["round_medians"] = [x.median for x in timed[i]]
                cell["TBps"] = case.compulsory_bytes() / (t.median * 1e-3) / 1e12
                reset_pool(case, sets[0])  # (the timed calls rewrote the slots: every candidate's o from the same states)
                o = run_kdagen(case, sets[0], names[i])[0]
                if cand.name == plan["auto"]:
                    ref_o = o
                else:
                    cell["rel_vs_auto"] = _rel(o, ref_o)
                del o
            except Exception as e:  # noqa: BLE001
                cell["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        row["variants"].append(cell)
    if opts.graphs and case.short and plan["auto"] is not None:
        try:
            row["graph"] = timers.graph_calls(lambda s: run_kdagen(case, s, None), sets[:4], iters=None,
                                              budget_ms=opts.budget_ms).as_dict()
        except Exception as e:  # noqa: BLE001
            row["notes"].append(f"CUDA graph: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    progress.advance(f"{case.name}: graph")
    for peer in plan["peers"]:
        try:
            fn = peer_call(peer, case)
            with torch.inference_mode():
                t = timers.time_calls(fn, sets, iters=None, budget_ms=opts.budget_ms)
                o = fn(sets[0])[0]
            row["peers"][peer] = {"timing": t.as_dict(), "TBps": case.compulsory_bytes() / (t.median * 1e-3) / 1e12,
                                  "rel_vs_auto": _rel(o, ref_o)}
            del o
        except ImportError as e:
            row["peers"][peer] = {"skipped": f"not importable ({e})"}
        except Exception as e:  # noqa: BLE001
            row["peers"][peer] = {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        progress.advance(f"{case.name}: {peer}")
    del sets
    if device == "cuda":
        torch.cuda.empty_cache()
    _judge(row)
    return row


def _judge(row: dict) -> None:
    """best: the fastest measured kdagen variant; dispatch_ok: the auto one within
    DISPATCH_TOLERANCE of it; dispatch_note: why not, where it is not."""
    timed = [c for c in row["variants"] if "timing" in c]
    auto = next((c for c in timed if c["auto"]), None)
    if not timed or auto is None:
        row["best"], row["dispatch_ok"] = None, None
        row["dispatch_note"] = brief(row.get("error")) or "the auto-selected variant did not run"
        return
    best = min(timed, key=lambda c: c["timing"]["median"])
    row["best"] = best["variant"]
    ratio = auto["timing"]["median"] / best["timing"]["median"]
    row["auto_vs_best"] = ratio
    row["dispatch_ok"] = ratio <= 1 + DISPATCH_TOLERANCE
    if row["dispatch_ok"]:
        row["dispatch_note"] = "" if best is auto else f"within {100 * (ratio - 1):.1f}% of {_short(best['variant'])}"
    elif best["target"] != auto["target"]:
        from .targets import TARGETS

        ra, rb = TARGETS[auto["target"]].rank, TARGETS[best["target"]].rank
        row["dispatch_note"] = (f"auto takes {ratio:.2f}x the time of {_short(best['variant'])}: dispatch puts target "
                                f"{best['target']} after {auto['target']} here (the tuning file's regime ranks, the "
                                f"targets' preferred regimes, then their ranks: {rb} vs {ra})")
    elif not best.get("listed", True):
        row["dispatch_note"] = (f"auto takes {ratio:.2f}x the time of {_short(best['variant'])}, which no spec lists "
                                "(dispatch serves a call with a listed variant, zero-padded if need be, before "
                                "generating one): list it in a spec")
    else:
        row["dispatch_note"] = (f"auto takes {ratio:.2f}x the time of {_short(best['variant'])} (chunk "
                                f"{best['chunk']}, block_v {best['block_v']}); `kdagen tune` makes dispatch prefer it")
    mism = [c["variant"] for c in timed if (c.get("rel_vs_auto") or 0) > MISMATCH]
    if mism:
        row["notes"].append(f"o differs from the auto variant's by more than {MISMATCH:g} rel RMSE: "
                            + ", ".join(mism))


def _short(name: str) -> str:
    return name.replace("kda_fwd_", "")


def brief(msg: Optional[str]) -> str:
    """An error message in one line: its first line, and its last where it has more (the
    runtime's misses end with what would serve the call)."""
    lines = [ln.strip() for ln in (msg or "").splitlines() if ln.strip()]
    return " ... ".join(lines[:1] + lines[-1:]) if len(lines) > 1 else (lines[0] if lines else "")


def _summary_line(row: dict) -> str:
    name = row["case"]["name"]
    if row.get("best") is None:
        return f"{name}: {row.get('dispatch_note')}"
    auto = next(c for c in row["variants"] if c["auto"])
    best = next(c for c in row["variants"] if c["variant"] == row["best"])
    peers = "  ".join(f"{p} {v['timing']['median']:.3f}" for p, v in row["peers"].items() if "timing" in v)
    graph = f"  graph {row['graph']['median']:.3f}" if row.get("graph") else ""
    return (f"{name}: auto {auto['timing']['median']:.3f} ms ({auto['variant'].replace('kda_fwd_', '')})"
            f"  best {best['timing']['median']:.3f} ({best['variant'].replace('kda_fwd_', '')})"
            f"{graph}  floor {row['floor_ms']:.3f}  {'ok' if row['dispatch_ok'] else 'NOT ok'}"
            + (f"  {peers}" if peers else ""))


# ----------------------------------------------------------------------------- tune


def case_regime(case: Case, sms: int) -> tuple[float, float]:
    """The tuning regime of `case` on a GPU of `sms` SMs (tuning.regime of its packed tokens)."""
    from . import tuning

    return tuning.regime(case.tokens, 1, case.N, case.hv, sms)


def tune_measurements(results: dict) -> list[dict]:
    """Per case and target, the measured (chunk, block_v) times, for tuning.derive_rules."""
    out = []
    for row in results["cases"]:
        c = row["case"]
        case = case_from_dict(c, c["name"])
        sms = results["env"].get("sm_count") or 1
        by_target: dict[str, dict] = {}
        for cell in row["variants"]:
            if "timing" not in cell or (cell.get("rel_vs_auto") or 0) > MISMATCH:
                continue
            key = (cell["chunk"], cell["block_v"])
            times = by_target.setdefault(cell["target"], {})
            times[key] = min(times.get(key, math.inf), cell["timing"]["median"])
        for target, times in by_target.items():
            tps, shs = case_regime(case, sms)
            out.append({"case": case.name, "target": target, "dtype": case.dtype, "head_dim": case.D, "gate": case.gate,
                        "tokens_per_seq": tps, "seq_heads_per_sm": shs, "times": times})
    return out


def tune(cases: Sequence[Case], opts: Options, out: Optional[Path], echo: Callable[[str], None] = print,
         progress: Optional[Progress] = None, **run_kw: Any) -> tuple[Path, dict]:
    """Measure every candidate of `cases` (tuning and the scan off) and write the tuning file of
    this GPU; returns its path and the results."""
    from . import runtime as rt
    from . import tuning

    # tuning off, so the defaults pick the auto ones; the scan off, so every time is one piece's
    saved = {n: os.environ.get(n) for n in (tuning.ENV, "KDAGEN_SCAN")}
    os.environ.update({tuning.ENV: "off", "KDAGEN_SCAN": "0"})
    try:
        rt.reset()
        results = run(cases, opts, echo, progress, **run_kw)
    finally:
        for n, val in saved.items():
            if val is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = val
        rt.reset()
    env = results["env"]
    rules = tuning.derive_rules(tune_measurements(results))
    t = tuning.Tuning(gpu=env.get("gpu") or "cpu", sm_count=env.get("sm_count") or 1, rules=tuple(rules),
                      meta={"made_by": "kdagen tune", "date": env["date"], "commit": env.get("commit")})
    path = out or tuning.write_path(t.gpu)
    tuning.save(t, path)
    return path, results


def write_results(results: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench.json"
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return path


def read_results(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise BenchError(f"{path}: cannot be read ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise BenchError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(data, dict) or data.get("kind") != RESULTS_KIND or data.get("version") != RESULTS_VERSION:
        raise BenchError(f"{path}: expected the bench.json of `kdagen bench` ({RESULTS_KIND} version "
                         f"{RESULTS_VERSION}), found kind={data.get('kind') if isinstance(data, dict) else None!r}")
    return data
