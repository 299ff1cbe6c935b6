"""Head dims no variant has natively: zero padding to the next size one has.

The padding is exact, not an approximation: zero q/k columns add nothing to a dot product or
to the L2 norm; zero v columns and zero state rows/columns stay zero through every update
(the decay multiplies zero, the delta-rule update of a zero v column is zero), so the padded o
columns come out 0 and are sliced off. Padded gate channels get g = 0 and dt_bias = 0: a
finite decay, like a real channel's, applied to state columns that stay zero.

Selection: registered variants first (as for any call), among them those whose head dims
cover the call's: the target's rank first (a CUDA kernel padded beats a Triton kernel at the
exact size), then the least padding, then the usual preference (readiness, state, chunk,
V-split). When none is registered, each target's smallest covering sizes are generated on
demand, by the same order.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Optional

import torch

from . import select
from .inputs import MAX_HEAD_DIM, CallInfo
from .select import Candidate
from .targets import TARGETS

__all__ = ["MAX_HEAD_DIM", "PaddedPlan", "choose_covering", "target_dims"]
log = logging.getLogger("kdagen")


def target_dims(target: str, info: CallInfo) -> Optional[tuple[int, int]]:
    """The smallest (K, V) >= the call's that `target` builds (None: it has none that large)."""
    dims = TARGETS[target].head_dims
    kp = min((d for d in dims if d >= info.K), default=None)
    vp = min((d for d in dims if d >= info.V), default=None)
    return None if kp is None or vp is None else (kp, vp)


def at_dims(info: CallInfo, k: int, v: int) -> CallInfo:
    return info if (k, v) == (info.K, info.V) else dataclasses.replace(info, K=k, V=v)


def choose_covering(cands: Iterable[Candidate], info: CallInfo) -> tuple[Optional[Candidate], CallInfo,
                                                                         list[tuple[Candidate, str]]]:
    """The preferred candidate whose head dims are >= the call's (exact ones included), the
    call as that candidate sees it (at its head dims), and every rejected candidate with its
    reason (each logged at debug level, as select.choose does)."""
    sms = select._sm_count(info.device)
    at: dict[tuple[int, int], CallInfo] = {}
    rejected: list[tuple[Candidate, str]] = []
    fits: list[tuple[tuple, Candidate, CallInfo]] = []
    for c in cands:
        var = c.variant
        covers = var.k >= info.K and var.v >= info.V
        pinfo = at.setdefault((var.k, var.v), at_dims(info, var.k, var.v)) if covers else info
        why = select.rejection(c, pinfo)
        if why:
            rejected.append((c, why))
            continue
        pref, n = select.preference(c, pinfo, sms), select.TARGET_ORDER
        fits.append(((*pref[:n], (var.k - info.K) + (var.v - info.V), *pref[n:]), c, pinfo))
    best = min(fits, key=lambda f: f[0]) if fits else None
    if log.isEnabledFor(logging.DEBUG):
        for c, why in rejected:
            log.debug("kdagen: rejected %s: %s", c.variant.name, why)
        for _, c, _ in fits:
            if c is not best[1]:
                log.debug("kdagen: passed over %s: %s is preferred (regime rank, preferred regime, target rank, padding, "
                          "tuned chunk and block_v, readiness, state, chunk, block_v)", c.variant.name, best[1].variant.name)
    if best is None:
        return None, info, rejected
    return best[1], best[2], rejected


def coverage_note(info: CallInfo) -> str:
    """One line for a miss: what the largest head dims of this device's targets are."""
    tops = [f"{name} up to {max(t.head_dims)}" for name, t in sorted(TARGETS.items())
            if info.device.type in (t.devices or ())]
    return (f"  Head dims: K={info.K} V={info.V}; a call whose head dims no variant has is zero-padded to the "
            f"next size a target builds ({', '.join(tops) or 'no target on ' + info.device.type})")


# ----------------------------------------------------------------------------- tensors

def pad_last(t: torch.Tensor, n: int) -> torch.Tensor:
    """t zero-padded to n along its last dim: a new contiguous tensor (t itself when already n)."""
    if t.shape[-1] >= n:
        return t
    out = t.new_zeros((*t.shape[:-1], n))
    out[..., :t.shape[-1]] = t
    return out


