"""The registry of variants: read from the generated and build manifests, never from a copy of
the matrix. It knows, per variant, whether it can run as is, needs a build first, or cannot be
built here (and why), and builds on demand into the build folder it was loaded with.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from . import env
from .errors import BuildError, NoVariantError
from .generate import MANIFEST
from .paths import SOURCE_GENERATED_DIR, SOURCE_TREE, build_dir_for, cache_build_dir, cache_generated_dir, rel
from .select import NEEDS_BUILD, READY
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
    generated_root: Path = Path(".")  # the folder holding <spec>/manifest.json
    build_root: Path = Path(".")  # the folder holding <spec>/<variant>/ builds

    @property
    def name(self) -> str:
        return self.variant.name

    @property
    def artifact(self) -> Path:
        from .build import artifact_path

        return artifact_path(self.build_root / self.spec, self.variant)

    def build_command(self) -> str:
        from .cache import ONDEMAND_SPEC

        if self.spec == ONDEMAND_SPEC:
            return f"kdagen build --variant {self.name}"
        return f"kdagen build --spec {self.spec} --filter {self.name}"


@dataclass
class Registry:
    entries: dict[str, Entry] = field(default_factory=dict)
    _launchers: dict[tuple[str, str], Callable] = field(default_factory=dict, repr=False)
    _status: dict[str, tuple[str, Optional[str]]] = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, generated_dir: Optional[Path] = None, build_dir: Optional[Path] = None) -> "Registry":
        """Every variant rendered under `generated_dir` (built into `build_dir`, default: the
        folder that goes with it). Without arguments: the checkout's generated/ (when running
        from one) and the cache directory, after rendering the shipped specs into the cache
        when installed."""
        reg = cls()
        if generated_dir is not None:
            roots = [(Path(generated_dir), Path(build_dir) if build_dir else build_dir_for(Path(generated_dir)))]
        else:
            roots = []
            if SOURCE_GENERATED_DIR is not None:
                roots.append((SOURCE_GENERATED_DIR, build_dir_for(SOURCE_GENERATED_DIR)))
            else:
                from .cache import ensure_shipped_specs

                ensure_shipped_specs()
            roots.append((cache_generated_dir(), cache_build_dir()))
        for gen, bld in roots:
            reg.add_root(gen, bld)
        return reg

    def add_root(self, generated_dir: Path, build_dir: Path) -> None:
        """Add the specs rendered under `generated_dir`; a name seen before is kept unless this
        copy is built and that one is not."""
        for man_path in sorted(Path(generated_dir).glob(f"*/{MANIFEST}")):
            man = json.loads(man_path.read_text())
            spec = man["spec"]
            built_path = Path(build_dir) / spec / MANIFEST
            built = json.loads(built_path.read_text())["variants"] if built_path.exists() else {}
            for e in man["variants"]:
                name = e["name"]
                entry = Entry(Variant.from_dict(e), spec, man_path.parent / name, e["source_sha256"], built.get(name),
                              Path(generated_dir), Path(build_dir))
                old = self.entries.get(name)
                if old is not None and (old.built is not None or entry.built is None):
                    continue
                self.entries[name] = entry
                self._status.pop(name, None)

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

    def status(self, name: str) -> tuple[str, Optional[str]]:
        """(READY or NEEDS_BUILD, None), or (NEEDS_BUILD, why it cannot be built here)."""
        st = self._status.get(name)
        if st is None:
            st = self._status[name] = self._check(self.entries[name])
        return st

    def _check(self, entry: Entry) -> tuple[str, Optional[str]]:
        from . import build as _build

        info = TARGETS[entry.variant.target]
        if info.build == "jit":
            return READY, None
        if self._fresh(entry):
            return READY, None
        why = _build.compiler_reason(info.build)
        if why:
            return NEEDS_BUILD, f"not built, and {why} to build it (`{entry.build_command()}` elsewhere)"
        if env.disable_jit():
            return NEEDS_BUILD, f"not built, and KDAGEN_DISABLE_JIT=1 forbids building it now (`{entry.build_command()}`)"
        return NEEDS_BUILD, None

    def _fresh(self, entry: Entry) -> bool:
        """The artifact exists and its build key matches the sources and toolchain now."""
        from . import build as _build

        if not entry.built or not entry.artifact.exists():
            return False
        info = TARGETS[entry.variant.target]
        toolchain = None
        if info.build == "nvcc" and not _build.nvcc_path():
            toolchain = entry.built.get("toolchain")  # no nvcc here: trust the recorded compiler
        return entry.built.get("cache_key") == _build.cache_key(entry.variant, entry.source_sha256, toolchain)

    def _artifact(self, entry: Entry) -> Path:
        from . import build as _build

        info = TARGETS[entry.variant.target]
        if info.build == "jit":
            return entry.source_dir / info.templates[0][1]
        if self._fresh(entry):
            return entry.artifact
        stale = "is not built" if not entry.built or not entry.artifact.exists() else \
            "was built from other sources or another toolchain"
        state, why = self._check(entry)
        if why:
            raise NoVariantError(f"{entry.name} {stale}: {why}")
        log.warning("kdagen: %s %s; building it now into %s (`%s` builds it ahead of time)", entry.name, stale,
                    rel(entry.build_root / entry.spec), entry.build_command())
        t0 = time.monotonic()
        try:
            man = _build.build_spec(entry.spec, names=[entry.name], generated_dir=entry.generated_root,
                                    build_dir=entry.build_root, quiet=True)
        except BuildError as e:
            raise NoVariantError(f"{entry.name}: on-demand build failed: {e}") from None
        entry.built = man["variants"][entry.name]
        self._status[entry.name] = (READY, None)
        log.warning("kdagen: built %s in %.1f s", entry.name, time.monotonic() - t0)
        return entry.artifact


def artifact_status(entry: Entry) -> str:
    if TARGETS[entry.variant.target].build == "jit":
        return "jit"
    return "built" if entry.built and entry.artifact.exists() else "not built"


__all__ = ["Entry", "Registry", "artifact_status", "rel", "READY", "NEEDS_BUILD", "SOURCE_TREE"]
