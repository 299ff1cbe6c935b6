"""Launcher for the Triton target: imports the generated module and calls its launch()."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from ..abi import KdaCall
from ..variant import Variant


def load_generated_module(variant: Variant, source: Path):
    """Import a generated kernel module under a name derived from the variant (cached in sys.modules)."""
    mod_name = f"kdagen_generated.{variant.name}"
    mod = sys.modules.get(mod_name)
    if mod is not None and getattr(mod, "__file__", None) == str(source):
        return mod
    spec = importlib.util.spec_from_file_location(mod_name, source)
    if spec is None or spec.loader is None:
        raise ImportError(f"{variant.name}: cannot import {source}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    return mod


class TritonLauncher:
    def __init__(self, variant: Variant, artifact: Path) -> None:
        self.variant = variant
        self.module = load_generated_module(variant, artifact)

    def __call__(self, call: KdaCall) -> None:
        self.module.launch(call)
