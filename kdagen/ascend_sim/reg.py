"""``cannbotdsl.reg``: 256-byte vector registers (64 fp32 lanes) on the model.

Every op runs for both vector subblocks at once: values are [2, 64] arrays. Masked arithmetic
zeroes the inactive lanes (the DSL's default "zeroing" mode); masked stores leave them alone.
"""

from __future__ import annotations

from enum import Enum

import numpy as np

from . import memory as M
from .machine import SUBBLOCKS, ModelError, PerSub, at, current
from .memory import MemLoc, View

LANES = 64  # fp32 lanes of a 256-byte register


class UnpackMode(Enum):
    B16_TO_B32 = "b16_to_b32"


class PackMode(Enum):
    B32_TO_B16 = "b32_to_b16"


class Reg:
    """A register: fp32 lanes, or 16-bit patterns in 32-bit lanes (after vload_unpack / vcast)."""

    __slots__ = ("v", "dtype")

    def __init__(self, v: np.ndarray, dtype=M.float32):
        self.v = v
        self.dtype = dtype


class Mask:
    __slots__ = ("m",)

    def __init__(self, m: np.ndarray):
        self.m = m


def _vf():
    blk = current()
    if not blk.in_vf:
        raise ModelError("vector register ops must run inside `with cb.vf():`")
    st = blk.grid.stats
    st.vector_ops[blk.phase] += 1


def _f32(r: Reg, what: str) -> np.ndarray:
    if not isinstance(r, Reg):
        raise ModelError(f"{what}: expected a register, got {type(r).__name__}")
    if r.dtype != M.float32:
        raise ModelError(f"{what}: a {r.dtype} register used as fp32 (vcast it first)")
    return r.v


def _mask(m: Mask | None) -> np.ndarray:
    if m is None:
        return np.ones((1, LANES), dtype=bool)
    if not isinstance(m, Mask):
        raise ModelError(f"expected a mask register, got {type(m).__name__}")
    return m.m


def _z(val: np.ndarray, m: Mask | None) -> Reg:
    mm = _mask(m)
    return Reg(np.where(mm, val, np.float32(0)).astype(np.float32, copy=False))


def _ub(view: View, what: str) -> View:
    if not isinstance(view, View) or view.memloc != MemLoc.UB:
        raise ModelError(f"{what}: vector ops read and write UB, got "
                         f"{view.describe() if isinstance(view, View) else type(view).__name__}")
    return view


def _addr(view: View, offset, s: int, n: int, what: str, lanes: np.ndarray | None = None) -> int:
    view.st.touched = True
    o = view.origin(s) + at(offset, s)
    if (o * view.dtype.nbytes) % 32:
        raise ModelError(f"{what} at element {o} of {view.describe()} is not 32-byte aligned")
    hi = o + n if lanes is None else o + int(lanes.max()) + 1 if lanes.size else o
    lo = o if lanes is None else o + (int(lanes.min()) if lanes.size else 0)
    if lo < 0 or hi > view.st.n:
        raise ModelError(f"{what} touches elements {lo}..{hi - 1} of {view.describe()} "
                         f"(allocation of {view.st.n})")
    return o


# ----------------------------------------------------------------------------- masks

def create_mask(pattern: str = "all", elem_bits: int = 32) -> Mask:
    _vf()
    if elem_bits != 32 or pattern != "all":
        raise ModelError(f"create_mask({pattern!r}, {elem_bits}) is not modelled")
    return Mask(np.ones((1, LANES), dtype=bool))


def update_mask(remaining, elem_bits: int = 32):
    _vf()
    if elem_bits != 32:
        raise ModelError("update_mask: only 32-bit masks are modelled")
    lanes = np.arange(LANES)
    m = np.stack([lanes < at(remaining, s) for s in range(SUBBLOCKS)])
    return Mask(m), remaining - LANES


def mask_and(lhs: Mask, rhs: Mask, *, exec_mask: Mask) -> Mask:
    _vf()
    return Mask(_mask(lhs) & _mask(rhs) & _mask(exec_mask))


def mask_not(src: Mask, *, exec_mask: Mask) -> Mask:
    _vf()
    return Mask(~_mask(src) & _mask(exec_mask))


# ----------------------------------------------------------------------------- loads and stores

