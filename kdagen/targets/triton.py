"""Launcher for the Triton target: allocates the workspace and calls the generated module's launch().

The generated module (templates/triton/kda_fused.py.j2) has a chunk-parallel prep that writes
one workspace record per (chunk, value head), for 16-bit variants an exact prep pass for the
chunks the prep flags (launched only for gates that need it), and the V-split recurrence that
reads the records. Launch configurations come from the template's defaults, overridden per GPU
by TUNING (measured on that GPU); nothing is tuned at call time.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch

from ..abi import KdaCall
from ..variant import Variant
from .loader import load_generated_module

# Measured launch configurations: {GPU name prefix: {(chunk, k, v, block_v): {option: value}}},
# options prep_warps, prep_stages, prep_maxnreg, recur_warps, recur_stages, recur_gam_next (the keyword
# arguments of the generated launch()). Empty until measured: the template defaults apply
# (chunk and block_v per regime come from `kdagen tune`'s file instead), e.g. for K = 128 the
# chunk-64 prep at 8 warps with 2 stages, the chunk-16 prep at 4 warps, the recurrence at
# 4 warps (8 at block_v 64) with 2 stages.
TUNING: dict[str, dict[tuple[int, int, int, int], dict[str, int]]] = {}

_WS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "none": torch.float32}


def tuned_config(variant: Variant, device: torch.device) -> dict[str, int]:
    """The measured launch options for this variant on this device ({} where none was measured)."""
    if device.type != "cuda":
        return {}
    name = torch.cuda.get_device_name(device)
    for prefix, table in TUNING.items():
        if name.startswith(prefix):
            return dict(table.get((variant.chunk, variant.k, variant.v, variant.block_v), {}))
    return {}


class TritonLauncher:
    def __init__(self, variant: Variant, artifact: Path) -> None:
        self.variant = variant
        self.module = load_generated_module(variant.name, artifact)
        # Which kernels to launch; benchmarks set ("prep",) or ("recur",) to time one alone.
        self.parts: tuple[str, ...] = ("prep", "recur")
        # Launch options forced by a caller (benchmarks comparing configurations); None: TUNING.
        self.config: Optional[dict[str, int]] = None
        self._dummies: dict[str, dict[str, torch.Tensor]] = {}
        self._tuned: dict[str, dict[str, int]] = {}
        self._ws_dtype = _WS_DTYPES[self.module.WS_DTYPE]

    def _device_state(self, dev: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        key = str(dev)
        d = self._dummies.get(key)
        if d is None:
            # Stand-ins for absent optional tensors, one dtype each, so that every call of a
            # variant hits the same compiled kernel. The fp32 one (absent A_log / dt_bias) is NaN:
            # a kernel that reads it by mistake poisons o instead of reading zeros that look right.
            d = {"i32": torch.zeros(16, dtype=torch.int32, device=dev),
                 "f32": torch.full((16,), float("nan"), dtype=torch.float32, device=dev),
                 "state": torch.zeros(16, dtype=_STATE_DTYPES[self.variant.state], device=dev)}
            self._dummies[key] = d
            self._tuned[key] = tuned_config(self.variant, dev)
        return d, self._tuned[key]

    def __call__(self, call: KdaCall) -> None:
        v, mod = self.variant, self.module
        if (call.K, call.V) != (v.k, v.v):
            raise RuntimeError(f"{v.name}: head dims K={call.K} V={call.V} do not match the variant")
        if call.twins != 1:
            raise RuntimeError(f"{v.name}: twins={call.twins}; the Triton kernels run one state per value head")
        if call.uses_pool_slots:
            raise RuntimeError(f"{v.name}: h0_index/ht_index given; the Triton kernels take no state pool slots "
                               f"(the runtime gathers and scatters a pool around them)")
        dev = call.q.device
        dummies, tuned = self._device_state(dev)
        cfg = tuned if self.config is None else self.config
        # Records: sequence n's chunks start at record (first token // C) + n, so
        # B*T // C + N + 1 records cover every chunk of every sequence. The Triton target takes
        # no caller workspace (workspace_size() is 0 for it): the buffer comes from torch.
        nrec = ((call.B * call.T) // v.chunk + call.N + 1) * call.HV
        # Three allocations cost less host time than views of one (slicing and view are ~5 us
        # each on a slow host, an allocation from the caching allocator ~4 us).
        ws = torch.empty(nrec * mod.REC, dtype=self._ws_dtype, device=dev)
        gam = torch.empty(nrec * mod.KP, dtype=torch.float32, device=dev)
        flags = torch.empty(nrec, dtype=torch.int32, device=dev)
        keep = None
        if call.chunk_states is not None and call.chunk_stride > 1:
            call, keep = every_chunk(call, v.chunk)
        mod.launch(call, ws, gam, flags, dummies, parts=self.parts, **cfg)
        if keep is not None:
            keep()
        # The buffers were allocated on the current stream, where the kernels run: no
        # record_stream needed.


def every_chunk(call: KdaCall, C: int) -> tuple[KdaCall, Callable[[], None]]:
    """A chunk_stride > 1 call as the Triton kernel runs it: every chunk's state into a scratch
    buffer, and the copy of the kept ones (chunks 0, m, 2m, ... of each sequence) into the
    caller's rows, on the device (no sync: capturable). The kernel keeps its store as it is: a
    strided one (a mask, a division or a branch in its loop) made the c64 K128 BV64 recurrence
    spill registers."""
    dev, N, m = call.q.device, call.N, call.chunk_stride
    if N == 0:
        return call, lambda: None
    if call.cu_seqlens is not None:
        lens = (call.cu_seqlens[1:] - call.cu_seqlens[:-1]).to(torch.int64)
    else:
        lens = torch.full((N,), call.T, dtype=torch.int64, device=dev)
    every = torch.zeros(N + 1, dtype=torch.int64, device=dev)
    torch.cumsum((lens + C - 1) // C, 0, out=every[1:])
    scratch = torch.empty(((call.B * call.T) // C + N, *call.chunk_states.shape[1:]), dtype=call.chunk_states.dtype,
                          device=dev)
    kept, out = call.chunk_offsets.to(torch.int64), call.chunk_states

    def copy() -> None:
        r = torch.arange(out.shape[0], device=dev)
        n = torch.searchsorted(kept[1:], r, right=True)  # the sequence owning row r (N: none)
        nc = n.clamp(max=N - 1)
        src = every[nc] + (r - kept[nc]) * m
        valid = (n < N) & (src < every[nc + 1])
        got = scratch.index_select(0, src.clamp(0, scratch.shape[0] - 1))
        out.copy_(torch.where(valid.view(-1, *([1] * (out.dim() - 1))), got, out))

    return replace(call, chunk_states=scratch, chunk_offsets=every.to(torch.int32), chunk_stride=1), copy
