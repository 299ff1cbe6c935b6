"""Tensor maps (TMA descriptors) for the sm90 pair's copies (templates/sm90/kda_sm90_tma.cuh).

An image built with tensor-map copies takes `struct KdaParams90 { KdaParams p; KdaTmap tm[4]; }`: the
parameters, then one 128-byte CUtensorMap per input (q, k, g, v). Each map views its tensor as 4D (K or V,
time, heads, batch) with the element strides the parameter struct carries and copies boxes of one chunk's rows
of one head. The maps are encoded from the filled KdaParams, so every launch path (the launcher, the A/B and
stamp scripts) gets them alike. Encoding goes through the driver's cuTensorMapEncodeTiled (libcuda by ctypes:
a map is plain bytes in the argument) and is cached per (address, shape, strides).
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from typing import Any

from .launch_shim import LIBCUDA

TMAP_BYTES = 128
# CUtensorMapDataType, CUtensorMapSwizzle, CUtensorMapL2promotion (cuda.h)
_DT_UINT16, _DT_FLOAT32 = 1, 7
_SWIZZLE_NONE, _SWIZZLE_128B = 0, 3
_L2_128B = 2

_LIB: Any = None
_CACHE: "OrderedDict[tuple, bytes]" = OrderedDict()
_CACHE_MAX = 256


def _lib() -> Any:
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL(LIBCUDA)
        f = lib.cuTensorMapEncodeTiled
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                      ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                      ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                      ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        _LIB = lib
    return _LIB


def map_strides(dims: tuple[int, ...], strides: tuple[int, ...], elem: int) -> tuple[int, ...]:
    """The byte strides of dims 1.. as a tensor map takes them: a dimension of size 1 is never stepped, so
    whatever stride the tensor reports there (torch allows any) is replaced by one past the dimensions
    before it (a multiple of 16 whenever theirs are)."""
    out = []
    extent = -(-dims[0] * elem // 16) * 16
    for d, s in zip(dims[1:], strides):
        s = int(s)
        if d == 1:
            s = extent
        out.append(s)
        extent = max(extent, s * d)
    return tuple(out)


def encode(addr: int, dtype: int, dims: tuple[int, ...], strides: tuple[int, ...], box: tuple[int, ...],
           swizzle: int, who: str) -> bytes:
    """One tiled tensor map: dims (innermost first, elements), strides of dims 1.. (bytes), box (elements)."""
    key = (addr, dtype, dims, strides, box, swizzle)
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    for i, s in enumerate(strides):
        if s % 16 or s <= 0 or s >= 1 << 40:
            raise RuntimeError(f"{who}: a tensor-map stride must be a positive multiple of 16 bytes below 2^40, "
                               f"dimension {i + 1} has {s}")
    if addr % 16:
        raise RuntimeError(f"{who}: a tensor-map base address must be 16-byte aligned, found {addr:#x}")
    if any(d >= 1 << 32 or d < 1 for d in dims):
        raise RuntimeError(f"{who}: tensor-map dimensions must lie in [1, 2^32), found {dims}")
    n = len(dims)
    raw = (ctypes.c_char * (TMAP_BYTES + 64))()  # (the driver writes the map at a 64-byte aligned address)
    at = (ctypes.addressof(raw) + 63) // 64 * 64
    res = _lib().cuTensorMapEncodeTiled(
        at, dtype, n, ctypes.c_void_p(addr), (ctypes.c_uint64 * n)(*dims),
        (ctypes.c_uint64 * (n - 1))(*strides), (ctypes.c_uint32 * n)(*box), (ctypes.c_uint32 * n)(*([1] * n)),
        0, swizzle, _L2_128B, 0)
    if res != 0:
        raise RuntimeError(f"{who}: cuTensorMapEncodeTiled failed (CUresult {res}) for dims {dims}, strides "
                           f"{strides} bytes, box {box}")
    b = ctypes.string_at(at, TMAP_BYTES)
    _CACHE[key] = b
    if len(_CACHE) > _CACHE_MAX:
        _CACHE.popitem(last=False)
    return b


def tensor_maps(p: Any, k: int, v: int, chunk: int, in_size: int, who: str) -> bytes:
    """The four maps (q, k, g, v) for a filled KdaParams `p` (pointers, element strides (batch, time, head),
    B, T, H, HV, g_fp32); k, v: head dims; boxes of `chunk` rows (v: 64-column boxes, 128-byte swizzled)."""
    B, T, H, HV = int(p.B), int(p.T), int(p.H), int(p.HV)
    g_size = 4 if p.g_fp32 else 2

    def four(addr: int, inner: int, heads: int, st: Any, size: int, box0: int, dtype: int, swz: int) -> bytes:
        sb, stt, sh = (int(x) * size for x in st)
        dims = (inner, T, heads, B)
        return encode(int(addr), dtype, dims, map_strides(dims, (stt, sh, sb), size), (box0, chunk, 1, 1), swz, who)

    return b"".join((
        four(p.q, k, H, p.q_s, in_size, k, _DT_UINT16, _SWIZZLE_NONE),
        four(p.k, k, H, p.k_s, in_size, k, _DT_UINT16, _SWIZZLE_NONE),
        four(p.g, k, HV, p.g_s, g_size, k, _DT_FLOAT32 if g_size == 4 else _DT_UINT16, _SWIZZLE_NONE),
        four(p.v, v, HV, p.v_s, in_size, 64, _DT_UINT16, _SWIZZLE_128B),
    ))


def params90(params_type: type, p: Any, maps: bytes, offset: int, size: int) -> ctypes.Array:
    """The kernel's KdaParams90 as bytes in a ctypes buffer: p, then the maps at `offset` (the kernel's
    offsetof), `size` bytes in all (its sizeof)."""
    buf = (ctypes.c_char * size)()
    ctypes.memmove(buf, ctypes.addressof(p), ctypes.sizeof(params_type))
    ctypes.memmove(ctypes.addressof(buf) + offset, maps, len(maps))
    return buf
