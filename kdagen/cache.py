"""The cache directory: locks shared by processes, the shipped specs rendered into it, and the
on-demand spec that collects variants generated for calls no spec lists.

Layout (KDAGEN_CACHE_DIR, default ~/.cache/kdagen/<version>/)::

    generated/<spec>/<variant>/kernel.*   rendered sources (+ manifest.json per spec)
    build/<spec>/<variant>/...            artifacts, build logs, cache keys (+ manifest.json)
    generated/ondemand/..., build/ondemand/...   variants made for calls (`kdagen build --variant`)

Staleness is decided by content: a rendered spec carries a stamp of its inputs (spec text,
templates, kdagen version); a build step's key hashes sources, headers, flags and toolchain.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from pathlib import Path
from typing import Iterator

from . import __version__
from .env import lock_timeout
from .errors import BuildError
from .paths import SPECS_DIR, TEMPLATES_DIR, cache_generated_dir

log = logging.getLogger("kdagen")

ONDEMAND_SPEC = "ondemand"
LOCK_NAME = ".kdagen.lock"
STAMP_NAME = ".inputs_sha256"


@contextlib.contextmanager
def locked(folder: Path, what: str, timeout: float | None = None) -> Iterator[None]:
    """Hold the lock of `folder` (a file lock: two processes never write the same build or
    generated folder at once). Waits at most `timeout` s (KDAGEN_LOCK_TIMEOUT, default 600),
    saying so when it has to wait, then raises BuildError naming the lock file."""
    from filelock import FileLock, Timeout

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    timeout = lock_timeout() if timeout is None else timeout
    lock = FileLock(str(path), timeout=timeout)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.warning("kdagen: waiting up to %.0f s for %s (another process holds %s)", timeout, what, path)
        t0 = time.monotonic()
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            raise BuildError(f"{what}: another process held the lock {path} for more than {timeout:.0f} s "
                             "(set KDAGEN_LOCK_TIMEOUT to wait longer)") from None
        log.warning("kdagen: got %s after %.1f s", path, time.monotonic() - t0)
    try:
        yield
    finally:
        lock.release()


def inputs_stamp(spec_path: Path) -> str:
    """Hash of everything a rendering of `spec_path` depends on (no mtimes)."""
    h = hashlib.sha256()
    h.update(__version__.encode() + b"\0" + Path(spec_path).read_bytes() + b"\0")
    for p in sorted(TEMPLATES_DIR.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(TEMPLATES_DIR)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def ensure_generated(spec_path: Path, out_dir: Path | None = None) -> Path:
    """Render spec `spec_path` into the cache (default) unless its stamp says it is current;
    returns the generated folder holding <spec>/manifest.json."""
    from .generate import MANIFEST, generate, write_if_different
    from .spec import load_spec

    out_dir = Path(out_dir or cache_generated_dir())
    spec = load_spec(spec_path)
    root = out_dir / spec.name
    stamp = inputs_stamp(Path(spec_path))
    stamp_file = root / STAMP_NAME
    if (root / MANIFEST).exists() and stamp_file.exists() and stamp_file.read_text().strip() == stamp:
        return out_dir
    with locked(root, f"rendering spec {spec.name}"):
        generate(spec, out_dir)
        write_if_different(stamp_file, (stamp + "\n").encode())
    return out_dir


def ensure_shipped_specs() -> Path:
    """Render every shipped spec into the cache (what an installed package runs on)."""
    for path in sorted(SPECS_DIR.glob("*.yaml")):
        ensure_generated(path)
    return cache_generated_dir()
