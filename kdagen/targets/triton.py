"""Launcher for the Triton target: imports the generated module and calls its launch()."""

from __future__ import annotations

from pathlib import Path

from ..abi import KdaCall
from ..variant import Variant
from .loader import load_generated_module


class TritonLauncher:
    def __init__(self, variant: Variant, artifact: Path) -> None:
        self.variant = variant
        self.module = load_generated_module(variant.name, artifact)

    def __call__(self, call: KdaCall) -> None:
        self.module.launch(call)
