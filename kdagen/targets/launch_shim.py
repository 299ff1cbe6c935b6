"""The launch shim (launch_shim.c): the sm80 bound launch's two cuLaunchKernel calls in one
ctypes call, built with the host C compiler into the cache directory on first use.

Each cuda-bindings driver call costs the host a Python -> Cython -> driver transition with its
argument conversions (H200 host: 4.2 us a launch, most of a repeated call's launch cost); the
shim takes one prepared struct (kdagen_pair) and launches both kernels from C. Where no C
compiler is found, the build fails, libcuda cannot be opened, or KDAGEN_LAUNCH_SHIM=0, the
bound launch keeps calling cuda-bindings (`kdagen doctor` says which path is active).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from functools import lru_cache
from pathlib import Path
from typing import Optional

from .. import env
from ..errors import BuildError

SOURCE = Path(__file__).with_name("launch_shim.c")
ABI = 1  # KDAGEN_SHIM_ABI of launch_shim.c
LIBCUDA = "libcuda.so.1"


class Launch(ctypes.Structure):
    """struct kdagen_launch of launch_shim.c."""

    _fields_ = [("func", ctypes.c_void_p), ("stream", ctypes.c_void_p), ("args", ctypes.c_void_p),
                ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("pad_", ctypes.c_uint)]


class Pair(ctypes.Structure):
    """struct kdagen_pair of launch_shim.c: k[0] kda_prep, k[1] kda_recur."""

    _fields_ = [("k", Launch * 2), ("failed", ctypes.c_int), ("pad_", ctypes.c_int)]


# What kdagen_shim_layout reports, in its order.
_LAYOUT = (ctypes.sizeof(Pair), ctypes.sizeof(Launch), Launch.func.offset, Launch.stream.offset, Launch.args.offset,
           Launch.grid.offset, Launch.block.offset, Launch.smem.offset, Pair.failed.offset)


def compiler() -> Optional[str]:
    """The host C compiler: $CC, else cc, gcc or clang on PATH; None when there is none."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or None
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


@lru_cache(maxsize=None)
def source_key() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(f"\0{platform.system()}-{platform.machine()}".encode())
    return h.hexdigest()[:16]


def library_path(folder: Optional[Path] = None) -> Path:
    """Where the shim of this source lives: <cache>/shim/kdagen_launch_shim-<source hash>.so."""
    from ..paths import cache_dir

    folder = Path(folder) if folder is not None else cache_dir() / "shim"
    return folder / f"kdagen_launch_shim-{source_key()}.so"


def build(folder: Optional[Path] = None, quiet: bool = True) -> Path:
    """The compiled shim, compiled first when this source's is not there (under the cache's
    file lock, written under a temporary name and renamed); BuildError says why it could not be."""
    from ..cache import locked

    out = library_path(folder)
    if out.exists():
        return out
    cc = compiler()
    if cc is None:
        raise BuildError("launch shim: no C compiler found (cc, gcc, clang; or set CC)")
    with locked(out.parent, "building the launch shim"):
        if out.exists():  # another process built it while this one waited
            return out
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE), "-ldl"]
        if not quiet:
            print(f"kdagen: building the launch shim: {' '.join(cmd)}", flush=True)
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise BuildError(f"launch shim: {cc} failed to run: {e}") from None
        if res.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise BuildError(f"launch shim: `{' '.join(cmd)}` failed ({res.returncode}):\n{res.stderr.strip()}")
        os.replace(tmp, out)
    return out


class Shim:
    """A loaded shim whose cuLaunchKernel is `libcuda`'s. launch_pair(pair_address, prep_grid_x)
    launches a prepared Pair: 0, or the CUresult of the launch Pair.failed names."""

    def __init__(self, path: Path, libcuda: str = LIBCUDA) -> None:
        self.path, self.libcuda = Path(path), libcuda
        lib = ctypes.CDLL(str(path))  # CDLL: the GIL is released while the driver works
        if lib.kdagen_shim_abi() != ABI:
            raise BuildError(f"launch shim {path}: ABI {lib.kdagen_shim_abi()}, expected {ABI}")
        got = (ctypes.c_longlong * len(_LAYOUT))()
        lib.kdagen_shim_layout(got, len(_LAYOUT))
        if tuple(got) != _LAYOUT:
            raise BuildError(f"launch shim {path}: struct layout {tuple(got)} differs from the Python mirror "
                             f"{_LAYOUT}")
        lib.kdagen_shim_error.restype = ctypes.c_char_p
        lib.kdagen_shim_init.argtypes = [ctypes.c_char_p]
        if lib.kdagen_shim_init(libcuda.encode()) != 0:
            raise OSError(f"launch shim: {lib.kdagen_shim_error().decode(errors='replace')}")
        self.lib = lib
        # No argtypes: the caller passes a prepared c_void_p and a Python int (converted to a C
        # int, which a grid size always fits), the cheapest call ctypes makes.
        self.launch_pair = lib.kdagen_launch_pair
        self.launch_pair.restype = ctypes.c_int

    def describe(self) -> str:
        return f"the launch shim {self.path.name} (both cuLaunchKernel calls in one ctypes call)"


_STATE: dict[tuple, tuple[Optional[Shim], str]] = {}
_LOCK = threading.Lock()


def active(libcuda: str = LIBCUDA) -> tuple[Optional[Shim], str]:
    """(the shim, how launches go) where it is on and usable, else (None, why not). The build and
    load happen once per process and cache directory; KDAGEN_LAUNCH_SHIM is read every time."""
    if not env.launch_shim():
        return None, "KDAGEN_LAUNCH_SHIM=0"
    key = (str(library_path()), libcuda)
    with _LOCK:
        got = _STATE.get(key)
        if got is None:
            try:
                shim = Shim(build(), libcuda)
                got = (shim, shim.describe())
            except (BuildError, OSError) as e:
                got = (None, str(e))
            _STATE[key] = got
    return got
