"""`kdagen verify`: run each variant this machine can run on a random case against the
float64 reference and print one line per variant (the main job's last step)."""

from __future__ import annotations

import fnmatch
import os
import time

from .spec import Spec, expand


def _device():
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    # Triton runs on the CPU through its interpreter; set before any kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch.device("cpu")


def verify_spec(spec: Spec, pattern: str = "*") -> bool:
    """Check every variant of `spec` that runs here; return False if any check fails."""
    from .cases import errors, make_case, run_poisoned, tolerances
    from .runtime import registry
    from .select import device_reason

    device = _device()
    variants = [v for v in expand(spec) if fnmatch.fnmatch(v.name, pattern)]
    reg = registry()
    print(f"kdagen verify: spec {spec.name}, {len(variants)} variant(s), device {device}")
    ok = True
    counts = {"pass": 0, "FAIL": 0, "skip": 0}
    for v in variants:
        why = device_reason(v.target, device)
        if v.name not in reg.entries:
            why = "not generated (run `kdagen generate`)"
        if why:
            note = "" if v.hardware_validated else " (hardware-validated: no)"
            print(f"  skip  {v.name}: {why}{note}")
            counts["skip"] += 1
            continue
        # ragged T, two sequences, GQA, initial and final state
        case = make_case(v, device, B=2, T=37, H=1, HV=2, seed=0)
        t0 = time.perf_counter()
        try:
            out = run_poisoned(v, case)
        except Exception as e:  # report and continue: verify summarises every variant
            print(f"  FAIL  {v.name}: {type(e).__name__}: {e}")
            counts["FAIL"] += 1
            ok = False
            continue
        secs = time.perf_counter() - t0
        errs, tol = errors(v, case, out), tolerances(v, device)
        good = all(e < tol[k] for k, e in errs.items())
        counts["pass" if good else "FAIL"] += 1
        ok &= good
        shown = ", ".join(f"{k} {e:.2e}" for k, e in errs.items())
        bounds = ", ".join(f"{k} {tol[k]:.0e}" for k in errs)
        print(f"  {'pass' if good else 'FAIL'}  {v.name}: rel RMSE {shown} (tol {bounds}) {secs:.1f}s")
    print(f"kdagen verify: {counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped")
    return ok
