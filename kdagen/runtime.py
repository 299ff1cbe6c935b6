"""kda_prefill: validate, select a variant from the registry, launch it."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from .abi import KdaCall
from .inputs import STATE_DTYPES, check_call
from .registry import Registry
from .select import select

log = logging.getLogger("kdagen")

_REGISTRY: Optional[Registry] = None
_LOGGED: set = set()
# Tests set this to fill every output with NaN before the launch, so an element a
# kernel forgets to write cannot pass as a plausible value.
POISON_OUTPUTS = False


def registry() -> Registry:
    """The process-wide registry, read from generated/ and build/ on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = Registry.load()
    return _REGISTRY


def reload_registry() -> Registry:
    global _REGISTRY
    _REGISTRY = None
    return registry()


def _strides(t: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """(batch, time, head) element strides of a [B,T,H,...] / [B,H,T,...] tensor."""
    if layout == "bsnd":
        return t.stride(0), t.stride(1), t.stride(2)
    return t.stride(0), t.stride(2), t.stride(1)


def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    lower_bound: Optional[float] = -5.0,
    gate: Optional[str] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    layout: str = "BSND",
    state_layout: str = "VK",
    state_dtype: Optional[torch.dtype] = None,
    use_qk_l2norm: bool = True,
    allow_neg_eigval: bool = False,
    chunk_size: Optional[int] = None,
    return_chunk_states: bool = False,
    variant: Optional[str] = None,
):
    """Kimi Delta Attention prefill.

    Layout "BSND": q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]
    ("BNSD" swaps T and the head axis). HV must be a multiple of H (GQA/GVA).
    Gate: bounded lower_bound*sigmoid(exp(A_log)*(g+dt_bias)) (default), unbounded
    -exp(A_log)*softplus(g+dt_bias) (lower_bound=None), or precomputed log-decay g
    (A_log=None); `gate` names one explicitly. beta is a logit (sigmoid in kernel).
    States are [N, HV, V, K] (state_layout "VK") or [N, HV, K, V] ("KV"), float32
    or bfloat16. cu_seqlens (int32/int64, B=1) packs N sequences along T;
    cu_seqlens_cpu, the same offsets already on the host, spares a device sync.

    Returns (o, final_state), or (o, final_state, chunk_states) when
    return_chunk_states: the state entering every chunk of `chunk_size` tokens,
    [NC_total, HV, *state], sequences' chunks concatenated.
    `variant` forces a variant by name (it must still fit the call).
    """
    info = check_call(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, lower_bound=lower_bound,
                      gate=gate, initial_state=initial_state, output_final_state=output_final_state,
                      cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, layout=layout,
                      state_layout=state_layout, state_dtype=state_dtype,
                      chunk_size=chunk_size, return_chunk_states=return_chunk_states)
    reg = registry()
    candidates = reg.variants()
    if variant is not None:
        if variant not in reg.entries:
            from .errors import NoVariantError

            raise NoVariantError(f"variant {variant!r} is not registered (see `kdagen list`)")
        candidates = [reg.entries[variant].variant]
    chosen = select(candidates, info)
    key = (chosen.name, info.layout, info.varlen, info.state)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("kdagen: %s for B=%d T=%d N=%d H=%d HV=%d %s", chosen.name, info.B, info.T, info.N, info.H,
                 info.HV, info.describe())

    dev = q.device
    o = torch.empty_like(v)
    state_t = STATE_DTYPES.get(chosen.state, torch.float32)
    final_state = None
    if output_final_state:
        shape = (info.N, info.HV, info.V, info.K) if state_layout == "VK" else (info.N, info.HV, info.K, info.V)
        final_state = torch.empty(shape, dtype=state_t, device=dev)
    cu32 = None
    if cu_seqlens is not None:
        # cu_seqlens may live on the host (it was read there for validation anyway).
        cu32 = cu_seqlens.to(device=dev, dtype=torch.int32).contiguous()
    chunk_states = chunk_offsets = None
    if return_chunk_states:
        C = info.chunk_size
        lens = ([b - a for a, b in zip(info.cu_seqlens_host, info.cu_seqlens_host[1:])]
                if info.cu_seqlens_host else [info.T] * info.N)
        offs = [0]
        for n in lens:
            offs.append(offs[-1] + (n + C - 1) // C)
        chunk_offsets = torch.tensor(offs, dtype=torch.int32, device=dev)
        st_shape = (info.V, info.K) if state_layout == "VK" else (info.K, info.V)
        chunk_states = torch.empty((offs[-1], info.HV, *st_shape), dtype=state_t, device=dev)
    A = A_log.to(torch.float32).contiguous().reshape(-1) if A_log is not None and info.gate != "precomputed" else None
    dt = (dt_bias.to(torch.float32).contiguous().reshape(info.HV, info.K)
          if dt_bias is not None and info.gate != "precomputed" else None)
    h0 = initial_state.contiguous() if initial_state is not None else None
    call = KdaCall(
        q=q, k=k, v=v, g=g, beta=beta, o=o,
        q_strides=_strides(q, info.layout), k_strides=_strides(k, info.layout), v_strides=_strides(v, info.layout),
        g_strides=_strides(g, info.layout), beta_strides=_strides(beta.unsqueeze(-1), info.layout),
        o_strides=_strides(o, info.layout),
        B=info.B, T=info.T, N=info.N, H=info.H, HV=info.HV, K=info.K, V=info.V,
        cu_seqlens=cu32, A_log=A, dt_bias=dt,
        scale=float(scale) if scale is not None else info.K ** -0.5,
        lower_bound=float(lower_bound) if lower_bound is not None else 0.0,
        use_qk_l2norm=bool(use_qk_l2norm), allow_neg_eigval=bool(allow_neg_eigval),
        initial_state=h0, final_state=final_state, state_kv=state_layout == "KV",
        chunk_states=chunk_states, chunk_offsets=chunk_offsets, max_len=info.max_len,
    )
    if POISON_OUTPUTS:
        for t in (o, final_state, chunk_states):
            if t is not None:
                t.fill_(float("nan"))
    if info.N > 0:
        device_key = f"{dev.type}:{dev.index}"
        reg.launcher(chosen.name, device_key)(call)
    if return_chunk_states:
        return o, final_state, chunk_states
    return o, final_state
