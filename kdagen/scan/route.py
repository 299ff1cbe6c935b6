"""Whether kda_prefill serves a call signature as the segment scan instead of one piece, and the
plan that does.

One piece runs each (sequence, value head, V block) as one serial chain of chunk steps: a long
sequence with few heads keeps a few dozen SMs busy and leaves the rest idle. The scan in mode
"correct" (kdagen.scan.engine) cuts it into segments that run side by side and adds each
segment's entering state to o afterwards. Routed against one piece on the H200 (session 37):
B1 T131072 H4 0.51x, T262144 H4 0.40x, B2 T65536 H4 0.83x, T65536 H8 0.89x. Its o is step 1's o
plus o_A S_in^T with o_A in the input dtype; against float64 that moved o's error by at most
0.03e-3 (4.24e-3 against 4.22e-3 with a gate that barely decays).

The choice is made once per signature (the runtime caches the plan) by the scan's planner; a
signature is offered to it only where the planner's cost model applies and the scan returns what
one piece would: sm80 one piece at the call's own head dims, bf16, K == V, no chunk states but
sparse ones (return_chunk_states=m with at least CS_MIN_SPACING tokens between them:
checkpoints), no forced variant, no workspace, host-readable offsets (not assume_valid). Varlen
with several sequences (an engine's packed batch) has lengths that change per call: where the
planner would cut one sequence of all T tokens, each call with a sequence of MIN_TOKENS or more
is planned from its offsets (the planner caches by offsets, and a model's layers repeat them); the
rest run in one piece. Offsets passed only on the device are read once per call, as one piece
reads them anyway. KDAGEN_SCAN=0 turns it off; a call under CUDA graph capture, or made by the
scan itself, always runs one piece.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any, Optional

import torch

from .. import env

log = logging.getLogger("kdagen")

# Tokens per sequence below which a signature is not offered to the planner: it never split
# shorter sequences on the H200 (T16384 H2-H64, both cost sets), and planning costs host time.
MIN_TOKENS = 16384
MODE = "correct"
# Chunk states this far apart (tokens) or more ride along: segments are cut on their grid and the
# correct step adds S_in A_c to a few rows. Denser ones (every chunk: T / 16 rows of K x V) would
# add work the planner does not cost. On an H100 (session 47) routing paid at every 512 tokens or
# more at T131072 H4 and T65536 H8; every 256 and 64 lost at H8.
CS_MIN_SPACING = 1024

_STATE = threading.local()  # .depth: > 0 while this thread runs a routed call


def _inside() -> bool:
    return getattr(_STATE, "depth", 0) > 0


# segments_for's answer for varlen with several sequences: planned on each call from its offsets
PER_CALL: tuple[int, ...] = ()


def offered(info: Any, target: str, kw: dict) -> bool:
    """Whether a signature (CallInfo `info`, its one-piece variant's `target`, kda_prefill
    keywords `kw`) is one the planner may route: see the module's docstring for why each."""
    spacing = _cs_spacing(kw)
    return (not _inside() and target == "sm80" and info.device.type == "cuda" and info.dtype == "bf16"
            and info.K == info.V and info.N >= 1 and info.T >= MIN_TOKENS
            and kw.get("variant") is None and not env.force_variant() and kw.get("workspace") is None
            and (spacing is None or spacing >= CS_MIN_SPACING) and not kw.get("assume_valid"))


def _cs_spacing(kw: dict) -> Optional[int]:
    """Tokens between the chunk states a call keeps (None: it keeps none)."""
    from ..inputs import kept_stride

    m = kept_stride(kw.get("return_chunk_states", False), kw.get("chunk_states"))
    return m * (kw.get("chunk_size") or 16) if m else None  # chunk_size comes with chunk states


def segments_for(plan: Any, kw: dict) -> Optional[tuple[int, ...]]:
    """The planner's segments per sequence for the signature of `plan` (a runtime Plan) called
    with kda_prefill keywords `kw`; None where the signature is not offered or the planner keeps
    it whole."""
    from ..runtime import Plan
    from .engine import planned_segments

    info = plan.info
    if type(plan) is not Plan or not offered(info, plan.variant.target, kw):
        return None
    align = align_of(kw)
    if info.varlen and info.N > 1:
        # the longest any call of the signature can have: one sequence of all T tokens; where the
        # planner keeps even that whole, no call is worth planning
        probe = planned_segments(replace(info, N=1, max_len=info.T, cu_seqlens_host=None), [0, info.T], mode=MODE,
                                 align=align)
        return PER_CALL if max(probe, default=1) > 1 else None
    cu = [0, info.T] if info.varlen else [i * info.T for i in range(info.B + 1)]
    segs = planned_segments(info, cu, mode=MODE, align=align)
    return tuple(segs) if max(segs, default=1) > 1 else None


