"""fla-shaped KDA problems (fla's chunk_kda keywords and conventions) and fla's own naive
reference (fla.ops.kda.naive), shared by the tests of kdagen.chunk_kda and of the fla backend."""

from __future__ import annotations

from typing import Optional

import torch

GATES = ("bounded", "bounded_no_A", "unbounded", "precomputed")


def fla_case(D: int = 32, V: Optional[int] = None, *, B: int = 1, T: int = 20, H: int = 1, HV: int = 2,
             lens: Optional[list[int]] = None, dtype=torch.bfloat16, gate: str = "bounded", with_state: bool = True,
             state_v_first: bool = False, beta_logits: bool = True, l2norm: bool = True,
             neg_eigval: bool = False, device="cpu", seed: int = 0) -> dict:
    """chunk_kda keyword arguments (random, never zero). Without the in-kernel L2 norm, q and k
    come normalized, as fla's tests pass them."""
    gen = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=gen) * scale

    V = V or D
    if lens is not None:
        B, T = 1, sum(lens)
    N = len(lens) if lens is not None else B
    q, k = r(B, T, H, D), r(B, T, H, D)
    if not l2norm:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    kw = dict(q=q.to(dtype), k=k.to(dtype), v=r(B, T, HV, V).to(dtype), use_qk_l2norm_in_kernel=l2norm,
              state_v_first=state_v_first)
    g = r(B, T, HV, D)
    if gate == "precomputed":
        kw.update(g=-5.0 * torch.sigmoid(g), use_gate_in_kernel=False)  # a log-decay, as fla expects
    else:
        kw.update(g=g, use_gate_in_kernel=True, dt_bias=r(HV * D, scale=0.5))  # flat [HV*K], as in fla
        if gate != "bounded_no_A":
            kw["A_log"] = r(HV, scale=0.5)
        if gate in ("bounded", "bounded_no_A"):
            kw.update(lower_bound=-5.0, safe_gate=gate == "bounded")
    b = r(B, T, HV)
    kw.update(beta=b if beta_logits else torch.sigmoid(b), use_beta_sigmoid_in_kernel=beta_logits,
              allow_neg_eigval=neg_eigval)
    if lens is not None:
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64)
    if with_state:
        h0 = r(N, HV, D, V, scale=0.5)
        kw.update(initial_state=h0.transpose(-1, -2).contiguous() if state_v_first else h0, output_final_state=True)
    return {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}


def fla_naive(kw: dict) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """fla's naive recurrence (fp32) on a chunk_kda call: the gate, L2 norm and beta sigmoid
    applied as fla's naive helpers define them, sequence by sequence; states in the call's layout."""
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda

    kw = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    q, k, v, g, beta = (kw[n].float() for n in ("q", "k", "v", "g", "beta"))
    if kw.get("use_qk_l2norm_in_kernel"):
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if kw.get("use_gate_in_kernel"):
        if kw.get("lower_bound") is not None:
            g = naive_kda_lowerbound_gate(g, kw.get("A_log"), kw.get("dt_bias"), kw["lower_bound"])
        else:
            g = naive_kda_gate(g, kw["A_log"], kw.get("dt_bias"))
    if kw.get("use_beta_sigmoid_in_kernel"):
        beta = torch.sigmoid(beta) * (2.0 if kw.get("allow_neg_eigval") else 1.0)
    h0 = kw.get("initial_state")
    vfirst = kw.get("state_v_first", False)
    if h0 is not None and vfirst:
        h0 = h0.transpose(-1, -2)
    cu = kw.get("cu_seqlens")
    spans = [(b, 0, q.shape[1]) for b in range(q.shape[0])] if cu is None else \
        [(0, int(a), int(e)) for a, e in zip(cu[:-1], cu[1:])]
    o = torch.zeros_like(v)
    finals = []
    for n, (b, a, e) in enumerate(spans):
        on, sn = naive_recurrent_kda(q[b:b + 1, a:e], k[b:b + 1, a:e], v[b:b + 1, a:e], g[b:b + 1, a:e],
                                     beta[b:b + 1, a:e], scale=kw.get("scale"),
                                     initial_state=None if h0 is None else h0[n:n + 1], output_final_state=True)
        o[b:b + 1, a:e] = on
        finals.append(sn)
    final = torch.cat(finals) if kw.get("output_final_state") else None
    if final is not None and vfirst:
        final = final.transpose(-1, -2)
    return o, final


def fla_chunk_kda_args(kw: dict) -> tuple[tuple, dict]:
    """(positional, keyword) arguments of chunk_kda for a case."""
    kw = dict(kw)
    return tuple(kw.pop(n) for n in ("q", "k", "v", "g", "beta")), kw
