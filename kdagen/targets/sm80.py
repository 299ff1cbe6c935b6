"""Launcher for the sm80 target: two kernels per variant (kda_prep, kda_recur) from one fatbin.

kda_prep (grid: chunks x sequences x value heads) writes a per-chunk workspace record;
kda_recur (grid: V/block_v x sequences x value heads) runs the chunk recurrence; kda_recur_twins,
the same code built for KdaCall.twins == 2, runs twice the heads (the scan's transition run on the
same prep). All take a
`KdaParams` struct by value (its ctypes mirror is derived from templates/common/kda_common.cuh
in cuda_launch.py). Layout
constants (workspace record size, shared memory, block sizes) are read from the module's
`kda_meta` global, so they have a single source of truth: the header.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import struct
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..abi import KdaCall
from ..dtypes import torch_dtype
from ..scan.planner import OVERLAP_MIN_HIDDEN_US, hidden_prep_us
from ..select import _sm_count
from ..variant import Variant
from . import launch_shim
from .cuda_driver import capture_query, driver, driver_binding, load_module, raw_stream_query
from .cuda_launch import KdaParams, aligned_inputs, check_call, check_shared_memory
from .cuda_launch import ptr as _ptr

log = logging.getLogger("kdagen")

# Caller-provided workspaces are carved into pieces at this alignment.
_WS_ALIGN = 256


@dataclass(frozen=True)
class Sm80Settings:
    """How the sm80 launcher splits a call; measurements behind each default in benchmarks/NOTES.md."""

    # Which kernels to launch; benchmarks time ("prep",) or ("recur",) alone.
    parts: tuple[str, ...] = ("prep", "recur")
    # Time segmentation (the prep of segment s + 1 overlaps the recurrence of segment s): segments
    # of at least this many tokens, at most max_segments of them; None turns it off.
    min_segment_tokens: int | None = 4096
    max_segments: int = 8
    # ... and only where they can hide at least this much prep (modeled: kdagen.scan.planner's
    # hidden_prep_us); below it their fixed cost loses to one piece. None: no such limit.
    min_hidden_prep_us: float | None = OVERLAP_MIN_HIDDEN_US
    # A last segment of about this many tokens (None: all segments equal): its recurrence has no
    # prep left to overlap. Measured no gain on the H200, so off.
    last_segment_tokens: int | None = None
    # In a segmented call kda_recur blocks claim enough shared memory that at most this many
    # kda_prep blocks fit beside them on an SM (None: no limit); 0 measured fastest with the
    # current prep (T65536 H24).
    prep_blocks_beside_recur: int | None = 0

    def __post_init__(self) -> None:
        if not self.parts or any(p not in ("prep", "recur") for p in self.parts):
            raise ValueError(f"Sm80Settings.parts: expected a non-empty subset of ('prep', 'recur'), found {self.parts}")
        if self.min_segment_tokens is not None and self.min_segment_tokens < 64:
            raise ValueError(f"Sm80Settings.min_segment_tokens: expected None or >= 64, found {self.min_segment_tokens}")
        if self.min_hidden_prep_us is not None and not self.min_hidden_prep_us >= 0:
            raise ValueError(f"Sm80Settings.min_hidden_prep_us: expected None or >= 0, found {self.min_hidden_prep_us}")
        if self.max_segments < 1:
            raise ValueError(f"Sm80Settings.max_segments: expected >= 1, found {self.max_segments}")


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


class Sm80Launcher:
    # KdaCall.twins == 2 runs (the transition run shares the prep; see KdaParams::twins)
    supports_twins = True
    # KdaCall.h0_index / ht_index: a state pool's slots read and written by the kernels
    pool_indices = True

    def __init__(self, variant: Variant, artifact: Path, settings: Sm80Settings | None = None) -> None:
        self.variant = variant
        self.artifact = Path(artifact)
        self.settings = settings or Sm80Settings()
        self._meta: dict[int, tuple] = {}
        self._side_streams: dict[int, torch.cuda.Stream] = {}
        self.last_segments = 0  # segments of the last call (0: one piece); for tests and logs

    def with_settings(self, **changes) -> "Sm80Launcher":
        """A launcher of the same variant and artifact with some settings changed."""
        return Sm80Launcher(self.variant, self.artifact, replace(self.settings, **changes))

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

    def recur_blocks_per_sm(self, device: torch.device, twins: bool = False) -> int:
        """kda_recur (or kda_recur_twins) blocks one SM holds at once in a varlen launch (for
        wave-aware segment counts: kdagen.cp, kdagen.scan.planner)."""
        idx, (mod, _, _, _, _, smem2, _, nt2) = self._module(device)
        return mod.blocks_per_sm("kda_recur_twins" if twins else "kda_recur", nt2, smem2)

    def _check(self, call: KdaCall) -> None:
        v = self.variant
        who = v.name
        check_call(call, v, twins_ok=True, slots_ok=True)
        o = call.o
        if o.stride(-1) != 1 or o.data_ptr() % 16 or any((st * o.element_size()) % 16 for st in call.o_strides):
            # kda_recur writes o in 16-byte pieces
            raise RuntimeError(f"{who}: o must have a unit last stride and 16-byte aligned rows "
                               f"(strides {tuple(o.stride())}, data_ptr % 16 = {o.data_ptr() % 16})")

    def _params(self, call: KdaCall, g_dtype, beta_dtype, strides, max_len: int) -> KdaParams:
        """The kernels' parameter struct without its pointers (filled per call)."""
        p = KdaParams()
        for nm, st in zip(("q_s", "k_s", "v_s", "g_s", "b_s", "o_s"), strides):
            getattr(p, nm)[:] = [int(x) for x in st]
        p.B, p.T, p.N, p.H, p.HV = call.B, call.T, call.N, call.H, call.HV
        p.group, p.max_len = call.HV // call.H, max_len
        p.scale, p.lower_bound = float(call.scale), float(call.lower_bound)
        p.use_l2norm, p.beta_mode, p.state_kv = int(call.use_qk_l2norm), call.beta_mode, int(call.state_kv)
        p.g_fp32, p.beta_fp32 = int(g_dtype == torch.float32), int(beta_dtype == torch.float32)
        p.twins, p.chunk_stride = call.twins, call.chunk_stride
        return p

    def workspace_bytes(self, call: KdaCall, device: torch.device) -> int:
        """Bytes of caller workspace a call of this shape needs (T as the longest sequence)."""
        _, (_, _, _, rec, *_rest) = self._module(device)
        max_len = call.max_len if call.max_len > 0 else call.T
        return sum(n for n in self._workspace_pieces(call, rec, self._segments(call, self.variant, max_len, device)))

    def _workspace_pieces(self, call: KdaCall, rec: int, segs: list[tuple[int, int]]) -> list[int]:
        """Bytes of each scratch buffer of a call: one workspace, or per segment one plus the fp32
        states carried between segments; each rounded up to _WS_ALIGN."""
        C, N, HV = self.variant.chunk, call.N, call.HV
        up = lambda n: -(-n // _WS_ALIGN) * _WS_ALIGN  # noqa: E731
        if not segs:
            return [up(((call.B * call.T) // C + N + 1) * HV * rec)]
        carry = up((len(segs) - 1) * N * HV * self.variant.v * self.variant.k * 4)
        return [carry] + [up(((call.B * (b - a)) // C + N + 1) * HV * rec) for a, b in segs]

    def _scratch(self, call: KdaCall, pieces: list[int], dev: torch.device) -> list[torch.Tensor]:
        """The scratch buffers: views of call.workspace when given (checked for size), else
        fresh ones from torch's caching allocator on the current stream."""
        ws = call.workspace
        if ws is None:
            return [torch.empty(n, dtype=torch.uint8, device=dev) for n in pieces]
        flat = ws.view(torch.uint8).reshape(-1)
        need = _workspace_need(ws, pieces)
        if flat.numel() < need:
            raise RuntimeError(f"{self.variant.name}: workspace has {flat.numel()} bytes, this call needs {need} "
                               "(kdagen.workspace_size(...) says how many)")
        out, at = [], (-ws.data_ptr()) % _WS_ALIGN
        for n in pieces:
            out.append(flat[at:at + n])
            at += n
        return out

    def __call__(self, call: KdaCall) -> None:
        v = self.variant
        self._check(call)
        dev = call.q.device
        in_t = torch_dtype(v.dtype)
        idx, (mod, f1, f2, rec, smem1, smem2, nt1, nt2) = self._module(dev)
        q, q_s, k, k_s, vv, v_s, g, g_s, beta = aligned_inputs(call, in_t)

        C = v.chunk
        max_len = call.max_len if call.max_len > 0 else call.T
        A_log = call.A_log.float().contiguous() if (call.A_log is not None and v.gate != "precomputed") else None
        dt = call.dt_bias.float().contiguous() if (call.dt_bias is not None and v.gate != "precomputed") else None
        cu = call.cu_seqlens
        if cu is not None and (cu.dtype != torch.int32 or not cu.is_contiguous()):
            cu = cu.to(torch.int32).contiguous()
        co = call.chunk_offsets
        if call.chunk_states is not None:
            co = co.to(torch.int32).contiguous()

        p = self._params(call, g.dtype, beta.dtype, (q_s, k_s, v_s, g_s, call.beta_strides, call.o_strides), max_len)
        p.q, p.k, p.v, p.g, p.beta, p.o = _ptr(q), _ptr(k), _ptr(vv), _ptr(g), _ptr(beta), _ptr(call.o)
        p.A_log, p.dt_bias, p.cu_seqlens = _ptr(A_log), _ptr(dt), _ptr(cu)
        p.h0, p.ht = _ptr(call.initial_state), _ptr(call.final_state)
        p.h0_idx, p.ht_idx = _ptr(call.h0_index), _ptr(call.ht_index)
        p.hc, p.chunk_offsets = _ptr(call.chunk_states), (_ptr(co) if call.chunk_states is not None else 0)

        if call.N == 0:
            return
        segs = self._segments(call, v, max_len)
        pieces = self._workspace_pieces(call, rec, segs)
        if segs and call.workspace is not None and call.workspace.nbytes < _workspace_need(call.workspace, pieces):
            # a caller workspace sized for the one-piece call (workspace_size promises that much,
            # growing with T and N; the segments' carried states are extra): run in one piece
            segs, pieces = [], self._workspace_pieces(call, rec, [])
        self.last_segments = len(segs)
        scratch = self._scratch(call, pieces, dev)
        if segs:
            self._launch_segmented(call, p, segs, scratch, dev=dev, mod=mod, f1=f1, f2=f2, nt1=nt1, nt2=nt2,
                                   smem1=smem1, smem2=smem2,
                                   sizes=tuple(t.element_size() for t in (q, k, vv, g, beta, call.o)))
            return
        p.ws = _ptr(scratch[0])
        stream = torch.cuda.current_stream(dev).cuda_stream
        if max_len > 0 and "prep" in self.settings.parts:
            mod.launch(f1, ((max_len + C - 1) // C, call.N, call.HV), (nt1, 1, 1), smem1, stream, p, "kda_prep")
        if "recur" in self.settings.parts:
            if call.twins > 1:  # its own entry: the plain kda_recur is compiled without the twins' code
                mod.launch(mod.function("kda_recur_twins", smem2), (v.v // v.block_v, call.N, call.HV * call.twins),
                           (nt2, 1, 1), smem2, stream, p, "kda_recur_twins")
            else:
                mod.launch(f2, (v.v // v.block_v, call.N, call.HV), (nt2, 1, 1), smem2, stream, p, "kda_recur")
        # ws and any realigned copies were allocated on this stream: the caching allocator only
        # hands their memory to later work on the same stream, so no record_stream is needed.

    def bind(self, call: KdaCall) -> "Sm80Bound | None":
        """A launch for every later call of `call`'s signature (the runtime reuses it only for the
        same shapes, strides, dtypes, devices and flags) that skips the per-call checks and
        struct building; None where the signature needs the general path (time segments, dtype
        conversions, realigned copies, partial settings)."""
        v = self.variant
        self._check(call)
        dev = call.q.device
        in_t = torch_dtype(v.dtype)
        if call.N == 0 or self.settings.parts != ("prep", "recur"):
            return None
        if call.g.dtype not in (in_t, torch.float32) or call.beta.dtype not in (in_t, torch.float32):
            return None
        strides = (call.q_strides, call.k_strides, call.v_strides, call.g_strides, call.beta_strides, call.o_strides)
        for t, st in zip((call.q, call.k, call.v, call.g), strides):
            if any((x * t.element_size()) % 16 for x in st):
                return None  # strides that need realigned copies: the general path copies
        if (call.A_log is not None and call.A_log.dtype != torch.float32) or \
                (call.dt_bias is not None and call.dt_bias.dtype != torch.float32) or \
                (call.cu_seqlens is not None and call.cu_seqlens.dtype != torch.int32):
            return None
        idx, (mod, f1, f2, rec, smem1, smem2, nt1, nt2) = self._module(dev)
        p = self._params(call, call.g.dtype, call.beta.dtype, strides, call.T)
        segs = self._segments(call, v, call.max_len if call.max_len > 0 else call.T)
        if segs:
            # the general segmented path spent 0.5-0.7 ms of host time a call, which cost the
            # segments most of what they save; bound: 0.08-0.38 ms (NOTES, session 34)
            return Sm80SegmentedBound(self, call, idx, p, segs, f1, f2, nt1, nt2, smem1,
                                      self._recur_smem(dev, mod, smem1, smem2),
                                      self._workspace_pieces(call, rec, segs))
        if call.twins > 1:  # the scan's twin runs (kda_prefill_twins), a call per scan step 1
            f2 = mod.function("kda_recur_twins", smem2)
        return Sm80Bound(self, call, idx, mod, p, f1, f2, nt1, nt2, smem1, smem2,
                         self._workspace_pieces(call, rec, [])[0])

    def _segments(self, call: KdaCall, v: Variant, max_len: int,
                  device: torch.device | None = None) -> list[tuple[int, int]]:
        """Time segments [a, b) for overlapping the prep of segment s + 1 with the recurrence
        of segment s, or [] to run in one piece. Worth it only when the recurrence leaves most
        SMs idle (few heads, long sequences); needs the fp32 state carried between segments,
        equal-length sequences (a batch, or one varlen sequence: its offsets are [0, T], which
        the runtime checked or the caller promised). With chunk states every cut falls on the
        kept states' grid (chunk x chunk_stride tokens), so a segment's rows follow the last's."""
        cfg = self.settings
        if (cfg.min_segment_tokens is None or cfg.parts != ("prep", "recur")
                or (call.cu_seqlens is not None and call.N != 1)
                or v.state != "fp32" or call.twins != 1):
            return []
        unit = 64 if call.chunk_states is None else math.lcm(64, v.chunk * max(1, call.chunk_stride))
        programs = call.N * call.HV * (v.v // v.block_v)
        sms = _sm_count(device or call.q.device)
        if programs >= sms or max_len < 2 * max(cfg.min_segment_tokens, unit):
            return []
        if (cfg.min_hidden_prep_us is not None
                and hidden_prep_us(call.N * max_len * call.HV, programs, sms, v.chunk) < cfg.min_hidden_prep_us):
            return []
        S = min(cfg.max_segments, max_len // cfg.min_segment_tokens)
        tail = cfg.last_segment_tokens
        body = max_len
        if tail is not None and S > 2 and 0 < tail < max_len // S:
            # the last segment starts on a whole unit, like every other boundary, so that the
            # chunking (and each rounding) is the one-piece call's
            body, S = (max_len - tail) // unit * unit, S - 1
        step = -(-body // S)
        step = -(-step // unit) * unit  # whole chunks (64 is a multiple of every chunk size)
        segs = [(a, min(a + step, body)) for a in range(0, body, step)] + ([(body, max_len)] if body < max_len else [])
        return segs if len(segs) > 1 else []

    def _side_stream(self, dev: torch.device) -> torch.cuda.Stream:
        """The stream the segments' preps run on (one per device)."""
        side = self._side_streams.get(dev.index)
        if side is None:
            side = self._side_streams[dev.index] = torch.cuda.Stream(dev)
        return side

    def _recur_smem(self, dev: torch.device, mod, smem1: int, smem2: int) -> int:
        """Dynamic shared memory of a segmented call's kda_recur blocks (see prep_blocks_beside_recur)."""
        if self.settings.prep_blocks_beside_recur is None:
            return smem2
        smem_r = recur_smem_beside_prep(smem1, smem2, torch.cuda.get_device_properties(dev),
                                        self.settings.prep_blocks_beside_recur)
        mod.function("kda_recur", smem_r)
        return smem_r

    def _launch_segmented(self, call, p, segs, scratch, *, dev, mod, f1, f2, nt1, nt2, smem1, smem2, sizes):
        v, C = self.variant, self.variant.chunk
        main = torch.cuda.current_stream(dev)
        side = self._side_stream(dev)
        # The prep stream starts after everything already queued on the caller's stream (inputs,
        # and earlier users of the memory the allocator hands out below). Recurrences stay on the
        # caller's stream: a high-priority stream for them, with each prep held back a segment,
        # measured slower on an H200 (4.03 vs 3.76-3.83 ms at T65536 H24, 2026-11-30).
        start = torch.cuda.Event()
        start.record(main)
        side.wait_event(start)
        N, HV, V, K = call.N, call.HV, v.v, v.k
        carry = scratch[0][:(len(segs) - 1) * N * HV * V * K * 4].view(torch.float32).view(len(segs) - 1, N, HV, V, K)
        smem_r = self._recur_smem(dev, mod, smem1, smem2)
        # Each recurrence is queued right after its prep: queuing every prep first kept the first
        # recurrence waiting for the host's whole loop (0.05-0.13 ms at T131072; NOTES, session 34).
        # The preps still run ahead on the side stream, beside the recurrences.
        base = (p.q, p.k, p.v, p.g, p.beta, p.o)
        strides = (p.q_s, p.k_s, p.v_s, p.g_s, p.b_s, p.o_s)
        rows = _segment_rows(call, segs, C)
        for i, (ps, gx, off) in enumerate(_segment_structs(p, segs, strides, sizes, C)):
            _pack_segment(ps, base, off, p.A_log, p.dt_bias, p.h0 if i == 0 else int(carry[i - 1].data_ptr()),
                          p.ht if i == len(segs) - 1 else int(carry[i].data_ptr()), int(scratch[1 + i].data_ptr()),
                          p.hc and p.hc + rows[i], p.chunk_offsets)
            # a pool's slots only where the call's states are: the carries between segments are per sequence
            ps.h0_idx = p.h0_idx if i == 0 else 0
            ps.ht_idx = p.ht_idx if i == len(segs) - 1 else 0
            mod.launch(f1, (gx, N, HV), (nt1, 1, 1), smem1, side.cuda_stream, ps, "kda_prep")
            done = torch.cuda.Event()
            done.record(side)
            main.wait_event(done)
            mod.launch(f2, (V // v.block_v, N, HV), (nt2, 1, 1), smem_r, main.cuda_stream, ps, "kda_recur")
        # carry and the workspaces were allocated on the caller's stream and their last use is
        # there (each recurrence waits for its prep): no record_stream needed.


def _segment_structs(params: KdaParams, segs: list[tuple[int, int]], strides, sizes, chunk: int
                     ) -> list[tuple[KdaParams, int, tuple[int, ...]]]:
    """Per time segment [a, b): `params` with the segment's length, its prep grid x, and the byte
    offsets of q, k, v, g, beta and o at token a (strides and element sizes in that order)."""
    return [(_with_length(params, b - a), -(-(b - a) // chunk), tuple(a * st[1] * es for st, es in zip(strides, sizes)))
            for a, b in segs]


def _segment_rows(call: KdaCall, segs: list[tuple[int, int]], chunk: int) -> list[int]:
    """Byte offset into the chunk states of each segment's first kept row: the kernel writes row
    chunk_offsets[n] + c / chunk_stride of its own chunks c, so moving the pointer by the rows
    of the tokens before the segment continues every sequence's rows (cuts on the rows' grid)."""
    if call.chunk_states is None:
        return [0] * len(segs)
    row = call.HV * call.V * call.K * call.chunk_states.element_size()
    spacing = chunk * max(1, call.chunk_stride)
    return [a // spacing * row for a, _ in segs]


def _with_length(params: KdaParams, n: int) -> KdaParams:
    ps = KdaParams.from_buffer_copy(params)
    ps.T = ps.max_len = n
    return ps


def _pack_segment(ps: KdaParams, base: tuple[int, ...], off: tuple[int, ...], A: int, dt: int, h0: int, ht: int,
                  ws: int, hc: int, chunk_offsets: int) -> None:
    """A segment's 14 pointers: q, k, v, g, beta and o advanced to its first token, no varlen
    offsets (one varlen sequence runs as the batch of one it is), the chunk states advanced to
    its first row (0: none)."""
    _PACK_PTRS(ps, _ptr_offset(), base[0] + off[0], base[1] + off[1], base[2] + off[2], base[3] + off[3],
               base[4] + off[4], base[5] + off[5], A, dt, 0, h0, ht, hc, chunk_offsets if hc else 0, ws)


_PTRS = ("q", "k", "v", "g", "beta", "o", "A_log", "dt_bias", "cu_seqlens", "h0", "ht", "hc", "chunk_offsets", "ws")


@functools.lru_cache(maxsize=None)
def _ptr_offset() -> int:
    """Offset of KdaParams' 14 pointer fields, which the packed writes take to be consecutive."""
    offs = [getattr(KdaParams, n).offset for n in _PTRS]
    if offs != list(range(offs[0], offs[0] + 8 * len(offs), 8)):
        raise RuntimeError("KdaParams: the pointer fields are no longer 14 consecutive 8-byte fields")
    return offs[0]


def _workspace_need(ws: torch.Tensor, pieces: list[int]) -> int:
    """Bytes of caller workspace `ws` that `pieces` take, with its start rounded up to _WS_ALIGN."""
    return sum(pieces) + (-ws.data_ptr()) % _WS_ALIGN


def shim_state() -> tuple:
    """(the launch shim or None, how launches go or why not); tests point it at a stand-in."""
    return launch_shim.active()


def cu_result_name(err) -> str:
    """The name of a CUresult a launch returned (an enum member, or an int from the launch shim)."""
    what = getattr(err, "name", None)
    if what is None:
        try:
            what = driver().CUresult(int(err)).name
        except Exception:
            what = f"CUresult {int(err)}"
    return what


_PACK_PTRS = struct.Struct("<14Q").pack_into
_PACK_INT = struct.Struct("<i").pack_into


def _device_lock(idx: int) -> threading.Lock:
    with _LOCKS_GUARD:
        return Sm80Bound._LOCKS.setdefault(idx, threading.Lock())


_LOCKS_GUARD = threading.Lock()


class Sm80Bound:
    """One call signature's launch, prepared once: the parameter struct with strides and scalars
    filled, grids, kernels, workspace size, and per stream the driver calls' argument tuples (or
    the launch shim's prepared Pair: both launches in one ctypes call). A call writes its 14
    pointers into the struct and launches both kernels on torch's current stream, with no checks
    (the signature was checked) and no context switch (torch keeps the device's primary context
    current; a launch that finds another one falls back to the general path, which switches)."""

    # One lock per device guards its bound structs and its scratch arenas: a call that finds it
    # taken (another thread is launching) takes the general path rather than wait.
    _LOCKS: dict[int, threading.Lock] = {}

    def __init__(self, launcher: Sm80Launcher, call: KdaCall, idx: int, mod, params: KdaParams, f1, f2,
                 nt1: int, nt2: int, smem1: int, smem2: int, ws_bytes: int) -> None:
        v = launcher.variant
        self.launcher, self.idx, self.mod = launcher, idx, mod
        self.params = params
        params.h0_idx = params.ht_idx = self.pool_slots = 0  # set per call (launch's pool_slots)
        self.argv = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        self.argv_addr = ctypes.addressof(self.argv)
        self.ptr_offset = _ptr_offset()
        self.max_len_offset = KdaParams.max_len.offset
        self.f1, self.f2 = f1, f2
        self.nt1, self.nt2, self.smem1, self.smem2 = nt1, nt2, smem1, smem2
        self.C, self.N, self.HV = v.chunk, call.N, call.HV
        self.T = call.T
        self.recur_grid = (v.v // v.block_v, call.N, call.HV * call.twins)
        self.recur_name = "kda_recur_twins" if call.twins > 1 else "kda_recur"
        self.varlen = call.cu_seqlens is not None
        self.ws_bytes = ws_bytes
        self.device = call.q.device
        self.lock = _device_lock(idx)
        self.launch_kernel = driver().cuLaunchKernel
        self.use_shim(True)
        self.raw_stream = raw_stream_query()
        self.capturing = capture_query()
        self.streams: dict[int, object] = {}  # raw handle -> CUstream
        # raw handle -> (prep's arguments (None: varlen, its grid is per call), recur's arguments)
        self.stream_args: dict[int, tuple] = {}
        self.arenas = _arenas(idx)

    def use_shim(self, on: bool) -> None:
        """Launch through the launch shim (where on, KDAGEN_LAUNCH_SHIM allows it and it builds and
        loads) or through cuda-bindings; launch_path says which. Benchmarks switch a bound launch
        both ways in one process."""
        shim, how = shim_state() if on else (None, "switched off")
        self.shim = shim
        self.shim_call = shim.launch_pair if shim is not None else None
        # raw handle -> (address of its Pair, prep grid x (None: varlen, per call), the Pair)
        self.shim_args: dict[int, tuple] | None = {} if shim is not None else None
        self.launch_path = f"kda_prep + kda_recur through {how}" if shim is not None else \
            f"cuLaunchKernel through {driver_binding()} (launch shim not used: {how})"
        self.last_failure = ""  # the latest launch the driver refused (the general path then ran)

    def _shim_args_for(self, raw: int) -> tuple:
        """The shim's prepared Pair on the stream `raw` (made once per stream)."""
        pair = launch_shim.Pair()
        for k, f, grid, nt, smem in ((pair.k[0], self.f1, (0, self.N, self.HV), self.nt1, self.smem1),
                                     (pair.k[1], self.f2, self.recur_grid, self.nt2, self.smem2)):
            k.func, k.stream, k.args = int(f), raw, self.argv_addr
            k.grid[:], k.block[:], k.smem = grid, (nt, 1, 1), smem
        pair.failed = -1
        prep_x = None if self.varlen else -(-self.T // self.C) if self.T > 0 else 0
        args = self.shim_args[raw] = (ctypes.c_void_p(ctypes.addressof(pair)), prep_x, pair)
        return args

    def _args_for(self, raw: int) -> tuple:
        """The driver calls' argument tuples on the stream `raw` (made once per stream)."""
        stream = self.streams.get(raw)
        if stream is None:
            stream = self.streams[raw] = driver().CUstream(raw)
        argv = self.argv_addr
        # prep: None for varlen (its grid follows each call's longest sequence), () for T = 0 (no chunks)
        prep = None if self.varlen else () if self.T <= 0 else (self.f1, -(-self.T // self.C), self.N, self.HV,
                                                                self.nt1, 1, 1, self.smem1, stream, argv, 0)
        gx, gy, gz = self.recur_grid
        args = self.stream_args[raw] = (prep, (self.f2, gx, gy, gz, self.nt2, 1, 1, self.smem2, stream, argv, 0))
        return args

    takes_slots = True  # launch(..., pool_slots=): a state pool's slots (KdaParams h0_idx, ht_idx)

    def launch(self, q, k, v, g, beta, o, A_log, dt_bias, cu_seqlens, h0, ht, hc, chunk_offsets, ws,
               max_len: int, pool_slots: int = 0) -> bool:
        """Launch one call of the bound signature (the tensors of a KdaCall, positionally); False
        when it must take the general path instead (unaligned data, a concurrent call, another
        current context): nothing was launched then, or only the prep kernel, which the general
        path simply runs again. pool_slots: the device address of a state pool's int32 slots (h0
        and ht are then the pool), or 0."""
        qp, kp, vp, gp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), o.data_ptr()
        if (qp | kp | vp | gp | op) & 15:
            return False
        if ws is not None:
            wp = ws.data_ptr()
            if wp % _WS_ALIGN or ws.nbytes < self.ws_bytes:
                return False  # the general path carves (and checks) a caller workspace
        lock = self.lock
        if not lock.acquire(False):  # not blocking
            return False
        try:
            raw = self.raw_stream(self.idx)
            if ws is None:
                # the stream's arena (see _scratch); the legacy default stream (0) cannot capture
                arena = self.arenas.get(raw)
                if arena is not None and arena[2] >= self.ws_bytes and not (raw and self.capturing()):
                    ws, wp = arena[0], arena[1]  # ws held until both launches are queued
                else:
                    ws, wp = self._scratch(raw)
            _PACK_PTRS(self.params, self.ptr_offset, qp, kp, vp, gp, beta.data_ptr(), op,
                       0 if A_log is None else A_log.data_ptr(), 0 if dt_bias is None else dt_bias.data_ptr(),
                       0 if cu_seqlens is None else cu_seqlens.data_ptr(), 0 if h0 is None else h0.data_ptr(),
                       0 if ht is None else ht.data_ptr(), 0 if hc is None else hc.data_ptr(),
                       0 if hc is None else chunk_offsets.data_ptr(), wp)
            if pool_slots != self.pool_slots:
                self.params.h0_idx = self.params.ht_idx = self.pool_slots = pool_slots
            shim_args = self.shim_args
            if shim_args is not None:
                addr, prep_x, pair = shim_args.get(raw) or self._shim_args_for(raw)
                if prep_x is None:  # varlen: the grid follows this call's longest sequence
                    _PACK_INT(self.params, self.max_len_offset, max_len)
                    prep_x = -(-max_len // self.C) if max_len > 0 else 0
                err = self.shim_call(addr, prep_x)
                if err:
                    which, pair.failed = pair.failed, -1
                    k = pair.k[which]
                    return self._declined(which, (prep_x if which == 0 else k.grid[0], k.grid[1], k.grid[2]), err,
                                          tuple(k.block), k.smem)
                return True
            prep, recur = self.stream_args.get(raw) or self._args_for(raw)
            launch_kernel = self.launch_kernel
            if prep is None:  # varlen: the grid follows this call's longest sequence
                _PACK_INT(self.params, self.max_len_offset, max_len)
                gx = -(-max_len // self.C)
                if max_len > 0 and (err := launch_kernel(self.f1, gx, self.N, self.HV, self.nt1, 1, 1, self.smem1,
                                                         recur[8], self.argv_addr, 0)[0]):
                    return self._declined(0, (gx, self.N, self.HV), err)
            elif prep and (err := launch_kernel(*prep)[0]):
                return self._declined(0, prep[1:4], err)
            if err := launch_kernel(*recur)[0]:
                return self._declined(1, self.recur_grid, err)
            return True
        finally:
            lock.release()

    def _declined(self, which: int, grid: tuple, err, block: tuple | None = None, smem: int | None = None) -> bool:
        """A launch the driver refused (`which`: 0 kda_prep, 1 the recurrence): said in last_failure
        (and the debug log) in the general launch's words; False, so the general path runs the
        call (and raises if it fails too). The shim passes the refused launch's own block and
        shared memory (its Pair holds them)."""
        name, nt, smem_ = ("kda_prep", self.nt1, self.smem1) if which == 0 else (self.recur_name, self.nt2, self.smem2)
        block = block or (nt, 1, 1)
        smem = smem_ if smem is None else smem
        self.last_failure = (f"cuLaunchKernel({name}, grid={tuple(int(x) for x in grid)}, block={block}, "
                             f"smem={smem}) failed: {cu_result_name(err)} ({self.launch_path})")
        log.debug("kdagen: %s: the bound launch declined: %s", self.launcher.variant.name, self.last_failure)
        return False

    # Scratch per (device, stream), shared by every bound launch: each call writes it (kda_prep)
    # and reads it (kda_recur) on that stream under the device lock, so consecutive calls are
    # ordered by the stream and one buffer serves them all (one allocation less per call). Not
    # under CUDA graph capture (the graph keeps its own; the legacy default stream, handle 0,
    # cannot capture, so it is not asked), not above ARENA_MAX (long calls: noise).
    ARENA_MAX = 64 << 20
    _ARENAS: dict[int, dict[int, tuple[torch.Tensor, int, int]]] = {}  # device -> stream -> (buffer, address, bytes)

    @classmethod
    def drop_arenas(cls) -> None:
        """Let go of every stream's scratch arena (later calls allocate anew)."""
        with _LOCKS_GUARD:
            for arenas in cls._ARENAS.values():
                arenas.clear()

    def _scratch(self, raw_stream: int) -> tuple[torch.Tensor, int]:
        """This call's scratch and its address, where the stream's arena does not serve it (the
        caller holds the device lock)."""
        n = self.ws_bytes
        if n > self.ARENA_MAX or (raw_stream and self.capturing()):
            buf = torch.empty(n, dtype=torch.uint8, device=self.device)
            return buf, buf.data_ptr()
        arena = self.arenas.get(raw_stream)
        if arena is None or arena[2] < n:
            buf = torch.empty(n, dtype=torch.uint8, device=self.device)
            arena = self.arenas[raw_stream] = (buf, buf.data_ptr(), n)
        return arena[0], arena[1]


class Sm80SegmentedBound:
    """A time-segmented signature's launch (Sm80Launcher._launch_segmented), prepared once: per
    segment its parameter struct (length, strides, scalars) and grid, the recurrence's shared
    memory, the scratch layout, and the events, reused call after call (a stream's wait takes
    the event as last recorded when the wait is queued). A call writes each segment's 14 pointers
    (inputs and o advanced to the segment's first token) and queues prep s on the side stream,
    then recurrence s on torch's current stream after it, as the general path does. Declines
    (False: nothing launched, or only work the general path redoes from scratch) on unaligned
    data, a short caller workspace, a concurrent call, CUDA graph capture or a refused launch."""

    def __init__(self, launcher: Sm80Launcher, call: KdaCall, idx: int, params: KdaParams,
                 segs: list[tuple[int, int]], f1, f2, nt1: int, nt2: int, smem1: int, smem_r: int,
                 pieces: list[int]) -> None:
        v = launcher.variant
        self.launcher, self.idx, self.device = launcher, idx, call.q.device
        self.f1, self.f2, self.nt1, self.nt2, self.smem1, self.smem_r = f1, f2, nt1, nt2, smem1, smem_r
        self.N, self.HV, self.recur_x = call.N, call.HV, v.v // v.block_v
        strides = (call.q_strides, call.k_strides, call.v_strides, call.g_strides, call.beta_strides, call.o_strides)
        sizes = [t.element_size() for t in (call.q, call.k, call.v, call.g, call.beta, call.o)]
        # per segment: (struct, its argv, prep grid x, byte offsets of q k v g beta o)
        self.segs = [(ps, (ctypes.c_void_p * 1)(ctypes.addressof(ps)), gx, off, row)
                     for (ps, gx, off), row in zip(_segment_structs(params, segs, strides, sizes, v.chunk),
                                                   _segment_rows(call, segs, v.chunk))]
        # scratch: the carried states, then each segment's workspace (Sm80Launcher._workspace_pieces)
        self.carry_bytes = v.v * v.k * 4 * call.N * call.HV
        self.pieces = pieces
        self.ws_at = [sum(pieces[:1 + i]) for i in range(len(segs))]
        self.ws_bytes = sum(pieces)
        self.side = launcher._side_stream(self.device)
        self.side_cu = driver().CUstream(self.side.cuda_stream)
        self.start = torch.cuda.Event()
        self.done = [torch.cuda.Event() for _ in segs]
        self.lock = _device_lock(idx)
        self.launch_kernel = driver().cuLaunchKernel
        self.capturing = capture_query()
        self.streams: dict[int, object] = {}  # raw handle -> CUstream
        self.launch_path = f"{len(segs)} time segments through cuLaunchKernel ({driver_binding()})"
        self.last_failure = ""

    def launch(self, q, k, v, g, beta, o, A_log, dt_bias, cu_seqlens, h0, ht, hc, chunk_offsets, ws,
               max_len: int) -> bool:
        """Launch one call of the bound signature (a KdaCall's tensors, positionally); False when the
        general path must run it instead."""
        base = (q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), o.data_ptr())
        if (base[0] | base[1] | base[2] | base[3] | base[5]) & 15:
            return False
        if ws is not None:
            if ws.nbytes < _workspace_need(ws, self.pieces):
                return False  # the general path runs it in one piece, or refuses it by name
            wp = ws.data_ptr() + (-ws.data_ptr()) % _WS_ALIGN
        if not self.lock.acquire(False):
            return False
        try:
            main = torch.cuda.current_stream(self.device)
            if main.cuda_stream and self.capturing():
                return False  # the general path: a graph keeps its own scratch and events
            if ws is None:
                # the caller's stream orders every later user of this memory after the last
                # recurrence, which waited for every prep (as in the general path)
                ws = torch.empty(self.ws_bytes, dtype=torch.uint8, device=self.device)
                wp = ws.data_ptr()
            main_cu = self.streams.get(main.cuda_stream)
            if main_cu is None:
                main_cu = self.streams[main.cuda_stream] = driver().CUstream(main.cuda_stream)
            A = 0 if A_log is None else A_log.data_ptr()
            dt = 0 if dt_bias is None else dt_bias.data_ptr()
            hp, cp = (0, 0) if hc is None else (hc.data_ptr(), chunk_offsets.data_ptr())
            last = len(self.segs) - 1
            self.start.record(main)
            self.side.wait_event(self.start)
            for i, (ps, argv, gx, off, row) in enumerate(self.segs):
                _pack_segment(ps, base, off, A, dt,
                              (0 if h0 is None else h0.data_ptr()) if i == 0 else wp + (i - 1) * self.carry_bytes,
                              (0 if ht is None else ht.data_ptr()) if i == last else wp + i * self.carry_bytes,
                              wp + self.ws_at[i], hp and hp + row, cp)
                if err := self.launch_kernel(self.f1, gx, self.N, self.HV, self.nt1, 1, 1, self.smem1, self.side_cu,
                                             ctypes.addressof(argv), 0)[0]:
                    return self._declined("kda_prep", (gx, self.N, self.HV), self.nt1, self.smem1, err)
                self.done[i].record(self.side)
                main.wait_event(self.done[i])
                if err := self.launch_kernel(self.f2, self.recur_x, self.N, self.HV, self.nt2, 1, 1, self.smem_r,
                                             main_cu, ctypes.addressof(argv), 0)[0]:
                    return self._declined("kda_recur", (self.recur_x, self.N, self.HV), self.nt2, self.smem_r, err)
            return True
        finally:
            self.lock.release()

    def _declined(self, name: str, grid: tuple, nt: int, smem: int, err) -> bool:
        """A refused launch: said in last_failure; False, so the general path runs the whole call
        again (what ran wrote only scratch, o and carried states, all rewritten; the final state is
        written by the last recurrence only, after every other launch was accepted)."""
        self.last_failure = (f"cuLaunchKernel({name}, grid={grid}, block=({nt}, 1, 1), smem={smem}) failed: "
                             f"{cu_result_name(err)} ({self.launch_path})")
        log.debug("kdagen: %s: the bound launch declined: %s", self.launcher.variant.name, self.last_failure)
        return False


def _arenas(idx: int) -> dict[int, tuple[torch.Tensor, int, int]]:
    with _LOCKS_GUARD:
        return Sm80Bound._ARENAS.setdefault(idx, {})
