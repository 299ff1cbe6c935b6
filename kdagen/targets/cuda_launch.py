"""Launcher pieces every CUDA target shares: the kernel parameter struct, input realignment and
the shared-memory check.

The ctypes mirror of `struct KdaParams` is derived from its one source, the C declaration in
templates/common/kda_common.cuh, field by field (tests/test_cuda_launch.py compiles the header
with nvcc and compares every field's offset and the struct's size).
"""

from __future__ import annotations

import ctypes
import re
from functools import lru_cache
from pathlib import Path

import torch

from ..paths import TEMPLATES_DIR

HEADER = TEMPLATES_DIR / "common" / "kda_common.cuh"

# C type of a KdaParams field -> ctypes type (pointers travel as 64-bit device addresses).
_CTYPES = {"long long": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}
_STRUCT = re.compile(r"struct\s+KdaParams\s*\{(?P<body>.*?)\};", re.S)
_NAME = re.compile(r"(?P<name>[A-Za-z_]\w*)(?:\[(?P<count>\d+)\])?")


def parse_params(text: str) -> list[tuple[str, object]]:
    """The (name, ctypes type) fields of `struct KdaParams` in C declaration order."""
    m = _STRUCT.search(text)
    if m is None:
        raise RuntimeError(f"{HEADER}: no `struct KdaParams {{ ... }};` found")
    fields: list[tuple[str, object]] = []
    body = re.sub(r"//[^\n]*", "", m.group("body"))  # comments first: they may hold a ';'
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        if "*" in decl:  # `const void* q`: every pointer is a 64-bit device address
            ctype, names, base = decl.rsplit("*", 1)[0], decl.rsplit("*", 1)[1], ctypes.c_uint64
        else:
            ctype = next((t for t in _CTYPES if decl.startswith(t + " ")), None)
            if ctype is None:
                raise RuntimeError(f"{HEADER}: KdaParams declaration {decl!r} has no ctypes mirror")
            names, base = decl[len(ctype):], _CTYPES[ctype]
        for item in names.split(","):
            n = _NAME.fullmatch(item.strip())
            if n is None:
                raise RuntimeError(f"{HEADER}: cannot read KdaParams field {item.strip()!r} of {decl!r}")
            count = int(n.group("count") or 1)
            fields.append((n.group("name"), base * count if count > 1 else base))
    return fields


@lru_cache(maxsize=None)
def params_struct(header: Path = HEADER) -> type:
    """The ctypes Structure mirroring `struct KdaParams` of `header`."""
    return type("KdaParams", (ctypes.Structure,), {"_fields_": parse_params(Path(header).read_text())})


KdaParams = params_struct()


def ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else int(t.data_ptr())


def aligned_btH(t: torch.Tensor, strides: tuple[int, int, int]) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """q/k/v/g are read 16 bytes at a time: data pointer and (batch, time, head) strides must be
    16-byte multiples. Rarely false; then copy to a compact tensor and recompute the strides."""
    eb = t.element_size()
    if t.data_ptr() % 16 == 0 and all((s * eb) % 16 == 0 for s in strides):
        return t, strides
    dims: list[int | None] = []
    for s in strides:  # which tensor dim carries batch / time / head
        cands = [d for d in range(t.dim() - 1) if t.stride(d) == s and d not in dims]
        dims.append(cands[0] if cands else None)
    c = t.clone(memory_format=torch.contiguous_format)  # a new allocation: aligned (contiguous() may be t)
    if None in dims or c.data_ptr() % 16:
        raise RuntimeError("cannot realign an input tensor to 16 bytes")
    return c, tuple(c.stride(d) for d in dims)  # type: ignore[arg-type]


def aligned_inputs(call, in_t: torch.dtype) -> tuple:
    """(q, q_s, k, k_s, v, v_s, g, g_s, beta) of a KdaCall as the CUDA kernels read them: rows
    16-byte aligned (aligned_btH), g and beta in the input dtype or fp32 (others cast to fp32)."""
    q, q_s = aligned_btH(call.q, call.q_strides)
    k, k_s = aligned_btH(call.k, call.k_strides)
    v, v_s = aligned_btH(call.v, call.v_strides)
    g = call.g if call.g.dtype in (in_t, torch.float32) else call.g.float()
    g, g_s = aligned_btH(g, call.g_strides)
    beta = call.beta if call.beta.dtype in (in_t, torch.float32) else call.beta.float()
    return q, q_s, k, k_s, v, v_s, g, g_s, beta


def check_call(call, v, twins_ok: bool = False, slots_ok: bool = False) -> None:
    """What every CUDA launcher checks of a KdaCall against its variant `v` (the runtime has
    validated the user's arguments; these catch a record built for another variant). twins_ok:
    the launcher runs KdaCall.twins == 2; slots_ok: its kernels read a state pool's slots
    (KdaCall.h0_index, ht_index)."""
    from ..dtypes import torch_dtype

    who = v.name
    if call.twins not in ((1, 2) if twins_ok else (1,)):
        raise RuntimeError(f"{who}: twins={call.twins}; this launcher runs "
                           f"{'1 or 2' if twins_ok else 'only 1'} state runs per value head")
    if not slots_ok and call.uses_pool_slots:
        # its kernels would read and write rows 0..N-1 of the pool, not the slots
        raise RuntimeError(f"{who}: h0_index/ht_index given; this launcher's kernels take no state pool slots "
                           f"(the runtime gathers and scatters a pool around them)")
    in_t = torch_dtype(v.dtype)
    for nm in ("q", "k", "v", "o"):
        t = getattr(call, nm)
        if t.dtype != in_t:
            raise RuntimeError(f"{who}: {nm} has dtype {t.dtype}, expected {in_t}")
    if (call.K, call.V) != (v.k, v.v):
        raise RuntimeError(f"{who}: K, V = {call.K}, {call.V}; variant has {v.k}, {v.v}")
    st_t = torch_dtype(v.state)
    for nm in ("initial_state", "final_state", "chunk_states"):
        t = getattr(call, nm)
        if t is not None and (t.dtype != st_t or not t.is_contiguous()):
            raise RuntimeError(f"{who}: {nm} must be contiguous {st_t}, found {t.dtype}")
    if v.state == "none" and (call.initial_state is not None or call.final_state is not None):
        raise RuntimeError(f"{who}: state 'none' variants take no initial/final state")
    if call.HV % call.H:
        raise RuntimeError(f"{who}: HV={call.HV} is not a multiple of H={call.H}")
    if v.gate != "precomputed" and call.A_log is None:
        raise RuntimeError(f"{who}: gate {v.gate!r} needs A_log")
    if call.chunk_states is not None and call.chunk_offsets is None:
        raise RuntimeError(f"{who}: chunk_states needs chunk_offsets")
    if call.chunk_stride < 1:
        raise RuntimeError(f"{who}: chunk_stride={call.chunk_stride}; expected >= 1")


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
