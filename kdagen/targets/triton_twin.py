"""Launcher for the Triton twin of the Ascend kernel (templates/triton/kda_twostage.py.j2).

The twin runs the Ascend kernel's stage decomposition (stage 1 per (chunk, head) into an fp32
workspace, stage 2 the V-split recurrence) under the Triton CPU interpreter
(TRITON_INTERPRET=1) or on a GPU, so the algorithm the Ascend kernel encodes is checked
against the float64 reference in CI.
"""

from __future__ import annotations

import importlib.util
import pathlib

import torch

_GATE_ID = {"bounded": 0, "unbounded": 1, "precomputed": 2}


def _load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(f"kdagen_twin_{path.parent.name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class TritonTwinLauncher:
    def __init__(self, variant, artifact):
        self.variant = variant
        path = pathlib.Path(artifact)
        self.source = path / "kernel.py" if path.is_dir() else path
        self._mod = None

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
            self._mod = _load(self.source)
        mod = self._mod
        if v.chunk != 64:
            raise ValueError(f"{v.name}: the twin implements chunk 64 only")
        if call.K != v.k or call.V != v.v:
            raise ValueError(f"{v.name}: head dims K={call.K} V={call.V} do not match the variant")
        dev = call.q.device
        info, seq_chunks, NCT, maxc = self._chunks(call)
        HV = call.HV
        f32 = dict(device=dev, dtype=torch.float32)
        rows = NCT * HV * 64
        ws_qd = torch.empty(rows, v.k, **f32)
        ws_kr = torch.empty(rows, v.k, **f32)
        ws_w = torch.empty(rows, v.k, **f32)
        ws_u = torch.empty(rows, v.v, **f32)
        ws_m = torch.empty(rows, 64, **f32)
        ws_gc = torch.empty(NCT * HV, v.k, **f32)
        dummy = torch.zeros(1, **f32)
        A_log = call.A_log if call.A_log is not None else dummy
        dt_bias = call.dt_bias if call.dt_bias is not None else torch.zeros(HV, v.k, **f32)
        gate_id = _GATE_ID[v.gate]
        mod.kda_stage1[(NCT, HV)](
            call.q, call.k, call.v, call.g, call.beta, A_log, dt_bias, info,
            ws_qd, ws_kr, ws_w, ws_u, ws_m, ws_gc,
            *call.q_strides, *call.k_strides, *call.v_strides, *call.g_strides, *call.beta_strides,
            HV, HV // call.H, float(call.scale), float(call.lower_bound),
            GATE_ID=gate_id, USE_L2=bool(call.use_qk_l2norm), NEG_EIG=bool(call.allow_neg_eigval),
            K=v.k, V=v.v,
        )
        h0 = call.initial_state if call.initial_state is not None else dummy
        ht = call.final_state if call.final_state is not None else dummy
        cs = call.chunk_states if call.chunk_states is not None else dummy
        cs_off = call.chunk_offsets if call.chunk_offsets is not None else seq_chunks
        mod.kda_stage2[(call.N, HV, v.v // v.block_v)](
            call.o, info, seq_chunks, h0, ht, cs, cs_off,
            ws_qd, ws_kr, ws_w, ws_u, ws_m, ws_gc,
            *call.o_strides, HV, maxc,
            HAS_H0=call.initial_state is not None, HAS_HT=call.final_state is not None,
            HAS_CS=call.chunk_states is not None, STATE_KV=bool(call.state_kv),
            K=v.k, V=v.v, BV=v.block_v,
        )
