"""Render a spec's variants from the Jinja templates into generated/<spec>/<variant>/.

Deterministic: sorted variants, no timestamps, stable JSON; a file is written only
when its bytes change, so ninja and editors see no spurious updates.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jinja2

from . import __version__
from .dtypes import template_context
from .paths import TEMPLATES_DIR, generated_dir_for, rel
from .spec import Spec, expand
from .targets import TARGETS
from .variant import Variant

MANIFEST = "manifest.json"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_if_different(path: Path, data: bytes) -> bool:
    """Atomically replace `path` with `data` unless it already holds exactly that."""
    if path.exists() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return True


def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render_variant(variant: Variant, env: jinja2.Environment | None = None) -> dict[str, bytes]:
    """The files of one variant: {file name: bytes}."""
    env = env or _env()
    info = TARGETS[variant.target]
    out = {}
    for template, fname in info.templates:
        text = env.get_template(template).render(variant=variant, name=variant.name, **template_context())
        out[fname] = text.encode()
    return out


@dataclass
class GenerateResult:
    written: list[Path]
    removed: list[Path]
    manifest: dict

    @property
    def changed(self) -> bool:
        return bool(self.written or self.removed)


def manifest_for(spec: Spec, files: dict[str, dict[str, bytes]], variants: list[Variant]) -> dict:
    entries = []
    for v in variants:
        fs = files[v.name]
        entry = v.to_dict()
        entry["files"] = {fn: sha256_bytes(fs[fn]) for fn in sorted(fs)}
        entry["source_sha256"] = sha256_bytes(b"".join(fs[fn] for fn in sorted(fs)))
        entry["build"] = TARGETS[v.target].build
        entries.append(entry)
    return {
        "kdagen_version": __version__,
        "spec": spec.name,
        "spec_file": rel(Path(spec.path)),
        "description": spec.description,
        "variants": entries,
    }


def generate(spec: Spec, out_dir: Path | None = None, *, check: bool = False) -> GenerateResult:
    """Render all variants of `spec` under out_dir/<spec.name>/ (default: the checkout's
    generated/ for its own specs, the cache directory otherwise).

    With check=True nothing is written; the result lists what would change.
    """
    return emit(spec, expand(spec), out_dir or generated_dir_for(spec.path), check=check)


def emit(spec: Spec, variants: list[Variant], out_dir: Path, *, check: bool = False) -> GenerateResult:
    """Render `variants` (sorted by name) as spec `spec` under out_dir/<spec.name>/ and remove
    what no longer belongs there."""
    root = Path(out_dir) / spec.name
    variants = sorted(variants, key=lambda v: v.name)
    env = _env()
    files = {v.name: render_variant(v, env) for v in variants}
    manifest = manifest_for(spec, files, variants)
    wanted: dict[Path, bytes] = {}
    for v in variants:
        for fname, data in files[v.name].items():
            wanted[root / v.name / fname] = data
    wanted[root / MANIFEST] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()

    written = []
    for path in sorted(wanted):
        data = wanted[path]
        if check:
            if not path.exists() or path.read_bytes() != data:
                written.append(path)
        elif write_if_different(path, data):
            written.append(path)

    removed = []
    if root.exists():
        for path in sorted(root.rglob("*")):
            # dot files are the cache's own (lock, input stamp), not generated sources
            if path.is_file() and path not in wanted and not path.name.startswith("."):
                removed.append(path)
        if not check:
            for path in removed:
                path.unlink()
            for d in sorted((p for p in root.iterdir() if p.is_dir()), reverse=True):
                if not any(d.iterdir()):
                    shutil.rmtree(d)
    return GenerateResult(written=written, removed=removed, manifest=manifest)
