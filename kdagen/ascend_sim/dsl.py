"""The ``cannbotdsl`` names the Ascend kernels use, implemented on the model (see the package doc).

A generated kernel.py runs against this module unchanged: ``import cannbotdsl as cb`` binds here
when the source is loaded through ``launch.load_kernel_module``.
"""

from __future__ import annotations

import contextlib
from enum import IntEnum
from types import SimpleNamespace
from typing import Any

import numpy as np

from . import memory as M
from . import reg  # noqa: F401  (``from cannbotdsl import reg``)
from .machine import AIC, SUBBLOCKS, Grid, ModelError, PerSub, Stats, current, uniform
from .memory import MemLoc, View

dtypes = SimpleNamespace(float32=M.float32, bfloat16=M.bfloat16, float16=M.float16)
LAST_STATS: list[Stats] = []  # the most recent launch's counters (one element)
LAST_ALLOCATED: list[dict] = []  # bytes allocated per memory space by block 0


class ChannelKind(IntEnum):
    SameCore = 0
    CrossCore = 1


# ----------------------------------------------------------------------------- program structure

def jit(fn=None, **_kw):
    return fn if fn is not None else (lambda f: f)


def host(fn):
    return fn


def const_expr(x):
    if isinstance(x, PerSub):
        raise ModelError("const_expr of a subblock-dependent value")
    return x


def range_constexpr(*args):
    return range(*args)


def range(*args, **_kw):  # noqa: A001 - the DSL's name
    import builtins

    for a in args:
        if isinstance(a, PerSub):
            raise ModelError("a loop bound depends on the vector subblock (get_subblock_id): the model requires "
                             "both subblocks to run the same statements")
    return builtins.range(*args)


def target_version(*_a, **_k):
    return None


@contextlib.contextmanager
def vf(*_a, **_k):
    blk = current()
    blk.in_vf += 1
    try:
        yield
    finally:
        blk.in_vf -= 1


def get_block_idx() -> int:
    return current().bid


def get_block_num() -> int:
    return current().grid.blocks


def get_subblock_id() -> PerSub:
    return PerSub(builtins_range(SUBBLOCKS))


def get_subblock_dim() -> int:
    return SUBBLOCKS


def builtins_range(n):
    import builtins

    return builtins.range(n)


def global_sync_all() -> None:
    blk = current()
    blk.grid.sync(blk.bid)


def kernel(cls):
    """``@cb.kernel class K``: ``K(*consts)[blocks](*tensors)`` runs the program on ``blocks`` blocks,
    each with its own instance (so __init__'s on-chip declarations are per block)."""

    class _Configured:
        def __init__(self, *args, **kw):
            self._args, self._kw = args, kw

        def __getitem__(self, blocks):
            def launch(*tensors):
                gm = [_as_gm(t, i) for i, t in enumerate(tensors)]
                stats = Stats()
                grid = Grid(int(blocks), stats)

                def body(_blk):
                    obj = cls(*self._args, **self._kw)
                    obj(*gm)

                grid.run(body)
                LAST_STATS[:] = [stats]
                LAST_ALLOCATED[:] = [dict(grid.allocated[0]) if grid.allocated else {}]
            return launch

    _Configured.__name__ = cls.__name__
    _Configured.program = cls
    return _Configured


def _as_gm(t, i: int) -> View:
    if isinstance(t, View):
        return t
    import torch

    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise ModelError(f"kernel argument {i}: expected a CPU torch tensor, found {type(t).__name__}")
    if t.dim() != 2:
        raise ModelError(f"kernel argument {i}: expected a 2-D tensor, found shape {tuple(t.shape)}")
    if t.dtype == torch.float32:
        return M.gm_tensor(t.numpy(), M.float32, f"arg{i}")
    if t.dtype in (torch.bfloat16, torch.float16):
        return M.gm_tensor(t.view(torch.int16).numpy().view(np.uint16), M.bfloat16 if t.dtype == torch.bfloat16
                           else M.float16, f"arg{i}")
    raise ModelError(f"kernel argument {i}: unsupported dtype {t.dtype}")


# ----------------------------------------------------------------------------- on-chip declarations

_names = {}


