"""Run by the installed wheel's interpreter from outside the source tree (`make wheel-check`):
the package imports from site-packages, finds its registry without a checkout, and a small
kda_prefill call on the CPU (Triton interpreter) matches the float64 reference."""

import os
import sys
from pathlib import Path

import torch

import kdagen
from kdagen.reference import kda_reference, rel_rmse

here = Path(kdagen.__file__).resolve()
assert "site-packages" in here.parts, f"kdagen imported from {here}, not from the installed wheel"
assert os.environ.get("TRITON_INTERPRET") == "1"
gen = torch.Generator().manual_seed(0)
B, T, H, HV, K = 1, 40, 1, 2, 32
r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
cu = torch.tensor([0, 17, 40], dtype=torch.int32)
kw = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, K), g=r(B, T, HV, K), beta=r(B, T, HV), A_log=r(HV) * 0.5,
          dt_bias=r(HV, K), initial_state=r(2, HV, K, K) * 0.5, cu_seqlens=cu)
o, st = kdagen.kda_prefill(**kw, output_final_state=True)
ro, rs, _ = kda_reference(**kw, output_final_state=True)
eo, es = rel_rmse(o, ro), rel_rmse(st, rs)
print(f"wheel smoke: kdagen {kdagen.__version__} from {here.parent}; rel RMSE o {eo:.2e}, state {es:.2e}")
sys.exit(0 if eo < 1e-5 and es < 1e-5 else 1)
