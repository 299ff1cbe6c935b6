"""Where kdagen's files are: the package data (templates, specs) and the cache (generated
sources and builds).

Two ways to run, one code path:
- installed (a wheel): templates/ and specs/ ship inside the package and are found through
  importlib.resources; generated sources and builds live in the cache directory.
- a source checkout (development): templates/, specs/ and the committed generated/ of the
  repository are used, and builds of the shipped specs go to build/ (what `make` and the
  scripts use) unless KDAGEN_CACHE_DIR is set.
Variants generated on demand (no spec lists them) always live in the cache directory.
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

from . import __version__

ROOT = Path(__file__).resolve().parent.parent


def _is_checkout() -> bool:
    # The package imported from a source tree (not from site-packages).
    return (ROOT / "pyproject.toml").is_file() and (ROOT / "templates").is_dir() and (ROOT / "specs").is_dir()


SOURCE_TREE: Path | None = ROOT if _is_checkout() else None


def _data_dir(name: str) -> Path:
    """A folder of package data: inside the installed package, else the checkout's."""
    packaged = importlib.resources.files("kdagen") / name
    if packaged.is_dir():
        # Wheels unpack to the file system; nvcc and Jinja need real paths.
        return Path(str(packaged))
    if SOURCE_TREE is not None:
        return SOURCE_TREE / name
    raise RuntimeError(f"kdagen: package data folder {name!r} not found in {packaged} (a broken install?)")


TEMPLATES_DIR = _data_dir("templates")
SPECS_DIR = _data_dir("specs")
DEFAULT_SPEC = SPECS_DIR / "ci.yaml"
# The committed generated/ of a checkout; None when installed.
SOURCE_GENERATED_DIR: Path | None = SOURCE_TREE / "generated" if SOURCE_TREE else None
CACHE_ENV = "KDAGEN_CACHE_DIR"


def cache_dir() -> Path:
    """KDAGEN_CACHE_DIR, else $XDG_CACHE_HOME/kdagen/<version> (~/.cache/kdagen/<version>).
    Read on every call, so a test or a process can point it elsewhere."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kdagen" / __version__


def cache_generated_dir() -> Path:
    return cache_dir() / "generated"


def cache_build_dir() -> Path:
    return cache_dir() / "build"


# For the developer tools and tests that read the checkout's folders directly (installed: the
# cache's, as they are at import).
GENERATED_DIR = SOURCE_GENERATED_DIR if SOURCE_GENERATED_DIR is not None else cache_generated_dir()
BUILD_DIR = (SOURCE_TREE / "build") if SOURCE_TREE else cache_build_dir()


def generated_dir_for(spec_path: str | Path) -> Path:
    """Where a spec's sources are rendered: the checkout's generated/ for its own specs/,
    the cache for everything else (installed package, user spec files)."""
    if SOURCE_GENERATED_DIR is not None and _inside(Path(spec_path), SPECS_DIR):
        return SOURCE_GENERATED_DIR
    return cache_generated_dir()


def build_dir_for(generated_dir: Path) -> Path:
    """Where the variants rendered under `generated_dir` are built."""
    if SOURCE_GENERATED_DIR is not None and _same(generated_dir, SOURCE_GENERATED_DIR):
        return cache_build_dir() if os.environ.get(CACHE_ENV) else BUILD_DIR
    if _same(generated_dir, cache_generated_dir()):
        return cache_build_dir()
    # Any other generated folder (tests, `generate --out`): build/ beside it.
    return Path(generated_dir).parent / "build"


def _inside(path: Path, folder: Path) -> bool:
    try:
        Path(path).resolve().relative_to(Path(folder).resolve())
        return True
    except ValueError:
        return False


def _same(a: Path, b: Path) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def rel(path: Path) -> str:
    """A path relative to the source tree when inside it (stable across clones)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)
