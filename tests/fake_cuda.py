"""A stand-in for the CUDA driver and an sm80 module, so the sm80 host path (the general launch
and the bound one) runs on CPU tensors without a GPU: launches are recorded (kernel, grid,
block, shared memory, stream and every byte of the parameter struct) or, for timing, dropped.

Used by tests/test_fastpath.py (the bound launch against the general one) and by
scripts/host_overhead.py --stub (host cost on the CPU, driver and CUDA allocator left out).
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch

import kdagen.targets.sm80 as sm80
from kdagen.targets.cuda_launch import KdaParams
from kdagen.variant import Variant

STREAM = 7  # the raw stream handle torch's "current stream" has here
# (record size, smem prep, smem recur, threads prep, threads recur): what kda_meta would say
META = (1024, 5000, 6000, 128, 160)


class RecordingDriver:
    """cuLaunchKernel that records what it was given (record=False: only counts, for timing)."""

    def __init__(self, record: bool = True) -> None:
        self.record, self.launches, self.count = record, [], 0
        self.size = ctypes.sizeof(KdaParams)
        self.capturing = False  # what torch.cuda.is_current_stream_capturing() answers
        self.stream = STREAM  # the raw handle of torch's current stream

    def is_capturing(self) -> bool:
        return self.capturing

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        self.count += 1
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
def sm80_on_cpu(variant: Optional[Variant] = None,
                record: bool = True) -> Iterator[tuple[sm80.Sm80Launcher, RecordingDriver]]:
    """An Sm80Launcher of `variant` (default: bf16 K=V=64) over the fake module and driver, with
    torch's CUDA stream queries answered for CPU tensors; everything restored on exit."""
    variant = variant or Variant("sm80", 16, 64, 64, "bf16", "bounded", "fp32", 32)
    drv = RecordingDriver(record)
    mod = RecordingModule(drv)
    la = sm80.Sm80Launcher(variant, Path("unused.fatbin"))
    la._module = lambda dev: (0, (mod, "kda_prep", "kda_recur", *META))
    stream = type("Stream", (), {"cuda_stream": STREAM})()
    saved = [(sm80, n, getattr(sm80, n)) for n in ("driver", "driver_binding", "raw_stream_query", "capture_query",
                                                   "_sm_count")]
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
        sm80.Sm80Bound.drop_arenas()


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
