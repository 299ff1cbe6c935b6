"""torch.ops.kdagen.kda_prefill: kda_prefill as a torch library op.

Registered directly with torch.library (a schema, a kernel per device type, a fake
implementation), the low-overhead way serving engines register their own ops: it writes into
caller-provided outputs (`out`, `final_state`, `chunk_states`, `workspace` are declared
mutated) and returns nothing, so torch.compile treats it as one opaque node and CUDA graphs
capture its launches. kdagen.kda_prefill under torch.compile allocates its outputs and calls
this op (traced_prefill below), so a compiled module never reads tensor values: no
data-dependent guard, no graph break.

Importing kdagen.runtime (any use of kdagen.kda_prefill) registers the op.
"""

from __future__ import annotations

from typing import Optional

import torch

SCHEMA = (
    "kda_prefill(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
    "Tensor? initial_state, Tensor? cu_seqlens, Tensor? cu_seqlens_cpu, Tensor(a!) out, "
    "Tensor(b!)? final_state, Tensor(c!)? chunk_states, Tensor(d!)? workspace, Tensor(e!)? state_pool=None, "
    "Tensor? state_indices=None, Tensor(f!)? checkpoints=None, Tensor? checkpoint_offsets=None, *, "
    "float? scale=None, float? lower_bound=-5.0, str? gate=None, str layout=\"BSND\", str state_layout=\"VK\", "
    "bool use_qk_l2norm=True, bool allow_neg_eigval=False, int? chunk_size=None, bool assume_valid=False, "
    "str? variant=None, bool beta_is_logit=True, int? checkpoint_every=None) -> ()"
)
DEVICE_KEYS = ("CPU", "CUDA", "PrivateUse1")  # PrivateUse1: Ascend NPUs through torch_npu


def _impl(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, out, final_state,
          chunk_states, workspace, state_pool=None, state_indices=None, checkpoints=None, checkpoint_offsets=None,
          scale=None, lower_bound=-5.0, gate=None, layout="BSND", state_layout="VK", use_qk_l2norm=True,
          allow_neg_eigval=False, chunk_size=None, assume_valid=False, variant=None, beta_is_logit=True,
          checkpoint_every=None) -> None:
    # The schema's keyword arguments are positional-or-keyword here (the dispatcher passes them by
    # name, only those not at their defaults): a keyword-only default costs a dict lookup per call.
    if state_pool is None and state_indices is None and checkpoints is None and checkpoint_offsets is None \
            and checkpoint_every is None:
        # kda_prefill's positional entry, skipping its keyword handling; the flags are the ones
        # kda_prefill would pass for these arguments (in runtime._FLAGS order), so both share plans.
        _prefill(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, out, final_state,
                 chunk_states, workspace,
                 (scale, lower_bound, gate, final_state is not None, layout, state_layout, None, use_qk_l2norm,
                  allow_neg_eigval, chunk_size, chunk_states is not None, variant, assume_valid, beta_is_logit))
        return
    from .errors import KdaInputError
    from .runtime import kda_prefill

    if checkpoint_every is not None and checkpoints is None:
        raise KdaInputError("checkpoints: expected a buffer with checkpoint_every (the op returns nothing), found None")
    kda_prefill(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, lower_bound=lower_bound, gate=gate,
                initial_state=initial_state, output_final_state=final_state is not None, cu_seqlens=cu_seqlens,
                cu_seqlens_cpu=cu_seqlens_cpu, layout=layout, state_layout=state_layout,
                use_qk_l2norm=use_qk_l2norm, allow_neg_eigval=allow_neg_eigval, chunk_size=chunk_size,
                return_chunk_states=chunk_states is not None, variant=variant, out=out, final_state=final_state,
                chunk_states=chunk_states, workspace=workspace, assume_valid=assume_valid,
                beta_is_logit=beta_is_logit, state_pool=state_pool, state_indices=state_indices,
                checkpoint_every=checkpoint_every, checkpoints=checkpoints, checkpoint_offsets=checkpoint_offsets)


