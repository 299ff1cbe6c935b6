"""Launcher for the Triton twin of the Ascend kernel (templates/triton/kda_twostage.py.j2).

The twin runs the Ascend kernel's stage decomposition (stage 1 per (chunk, head) into an fp32
workspace, stage 2 the V-split recurrence) under the Triton CPU interpreter
(TRITON_INTERPRET=1) or on a GPU. It is a separate implementation of the algorithm: the Ascend
kernel itself is checked by running its own program on the DSL model (kdagen.ascend_sim).
Like the Ascend kernel it works in groups of G chunks (G from ``ascend.group_chunks``, the same
rule): stage 1 for the group's chunks, stage 2 over them, with one group-sized workspace reused
and the fp32 state carried between groups.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Optional

import torch

from ..dtypes import GATE_IDS
from .ascend import group_chunks
from . import TARGETS
from .loader import load_generated_module


@dataclass(frozen=True)
class TwinSettings:
    """group_chunks: chunks per group (None: ``ascend.group_chunks``, the Ascend kernel's rule)."""

    group_chunks: Optional[int] = None


# The largest head dim whose stage 2 fits a CUDA block's shared memory (see __call__): the
# target's TargetInfo.device_max_k, which dispatch reads too.
CUDA_MAX_K = next(k for dev, k, _ in TARGETS["triton_twin"].device_max_k if dev == "cuda")


class TritonTwinLauncher:
    def __init__(self, variant, artifact, settings: Optional[TwinSettings] = None):
        self.variant = variant
        path = pathlib.Path(artifact)
        self.source = path / "kernel.py" if path.is_dir() else path
        self.settings = settings or TwinSettings()
        self._mod = None
        self.last_group_chunks: Optional[int] = None

    def _chunks(self, call):
        C = self.variant.chunk
        if call.cu_seqlens is not None:
            cu = [int(x) for x in call.cu_seqlens.tolist()]
            seqs = [(0, cu[n], cu[n + 1] - cu[n]) for n in range(len(cu) - 1)]
        else:
            seqs = [(b, 0, call.T) for b in range(call.B)]
        info, starts = [], [0]
        for bidx, t0, length in seqs:
            for c0 in range(0, length, C):
                info.append((bidx, t0 + c0, min(C, length - c0)))
            starts.append(len(info))
        dev = call.q.device
        if not info:  # all sequences empty
            info.append((0, 0, 0))
        maxc = max(b - a for a, b in zip(starts[:-1], starts[1:]))
        return (torch.tensor(info, dtype=torch.int32, device=dev),
                torch.tensor(starts, dtype=torch.int32, device=dev), len(info), maxc)

    def __call__(self, call) -> None:
        v = self.variant
        if self._mod is None:
            self._mod = load_generated_module(self.variant.name, self.source)
        mod = self._mod
        if v.chunk != 64:
            raise ValueError(f"{v.name}: the twin implements chunk 64 only")
        if call.q.device.type == "cuda" and v.k > CUDA_MAX_K:
            # Measured with Triton 3.6 for sm_90: stage 2 needs 288 KB of shared memory at
            # K = 128 (180 KB at K = 64); a CUDA block has at most 227 KB.
            raise RuntimeError(f"{v.name}: the Ascend twin runs on CUDA GPUs only for K <= {CUDA_MAX_K} "
                               f"(its stage 2 needs more shared memory than a CUDA block has at K = {v.k}); "
                               "it runs on the CPU interpreter for every K")
        if call.K != v.k or call.V != v.v:
            raise ValueError(f"{v.name}: head dims K={call.K} V={call.V} do not match the variant")
        dev = call.q.device
        info, seq_chunks, NCT, _ = self._chunks(call)
        HV, N, K, V = call.HV, call.N, v.k, v.v
        G = self.settings.group_chunks or group_chunks(v.chunk, K, V, HV, NCT)
        G = max(1, min(G, NCT))
        self.last_group_chunks = G
        f32 = dict(device=dev, dtype=torch.float32)
        rows = G * HV * 64                       # one group's workspace, reused by every group
        ws = (torch.empty(rows, K, **f32), torch.empty(rows, K, **f32), torch.empty(rows, K, **f32),
              torch.empty(rows, V, **f32), torch.empty(rows, 64, **f32), torch.empty(G * HV, K, **f32))
        dummy = torch.zeros(1, **f32)
        A_log = call.A_log if call.A_log is not None else dummy
        dt_bias = call.dt_bias if call.dt_bias is not None else torch.zeros(HV, K, **f32)
        # the fp32 state carried between groups, [N, HV, V, K]
        if call.initial_state is not None:
            h0 = call.initial_state.transpose(-1, -2) if call.state_kv else call.initial_state
            st = h0.to(torch.float32, copy=True).contiguous().reshape(N, HV, V, K)   # never alias the input
        else:
            st = torch.zeros(N, HV, V, K, **f32)
        cs = call.chunk_states if call.chunk_states is not None else dummy
        cs_off = call.chunk_offsets if call.chunk_offsets is not None else seq_chunks
        for g0 in range(0, NCT, G):
            gn = min(G, NCT - g0)
            mod.kda_stage1[(gn, HV)](
                call.q, call.k, call.v, call.g, call.beta, A_log, dt_bias, info, *ws,
                *call.q_strides, *call.k_strides, *call.v_strides, *call.g_strides, *call.beta_strides,
                HV, HV // call.H, float(call.scale), float(call.lower_bound), g0,
                GATE_ID=GATE_IDS[v.gate], USE_L2=bool(call.use_qk_l2norm), BETA_MODE=call.beta_mode,
                K=K, V=V,
            )
            mod.kda_stage2[(N, HV, V // v.block_v)](
                call.o, info, seq_chunks, st, cs, cs_off, *ws,
                *call.o_strides, HV, g0, gn, max(1, int(call.chunk_stride)),
                HAS_CS=call.chunk_states is not None, STATE_KV=bool(call.state_kv),
                K=K, V=V, BV=v.block_v,
            )
        if call.final_state is not None:
            ht = st.transpose(-1, -2) if call.state_kv else st
            call.final_state.copy_(ht.reshape(call.final_state.shape))