def call_segments(info: Any, kw: dict) -> Optional[tuple[int, ...]]:
    """The segments a call of a PER_CALL signature runs at (its offsets: kw's cu_seqlens_cpu, else
    read from cu_seqlens), or None where it runs in one piece: no sequence of MIN_TOKENS, or the
    planner keeps it whole (what ScanRoute's call and scan_prefill(segments=None) decide)."""
    from .engine import planned_segments

    cu_cpu = host_offsets(kw["cu_seqlens"], kw.get("cu_seqlens_cpu"))
    if longest(cu_cpu) < MIN_TOKENS:
        return None
    segs = planned_segments(info, cu_cpu.tolist(), mode=MODE, align=align_of(kw))
    return tuple(segs) if max(segs, default=1) > 1 else None


def align_of(kw: dict) -> int:
    """The grid the scan cuts a call's sequences on: its kept chunk states' spacing, else its chunk."""
    return _cs_spacing(kw) or kw.get("chunk_size") or 64


def host_offsets(cu: torch.Tensor, cu_cpu: Optional[torch.Tensor]) -> torch.Tensor:
    """The call's offsets on the host: cu_seqlens_cpu, else one read of cu_seqlens (a device sync,
    which one piece makes as well to check them and size its grid)."""
    return cu_cpu if cu_cpu is not None else cu.cpu()


def longest(cu_cpu: torch.Tensor) -> int:
    """The longest sequence of host offsets."""
    host = cu_cpu.tolist()
    return max((b - a for a, b in zip(host, host[1:])), default=0)


# kda_prefill's keyword flags the routed call passes on (the rest are the call's tensors, or
# settings segments_for only offers at their defaults)
_PASSED = ("scale", "lower_bound", "gate", "output_final_state", "layout", "state_layout", "state_dtype",
           "use_qk_l2norm", "allow_neg_eigval", "chunk_size", "beta_is_logit", "return_chunk_states")


class ScanRoute:
    """A signature the scan serves: calling it runs kdagen.scan.engine.scan_prefill at the
    planned segments; `inner` (the one-piece plan) serves it where the scan must not run."""

    def __init__(self, inner: Any, segments: tuple[int, ...], kw: dict) -> None:
        self.inner, self.segments = inner, segments
        self.entry, self.variant, self.info = inner.entry, inner.variant, inner.info
        self.flags = {n: kw[n] for n in _PASSED}
        self.run = self.__call__
        self.guard, self.guard_builds = None, 0  # what the runtime's fast path expects of a plan
        i = self.info
        log.info("kdagen: B=%d T=%d H=%d HV=%d runs as the scan (mode %s, %s) over %s; KDAGEN_SCAN=0 runs it in "
                 "one piece", i.B, i.T, i.H, i.HV, MODE,
                 f"{max(segments)} segments per sequence" if segments else
                 f"planned per call with a sequence of {MIN_TOKENS} tokens or more", inner.entry.name)

    @staticmethod
    def label(segments: tuple[int, ...]) -> str:
        return f"scan {MODE} x{max(segments)}" if segments else f"scan {MODE} per call"

    def __call__(self, q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, out, fs, cs, ws):
        per_call = not self.segments
        if _inside() or not env.scan_route() or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            return self.inner.run(q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, out, fs, cs, ws)
        if per_call:
            cu_cpu = host_offsets(cu, cu_cpu)  # passed on: read once, by whichever runs the call
            if longest(cu_cpu) < MIN_TOKENS:
                return self.inner.run(q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, out, fs, cs, ws)
        from .engine import scan_prefill

        _STATE.depth = getattr(_STATE, "depth", 0) + 1
        try:
            # per call: segments=None asks the planner about these offsets (it may keep them whole)
            return scan_prefill(q, k, v, g, beta, segments=None if per_call else self.segments, mode=MODE,
                                A_log=A_log, dt_bias=dt_bias,
                                initial_state=h0, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, out=out, final_state=fs,
                                chunk_states=cs, **self.flags)
        finally:
            _STATE.depth -= 1
