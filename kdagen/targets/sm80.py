"""Launcher for the sm80 target: two kernels per variant (kda_prep, kda_recur) from one fatbin.

kda_prep (grid: chunks x sequences x value heads) writes a per-chunk workspace record;
kda_recur (grid: V/block_v x sequences x value heads) runs the chunk recurrence. Both take a
`KdaParams` struct by value (mirrored below from templates/common/kda_common.cuh). Layout
constants (workspace record size, shared memory, block sizes) are read from the module's
`kda_meta` global, so they have a single source of truth: the header.
"""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import torch

from ..abi import KdaCall
from ..variant import Variant
from .cuda_driver import load_module

_IN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "none": torch.float32}


class KdaParams(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_uint64), ("k", ctypes.c_uint64), ("v", ctypes.c_uint64), ("g", ctypes.c_uint64),
        ("beta", ctypes.c_uint64), ("o", ctypes.c_uint64), ("A_log", ctypes.c_uint64),
        ("dt_bias", ctypes.c_uint64), ("cu_seqlens", ctypes.c_uint64), ("h0", ctypes.c_uint64),
        ("ht", ctypes.c_uint64), ("hc", ctypes.c_uint64), ("chunk_offsets", ctypes.c_uint64),
        ("ws", ctypes.c_uint64),
        ("q_s", ctypes.c_int64 * 3), ("k_s", ctypes.c_int64 * 3), ("v_s", ctypes.c_int64 * 3),
        ("g_s", ctypes.c_int64 * 3), ("b_s", ctypes.c_int64 * 3), ("o_s", ctypes.c_int64 * 3),
        ("B", ctypes.c_int), ("T", ctypes.c_int), ("N", ctypes.c_int), ("H", ctypes.c_int),
        ("HV", ctypes.c_int), ("group", ctypes.c_int), ("max_len", ctypes.c_int),
        ("scale", ctypes.c_float), ("lower_bound", ctypes.c_float),
        ("use_l2norm", ctypes.c_int), ("neg_eigval", ctypes.c_int), ("state_kv", ctypes.c_int),
        ("g_fp32", ctypes.c_int), ("beta_fp32", ctypes.c_int), ("pad0", ctypes.c_int),
    ]


assert ctypes.sizeof(KdaParams) == 320


def _ptr(t) -> int:
    return 0 if t is None else int(t.data_ptr())


def _aligned_btH(t: torch.Tensor, strides: tuple[int, int, int]):
    """q/k/v/g are read 16 bytes at a time: data pointer and (batch, time, head) strides must be
    16-byte multiples. Rarely false; then copy to a compact tensor and recompute the strides."""
    eb = t.element_size()
    if t.data_ptr() % 16 == 0 and all((s * eb) % 16 == 0 for s in strides):
        return t, strides
    dims = []
    for s in strides:  # which tensor dim carries batch / time / head
        cands = [d for d in range(t.dim() - 1) if t.stride(d) == s and d not in dims]
        dims.append(cands[0] if cands else None)
    c = t.contiguous()
    if None in dims or c.data_ptr() % 16:
        raise RuntimeError("sm80: cannot realign an input tensor")
    return c, tuple(c.stride(d) for d in dims)


