"""A stand-in for the CUDA driver and an sm80 module, so the sm80 host path (the general launch
and the bound one) runs on CPU tensors without a GPU: launches are recorded (kernel, grid,
block, shared memory, stream and every byte of the parameter struct) or, for timing, dropped.

With shim=True the bound launch goes through the real launch shim (kdagen/targets/launch_shim.c,
compiled here) over tests/fake_libcuda.c, a C stand-in for libcuda's cuLaunchKernel that hands
every launch's arguments, as the C ABI passed them, to the same record.

Used by tests/test_fastpath.py (the bound launch against the general one) and by
scripts/host_overhead.py --stub (host cost on the CPU, driver and CUDA allocator left out).
"""

from __future__ import annotations

import atexit
import ctypes
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Optional

import torch

import kdagen.targets.sm80 as sm80
from kdagen.targets.cuda_launch import KdaParams
from kdagen.variant import Variant

STREAM = 7  # the raw stream handle torch's "current stream" has here
# (record size, smem prep, smem recur, threads prep, threads recur): what kda_meta would say
META = (1024, 5000, 6000, 128, 160)


class FakeFunc(str):
    """A kernel handle: its name in the record, a number where C needs one (int())."""

    def __int__(self) -> int:
        return FUNC_HANDLES[self]


FUNC_HANDLES = {"kda_prep": 0x1000, "kda_recur": 0x2000, "kda_fused": 0x3000, "kda_fused_slots": 0x4000}
FUNCS = {n: FakeFunc(n) for n in FUNC_HANDLES}
_BY_HANDLE = {h: FUNCS[n] for n, h in FUNC_HANDLES.items()}
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_void_p)


@lru_cache(maxsize=None)
def fake_shim():
    """(the launch shim over tests/fake_libcuda.c, the stand-in library), both compiled once per
    process into a temporary folder."""
    from kdagen.targets import launch_shim

    cc = launch_shim.compiler()
    if cc is None:
        raise RuntimeError("tests/fake_cuda.py: no C compiler for the launch shim's stand-in driver")
    folder = Path(tempfile.mkdtemp(prefix="kdagen-fake-cuda-"))
    atexit.register(shutil.rmtree, folder, True)
    lib = folder / "fake_libcuda.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(Path(__file__).with_name("fake_libcuda.c"))],
                   check=True, capture_output=True)
    shim = launch_shim.Shim(launch_shim.build(folder), libcuda=str(lib))
    clib = ctypes.CDLL(str(lib))
    clib.fake_set_callback.argtypes = [_CALLBACK]
    clib.fake_launches.restype = ctypes.c_longlong
    clib.fake_fail.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return shim, clib


class RecordingDriver:
    """cuLaunchKernel that records what it was given (record=False: only counts, for timing)."""

    def __init__(self, record: bool = True) -> None:
        self.record, self.launches, self.count = record, [], 0
        self.size = ctypes.sizeof(KdaParams)
        self.capturing = False  # what torch.cuda.is_current_stream_capturing() answers
        self.stream = STREAM  # the raw handle of torch's current stream
        self.failing: dict[str, list[int]] = {}  # kernel -> [launches left to fail, CUresult]
        self.clib = None  # the C stand-in, where the bound launch goes through the shim
        self.callback = _CALLBACK(self._from_c)  # kept alive as long as the driver

    def is_capturing(self) -> bool:
        return self.capturing

    def fail(self, kernel: str, times: int, code: int) -> None:
        """The next `times` bound launches of `kernel` return `code` (in tests/fake_libcuda.c
        where the shim is on); the general path's launches (RecordingModule) never fail."""
        if self.clib is not None:
            self.clib.fake_fail(FUNC_HANDLES[kernel], times, code)
        else:
            self.failing[kernel] = [times, code]

    def _from_c(self, f, gx, gy, gz, bx, by, bz, smem, stream, argv, extra) -> int:
        """A launch the shim made through tests/fake_libcuda.c, recorded as cuLaunchKernel's."""
        return self.cuLaunchKernel(_BY_HANDLE.get(f, f), gx, gy, gz, bx, by, bz, smem, stream or 0, argv,
                                   extra)[0]

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        self.count += 1
        left = self.failing.get(f)
        if left and left[0] > 0:
            left[0] -= 1
            return (left[1],)
        if self.record:
            struct_addr = ctypes.cast(argv, ctypes.POINTER(ctypes.c_void_p))[0]
            self.launches.append((f, (gx, gy, gz), (bx, by, bz), smem, stream,
                                  ctypes.string_at(struct_addr, self.size)))
        return (0,)

    def CUstream(self, raw):
        return raw