def _name(kind: str) -> str:
    blk = current()
    key = (id(blk), kind)
    _names[key] = _names.get(key, 0) + 1
    return f"{kind}{_names[key]}"


def Buffer(mem_loc, shape, dtype, *, data_format=None, **_kw) -> View:  # noqa: N802 - DSL name
    if MemLoc(mem_loc) == MemLoc.GM:
        raise ModelError("Buffer in GM")
    return M.alloc(MemLoc(mem_loc), tuple(shape), dtype, data_format, _name(f"{MemLoc(mem_loc).name}buf"))


class Channel:
    """A pool of ``depth`` slots with independent write and read cursors (DSL semantics:
    produce()/consume() select slot[cursor % depth] and advance; no fullness checks)."""

    def __init__(self, mem_loc, shape=None, dtype=None, *, depth, kind=ChannelKind.SameCore,
                 data_format=None, capacity=None, **_kw):
        mem_loc = MemLoc(mem_loc)
        if mem_loc == MemLoc.GM:
            raise ModelError("Channel in GM")
        if not isinstance(depth, int) or depth < 1:
            raise ModelError(f"Channel depth must be a positive int, got {depth!r}")
        if kind == ChannelKind.CrossCore and depth > 8:
            raise ModelError(f"cross-core Channel depth must be <= 8, got {depth}")
        shape = tuple(shape if shape is not None else capacity)
        self.name = _name(f"{mem_loc.name}ch")
        self.depth = depth
        self.kind = ChannelKind(kind)
        self.slots = []
        for i in builtins_range(depth):
            v = M.alloc(mem_loc, shape, dtype, data_format, f"{self.name}.slot{i}")
            v.slot = (self.name, i)
            self.slots.append(v)
        self._w = 0
        self._r = 0

    def _select(self, which: str) -> View:
        if current().in_vf:
            raise ModelError(f"{self.name}: Channel cursors must be advanced outside VF regions")
        if which == "w":
            i, self._w = self._w % self.depth, self._w + 1
        else:
            i, self._r = self._r % self.depth, self._r + 1
        return self.slots[i]

    def produce(self) -> View:
        return self._select("w")

    def consume(self) -> View:
        return self._select("r")

    @property
    def shape(self):
        return self.slots[0].shape

    @property
    def dtype(self):
        return self.slots[0].dtype


def tile_slice(input: View, tiler, coord) -> View:  # noqa: A002 - DSL name
    return input.tile(tuple(tiler), tuple(coord))


def reinterpret(input: View, dtype=None, shape=None, *, offset: int = 0, data_format=None, **_kw) -> View:  # noqa: A002
    """A zero-copy window of ``shape`` at ``offset`` bytes from ``input``'s first element, packed ND
    (or the NZ frame of ``shape`` with data_format="nz")."""
    if dtype is not None and dtype != input.dtype:
        raise ModelError("reinterpret with a dtype change is not modelled")
    if input.per_sub:
        raise ModelError("reinterpret of a subblock-dependent window")
    if shape is None:
        if data_format is not None or offset:
            raise ModelError("reinterpret without shape keeps the input view")
        return input
    nb = input.dtype.nbytes
    if offset % nb:
        raise ModelError(f"reinterpret offset {offset} is not a whole number of {input.dtype} elements")
    fmt = data_format or "nd"
    rows, cols = shape
    n = rows * cols if fmt == "nd" else M.nz_elements(rows, cols, M.c0_of(input.memloc, input.dtype))
    base = input.origin() + offset // nb
    if base + n > input.st.n:
        raise ModelError(f"reinterpret {shape} {fmt} at +{offset} B does not fit {input.describe()}")
    return View(input.st, fmt, rows, cols, base=base, slot=input.slot)


class _Engine:
    def __init__(self, **kw):
        unknown = set(kw) - {"format_transform", "split_axis", "transpose", "kind"}
        if unknown:
            raise ModelError(f"make_copy_engine options not modelled: {sorted(unknown)}")
        self.format_transform = kw.get("format_transform")
        self.split_axis = kw.get("split_axis")
        self.transpose = kw.get("transpose")


def make_copy_engine(**kw) -> _Engine:
    return _Engine(**kw)


# ----------------------------------------------------------------------------- data movement

