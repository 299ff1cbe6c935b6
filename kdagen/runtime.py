"""kda_prefill: validate, select a variant, launch it, with a host fast path.

The first call of a signature (shapes, strides, dtypes, devices, flags) validates everything,
selects a variant (generating and building it when nothing built fits and that is allowed) and
caches a Plan: the chosen launcher, the strides and what to allocate. Later calls of the same
signature only look the plan up and launch; the only per-call host work left is the offsets of
varlen calls, read from `cu_seqlens_cpu` when given (never from the device when the caller
passes them or promises valid input with `assume_valid=True`).

The lookup: a call with the latest call's flags is first checked by torch's C++ tensor guard
against that call's signature (signature_guard.py); any other call builds the Python key of
every tensor's facts. A plan whose launcher bound the signature (sm80) runs it whole in
Plan._run_bound: outputs from the caching allocator's own entry, then the bound launch.
kda_prefill and torch.ops.kdagen.kda_prefill both enter at _prefill (positional).
"""

from __future__ import annotations

import itertools
import operator
import logging
from typing import Any, Optional

import torch

from . import checkpoints as ckpt
from . import env
from . import state_pool as pool_io
from .abi import KdaCall
from .dtypes import torch_dtype
from .errors import KdaInputError, NoVariantError
from .inputs import CallInfo, check_offsets, check_signature, chunk_stride
from .registry import Entry, Registry
from .scan import route as scan_route
from .scan.layout import device_ints
from .padding import PaddedPlan, at_dims, choose_covering, coverage_note, target_dims
from .select import GENERATE, TARGET_ORDER, Candidate, miss_message, preference, regime_key, rejection
from .signature_guard import make_check
from .targets.cuda_driver import capture_query
from .tuning import memo_key as tuning_memo_key

log = logging.getLogger("kdagen")

_REGISTRY: Optional[Registry] = None
_PLANS: dict[tuple, "Plan"] = {}
_PLAN_LIMIT = 4096  # signatures kept; an engine sees one per distinct token count
_LOGGED: set = set()
_NO_PLAN = (object(), None, None, None)  # _LAST with no latest plan: its flags equal no call's
_LAST: tuple = _NO_PLAN  # (flags, grad mode, guard, plan) of the latest call
# The same for the latest state pool call (flags, grad mode, guard, plan, N)
_POOL_LAST: tuple = _NO_PLAN
_GUARD_BUILDS = 8  # guards a plan gets at most
# Choices by what selection depends on (so a new token count with the same sequences and heads
# skips the candidate scan): functional key, device, N, HV, whether sequences average >= 512, and
# the tuning-file rules the call's regime matches.
_CHOICES: dict[tuple, str] = {}