class Sm80Launcher:
    def __init__(self, variant: Variant, artifact: Path) -> None:
        self.variant = variant
        self.artifact = Path(artifact)
        self._meta: dict[int, tuple] = {}
        # Which kernels to launch; benchmarks set ("prep",) or ("recur",) to time one alone.
        self.parts = ("prep", "recur")

    def _module(self, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        mod = load_module(self.artifact, idx, self.variant.name)
        meta = self._meta.get(idx)
        if meta is None:
            rec, smem1, smem2, nt1, nt2, chunk, bv, _ = struct.unpack("<8i", mod.read_global("kda_meta", 32))
            if chunk != self.variant.chunk or bv != self.variant.block_v:
                raise RuntimeError(f"{self.variant.name}: artifact {self.artifact} was built for chunk={chunk} "
                                   f"block_v={bv}")
            f1 = mod.function("kda_prep", smem1)
            f2 = mod.function("kda_recur", smem2)
            meta = (mod, f1, f2, rec, smem1, smem2, nt1, nt2)
            self._meta[idx] = meta
        return idx, meta

    def __call__(self, call: KdaCall) -> None:
        v = self.variant
        who = v.name
        dev = call.q.device
        in_t = _IN_DTYPES[v.dtype]
        for nm in ("q", "k", "v", "o"):
            t = getattr(call, nm)
            if t.dtype != in_t:
                raise RuntimeError(f"{who}: {nm} has dtype {t.dtype}, expected {in_t}")
        if (call.K, call.V) != (v.k, v.v):
            raise RuntimeError(f"{who}: K, V = {call.K}, {call.V}; variant has {v.k}, {v.v}")
        st_t = _STATE_DTYPES[v.state]
        for nm in ("initial_state", "final_state", "chunk_states"):
            t = getattr(call, nm)
            if t is not None and (t.dtype != st_t or not t.is_contiguous()):
                raise RuntimeError(f"{who}: {nm} must be contiguous {st_t}, found {t.dtype}")
        if v.state == "none" and (call.initial_state is not None or call.final_state is not None):
            raise RuntimeError(f"{who}: state 'none' variants take no initial/final state")
        if call.HV % call.H:
            raise RuntimeError(f"{who}: HV={call.HV} is not a multiple of H={call.H}")

        o = call.o
        if o.stride(-1) != 1 or o.data_ptr() % 16 or any((st * o.element_size()) % 16 for st in call.o_strides):
            # kda_recur writes o in 16-byte pieces; the runtime allocates o itself, so this is a bug
            raise RuntimeError(f"{who}: o must have a unit last stride and 16-byte aligned rows "
                               f"(strides {tuple(o.stride())}, data_ptr % 16 = {o.data_ptr() % 16})")
        idx, (mod, f1, f2, rec, smem1, smem2, nt1, nt2) = self._module(dev)
        q, q_s = _aligned_btH(call.q, call.q_strides)
        k, k_s = _aligned_btH(call.k, call.k_strides)
        vv, v_s = _aligned_btH(call.v, call.v_strides)
        g, g_s = call.g, call.g_strides
        if g.dtype not in (in_t, torch.float32):
            g = g.float()
        g, g_s = _aligned_btH(g, g_s)
        beta = call.beta if call.beta.dtype in (in_t, torch.float32) else call.beta.float()

        C = v.chunk
        max_len = call.max_len if call.max_len > 0 else call.T
        nrec = (call.B * call.T) // C + call.N + 1
        ws = torch.empty(nrec * call.HV * rec, dtype=torch.uint8, device=dev)
        A_log = call.A_log.float().contiguous() if (call.A_log is not None and v.gate != "precomputed") else None
        if v.gate != "precomputed" and A_log is None:
            raise RuntimeError(f"{who}: gate {v.gate!r} needs A_log")
        dt = call.dt_bias.float().contiguous() if (call.dt_bias is not None and v.gate != "precomputed") else None
        cu = call.cu_seqlens
        if cu is not None and (cu.dtype != torch.int32 or not cu.is_contiguous()):
            cu = cu.to(torch.int32).contiguous()
        co = call.chunk_offsets
        if call.chunk_states is not None:
            if co is None:
                raise RuntimeError(f"{who}: chunk_states needs chunk_offsets")
            co = co.to(torch.int32).contiguous()

        p = KdaParams()
        p.q, p.k, p.v, p.g, p.beta, p.o = _ptr(q), _ptr(k), _ptr(vv), _ptr(g), _ptr(beta), _ptr(call.o)
        p.A_log, p.dt_bias, p.cu_seqlens = _ptr(A_log), _ptr(dt), _ptr(cu)
        p.h0, p.ht = _ptr(call.initial_state), _ptr(call.final_state)
        p.hc, p.chunk_offsets = _ptr(call.chunk_states), (_ptr(co) if call.chunk_states is not None else 0)
        p.ws = _ptr(ws)
        for nm, s in (("q_s", q_s), ("k_s", k_s), ("v_s", v_s), ("g_s", g_s),
                      ("b_s", call.beta_strides), ("o_s", call.o_strides)):
            getattr(p, nm)[:] = [int(x) for x in s]
        p.B, p.T, p.N, p.H, p.HV = call.B, call.T, call.N, call.H, call.HV
        p.group, p.max_len = call.HV // call.H, max_len
        p.scale, p.lower_bound = float(call.scale), float(call.lower_bound)
        p.use_l2norm, p.neg_eigval, p.state_kv = int(call.use_qk_l2norm), int(call.allow_neg_eigval), int(call.state_kv)
        p.g_fp32, p.beta_fp32 = int(g.dtype == torch.float32), int(beta.dtype == torch.float32)

        stream = torch.cuda.current_stream(dev).cuda_stream
        if call.N == 0:
            return
        if max_len > 0 and "prep" in self.parts:
            mod.launch(f1, ((max_len + C - 1) // C, call.N, call.HV), (nt1, 1, 1), smem1, stream, p, "kda_prep")
        if "recur" in self.parts:
            mod.launch(f2, (v.v // v.block_v, call.N, call.HV), (nt2, 1, 1), smem2, stream, p, "kda_recur")
        # ws and any realigned copies were allocated on this stream: the caching allocator only
        # hands their memory to later work on the same stream, so no record_stream is needed.
