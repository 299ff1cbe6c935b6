"""Benchmark (not a test): kdagen's targets next to fla's chunk_kda on the same inputs.

    PYTHONPATH=$PWD python benchmarks/bench_kda.py [--cases all|issue4|issue15|issue16|issue21] [--targets sm80,triton] [--out F]
        [--variants all|NAME,...] [--parts] [--triton-configs 'k=v,..;..'] [--warm-procs N]

A --targets entry is a target (the runtime's selection among its variants) or a variant's name.

Cases are DESIGN.md section 5's rows (bf16, D=128, lower_bound=-5, fp32 state, q/k L2 norm
and gate in kernel) and issue 21's (fp16 with the unbounded gate, D=64 with a precomputed
gate). For each target the runtime's own selection (restricted to that target) picks the
variant; --variants all also times every other variant of the target that fits the call, or
the named ones. Times: CUDA events around one call, after warm-up, median of many runs,
inputs rotated among several sets so the L2 cache does not flatter small cases.
--warm-procs N makes the first calls (fla's autotuning on each case, a compile of every
Triton variant and configuration) in N processes at once before anything is timed; they share
the Triton cache, where fla keeps its tuned configurations. fla then tunes with other
processes on the GPU, which may pick a different configuration than a quiet GPU would (pass 0
for the strict, slower order).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("KDAGEN_FLA_BACKEND", "0")  # the fla column times fla's own kernels, never kdagen's

import torch

import kdagen
from kdagen.cases import bench_inputs as make_inputs
from kdagen.inputs import check_call
from kdagen.reference import rel_rmse
from kdagen.runtime import registry
from kdagen.select import select
from kdagen_dev.launch import median_ms

CASES = {
    "B1 T8192 H96": dict(T=8192, H=96),
    "B1 T8192 H64": dict(T=8192, H=64),
    "varlen6 H96": dict(lens=[1300, 547, 2048, 963, 271, 3063], H=96),
    "varlen 8x1024 H64": dict(lens=[1024] * 8, H=64),
    "B1 T16384 H48": dict(T=16384, H=48),
    "B1 T32768 H32": dict(T=32768, H=32),
    "B1 T65536 H24": dict(T=65536, H=24),
    "B1 T4096 H16": dict(T=4096, H=16),
    "B1 T2048 H8": dict(T=2048, H=8),
    "B4 T4096 H32": dict(T=4096, H=32, B=4),
    "B1 T8192 H32 fp16 unbounded": dict(T=8192, H=32, dtype="fp16", gate="unbounded"),
    "B1 T8192 H32 D64 precomputed": dict(T=8192, H=32, D=64, gate="precomputed"),
    "B1 T8192 H32 D64": dict(T=8192, H=32, D=64),
    "B1 T8192 H16 D256": dict(T=8192, H=16, D=256),
}
ISSUE4 = ["B1 T8192 H96", "B1 T65536 H24"]
ISSUE16 = ["B1 T8192 H96", "B1 T8192 H64", "varlen6 H96", "varlen 8x1024 H64", "B1 T16384 H48", "B4 T4096 H32"]
ISSUE21 = ["B1 T8192 H96", "B1 T65536 H24", "B1 T2048 H8", "B1 T8192 H32 fp16 unbounded",
           "B1 T8192 H32 D64 precomputed", "varlen6 H96"]
ISSUE15 = ["B1 T8192 H32 D64", "B1 T8192 H16 D256"]  # head dims of issue 15 (D=256: needs a 256 variant)
FLASHKDA_MS = {"B1 T8192 H96": 1.49, "B1 T8192 H64": 1.26, "varlen6 H96": 1.49, "varlen 8x1024 H64": 0.85,
               "B1 T16384 H48": 2.22, "B1 T32768 H32": 3.99, "B1 T65536 H24": 7.31, "B1 T4096 H16": 0.50,
               "B1 T2048 H8": 0.31}


def run_kdagen(variant, kw, cu):
    return kdagen.kda_prefill(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], A_log=kw["A_log"],
                              dt_bias=kw["dt_bias"], lower_bound=-5.0 if kw["gate"] == "bounded" else None,
                              gate=kw["gate"], initial_state=kw["initial_state"], output_final_state=True,
                              cu_seqlens=cu, variant=variant)


def run_fla(kw, cu):
    from fla.ops.kda import chunk_kda

    gate = kw["gate"]
    extra = dict(A_log=kw["A_log"], dt_bias=kw["dt_bias"].reshape(-1)) if gate != "precomputed" else {}
    return chunk_kda(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], initial_state=kw["initial_state"],
                     output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate != "precomputed",
                     use_beta_sigmoid_in_kernel=True, safe_gate=gate == "bounded",
                     lower_bound=-5.0 if gate == "bounded" else None, state_v_first=True,
                     cu_seqlens=cu.long() if cu is not None else None, **extra)


def call_info(kw, cu):
    return check_call(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], A_log=kw["A_log"], dt_bias=kw["dt_bias"],
                      scale=None, lower_bound=-5.0 if kw["gate"] == "bounded" else None, gate=kw["gate"],
                      initial_state=kw["initial_state"], output_final_state=True, cu_seqlens=cu, layout="BSND",
                      state_layout="VK", state_dtype=None, chunk_size=None, return_chunk_states=False)


def parse_configs(text: str) -> list:
    """'prep_warps=4,recur_stages=1;prep_warps=8' -> [{...}, {...}] (launch options of the Triton target)."""
    out = []
    for part in (text or "").split(";"):
        part = part.strip()
        if part:
            out.append({k.strip(): int(v) for k, v in (kv.split("=") for kv in part.split(","))})
    return out


def plan(case: str, targets: list, variants: str, configs: list) -> list:
    """What to time for one case: [(target, variant name, config or None, selected?)]."""
    from kdagen.select import functional_reason

    kw, cu = make_inputs(**CASES[case], seed=0)
    info = call_info(kw, cu)
    reg = registry()
    jobs = []
    for t in targets:
        if t.startswith("kda_fwd_") and t not in reg.entries:  # a variant no spec lists: generated for the run
            from kdagen import ondemand
            from kdagen.paths import cache_build_dir

            reg.add_root(ondemand.register([ondemand.parse_name(t)]), cache_build_dir())
        cands = [v for v in reg.variants() if t in (v.target, v.name)]
        try:
            chosen = select(cands, info)
        except Exception as e:
            jobs.append((t, None, str(e).splitlines()[0], False))
            continue
        target = chosen.target
        names = [chosen.name]
        if variants == "all":
            names += [v.name for v in cands if v.name != chosen.name and functional_reason(v, info) is None]
        elif variants not in ("", "selected"):
            names += [n for n in variants.split(",") if n in reg.entries and n != chosen.name
                      and reg.entries[n].variant.target == target and functional_reason(reg.entries[n].variant, info) is None]
        for n in names:
            for cfg in ([None] + configs if target == "triton" else [None]):
                jobs.append((target, n, cfg, n == chosen.name and cfg is None))
    return jobs


def _launcher(name):
    return registry().launcher(name, f"cuda:{torch.cuda.current_device()}")


def _set_config(name, cfg, parts=("prep", "recur")):
    lau = _launcher(name)
    if hasattr(lau, "config"):
        lau.config = cfg
    if hasattr(lau, "parts"):
        lau.parts = parts


def warm_task(task) -> tuple:
    """One first call, in a worker process: fla on the case's own inputs (its autotuning keys on
    the shape), or one Triton variant and configuration on a short input of the case's kind (a
    compile does not depend on the lengths). Returns (label, seconds)."""
    import time

    kind, case, name, cfg = task
    c = dict(CASES[case])
    if kind == "triton":
        c.pop("lens", None)
        c.update(T=256, H=min(c.get("H", 8), 4))
    kw, cu = make_inputs(**c, seed=0)
    t0 = time.perf_counter()
    if kind == "fla":
        run_fla(kw, cu)
    else:
        _set_config(name, cfg)
        run_kdagen(name, kw, cu)
    torch.cuda.synchronize()
    return (f"fla {case}" if kind == "fla" else f"{name.replace('kda_fwd_', '')} {cfg or ''}".strip(),
            time.perf_counter() - t0)


def warm_tasks(names, plans, with_fla) -> list:
    """fla's first calls first (the longest), then every Triton variant and configuration once."""
    tasks = [("fla", n, None, None) for n in names] if with_fla else []
    seen = set()
    for n in names:
        for t, vname, cfg, _ in plans[n]:
            key = (vname, json.dumps(cfg, sort_keys=True))
            if t == "triton" and vname is not None and key not in seen:
                seen.add(key)
                tasks.append(("triton", n, vname, cfg))
    return tasks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="all", help="all | issue4 | issue15 | issue16 | issue21 | comma-separated case names")
    ap.add_argument("--targets", default="sm80,triton")
    ap.add_argument("--variants", default="selected",
                    help="selected | all (every variant of the target that fits) | comma-separated names, timed beside the selected one")
    ap.add_argument("--parts", action="store_true", help="Triton variants: also time the prep and recurrence kernels alone")
    ap.add_argument("--triton-configs", default="", help="extra launch configurations of the Triton variants, "
                    "';'-separated 'option=value,...' (prep_warps, prep_stages, prep_maxnreg, recur_warps, recur_stages)")
    ap.add_argument("--warm-procs", type=int, default=0, help="make the first calls in this many processes at once")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    ap.add_argument("--extra-triton-head-dims", default="", help="experiment: let the Triton target build these "
                    "head dims too (e.g. 256; not validated), for variant names in --targets")
    args = ap.parse_args()
    if args.extra_triton_head_dims:
        import dataclasses

        from kdagen.targets import TARGETS

        tri = TARGETS["triton"]
        extra = tuple(int(d) for d in args.extra_triton_head_dims.split(","))
        TARGETS["triton"] = dataclasses.replace(tri, head_dims=tuple(sorted(set(tri.head_dims + extra))))
    lists = {"all": list(CASES), "issue4": ISSUE4, "issue15": ISSUE15, "issue16": ISSUE16, "issue21": ISSUE21}
    names = lists.get(args.cases) or args.cases.split(",")
    targets = [t for t in args.targets.split(",") if t]
    configs = parse_configs(args.triton_configs)
    have_fla = False
    if not args.no_fla:
        try:
            import fla.ops.kda  # noqa: F401
            have_fla = True
        except Exception as e:  # report, still time kdagen
            print(f"fla not importable ({e}); fla column empty")
    torch.backends.cuda.matmul.allow_tf32 = False
    plans = {name: plan(name, targets, args.variants, configs) for name in names}
    if args.warm_procs > 0:
        import multiprocessing as mp
        import time

        t0 = time.perf_counter()
        tasks = warm_tasks(names, plans, have_fla)
        with mp.get_context("spawn").Pool(args.warm_procs) as pool:
            firsts = pool.map(warm_task, tasks, chunksize=1)
        print(f"warm-up: {len(tasks)} first calls in {args.warm_procs} processes, {time.perf_counter() - t0:.0f} s")
        print("  first call (s): " + ", ".join(f"{label} {sec:.1f}" for label, sec in firsts))
    rows = []
    print(f"{'case':<30}{'impl':<60}{'ms':>9}{'prep':>8}{'recur':>8}{'fla/x':>7}")
    for name in names:
        sets = [make_inputs(**CASES[name], seed=s) for s in range(3)]
        kw0, cu0 = sets[0]
        row = {"case": name, "kdagen": []}
        ref_o = run_fla(kw0, cu0)[0].float() if have_fla else None
        if have_fla:
            row["fla_ms"] = median_ms(lambda s: run_fla(*s), sets, iters=args.iters)
        fla_ms = row.get("fla_ms")
        for t, vname, cfg, selected in plans[name]:
            if vname is None:
                row["kdagen"].append({"target": t, "error": cfg})
                print(f"{name:<30}{t + ': ' + cfg:<60}")
                continue
            cell = {"target": t, "variant": vname, "config": cfg, "selected": selected}
            _set_config(vname, cfg)
            cell["ms"] = median_ms(lambda s: run_kdagen(vname, *s), sets, iters=args.iters)
            o = run_kdagen(vname, kw0, cu0)[0].float()
            cell["rel_vs_fla"] = rel_rmse(o.cpu().double(), ref_o.cpu().double()) if ref_o is not None else None
            if args.parts and t == "triton":
                for part in ("prep", "recur"):
                    _set_config(vname, cfg, (part,))
                    cell[f"{part}_ms"] = median_ms(lambda s: run_kdagen(vname, *s), sets, iters=args.iters)
            _set_config(vname, None)
            row["kdagen"].append(cell)
            label = ("* " if selected else "  ") + vname.replace("kda_fwd_", "") + (f" {cfg}" if cfg else "")
            prep = f"{cell['prep_ms']:8.3f}" if "prep_ms" in cell else " " * 8
            recur = f"{cell['recur_ms']:8.3f}" if "recur_ms" in cell else " " * 8
            ratio = f"{fla_ms / cell['ms']:7.2f}" if fla_ms else ""
            print(f"{name:<30}{label:<60}{cell['ms']:9.3f}{prep}{recur}{ratio}", flush=True)
        if fla_ms:
            print(f"{name:<30}{'  fla chunk_kda':<60}{fla_ms:9.3f}")
        row["flashkda_ms_design"] = FLASHKDA_MS.get(name)
        rows.append(row)
    summary(rows, targets)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


