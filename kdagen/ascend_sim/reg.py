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
    """Predicate lanes, [1, 64] (the same for both subblocks) or [2, 64]."""

    __slots__ = ("m", "full", "lanes")

    def __init__(self, m: np.ndarray):
        self.m = m
        self.full = bool(m.all())
        # active lane indices when both subblocks agree (the fast path of masked stores)
        self.lanes = np.nonzero(m[0])[0] if (m.shape[0] == 1 or (m[0] == m[1]).all()) else None


_ALL = Mask(np.ones((1, 64), dtype=bool))
_STRIDED: dict[int, np.ndarray] = {}


def _vf():
    blk = current()
    if not blk.in_vf:
        raise ModelError("vector register ops must run inside `with cb.vf():`")
    blk.grid.stats.vector_ops[blk.grid.phase] += 1


def _f32(r: Reg, what: str) -> np.ndarray:
    if not isinstance(r, Reg):
        raise ModelError(f"{what}: expected a register, got {type(r).__name__}")
    if r.dtype is not M.float32:
        raise ModelError(f"{what}: a {r.dtype} register used as fp32 (vcast it first)")
    return r.v


def _mask(m: Mask | None) -> Mask:
    if m is None:
        return _ALL
    if not isinstance(m, Mask):
        raise ModelError(f"expected a mask register, got {type(m).__name__}")
    return m


def _z(val: np.ndarray, m: Mask | None) -> Reg:
    mm = _mask(m)
    if mm.full:
        return Reg(val if val.dtype == np.float32 else val.astype(np.float32))
    return Reg(np.where(mm.m, val, np.float32(0)).astype(np.float32, copy=False))


def _ub(view: View, what: str) -> View:
    if not isinstance(view, View) or view.memloc != MemLoc.UB:
        raise ModelError(f"{what}: vector ops read and write UB, got "
                         f"{view.describe() if isinstance(view, View) else type(view).__name__}")
    return view


def _base(view: View, offset, what: str):
    """Flat element offset of the access for each subblock: an int when both agree, else a pair."""
    view.st.touched = True
    if not view.per_sub and not isinstance(offset, PerSub):
        o = view.origin(0) + offset
        if (o * view.dtype.nbytes) % 32:
            raise ModelError(f"{what} at element {o} of {view.describe()} is not 32-byte aligned")
        return o
    os_ = tuple(view.origin(s) + at(offset, s) for s in range(SUBBLOCKS))
    for o in os_:
        if (o * view.dtype.nbytes) % 32:
            raise ModelError(f"{what} at element {o} of {view.describe()} is not 32-byte aligned")
    return os_


def _bounds(view: View, lo: int, hi: int, what: str) -> None:
    if lo < 0 or hi > view.st.n:
        raise ModelError(f"{what} touches elements {lo}..{hi - 1} of {view.describe()} (allocation of {view.st.n})")


def _load(view: View, offset, what: str) -> np.ndarray:
    o = _base(view, offset, what)
    d = view.st.data
    if isinstance(o, int):
        _bounds(view, o, o + LANES, what)
        return d[:, o:o + LANES].copy()
    out = np.empty((SUBBLOCKS, LANES), dtype=d.dtype)
    for s, os_ in enumerate(o):
        _bounds(view, os_, os_ + LANES, what)
        out[s] = d[s, os_:os_ + LANES]
    return out


def _store(view: View, offset, vals: np.ndarray, mask: Mask, what: str, pos: np.ndarray | None = None) -> None:
    """Write the mask's lanes of vals at offset (+ pos[lane] instead of + lane when given)."""
    mm = _mask(mask)
    o = _base(view, offset, what)
    d = view.st.data
    rel = np.arange(LANES) if pos is None else pos
    if isinstance(o, int) and mm.lanes is not None:
        lanes = mm.lanes
        if not lanes.size:
            return
        idx = o + rel[lanes]
        _bounds(view, int(idx[0]) if pos is None else int(idx.min()), int(idx[-1] if pos is None else idx.max()) + 1, what)
        d[:, idx] = vals[:, lanes]
        return
    for s in range(SUBBLOCKS):
        lanes = np.nonzero(mm.m[s if mm.m.shape[0] > 1 else 0])[0]
        if not lanes.size:
            continue
        idx = at(o, s) if isinstance(o, int) else o[s]
        idx = idx + rel[lanes]
        _bounds(view, int(idx.min()), int(idx.max()) + 1, what)
        d[s, idx] = vals[s, lanes]


# ----------------------------------------------------------------------------- masks

def create_mask(pattern: str = "all", elem_bits: int = 32) -> Mask:
    _vf()
    if elem_bits != 32 or pattern != "all":
        raise ModelError(f"create_mask({pattern!r}, {elem_bits}) is not modelled")
    return _ALL


_LANE = np.arange(LANES)


def update_mask(remaining, elem_bits: int = 32):
    _vf()
    if elem_bits != 32:
        raise ModelError("update_mask: only 32-bit masks are modelled")
    if isinstance(remaining, PerSub):
        m = np.stack([_LANE < at(remaining, s) for s in range(SUBBLOCKS)])
    else:
        m = (_LANE < remaining)[None, :]
    return Mask(m), remaining - LANES


def mask_and(lhs: Mask, rhs: Mask, *, exec_mask: Mask) -> Mask:
    _vf()
    return Mask(_mask(lhs).m & _mask(rhs).m & _mask(exec_mask).m)


def mask_not(src: Mask, *, exec_mask: Mask) -> Mask:
    _vf()
    return Mask(~_mask(src).m & _mask(exec_mask).m)


# ----------------------------------------------------------------------------- loads and stores