_PATHS = {
    (MemLoc.GM, MemLoc.UB): "aiv", (MemLoc.UB, MemLoc.GM): "aiv", (MemLoc.UB, MemLoc.L1): "aiv",
    (MemLoc.UB, MemLoc.UB): "aiv", (MemLoc.GM, MemLoc.L1): "aic", (MemLoc.L1, MemLoc.L0A): "aic",
    (MemLoc.L1, MemLoc.L0B): "aic", (MemLoc.L0C, MemLoc.UB): "aic", (MemLoc.L0C, MemLoc.L1): "aic",
    (MemLoc.L0C, MemLoc.GM): "aic",
}


def _count(src: View, dst: View, n: int) -> None:
    blk = current()
    blk.grid.stats.bytes[(blk.phase, f"{src.memloc.name}->{dst.memloc.name}")] += n * dst.dtype.nbytes


def mem_copy(dst: View, src: View, *, engine: _Engine | None = None, transpose=None, dst_subblock=None,
             **kw) -> None:
    """Copy src to dst element by logical element (the DMA and fixpipe formats included)."""
    extra = {k: v for k, v in kw.items() if v not in (None, 0, False)}
    if extra:
        raise ModelError(f"mem_copy options not modelled: {sorted(extra)}")
    if not isinstance(dst, View) or not isinstance(src, View):
        raise ModelError("mem_copy of a non-tensor (a Channel must be selected with produce()/consume())")
    blk = current()
    sp, dp = src.memloc, dst.memloc
    unit = _PATHS.get((sp, dp))
    if unit is None:
        raise ModelError(f"mem_copy {sp.name} -> {dp.name} is not a path the hardware has "
                         f"({src.describe()} -> {dst.describe()})")
    if blk.in_vf and unit == "aic":
        raise ModelError(f"cube copy {sp.name} -> {dp.name} inside a VF region")
    transpose = bool(transpose or (engine is not None and engine.transpose))
    if transpose and dp not in (MemLoc.L0A, MemLoc.L0B):
        raise ModelError("transpose copies go from L1 to L0A/L0B")
    want = (src.cols, src.rows) if transpose else src.shape
    if dst.shape != want:
        raise ModelError(f"mem_copy shapes differ: {src.describe()}{' transposed' if transpose else ''} -> "
                         f"{dst.describe()}")
    fixpipe = sp == MemLoc.L0C
    if not fixpipe and src.dtype != dst.dtype:
        raise ModelError(f"mem_copy {src.describe()} ({src.dtype}) -> {dst.describe()} ({dst.dtype}): a DMA copies "
                         "bytes and does not convert dtypes (only the fixpipe out of L0C casts)")
    if fixpipe and dp == MemLoc.UB and dst.fmt != "nd":
        raise ModelError("the fixpipe writes UB in ND")
    if (sp, dp) == (MemLoc.UB, MemLoc.L1) and src.fmt != dst.fmt:
        raise ModelError(f"UB -> L1 copies bytes: {src.describe()} and {dst.describe()} must have one format")
    if (sp, dp) in ((MemLoc.GM, MemLoc.UB), (MemLoc.UB, MemLoc.GM)) and "nz" in (src.fmt, dst.fmt):
        raise ModelError("GM <-> UB copies are ND")
    if dp in (MemLoc.L0A, MemLoc.L0B) and src.fmt != "nz":
        raise ModelError("L1 -> L0 copies read NZ")
    n = src.rows * src.cols

    if unit == "aiv":
        written = []
        for s in builtins_range(SUBBLOCKS):
            M.gm_check_read(src, s, s)
            vals = src.read(s, s)
            if transpose:
                vals = vals.T
            if dp == MemLoc.GM:
                M.gm_write(dst, vals, s, s)
            elif dp == MemLoc.UB:
                dst.write(s, vals, s)
            else:  # L1, shared by the two subblocks
                idx = dst.flat(s)
                for pidx, pvals in written:
                    common, a, b = np.intersect1d(pidx, idx, return_indices=True)
                    if common.size and not np.array_equal(pvals.ravel()[a], vals.ravel()[b], equal_nan=True):
                        raise ModelError(f"both vector subblocks write {dst.describe()} with different values "
                                         "(a race on the NPU)")
                written.append((idx.ravel(), vals))
                dst.write(s, vals, s)
            _count(src, dst, n)
        return

    # the cube: one copy per block
    uniform(src.r0, "the copy's source window"), uniform(src.c0, "the copy's source window")
    uniform(dst.r0, "the copy's destination window"), uniform(dst.c0, "the copy's destination window")
    M.gm_check_read(src, AIC, 0)
    vals = src.read(AIC)
    if transpose:
        vals = vals.T
    if fixpipe and src.dtype != dst.dtype:
        vals = M.from_f32(M.to_f32(vals, src.dtype), dst.dtype)
    if dp == MemLoc.UB:
        if engine is not None and engine.split_axis is not None:
            if dst_subblock is not None:
                raise ModelError("a split fixpipe copy routes both halves itself; drop dst_subblock")
            ax = engine.split_axis
            half = dst.shape[ax] // 2
            for s in builtins_range(SUBBLOCKS):
                part = vals[s * half:(s + 1) * half] if ax == 0 else vals[:, s * half:(s + 1) * half]
                sub_view = dst.tile((half, dst.cols) if ax == 0 else (dst.rows, half), (s, 0) if ax == 0 else (0, s))
                sub_view.write(s, part)
        else:
            s = 0 if dst_subblock is None else uniform(dst_subblock, "dst_subblock")
            if s not in (0, 1):
                raise ModelError(f"dst_subblock must be 0 or 1, got {s}")
            dst.write(s, vals)
    elif dp == MemLoc.GM:
        M.gm_write(dst, vals, AIC, 0)
    else:
        dst.write(AIC, vals)
    _count(src, dst, n)


