"""`kdagen verify`: run each variant this machine can run on a random case against the
float64 reference and print one line per variant (the main job's last step)."""

from __future__ import annotations

import fnmatch
import os
import time

from .spec import Spec, expand

TOLERANCE = {"fp32": 1e-5, "bf16": 5e-3, "fp16": 5e-3}


def _device():
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    # Triton runs on the CPU through its interpreter; set before any kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch.device("cpu")


def random_case(variant, device, *, B=2, T=37, H=1, HV=2, seed=0) -> dict:
    """Inputs that fit `variant`: ragged T, GQA, an initial state, random (never zero) data."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[variant.dtype]

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(device)

    K, V = variant.k, variant.v
    args = dict(
        q=rnd(B, T, H, K).to(dt), k=rnd(B, T, H, K).to(dt), v=rnd(B, T, HV, V).to(dt),
        g=rnd(B, T, HV, K, s=2.0), beta=rnd(B, T, HV),
    )
    kw: dict = dict(gate=variant.gate, output_final_state=variant.state != "none")
    if variant.gate == "precomputed":
        args["g"] = -torch.rand(B, T, HV, K, generator=gen).to(device) * 2.0
    else:
        kw.update(A_log=rnd(HV, s=0.5), dt_bias=rnd(HV, K), lower_bound=-5.0 if variant.gate == "bounded" else None)
    if variant.state != "none":
        st = torch.float32 if variant.state == "fp32" else torch.bfloat16
        kw["initial_state"] = rnd(B, HV, V, K, s=0.5).to(st)
    return {**args, **kw}


def verify_spec(spec: Spec, pattern: str = "*") -> bool:
    """Check every variant of `spec` that runs here; return False if any check fails."""
    from .reference import kda_reference, rel_rmse
    from .runtime import kda_prefill, registry
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
        case = random_case(v, device)
        t0 = time.perf_counter()
        try:
            o, st = kda_prefill(**case, variant=v.name)
        except Exception as e:  # report and continue: verify summarises every variant
            print(f"  FAIL  {v.name}: {type(e).__name__}: {e}")
            counts["FAIL"] += 1
            ok = False
            continue
        secs = time.perf_counter() - t0
        cpu = {key: (val.cpu() if hasattr(val, "cpu") else val) for key, val in case.items()}
        ro, rs, _ = kda_reference(**cpu)
        eo = rel_rmse(o.cpu(), ro)
        es = rel_rmse(st.cpu(), rs) if st is not None else 0.0
        tol = TOLERANCE[v.dtype] if v.state != "bf16" else 5e-3
        good = eo < tol and es < tol
        counts["pass" if good else "FAIL"] += 1
        ok &= good
        print(f"  {'pass' if good else 'FAIL'}  {v.name}: rel RMSE o {eo:.2e}, state {es:.2e} (tol {tol:.0e}) {secs:.1f}s")
    print(f"kdagen verify: {counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped")
    return ok
