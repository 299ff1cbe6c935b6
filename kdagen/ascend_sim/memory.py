"""Global memory, on-chip allocations and the 2-D views the kernel addresses them through.

Element storage: fp32 as float32, bf16/fp16 as their 16-bit patterns (uint16). A view maps its
logical (row, column) to a flat element offset of its storage: ND row-major with a pitch, or the
NZ fractal order the hardware uses (column blocks of 32 bytes, rows padded to 16; L0C blocks of 16
columns). UB has one storage per vector subblock; L1/L0 one per block; GM one per launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from .machine import AIC, SUBBLOCKS, ModelError, PerSub, at, current


class MemLoc(IntEnum):
    GM = 0
    UB = 1
    L1 = 2
    L0A = 3
    L0B = 4
    L0C = 5


@dataclass(frozen=True, eq=False)
class DType:
    """A dtype singleton (compared by identity)."""

    name: str
    bits: int

    @property
    def storage(self):
        return np.float32 if self.name == "float32" else np.uint16

    @property
    def nbytes(self) -> int:
        return self.bits // 8

    def __repr__(self) -> str:
        return f"dtypes.{self.name}"


float32 = DType("float32", 32)
bfloat16 = DType("bfloat16", 16)
float16 = DType("float16", 16)

NAN_BITS = {float32: np.float32(np.nan), bfloat16: np.uint16(0x7FC0), float16: np.uint16(0x7E00)}


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, NaN kept NaN (what vcast and the fixpipe do for fp32 -> bf16)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), r)


def to_f32(vals: np.ndarray, dt: DType) -> np.ndarray:
    if dt == float32:
        return vals.astype(np.float32, copy=False)
    if dt == bfloat16:
        return bf16_to_f32(vals)
    return vals.view(np.float16).astype(np.float32)


def from_f32(x: np.ndarray, dt: DType) -> np.ndarray:
    if dt == float32:
        return np.asarray(x, dtype=np.float32)
    if dt == bfloat16:
        return f32_to_bf16(x)
    return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)


class Storage:
    """Flat element storage of one memory space: [units, n] (units = 2 vector subblocks for UB)."""

    def __init__(self, space: MemLoc, dtype: DType, n: int, name: str, data: np.ndarray | None = None):
        self.space = space
        self.dtype = dtype
        self.name = name
        if data is None:
            units = SUBBLOCKS if space == MemLoc.UB else 1
            data = np.full((units, n), NAN_BITS[dtype], dtype=dtype.storage)
        self.data = data
        self.n = data.shape[1]
        self.touched = False  # read or written by the program (the translation drops unused buffers)
        # GM only: who wrote each element last, and in which phase (-1: before the launch)
        self.wunit: np.ndarray | None = None
        self.wphase: np.ndarray | None = None

    def unit_row(self, unit: int) -> np.ndarray:
        return self.data[unit if self.space == MemLoc.UB else 0]


def c0_of(space: MemLoc, dt: DType) -> int:
    """Columns per NZ fractal: 32 bytes, except L0C, whose fractals are 16 x 16."""
    return 16 if space == MemLoc.L0C else 32 // dt.nbytes


class View:
    """A logical [rows, cols] window of a Storage.

    fmt "nd": element (r, c) at base + (r0 + r) * pitch + c0 + c.
    fmt "nz": element (r, c) of the NZ frame (frame_rows x frame_cols at ``base``) at
      base + ((c0 + c) // C0) * (ceil16(frame_rows) * C0) + (r0 + r) * C0 + (c0 + c) % C0.
    r0/c0 may be PerSub (a window chosen by get_subblock_id).
    """

    def __init__(self, st: Storage, fmt: str, rows: int, cols: int, *, base: int = 0, pitch: int | None = None,
                 frame_rows: int | None = None, r0=0, c0=0, slot=None):
        self.st = st
        self.fmt = fmt
        self.rows = rows
        self.cols = cols
        self.base = base
        self.pitch = cols if pitch is None else pitch
        self.frame_rows = rows if frame_rows is None else frame_rows
        self.r0 = r0
        self.c0 = c0
        self.slot = slot  # (channel name, slot index) when selected from a Channel
        self._idx: dict[int, np.ndarray] = {}

    # -- the DSL surface the kernel reads
    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def dtype(self) -> DType:
        return self.st.dtype

    @property
    def memloc(self) -> MemLoc:
        return self.st.space

    @property
    def per_sub(self) -> bool:
        return isinstance(self.r0, PerSub) or isinstance(self.c0, PerSub)

    def describe(self) -> str:
        return f"{self.st.name}[{self.rows}x{self.cols} {self.fmt}]"

    # -- addressing
    def C0(self) -> int:
        return c0_of(self.st.space, self.st.dtype)

    def flat(self, s: int = 0) -> np.ndarray:
        """Flat storage offsets of the logical elements, [rows, cols], for subblock s."""
        self.st.touched = True
        key = s if self.per_sub else 0
        idx = self._idx.get(key)
        if idx is None:
            r0, c0 = at(self.r0, s), at(self.c0, s)
            r = np.arange(self.rows)[:, None] + r0
            c = np.arange(self.cols)[None, :] + c0
            if self.fmt == "nd":
                idx = self.base + r * self.pitch + c
            else:
                C0 = self.C0()
                rp = -(-self.frame_rows // 16) * 16
                idx = self.base + (c // C0) * (rp * C0) + r * C0 + c % C0
            if idx.size and (idx.min() < 0 or idx.max() >= self.st.n):
                raise ModelError(f"view {self.describe()} at ({r0}, {c0}) reaches outside {self.st.name} "
                                 f"({self.st.n} elements)")
            self._idx[key] = idx
        return idx

    def origin(self, s: int = 0) -> int:
        """Flat offset of logical (0, 0): where a vector op's offset 0 is."""
        r0, c0 = at(self.r0, s), at(self.c0, s)
        if self.fmt == "nd":
            return self.base + r0 * self.pitch + c0
        C0 = self.C0()
        rp = -(-self.frame_rows // 16) * 16
        return self.base + (c0 // C0) * (rp * C0) + r0 * C0 + c0 % C0

    def span_end(self) -> int:
        """One past the last flat element a vector op may touch through this view."""
        if self.fmt == "nd" and self.r0 == 0 and self.c0 == 0 and self.pitch == self.cols:
            return self.base + self.rows * self.cols
        return self.st.n

    def read(self, unit: int, s: int = 0) -> np.ndarray:
        return self.st.unit_row(unit)[self.flat(s)]

    def write(self, unit: int, vals: np.ndarray, s: int = 0) -> None:
        self.st.unit_row(unit)[self.flat(s)] = vals

    # -- windows
    def tile(self, tiler, coord) -> "View":
        if len(tiler) != 2 or len(coord) != 2:
            raise ModelError(f"tile_slice of {self.describe()}: the model supports 2-D tiles, got {tiler} at {coord}")
        tr, tc = tiler
        r0 = coord[0] * tr
        c0 = coord[1] * tc
        rows = min(tr, self.rows - at(r0, 0)) if not isinstance(r0, PerSub) else tr
        cols = min(tc, self.cols - at(c0, 0)) if not isinstance(c0, PerSub) else tc
        for s in range(SUBBLOCKS):
            rs, cs = at(r0, s), at(c0, s)
            if rs < 0 or cs < 0 or rs >= self.rows or cs >= self.cols or rows <= 0 or cols <= 0:
                raise ModelError(f"tile_slice {tiler} at {coord} is outside {self.describe()}")
            if self.st.space != MemLoc.GM and (rs + rows > self.rows or cs + cols > self.cols):
                raise ModelError(f"tile_slice {tiler} at {coord} overruns on-chip {self.describe()}")
        if self.fmt == "nz":
            C0 = self.C0()
            for s in range(SUBBLOCKS):
                rs, cs = at(r0, s), at(c0, s)
                if cs % C0 or (cols % C0 and cs + cols != self.cols):
                    raise ModelError(f"tile_slice {tiler} at {coord} of NZ {self.describe()}: columns not "
                                     f"aligned to its {C0}-column fractals")
                if (rs % 16 or rows % 16) and not (cols == self.cols and rows < 16):
                    raise ModelError(f"tile_slice {tiler} at {coord} of NZ {self.describe()}: rows not aligned "
                                     "to 16-row fractals")
        return View(self.st, self.fmt, rows, cols, base=self.base, pitch=self.pitch, frame_rows=self.frame_rows,
                    r0=self.r0 + r0, c0=self.c0 + c0, slot=self.slot)


def root_view(st: Storage, fmt: str, shape, slot=None) -> View:
    rows, cols = shape
    return View(st, fmt, rows, cols, slot=slot)


def nz_elements(rows: int, cols: int, C0: int) -> int:
    return -(-cols // C0) * (-(-rows // 16) * 16) * C0


def alloc(space: MemLoc, shape, dtype: DType, fmt: str | None, name: str) -> View:
    """One on-chip allocation (a Buffer, or one Channel slot) and its root view."""
    if len(shape) != 2:
        raise ModelError(f"{name}: the model supports 2-D on-chip tensors, got shape {shape}")
    if fmt is None:
        fmt = "nd" if space == MemLoc.UB else "nz"
    rows, cols = shape
    n = rows * cols if fmt == "nd" else nz_elements(rows, cols, c0_of(space, dtype))
    st = Storage(space, dtype, n, name)
    current().storages.append(st)
    return root_view(st, fmt, shape)


def gm_tensor(arr: np.ndarray, dtype: DType, name: str) -> View:
    """A 2-D GM tensor over ``arr`` (shared memory: kernel writes land in the caller's tensor)."""
    if arr.ndim != 2:
        raise ModelError(f"{name}: GM tensors are 2-D in the model, got {arr.shape}")
    rows, cols = arr.shape
    if not arr.flags.c_contiguous:
        raise ModelError(f"{name}: GM tensor must be contiguous")
    st = Storage(MemLoc.GM, dtype, rows * cols, name, data=arr.reshape(1, rows * cols))
    st.wunit = np.full(rows * cols, -1, dtype=np.int32)
    st.wphase = np.full(rows * cols, -1, dtype=np.int32)
    return root_view(st, "nd", (rows, cols))


def unit_id(unit: int) -> int:
    return current().bid * 3 + unit


def gm_check_read(view: View, unit: int, s: int) -> None:
    st = view.st
    if st.space != MemLoc.GM:
        return
    idx = view.flat(s)
    me = unit_id(unit)
    bad = (st.wphase[idx] == current().phase) & (st.wunit[idx] != me)
    if bad.any():
        who = int(st.wunit[idx][bad].flat[0])
        raise ModelError(f"{st.name}: {int(bad.sum())} elements read by block {current().bid} "
                         f"{unit_name(unit)} were written by block {who // 3} {unit_name(who % 3)} in the same "
                         f"phase (no global_sync_all between them: a race on the NPU)")


def gm_write(view: View, vals: np.ndarray, unit: int, s: int) -> None:
    st = view.st
    idx = view.flat(s)
    me = unit_id(unit)
    ph = current().phase
    clash = (st.wphase[idx] == ph) & (st.wunit[idx] != me)
    if clash.any() and not np.array_equal(st.data[0][idx][clash], vals[clash]):
        raise ModelError(f"{st.name}: block {current().bid} {unit_name(unit)} overwrites, with other values, "
                         f"elements another core wrote in the same phase (a race on the NPU)")
    st.data[0][idx] = vals
    st.wunit[idx] = me
    st.wphase[idx] = ph


def unit_name(unit: int) -> str:
    return "cube" if unit == AIC else f"vector subblock {unit}"
