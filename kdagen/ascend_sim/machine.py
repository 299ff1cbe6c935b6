"""Blocks, subblocks and the order the model runs them in.

One launch runs ``blocks`` AI cores. Each block is a thread, but only one runs at a time: a block
runs until its next ``global_sync_all``, then hands over to the next block; when every block has
arrived, the phase number advances and block 0 resumes. Inside a block the program runs in order;
vector statements run for subblock 0 then subblock 1 (their scalars may differ: ``PerSub``).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

SUBBLOCKS = 2
AIC = 2  # unit id of the cube core; the vector subblocks are units 0 and 1


class ModelError(RuntimeError):
    """The kernel did something the hardware model forbids (or that would race on the NPU)."""


class _Abort(BaseException):
    """Unwinds a waiting block after another block failed."""


class PerSub:
    """An integer that differs between the two vector subblocks (from ``get_subblock_id``)."""

    __slots__ = ("v",)

    def __init__(self, v):
        self.v = v if type(v) is tuple else tuple(v)

    def at(self, s: int):
        return self.v[s]

    def _op(self, other, f):
        a0, a1 = self.v
        if isinstance(other, PerSub):
            b0, b1 = other.v
            return PerSub((f(a0, b0), f(a1, b1)))
        return PerSub((f(a0, other), f(a1, other)))

    def _rop(self, other, f):
        a0, a1 = self.v
        return PerSub((f(other, a0), f(other, a1)))

    def __add__(self, o): return self._op(o, lambda a, b: a + b)
    def __radd__(self, o): return self._rop(o, lambda a, b: a + b)
    def __sub__(self, o): return self._op(o, lambda a, b: a - b)
    def __rsub__(self, o): return self._rop(o, lambda a, b: a - b)
    def __mul__(self, o): return self._op(o, lambda a, b: a * b)
    def __rmul__(self, o): return self._rop(o, lambda a, b: a * b)
    def __floordiv__(self, o): return self._op(o, lambda a, b: a // b)
    def __rfloordiv__(self, o): return self._rop(o, lambda a, b: a // b)
    def __mod__(self, o): return self._op(o, lambda a, b: a % b)
    def __neg__(self): return PerSub(-a for a in self.v)

    def _cmp(self, o=None, f=None):
        raise ModelError("a comparison of a subblock-dependent value (get_subblock_id) decides control "
                         "flow: the model requires both vector subblocks to run the same statements")

    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _cmp

    def __bool__(self):
        self._cmp(None, None)

    def __index__(self):
        raise ModelError("a subblock-dependent value (get_subblock_id) is used as a loop bound or index")

    __int__ = __index__
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self):
        return f"PerSub{self.v}"


def at(x, s: int):
    """x for subblock s (x itself when it does not depend on the subblock)."""
    return x.at(s) if isinstance(x, PerSub) else x


def uniform(x, what: str):
    if isinstance(x, PerSub):
        raise ModelError(f"{what} depends on the vector subblock, but it runs on the cube (one per block)")
    return x


@dataclass
class Stats:
    """What one launch did, summed over blocks, per phase (the span between global syncs)."""

    cube_flops: Counter = field(default_factory=Counter)  # phase -> flops
    matmuls: Counter = field(default_factory=Counter)  # phase -> count
    bytes: Counter = field(default_factory=Counter)  # (phase, "src->dst") -> bytes
    vector_ops: Counter = field(default_factory=Counter)  # phase -> register ops (per subblock)
    global_syncs: int = 0

    def total_bytes(self, path: str) -> int:
        return sum(b for (_, p), b in self.bytes.items() if p == path)


class Block:
    """One AI core while its program runs: its id, its on-chip allocations, the VF state."""

    def __init__(self, grid: "Grid", bid: int):
        self.grid = grid
        self.bid = bid
        self.in_vf = 0
        self.storages: list = []  # on-chip allocations, in declaration order

    @property
    def allocated(self) -> Counter:
        """Bytes per memory space of the on-chip buffers the program used."""
        out: Counter = Counter()
        for st in self.storages:
            if st.touched:
                out[st.space] += st.n * st.dtype.nbytes
        return out

    @property
    def phase(self) -> int:
        return self.grid.phase


_local = threading.local()


def current() -> Block:
    blk = getattr(_local, "block", None)
    if blk is None:
        raise ModelError("a DSL operation ran outside a kernel launch")
    return blk


class Grid:
    """Runs ``body(block)`` on ``blocks`` blocks, one at a time, switching at global syncs."""

    def __init__(self, blocks: int, stats: Stats):
        if blocks < 1:
            raise ModelError(f"launch with {blocks} blocks")
        self.blocks = blocks
        self.stats = stats
        self.phase = 0
        self._cv = threading.Condition()
        self._turn = 0
        self._arrived = 0
        self._finished = [False] * blocks
        self._syncs = [0] * blocks
        self._error: BaseException | None = None
        self.allocated: list[Counter] = []

    def _next(self, b: int) -> int:
        for d in range(1, self.blocks + 1):
            n = (b + d) % self.blocks
            if not self._finished[n]:
                return n
        return b

    def _wait_turn(self, b: int) -> None:
        while self._turn != b and self._error is None:
            self._cv.wait()
        if self._error is not None:
            raise _Abort()

    def sync(self, b: int) -> None:
        with self._cv:
            self._syncs[b] += 1
            self._arrived += 1
            if self._arrived == self.blocks:
                self._arrived = 0
                self.phase += 1
                self.stats.global_syncs += 1
                self._turn = 0
            else:
                self._turn = self._next(b)
            self._cv.notify_all()
            self._wait_turn(b)

    def _worker(self, b: int, body: Callable[[Block], Any]) -> None:
        blk = Block(self, b)
        _local.block = blk
        with self._cv:
            try:
                self._wait_turn(b)
            except _Abort:
                return
        try:
            import numpy as np

            with np.errstate(all="ignore"):  # the kernel's inf/NaN follow IEEE, as on the NPU
                body(blk)
        except _Abort:
            return
        except BaseException as exc:  # noqa: BLE001 - re-raised by run()
            with self._cv:
                if self._error is None:
                    self._error = exc
                self._cv.notify_all()
            return
        finally:
            _local.block = None
            self.allocated.append(blk.allocated)
        with self._cv:
            self._finished[b] = True
            if self._arrived and self._error is None:
                self._error = ModelError(
                    f"block {b} finished after {self._syncs[b]} global syncs while other blocks wait at "
                    f"one: the blocks call global_sync_all different numbers of times (a hang on the NPU)")
            self._turn = self._next(b)
            self._cv.notify_all()

    def run(self, body: Callable[[Block], Any]) -> None:
        threads = [threading.Thread(target=self._worker, args=(b, body), daemon=True) for b in range(self.blocks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self._error is not None:
            raise self._error
        if len(set(self._syncs)) > 1:
            raise ModelError(f"blocks made different numbers of global syncs: {self._syncs}")
