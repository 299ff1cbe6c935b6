"""A/B builds: one variant's generated source compiled with experimental -D flags or headers
(on the CPU machine), for timing against the shipped build on the GPU (scripts/fatbin_ab.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Sequence


def entry(variant: str):
    """The registry entry of `variant` (exit with a message when no generated spec names it)."""
    from kdagen.registry import Registry

    e = Registry.load().entries.get(variant)
    if e is None:
        raise SystemExit(f"{variant} is not in any generated spec: run `kdagen generate` first")
    return e


def wgmma_serialized(ptxas_log: str) -> list[str]:
    """ptxas's notes that it serialized the kernel's wgmma (C7511, C7512: a wait after every wgmma, from
    register shortage or from accumulators it cannot track). Such a build times its products several
    times slower than the design (session 16: the 32-token step's products 4226 -> 2622 cycles once fixed),
    so an A/B of it measures the compiler's fallback, not the kernel."""
    return [ln.strip() for ln in ptxas_log.splitlines() if "wgmma" in ln and "serialized" in ln]


def build(variant: str, out: Path, defines: Sequence[str], includes: Sequence[str] = (),
          allow_serialized: bool = False) -> None:
    """Compile the generated source of `variant` with extra -D flags into `out`; refuse a build whose
    wgmma ptxas serialized unless allow_serialized."""
    from kdagen.build import nvcc_command

    e = entry(variant)
    cmd = nvcc_command(e.variant, e.source_dir / "kernel.cu", out)
    cmd[1:1] = [f"-D{d}" for d in defines] + [f"-I{d}" for d in includes]  # -I first: an experimental header copy wins
    out.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    (out.with_suffix(".log")).write_text(r.stdout + r.stderr)
    if r.returncode:
        raise SystemExit(r.stdout + r.stderr)
    ser = wgmma_serialized(r.stdout + r.stderr)
    if ser and not allow_serialized:
        out.unlink(missing_ok=True)
        raise SystemExit(f"{out}: ptxas serialized the wgmma of this build (--allow-serialized to keep it):\n  "
                         + "\n  ".join(ser))
    regs = [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if "registers" in ln or "spill" in ln]
    print(f"built {out} ({' '.join(defines)})\n  " + "\n  ".join(regs[-4:]))


class FirstResult:
    """The (o, final state) of the first configuration an A/B times, and how far each later one's
    lies from it (rel difference; builds that change only the schedule should give 0)."""

    def __init__(self) -> None:
        self.ref = None

    def check(self, call) -> tuple[float | None, bool]:
        """(rel difference from the first result, None for the first itself; all finite)."""
        import torch

        res = torch.cat([call.o.float().flatten(), call.final_state.float().flatten()])
        ok = bool(torch.isfinite(res).all())
        if self.ref is None:
            self.ref = res
            return None, ok
        return ((res - self.ref).norm() / self.ref.norm()).item(), ok