def vload(tensor: View, offset=0, *, post_update: bool = False) -> Reg:
    _vf()
    if post_update:
        raise ModelError("post_update loads are not modelled")
    _ub(tensor, "vload")
    if tensor.dtype != M.float32:
        raise ModelError(f"vload of {tensor.describe()} ({tensor.dtype}): only fp32 loads are modelled "
                         "(use vload_unpack for 16-bit data)")
    out = np.empty((SUBBLOCKS, LANES), dtype=np.float32)
    for s in range(SUBBLOCKS):
        o = _addr(tensor, offset, s, LANES, "vload")
        out[s] = tensor.st.data[s, o:o + LANES]
    return Reg(out)


def vload_unpack(tensor: View, offset=0, *, unpack_mode, post_update: bool = False) -> Reg:
    _vf()
    _ub(tensor, "vload_unpack")
    if unpack_mode != UnpackMode.B16_TO_B32 or tensor.dtype.bits != 16:
        raise ModelError("vload_unpack: only B16_TO_B32 of a 16-bit buffer is modelled")
    out = np.empty((SUBBLOCKS, LANES), dtype=np.uint16)
    for s in range(SUBBLOCKS):
        o = _addr(tensor, offset, s, LANES, "vload_unpack")
        out[s] = tensor.st.data[s, o:o + LANES]
    return Reg(out, tensor.dtype)


def vload_broadcast(tensor: View, offset=0, **kw) -> Reg:
    _vf()
    if any(v is not None and v is not False for v in kw.values()):
        raise ModelError(f"vload_broadcast options not modelled: {sorted(kw)}")
    _ub(tensor, "vload_broadcast")
    if tensor.dtype != M.float32:
        raise ModelError("vload_broadcast: only fp32 is modelled")
    out = np.empty((SUBBLOCKS, LANES), dtype=np.float32)
    tensor.st.touched = True
    for s in range(SUBBLOCKS):
        o = tensor.origin(s) + at(offset, s)
        if o < 0 or o >= tensor.st.n:
            raise ModelError(f"vload_broadcast of element {o} outside {tensor.describe()}")
        out[s] = tensor.st.data[s, o]
    return Reg(out)


def vstore(tensor: View, offset, value: Reg, mask: Mask, *, post_update: bool = False) -> None:
    _vf()
    _ub(tensor, "vstore")
    if post_update or tensor.dtype != M.float32:
        raise ModelError(f"vstore into {tensor.describe()}: only plain fp32 stores are modelled")
    v = _f32(value, "vstore")
    mm = np.broadcast_to(_mask(mask), (SUBBLOCKS, LANES))
    for s in range(SUBBLOCKS):
        lanes = np.nonzero(mm[s])[0]
        o = _addr(tensor, offset, s, LANES, "vstore", lanes)
        tensor.st.data[s, o + lanes] = v[s, lanes]


