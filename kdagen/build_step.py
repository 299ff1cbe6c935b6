"""One ninja step for targets that are not compiled by nvcc (run as `python -m kdagen.build_step`)."""

from __future__ import annotations

import ast
import json
import os
import sys
import time
from pathlib import Path

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
    ptx = kernel.asm["ptx"]
    local = ptx.count("st.local")
    print(f"{name}: compiled for sm_90 in {secs:.1f} s, {local} local-memory stores")
    if local:
        print(f"{name}: registers spill to local memory", file=sys.stderr)
        return 1
    out.write_text(f"{name}: compiled for sm_90, no local memory\n")
    return 0


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