def matmul(dst: View, lhs: View, rhs: View, *, init=True, **kw) -> None:
    """dst[M, N] (+)= lhs[M, K] @ rhs[N, K]^T with fp32 accumulation (L0A x L0B -> L0C)."""
    if kw.get("bias") is not None:
        raise ModelError("matmul bias is not modelled")
    if (lhs.memloc, rhs.memloc, dst.memloc) != (MemLoc.L0A, MemLoc.L0B, MemLoc.L0C):
        raise ModelError(f"matmul operands must be L0A x L0B -> L0C, got {lhs.memloc.name} x {rhs.memloc.name} -> "
                         f"{dst.memloc.name}")
    blk = current()
    if blk.in_vf:
        raise ModelError("matmul inside a VF region")
    for v in (dst, lhs, rhs):
        uniform(v.r0, "a matmul operand window"), uniform(v.c0, "a matmul operand window")
    (m, n), (m2, k), (n2, k2) = dst.shape, lhs.shape, rhs.shape
    if m != m2 or n != n2 or k != k2:
        raise ModelError(f"matmul shapes: {dst.describe()} = {lhs.describe()} x {rhs.describe()}^T")
    if lhs.dtype != rhs.dtype or dst.dtype != M.float32:
        raise ModelError(f"matmul dtypes: {lhs.dtype} x {rhs.dtype} -> {dst.dtype}")
    a = M.to_f32(lhs.read(AIC), lhs.dtype)
    b = M.to_f32(rhs.read(AIC), rhs.dtype)
    with np.errstate(all="ignore"):
        prod = np.matmul(a, b.T)  # float32 in, float32 accumulation
        if not init:
            prod = dst.read(AIC) + prod
    dst.write(AIC, prod.astype(np.float32))
    st = blk.grid.stats
    st.cube_flops[blk.phase] += 2 * m * n * k
    st.matmuls[blk.phase] += 1


# ----------------------------------------------------------------------------- host-side names

class TensorSpec:
    def __init__(self, *a, **k):
        self.args = a


class Dim:
    def __init__(self, *a, **k):
        self.args = a

    def __mul__(self, o):
        return self

    __rmul__ = __add__ = __radd__ = __floordiv__ = __mul__


def compile(*_a, **_k):  # noqa: A001 - DSL name
    raise ModelError("cb.compile runs the NPU toolchain; the model runs the kernel class directly")


def __getattr__(name: str) -> Any:
    raise ModelError(f"cannbotdsl.{name} is not part of the model's DSL subset")
