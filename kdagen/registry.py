"""The registry of built variants: read from the manifests, never from a copy of the matrix."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import BuildError, NoVariantError
from .generate import MANIFEST
from .paths import BUILD_DIR, GENERATED_DIR, ROOT, rel
from .targets import TARGETS
from .variant import Variant

log = logging.getLogger("kdagen")


@dataclass
class Entry:
    variant: Variant
    spec: str
    source_dir: Path
    source_sha256: str
    built: dict[str, Any] | None = None  # this variant's build-manifest entry, if built

    @property
    def name(self) -> str:
        return self.variant.name


@dataclass
class Registry:
    entries: dict[str, Entry] = field(default_factory=dict)
    _launchers: dict[tuple[str, str], Callable] = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, generated_dir: Path = GENERATED_DIR, build_dir: Path = BUILD_DIR) -> "Registry":
        reg = cls()
        for man_path in sorted(Path(generated_dir).glob(f"*/{MANIFEST}")):
            man = json.loads(man_path.read_text())
            spec = man["spec"]
            built_path = Path(build_dir) / spec / MANIFEST
            built = json.loads(built_path.read_text())["variants"] if built_path.exists() else {}
            for e in man["variants"]:
                name = e["name"]
                if name in reg.entries and reg.entries[name].source_sha256 == e["source_sha256"]:
                    if reg.entries[name].built is None and name in built:
                        reg.entries[name] = Entry(reg.entries[name].variant, spec, man_path.parent / name,
                                                  e["source_sha256"], built[name])
                    continue
                reg.entries[name] = Entry(Variant.from_dict(e), spec, man_path.parent / name,
                                          e["source_sha256"], built.get(name))
        return reg

    def variants(self) -> list[Variant]:
        return [self.entries[n].variant for n in sorted(self.entries)]

    def launcher(self, name: str, device_key: str) -> Callable:
        """The callable that launches `name`, loaded once per device."""
        key = (name, device_key)
        if key not in self._launchers:
            entry = self.entries[name]
            info = TARGETS[entry.variant.target]
            artifact = self._artifact(entry)
            self._launchers[key] = info.load_launcher()(entry.variant, artifact)
        return self._launchers[key]

    def _artifact(self, entry: Entry) -> Path:
        info = TARGETS[entry.variant.target]
        if info.build == "jit":
            return entry.source_dir / info.templates[0][1]
        from . import build as _build

        key = _build.cache_key(entry.variant, entry.source_sha256)
        art = entry.built and ROOT / entry.built["artifact"]
        if art and art.exists() and entry.built.get("cache_key") == key:
            return art
        why = "is not built" if not art or not art.exists() else "was built from other sources or another toolchain"
        cmd = f"kdagen build --spec specs/{entry.spec}.yaml --filter {entry.name}"
        if info.build == "nvcc" and not _build.nvcc_path():
            raise NoVariantError(f"{entry.name} {why} and nvcc is not available here to build it; run `{cmd}` "
                                 "on a machine with the CUDA toolkit and copy build/ here")
        log.warning("kdagen: %s %s; building it now (%s)", entry.name, why, cmd)
        try:
            man = _build.build_spec(entry.spec, names=[entry.name], quiet=True)
        except BuildError as e:
            raise NoVariantError(f"{entry.name}: on-demand build failed: {e}") from None
        entry.built = man["variants"][entry.name]
        return ROOT / entry.built["artifact"]


def artifact_status(entry: Entry) -> str:
    if TARGETS[entry.variant.target].build == "jit":
        return "jit"
    return "built" if entry.built and (ROOT / entry.built["artifact"]).exists() else "not built"


__all__ = ["Entry", "Registry", "artifact_status", "rel"]