def _fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, out, final_state,
          chunk_states, workspace, *args, **kwargs) -> None:
    return None  # writes its outputs in place; nothing to describe


def _registered() -> bool:
    try:
        torch.ops.kdagen.kda_prefill  # noqa: B018
        return True
    except (AttributeError, RuntimeError):
        return False


if not _registered():
    _LIB = torch.library.Library("kdagen", "DEF")
    _LIB.define(SCHEMA)
    for _key in DEVICE_KEYS:
        _LIB.impl("kda_prefill", _impl, _key)
    torch.library.register_fake("kdagen::kda_prefill", _fake, lib=_LIB)


from .runtime import _prefill  # noqa: E402  (runtime imports this module at its end)


def traced_prefill(q, k, v, g, beta, *, A_log, dt_bias, scale, lower_bound, gate, initial_state,
                   output_final_state, cu_seqlens, cu_seqlens_cpu, layout, state_layout, state_dtype,
                   use_qk_l2norm, allow_neg_eigval, chunk_size, return_chunk_states, variant, out, final_state,
                   chunk_states, workspace, assume_valid, state_pool=None, state_indices=None, checkpoint_every=None,
                   checkpoints=None, checkpoint_offsets=None, beta_is_logit=True):
    """kda_prefill as torch.compile traces it: outputs from shapes only, then the op."""
    from .errors import KdaInputError
    from .inputs import require_every_chunk

    bsnd = layout.upper() == "BSND"
    B, T, K = q.shape[0], (q.shape[1] if bsnd else q.shape[2]), q.shape[3]
    HV, V = (v.shape[2] if bsnd else v.shape[1]), v.shape[3]
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    st_dtype: Optional[torch.dtype] = next((t.dtype for t in (initial_state, final_state, chunk_states, state_pool)
                                            if t is not None), state_dtype or torch.float32)
    st = (V, K) if state_layout == "VK" else (K, V)
    o = out if out is not None else torch.empty(v.shape, dtype=v.dtype, device=v.device)
    fs = final_state
    if fs is None and output_final_state:
        if state_pool is not None:
            raise KdaInputError("output_final_state: expected False with state_pool under torch.compile (the pool "
                                "receives the final states)")
        fs = torch.empty((N, HV, *st), dtype=st_dtype, device=q.device)
    require_every_chunk(return_chunk_states, "under torch.compile")
    cs = chunk_states
    if cs is None and return_chunk_states:
        if cu_seqlens is not None or chunk_size is None:
            raise KdaInputError("chunk_states: return_chunk_states under torch.compile needs chunk_size and, with "
                                "cu_seqlens, a chunk_states= buffer (at least T // chunk_size + N rows)")
        cs = torch.empty((N * ((T + chunk_size - 1) // chunk_size), HV, *st), dtype=st_dtype, device=q.device)
    ck = checkpoints
    if ck is None and checkpoint_every is not None:
        if cu_seqlens is not None or checkpoint_offsets is not None:
            raise KdaInputError("checkpoints: checkpoint_every under torch.compile with cu_seqlens or "
                                "checkpoint_offsets needs a checkpoints= buffer")
        ck = torch.empty((N * (T // checkpoint_every), HV, *st), dtype=st_dtype, device=q.device)
    torch.ops.kdagen.kda_prefill(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, o,
                                 fs, cs, workspace, state_pool, state_indices, ck, checkpoint_offsets, scale=scale,
                                 lower_bound=lower_bound, gate=gate, layout=layout, state_layout=state_layout,
                                 use_qk_l2norm=use_qk_l2norm, allow_neg_eigval=allow_neg_eigval,
                                 chunk_size=chunk_size, assume_valid=assume_valid, variant=variant,
                                 checkpoint_every=checkpoint_every, beta_is_logit=beta_is_logit)
    return (o, fs, *((cs,) if cs is not None else ()), *((ck,) if ck is not None else ()))
