"""Thin helpers over NVIDIA's cuda-bindings driver API: load a fatbin per device (cached),
look up kernels and globals, launch on torch's current stream, check every return code.

cuda-bindings is imported lazily so CPU-only machines can import this module.
"""

from __future__ import annotations

import ctypes
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

_DRV = None
_LOCK = threading.Lock()


def driver():
    """The cuda.bindings.driver module (imported on first use)."""
    global _DRV
    if _DRV is None:
        try:
            from cuda.bindings import driver as drv
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise RuntimeError(
                "kdagen CUDA targets need NVIDIA's Python bindings: pip install cuda-bindings"
            ) from e
        _DRV = drv
    return _DRV


@lru_cache(maxsize=None)
def driver_binding() -> str:
    """What the launches go through, for logs and benchmark tables ("cuda-bindings 13.0.1")."""
    try:
        from importlib.metadata import version

        return f"cuda-bindings {version('cuda-bindings')}"
    except Exception:  # pragma: no cover - depends on the machine
        return "cuda-bindings"


def raw_stream_query():
    """f(device_index) -> the CUstream handle of torch's current stream on that device, the cheap
    way (torch's own generated code asks so; torch.cuda.current_stream builds a Stream object per
    call)."""
    import torch

    return getattr(torch._C, "_cuda_getCurrentRawStream", None) or (lambda i: torch.cuda.current_stream(i).cuda_stream)


def capture_query():
    """f() -> whether torch's current CUDA stream is capturing a graph: torch's C entry where it
    has one (torch.cuda.is_current_stream_capturing is a Python frame around it)."""
    import torch

    return getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


_RAW_STREAM = None


def current_stream_handle(device_index: int) -> int:
    """The CUstream handle of torch's current stream on a device (raw_stream_query's answer)."""
    global _RAW_STREAM
    if _RAW_STREAM is None:
        _RAW_STREAM = raw_stream_query()
    return _RAW_STREAM(device_index)


_CAPTURING = None


def current_stream_capturing() -> bool:
    """Whether torch's current CUDA stream is capturing a graph (capture_query's answer)."""
    global _CAPTURING
    if _CAPTURING is None:
        _CAPTURING = capture_query()
    return _CAPTURING()


def check(res: Any, what: str, who: str):
    """Raise RuntimeError naming `who` (a variant) if a driver call failed; return its payload."""
    drv = driver()
    if isinstance(res, tuple):
        err, rest = res[0], res[1:]
    else:
        err, rest = res, ()
    if err != drv.CUresult.CUDA_SUCCESS:
        try:
            _, msg = drv.cuGetErrorString(err)
            msg = msg.decode() if isinstance(msg, bytes) else str(msg)
        except Exception:  # pragma: no cover
            msg = "?"
        name = getattr(err, "name", str(err))
        raise RuntimeError(f"{who}: {what} failed: {name} ({msg})")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


class PrimaryContext:
    """Makes the device's primary context (the one torch uses) current for a block."""

    _ctx: dict[int, Any] = {}

    def __init__(self, device_index: int, who: str):
        self.index = device_index
        self.who = who
        self.pushed = False

    def _get(self):
        drv = driver()
        with _LOCK:
            ctx = self._ctx.get(self.index)
            if ctx is None:
                check(drv.cuInit(0), "cuInit", self.who)
                dev = check(drv.cuDeviceGet(self.index), "cuDeviceGet", self.who)
                ctx = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain", self.who)
                self._ctx[self.index] = ctx
        return ctx

    def __enter__(self):
        drv = driver()
        ctx = self._get()
        cur = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent", self.who)
        if cur is None or int(cur) != int(ctx):
            check(drv.cuCtxPushCurrent(ctx), "cuCtxPushCurrent", self.who)
            self.pushed = True
        return self

    def __exit__(self, *exc):
        if self.pushed:
            check(driver().cuCtxPopCurrent(), "cuCtxPopCurrent", self.who)
            self.pushed = False
        return False


class LoadedModule:
    """A fatbin loaded into one device's primary context."""

    def __init__(self, image: bytes, device_index: int, who: str):
        self.who = who
        self.device_index = device_index
        self._image = image  # keep the bytes alive as long as the module
        self._funcs: dict[str, Any] = {}
        self._smem: dict[str, int] = {}  # dynamic shared memory each function is allowed
        with PrimaryContext(device_index, who):
            self.module = check(driver().cuModuleLoadData(image), "cuModuleLoadData", who)

    def function(self, name: str, max_dynamic_smem: int = 0):
        """The kernel `name`, allowed at least `max_dynamic_smem` bytes of dynamic shared memory
        (the attribute is raised when a later caller asks for more)."""
        f = self._funcs.get(name)
        raise_smem = max_dynamic_smem > max(48 * 1024, self._smem.get(name, 0))
        if f is not None and not raise_smem:
            return f  # the per-call path: no context switch
        drv = driver()
        with PrimaryContext(self.device_index, self.who):
            if f is None:
                f = check(drv.cuModuleGetFunction(self.module, name.encode()), f"cuModuleGetFunction({name})",
                          self.who)
                self._funcs[name] = f
            if raise_smem:
                attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                check(drv.cuFuncSetAttribute(f, attr, int(max_dynamic_smem)),
                      f"cuFuncSetAttribute({name}, smem={max_dynamic_smem})", self.who)
                self._smem[name] = max_dynamic_smem
        return f

    def blocks_per_sm(self, name: str, threads: int, smem: int) -> int:
        """Blocks of kernel `name` (threads each, smem bytes of dynamic shared memory) that one
        multiprocessor holds at once (the driver's occupancy calculator)."""
        f = self.function(name, smem)
        with PrimaryContext(self.device_index, self.who):
            n = check(driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(f, int(threads), int(smem)),
                      f"cuOccupancyMaxActiveBlocksPerMultiprocessor({name})", self.who)
        return int(n)

    def read_global(self, name: str, nbytes: int) -> bytes:
        drv = driver()
        with PrimaryContext(self.device_index, self.who):
            dptr, size = check(drv.cuModuleGetGlobal(self.module, name.encode()), f"cuModuleGetGlobal({name})",
                               self.who)
            n = min(int(size), nbytes)
            buf = (ctypes.c_char * n)()
            check(drv.cuMemcpyDtoH(ctypes.addressof(buf), dptr, n), f"cuMemcpyDtoH({name})", self.who)
        return bytes(buf)

    def launch(self, func, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int, stream: int,
               params: ctypes.Structure, what: str) -> None:
        """Launch `func` with one by-value struct argument on the CUstream handle `stream`."""
        drv = driver()
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        with PrimaryContext(self.device_index, self.who):
            check(drv.cuLaunchKernel(func, grid[0], grid[1], grid[2], block[0], block[1], block[2], int(smem),
                                     drv.CUstream(stream), ctypes.addressof(argv), 0),
                  f"cuLaunchKernel({what}, grid={grid}, block={block}, smem={smem})", self.who)


_MODULES: dict[tuple[str, int], LoadedModule] = {}


def load_module(path: Path, device_index: int, who: str) -> LoadedModule:
    """Load (once per process and device) the fatbin at `path`."""
    key = (str(Path(path).resolve()), device_index)
    mod = _MODULES.get(key)
    if mod is None:
        p = Path(path)
        if not p.exists():
            raise RuntimeError(f"{who}: artifact {p} does not exist (build it: kdagen build)")
        mod = LoadedModule(p.read_bytes(), device_index, who)
        _MODULES[key] = mod
    return mod
