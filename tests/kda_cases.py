"""Random KDA problems and the comparison against the float64 reference, shared by the
numeric tests of every target."""

from __future__ import annotations

import math
from typing import Optional

import torch

import kdagen.runtime as rt
from kdagen.reference import kda_reference, rel_rmse
from kdagen.variant import Variant

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Gate scenarios: (name, how g is drawn, dt_bias value or None)
GATE_SCENARIOS = {
    "normal": ("randn", None),
    "g=-8": ("const:-8", None),
    "g=0": ("const:0", None),
    "g=+8": ("const:8", None),
    "U(-8,8)": ("uniform:8", None),
    "N(0,8)": ("randn:8", None),
    "dt=+4": ("randn", 4.0),
    "dt=-4": ("randn", -4.0),
    "dt=+8": ("randn", 8.0),
    "dt=-8": ("randn", -8.0),
}


def make_case(v: Variant, device, *, B=1, T=37, H=1, HV=2, layout="BSND", lens: Optional[list[int]] = None,
              gate_scenario="normal", state_layout="VK", with_state=True, chunk_states=False,
              A_log_scale=0.5, seed=0) -> dict:
    """kda_prefill kwargs for variant `v` (random, never zero)."""
    gen = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=gen) * scale

    if lens is not None:
        B, T = 1, sum(lens)
    K, V = v.k, v.v
    dt = DTYPES[v.dtype]
    kind, dt_val = GATE_SCENARIOS[gate_scenario]
    if kind == "randn":
        g = r(B, T, HV, K)
    elif kind.startswith("randn:"):
        g = r(B, T, HV, K, scale=float(kind.split(":")[1]))
    elif kind.startswith("uniform:"):
        a = float(kind.split(":")[1])
        g = (torch.rand(B, T, HV, K, generator=gen) * 2 - 1) * a
    else:
        g = torch.full((B, T, HV, K), float(kind.split(":")[1])) + 0.01 * r(B, T, HV, K)
    kw: dict = {}
    if v.gate == "precomputed":
        # a log-decay: <= 0, as large as the bounded gate's range
        g = -5.0 * torch.sigmoid(g)
    else:
        kw["A_log"] = r(HV, scale=A_log_scale)
        kw["dt_bias"] = r(HV, K) if dt_val is None else torch.full((HV, K), dt_val) + 0.1 * r(HV, K)
        kw["lower_bound"] = -5.0 if v.gate == "bounded" else None
    kw["gate"] = v.gate
    q, k, vv, beta = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V), r(B, T, HV)
    tensors = dict(q=q.to(dt), k=k.to(dt), v=vv.to(dt), g=g, beta=beta)
    if layout == "BNSD":
        tensors = {n: t.transpose(1, 2).contiguous() for n, t in tensors.items()}
    kw.update(tensors)
    kw["layout"] = layout
    N = len(lens) if lens is not None else B
    if lens is not None:
        kw["cu_seqlens"] = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int32)
    if with_state and v.state != "none":
        shape = (N, HV, V, K) if state_layout == "VK" else (N, HV, K, V)
        kw["initial_state"] = r(*shape, scale=0.5).to(STATE_DTYPES[v.state])
        kw["output_final_state"] = True
    kw["state_layout"] = state_layout
    if chunk_states:
        kw["return_chunk_states"] = True
        kw["chunk_size"] = v.chunk
        if v.state != "none":
            kw["state_dtype"] = STATE_DTYPES[v.state]
    return {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def tolerance(v: Variant) -> float:
    if v.dtype == "fp32" and v.state != "bf16":
        return 1e-5
    return 5e-3


def run_and_compare(v: Variant, kw: dict, tol: Optional[float] = None, prefill=None) -> dict:
    """Run the variant with poisoned outputs, compare every output with the float64 reference.
    ``prefill`` replaces kdagen.kda_prefill (e.g. the Ascend CPU model's); it poisons its outputs."""
    tol = tol if tol is not None else tolerance(v)
    rt.POISON_OUTPUTS = True
    try:
        out = (prefill or rt.kda_prefill)(**kw, variant=v.name)
    finally:
        rt.POISON_OUTPUTS = False
    ref_kw = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    ref_kw.pop("state_dtype", None)
    cs = ref_kw.pop("chunk_size", None)
    want_cs = ref_kw.pop("return_chunk_states", False)
    ro, rs, rc = kda_reference(**ref_kw, chunk_states_size=cs if want_cs else None)
    errs = {"o": rel_rmse(out[0].cpu(), ro)}
    assert torch.isfinite(out[0]).all(), f"{v.name}: o has NaN/inf (unwritten or overflow)"
    if rs is not None:
        assert out[1] is not None and torch.isfinite(out[1]).all(), f"{v.name}: final state has NaN/inf"
        errs["state"] = rel_rmse(out[1].cpu(), rs)
    if want_cs:
        assert torch.isfinite(out[2]).all(), f"{v.name}: chunk states have NaN/inf"
        assert out[2].shape == rc.shape, (out[2].shape, rc.shape)
        errs["chunk_states"] = rel_rmse(out[2].cpu(), rc) if rc.numel() else 0.0
    for name, e in errs.items():
        assert e < tol and not math.isnan(e), f"{v.name}: rel RMSE of {name} {e:.3e} >= {tol:.0e} ({errs})"
    return errs
