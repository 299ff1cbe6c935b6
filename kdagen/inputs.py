"""Validate kda_prefill's arguments and describe the call (the functional key for selection)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .dtypes import GATES, dtype_name
from .errors import KdaInputError

LAYOUTS = ("BSND", "BNSD")
MAX_HEAD_DIM = 256  # K and V; sizes no variant has are zero-padded (kdagen.padding)


@dataclass
class CallInfo:
    """What selection needs to know about a call."""

    device: torch.device
    dtype: str
    layout: str  # lower case, as in Variant.layouts
    B: int
    T: int
    N: int
    H: int
    HV: int
    K: int
    V: int
    gate: str
    state: str  # "fp32" | "bf16" | "none": dtype of the state tensors the call reads/writes
    varlen: bool
    chunk_size: Optional[int]  # required chunk (chunk states were asked for), else None
    max_len: int
    cu_seqlens_host: Optional[list[int]]

    def describe(self) -> str:
        return (f"dtype={self.dtype} K={self.K} V={self.V} layout={self.layout} gate={self.gate} "
                f"state={self.state} varlen={'yes' if self.varlen else 'no'} gqa={'yes' if self.HV != self.H else 'no'} "
                f"chunk={self.chunk_size or 'any'} device={self.device.type}")


def _err(arg: str, expected: str, found: object) -> KdaInputError:
    return KdaInputError(f"{arg}: expected {expected}, found {found}")


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def resolve_gate(gate: Optional[str], A_log, lower_bound) -> str:
    if gate is None:
        if A_log is None:
            return "precomputed"
        return "unbounded" if lower_bound is None else "bounded"
    if gate not in GATES:
        raise _err("gate", "one of " + ", ".join(GATES) + " or None", repr(gate))
    return gate


def check_call(q, k, v, g, beta, *, A_log, dt_bias, scale, lower_bound, gate, initial_state,
               output_final_state, cu_seqlens, layout, state_layout, state_dtype,
               cu_seqlens_cpu=None, chunk_size, return_chunk_states, final_state=None, chunk_states=None,
               assume_valid: bool = False) -> CallInfo:
    """Every check of a call, the offsets' values included (read from cu_seqlens_cpu, else from
    the device unless assume_valid)."""
    info = check_signature(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, lower_bound=lower_bound,
                           gate=gate, initial_state=initial_state, output_final_state=output_final_state,
                           cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, layout=layout,
                           state_layout=state_layout, state_dtype=state_dtype, chunk_size=chunk_size,
                           return_chunk_states=return_chunk_states, final_state=final_state,
                           chunk_states=chunk_states)
    if info.varlen:
        host = host_offsets(cu_seqlens, cu_seqlens_cpu, assume_valid)
        if host is not None:
            info.max_len = check_offsets(host, info.T, validate=not assume_valid)
            info.cu_seqlens_host = host
    return info


def host_offsets(cu_seqlens, cu_seqlens_cpu, assume_valid: bool) -> Optional[list[int]]:
    """cu_seqlens' values on the host: from cu_seqlens_cpu, else read from cu_seqlens (a device
    sync when it lives on a GPU), or None when the caller promised valid offsets (assume_valid)
    and gave no host copy."""
    if cu_seqlens_cpu is not None:
        return cu_seqlens_cpu.tolist()
    if assume_valid:
        return None
    return cu_seqlens.tolist()


def check_offsets(cu: list[int], T: int, validate: bool = True) -> int:
    """The longest sequence of offsets `cu`; with validate, raise unless they rise from 0 to T."""
    lens = list(map(operator.sub, cu[1:], cu))
    if validate and (cu[0] != 0 or cu[-1] != T or min(lens) < 0):
        raise _err("cu_seqlens", f"non-decreasing offsets from 0 to T={T}",
                   cu if len(cu) <= 12 else f"{cu[:6]}...{cu[-3:]}")
    return max(lens)


def chunk_stride(return_chunk_states) -> int:
    """return_chunk_states as the chunk states' stride in chunks: 0 (none), 1 (True: every
    chunk's) or m > 1 (every m-th chunk's: chunks 0, m, 2m, ... of each sequence)."""
    if return_chunk_states is True or return_chunk_states is False:
        return int(return_chunk_states)
    if isinstance(return_chunk_states, int) and return_chunk_states >= 1:
        return return_chunk_states
    raise _err("return_chunk_states", "True, False or a stride m >= 1 (the state entering every m-th chunk)",
               repr(return_chunk_states))


def kept_stride(return_chunk_states, chunk_states) -> int:
    """The stride of the chunk states a call keeps: chunk_stride, or 1 where a chunk_states
    buffer alone asks for them (0: none)."""
    return chunk_stride(return_chunk_states) or (1 if chunk_states is not None else 0)


def kept_chunk_rows(lens: Sequence[int], chunk: int, m: int) -> list[int]:
    """Which rows of every-chunk states (each sequence's ceil(L / chunk) rows, packed in order)
    return_chunk_states=m keeps: the states entering chunks 0, m, 2m, ... of each sequence."""
    rows, first = [], 0
    for L in lens:
        n = -(-L // chunk)
        rows += range(first, first + n, m)
        first += n
    return rows


def require_every_chunk(return_chunk_states, where: str) -> None:
    """Refuse a chunk-state stride m > 1 where `where` keeps every chunk's state only."""
    if chunk_stride(return_chunk_states) > 1:
        raise _err("return_chunk_states", f"True or False {where} (it keeps every chunk's state)",
                   repr(return_chunk_states))


def check_signature(q, k, v, g, beta, *, A_log, dt_bias, scale, lower_bound, gate, initial_state,
                    output_final_state, cu_seqlens, layout, state_layout, state_dtype,
                    cu_seqlens_cpu=None, chunk_size, return_chunk_states, final_state=None,
                    chunk_states=None) -> CallInfo:
    """The checks that depend only on the call's signature (types, shapes, strides, dtypes,
    devices, flags), never on tensor values: the same signature always passes or fails alike.
    max_len is T (an upper bound) and cu_seqlens_host None; check_call fills them."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise _err(name, "a torch.Tensor", type(t).__name__)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta)):
        grads = [n for n, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)) if t.requires_grad]
        raise _err(", ".join(grads), "tensors without autograd history: kda_prefill is forward-only "
                   "(no backward); call it under torch.no_grad() or pass .detach()ed tensors",
                   "requires_grad=True")
    if not isinstance(layout, str) or layout.upper() not in LAYOUTS:
        raise _err("layout", "'BSND' or 'BNSD'", repr(layout))
    layout = layout.upper()
    if state_layout not in ("VK", "KV"):
        raise _err("state_layout", "'VK' ([N, HV, V, K]) or 'KV' ([N, HV, K, V])", repr(state_layout))
    if dtype_name(q.dtype) is None:
        raise _err("q", "dtype bfloat16, float16 or float32", q.dtype)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise _err(name, f"dtype {q.dtype} (same as q)", t.dtype)
    for name, t in (("g", g), ("beta", beta)):
        if not t.is_floating_point():
            raise _err(name, "a floating-point tensor", t.dtype)
    dev = q.device
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.device != dev:
            raise _err(name, f"a tensor on {dev} (same as q)", t.device)
    if q.dim() != 4:
        raise _err("q", f"4 dims [{'B, T, H, K' if layout == 'BSND' else 'B, H, T, K'}] (layout {layout})", _shape(q))
    if layout == "BSND":
        B, T, H, K = q.shape
    else:
        B, H, T, K = q.shape
    if v.dim() != 4:
        raise _err("v", "4 dims", _shape(v))
    HV, V = (v.shape[2] if layout == "BSND" else v.shape[1]), v.shape[3]

    def want(*dims):
        return tuple(dims) if layout == "BSND" else (dims[0], dims[2], dims[1], *dims[3:])

    names = "[B, T, {h}, {d}]" if layout == "BSND" else "[B, {h}, T, {d}]"
    for name, t, exp, hname, dname in (("k", k, want(B, T, H, K), "H", "K"), ("v", v, want(B, T, HV, V), "HV", "V"),
                                        ("g", g, want(B, T, HV, K), "HV", "K")):
        if tuple(t.shape) != exp:
            raise _err(name, f"shape {names.format(h=hname, d=dname)} = {exp} (layout {layout}, from q and v)", _shape(t))
    exp_beta = (B, T, HV) if layout == "BSND" else (B, HV, T)
    if tuple(beta.shape) != exp_beta:
        raise _err("beta", f"shape {exp_beta} (layout {layout})", _shape(beta))
    if HV % H:
        raise _err("v", f"a number of value heads HV that is a multiple of the q/k heads H={H}", f"HV={HV}")
    for name, d, what in (("q", K, "K"), ("v", V, "V")):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise _err(name, f"a head dim {what} from 1 to {MAX_HEAD_DIM}", f"{what}={d}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g)):
        if t.stride(-1) != 1:
            raise _err(name, "a contiguous last (feature) dimension (call .contiguous())", f"stride {t.stride(-1)}")

    gate = resolve_gate(gate, A_log, lower_bound)
    if gate != "precomputed":
        if not isinstance(A_log, torch.Tensor):
            raise _err("A_log", f"a tensor of shape ({HV},) for the {gate} gate", type(A_log).__name__)
        if A_log.numel() != HV:
            raise _err("A_log", f"{HV} elements (one per value head)", _shape(A_log))
        if A_log.device != dev:
            raise _err("A_log", f"a tensor on {dev}", A_log.device)
        if dt_bias is not None:
            if not isinstance(dt_bias, torch.Tensor) or dt_bias.numel() != HV * K:
                raise _err("dt_bias", f"a tensor of shape ({HV}, {K}) or ({HV * K},)",
                           _shape(dt_bias) if isinstance(dt_bias, torch.Tensor) else type(dt_bias).__name__)
            if dt_bias.device != dev:
                raise _err("dt_bias", f"a tensor on {dev}", dt_bias.device)
    if gate == "precomputed":
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
            if t is not None:
                raise _err(name, "None for the precomputed gate (g is already the log-decay)", "a tensor")
    if gate == "bounded":
        if not isinstance(lower_bound, (int, float)) or not (-1e4 < float(lower_bound) <= 0):
            raise _err("lower_bound", "a finite number <= 0 for the bounded gate", repr(lower_bound))
    if scale is not None and not isinstance(scale, (int, float)):
        raise _err("scale", "a float or None", type(scale).__name__)

    varlen = cu_seqlens is not None
    if varlen:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise _err("cu_seqlens", "a 1-D int32 or int64 tensor", getattr(cu_seqlens, "dtype", type(cu_seqlens).__name__))
        if B != 1:
            raise _err("q", "batch size 1 when cu_seqlens is given (sequences packed along T)", f"B={B}")
        if cu_seqlens.numel() < 2:
            raise _err("cu_seqlens", "at least 2 entries [0, ..., T]", _shape(cu_seqlens))
        # The offsets' values are needed on the host only for validation and exact grid sizes;
        # a caller that has them there (cu_seqlens_cpu) spares a device sync, which also keeps
        # the call capturable in a CUDA graph.
        if cu_seqlens_cpu is not None:
            if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.device.type != "cpu" \
                    or tuple(cu_seqlens_cpu.shape) != tuple(cu_seqlens.shape):
                raise _err("cu_seqlens_cpu", f"a CPU tensor of shape {_shape(cu_seqlens)} holding cu_seqlens' values",
                           _shape(cu_seqlens_cpu) if isinstance(cu_seqlens_cpu, torch.Tensor) else type(cu_seqlens_cpu).__name__)
        N = cu_seqlens.shape[0] - 1
    else:
        if cu_seqlens_cpu is not None:
            raise _err("cu_seqlens_cpu", "None without cu_seqlens", "a tensor")
        N = B
    max_len = T

    if initial_state is not None:
        exp = (N, HV, V, K) if state_layout == "VK" else (N, HV, K, V)
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != exp:
            raise _err("initial_state", f"shape [N, HV, {'V, K' if state_layout == 'VK' else 'K, V'}] = {exp}",
                       _shape(initial_state) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__)
        if initial_state.dtype not in (torch.float32, torch.bfloat16):
            raise _err("initial_state", "dtype float32 or bfloat16", initial_state.dtype)
        if initial_state.device != dev:
            raise _err("initial_state", f"a tensor on {dev}", initial_state.device)
    if state_dtype is not None and state_dtype not in (torch.float32, torch.bfloat16):
        raise _err("state_dtype", "torch.float32, torch.bfloat16 or None", state_dtype)
    if state_dtype is not None and initial_state is not None and initial_state.dtype != state_dtype:
        raise _err("initial_state", f"dtype {state_dtype} (= state_dtype)", initial_state.dtype)
    st_shape = (V, K) if state_layout == "VK" else (K, V)
    for name, buf in (("final_state", final_state), ("chunk_states", chunk_states)):
        if buf is None:
            continue
        if not isinstance(buf, torch.Tensor):
            raise _err(name, "a tensor or None", type(buf).__name__)
        if buf.dtype not in (torch.float32, torch.bfloat16):
            raise _err(name, "dtype float32 or bfloat16", buf.dtype)
        if buf.device != dev:
            raise _err(name, f"a tensor on {dev}", buf.device)
        if not buf.is_contiguous():
            raise _err(name, "a contiguous tensor", f"strides {tuple(buf.stride())}")
    if final_state is not None and tuple(final_state.shape) != (N, HV, *st_shape):
        raise _err("final_state", f"shape [N, HV, {'V, K' if state_layout == 'VK' else 'K, V'}] = {(N, HV, *st_shape)}",
                   _shape(final_state))
    if chunk_states is not None and (chunk_states.dim() != 4 or tuple(chunk_states.shape[1:]) != (HV, *st_shape)):
        raise _err("chunk_states", f"shape [rows, HV, {'V, K' if state_layout == 'VK' else 'K, V'}] = "
                   f"(rows, {HV}, {st_shape[0]}, {st_shape[1]})", _shape(chunk_states))
    given = [(n, d) for n, d in (("state_dtype", state_dtype),
                                 *((n, t.dtype if t is not None else None) for n, t in
                                   (("initial_state", initial_state), ("final_state", final_state),
                                    ("chunk_states", chunk_states)))) if d is not None]
    for name, d in given[1:]:
        if d != given[0][1]:
            raise _err(name, f"dtype {given[0][1]} (as {given[0][0]}: one state dtype per call)", d)
    if given:
        state = dtype_name(given[0][1])
    elif output_final_state or return_chunk_states:
        state = "fp32"
    else:
        state = "none"
    if chunk_size is not None and chunk_size not in (16, 64):
        raise _err("chunk_size", "16, 64 or None", repr(chunk_size))
    chunk_stride(return_chunk_states)
    if (return_chunk_states or chunk_states is not None) and chunk_size is None:
        raise _err("chunk_size", "16 or 64 when return_chunk_states=True (the states' spacing)", None)
    return CallInfo(device=dev, dtype=dtype_name(q.dtype), layout=layout.lower(), B=B, T=T, N=N, H=H, HV=HV,
                    K=K, V=V, gate=gate, state=state, varlen=varlen, chunk_size=chunk_size, max_len=max_len,
                    cu_seqlens_host=None)
