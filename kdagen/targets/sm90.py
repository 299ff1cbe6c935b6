"""Launcher for the sm90 target: one fused kernel per variant (kda_fused, templates/sm90/; and
kda_fused_slots, the same for calls whose states are a state pool's slots).

Grid: value heads x sequences (varlen: longest first, ranked in the kernel) x V / block_v; each CTA
streams its head's inputs in with bulk copies, builds the chunk records in shared memory and runs the
recurrence (no workspace). The
kernel takes the same `KdaParams` struct as sm80 (mirrored in kdagen.targets.sm80); its shape
constants are read from the module's `kda_meta` global (single source of truth: the header).
"""

from __future__ import annotations

import ctypes
import logging
import struct
from pathlib import Path

import torch

from ..abi import KdaCall
from ..dtypes import torch_dtype
from ..variant import Variant
from .cuda_driver import load_module
from .cuda_launch import KdaParams, check_call, check_shared_memory
from .cuda_launch import aligned_btH, aligned_inputs
from .cuda_launch import ptr as _ptr
from . import launch_shim, sm80  # (the bound launch's shared pieces are sm80's, looked up there at call time)

log = logging.getLogger("kdagen")



def build_params(call: KdaCall, v: Variant,
                 who: str) -> tuple[KdaParams, list[torch.Tensor], torch.Tensor | None]:
    """Check `call` against variant `v` and fill the kernel's parameter struct. Returns the struct,
    the tensors it points into that the caller must keep alive until the launch is queued
    (realigned or converted copies), and the aligned stand-in for o the kernel writes (None when
    it writes call.o itself)."""
    check_call(call, v, slots_ok=v.state != "none")
    if call.N > 65535:  # (sequences run along the grid's y)
        raise RuntimeError(f"{who}: at most 65535 sequences per call, found {call.N}")
    in_t = torch_dtype(v.dtype)
    o = call.o
    if o.stride(-1) != 1 or o.element_size() != 2:
        raise RuntimeError(f"{who}: o must be a 16-bit tensor with a unit last stride (strides {tuple(o.stride())})")

    # Rows are bulk-copied: 16-byte aligned sources (q, k, v rows are K*2 / V*2 bytes, g rows
    # K*2 or K*4). beta is read element-wise. o is written 16 bytes at a time: an o whose rows are
    # not 16-byte aligned is written through an aligned copy (copied back by the launcher).
    q, q_s, k, k_s, vv, v_s, g, g_s, beta = aligned_inputs(call, in_t)
    o, o_s = aligned_btH(o, call.o_strides)
    A_log = call.A_log.float().contiguous() if (call.A_log is not None and v.gate != "precomputed") else None
    dt = call.dt_bias.float().contiguous() if (call.dt_bias is not None and v.gate != "precomputed") else None
    cu = call.cu_seqlens
    if cu is not None and (cu.dtype != torch.int32 or not cu.is_contiguous()):
        cu = cu.to(torch.int32).contiguous()
    co = call.chunk_offsets.to(torch.int32).contiguous() if call.chunk_states is not None else None

    p = KdaParams()
    p.q, p.k, p.v, p.g, p.beta, p.o = _ptr(q), _ptr(k), _ptr(vv), _ptr(g), _ptr(beta), _ptr(o)
    p.A_log, p.dt_bias, p.cu_seqlens = _ptr(A_log), _ptr(dt), _ptr(cu)
    p.h0, p.ht = _ptr(call.initial_state), _ptr(call.final_state)
    p.h0_idx, p.ht_idx = _ptr(call.h0_index), _ptr(call.ht_index)
    p.hc, p.chunk_offsets = _ptr(call.chunk_states), _ptr(co)
    p.ws = 0
    for nm, s in (("q_s", q_s), ("k_s", k_s), ("v_s", v_s), ("g_s", g_s),
                  ("b_s", call.beta_strides), ("o_s", o_s)):
        getattr(p, nm)[:] = [int(x) for x in s]
    p.B, p.T, p.N, p.H, p.HV = call.B, call.T, call.N, call.H, call.HV
    p.group = call.HV // call.H
    p.max_len = call.max_len if call.max_len > 0 else call.T
    p.scale, p.lower_bound = float(call.scale), float(call.lower_bound)
    p.use_l2norm, p.beta_mode, p.state_kv = int(call.use_qk_l2norm), call.beta_mode, int(call.state_kv)
    p.g_fp32, p.beta_fp32 = int(g.dtype == torch.float32), int(beta.dtype == torch.float32)
    p.chunk_stride = call.chunk_stride
    keep = [t for t in (q, k, vv, g, beta, A_log, dt, cu, co) if t is not None]
    return p, keep, (o if o is not call.o else None)