class RecordingModule:
    """A loaded module whose launches go to the driver's record, in the same form."""

    def __init__(self, drv: RecordingDriver) -> None:
        self.drv = drv

    def launch(self, func, grid, block, smem, stream, params, what):
        self.drv.count += 1
        if self.drv.record:
            self.drv.launches.append((func, tuple(grid), tuple(block), smem, stream, bytes(params)))

    def function(self, name, smem=0):
        return name


@contextmanager
def sm80_on_cpu(variant: Optional[Variant] = None, record: bool = True,
                shim: bool = False) -> Iterator[tuple[sm80.Sm80Launcher, RecordingDriver]]:
    """An Sm80Launcher of `variant` (default: bf16 K=V=64) over the fake module and driver, with
    torch's CUDA stream queries answered for CPU tensors; everything restored on exit. shim: bound
    launches go through the launch shim over tests/fake_libcuda.c (record=False: it only counts)."""
    variant = variant or Variant("sm80", 16, 64, 64, "bf16", "bounded", "fp32", 32)
    drv = RecordingDriver(record)
    mod = RecordingModule(drv)
    la = sm80.Sm80Launcher(variant, Path("unused.fatbin"))
    la._module = lambda dev: (0, (mod, FUNCS["kda_prep"], FUNCS["kda_recur"], *META))
    stream = type("Stream", (), {"cuda_stream": STREAM})()
    saved = [(sm80, n, getattr(sm80, n)) for n in ("driver", "driver_binding", "raw_stream_query", "capture_query",
                                                   "_sm_count", "shim_state")]
    if shim:
        the_shim, drv.clib = fake_shim()
        drv.clib.fake_set_callback(drv.callback if record else _CALLBACK())
        drv.clib.fake_fail(None, 0, 0)
        sm80.shim_state = lambda: (the_shim, the_shim.describe() + " over tests/fake_libcuda.c")
    else:
        sm80.shim_state = lambda: (None, "tests/fake_cuda.py has the shim off")
    saved += [(torch.cuda, n, getattr(torch.cuda, n)) for n in ("current_stream", "is_current_stream_capturing")]
    sm80.driver = lambda: drv
    sm80.driver_binding = lambda: "the stand-in driver of tests/fake_cuda.py (launches dropped)"
    sm80.raw_stream_query = lambda: (lambda idx: drv.stream)
    sm80.capture_query = lambda: (lambda: drv.is_capturing())
    sm80._sm_count = lambda device: 132
    torch.cuda.current_stream = lambda device=None: stream
    torch.cuda.is_current_stream_capturing = lambda: drv.is_capturing()
    try:
        yield la, drv
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        if drv.clib is not None:
            drv.clib.fake_set_callback(_CALLBACK())  # no callback into a driver that is gone
        sm80.Sm80Bound.drop_arenas()


SMEM90, NT90 = 200000, 512  # what sm90's kda_meta would say


@contextmanager
def sm90_on_cpu(variant: Variant, shim: bool = False) -> Iterator[tuple[object, RecordingDriver]]:
    """An Sm90Launcher of `variant` over the fake module and driver (the sm80 pieces its bound launch shares,
    patched as sm80_on_cpu patches them): kda_fused (and, with a state, kda_fused_slots) with SMEM90 bytes and
    NT90 threads, heads along x."""
    import kdagen.targets.sm90 as sm90

    with sm80_on_cpu(shim=shim) as (_la80, drv):
        la = sm90.Sm90Launcher(variant, Path("unused.fatbin"))
        mod = RecordingModule(drv)
        la._module = lambda dev: (mod, FUNCS["kda_fused"], SMEM90, NT90, True,
                                  FUNCS["kda_fused_slots"] if la.pool_indices else None)
        yield la, drv


@contextmanager
def route_launcher(la) -> Iterator[None]:
    """Every registry entry launches through `la` (selection still runs, on the CPU): so
    kdagen.kda_prefill drives the fake sm80 launcher end to end."""
    import kdagen.registry as registry

    real = registry.Registry.launcher
    registry.Registry.launcher = lambda self, name, device_key: la
    try:
        yield
    finally:
        registry.Registry.launcher = real