def registry() -> Registry:
    """The process-wide registry (checkout's generated/ and the cache), read on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        env.configure_logging()
        _REGISTRY = Registry.load()
    return _REGISTRY


def reset() -> Registry:
    """Forget the registry, the cached plans and the logged choices, and read the environment
    (KDAGEN_*) again on the next call."""
    global _REGISTRY, _LAST, _POOL_LAST
    _REGISTRY = None
    _LAST = _POOL_LAST = _NO_PLAN
    _PLANS.clear()
    _LOGGED.clear()
    _CHOICES.clear()
    return registry()


reload_registry = reset


def _strides(t: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """(batch, time, head) element strides of a [B,T,H,...] / [B,H,T,...] tensor."""
    if layout == "bsnd":
        return t.stride(0), t.stride(1), t.stride(2)
    return t.stride(0), t.stride(2), t.stride(1)


def _contiguous_strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(tuple(shape)):
        out.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(out))


def _allocator(device: torch.device) -> tuple[Any, Any, Optional[Any], int]:
    """(empty, general, current, index): empty(shape, strides, dtype) gives an uninitialized
    tensor on `device` from the caching allocator the cheap way, the allocator entry
    torch.compile's generated code calls (torch.empty_like and torch.empty go through the
    dispatcher; measured 0.90 -> 0.56 us per CPU tensor). That entry allocates on the current
    CUDA device, so where `current` is not None, empty serves a call only while current() ==
    index (checked once per call, not per tensor); general (torch.empty_strided) serves the
    others, and every call where torch lacks the entry or it answers unlike torch.empty_strided."""
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    raw = getattr(guards, f"_empty_strided_{device.type}", None) if device.type in ("cpu", "cuda") else None

    def general(shape, strides, dtype):
        return torch.empty_strided(shape, strides, dtype=dtype, device=device)

    current, idx = None, -1
    if device.type == "cuda":
        current = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)  # the former skips a lazy-init check
        idx = device.index if device.index is not None else torch.cuda.current_device()
    try:
        t = raw((2, 3), (3, 1), torch.bfloat16) if raw is not None and (current is None or current() == idx) else None
        ok = t is not None and (t.device, t.shape, t.stride(), t.dtype) == (device, (2, 3), (3, 1), torch.bfloat16)
    except Exception:
        ok = False
    return (raw, general, current, idx) if ok else (general, general, None, -1)


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
    out: Optional[torch.Tensor] = None,
    final_state: Optional[torch.Tensor] = None,
    chunk_states: Optional[torch.Tensor] = None,
    workspace: Optional[torch.Tensor] = None,
    assume_valid: bool = False,
    cp_context: Optional[Any] = None,
    beta_is_logit: bool = True,
    state_pool: Optional[torch.Tensor] = None,
    state_indices: Optional[torch.Tensor] = None,
    checkpoint_every: Optional[int] = None,
    checkpoints: Optional[torch.Tensor] = None,
    checkpoint_offsets: Optional[torch.Tensor] = None,
) -> tuple[Optional[torch.Tensor], ...]:  # (o, final_state or None[, chunk_states][, checkpoints])
    """Kimi Delta Attention prefill.

    Layout "BSND": q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]
    ("BNSD" swaps T and the head axis). HV must be a multiple of H (GQA/GVA).
    Gate: bounded lower_bound*sigmoid(exp(A_log)*(g+dt_bias)) (default), unbounded
    -exp(A_log)*softplus(g+dt_bias) (lower_bound=None), or precomputed log-decay g
    (A_log=None); `gate` names one explicitly. beta is a logit (b = sigmoid(beta), x2 with
    allow_neg_eigval), or with beta_is_logit=False the coefficient b itself, used as given
    (fla's use_beta_sigmoid_in_kernel=False; allow_neg_eigval then changes nothing). Head dims
    K and V (which may differ) up to 256: sizes no variant has are zero-padded to larger ones a
    registered variant has, else to the next a target builds on demand (exact; see
    kdagen.padding).
    States are [N, HV, V, K] (state_layout "VK") or [N, HV, K, V] ("KV"), float32
    or bfloat16. cu_seqlens (int32/int64, B=1) packs N sequences along T.

    State pool (serving engines): state_pool [P, HV, V, K] (or [P, HV, K, V]) and
    state_indices [N] (int32/int64; -1: a padding sequence, whose slot is neither read nor
    written) replace initial_state/final_state: sequence n starts from state_pool[idx[n]]
    and its final state is written back there in place. Indices are checked (range, no
    duplicates) on the host unless assume_valid; pass them on the CPU to spare a device read.

    Checkpoints (prefix caching): checkpoint_every=n (a multiple of the chunk size, 16 or 64)
    writes the state after every n tokens of each sequence (n, 2n, ... <= its length) to
    `checkpoints` [rows, HV, *state] (allocated when None): sequence i's j-th at row
    checkpoint_offsets[i] + j (offsets [N + 1]; default: packed in order). Needs the lengths
    on the host (cu_seqlens_cpu, else a read of cu_seqlens). It runs the kernel the call
    without checkpoints runs (o is the same), which keeps one chunk state per checkpoint.

    Engine-owned memory: `out` (v's shape and dtype, unit last stride), `final_state`
    (implies output_final_state), `chunk_states` (implies return_chunk_states; at least the
    chunks' count of rows) and `workspace` (uint8, `workspace_size(...)` bytes) are written in
    place; without them, buffers come from torch's caching allocator on the current stream.

    Host offsets: cu_seqlens_cpu, the same offsets already on the host, spares the device read
    of cu_seqlens (a sync); assume_valid=True promises valid offsets (0, non-decreasing, T) and
    sizes grids for the longest possible sequence, so nothing is read at all (needed under CUDA
    graph capture, where the offsets may change between replays).

    Returns (o, final_state), or (o, final_state, chunk_states) when return_chunk_states: the
    state entering every chunk of `chunk_size` tokens, [NC_total, HV, *state], sequences'
    chunks concatenated (return_chunk_states=m > 1: every m-th chunk's, chunks 0, m, 2m, ... of
    each sequence, ceil(L / (m chunk_size)) rows a sequence); checkpoints, when asked, come last. `variant` (or
    KDAGEN_FORCE_VARIANT) forces a variant by name (it must still fit the call).

    cp_context (kdagen.cp.build_cp_context, or fla's FLACPContext): context-parallel across a
    torch.distributed group; q..beta are this rank's tokens and every rank calls
    (kdagen.cp.kda_prefill_cp says more). With a state pool (kdagen's contexts), state_indices
    name every global sequence's slot; each rank reads its starting sequences' states from its
    pool, and every rank's pool receives every final state (the context's pools="replicated")
    or its ending sequences' only ("local"; kdagen.cp.kda_prefill_cp_pool).
    Checkpoints with a context: buffer rows and offsets over the global sequences, kept like the
    pools; the slots must cut sequences on the kernel chunk's grid.
    """
    if beta_is_logit is not True and beta_is_logit is not False:
        raise KdaInputError(f"beta_is_logit: expected True or False, found {beta_is_logit!r}")
    if state_pool is not None and state_indices is not None and initial_state is None and final_state is None \
            and not output_final_state and chunk_states is None and checkpoint_every is None and checkpoints is None \
            and checkpoint_offsets is None and cp_context is None and not torch.compiler.is_compiling():
        # An engine's pool call of the latest pool call's signature (the flags with the final states asked, as
        # the pool's plan has them)
        o = _pool_fast(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu, out, workspace, state_pool,
                       state_indices, (scale, lower_bound, gate, True, layout, state_layout, state_dtype,
                                       use_qk_l2norm, allow_neg_eigval, chunk_size, return_chunk_states, variant,
                                       assume_valid, beta_is_logit))
        if o is not None:
            return o, None
    engine_io = state_pool is not None or state_indices is not None or checkpoint_every is not None \
        or checkpoints is not None or checkpoint_offsets is not None
    if engine_io and (state_pool is None) != (state_indices is None):
        raise KdaInputError("state_pool, state_indices: expected both (the pool and each sequence's slot) or "
                            "neither, found only " + ("state_pool" if state_indices is None else "state_indices"))
    if cp_context is not None:
        from .cp import kda_prefill_cp, kda_prefill_cp_pool

        kw = {n: val for n, val in locals().items() if n in _DEFAULTS}
        kw.update(checkpoint_every=checkpoint_every, checkpoints=checkpoints, checkpoint_offsets=checkpoint_offsets)
        if state_pool is not None:
            return kda_prefill_cp_pool(q, k, v, g, beta, cp_context=cp_context, state_pool=state_pool,
                                       state_indices=state_indices, **kw)
        return kda_prefill_cp(q, k, v, g, beta, cp_context=cp_context, **kw)
    if torch.compiler.is_compiling():
        from .ops import traced_prefill

        return traced_prefill(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, lower_bound=lower_bound,
                              gate=gate, initial_state=initial_state, output_final_state=output_final_state,
                              cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, layout=layout,
                              state_layout=state_layout, state_dtype=state_dtype, use_qk_l2norm=use_qk_l2norm,
                              allow_neg_eigval=allow_neg_eigval, chunk_size=chunk_size,
                              return_chunk_states=return_chunk_states, variant=variant, out=out,
                              final_state=final_state, chunk_states=chunk_states, workspace=workspace,
                              assume_valid=assume_valid, state_pool=state_pool, state_indices=state_indices,
                              checkpoint_every=checkpoint_every, checkpoints=checkpoints,
                              checkpoint_offsets=checkpoint_offsets, beta_is_logit=beta_is_logit)
    if engine_io:
        return _engine_call(q, k, v, g, beta, {n: val for n, val in locals().items() if n in _DEFAULTS},
                            state_pool, state_indices, checkpoint_every, checkpoints, checkpoint_offsets)
    return _prefill(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, out, final_state,
                    chunk_states, workspace,
                    (scale, lower_bound, gate, output_final_state, layout, state_layout, state_dtype, use_qk_l2norm,
                     allow_neg_eigval, chunk_size, return_chunk_states, variant, assume_valid, beta_is_logit))


# The order of _prefill's `flags`: kda_prefill's keyword arguments that are no tensors.
_FLAGS = ("scale", "lower_bound", "gate", "output_final_state", "layout", "state_layout", "state_dtype",
          "use_qk_l2norm", "allow_neg_eigval", "chunk_size", "return_chunk_states", "variant", "assume_valid",
          "beta_is_logit")


def _prefill(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, out, final_state,
             chunk_states, workspace, flags: tuple):
    """The positional entry kda_prefill and torch.ops.kdagen.kda_prefill share: the plan of the
    call's signature (validated, selected and cached on first sight), run on this call's tensors."""
    last = _LAST
    # The latest call's plan, where torch's C++ tensor guard says this call has its signature (the
    # flags and grad mode compared here): a model's layers repeat one signature.
    try:
        guarded = flags == last[0] and torch.is_grad_enabled() is last[1]
    except Exception:  # a flag that does not compare (a tensor for scale): the checks below name it
        guarded = False
    if guarded and last[2](q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, out,
                           final_state, chunk_states, workspace):
        return last[3].run(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, out,
                           final_state, chunk_states, workspace)
    plan, key = _plan_of(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, out,
                         final_state, chunk_states, workspace, flags)
    if key is not None:
        _remember(plan, flags, (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, out,
                                final_state, chunk_states, workspace), guarded and plan is last[3])
    return plan.run(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, out, final_state,
                    chunk_states, workspace)


def _plan_of(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, out, final_state,
             chunk_states, workspace, flags: tuple) -> tuple["Plan", Optional[tuple]]:
    """The plan of a call's signature (validated, selected and cached on first sight) and its
    cache key (None: an argument is no tensor, and the plan was made to raise)."""
    # The signature: everything validation and selection depend on but tensor values. Spelled
    # out (no helper per tensor): this line is most of the host cost of a call the guard above
    # does not serve. The autograd flag is one bool: a plan is never made (nor cached) for a
    # call it would be True.
    try:
        key = (flags, q.dtype, q.shape, q.stride(), q.device, k.dtype, k.shape, k.stride(), k.device,
               v.dtype, v.shape, v.stride(), v.device, g.dtype, g.shape, g.stride(), g.device,
               beta.dtype, beta.shape, beta.stride(), beta.device,
               None if A_log is None else (A_log.dtype, A_log.shape, A_log.stride(), A_log.device),
               None if dt_bias is None else (dt_bias.dtype, dt_bias.shape, dt_bias.stride(), dt_bias.device),
               None if initial_state is None else (initial_state.dtype, initial_state.shape, initial_state.stride(),
                                                   initial_state.device),
               None if cu_seqlens is None else (cu_seqlens.dtype, cu_seqlens.shape, cu_seqlens.stride(),
                                                cu_seqlens.device),
               None if cu_seqlens_cpu is None else (cu_seqlens_cpu.dtype, cu_seqlens_cpu.shape, cu_seqlens_cpu.device),
               None if out is None else (out.dtype, out.shape, out.stride(), out.device),
               None if final_state is None else (final_state.dtype, final_state.shape, final_state.stride(),
                                                 final_state.device),
               None if chunk_states is None else (chunk_states.dtype, chunk_states.shape, chunk_states.stride(),
                                                  chunk_states.device),
               None if workspace is None else (workspace.dtype, workspace.shape, workspace.stride(), workspace.device),
               torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or g.requires_grad
                                            or beta.requires_grad))
    except AttributeError:  # not a tensor: the checks below say which argument
        key = None
    plan = _PLANS.get(key)
    if plan is None:
        kw = dict(A_log=A_log, dt_bias=dt_bias, initial_state=initial_state, cu_seqlens=cu_seqlens,
                  cu_seqlens_cpu=cu_seqlens_cpu, out=out, final_state=final_state, chunk_states=chunk_states,
                  workspace=workspace, **dict(zip(_FLAGS, flags)))
        plan = _make_plan(q, k, v, g, beta, **kw)
        segments = scan_route.segments_for(plan, kw) if key is not None else None
        if segments is not None:  # a long call with few heads: the segment scan (kdagen/scan/route.py)
            plan = scan_route.ScanRoute(plan, segments, kw)
        if len(_PLANS) >= _PLAN_LIMIT:
            _PLANS.pop(next(iter(_PLANS)))
        if key is not None:
            _PLANS[key] = plan
    return plan, key


def kda_prefill_twins(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                      initial_state: torch.Tensor, A_log: Optional[torch.Tensor] = None,
                      dt_bias: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
                      cu_seqlens_cpu: Optional[torch.Tensor] = None, return_chunk_states: bool = False,
                      **kw: Any) -> Optional[tuple]:
    """Every sequence run twice over one kernel prep: as kda_prefill would from initial_state's
    heads [:HV], and from its heads [HV:] with v read as zero (the scan's transition maps,
    kdagen.scan.engine.maps_step). initial_state: fp32 [N, 2 HV, V, K] ("VK"), contiguous.

    Returns (o [.., 2 HV, V] in v's layout, final states [N, 2 HV, V, K], and with
    return_chunk_states the chunk states [rows, 2 HV, V, K]): heads HV + h are head h's run with
    v = 0. None where the call's variant has no such launch (a target without it, zero-padded
    head dims, a state dtype other than fp32, "KV" states): the caller then makes the two calls.
    kw: kda_prefill's other keywords (flags; no out/final_state/chunk_states/workspace buffers)."""
    unknown = sorted(set(kw) - set(_FLAGS))
    if unknown:
        raise TypeError(f"kda_prefill_twins: unexpected keyword argument(s) {', '.join(unknown)}")
    HV = v.shape[2] if kw.get("layout", "BSND").upper() == "BSND" else v.shape[1]
    if (not isinstance(initial_state, torch.Tensor) or initial_state.dim() != 4
            or initial_state.shape[1] != 2 * HV or initial_state.dtype != torch.float32
            or not initial_state.is_contiguous()):
        raise KdaInputError(f"initial_state: expected a contiguous float32 [N, {2 * HV}, V, K] tensor (both runs' "
                            f"heads), found {_describe(initial_state)}")
    if kw.get("state_layout", "VK") != "VK":
        return None
    flags = tuple({**_DEFAULTS, **kw, "output_final_state": True,
                   "return_chunk_states": return_chunk_states}[n] for n in _FLAGS)
    plan, _ = _plan_of(q, k, v, g, beta, A_log, dt_bias, initial_state[:, :HV], cu_seqlens, cu_seqlens_cpu, None,
                       None, None, None, flags)
    if isinstance(plan, scan_route.ScanRoute):
        plan = plan.inner
    if type(plan) is not Plan or not getattr(plan.launcher, "supports_twins", False) \
            or plan.st_dtype != torch.float32 or plan.state_kv or plan.info.state == "none":
        return None
    return plan.twins(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu)


def _describe(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {list(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}"


def _remember(plan: "Plan", flags: tuple, tensors: tuple, failed: bool) -> None:
    """Make `plan` the latest, with a guard of this call's tensors: its own from an earlier call,
    or a new one where it has none or its guard just `failed` a call of its signature
    (inference mode, a tensor subclass); a plan whose guards keep failing (a caller passing one
    tensor in two slots) stops getting new ones."""
    global _LAST
    guard = plan.guard
    if guard is None or failed:
        if plan.guard_builds >= _GUARD_BUILDS:
            _LAST = _NO_PLAN
            return
        plan.guard_builds += 1
        guard = plan.guard = make_check(tensors)
    _LAST = (flags, torch.is_grad_enabled(), guard, plan) if guard is not None else _NO_PLAN


def _engine_call(q, k, v, g, beta, kw: dict, state_pool, state_indices, checkpoint_every, checkpoints,
                 checkpoint_offsets):
    """kda_prefill with a state pool and/or checkpoints: gathers and scatters around one call."""
    HV, st = pool_io.head_dims(q, v, kw["layout"], kw["state_layout"])
    bsnd = str(kw["layout"]).upper() == "BSND"
    cu = kw["cu_seqlens"]
    B, T = q.shape[0], (q.shape[1] if bsnd else q.shape[2])
    N = cu.shape[0] - 1 if isinstance(cu, torch.Tensor) else B
    want_final = bool(kw["output_final_state"]) or kw["final_state"] is not None
    pc = None
    if state_pool is not None:  # with state_indices (kda_prefill checked both or neither)
        for name in ("initial_state", "final_state"):
            if kw[name] is not None:
                raise KdaInputError(f"{name}: expected None with state_pool (the pool holds the initial and final "
                                    f"states), found a tensor")
        if env.pool_slots() and not want_final and checkpoint_every is None and checkpoints is None \
                and checkpoint_offsets is None:
            # (asked for, the final states come back per sequence, a padding one's too: gathered). Bit for
            # bit the gathered call; 1.06-1.15x faster on sm80 (H100, session 52; KDAGEN_POOL_SLOTS=0 gathers);
            # sm90 runs its kda_fused_slots entry point
            o, checked = _pool_in_kernel(q, k, v, g, beta, kw, state_pool, state_indices, N=N, HV=HV, st=st)
            if o is not None:
                return o, None
        else:
            checked = None
        pc = pool_io.gather(state_pool, state_indices, N=N, HV=HV, state_shape=st, device=q.device,
                            state_dtype=kw["state_dtype"], assume_valid=bool(kw["assume_valid"]), checked=checked)
        kw = dict(kw, initial_state=pc.initial_state, final_state=pc.final_state, output_final_state=True)
    cp = None
    if checkpoint_every is not None or checkpoints is not None or checkpoint_offsets is not None:
        ckpt.require_spacing(checkpoint_every)
        chunks, user_stride = ckpt.caller_chunks(checkpoint_every, kw["chunk_size"], kw["return_chunk_states"],
                                                 kw["chunk_states"])
        lens = ckpt.host_lengths(B, T, cu, kw["cu_seqlens_cpu"], "checkpoint_every")
        if cu is not None and kw["cu_seqlens_cpu"] is None:
            kw = dict(kw, cu_seqlens_cpu=torch.tensor([0, *itertools.accumulate(lens)], dtype=cu.dtype))
        st_dtype = next((t.dtype for t in (kw["initial_state"], kw["final_state"], kw["chunk_states"])
                         if t is not None), kw["state_dtype"] or torch.float32)
        kw = dict(kw, output_final_state=True, state_dtype=st_dtype)
        if len(chunks) > 1:
            # the kernel the call without checkpoints runs (its cached plan), so that checkpoints
            # change neither o nor the tuned choice: it keeps only every (n / chunk)-th chunk state
            chunk = _chunk_of(q, k, v, g, beta, kw)
            chunks = (chunk, *(c for c in chunks if c != chunk)) if chunk in chunks else chunks
        # the call writes its kept chunk states and final states into one tensor, from which one
        # gather makes the checkpoints (the caller's own chunk states or final states: two copies);
        # a pool's final states are scratch the scatter reads, so they go there too
        stack = not user_stride and (kw["final_state"] is None or pc is not None)
        for i, chunk in enumerate(chunks):
            stride = user_stride or checkpoint_every // chunk
            cp = ckpt.plan(checkpoint_every, lens, HV=HV, state_shape=st, dtype=st_dtype, device=q.device,
                           chunk=chunk * stride, buffer=checkpoints, offsets=checkpoint_offsets,
                           assume_valid=bool(kw["assume_valid"]))
            call_kw = dict(kw, chunk_size=chunk, return_chunk_states=stride)
            if stack:
                stacked = torch.empty((cp.kept + N, HV, *st), dtype=st_dtype, device=q.device)
                call_kw.update(chunk_states=stacked[:cp.kept], final_state=stacked[cp.kept:])
                if pc is not None:
                    pc.final_state = call_kw["final_state"]
            try:
                res = _prefill_kw(q, k, v, g, beta, call_kw)
                break
            except NoVariantError:
                if i == len(chunks) - 1:
                    raise
        if stack:
            buffer = cp.fill(stacked)
        else:
            buffer = cp.target(res[2])
            cp.rows.copy(buffer, res[2], res[1])
        res = (res[0], res[1] if want_final else None, *((res[2],) if user_stride else ()), buffer)
    else:
        res = _prefill_kw(q, k, v, g, beta, kw)
        if not want_final:
            res = (res[0], None, *res[2:])
    if pc is not None:
        pool_io.scatter(pc)
    return res


def _pool_fast(q, k, v, g, beta, A_log, dt_bias, cu, cu_cpu, out, ws, pool, indices, flags: tuple
               ) -> Optional[torch.Tensor]:
    """o of a state pool call of the latest pool call's signature (its flags, grad mode and guarded
    tensors, the pool's included) whose kernels take the slots: only the slots' own checks, then the
    plan's launch. None sends the call down the general path (_engine_call), which checks and plans it
    (a pool call there took ~16 us of kdagen's Python against ~6 for the plain call: CPU stub, session 53)."""
    last = _POOL_LAST
    try:
        same = flags == last[0] and torch.is_grad_enabled() is last[1]
    except Exception:  # a flag that does not compare (a tensor for scale): the general path names it
        return None
    if not same or not env.pool_slots() or not last[2](q, k, v, g, beta, A_log, dt_bias, pool, cu, cu_cpu, out, ws):
        return None
    plan = last[3]
    if not _takes_slots(plan):
        return None  # (the general path gathers)
    host = pool_io.check_indices(pool, indices, N=last[4], device=q.device, assume_valid=bool(flags[_VALID_AT]))
    slots = pool_io.kernel_slots(indices, host, q.device)
    return plan.pool_call(q, k, v, g, beta, A_log, dt_bias, cu, cu_cpu, out, pool, slots, ws)


def _takes_slots(plan) -> bool:
    """Whether a pool call's plan is a plain launch whose kernels read and write the pool's slots."""
    return type(plan) is Plan and getattr(plan.launcher, "pool_indices", False) and not plan.want_chunks


def _pool_in_kernel(q, k, v, g, beta, kw: dict, pool, indices, *, N: int, HV: int, st: tuple[int, int]
                    ) -> tuple[Optional[torch.Tensor], Optional[tuple]]:
    """A state pool call whose kernels read and write the pool's slots themselves (KdaCall.h0_index,
    ht_index), and the slots' check for gather's `checked` (None: not checked here): its o where
    the call's plan is a plain launch of a launcher with pool_indices, else None (the caller
    gathers and scatters around the call). The gather, the kernel's read of its
    scratch and the scatter made three passes over the states where this makes one each way (the
    gathered pool call took 1.2-1.55x the h0 + final-state call on engine shapes: H100,
    benchmarks/NOTES.md, sessions 51-52)."""
    global _POOL_LAST
    dev = q.device
    if not isinstance(pool, torch.Tensor) or pool.dim() < 1 or pool.shape[0] == 0 \
            or not pool.is_contiguous() or kw["return_chunk_states"] or kw["chunk_states"] is not None:
        return None, None
    host = pool_io.check_slots(pool, indices, N=N, HV=HV, state_shape=st, device=dev, state_dtype=kw["state_dtype"],
                               assume_valid=bool(kw["assume_valid"]))
    flags = _pool_flags(kw)
    tensors = (q, k, v, g, beta, kw["A_log"], kw["dt_bias"], pool, kw["cu_seqlens"], kw["cu_seqlens_cpu"], kw["out"],
               kw["workspace"])
    last = _POOL_LAST
    # The latest pool call's plan where the guard says this call has its signature (the pool's
    # included: a model's layers repeat one); else the plan of the same call with per-sequence
    # states (their signature: [N, HV, *st] contiguous), cached by _plan_of as any call's.
    if flags == last[0] and torch.is_grad_enabled() is last[1] and last[2](*tensors):
        plan = last[3]
    else:
        like = pool[:N] if pool.shape[0] >= N else torch.empty((N, HV, *st), dtype=pool.dtype, device=dev)
        plan, key = _plan_of(q, k, v, g, beta, kw["A_log"], kw["dt_bias"], like, kw["cu_seqlens"],
                             kw["cu_seqlens_cpu"], kw["out"], like, None, kw["workspace"], flags)
        guard = make_check(tensors) if key is not None else None
        _POOL_LAST = (flags, torch.is_grad_enabled(), guard, plan, N) if guard is not None else _NO_PLAN
    if not _takes_slots(plan):
        return None, (host,)  # padded head dims, the scan's route, a target without pool slots: gathered
    slots = pool_io.kernel_slots(indices, host, dev)
    return plan.pool_call(q, k, v, g, beta, kw["A_log"], kw["dt_bias"], kw["cu_seqlens"], kw["cu_seqlens_cpu"],
                          kw["out"], pool, slots, kw["workspace"]), (host,)


# The flags of a pool call's plan: kda_prefill's (_FLAGS), with the final state asked (the pool's slots).
_pool_flag_values = operator.itemgetter(*_FLAGS)
_FINAL_AT = _FLAGS.index("output_final_state")
_VALID_AT = _FLAGS.index("assume_valid")


def _pool_flags(kw: dict) -> tuple:
    flags = list(_pool_flag_values(kw))
    flags[_FINAL_AT] = True
    return tuple(flags)


def _prefill_kw(q, k, v, g, beta, kw: dict):
    """kda_prefill(q, k, v, g, beta, **kw) for kw holding every one of its _DEFAULTS keys (no cp
    context, engine arguments or tracing: the caller dealt with those)."""
    return _prefill(q, k, v, g, beta, kw["A_log"], kw["dt_bias"], kw["initial_state"], kw["cu_seqlens"],
                    kw["cu_seqlens_cpu"], kw["out"], kw["final_state"], kw["chunk_states"], kw["workspace"],
                    tuple(kw[n] for n in _FLAGS))


def _chunk_of(q, k, v, g, beta, kw: dict) -> Optional[int]:
    """The kernel chunk kda_prefill(q, k, v, g, beta, **kw) runs, from its plan (made and cached
    as the call itself would); None where no variant serves it."""
    flags = tuple(kw[n] for n in _FLAGS)
    try:
        plan, _ = _plan_of(q, k, v, g, beta, kw["A_log"], kw["dt_bias"], kw["initial_state"], kw["cu_seqlens"],
                           kw["cu_seqlens_cpu"], None, kw["final_state"], None, kw["workspace"], flags)
    except NoVariantError:
        return None
    return plan.variant.chunk


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            **kwargs: Any) -> "Plan":
    """Validate the call kda_prefill(q, k, v, g, beta, **kwargs) and select (generating and
    building if need be) its variant, without running it: raises what the call would raise
    before its launch. State pools and checkpoints are not taken here."""
    return _make_plan(q, k, v, g, beta, **_with_defaults(dict(kwargs)))


def route_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             **kwargs: Any) -> Optional[str]:
    """How kda_prefill(q, k, v, g, beta, **kwargs) runs besides its variant: "scan correct xS"
    where the call runs as the segment scan at up to S segments a sequence
    (kdagen/scan/route.py), None where it runs in one piece."""
    if not env.scan_route():
        return None
    plan = prepare(q, k, v, g, beta, **kwargs)
    kw = _with_defaults(dict(kwargs))
    segments = scan_route.segments_for(plan, kw)
    if segments == scan_route.PER_CALL:  # several varlen sequences: these offsets decide
        segments = scan_route.call_segments(plan.info, kw)
    return None if segments is None else scan_route.ScanRoute.label(segments)


def workspace_size(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   **kwargs: Any) -> int:
    """Bytes of `workspace=` the call kda_prefill(q, k, v, g, beta, **kwargs) needs (0 when its
    variant takes none). It grows with T and the number of sequences: ask with the largest
    shapes an engine will pass, and allocate once."""
    return prepare(q, k, v, g, beta, **dict(kwargs, workspace=None, out=None)).workspace_bytes()


def allocate_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     fill: Optional[float] = None, **kwargs: Any) -> dict[str, torch.Tensor]:
    """The out= / final_state= / chunk_states= buffers kda_prefill(q, k, v, g, beta, **kwargs)
    writes (as keyword arguments for it), filled with `fill` (NaN: anything a kernel leaves
    unwritten shows up). Exact chunk-state rows need host offsets (cu_seqlens_cpu or a
    host-readable cu_seqlens)."""
    kw = _with_defaults(dict(kwargs))
    info = check_signature(q, k, v, g, beta, **{n: kw[n] for n in _SIGNATURE_ARGS})
    bufs = {"out": torch.empty(v.shape, dtype=v.dtype, device=v.device)}
    st = (info.V, info.K) if kw["state_layout"] == "VK" else (info.K, info.V)
    if info.state != "none" and (kw["output_final_state"]):
        bufs["final_state"] = torch.empty((info.N, info.HV, *st), dtype=torch_dtype(info.state), device=q.device)
    if kw["return_chunk_states"]:
        cu = kw["cu_seqlens_cpu"] if kw["cu_seqlens_cpu"] is not None else kw["cu_seqlens"]
        lens = [b - a for a, b in zip(cu.tolist(), cu.tolist()[1:])] if cu is not None else [info.T] * info.N
        spacing = info.chunk_size * chunk_stride(kw["return_chunk_states"])
        rows = sum(-(-n // spacing) for n in lens)
        bufs["chunk_states"] = torch.empty((rows, info.HV, *st), dtype=torch_dtype(info.state), device=q.device)
    if fill is not None:
        for t in bufs.values():
            t.fill_(fill)
    return bufs


_SIGNATURE_ARGS = ("A_log", "dt_bias", "scale", "lower_bound", "gate", "initial_state", "output_final_state",
                   "cu_seqlens", "cu_seqlens_cpu", "layout", "state_layout", "state_dtype", "chunk_size",
                   "return_chunk_states", "final_state", "chunk_states")
_DEFAULTS = dict(A_log=None, dt_bias=None, scale=None, lower_bound=-5.0, gate=None, initial_state=None,
                 output_final_state=False, cu_seqlens=None, cu_seqlens_cpu=None, layout="BSND", state_layout="VK",
                 state_dtype=None, use_qk_l2norm=True, allow_neg_eigval=False, chunk_size=None,
                 return_chunk_states=False, variant=None, out=None, final_state=None, chunk_states=None,
                 workspace=None, assume_valid=False, beta_is_logit=True)


def _with_defaults(kwargs: dict) -> dict:
    unknown = sorted(set(kwargs) - set(_DEFAULTS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}")
    return {**_DEFAULTS, **kwargs}


# ----------------------------------------------------------------------------- the slow path

def _make_plan(q, k, v, g, beta, **kw) -> "Plan":
    """Validate a new signature, select (and if need be generate/build) its variant."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise KdaInputError(f"{name}: expected a torch.Tensor, found {type(t).__name__}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta)):
        grads = [n for n, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)) if t.requires_grad]
        raise KdaInputError(f"{', '.join(grads)}: expected tensors without autograd history: kda_prefill is "
                            "forward-only (no backward); call it under torch.no_grad() or pass .detach()ed "
                            "tensors, found requires_grad=True")
    if kw["final_state"] is not None:
        kw["output_final_state"] = True
    if kw["chunk_states"] is not None and not kw["return_chunk_states"]:
        kw["return_chunk_states"] = True
    info = check_signature(q, k, v, g, beta, **{n: kw[n] for n in _SIGNATURE_ARGS})
    out = kw["out"]
    if out is not None:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(v.shape) or out.dtype != v.dtype \
                or out.device != v.device or out.stride(-1) != 1:
            found = (f"shape {tuple(out.shape)}, dtype {out.dtype}, {out.device}, last stride {out.stride(-1)}"
                     if isinstance(out, torch.Tensor) else type(out).__name__)
            raise KdaInputError(f"out: expected a tensor like v (shape {tuple(v.shape)}, dtype {v.dtype}, "
                                f"{v.device}, unit last stride), found {found}")
    ws = kw["workspace"]
    if ws is not None and (not isinstance(ws, torch.Tensor) or ws.device != q.device or not ws.is_contiguous()):
        raise KdaInputError(f"workspace: expected a contiguous tensor on {q.device}, found "
                            f"{ws.device if isinstance(ws, torch.Tensor) else type(ws).__name__}")
    entry = _dispatch(info, kw["variant"])
    reg = registry()
    dev = q.device
    launcher = reg.launcher(entry.name, f"{dev.type}:{dev.index}")
    padded = (entry.variant.k, entry.variant.v) != (info.K, info.V)
    key = (entry.name, info.layout, info.varlen, info.state, info.K, info.V)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("kdagen: %s for B=%d T=%d N=%d H=%d HV=%d %s%s", entry.name, info.B, info.T, info.N, info.H,
                 info.HV, info.describe(),
                 f" (zero-padded to K={entry.variant.k} V={entry.variant.v})" if padded else "")
    if padded:
        return PaddedPlan(entry, launcher, info, q, k, v, g, beta, kw, Plan)
    return Plan(entry, launcher, info, q, k, v, g, beta, kw)


def selected_entry(info: CallInfo, variant: Optional[str] = None) -> Optional[Entry]:
    """The registry entry a call described by `info` would run, built or not; None where the call
    would generate one (no listed variant serves it). Never generates or builds: for pricing
    calls not yet made (the scan's planner, kdagen.cp)."""
    reg = registry()
    forced = variant or env.force_variant()
    if forced:
        return reg.entries.get(forced)
    best, _, _ = choose_covering([Candidate(v, *reg.status(v.name)) for v in reg.variants()], info)
    return reg.entries.get(best.variant.name) if best is not None else None


def built_launcher(info: CallInfo, variant: Optional[str] = None) -> Optional[tuple[Entry, Any]]:
    """(entry, launcher) of selected_entry(info, variant) where it is built and runs at the
    call's own head dims (not zero-padded); None otherwise. Never generates or builds."""
    from .select import READY

    reg = registry()
    entry = selected_entry(info, variant)
    if entry is None or reg.status(entry.name)[0] != READY or (entry.variant.k, entry.variant.v) != (info.K, info.V):
        return None
    dev = info.device
    return entry, reg.launcher(entry.name, f"{dev.type}:{dev.index}")


def _candidate_for_name(reg: Registry, name: str) -> Candidate:
    from .ondemand import parse_name

    if name in reg.entries:
        readiness, blocked = reg.status(name)
        return Candidate(reg.entries[name].variant, readiness, blocked)
    try:
        v = parse_name(name)
    except Exception as e:
        raise NoVariantError(f"variant {name!r} is not registered and cannot be generated: {e}") from None
    return Candidate(v, GENERATE, _generate_blocked(v))


def _generate_blocked(v) -> Optional[str]:
    from .build import compiler_reason
    from .targets import TARGETS

    cmd = f"`kdagen build --variant {v.name}`"
    if env.disable_jit():
        return f"no spec lists it, and KDAGEN_DISABLE_JIT=1 forbids generating it now ({cmd} makes it ahead of time)"
    why = compiler_reason(TARGETS[v.target].build)
    return f"no spec lists it, and {why} to build it ({cmd} elsewhere)" if why else None


def _dispatch(info: CallInfo, variant: Optional[str]) -> Entry:
    """The registry entry that serves `info`: the forced one (variant= or KDAGEN_FORCE_VARIANT),
    else the preferred registered candidate, else one generated for this call."""
    reg = registry()
    forced = variant or env.force_variant()
    memo = (info.dtype, info.K, info.V, info.layout, info.gate, info.state, info.varlen, info.H != info.HV,
            info.chunk_size, info.device, info.N, info.HV, info.T * info.B >= 512 * max(info.N, 1), forced,
            tuning_memo_key(info), regime_key(info))
    name = _CHOICES.get(memo)
    if name is not None and name in reg.entries:
        return reg.entries[name]
    entry = _select_entry(reg, info, forced, variant)
    _CHOICES[memo] = entry.name
    return entry


def _select_entry(reg: Registry, info: CallInfo, forced: Optional[str], variant: Optional[str]) -> Entry:
    from . import ondemand
    from .paths import cache_build_dir
    from .targets import TARGETS

    if forced:
        best = _candidate_for_name(reg, forced)
        # a forced variant with larger head dims serves the call zero-padded
        covers = best.variant.k >= info.K and best.variant.v >= info.V
        why = rejection(best, at_dims(info, best.variant.k, best.variant.v) if covers else info)
        if why:
            src = "variant=" if variant else "KDAGEN_FORCE_VARIANT"
            raise NoVariantError(f"variant {forced!r} (from {src}) cannot serve this call: {why}\n"
                                 f"  Found:     {info.describe()}")
    else:
        # Variants with the call's head dims or larger ones (zero-padded): see kdagen.padding.
        cands = [Candidate(v, *reg.status(v.name)) for v in reg.variants()]
        best, binfo, rejected = choose_covering(cands, info)
        if best is None:
            # No listed variant serves the call: one that a target supports is generated for it.
            extra = [Candidate(v, GENERATE, _generate_blocked(v))
                     for t in TARGETS if (dims := target_dims(t, info)) is not None
                     for v in ondemand.variants_for(t, dtype=info.dtype, k=dims[0], v=dims[1], gate=info.gate,
                                                    state=info.state, chunk=info.chunk_size)
                     if v.name not in reg.entries]
            best, binfo, more = choose_covering(extra, info)
            rejected += more
            if best is None:
                raise NoVariantError(miss_message(rejected, info) + "\n" + coverage_note(info))
        _warn_if_better_blocked(best, rejected, binfo)
    if best.readiness == GENERATE:
        log.warning("kdagen: no spec lists a variant for %s; generating %s (`kdagen build --variant %s` "
                    "makes it ahead of time)", info.describe(), best.variant.name, best.variant.name)
        reg.add_root(ondemand.register([best.variant]), cache_build_dir())
    return reg.entries[best.variant.name]


def _warn_if_better_blocked(best: Candidate, rejected: list[tuple[Candidate, str]], info: CallInfo) -> None:
    """Say so (once) when a variant that would be preferred is skipped only because it is not
    built and cannot be built here."""
    from .select import _sm_count, device_reason, functional_reason

    sms = _sm_count(info.device)
    mine = preference(best, info, sms)
    n = TARGET_ORDER + 1  # the targets' order, then the tuned chunk and block_v
    better = [x for x, _ in rejected if x.blocked and not functional_reason(x.variant, info)
              and not device_reason(x.variant.target, info.device) and preference(x, info, sms)[:n] < mine[:n]]
    if better:
        top = min(better, key=lambda x: preference(x, info, sms))
        key = ("blocked", top.variant.name, best.variant.name)
        if key not in _LOGGED:
            _LOGGED.add(key)
            log.warning("kdagen: using %s; %s would be preferred but is %s", best.variant.name, top.variant.name,
                        top.blocked)


# ----------------------------------------------------------------------------- the fast path

_UNBOUND = object()


class Plan:
    """What a call signature resolved to; calling it launches with this call's tensors."""

    def __init__(self, entry: Entry, launcher, info: CallInfo, q, k, v, g, beta, kw: dict) -> None:
        self.entry, self.variant, self.launcher, self.info = entry, entry.variant, launcher, info
        lay = info.layout
        # info's device: a padded call plans its inner call from tensors on the meta device
        self.device = info.device
        self.layout = lay
        self.strides = (_strides(q, lay), _strides(k, lay), _strides(v, lay), _strides(g, lay),
                        _strides(beta.unsqueeze(-1), lay))
        out = kw["out"]
        self.o_shape, self.o_dtype = tuple(v.shape), v.dtype
        self.o_strides = _strides(out, lay) if out is not None else \
            _strides(torch.empty_strided(self.o_shape, _contiguous_strides(self.o_shape), device="meta"), lay)
        self.state_kv = kw["state_layout"] == "KV"
        st = (info.K, info.V) if self.state_kv else (info.V, info.K)
        self.st_shape = st
        self.fs_shape = (info.N, info.HV, *st)
        self.fs_cstrides = _contiguous_strides(self.fs_shape)
        self.o_cstrides = _contiguous_strides(self.o_shape)
        self.varlen, self.T = info.varlen, info.T
        self.st_dtype = torch_dtype(info.state) if info.state != "none" else torch.float32
        self.want_final = bool(kw["output_final_state"]) and info.state != "none"
        self.want_chunks = bool(kw["return_chunk_states"])
        self.chunk_stride = max(1, chunk_stride(kw["return_chunk_states"]))
        self.C = info.chunk_size or self.variant.chunk
        self.scale = float(kw["scale"]) if kw["scale"] is not None else info.K ** -0.5
        self.lower_bound = float(kw["lower_bound"]) if kw["lower_bound"] is not None else 0.0
        self.use_l2 = bool(kw["use_qk_l2norm"])
        self.neg_eig = bool(kw["allow_neg_eigval"])
        self.beta_logit = bool(kw["beta_is_logit"])
        self.assume_valid = bool(kw["assume_valid"])
        self.precomputed = info.gate == "precomputed"
        A, dt = kw["A_log"], kw["dt_bias"]
        # Conversions the launchers need, decided once: fp32 contiguous A_log [HV] and dt_bias [HV, K].
        self.A_ready = A is not None and A.dtype == torch.float32 and A.is_contiguous() and A.dim() == 1
        # The bound launch reads dt_bias's HV*K values in place: fla's flat [HV*K] form serves as it is
        dt_in_place = dt is not None and dt.dtype == torch.float32 and dt.is_contiguous()
        self.dt_ready = dt_in_place and dt.dim() == 2
        h0 = kw["initial_state"]
        self.h0_ready = h0 is None or h0.is_contiguous()
        self.h0_like = h0 is not None and h0.is_contiguous() and h0.dtype == self.st_dtype
        self.v_contiguous = v.is_contiguous()
        cu = kw["cu_seqlens"]
        self.cu_ready = cu is None or (cu.dtype == torch.int32 and cu.is_contiguous() and cu.device == self.device)
        # Other offsets (fla's int64 ones) whose host copy the call has: the kernels take an int32
        # device copy made from it, cached by value (a model's layers pass one batch's offsets).
        self.cu_via_host = not self.cu_ready and (kw["cu_seqlens_cpu"] is not None or cu.device.type == "cpu")
        self.on_cuda = self.device.type == "cuda"
        self.capturing = capture_query() if self.on_cuda else None
        self._static_offsets: Optional[torch.Tensor] = None
        # Calls a bound launch serves whole (_run_bound): no per-call conversion, no chunk states.
        gate_args = (A is None and dt is None) if self.precomputed else \
            (self.A_ready and (dt is None or dt_in_place))
        self.bound_whole = gate_args and self.h0_ready and (self.cu_ready or self.cu_via_host) and \
            not self.want_chunks and info.N > 0
        self.empty, self.empty_general, self.current_device, self.device_index = _allocator(q.device)
        self.o_alloc = (self.o_shape, self.o_cstrides, self.o_dtype)
        self.fs_alloc = (self.fs_shape, self.fs_cstrides, self.st_dtype) if self.want_final else None
        self.fast = _UNBOUND  # the launcher's bound launch of this signature (None: it has none)
        self.twins_fast: Any = _UNBOUND  # the same for kda_prefill_twins' launch (twins=2)
        self.guard: Any = None  # signature_guard's check of a call with this plan's signature (make_check)
        self.guard_builds = 0

    @property
    def fast(self) -> Any:
        return self._fast

    @fast.setter
    def fast(self, bound: Any) -> None:
        """Set the bound launch; `run` (what every call of the signature calls) follows it."""
        self._fast = bound
        whole = self.bound_whole and bound is not None and bound is not _UNBOUND
        self.run = self._run_bound if whole else self.__call__

    def workspace_bytes(self) -> int:
        fn = getattr(self.launcher, "workspace_bytes", None)
        return int(fn(self._call_template(), self.device)) if fn is not None else 0

    def _call_template(self) -> KdaCall:
        i = self.info
        meta = torch.empty(0, device="meta")
        return KdaCall(q=meta, k=meta, v=meta, g=meta, beta=meta, o=meta, q_strides=self.strides[0],
                       k_strides=self.strides[1], v_strides=self.strides[2], g_strides=self.strides[3],
                       beta_strides=self.strides[4], o_strides=self.o_strides, B=i.B, T=i.T, N=i.N, H=i.H,
                       HV=i.HV, K=i.K, V=i.V, cu_seqlens=meta if i.varlen else None,  # what launchers ask
                       A_log=None, dt_bias=None, scale=self.scale,
                       lower_bound=self.lower_bound, use_qk_l2norm=self.use_l2, allow_neg_eigval=self.neg_eig,
                       initial_state=None, final_state=None, state_kv=self.state_kv, chunk_states=None,
                       chunk_offsets=None, max_len=i.T, beta_is_logit=self.beta_logit)

    def _offsets(self, cu, cu_cpu) -> tuple[int, Optional[list[int]]]:
        """(longest sequence or its bound T, host offsets or None) for a varlen call."""
        T = self.info.T
        if self.on_cuda and self.capturing():
            # A graph replays with new offsets: grids sized for the longest possible sequence.
            if cu_cpu is None and not self.assume_valid:
                raise KdaInputError("cu_seqlens: cannot be read during CUDA graph capture; pass assume_valid=True "
                                    "(offsets are read by the kernels on every replay)")
            return T, None
        if cu_cpu is not None:
            host = cu_cpu.tolist()
        elif self.assume_valid:
            return T, None
        else:
            host = cu.tolist()  # a device sync: pass cu_seqlens_cpu or assume_valid=True to avoid it
        return check_offsets(host, T, validate=not self.assume_valid), host

    def _chunk_offsets(self, cu32, host) -> tuple[torch.Tensor, int]:
        """chunk_offsets [N + 1] (int32, on the device) and the rows they need (-1: unknown)."""
        # a row per chunk_stride chunks (rows for chunks 0, m, 2m, ...): ceil(len / (C m)) a sequence
        C, N, dev = self.C * self.chunk_stride, self.info.N, self.device
        if not self.info.varlen:
            if self._static_offsets is None:
                nc = -(-self.info.T // C)
                self._static_offsets = torch.arange(0, (N + 1) * nc, nc, dtype=torch.int32, device=dev)
            return self._static_offsets, N * (-(-self.info.T // C))
        if host is not None:
            offs = [0]
            for a, b in zip(host, host[1:]):
                offs.append(offs[-1] + -(-(b - a) // C))
            return device_ints(offs, dev), offs[-1]  # READ-ONLY; a plain copy waited for the stream
        # no host offsets: computed on the device (capturable), rows unknown here
        co = torch.zeros(N + 1, dtype=torch.int32, device=dev)
        torch.cumsum((cu32[1:] - cu32[:-1] + (C - 1)) // C, 0, dtype=torch.int32, out=co[1:])
        return co, -1

    def _run_bound(self, q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, out, fs, cs, ws):
        """A call of a signature whose bound launch serves it whole: offsets (varlen), outputs,
        launch; the general path only where the launch declines."""
        max_len, _, cu = self._varlen_args(cu, cu_cpu) if self.varlen else (self.T, None, cu)
        empty = self._empty_now()
        if out is None:
            out = empty(*self.o_alloc)
        if fs is None and self.fs_alloc is not None:
            fs = empty(*self.fs_alloc)
        if self._fast.launch(q, k, v, g, beta, out, A_log, dt_bias, cu, h0, fs, None, None, ws, max_len):
            return out, fs
        return self(q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, out, fs, cs, ws)

    def _empty_now(self):
        """The allocator for this call's outputs: the cheap one while the current CUDA device is the
        plan's (it allocates on the current device), else torch.empty_strided."""
        if self.current_device is not None and self.current_device() != self.device_index:
            return self.empty_general
        return self.empty

    def _gate_args(self, A_log, dt_bias) -> tuple:
        """A_log [HV] and dt_bias [HV, K] as the launchers take them (fp32, contiguous), or None."""
        A = dt = None
        if not self.precomputed:
            A = A_log if self.A_ready else A_log.to(torch.float32).contiguous().reshape(-1)
            if dt_bias is not None:
                dt = dt_bias if self.dt_ready else dt_bias.to(torch.float32).contiguous().reshape(self.info.HV,
                                                                                                self.info.K)
        return A, dt

    def _varlen_args(self, cu, cu_cpu) -> tuple:
        """(longest sequence or T, host offsets or None, int32 device offsets or None)."""
        if not self.info.varlen:
            return self.info.T, None, None
        max_len, host = self._offsets(cu, cu_cpu)
        if self.cu_ready:
            return max_len, host, cu
        if host is not None:
            return max_len, host, device_ints(host, self.device)
        return max_len, host, cu.to(device=self.device, dtype=torch.int32).contiguous()

    def _kda_call(self, q, k, v, g, beta, o, o_strides, A, dt, cu32, h0, fs, cs, co, max_len, ws,
                  twins: int = 1) -> KdaCall:
        i = self.info
        return KdaCall(q=q, k=k, v=v, g=g, beta=beta, o=o,
                       q_strides=self.strides[0], k_strides=self.strides[1], v_strides=self.strides[2],
                       g_strides=self.strides[3], beta_strides=self.strides[4], o_strides=o_strides,
                       B=i.B, T=i.T, N=i.N, H=i.H, HV=i.HV, K=i.K, V=i.V,
                       cu_seqlens=cu32, A_log=A, dt_bias=dt, scale=self.scale, lower_bound=self.lower_bound,
                       use_qk_l2norm=self.use_l2, allow_neg_eigval=self.neg_eig, initial_state=h0, final_state=fs,
                       state_kv=self.state_kv, chunk_states=cs, chunk_offsets=co, max_len=max_len, workspace=ws,
                       twins=twins, beta_is_logit=self.beta_logit, chunk_stride=self.chunk_stride)

    def pool_call(self, q, k, v, g, beta, A_log, dt_bias, cu, cu_cpu, out, pool, slots, ws) -> torch.Tensor:
        """o of a call whose initial and final states are a state pool's slots (`slots`: int32 [N]
        on the device, -1 none), read and written in place by the kernels: through the signature's
        bound launch where it takes slots (the checked launch's host time cost more than the gather
        and scatter saved: H200, session 51), else the launcher's checked launch, which on the
        signature's first call also binds (the bound struct's slots are set per call)."""
        max_len, _, cu32 = self._varlen_args(cu, cu_cpu)
        fast = self.fast
        if self.bound_whole and getattr(fast, "takes_slots", False):
            # as _run_bound: the cheap allocator and the gate arguments as passed (torch.empty_like
            # took 3x the allocator's host time in an H100 host's profile: session 54)
            if out is None:
                out = self._empty_now()(*self.o_alloc)
            if fast.launch(q, k, v, g, beta, out, A_log, dt_bias, cu32, pool, pool, None, None, ws, max_len,
                           pool_slots=slots.data_ptr()):
                return out
        if out is None:
            out = self._new_out(v)
        if self.info.N > 0:
            A, dt = self._gate_args(A_log, dt_bias)
            h = pool if self.h0_ready else pool.contiguous()
            fast = self.fast
            bound = self._launch(fast, q, k, v, g, beta, out, self.o_strides, A, dt, cu32, h, h, None, None, max_len,
                                 ws, slots=slots)
            if bound is not fast:
                self.fast = bound
        return out

    def _new_out(self, v: torch.Tensor) -> torch.Tensor:
        # empty_like where it gives the same layout: it costs a third of torch.empty(shape, ...)
        return torch.empty_like(v) if self.v_contiguous else torch.empty(self.o_shape, dtype=self.o_dtype,
                                                                           device=self.device)

    def twins(self, q, k, v, g, beta, A_log, dt_bias, h2, cu, cu_cpu) -> tuple:
        """kda_prefill_twins' launch: the launcher's KdaCall with twins=2, h2 [N, 2 HV, V, K] fp32,
        outputs with 2 HV heads; bound on the first call like __call__ (the checked launch took
        ~0.2 ms of host time, before the scan's first big kernel: benchmarks/NOTES.md, session 33)."""
        info, dev = self.info, self.device
        max_len, host, cu32 = self._varlen_args(cu, cu_cpu)
        if self.layout == "bsnd":
            o = torch.empty((info.B, info.T, 2 * info.HV, info.V), dtype=self.o_dtype, device=dev)
            o_strides = (o.stride(0), o.stride(1), o.stride(2))
        else:
            o = torch.empty((info.B, 2 * info.HV, info.T, info.V), dtype=self.o_dtype, device=dev)
            o_strides = (o.stride(0), o.stride(2), o.stride(1))
        fs = torch.empty_like(h2)
        co = cs = None
        if self.want_chunks:
            co, rows = self._chunk_offsets(cu32, host)
            if rows < 0:
                raise KdaInputError("chunk_states: the twin runs with cu_seqlens need host offsets (cu_seqlens_cpu)")
            cs = torch.empty((rows, 2 * info.HV, *self.st_shape), dtype=self.st_dtype, device=dev)
        if info.N > 0:
            A, dt = self._gate_args(A_log, dt_bias)
            self.twins_fast = self._launch(self.twins_fast, q, k, v, g, beta, o, o_strides, A, dt, cu32, h2, fs, cs,
                                           co, max_len, None, twins=2)
        return (o, fs, cs) if self.want_chunks else (o, fs)

    def _launch(self, fast, q, k, v, g, beta, o, o_strides, A, dt, cu32, h0, fs, cs, co, max_len, ws,
                twins: int = 1, slots: Optional[torch.Tensor] = None) -> Any:
        """One launch through `fast` (the signature's bound launch) where it serves, else the
        launcher's checked launch, which on the first call (fast _UNBOUND) also binds. Returns
        the bound launch to keep (None: the launcher has none for this signature). slots: a state
        pool's (h0 and fs are then the pool; KdaCall.h0_index/ht_index), where the bound launch
        takes them."""
        if fast is not None and fast is not _UNBOUND and (
                fast.launch(q, k, v, g, beta, o, A, dt, cu32, h0, fs, cs, co, ws, max_len) if slots is None else
                getattr(fast, "takes_slots", False)
                and fast.launch(q, k, v, g, beta, o, A, dt, cu32, h0, fs, cs, co, ws, max_len,
                                pool_slots=slots.data_ptr())):
            return fast
        call = self._kda_call(q, k, v, g, beta, o, o_strides, A, dt, cu32, h0, fs, cs, co, max_len, ws, twins=twins)
        if slots is not None:
            call.h0_index = call.ht_index = slots
        self.launcher(call)
        if fast is _UNBOUND:
            # Launchers with a bound fast path prepare it from this first (checked) call.
            bind = getattr(self.launcher, "bind", None)
            return bind(call) if bind is not None else None
        return fast

    def __call__(self, q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, out, fs, cs, ws):
        """The general path: conversions, chunk offsets, the launcher's checked launch (and, on
        the first call, its bind)."""
        info, dev = self.info, self.device
        max_len, host, cu32 = self._varlen_args(cu, cu_cpu)
        if out is None:
            out = self._new_out(v)
        if self.want_final and fs is None:
            fs = torch.empty_like(h0) if self.h0_like else torch.empty((info.N, info.HV, *self.st_shape),
                                                                       dtype=self.st_dtype, device=dev)
        co = None
        if self.want_chunks:
            co, rows = self._chunk_offsets(cu32, host)
            if cs is None:
                if rows < 0:
                    raise KdaInputError("chunk_states: return_chunk_states with cu_seqlens and no host offsets "
                                        "needs a chunk_states= buffer (at least T // chunk_size + N rows); or pass "
                                        "cu_seqlens_cpu")
                cs = torch.empty((rows, info.HV, *self.st_shape), dtype=self.st_dtype, device=dev)
            elif 0 <= rows and cs.shape[0] < rows:
                per = "chunk" if self.chunk_stride == 1 else f"{self.chunk_stride} chunks"
                raise KdaInputError(f"chunk_states: expected at least {rows} rows (one per {per} of every "
                                    f"sequence), found {cs.shape[0]}")
        if info.N > 0:
            A, dt = self._gate_args(A_log, dt_bias)
            h = h0 if self.h0_ready else h0.contiguous()
            cs_ = cs if self.want_chunks else None
            fast = self.fast
            bound = self._launch(fast, q, k, v, g, beta, out, self.o_strides, A, dt, cu32, h, fs, cs_, co, max_len, ws)
            if bound is not fast:
                self.fast = bound  # the setter points `run` at the bound launch
        if self.want_chunks:
            return out, fs, cs
        return out, fs


from . import ops as _ops  # noqa: E402,F401  (registers torch.ops.kdagen.*)