def vstore_strided(tensor: View, offset, value: Reg, mask: Mask, *, block_stride, repeat_stride=0) -> None:
    """Scatter the register's 8 DataBlocks (8 fp32 lanes each) block_stride DataBlocks apart."""
    _vf()
    _ub(tensor, "vstore_strided")
    if tensor.dtype != M.float32 or repeat_stride:
        raise ModelError("vstore_strided: only fp32 with repeat_stride 0 is modelled")
    v = _f32(value, "vstore_strided")
    mm = np.broadcast_to(_mask(mask), (SUBBLOCKS, LANES))
    lane = np.arange(LANES)
    for s in range(SUBBLOCKS):
        pos = (lane // 8) * (at(block_stride, s) * 8) + lane % 8
        lanes = np.nonzero(mm[s])[0]
        o = _addr(tensor, offset, s, LANES, "vstore_strided", pos[lanes])
        tensor.st.data[s, o + pos[lanes]] = v[s, lanes]


def vstore_pack(tensor: View, offset, value: Reg, mask: Mask, *, pack_mode, post_update: bool = False) -> None:
    _vf()
    _ub(tensor, "vstore_pack")
    if pack_mode != PackMode.B32_TO_B16 or tensor.dtype.bits != 16 or post_update:
        raise ModelError("vstore_pack: only B32_TO_B16 into a 16-bit buffer is modelled")
    if not isinstance(value, Reg) or value.dtype != tensor.dtype:
        raise ModelError(f"vstore_pack of a {getattr(value, 'dtype', '?')} register into {tensor.describe()} "
                         f"({tensor.dtype}): vcast it first")
    mm = np.broadcast_to(_mask(mask), (SUBBLOCKS, LANES))
    for s in range(SUBBLOCKS):
        lanes = np.nonzero(mm[s])[0]
        o = _addr(tensor, offset, s, LANES, "vstore_pack", lanes)
        tensor.st.data[s, o + lanes] = value.v[s, lanes]


def vmem_bar(mode: str = "vst_vld") -> None:
    _vf()


# ----------------------------------------------------------------------------- arithmetic

def vdups(value, dtype, *, mask: Mask | None = None, mode: str = "zeroing", merge=None) -> Reg:
    _vf()
    if dtype != M.float32 or mode != "zeroing":
        raise ModelError("vdups: only fp32 zeroing is modelled")
    vals = np.stack([np.full(LANES, at(value, s), dtype=np.float32) for s in range(SUBBLOCKS)])
    return _z(vals, mask)


def vdup(src: Reg, *, mask: Mask, position: str = "lowest", mode: str = "zeroing", merge=None) -> Reg:
    _vf()
    if position != "lowest" or mode != "zeroing":
        raise ModelError("vdup: only the lowest lane, zeroing, is modelled")
    v = _f32(src, "vdup")
    return _z(np.repeat(v[:, :1], LANES, axis=1), mask)


def vcast(src: Reg, dtype, *, mask: Mask, rounding=None, saturate=False, reg_layout=None) -> Reg:
    _vf()
    if not isinstance(src, Reg):
        raise ModelError("vcast of a non-register")
    mm = _mask(mask)
    if src.dtype == dtype:
        return src
    if dtype == M.float32:
        return _z(M.to_f32(src.v, src.dtype), mask)
    if src.dtype == M.float32 and dtype in (M.bfloat16, M.float16):
        bits = M.from_f32(src.v, dtype)
        return Reg(np.where(mm, bits, np.uint16(0)), dtype)
    raise ModelError(f"vcast {src.dtype} -> {dtype} is not modelled")


def _bin(f, what):
    def op(lhs: Reg, rhs: Reg, *, mask: Mask, **kw) -> Reg:
        _vf()
        with np.errstate(all="ignore"):
            return _z(f(_f32(lhs, what), _f32(rhs, what)), mask)
    op.__name__ = what
    return op


def _un(f, what):
    def op(src: Reg, *, mask: Mask) -> Reg:
        _vf()
        with np.errstate(all="ignore"):
            return _z(f(_f32(src, what)), mask)
    op.__name__ = what
    return op


def _scalar(f, what):
    def op(src: Reg, scalar, *, mask: Mask) -> Reg:
        _vf()
        if isinstance(scalar, PerSub):
            sc = np.array([[np.float32(v)] for v in scalar.v], dtype=np.float32)
        else:
            sc = np.float32(scalar)
        with np.errstate(all="ignore"):
            return _z(f(_f32(src, what), sc), mask)
    op.__name__ = what
    return op


vadd = _bin(np.add, "vadd")
vsub = _bin(np.subtract, "vsub")
vmul = _bin(np.multiply, "vmul")
vdiv = _bin(np.divide, "vdiv")
vmax = _bin(np.maximum, "vmax")
vmin = _bin(np.minimum, "vmin")
vexp = _un(np.exp, "vexp")
vsqrt = _un(np.sqrt, "vsqrt")
vneg = _un(np.negative, "vneg")
vmuls = _scalar(np.multiply, "vmuls")
vadds = _scalar(np.add, "vadds")
vmaxs = _scalar(np.maximum, "vmaxs")
vmins = _scalar(np.minimum, "vmins")


def vmula(acc: Reg, lhs: Reg, rhs: Reg, *, mask: Mask) -> Reg:
    """acc + lhs * rhs, each step rounded to fp32."""
    _vf()
    with np.errstate(all="ignore"):
        prod = (_f32(lhs, "vmula") * _f32(rhs, "vmula")).astype(np.float32)
        return _z(_f32(acc, "vmula") + prod, mask)


def vreduce_sum(src: Reg, *, mask: Mask) -> Reg:
    """Sum of the active lanes into lane 0 (the other lanes zero)."""
    _vf()
    v = _f32(src, "vreduce_sum")
    mm = np.broadcast_to(_mask(mask), v.shape)
    out = np.zeros_like(v)
    with np.errstate(all="ignore"):
        out[:, 0] = np.where(mm, v, np.float32(0)).sum(axis=1, dtype=np.float32)
    return Reg(out)


def vselect(src_true: Reg, src_false: Reg, *, cond_mask: Mask) -> Reg:
    _vf()
    return Reg(np.where(_mask(cond_mask), _f32(src_true, "vselect"), _f32(src_false, "vselect")).astype(np.float32))


def __getattr__(name: str):
    raise ModelError(f"cannbotdsl.reg.{name} is not part of the model's DSL subset")