class Sm90Launcher:
    def __init__(self, variant: Variant, artifact: Path) -> None:
        self.variant = variant
        self.artifact = Path(artifact)
        self._meta: dict[int, tuple] = {}
        # KdaCall.h0_index / ht_index: a state pool's slots, read and written by kda_fused_slots (its
        # own entry point: a run-time choice in kda_fused cost plain calls up to 2.3%, H100, session 52)
        self.pool_indices = variant.state != "none"

    def _module(self, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        meta = self._meta.get(idx)
        if meta is None:
            v = self.variant
            mod = load_module(self.artifact, idx, v.name)
            smem, nt, chunk, k, vdim, ncons, _nin, _nrec = struct.unpack("<8i", mod.read_global("kda_meta", 32))
            if (chunk, k, vdim, 64 * ncons) != (v.chunk, v.k, v.v, v.block_v):
                raise RuntimeError(f"{v.name}: artifact {self.artifact} was built for chunk={chunk} K={k} V={vdim} "
                                   f"block_v={64 * ncons}")
            props = torch.cuda.get_device_properties(idx)
            if props.major < 9:
                raise RuntimeError(f"{v.name}: needs an sm_90 GPU (Hopper), {props.name} is sm_{props.major}{props.minor}")
            check_shared_memory(v.name, {"kda_fused": smem}, props)
            try:  # (images from before the longest-first order took the grid as (sequences, heads): A/B runs)
                heads_x = struct.unpack("<i", mod.read_global("kda_grid_heads_x", 4))[0] == 1
            except RuntimeError:
                heads_x = False
            f_slots = None
            if self.pool_indices:
                try:
                    f_slots = mod.function("kda_fused_slots", smem)
                except RuntimeError:  # an image from before the entry point (A/B runs): pool calls refused
                    f_slots = None
            meta = (mod, mod.function("kda_fused", smem), smem, nt, heads_x, f_slots)
            self._meta[idx] = meta
        return meta

    def _slots_function(self, f_slots):
        if f_slots is None:
            raise RuntimeError(f"{self.variant.name}: artifact {self.artifact} has no kda_fused_slots entry point "
                               f"(built before it, or a variant without a state): rebuild it, or gather the pool "
                               f"(KDAGEN_POOL_SLOTS=0)")
        return f_slots

    def launch(self, call: KdaCall, p: KdaParams) -> None:
        """Queue kda_fused (kda_fused_slots for a call with a state pool's slots) on the current stream with
        parameters `p` (from build_params) for `call`."""
        mod, f, smem, nt, heads_x, f_slots = self._module(call.q.device)
        name = "kda_fused"
        if call.uses_pool_slots:
            f, name = self._slots_function(f_slots), "kda_fused_slots"
        stream = torch.cuda.current_stream(call.q.device).cuda_stream
        # grid: heads along x, sequences along y (the kernel maps row y to sequences longest first)
        nv = self.variant.v // self.variant.block_v
        grid = (call.HV, call.N, nv) if heads_x else (call.N, call.HV, nv)
        mod.launch(f, grid, (nt, 1, 1), smem, stream, p, name)

    def __call__(self, call: KdaCall) -> None:
        v = self.variant
        p, keep, o_run = build_params(call, v, v.name)
        if call.N == 0:
            return
        self.launch(call, p)
        if o_run is not None:
            call.o.copy_(o_run)
        del keep  # realigned copies were made on this stream: the allocator keeps them for its work

    def bind(self, call: KdaCall) -> "Sm90Bound | None":
        """A launch for every later call of `call`'s signature (the runtime reuses it only for the same shapes,
        strides, dtypes, devices and flags) that skips the per-call checks and struct building, as the sm80
        launcher's; None where the signature needs the general path (realigned or converted copies)."""
        v = self.variant
        if call.N == 0:
            return None
        p, keep, o_run = build_params(call, v, v.name)
        if o_run is not None:
            return None  # o written through an aligned copy
        for nm in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "chunk_offsets"):
            t = getattr(call, nm)
            if t is not None and getattr(p, nm) != t.data_ptr():
                return None  # a realigned or converted copy: every call needs its own
        del keep
        dev = call.q.device
        idx = dev.index if dev.index is not None else torch.cuda.current_device() if dev.type == "cuda" else 0
        mod, f, smem, nt, heads_x, f_slots = self._module(dev)
        nv = v.v // v.block_v
        grid = (call.HV, call.N, nv) if heads_x else (call.N, call.HV, nv)
        return Sm90Bound(self, idx, p, f, grid, nt, smem, varlen=call.cu_seqlens is not None, f_slots=f_slots)


