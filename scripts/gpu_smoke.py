"""Through the runtime (selection + registry + launcher) on a GPU: each sm80 variant of the
built specs on a ragged GQA case with state, against the float64 reference."""

from __future__ import annotations

import sys

from kdagen.cases import make_case, run_and_compare
from kdagen.runtime import registry


def main() -> int:
    bad = 0
    for v in registry().variants():
        if v.target != "sm80":
            continue
        try:
            errs = run_and_compare(v, make_case(v, "cuda", B=2, T=77, H=2, HV=4, seed=5))
            print(f"pass {v.name} {errs}")
        except AssertionError as e:
            bad += 1
            print(f"FAIL {v.name}: {e}")
    print(f"runtime smoke: {bad} failure(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
