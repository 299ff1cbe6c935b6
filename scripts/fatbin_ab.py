"""A/B timing of alternative builds of one sm80 variant on the same inputs (GPU).

    python scripts/fatbin_ab.py --variant kda_fwd_sm80_c16_k128_v128_bf16_gb_sfp32_bv32 \
        [--T 65536 --H 24] base=build/h800/V/V.fatbin ns4=/tmp/ab/ns4.fatbin ...

Builds are made on the CPU machine with `scripts/fatbin_ab.py --build LABEL -D...` (below), so a
kernel experiment costs one GPU call. For each build: the median ms of the full call (the
launcher's default segmentation), of kda_prep alone and of kda_recur alone, and the relative
difference of o and the final state from the first build's (a changed kernel must not change
the result beyond rounding). --recur-only N runs the recurrence N times after one prep, for ncu.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))


def _entry(variant: str):
    from kdagen.registry import Registry

    entry = Registry.load().entries.get(variant)
    if entry is None:
        raise SystemExit(f"{variant} is not in any generated spec: run `kdagen generate` first")
    return entry


def build(variant: str, out: Path, defines: list[str], includes: list[str] = ()) -> None:
    """Compile the generated source of `variant` with extra -D flags into `out` (CPU machine)."""
    from kdagen.build import nvcc_command

    entry = _entry(variant)
    cmd = nvcc_command(entry.variant, entry.source_dir / "kernel.cu", out)
    cmd[1:1] = [f"-D{d}" for d in defines] + [f"-I{d}" for d in includes]  # -I first: an experimental header copy wins
    out.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    (out.with_suffix(".log")).write_text(r.stdout + r.stderr)
    if r.returncode:
        raise SystemExit(r.stdout + r.stderr)
    regs = [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if "registers" in ln or "spill" in ln]
    print(f"built {out} ({' '.join(defines)})\n  " + "\n  ".join(regs[-4:]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", required=True)
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--H", type=int, default=24)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--recur-only", type=int, default=0, help="run kda_recur this many times (for ncu)")
    ap.add_argument("--build", metavar="OUT", help="compile the variant with -D flags into OUT and exit")
    ap.add_argument("-D", dest="defines", action="append", default=[])
    ap.add_argument("-I", dest="includes", action="append", default=[], help="searched before templates/ (--build)")
    ap.add_argument("builds", nargs="*", help="LABEL=PATH.fatbin[@VARIANT] (default: --variant)")
    a = ap.parse_args()
    if a.build:
        build(a.variant, Path(a.build), a.defines, a.includes)
        return 0

    import torch
    from bench_sm80 import make_call, make_inputs, timeit

    from kdagen.targets.sm80 import Sm80Launcher
    var0 = _entry(a.variant).variant
    T, H, D = a.T, a.H, var0.k
    dev = "cuda"
    inp = make_inputs(T, H, 1, D, dev)
    ref = None
    print(f"{a.variant} B1 T{T} H{H} D{D} on {torch.cuda.get_device_name()}", flush=True)
    for item in a.builds:
        label, _, path = item.partition("=")
        path, _, vname = path.partition("@")  # LABEL=PATH[@VARIANT]: another variant of the same shape
        var = _entry(vname).variant if vname else var0
        o = torch.full_like(inp["v"], float("nan"))
        ht = torch.full((1, H, D, D), float("nan"), device=dev)
        call = make_call(inp, o, ht)
        la = Sm80Launcher(var, Path(path))
        if a.recur_only:
            la.with_settings(min_segment_tokens=None, parts=("prep",))(call)  # timing only: the
            recur = la.with_settings(min_segment_tokens=None, parts=("recur",))  # workspace is not shared
            for _ in range(a.recur_only):
                recur(call)
            torch.cuda.synchronize()
            print(f"{label}: ran kda_recur x{a.recur_only}", flush=True)
            continue
        t = timeit(lambda: la(call), warmup=3, iters=a.iters)
        nseg = la.last_segments
        res = torch.cat([o.float().flatten(), ht.flatten()])
        diff = "" if ref is None else f"  d(o, ht) vs first {((res - ref).norm() / ref.norm()).item():.1e}"
        ok = bool(torch.isfinite(res).all())
        ref = res if ref is None else ref
        prep = la.with_settings(min_segment_tokens=None, parts=("prep",))
        t1 = timeit(lambda: prep(call), warmup=2, iters=a.iters)
        recur = la.with_settings(min_segment_tokens=None, parts=("recur",))
        t2 = timeit(lambda: recur(call), warmup=2, iters=a.iters)
        tn = ""
        if nseg:  # the same call without the launcher's limit on prep blocks beside the recurrence
            la2 = la.with_settings(prep_blocks_beside_recur=None)
            tn = f" ({timeit(lambda: la2(call), warmup=3, iters=a.iters):.3f} without the prep limit)"
        print(f"{label:10s} full {t:7.3f} ms [{nseg} seg]{tn}  prep {t1:.3f}  recur {t2:.3f} "
              f"({t2 * 1e3 / -(-T // var.chunk):.3f} us/step){diff}{'' if ok else '  NON-FINITE'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
