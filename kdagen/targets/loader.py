"""Import a generated Python kernel module (Triton, CANNBot-DSL) by its variant's name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_generated_module(name: str, source: Path) -> ModuleType:
    """Import `source` as `kdagen_generated.<name>`, once per process and file."""
    mod_name = f"kdagen_generated.{name}"
    mod = sys.modules.get(mod_name)
    if mod is not None and getattr(mod, "__file__", None) == str(source):
        return mod
    spec = importlib.util.spec_from_file_location(mod_name, source)
    if spec is None or spec.loader is None:
        raise ImportError(f"{name}: cannot import {source}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    return mod
