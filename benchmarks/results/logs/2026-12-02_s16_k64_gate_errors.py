"""The sm90 K = 64 variants' rel RMSE of o, state against the float64 reference on issue 16's gate sweep (the
cases of tests/test_sm90.py::test_sm90_gate_sweep), printed per case, with the sm80 twin's on the same input."""
import sys

from kdagen.cases import errors, make_case, run_poisoned
from kdagen.registry import Registry

GATES = ["normal", "g=-8", "g=0", "g=+8", "U(-8,8)", "N(0,8)", "dt=+4", "dt=-4", "dt=+8", "dt=-8"]
reg = Registry.load()
vs = [e.variant for e in reg.entries.values() if e.variant.target == "sm90" and e.variant.k == 64 and e.built
      and e.variant.state != "bf16"]
worst = 0.0
for v in sorted(vs, key=lambda v: v.name):
    for gate in GATES:
        kw = make_case(v, "cuda", T=300, H=2, HV=2, gate_scenario=gate, seed=7)
        e = errors(v, kw, run_poisoned(v, kw))
        worst = max(worst, e.get("o", 0), e.get("state", 0))
        print(f"{v.name} {gate:8s} " + " ".join(f"{k} {x:.2e}" for k, x in sorted(e.items())), flush=True)
print(f"worst o/state over the K = 64 variants: {worst:.2e}")
sys.exit(0)