class Sm90Bound:
    """One call signature's launch of kda_fused, prepared once (the runtime's host fast path, as sm80's
    Sm80Bound, whose pieces it shares: the pointer packing, the device lock, the launch shim and the driver
    binding): the parameter struct with strides and scalars filled, the grid. A call writes its 14 pointers
    into the struct and launches on torch's current stream, with no checks (the signature was checked);
    False sends it to the general path (unaligned data, a concurrent call, a refused launch). A call with a
    state pool's slots (launch's pool_slots) launches kda_fused_slots instead, with the same struct."""

    def __init__(self, launcher: Sm90Launcher, idx: int, params: KdaParams, f, grid: tuple[int, int, int], nt: int,
                 smem: int, varlen: bool, f_slots=None) -> None:
        self.launcher, self.idx = launcher, idx
        self.params = params
        params.h0_idx = params.ht_idx = self.pool_slots = 0  # set per call (launch's pool_slots)
        self.f_slots = f_slots
        self.takes_slots = f_slots is not None  # launch(..., pool_slots=): KdaParams h0_idx, ht_idx
        self.argv = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        self.argv_addr = ctypes.addressof(self.argv)
        self.ptr_offset = KdaParams.q.offset
        # (the kernel does not read max_len; written as the general path writes it, so both structs are equal)
        self.max_len_offset = KdaParams.max_len.offset if varlen else None
        self.f, self.grid, self.nt, self.smem = f, grid, nt, smem
        self.lock = sm80._device_lock(idx)
        self.launch_kernel = sm80.driver().cuLaunchKernel
        self.raw_stream = sm80.raw_stream_query()
        self.use_shim(True)
        self.streams: dict[tuple[int, bool], tuple] = {}  # (raw handle, slots) -> the driver call's arguments

    def use_shim(self, on: bool) -> None:
        """Launch through the launch shim (its Pair with the second launch alone) or cuda-bindings."""
        shim, how = sm80.shim_state() if on else (None, "switched off")
        self.shim = shim
        self.shim_call = shim.launch_pair if shim is not None else None
        # (raw handle, slots) -> (Pair address, Pair): kda_fused's, or with slots kda_fused_slots'
        self.shim_args: dict[tuple[int, bool], tuple] | None = {} if shim is not None else None
        self.launch_path = f"kda_fused through {how}" if shim is not None else \
            f"cuLaunchKernel through {sm80.driver_binding()} (launch shim not used: {how})"
        self.last_failure = ""

    def _shim_args_for(self, key: tuple[int, bool]) -> tuple:
        raw, slots = key
        pair = launch_shim.Pair()  # k[0] (a prep kernel) unused: launched only with a nonzero grid x
        k = pair.k[1]
        k.func, k.stream, k.args = int(self.f_slots if slots else self.f), raw, self.argv_addr
        k.grid[:], k.block[:], k.smem = self.grid, (self.nt, 1, 1), self.smem
        pair.failed = -1
        args = self.shim_args[key] = (ctypes.c_void_p(ctypes.addressof(pair)), pair)
        return args

    def launch(self, q, k, v, g, beta, o, A_log, dt_bias, cu_seqlens, h0, ht, hc, chunk_offsets, ws,
               max_len: int, pool_slots: int = 0) -> bool:
        """Launch one call of the bound signature (the tensors of a KdaCall, positionally; ws and max_len are
        not the fused kernel's); False when it must take the general path instead (nothing was launched).
        pool_slots: the device address of a state pool's int32 slots (h0 and ht are then the pool; launches
        kda_fused_slots), or 0."""
        qp, kp, vp, gp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), o.data_ptr()
        if (qp | kp | vp | gp | op) & 15 or (pool_slots and self.f_slots is None):
            return False
        lock = self.lock
        if not lock.acquire(False):  # not blocking
            return False
        try:
            raw = self.raw_stream(self.idx)
            sm80._PACK_PTRS(self.params, self.ptr_offset, qp, kp, vp, gp, beta.data_ptr(), op,
                            0 if A_log is None else A_log.data_ptr(), 0 if dt_bias is None else dt_bias.data_ptr(),
                            0 if cu_seqlens is None else cu_seqlens.data_ptr(), 0 if h0 is None else h0.data_ptr(),
                            0 if ht is None else ht.data_ptr(), 0 if hc is None else hc.data_ptr(),
                            0 if hc is None else chunk_offsets.data_ptr(), 0)
            if self.max_len_offset is not None:
                sm80._PACK_INT(self.params, self.max_len_offset, max_len)
            if pool_slots != self.pool_slots:
                self.params.h0_idx = self.params.ht_idx = self.pool_slots = pool_slots
            key = (raw, pool_slots != 0)
            if self.shim_args is not None:
                addr, pair = self.shim_args.get(key) or self._shim_args_for(key)
                if err := self.shim_call(addr, 0):
                    pair.failed = -1
                    return self._declined(err, key[1])
                return True
            args = self.streams.get(key)
            if args is None:
                gx, gy, gz = self.grid
                args = self.streams[key] = (self.f_slots if key[1] else self.f, gx, gy, gz, self.nt, 1, 1, self.smem,
                                            sm80.driver().CUstream(raw), self.argv_addr, 0)
            if err := self.launch_kernel(*args)[0]:
                return self._declined(err, key[1])
            return True
        finally:
            lock.release()

    def _declined(self, err, slots: bool = False) -> bool:
        name = "kda_fused_slots" if slots else "kda_fused"
        self.last_failure = (f"cuLaunchKernel({name}, grid={self.grid}, block={(self.nt, 1, 1)}, smem={self.smem}) "
                             f"failed: {sm80.cu_result_name(err)} ({self.launch_path})")
        log.debug("kdagen: %s: the bound launch declined: %s", self.launcher.variant.name, self.last_failure)
        return False
