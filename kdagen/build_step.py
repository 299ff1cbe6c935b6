"""One ninja step for targets that are not compiled by nvcc (run as `python -m kdagen.build_step`)."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from . import address_width
from .variant import Variant


def _variant(name: str, source: Path) -> Variant:
    manifest = json.loads((source.parent.parent / "manifest.json").read_text())
    for entry in manifest["variants"]:
        if entry["name"] == name:
            return Variant.from_dict(entry)
    raise SystemExit(f"{name}: not in {source.parent.parent / 'manifest.json'}")


def check_jit(name: str, src: Path, out: Path) -> int:
    """Triton compiles at first call; here the module must parse and, where it offers
    compile_for() and Triton is installed, compile for sm_90 with no local memory."""
    ast.parse(src.read_text(), filename=str(src))
    os.environ.pop("TRITON_INTERPRET", None)  # must be unset before triton is imported
    try:
        import triton  # noqa: F401
    except ImportError:
        out.write_text(f"{name}: parsed (triton not installed: not compiled)\n")
        return 0
    from .targets.loader import load_generated_module

    mod = load_generated_module(name, src)
    if not hasattr(mod, "compile_for"):
        out.write_text(f"{name}: parsed\n")
        return 0
    t0 = time.perf_counter()
    kernel = mod.compile_for(90)
    secs = time.perf_counter() - t0
    # ptxas spills show only in the cubin's stack frame, not as st.local in Triton's PTX
    frames = stack_frames(kernel)
    allowed = set(getattr(mod, "SPILL_OK", ()))
    local = kernel.asm["ptx"].count("st.local")
    shown = ", ".join(f"{k} stack {v if v is not None else '?'}" for k, v in sorted(frames.items()))
    # an int32 offset into a data tensor wraps past 2^31 elements (kdagen/address_width.py)
    checked, narrow = address_width.check(getattr(kernel, "kernels", {}), getattr(mod, "BOUNDED_PTRS", ()))
    print(f"{name}: compiled for sm_90 in {secs:.1f} s, {local} local-memory stores in the PTX; {shown}; "
          f"{checked} data offsets, {len(narrow)} narrower than 64 bits")
    bad = sorted(k for k, v in frames.items() if v and k not in allowed)
    if local or bad:
        print(f"{name}: registers spill to local memory ({', '.join(bad) or 'PTX st.local'})", file=sys.stderr)
        return 1
    if narrow:
        print(f"{name}: 32-bit offsets into data tensors (they wrap past 2^31 elements):\n  " + "\n  ".join(narrow),
              file=sys.stderr)
        return 1
    out.write_text(f"{name}: compiled for sm_90, no local memory ({shown})\n"
                   f"{name}: {checked} offsets into data tensors, all 64-bit\n")
    return 0


def stack_frames(kernel) -> dict[str, Optional[int]]:
    """Stack bytes per kernel of a compile_for() result, from cuobjdump -res-usage on its cubin
    (Triton ships cuobjdump; None where no cuobjdump or cubin is found)."""
    import triton

    exe = shutil.which("cuobjdump") or str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    frames: dict[str, Optional[int]] = {}
    for kname, k in getattr(kernel, "kernels", {}).items():
        cubin = k.asm.get("cubin")
        frames[kname] = None
        if not cubin or not Path(exe).exists():
            continue
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            res = subprocess.run([exe, "-res-usage", f.name], capture_output=True, text=True).stdout
        m = re.search(r"STACK:(\d+)", res)
        frames[kname] = int(m.group(1)) if m else None
    return frames


def main(argv: list[str]) -> int:
    kind, name, src, out = argv[0], argv[1], Path(argv[2]), Path(argv[3])
    if kind == "jit":
        return check_jit(name, src, out)
    if kind == "ascend":
        from .targets.ascend import translate

        facts = translate(_variant(name, src), src, out.parent)
        out.write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
        return 0
    raise SystemExit(f"unknown build kind {kind!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