def pad_state(h: torch.Tensor, kv: bool, K: int, V: int) -> torch.Tensor:
    """A state tensor [..., V, K] ([..., K, V] when kv) zero-padded to head dims K, V (new,
    contiguous)."""
    rows, cols = (K, V) if kv else (V, K)
    if (h.shape[-2], h.shape[-1]) == (rows, cols):
        return h.contiguous()
    out = h.new_zeros((*h.shape[:-2], rows, cols))
    out[..., :h.shape[-2], :h.shape[-1]] = h
    return out


def unpad_state(h: torch.Tensor, kv: bool, K: int, V: int) -> torch.Tensor:
    return h[..., :K, :V] if kv else h[..., :V, :K]


def _meta_like(t: torch.Tensor, padded_shape: Optional[tuple] = None) -> torch.Tensor:
    """A meta tensor with t's strides, or contiguous at padded_shape (what pad_last makes)."""
    if padded_shape is None:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
    return torch.empty(padded_shape, dtype=t.dtype, device="meta")


class PaddedPlan:
    """A call whose head dims (K, V) are served by a variant with larger ones (Kp, Vp): q, k, g
    (and dt_bias) padded to Kp, v to Vp, states to both; o, the final state and the chunk
    states sliced back. `plan_cls` builds the inner plan at the padded dims."""

    def __init__(self, entry, launcher, info: CallInfo, q, k, v, g, beta, kw: dict, plan_cls) -> None:
        self.entry, self.variant, self.info = entry, entry.variant, info
        self.K, self.V, self.Kp, self.Vp = info.K, info.V, entry.variant.k, entry.variant.v
        self.kv = kw["state_layout"] == "KV"
        self.want_final = bool(kw["output_final_state"]) and info.state != "none"
        self.want_chunks = bool(kw["return_chunk_states"])
        self.pad_k, self.pad_v = self.Kp > self.K, self.Vp > self.V
        pk = (lambda t: _meta_like(t, (*t.shape[:-1], self.Kp))) if self.pad_k else _meta_like
        pv = (lambda t: _meta_like(t, (*t.shape[:-1], self.Vp))) if self.pad_v else _meta_like
        h0, dt = kw["initial_state"], kw["dt_bias"]
        HV = info.HV
        st = (self.Kp, self.Vp) if self.kv else (self.Vp, self.Kp)
        inner_kw = dict(
            kw, out=None, final_state=None, chunk_states=None,
            # the scale of the real K: 1/sqrt(Kp) would be wrong
            scale=kw["scale"] if kw["scale"] is not None else info.K ** -0.5,
            initial_state=None if h0 is None else torch.empty((info.N, HV, *st), dtype=h0.dtype, device="meta"),
            dt_bias=None if dt is None else torch.empty((HV, self.Kp), dtype=torch.float32, device="meta"),
        )
        pinfo = at_dims(info, self.Kp, self.Vp)
        self.inner = plan_cls(entry, launcher, pinfo, pk(q), pk(k), pv(v), pk(g), _meta_like(beta), inner_kw)
        self.st_shape = st
        # what the runtime's fast path expects of a plan: its entry point and its signature guard
        self.run = self.__call__
        self.guard, self.guard_builds = None, 0

    def workspace_bytes(self) -> int:
        return self.inner.workspace_bytes()

    def __call__(self, q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, out, fs, cs, ws):
        Kp, Vp = self.Kp, self.Vp
        if self.pad_k:
            q, k, g = pad_last(q, Kp), pad_last(k, Kp), pad_last(g, Kp)
        vp = pad_last(v, Vp) if self.pad_v else v
        if dt_bias is not None:
            dt_bias = pad_last(dt_bias.to(torch.float32).reshape(self.info.HV, self.K), Kp)
        if h0 is not None:
            h0 = pad_state(h0, self.kv, Kp, Vp)
        # caller's chunk_states: the inner call gets as many rows (it may not know the offsets)
        cs_p = None if cs is None else cs.new_empty((cs.shape[0], *cs.shape[1:2], *self.st_shape))
        res = self.inner(q, k, vp, g, beta, A_log, dt_bias, h0, cu, cu_cpu, None, None, cs_p, ws)
        o = res[0][..., :self.V] if self.pad_v else res[0]
        if out is not None:
            out.copy_(o)
        else:
            out = o.contiguous()
        if self.want_final:
            f = unpad_state(res[1], self.kv, self.K, self.V)
            fs = fs.copy_(f) if fs is not None else f.contiguous()
        if not self.want_chunks:
            return out, fs
        c = unpad_state(res[2], self.kv, self.K, self.V)
        if cs is not None:
            cs[:c.shape[0]].copy_(c)
        else:
            cs = c.contiguous()
        return out, fs, cs
