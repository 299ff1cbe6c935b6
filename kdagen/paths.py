"""Where the project's folders are (the package runs from its source tree)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES_DIR = ROOT / "templates"
GENERATED_DIR = ROOT / "generated"
BUILD_DIR = ROOT / "build"
SPECS_DIR = ROOT / "specs"
DEFAULT_SPEC = SPECS_DIR / "ci.yaml"


def rel(path: Path) -> str:
    """A path relative to the project root when inside it (stable across clones)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)
