"""kdagen.chunk_kda: fla's chunk_kda (fla-core 0.6) keywords, with fla's meaning, served by
kdagen's kernels (forward only).

fla's conventions, translated to kda_prefill's: inputs [B, T, H, K] (BSND); beta a
probability unless use_beta_sigmoid_in_kernel; states float32 [N, HV, K, V] unless
state_v_first ([N, HV, V, K]); g the log-decay itself unless use_gate_in_kernel, then
-exp(A_log) * softplus(g + dt_bias), or lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) when
lower_bound is set (A_log None: lower_bound * sigmoid(g + dt_bias)); dt_bias [HV * K] or
[HV, K]; q/k L2 norm only with use_qk_l2norm_in_kernel; intermediate states (the state entering
every chunk of fla's chunk_size, 64 by default) [B, NT, HV, K, V] in k's dtype.

Context parallelism: cp_context is fla's FLACPContext (fla.ops.cp.build_cp_context, layout
"contiguous" or "zigzag") or kdagen's (kdagen.cp), run by kdagen.cp; q..beta are this rank's
tokens and the context's offsets replace cu_seqlens, as in fla. As in fla, no initial or final
state goes with it.

Intermediate states with a context are fla's too: the states entering every chunk of each local
piece, counted from the piece's start.

What kdagen does not implement is rejected with KdaInputError, never ignored: a context with
use_graph, keywords fla-core 0.6 does not have. Knobs that only shape fla's own
backward pass (disable_recompute) or its kernels' internals (safe_gate's M=16 path) change no
forward result and are accepted; their argument checks are fla's.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .checkpoints import host_lengths, kernel_chunks, rows
from .errors import KdaInputError, NoVariantError

FLA_CHUNK_SIZES = (32, 64)
_KWARGS = frozenset(("A_log", "dt_bias", "chunk_size", "transpose_state_layout"))


@dataclass
class Translated:
    """A chunk_kda call as kda_prefill keywords, and what to do with its results."""

    tensors: tuple  # q, k, v, g, beta
    kw: dict[str, Any]
    inter_chunk: Optional[int]  # fla chunk size of the intermediate states, when asked
    output_final_state: bool
    cp: Any = None  # kdagen.cp.CPContext of a context-parallel call

    def kernel_chunks(self) -> tuple[Optional[int], ...]:
        return kernel_chunks(self.inter_chunk, None, "chunk_size") if self.inter_chunk else (None,)


def translate(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, **kwargs) -> Translated:
    """Check a chunk_kda call against what kdagen implements and translate it (no kernel runs)."""
    if not _KWARGS.issuperset(kwargs):
        unknown = sorted(set(kwargs) - _KWARGS)
        raise KdaInputError(f"{', '.join(unknown)}: expected only fla-core 0.6's chunk_kda keywords, found "
                            "unknown keyword(s) (kdagen rejects what it does not implement)")
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise KdaInputError("transpose_state_layout: expected it or state_v_first, found both")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                      stacklevel=3)
        state_v_first = bool(kwargs["transpose_state_layout"])
    cp = None
    if cp_context is not None:
        cp = _cp_context(cp_context, q, initial_state, output_final_state, return_intermediate_states, use_graph)
        cu_seqlens = cu_seqlens_cpu = None  # the context's offsets replace them, as in fla
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise KdaInputError(f"{name}: expected a torch.Tensor, found {type(t).__name__}")
    if q.shape != k.shape:
        raise KdaInputError(f"k: expected the shape of q {tuple(q.shape)}, found {tuple(k.shape)}")
    HV = v.shape[2] if v.dim() == 4 else None
    chunk = kwargs.get("chunk_size", 64)
    if chunk not in FLA_CHUNK_SIZES:
        raise KdaInputError(f"chunk_size: expected 32 or 64 (fla's chunk sizes), found {chunk!r}")
    if initial_state is not None and isinstance(initial_state, torch.Tensor) \
            and initial_state.dtype != torch.float32:
        raise KdaInputError(f"initial_state: expected dtype float32 (fla's chunk_kda keeps states in float32), "
                            f"found {initial_state.dtype}")
    A_log = dt_bias = None
    if use_gate_in_kernel:
        A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
        if A_log is None and lower_bound is None:
            raise KdaInputError("A_log: expected a tensor when use_gate_in_kernel=True and lower_bound is not set, "
                                "found None")
        if safe_gate and (lower_bound is None or not -5 <= lower_bound < 0):
            raise KdaInputError(f"lower_bound: expected a value in fla's safe range [-5, 0) with safe_gate=True and "
                                f"use_gate_in_kernel=True, found {lower_bound}")
        if A_log is None:  # lower_bound * sigmoid(g + dt_bias): exp(A_log) = 1
            A_log = torch.zeros(HV or 0, dtype=torch.float32, device=q.device)
        gate = "bounded" if lower_bound is not None else "unbounded"
    else:
        gate = "precomputed"  # g is the log-decay; fla ignores A_log, dt_bias and lower_bound here
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise KdaInputError("allow_neg_eigval: expected False unless use_beta_sigmoid_in_kernel=True (fla's rule: "
                            "the sign flip applies to sigmoid(beta))")
    assume_valid = False
    if use_graph:
        # fla's graph mode: offsets are device data (zero-length tail sequences allowed), never read
        if cu_seqlens is not None and max_num_seqs is not None and cu_seqlens.shape[0] - 1 != max_num_seqs:
            raise KdaInputError(f"cu_seqlens: expected max_num_seqs + 1 = {max_num_seqs + 1} entries with "
                                f"use_graph=True, found {cu_seqlens.shape[0]}")
        assume_valid = True
    # fla's input_guard makes inputs contiguous; kdagen needs only a unit last stride
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or g.stride(-1) != 1:
        q, k, v, g = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, g))
    kw = dict(A_log=A_log, dt_bias=dt_bias, scale=scale, lower_bound=lower_bound if gate == "bounded" else None,
              gate=gate, initial_state=initial_state, output_final_state=bool(output_final_state),
              cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, layout="BSND",
              state_layout="VK" if state_v_first else "KV", state_dtype=torch.float32,
              use_qk_l2norm=bool(use_qk_l2norm_in_kernel), allow_neg_eigval=bool(allow_neg_eigval),
              beta_is_logit=bool(use_beta_sigmoid_in_kernel), assume_valid=assume_valid)
    if return_intermediate_states and use_graph and cu_seqlens is not None and cu_seqlens_cpu is None:
        raise KdaInputError("cu_seqlens_cpu: return_intermediate_states with use_graph=True needs the offsets on "
                            "the host (kdagen never reads cu_seqlens in graph mode)")
    return Translated((q, k, v, g, beta), kw, chunk if return_intermediate_states else None,
                      bool(output_final_state), cp)


def _cp_context(ctx: Any, q: Any, initial_state: Any, output_final_state: bool, return_intermediate_states: bool,
                use_graph: bool) -> Any:
    """kdagen's context of a chunk_kda call's cp_context, after fla's rules for one."""
    from .cp import CPContext, _context, _is_fla_context

    if not isinstance(ctx, CPContext) and not _is_fla_context(ctx):
        raise KdaInputError(f"cp_context: expected fla's FLACPContext (fla.ops.cp.build_cp_context) or a "
                            f"kdagen.cp.CPContext, found {type(ctx).__name__}")
    if initial_state is not None or output_final_state:
        raise KdaInputError("initial_state / output_final_state: expected None / False with cp_context (fla's "
                            "chunk_kda takes no states with context parallelism; kdagen.kda_prefill does)")
    if use_graph:
        raise KdaInputError("cp_context: expected None with use_graph (not implemented by kdagen together)")
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[0] != 1:
        raise KdaInputError(f"q: expected B = 1 with cp_context (the rank's packed tokens), found shape "
                            f"{tuple(q.shape)}")
    return _context(ctx)


