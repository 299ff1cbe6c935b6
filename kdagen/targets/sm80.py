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
from ..select import _sm_count
from ..variant import Variant
from .cuda_driver import load_module

_IN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "none": torch.float32}


def check_shared_memory(who: str, needs: dict[str, int], props) -> None:
    """Refuse a variant whose kernels need more shared memory per block than the device gives
    (sm80 kernels fit an A100's 163 KB; sm_86/89 allow 99 KB), naming kernel and sizes."""
    limit = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
    if limit <= 0:
        return  # unknown: let the driver decide
    over = {k: n for k, n in needs.items() if n > limit}
    if over:
        what = ", ".join(f"{k} needs {n / 1024:.1f} KB" for k, n in over.items())
        raise RuntimeError(f"{who}: {what} of shared memory per block; {props.name} allows "
                           f"{limit / 1024:.1f} KB. Use a variant with chunk 16 or a smaller block_v.")


def recur_smem_beside_prep(smem1: int, smem2: int, props, k: int = 1) -> int:
    """Dynamic shared memory for a kda_recur block such that k kda_prep blocks (smem1 bytes
    each) still fit on its SM but k + 1 do not; smem2 where the device does not say its sizes
    or the recurrence needs more anyway."""
    total = int(getattr(props, "shared_memory_per_multiprocessor", 0) or 0)
    optin = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
    if total <= 0 or optin <= 0:
        return smem2
    per_block = 1024  # shared memory the driver reserves per resident block (sm_80 and later)
    # k fit: r + per_block + k (smem1 + per_block) <= total; k + 1 do not: half a prep block of margin
    r = total - per_block - k * (smem1 + per_block) - smem1 // 2
    return max(smem2, min(r, optin))


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
        # Time segmentation (prep of the next segment overlaps the recurrence): segments of at
        # least this many tokens, at most max_segments of them; None turns it off.
        self.min_segment_tokens: int | None = 4096
        self.max_segments = 8
        # The last segment's recurrence has no prep left to overlap, so the SMs outside it idle;
        # a last segment of about this many tokens (at least this many, the boundary on a whole
        # 64; None: all segments equal) shortens that.
        self.last_segment_tokens: int | None = None
        # In a segmented call, kda_recur blocks ask for enough (unused) shared memory that at most
        # this many kda_prep blocks fit beside them on an SM (None: no limit): prep blocks
        # otherwise fill those SMs and take the issue slots of the serial chain. H200, T65536
        # H24: one beside took 3.50 -> 3.08 ms with the earlier prep; with the prep that issues
        # all its loads at once, none beside is faster than one (2.97-3.17 vs 3.18-3.34 ms over
        # two runs, scripts/segment_sweep.py).
        self.prep_blocks_beside_recur: int | None = 0
        self._side_streams: dict[int, torch.cuda.Stream] = {}
        self.last_segments = 0  # segments of the last call (0: one piece); for tests and logs

    def _module(self, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        mod = load_module(self.artifact, idx, self.variant.name)
        meta = self._meta.get(idx)
        if meta is None:
            rec, smem1, smem2, nt1, nt2, chunk, bv, _ = struct.unpack("<8i", mod.read_global("kda_meta", 32))
            if chunk != self.variant.chunk or bv != self.variant.block_v:
                raise RuntimeError(f"{self.variant.name}: artifact {self.artifact} was built for chunk={chunk} "
                                   f"block_v={bv}")
            check_shared_memory(self.variant.name, {"kda_prep": smem1, "kda_recur": smem2},
                                torch.cuda.get_device_properties(idx))
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
        for nm, s in (("q_s", q_s), ("k_s", k_s), ("v_s", v_s), ("g_s", g_s),
                      ("b_s", call.beta_strides), ("o_s", call.o_strides)):
            getattr(p, nm)[:] = [int(x) for x in s]
        p.B, p.T, p.N, p.H, p.HV = call.B, call.T, call.N, call.H, call.HV
        p.group, p.max_len = call.HV // call.H, max_len
        p.scale, p.lower_bound = float(call.scale), float(call.lower_bound)
        p.use_l2norm, p.neg_eigval, p.state_kv = int(call.use_qk_l2norm), int(call.allow_neg_eigval), int(call.state_kv)
        p.g_fp32, p.beta_fp32 = int(g.dtype == torch.float32), int(beta.dtype == torch.float32)

        if call.N == 0:
            return
        segs = self._segments(call, v, max_len)
        self.last_segments = len(segs)
        if segs:
            self._launch_segmented(call, p, segs, ws_bytes=rec, dev=dev, mod=mod, f1=f1, f2=f2,
                                   nt1=nt1, nt2=nt2, smem1=smem1, smem2=smem2,
                                   elsize={"q": q.element_size(), "k": k.element_size(), "v": vv.element_size(),
                                           "g": g.element_size(), "beta": beta.element_size(),
                                           "o": call.o.element_size()})
            return
        ws = torch.empty(nrec * call.HV * rec, dtype=torch.uint8, device=dev)
        p.ws = _ptr(ws)
        stream = torch.cuda.current_stream(dev).cuda_stream
        if max_len > 0 and "prep" in self.parts:
            mod.launch(f1, ((max_len + C - 1) // C, call.N, call.HV), (nt1, 1, 1), smem1, stream, p, "kda_prep")
        if "recur" in self.parts:
            mod.launch(f2, (v.v // v.block_v, call.N, call.HV), (nt2, 1, 1), smem2, stream, p, "kda_recur")
        # ws and any realigned copies were allocated on this stream: the caching allocator only
        # hands their memory to later work on the same stream, so no record_stream is needed.

    def _segments(self, call: KdaCall, v: Variant, max_len: int) -> list[tuple[int, int]]:
        """Time segments [a, b) for overlapping the prep of segment s + 1 with the recurrence
        of segment s, or [] to run in one piece. Worth it only when the recurrence leaves most
        SMs idle (few heads, long sequences); needs the fp32 state carried between segments,
        equal-length sequences and no per-chunk states."""
        if (self.min_segment_tokens is None or self.parts != ("prep", "recur") or call.cu_seqlens is not None
                or call.chunk_states is not None or v.state != "fp32"):
            return []
        programs = call.N * call.HV * (v.v // v.block_v)
        if programs >= _sm_count(call.q.device) or max_len < 2 * self.min_segment_tokens:
            return []
        S = min(self.max_segments, max_len // self.min_segment_tokens)
        tail = self.last_segment_tokens
        body = max_len
        if tail is not None and S > 2 and 0 < tail < max_len // S:
            # the last segment starts on a whole 64 tokens, like every other boundary, so that
            # the chunking (and each rounding) is the one-piece call's
            body, S = (max_len - tail) // 64 * 64, S - 1
        step = -(-body // S)
        step = -(-step // 64) * 64  # whole chunks (64 is a multiple of every chunk size)
        segs = [(a, min(a + step, body)) for a in range(0, body, step)]
        return segs + ([(body, max_len)] if body < max_len else [])

    def _launch_segmented(self, call, p, segs, *, ws_bytes, dev, mod, f1, f2, nt1, nt2, smem1, smem2, elsize):
        v, C = self.variant, self.variant.chunk
        main = torch.cuda.current_stream(dev)
        side = self._side_streams.get(dev.index)
        if side is None:
            side = self._side_streams[dev.index] = torch.cuda.Stream(dev)
        # The prep stream starts after everything already queued on the caller's stream (inputs,
        # and earlier users of the memory the allocator hands out below). Recurrences stay on the
        # caller's stream: a high-priority stream for them, with each prep held back a segment,
        # measured slower on an H200 (4.03 vs 3.76-3.83 ms at T65536 H24, 2026-11-30).
        start = torch.cuda.Event()
        start.record(main)
        side.wait_event(start)
        N, HV, V, K = call.N, call.HV, v.v, v.k
        carry = torch.empty((len(segs) - 1, N, HV, V, K), dtype=torch.float32, device=dev)
        work = []
        for i, (a, b) in enumerate(segs):
            ps = KdaParams.from_buffer_copy(p)
            for nm, key, strides in (("q", "q", "q_s"), ("k", "k", "k_s"), ("v", "v", "v_s"), ("g", "g", "g_s"),
                                     ("beta", "beta", "b_s"), ("o", "o", "o_s")):
                setattr(ps, nm, getattr(p, nm) + a * getattr(p, strides)[1] * elsize[key])
            ps.T = ps.max_len = b - a
            ps.h0 = p.h0 if i == 0 else int(carry[i - 1].data_ptr())
            ps.ht = p.ht if i == len(segs) - 1 else int(carry[i].data_ptr())
            ws = torch.empty(((call.B * (b - a)) // C + N + 1) * HV * ws_bytes, dtype=torch.uint8, device=dev)
            ps.ws = int(ws.data_ptr())
            mod.launch(f1, (-(-(b - a) // C), N, HV), (nt1, 1, 1), smem1, side.cuda_stream, ps, "kda_prep")
            done = torch.cuda.Event()
            done.record(side)
            work.append((ps, ws, done))
        smem_r = smem2
        if self.prep_blocks_beside_recur is not None:
            smem_r = recur_smem_beside_prep(smem1, smem2, torch.cuda.get_device_properties(dev),
                                            self.prep_blocks_beside_recur)
            mod.function("kda_recur", smem_r)
        for ps, _ws, done in work:
            main.wait_event(done)
            mod.launch(f2, (V // v.block_v, N, HV), (nt2, 1, 1), smem_r, main.cuda_stream, ps, "kda_recur")
        # carry and the workspaces were allocated on the caller's stream and their last use is
        # there (each recurrence waits for its prep): no record_stream needed.
