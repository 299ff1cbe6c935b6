"""The mutation check of the test suite (kdagen_dev/mutate.py, catalogue in kdagen_dev/mutations.py).

    python scripts/mutate.py [--only NAME,...] [--sample] [--suite] [--timeout 300] [--list]

Each mutation is applied to a copy of the tree and its kill tests are run on the CPU (Triton
interpreter); --suite also runs the CPU suite on a mutation its kill tests missed. Prints killed /
survived / stale per mutation with the killing test; exit status 1 if any mutation survived, timed
out, errored or is stale.
"""

from __future__ import annotations

import argparse
import sys

from kdagen_dev.mutate import report, run_catalogue
from kdagen_dev.mutations import CATALOGUE, SAMPLE, by_name

# The CPU suite on a survivor: everything but the hardware tests and the sm80 builds (no mutation
# here touches CUDA sources).
SUITE = ("tests", "--deselect", "tests/test_sm80.py::test_sm80_ptxas_reports_have_no_spills",
         "--deselect", "tests/test_sm80.py::test_sm80_compiles_without_spills", "--ignore", "tests/test_build.py",
         "--ignore", "tests/test_mutations.py")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated mutation names")
    ap.add_argument("--sample", action="store_true", help="the fixed sample CI runs")
    ap.add_argument("--suite", action="store_true", help="run the CPU suite on mutations their kill tests miss")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per pytest run")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the kill tests")
    ap.add_argument("--list", action="store_true", help="print the catalogue and exit")
    a = ap.parse_args()
    muts = by_name(a.only.split(",")) if a.only else by_name(SAMPLE) if a.sample else CATALOGUE
    if a.list:
        for m in muts:
            print(f"{m.name:36s} {m.file:32s} {m.why}")
        print(f"{len(muts)} mutations")
        return 0
    outcomes = run_catalogue(muts, timeout=a.timeout, suite=SUITE if a.suite else (),
                             baseline=not a.no_baseline, progress=lambda s: print(s, flush=True))
    print(report(outcomes))
    return 0 if all(o.status == "killed" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
