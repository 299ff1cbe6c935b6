"""Launcher for the sm90 target: one fused kernel per variant (kda_fused, templates/sm90/).

Grid: value heads x sequences (varlen: longest first, ranked in the kernel) x V / block_v; each CTA
streams its head's inputs in with bulk copies, builds the chunk records in shared memory and runs the
recurrence (no workspace). The
kernel takes the same `KdaParams` struct as sm80 (mirrored in kdagen.targets.sm80); its shape
constants are read from the module's `kda_meta` global (single source of truth: the header).
"""

from __future__ import annotations

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



def build_params(call: KdaCall, v: Variant,
                 who: str) -> tuple[KdaParams, list[torch.Tensor], torch.Tensor | None]:
    """Check `call` against variant `v` and fill the kernel's parameter struct. Returns the struct,
    the tensors it points into that the caller must keep alive until the launch is queued
    (realigned or converted copies), and the aligned stand-in for o the kernel writes (None when
    it writes call.o itself)."""
    check_call(call, v)
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
    p.hc, p.chunk_offsets = _ptr(call.chunk_states), _ptr(co)
    p.ws = 0
    for nm, s in (("q_s", q_s), ("k_s", k_s), ("v_s", v_s), ("g_s", g_s),
                  ("b_s", call.beta_strides), ("o_s", o_s)):
        getattr(p, nm)[:] = [int(x) for x in s]
    p.B, p.T, p.N, p.H, p.HV = call.B, call.T, call.N, call.H, call.HV
    p.group = call.HV // call.H
    p.max_len = call.max_len if call.max_len > 0 else call.T
    p.scale, p.lower_bound = float(call.scale), float(call.lower_bound)
    p.use_l2norm, p.neg_eigval, p.state_kv = int(call.use_qk_l2norm), int(call.allow_neg_eigval), int(call.state_kv)
    p.g_fp32, p.beta_fp32 = int(g.dtype == torch.float32), int(beta.dtype == torch.float32)
    keep = [t for t in (q, k, vv, g, beta, A_log, dt, cu, co) if t is not None]
    return p, keep, (o if o is not call.o else None)


class Sm90Launcher:
    def __init__(self, variant: Variant, artifact: Path) -> None:
        self.variant = variant
        self.artifact = Path(artifact)
        self._meta: dict[int, tuple] = {}

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
            meta = (mod, mod.function("kda_fused", smem), smem, nt, heads_x)
            self._meta[idx] = meta
        return meta

    def launch(self, call: KdaCall, p: KdaParams) -> None:
        """Queue kda_fused on the current stream with parameters `p` (from build_params) for `call`."""
        mod, f, smem, nt, heads_x = self._module(call.q.device)
        stream = torch.cuda.current_stream(call.q.device).cuda_stream
        # grid: heads along x, sequences along y (the kernel maps row y to sequences longest first)
        nv = self.variant.v // self.variant.block_v
        grid = (call.HV, call.N, nv) if heads_x else (call.N, call.HV, nv)
        mod.launch(f, grid, (nt, 1, 1), smem, stream, p, "kda_fused")

    def __call__(self, call: KdaCall) -> None:
        v = self.variant
        p, keep, o_run = build_params(call, v, v.name)
        if call.N == 0:
            return
        self.launch(call, p)
        if o_run is not None:
            call.o.copy_(o_run)
        del keep  # realigned copies were made on this stream: the allocator keeps them for its work
