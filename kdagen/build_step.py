"""One ninja step for targets that are not compiled by nvcc (run as `python -m kdagen.build_step`)."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

from .variant import Variant


def _variant(name: str, source: Path) -> Variant:
    manifest = json.loads((source.parent.parent / "manifest.json").read_text())
    for entry in manifest["variants"]:
        if entry["name"] == name:
            return Variant.from_dict(entry)
    raise SystemExit(f"{name}: not in {source.parent.parent / 'manifest.json'}")


def main(argv: list[str]) -> int:
    kind, name, src, out = argv[0], argv[1], Path(argv[2]), Path(argv[3])
    if kind == "jit":
        # Triton compiles at first call; here we only prove the emitted module parses.
        ast.parse(src.read_text(), filename=str(src))
        out.write_text(f"{name}: parsed\n")
        return 0
    if kind == "ascend":
        from .targets.ascend import translate

        facts = translate(_variant(name, src), src, out.parent)
        out.write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
        return 0
    raise SystemExit(f"unknown build kind {kind!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