def vload(tensor: View, offset=0, *, post_update: bool = False) -> Reg:
    _vf()
    if post_update:
        raise ModelError("post_update loads are not modelled")
    _ub(tensor, "vload")
    if tensor.dtype is not M.float32:
        raise ModelError(f"vload of {tensor.describe()} ({tensor.dtype}): only fp32 loads are modelled "
                         "(use vload_unpack for 16-bit data)")
    return Reg(_load(tensor, offset, "vload"))


def vload_unpack(tensor: View, offset=0, *, unpack_mode, post_update: bool = False) -> Reg:
    _vf()
    _ub(tensor, "vload_unpack")
    if unpack_mode != UnpackMode.B16_TO_B32 or tensor.dtype.bits != 16:
        raise ModelError("vload_unpack: only B16_TO_B32 of a 16-bit buffer is modelled")
    return Reg(_load(tensor, offset, "vload_unpack"), tensor.dtype)


def vload_broadcast(tensor: View, offset=0, **kw) -> Reg:
    _vf()
    if any(v is not None and v is not False for v in kw.values()):
        raise ModelError(f"vload_broadcast options not modelled: {sorted(kw)}")
    _ub(tensor, "vload_broadcast")
    if tensor.dtype != M.float32:
        raise ModelError("vload_broadcast: only fp32 is modelled")
    tensor.st.touched = True
    out = np.empty((SUBBLOCKS, LANES), dtype=np.float32)
    for s in range(SUBBLOCKS):
        o = tensor.origin(s) + at(offset, s)
        if o < 0 or o >= tensor.st.n:
            raise ModelError(f"vload_broadcast of element {o} outside {tensor.describe()}")
        out[s] = tensor.st.data[s, o]
    return Reg(out)


def vstore(tensor: View, offset, value: Reg, mask: Mask, *, post_update: bool = False) -> None:
    _vf()
    _ub(tensor, "vstore")
    if post_update or tensor.dtype is not M.float32:
        raise ModelError(f"vstore into {tensor.describe()}: only plain fp32 stores are modelled")
    _store(tensor, offset, _f32(value, "vstore"), mask, "vstore")


def vstore_strided(tensor: View, offset, value: Reg, mask: Mask, *, block_stride, repeat_stride=0) -> None:
    """Scatter the register's 8 DataBlocks (8 fp32 lanes each) block_stride DataBlocks apart."""
    _vf()
    _ub(tensor, "vstore_strided")
    if tensor.dtype is not M.float32 or repeat_stride or isinstance(block_stride, PerSub):
        raise ModelError("vstore_strided: only fp32 with a uniform block_stride and repeat_stride 0 is modelled")
    pos = _STRIDED.get(block_stride)
    if pos is None:
        pos = _STRIDED[block_stride] = (_LANE // 8) * (block_stride * 8) + _LANE % 8
    _store(tensor, offset, _f32(value, "vstore_strided"), mask, "vstore_strided", pos)


def vstore_pack(tensor: View, offset, value: Reg, mask: Mask, *, pack_mode, post_update: bool = False) -> None:
    _vf()
    _ub(tensor, "vstore_pack")
    if pack_mode != PackMode.B32_TO_B16 or tensor.dtype.bits != 16 or post_update:
        raise ModelError("vstore_pack: only B32_TO_B16 into a 16-bit buffer is modelled")
    if not isinstance(value, Reg) or value.dtype != tensor.dtype:
        raise ModelError(f"vstore_pack of a {getattr(value, 'dtype', '?')} register into {tensor.describe()} "
                         f"({tensor.dtype}): vcast it first")
    _store(tensor, offset, value.v, mask, "vstore_pack")


def vmem_bar(mode: str = "vst_vld") -> None:
    _vf()


# ----------------------------------------------------------------------------- arithmetic

def vdups(value, dtype, *, mask: Mask | None = None, mode: str = "zeroing", merge=None) -> Reg:
    _vf()
    if dtype != M.float32 or mode != "zeroing":
        raise ModelError("vdups: only fp32 zeroing is modelled")
    if isinstance(value, PerSub):
        vals = np.stack([np.full(LANES, v, dtype=np.float32) for v in value.v])
    else:
        vals = np.full((SUBBLOCKS, LANES), value, dtype=np.float32)
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
        return Reg(bits if mm.full else np.where(mm.m, bits, np.uint16(0)), dtype)
    raise ModelError(f"vcast {src.dtype} -> {dtype} is not modelled")


def _bin(f, what):
    def op(lhs: Reg, rhs: Reg, *, mask: Mask, **kw) -> Reg:
        _vf()
        return _z(f(_f32(lhs, what), _f32(rhs, what)), mask)
    op.__name__ = what
    return op


def _un(f, what):
    def op(src: Reg, *, mask: Mask) -> Reg:
        _vf()
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
    prod = (_f32(lhs, "vmula") * _f32(rhs, "vmula")).astype(np.float32)
    return _z(_f32(acc, "vmula") + prod, mask)


def vreduce_sum(src: Reg, *, mask: Mask) -> Reg:
    """Sum of the active lanes into lane 0 (the other lanes zero)."""
    _vf()
    v = _f32(src, "vreduce_sum")
    mm = _mask(mask)
    out = np.zeros((SUBBLOCKS, LANES), dtype=np.float32)
    out[:, 0] = (v if mm.full else np.where(mm.m, v, np.float32(0))).sum(axis=1, dtype=np.float32)
    return Reg(out)


def vselect(src_true: Reg, src_false: Reg, *, cond_mask: Mask) -> Reg:
    _vf()
    return Reg(np.where(_mask(cond_mask).m, _f32(src_true, "vselect"), _f32(src_false, "vselect")).astype(np.float32))


def __getattr__(name: str):
    raise ModelError(f"cannbotdsl.reg.{name} is not part of the model's DSL subset")