def summary(rows, targets) -> None:
    """Per target: the selected variant's time against fla's per case, the geometric mean, and
    the fastest variant/configuration measured for each case."""
    import math

    for t in targets:
        sel, best = [], []
        print(f"\n{t}: selected variant vs fla chunk_kda (fla ms / kdagen ms)")
        for row in rows:
            cells = [c for c in row["kdagen"] if c.get("target") == t and "ms" in c]
            if not cells:
                continue
            s = next((c for c in cells if c["selected"]), None)
            b = min(cells, key=lambda c: c["ms"])
            fla = row.get("fla_ms")
            if s and fla:
                sel.append(fla / s["ms"])
                best.append(fla / b["ms"])
            print(f"  {row['case']:<30} selected {s['ms'] if s else float('nan'):8.3f} ms"
                  f"  best {b['ms']:8.3f} ms ({b['variant'].replace('kda_fwd_', '')}{' ' + str(b['config']) if b['config'] else ''})"
                  + (f"  fla {fla:8.3f} ms  x{fla / s['ms']:.2f}" if s and fla else "")
                  + (f"  rel RMSE vs fla {s['rel_vs_fla']:.1e}" if s and s.get('rel_vs_fla') is not None else ""))
        if sel:
            gm = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs))  # noqa: E731
            print(f"  geometric mean of fla/kdagen: selected x{gm(sel):.2f} (min x{min(sel):.2f}), "
                  f"best measured x{gm(best):.2f} (min x{min(best):.2f})")


if __name__ == "__main__":
    sys.exit(main())
