"""The environment variables kdagen reads, in one place (`kdagen doctor` lists them).

Each is read when it is needed, not at import, so a process (or a test) may set it late. The
runtime reads the dispatch ones when it first sees a call signature; `kdagen.runtime.reset()`
makes it read them again.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from .errors import KdagenError

VARIABLES = {
    "KDAGEN_CACHE_DIR": "generated sources and builds (default ~/.cache/kdagen/<version>)",
    "KDAGEN_DISABLE_JIT": "1: never compile during a call; a missing build is an error naming the command",
    "KDAGEN_FORCE_VARIANT": "a canonical variant name every call must use",
    "KDAGEN_FLA_BACKEND": "0: do not register kdagen as a backend of fla's chunk_kda (default 1; read at import)",
    "KDAGEN_TUNING": "the tuning file dispatch reads (default <cache>/tuning/<GPU>.json from `kdagen tune`, else the "
                     "one shipped with kdagen for the GPU); off: none",
    "KDAGEN_COMMIT": "the commit `kdagen bench` reports (default: git rev-parse of the source tree, when there is one)",
    "KDAGEN_SCAN": "0: kda_prefill always runs one piece; default 1: a long call with few heads runs as the segment "
                   "scan where its cost model says that pays (kdagen/scan/route.py)",
    "KDAGEN_POOL_SLOTS": "0: a state pool is gathered and scattered around every kernel; default 1: the sm80 and "
                         "sm90 kernels read and write its slots themselves (sm80: 1.06-1.15x faster pool calls, H100, "
                         "benchmarks/NOTES.md session 52; sm90 through its kda_fused_slots entry point)",
    "KDAGEN_LAUNCH_SHIM": "0: sm80 launches through cuda-bindings, not the C launch shim built on first use (default 1)",
    "KDAGEN_LOGLEVEL": "0 warnings, 1 each choice and build (default), 2 also every rejected candidate and the "
                       "tuning file read",
    "KDAGEN_LOCK_TIMEOUT": "seconds to wait for another process's build lock (default 600)",
    "MAX_JOBS": "parallel compile jobs (default: the core count)",
    "KDAGEN_ERRORS": "tests: append each numeric check's errors as a JSON line to this file (kdagen/cases.py)",
}

log = logging.getLogger("kdagen")
_HANDLER: Optional[logging.Handler] = None


def _flag(name: str) -> bool:
    val = os.environ.get(name, "").strip().lower()
    if val in ("", "0", "false", "no", "off"):
        return False
    if val in ("1", "true", "yes", "on"):
        return True
    raise KdagenError(f"{name}: expected 1 or 0, found {os.environ[name]!r}")


def disable_jit() -> bool:
    return _flag("KDAGEN_DISABLE_JIT")


def fla_backend() -> bool:
    return "KDAGEN_FLA_BACKEND" not in os.environ or _flag("KDAGEN_FLA_BACKEND")


def launch_shim() -> bool:
    return "KDAGEN_LAUNCH_SHIM" not in os.environ or _flag("KDAGEN_LAUNCH_SHIM")


def scan_route() -> bool:
    return "KDAGEN_SCAN" not in os.environ or _flag("KDAGEN_SCAN")


def pool_slots() -> bool:
    return "KDAGEN_POOL_SLOTS" not in os.environ or _flag("KDAGEN_POOL_SLOTS")


def force_variant() -> Optional[str]:
    return os.environ.get("KDAGEN_FORCE_VARIANT") or None


def loglevel() -> int:
    val = os.environ.get("KDAGEN_LOGLEVEL", "").strip()
    if not val:
        return 1
    if val not in ("0", "1", "2"):
        raise KdagenError(f"KDAGEN_LOGLEVEL: expected 0, 1 or 2, found {val!r}")
    return int(val)


def lock_timeout() -> float:
    val = os.environ.get("KDAGEN_LOCK_TIMEOUT", "").strip()
    if not val:
        return 600.0
    try:
        secs = float(val)
    except ValueError:
        secs = -1.0
    if secs <= 0:
        raise KdagenError(f"KDAGEN_LOCK_TIMEOUT: expected a positive number of seconds, found {val!r}")
    return secs


def configure_logging() -> int:
    """Honour KDAGEN_LOGLEVEL on the `kdagen` logger: when it is set, the logger gets its level
    and (once) a stderr handler; unset, the application's logging setup decides. Returns the
    level (0, 1 or 2)."""
    global _HANDLER
    level = loglevel()
    if "KDAGEN_LOGLEVEL" in os.environ:
        log.setLevel({0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}[level])
        if _HANDLER is None:
            _HANDLER = logging.StreamHandler()
            _HANDLER.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(_HANDLER)
    return level
