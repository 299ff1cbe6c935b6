"""The three-step scan composed of kdagen.kda_prefill calls (any target's kernels).

Segments become varlen sequences, so today's kernels run every step:

1. Maps: two runs over all segments, both on the caller's tensors. B starts from zero (or from
   the sequence's initial state for its first segment): its final state is the segment's
   from-zero state B. A reads v as zero and starts from the identity: the recurrence is linear
   in the state then, so its final state is the segment's transition A (K = V). With A's o, o
   itself is affine in the entering state: o = o_B + o_A S_in^T. Where the variant's launcher
   runs twins (kdagen.runtime.kda_prefill_twins: sm80), both runs share one prep; elsewhere they
   are two calls, A's v a stride-0 zero view (nothing materialised).
2. Chain: S_in of every segment from the sequence's initial state (kdagen.scan.chain).
3. Correct (mode "correct", the default): o = o_B + o_A S_in^T from step 1's outputs with no rerun
   (o_A is rounded to the input dtype; on the H200, bf16, that moved o's error against float64 by
   0.02-0.03e-3, benchmarks/NOTES.md session 37); or, mode "rerun", one call over all segments
   from their true entering states (o, chunk states, final states), slower where it runs at all.

States between the steps are fp32 [*, HV, V, K]; the caller's layouts and dtypes are converted at
the edges. Dedicated kernels (step 1 without o and with the prep shared with step 3) replace the
calls without changing these pieces: see kdagen/scan/planner.py for the costs they target.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from ..errors import KdaInputError
from ..inputs import CallInfo, check_call, chunk_stride
from .chain import chain_states
from .correct import correct_cs_fits, correct_cs_triton, correct_o_fits, correct_o_triton
from .layout import SegmentLayout, device_ints, split
from .maps import ieee_fp32
from .planner import ScanLaunch, plan_segments

__all__ = ["Packed", "validate", "pack", "scan_prefill", "maps_step", "rerun_step", "correct_step",
           "one_piece_v_blocks", "scan_launch", "planned_segments"]

Prefill = Callable[..., Any]

# kda_prefill keywords that pass through unchanged to every call the scan makes.
_PASS = ("scale", "lower_bound", "gate", "use_qk_l2norm", "allow_neg_eigval", "chunk_size", "variant",
         "beta_is_logit")


def _default_prefill() -> Prefill:
    from ..runtime import kda_prefill

    return kda_prefill


def _twins_of(prefill: Prefill) -> Optional[Callable[..., Any]]:
    """The runtime's twin launch where `prefill` is the runtime's kda_prefill (a caller's own
    prefill gets the two calls)."""
    from ..runtime import kda_prefill, kda_prefill_twins

    return kda_prefill_twins if prefill is kda_prefill else None


@dataclass
class Packed:
    """A call's inputs as the scan's calls take them: one packed BSND row, fp32 [N, HV, V, K]
    states, host offsets."""

    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    A_log: Optional[Tensor]
    dt_bias: Optional[Tensor]
    h0: Tensor  # [N, HV, V, K] fp32
    cu: list[int]  # sequences' packed offsets
    B: int
    T: int
    HV: int
    K: int
    layout: str  # the caller's
    state_layout: str
    state_dtype: torch.dtype  # of the caller's states
    kw: dict  # _PASS keywords
    info: CallInfo  # the caller's call, as validated
    cs_stride: int = 1  # chunk states kept: every cs_stride-th chunk's (return_chunk_states=m)

    def call(self, prefill: Prefill, lay: SegmentLayout, **kw) -> Any:
        if lay.num_segments == 1 and lay.bounds[1] > 0:  # one segment over the packed row: the B = 1 call, no offsets
            cu_dev = cu_cpu = None
        else:
            cu_cpu, cu_dev = lay.bounds_tensor(), lay.bounds_tensor(self.q.device)
        args = {n: kw.pop(n) for n in ("q", "k", "v", "g", "beta") if n in kw}
        q, k, v, g, beta = (args.get(n, getattr(self, n)) for n in ("q", "k", "v", "g", "beta"))
        base = dict(self.kw, A_log=self.A_log, dt_bias=self.dt_bias, cu_seqlens=cu_dev, cu_seqlens_cpu=cu_cpu,
                    layout="BSND", state_layout="VK")
        base.update(kw)
        return prefill(q, k, v, g, beta, **base)


def validate(q, k, v, g, beta, *, A_log=None, dt_bias=None, initial_state=None, cu_seqlens=None,
             cu_seqlens_cpu=None, layout="BSND", state_layout="VK", state_dtype=None, output_final_state=False,
             return_chunk_states=False, final_state=None, chunk_states=None, assume_valid=False, **kw
             ) -> tuple[CallInfo, list[int]]:
    """A kda_prefill call's own checks and messages, and the sequences' packed offsets (host)."""
    info = check_call(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=kw.get("scale"),
                      lower_bound=kw.get("lower_bound", -5.0), gate=kw.get("gate"), initial_state=initial_state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                      layout=layout, state_layout=state_layout, state_dtype=state_dtype,
                      chunk_size=kw.get("chunk_size"), return_chunk_states=return_chunk_states,
                      final_state=final_state, chunk_states=chunk_states, assume_valid=assume_valid)
    if info.K != info.V:
        raise KdaInputError(f"v: the scan carries each segment's K x K transition as the state of a run with V "
                            f"value columns, so it needs V == K; found K={info.K}, V={info.V}")
    if info.varlen:
        if info.cu_seqlens_host is None:
            raise KdaInputError("cu_seqlens: the scan cuts sequences on the host; pass cu_seqlens_cpu (assume_valid "
                                "without host offsets cannot be split)")
        cu = [int(x) for x in info.cu_seqlens_host]
    else:
        cu = [i * info.T for i in range(info.B + 1)]
    return info, cu


def pack(q, k, v, g, beta, *, A_log=None, dt_bias=None, initial_state=None, layout="BSND", state_layout="VK",
         state_dtype=None, final_state=None, chunk_states=None, checked=None, **kw) -> Packed:
    """Validate a kda_prefill call (unless `checked` holds validate's result) and pack its inputs."""
    info, cu = checked or validate(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                                   layout=layout, state_layout=state_layout, state_dtype=state_dtype,
                                   final_state=final_state, chunk_states=chunk_states, **kw)
    bsnd = info.layout == "bsnd"
    B, T, HV, K = info.B, info.T, info.HV, info.K

    def tok(x: Tensor) -> Tensor:  # [B, T, heads, D] / [B, heads, T, D] -> [1, B*T, heads, D]
        x = x if bsnd else x.transpose(1, 2)
        return x.reshape(1, B * T, *x.shape[2:])

    beta_p = (beta if bsnd else beta.transpose(1, 2)).reshape(1, B * T, HV)
    if initial_state is None:
        h0 = torch.zeros(info.N, HV, K, K, dtype=torch.float32, device=q.device)
    else:
        h0 = initial_state if state_layout == "VK" else initial_state.transpose(-1, -2)
        h0 = h0.to(torch.float32).contiguous()
    st_dtype = next((t.dtype for t in (initial_state, final_state, chunk_states) if t is not None),
                    state_dtype or torch.float32)
    passed = {n: kw[n] for n in _PASS if n in kw}
    return Packed(tok(q), tok(k), tok(v), tok(g), beta_p, A_log, dt_bias, h0, cu, B, T, HV, K, info.layout,
                  state_layout, st_dtype, passed, info)


_EYES: dict[tuple[int, torch.device, int], Tensor] = {}


def _identity(K: int, device: torch.device) -> Tensor:
    """fp32 K x K identity on `device`, made once per stream (read-only: the transition runs'
    start; per stream for the reason layout.device_ints gives)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    eye = _EYES.get((K, device, stream))
    if eye is None:
        eye = torch.eye(K, dtype=torch.float32, device=device)
        if not (eye.is_cuda and torch.cuda.is_current_stream_capturing()):  # a graph's memory is its own
            _EYES[(K, device, stream)] = eye
    return eye


def maps_step(P: Packed, lay: SegmentLayout, known: Sequence[bool], prefill: Prefill,
              outputs: bool = False) -> tuple[Tensor, Tensor, Optional[tuple[Tensor, Tensor]],
                                              Optional[tuple[Tensor, Tensor]]]:
    """Step 1: every segment's map (A [S, HV, K, K], B [S, HV, V, K], fp32). A sequence whose
    entering state is known (known[n]) starts its first segment from P.h0[n]: that segment's B is
    its true exit state and its A is returned as 0. With outputs: also step 1's o as (o_B, o_A),
    each [1, T, HV, V], and chunk states as (B_c, A_c) (P.kw chunk_size) for mode "correct".

    One launch with twin state heads where the runtime has it (the prep, 3.3 of each call's 6.1 ms
    at 512K tokens in 8 segments, 8 heads on the H200, runs once); else two calls, not one with
    doubled heads: the doubled heads' inputs (v with zero heads between, g and beta repeated)
    cost 4.1 of rank 1's 17.3 ms there (benchmarks/NOTES.md, session 29)."""
    HV, K, dev = P.HV, P.K, P.q.device
    S = lay.num_segments
    h2 = torch.empty(S, 2, HV, K, K, dtype=torch.float32, device=dev)  # B's heads, then A's
    h2[:, 1].copy_(_identity(K, dev))
    h2[:, 0].zero_()
    seqs = [n for n in range(lay.num_sequences) if known[n]]
    # Every sequence known and cut alike (the one-GPU scan's usual call): its first segments are
    # every c-th, a strided view, with no index to copy to the device.
    every = lay.equal_counts if len(seqs) == lay.num_sequences else 0
    at = None
    if every:
        h2[::every, 0].copy_(P.h0)
    elif seqs:
        at = device_ints([lay.first[n] for n in seqs], dev, torch.long)
        h2[at, 0] = P.h0[device_ints(seqs, dev, torch.long)]
    h2 = h2.view(S, 2 * HV, K, K)
    want_cs = outputs and P.kw.get("chunk_size") is not None
    twins = _twins_of(prefill)
    cs_arg = P.cs_stride if want_cs else False
    res = P.call(twins, lay, initial_state=h2, return_chunk_states=cs_arg) if twins is not None else None
    if res is not None:  # heads [:HV] are B's run, [HV:] A's
        resB = [x[:, :, :HV] if i == 0 else x[:, :HV] for i, x in enumerate(res)]
        resA = [x[:, :, HV:] if i == 0 else x[:, HV:] for i, x in enumerate(res)]
    else:
        v0 = P.v.new_zeros(1, 1, 1, K).expand(P.v.shape)  # v = 0 for the transition run, read from one row
        resB = P.call(prefill, lay, initial_state=h2[:, :HV].contiguous(), output_final_state=True,
                      return_chunk_states=cs_arg)
        resA = P.call(prefill, lay, v=v0, initial_state=h2[:, HV:].contiguous(), output_final_state=True,
                      return_chunk_states=cs_arg)
    Bm, Am = resB[1], resA[1]
    if every:
        Am[::every].zero_()
    elif at is not None:
        Am.index_fill_(0, at, 0.0)  # Am[at] = 0.0 copies the scalar from the host: a sync (profiled)
    o = (resB[0], resA[0]) if outputs else None
    cs = (resB[2], resA[2]) if want_cs else None
    return Am, Bm, o, cs


def rerun_step(P: Packed, lay: SegmentLayout, S_in: Tensor, prefill: Prefill, chunk_states: bool
               ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """Step 3: every segment from its true entering state S_in [S, HV, V, K] (fp32). Returns
    (o [1, T, HV, V], each sequence's final state [N, HV, V, K] fp32, chunk states or None)."""
    res = P.call(prefill, lay, initial_state=S_in.contiguous(), output_final_state=True,
                 return_chunk_states=P.cs_stride if chunk_states else False)
    last = device_ints(lay.last, S_in.device, torch.long)
    return res[0], res[1][last], (res[2] if chunk_states else None)


def correct_step(P: Packed, lay: SegmentLayout, S_in: Tensor, known: Sequence[bool], o_pair: tuple[Tensor, Tensor],
                 cs_pair: Optional[tuple[Tensor, Tensor]]) -> tuple[Tensor, Optional[Tensor]]:
    """Step 3 without a rerun: o = o_B + o_A S_in^T and chunk states B_c + S_in A_c per segment
    (segments whose entering state was already applied in step 1 keep o_B, B_c). Each in one
    Triton pass where it runs (kdagen.scan.correct), else fp32 torch products."""
    C = P.kw.get("chunk_size")
    C = C * P.cs_stride if C else C  # a chunk-state row per C m tokens
    applied = {lay.first[n] for n in range(lay.num_sequences) if known[n]}
    oB, oA = o_pair
    o = None
    skip = [s in applied for s in range(lay.num_segments)]
    if correct_o_fits(oB, S_in):
        o = correct_o_triton(oB, oA, S_in, lay.bounds, skip)
    cs = cA = None  # cA: the torch form's A_c, where it corrects cs
    if cs_pair is not None and correct_cs_fits(cs_pair[0], cs_pair[1], S_in):
        cs = correct_cs_triton(cs_pair[0], cs_pair[1], S_in, _first_rows(lay, C), skip)
    elif cs_pair is not None:
        cs, cA = cs_pair[0].clone(), cs_pair[1]
    if o is not None and cA is None:
        return o, cs
    o_acc = oB.float().clone() if o is None else None
    with ieee_fp32():
        if o_acc is not None:
            for s, (a, b) in enumerate(zip(lay.bounds, lay.bounds[1:])):
                if s not in applied and b > a:
                    o_acc[0, a:b] += torch.einsum("thk,hvk->thv", oA[0, a:b].float(), S_in[s])
        if cA is not None:
            for s0, n, row, r in _equal_row_runs(lay, C, applied):
                # n consecutive segments of r rows each, their rows consecutive: one product
                # (an einsum per segment cost ~90 us of host time each on the H100, session 47)
                cs[row:row + n * r].view(n, r, *cs.shape[1:]).add_(torch.einsum(
                    "nhvk,nrhkj->nrhvj", S_in[s0:s0 + n], cA[row:row + n * r].view(n, r, *cA.shape[1:])))
    return (o if o is not None else o_acc.to(oB.dtype)), cs


def _first_rows(lay: SegmentLayout, C: int) -> list[int]:
    """Each segment's first chunk-state row, and the total (S + 1): a row per C tokens, begun or
    not, packed per segment in order."""
    rows = [0]
    for a, b in zip(lay.bounds, lay.bounds[1:]):
        rows.append(rows[-1] + -(-(b - a) // C))
    return rows


def _equal_row_runs(lay: SegmentLayout, C: int, applied: set[int]) -> list[tuple[int, int, int, int]]:
    """(first segment, count, first row, rows each) for every maximal run of consecutive segments
    whose entering state is still to apply (not in `applied`, not empty) and that have the same
    number of chunk-state rows (_first_rows)."""
    runs: list[list[int]] = []
    first = _first_rows(lay, C)
    for s in range(lay.num_segments):
        row, r = first[s], first[s + 1] - first[s]
        if s not in applied and r > 0:
            last = runs[-1] if runs else None
            if last is not None and last[0] + last[1] == s and last[3] == r:
                last[1] += 1
            else:
                runs.append([s, 1, row, r])
    return [tuple(x) for x in runs]


def _unpack(P: Packed, o: Tensor, final: Optional[Tensor], cs: Optional[Tensor], *, out, final_state,
            chunk_states_buf, want_final: bool, want_cs: bool):
    o = o.reshape(P.B, P.T, *o.shape[2:])
    if P.layout == "bnsd":
        o = o.transpose(1, 2)
    if out is not None:
        out.copy_(o)
        o = out
    else:
        o = o.contiguous()

    def st(x: Tensor) -> Tensor:
        x = x if P.state_layout == "VK" else x.transpose(-1, -2)
        return x.to(P.state_dtype).contiguous()

    fs = None
    if want_final:
        fs = st(final)
        if final_state is not None:
            final_state.copy_(fs)
            fs = final_state
    if want_cs:
        c = st(cs)
        if chunk_states_buf is not None:
            chunk_states_buf[: c.shape[0]].copy_(c)
            c = chunk_states_buf
        return o, fs, c
    return o, fs


def one_piece_v_blocks(info: CallInfo, variant: Optional[str] = None) -> int:
    """V-split blocks per head of the variant the one-piece call `info` would run (what the
    planner costs: block_v 16 at few heads doubles the blocks of block_v 32); V // 32 where the
    runtime would have to generate one. Never builds."""
    from ..runtime import selected_entry

    entry = selected_entry(info, variant)
    return max(1, info.V // (entry.variant.block_v if entry is not None else 32))


def scan_launch(info: CallInfo, lay: SegmentLayout, variant: Optional[str] = None) -> ScanLaunch | None | bool:
    """What the scan's calls over `lay` (kda_prefill calls on the packed row, fp32 states) would
    launch, asked of the runtime without generating or building anything: a ScanLaunch; None
    where that is not known here (not a GPU, variant not built); False where the variant has no
    recurrence launch the planner models (another target)."""
    from ..runtime import built_launcher

    if info.device.type != "cuda":
        return None
    whole = lay.num_segments == 1 and lay.bounds[1] > 0  # Packed.call's B = 1 call without offsets
    lens = [b - a for a, b in zip(lay.bounds, lay.bounds[1:])]
    sinfo = replace(info, layout="bsnd", B=1, T=lay.bounds[-1], N=lay.num_segments, varlen=not whole,
                    max_len=max(lens, default=0), cu_seqlens_host=None if whole else list(lay.bounds), state="fp32")
    got = built_launcher(sinfo, variant)
    if got is None:
        return None
    entry, la = got
    per_sm = getattr(la, "recur_blocks_per_sm", None)
    if per_sm is None:
        return False
    twins = per_sm(info.device, twins=True) if getattr(la, "supports_twins", False) else 0
    return ScanLaunch(entry.variant.block_v, per_sm(info.device), twins)


# segments=None's choice per call signature and mode: pricing asks the runtime about every
# candidate cut (a selection each), too slow to repeat on every call.
_PLANNED: dict[tuple, tuple[int, ...]] = {}


def planned_segments(info: CallInfo, cu: Sequence[int], *, mode: str, costs: str = "h200-engine",
                     variant: Optional[str] = None, ask_runtime: bool = True, align: Optional[int] = None,
                     **plan_kw: Any) -> tuple[int, ...]:
    """The planner's segments per sequence for the call `info` over offsets `cu` in scan mode
    `mode` (kdagen.scan.planner.plan_segments), with the one-piece and the scan's variants as
    the runtime would select them (ask_runtime; else the cost set's defaults)."""
    from .. import env
    from ..runtime import registry
    from ..select import _sm_count

    align = align or info.chunk_size or 64
    key = (tuple(cu), info.dtype, info.H, info.HV, info.K, info.V, info.gate, info.state, info.layout, info.varlen,
           info.chunk_size, info.device, mode, costs, variant, ask_runtime, align, tuple(sorted(plan_kw.items())),
           env.force_variant(), id(registry()))
    got = _PLANNED.get(key)
    if got is not None:
        return got
    lens = [b - a for a, b in zip(cu, cu[1:])]

    def launch_of(counts: tuple[int, ...]):
        return scan_launch(info, split(cu, list(counts), align), variant)

    plan = plan_segments(lens, heads=info.HV, v_blocks=one_piece_v_blocks(info, variant), head_v=info.V,
                         sm_count=_sm_count(info.device), chunk=info.chunk_size or 16, costs=costs, align=align,
                         mode=mode, varlen=info.varlen, launch_of=launch_of if ask_runtime else None, **plan_kw)
    if len(_PLANNED) >= 256:
        _PLANNED.clear()
    _PLANNED[key] = plan.segments
    return plan.segments


# Signatures segments=None leaves whole (_whole_key): such a call goes straight to the prefill,
# which validates it; validating and planning first cost ~60-150 us of host time on the H200's
# host, 1.2-1.9x a short call's time (benchmarks/NOTES.md, session 33). Only "whole" is kept: a
# key that missed something can cost speed, never a result.
_WHOLE: set = set()


def _whole_key(q, k, v, g, beta, mode: str, costs: str, prefill: Prefill, kw: dict) -> Optional[tuple]:
    """What segments=None's choice depends on, read off the raw arguments (shapes, dtypes,
    devices, host offsets, keywords; the forced variant and the registry); None where that is
    not cheap (device offsets only) or an argument is no tensor."""
    from .. import env
    from ..runtime import registry

    cu_cpu = kw.get("cu_seqlens_cpu")
    if kw.get("cu_seqlens") is not None and cu_cpu is None:
        return None
    try:
        rest = tuple((n, (x.shape, x.dtype, x.device) if isinstance(x, Tensor) else x) for n, x in sorted(kw.items())
                     if n != "cu_seqlens_cpu")
        key = (mode, costs, prefill, env.force_variant(), id(registry()),
               tuple((t.shape, t.dtype, t.device) for t in (q, k, v, g, beta)),
               None if cu_cpu is None else tuple(cu_cpu.tolist()), rest)
        hash(key)
    except (AttributeError, TypeError):
        return None
    return key


def scan_prefill(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                 segments: int | Sequence[int] | None = None, mode: str = "correct",
                 prefill: Optional[Prefill] = None, chain_impl: str = "auto", costs: str = "h200-engine",
                 **kw: Any):
    """kda_prefill (same arguments and results) through the three-step scan.

    segments: per sequence (or one count for all) how many segments to cut it into; None asks
    the planner (kdagen.scan.planner), which leaves the call whole where the scan does not pay.
    mode: "correct" (o corrected from step 1's outputs; kda_prefill's route and kdagen.cp use it) or
    "rerun" (step 3 reruns every segment). On the H200 (session 33) the planner's pick in "correct"
    ran B1 T1048576 H8 in 20.95 ms and T131072 H4 in 1.73, against 30.03 (left whole) and 2.54 in
    "rerun".
    prefill: the kda_prefill to compose (default kdagen.kda_prefill)."""
    if mode not in ("rerun", "correct"):
        raise KdaInputError(f"mode: expected 'rerun' or 'correct', found {mode!r}")
    prefill = prefill or _default_prefill()
    out, final_state, chunk_buf = kw.pop("out", None), kw.get("final_state"), kw.get("chunk_states")
    want_final = bool(kw.get("output_final_state")) or final_state is not None
    stride = max(1, chunk_stride(kw.get("return_chunk_states", False)))
    want_cs = bool(kw.get("return_chunk_states")) or chunk_buf is not None
    kw.setdefault("output_final_state", want_final)
    kw.setdefault("return_chunk_states", want_cs)
    whole_key = _whole_key(q, k, v, g, beta, mode, costs, prefill, kw) if segments is None else None
    if whole_key is not None and whole_key in _WHOLE:
        return prefill(q, k, v, g, beta, out=out, **kw)  # kda_prefill checks the call itself
    info, cu = validate(q, k, v, g, beta, **kw)
    # segments start on the chunk-state grid: each one's kept chunk states are the sequence's
    align = (kw.get("chunk_size") or 64) * stride
    if segments is None:
        segments = planned_segments(info, cu, mode=mode, costs=costs, variant=kw.get("variant"),
                                    ask_runtime=prefill is _default_prefill(), align=align)
        if max(segments, default=1) <= 1:  # the planner keeps the call whole: no layout to build
            if whole_key is not None:
                if len(_WHOLE) >= 256:
                    _WHOLE.clear()
                _WHOLE.add(whole_key)
            return prefill(q, k, v, g, beta, out=out, **kw)
    lay = split(cu, segments, align)
    if not lay.split_any:
        return prefill(q, k, v, g, beta, out=out, **kw)
    if kw.get("workspace") is not None:
        raise KdaInputError("workspace: the scan makes several calls with their own scratch; pass None")
    P = pack(q, k, v, g, beta, checked=(info, cu), **kw)
    P.cs_stride = stride

    known = [True] * lay.num_sequences
    A, B, o_pair, cs_pair = maps_step(P, lay, known, prefill, outputs=(mode == "correct"))
    S_in, final = chain_states(A, B, P.h0, lay.counts, impl=chain_impl)
    if mode == "rerun":
        o, final_r, cs = rerun_step(P, lay, S_in, prefill, want_cs)
        final = final_r
    else:
        o, cs = correct_step(P, lay, S_in, known, o_pair, cs_pair)
    return _unpack(P, o, final, cs, out=out, final_state=final_state, chunk_states_buf=chunk_buf,
                   want_final=want_final, want_cs=want_cs)