def _kernel_kw(t: Translated, kernel_chunk: Optional[int]) -> dict:
    if kernel_chunk is None:
        return t.kw
    return dict(t.kw, return_chunk_states=_stride(t, kernel_chunk), chunk_size=kernel_chunk)


def _stride(t: Translated, kernel_chunk: int) -> int:
    """The kernel's chunk-state stride for fla's intermediate states: one state per fla chunk
    (with a context, from each local piece's start: kdagen.cp's "piece" grid)."""
    return t.inter_chunk // kernel_chunk


def run(t: Translated):
    """Run a translated call; returns what fla's chunk_kda returns."""
    from .runtime import kda_prefill

    chunks = t.kernel_chunks()
    for i, c in enumerate(chunks):
        try:
            if t.cp is not None:  # chunk states on each local piece's own grid, as fla's with a context
                from .cp import kda_prefill_cp

                res = kda_prefill_cp(*t.tensors, cp_context=t.cp, chunk_grid="piece", **_kernel_kw(t, c))
            else:
                res = kda_prefill(*t.tensors, **_kernel_kw(t, c))
            break
        except NoVariantError:
            if i == len(chunks) - 1:
                raise
    o, fs = res[0], res[1] if t.output_final_state else None
    if t.inter_chunk is None:
        return o, fs
    return o, fs, _intermediate(t, res[2], c * _stride(t, c))


def plan(t: Translated) -> None:
    """Select (and if need be build) the variant a translated call needs, without running it;
    raises NoVariantError / KdaInputError as run() would."""
    from .runtime import prepare

    if t.cp is not None and not t.cp.pieces:
        return
    chunks = t.kernel_chunks()
    for i, c in enumerate(chunks):
        kw = _kernel_kw(t, c)
        if t.cp is not None:  # the rank's pieces as one varlen call: the variant the scan's calls take
            cu = torch.tensor(t.cp.local_cu, dtype=torch.int32)
            kw = dict(kw, cu_seqlens=cu.to(t.tensors[0].device), cu_seqlens_cpu=cu)
        try:
            prepare(*t.tensors, **kw)
            return
        except NoVariantError:
            if i == len(chunks) - 1:
                raise


def _intermediate(t: Translated, cs: torch.Tensor, spacing: int) -> torch.Tensor:
    """fla's h: the state entering every chunk of fla's chunk size, [B, NT, HV, *state], k's dtype,
    from the kernel's chunk states `spacing` tokens apart."""
    q, k = t.tensors[0], t.tensors[1]
    B, T = q.shape[0], q.shape[1]
    cu, cu_cpu = t.kw["cu_seqlens"], t.kw["cu_seqlens_cpu"]
    if t.cp is not None:  # the rank's local pieces
        cu = cu_cpu = torch.tensor(t.cp.local_cu)
    S = t.inter_chunk
    if S != spacing:
        lens = host_lengths(B, T, cu, cu_cpu, "return_intermediate_states")
        positions = [list(range(0, L, S)) for L in lens]
        first, dst = [], 0
        for p in positions:
            first.append(dst)
            dst += len(p)
        out = cs.new_empty((dst, *cs.shape[1:]))
        rows(lens, spacing, positions, first, cs.device).copy(out, cs, None)
        cs = out
    h = cs.to(k.dtype)
    return h.unsqueeze(0) if cu is not None else h.view(B, -(-T // S), *cs.shape[1:])


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
              output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
              use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
              allow_neg_eigval: bool = False, safe_gate: bool = False, lower_bound: Optional[float] = None,
              disable_recompute: bool = False, return_intermediate_states: bool = False,
              state_v_first: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
              cu_seqlens_cpu: Optional[torch.Tensor] = None, cp_context: Any = None, use_graph: bool = False,
              max_num_seqs: Optional[int] = None, **kwargs: Any) -> tuple[Optional[torch.Tensor], ...]:
    """fla's chunk_kda (fla-core 0.6) on kdagen's kernels: same keywords, same meaning, same
    returns ((o, final_state), or (o, final_state, h) with return_intermediate_states).
    Forward only: inputs that require grad under grad mode are rejected. A_log / dt_bias /
    chunk_size come as keywords, as in fla."""
    t = translate(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                  use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
                  disable_recompute, return_intermediate_states, state_v_first, cu_seqlens, cu_seqlens_cpu,
                  cp_context, use_graph, max_num_seqs, **kwargs)
    return run(t)
