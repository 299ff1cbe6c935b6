"""Build the generated variants of a spec with ninja.

One build.ninja per spec under build/<spec>/; one edge per variant, printed by ninja
as `[k/N] <kind> <variant>`. Each variant has a cache key (rendered sources, shared
headers, flags, arch, nvcc version, kdagen version) written to a key file only when
it changes, so a toolchain or header change rebuilds exactly what it affects; mtimes
never decide what is stale. The compiler's log (ptxas report included) is kept
next to each artifact and quoted when a step fails.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from . import __version__
from .errors import BuildError
from .generate import MANIFEST, sha256_bytes, write_if_different
from .paths import ROOT, SOURCE_GENERATED_DIR, TEMPLATES_DIR, build_dir_for, cache_generated_dir, rel
from .targets import TARGETS
from .variant import Variant


@lru_cache(maxsize=None)
def nvcc_path() -> str | None:
    cand = os.environ.get("CUDACXX") or shutil.which("nvcc")
    if not cand and Path("/usr/local/cuda/bin/nvcc").exists():
        cand = "/usr/local/cuda/bin/nvcc"
    return cand


@lru_cache(maxsize=None)
def nvcc_version() -> str:
    nvcc = nvcc_path()
    if not nvcc:
        return "none"
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release [\d.]+, (V[\d.]+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def ninja_path() -> str:
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja  # the PyPI package ships the binary

        return str(Path(ninja.BIN_DIR) / "ninja")
    except ImportError:
        raise BuildError("ninja not found: install it with `pip install ninja` (it is a dependency of kdagen)") from None


def default_jobs() -> int:
    env = os.environ.get("MAX_JOBS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise BuildError(f"MAX_JOBS: expected a positive integer, found {env!r}")
        return int(env)
    # nvcc takes ~1-2 GB per job; cores are the usual limit on CI machines.
    return max(1, os.cpu_count() or 1)


@lru_cache(maxsize=None)
def _include_hash(dirs: tuple[str, ...]) -> str:
    # Names relative to the templates' parent ("templates/common/..."): the same string in a
    # checkout and in an installed package, so a key does not depend on where kdagen lives.
    # Documentation (*.md, e.g. a target's DESIGN.md) compiles into nothing: editing it must not
    # make every artifact stale.
    data = b""
    for d in dirs:
        for p in sorted((TEMPLATES_DIR / d).rglob("*")):
            if p.is_file() and not p.name.endswith((".j2", ".md")) and "__pycache__" not in p.parts:
                data += str(p.relative_to(TEMPLATES_DIR.parent)).encode() + b"\0" + p.read_bytes() + b"\0"
    return sha256_bytes(data)


def compiler_reason(build: str) -> str | None:
    """Why a variant of build kind `build` cannot be built here (None when it can)."""
    if build == "nvcc" and not nvcc_path():
        return "nvcc is not available (PATH, CUDACXX, /usr/local/cuda/bin)"
    if build == "ascend":
        import importlib.util

        if importlib.util.find_spec("cannbotdsl") is None:
            return "the CANNBot-DSL translator (pip install cannbot-dsl) is not installed"
    return None


def nvcc_command(variant: Variant, src: Path, out: Path) -> list[str]:
    info = TARGETS[variant.target]
    incs = [f"-I{TEMPLATES_DIR / d}" for d in info.includes]
    return [nvcc_path() or "nvcc", *info.nvcc_flags, "-fatbin", "-Xptxas", "-v", *incs, str(src), "-o", str(out)]


def cache_key(variant: Variant, source_sha: str, toolchain: str | None = None) -> str:
    """`toolchain` overrides the compiler version (a machine without nvcc checks a prebuilt
    artifact against the version its build manifest records)."""
    info = TARGETS[variant.target]
    if toolchain is None:
        toolchain = nvcc_version() if info.build == "nvcc" else sys.version.split()[0]
    parts = {
        "variant": variant.name,
        "source": source_sha,
        "includes": _include_hash(info.includes),
        "flags": list(info.nvcc_flags),
        "build": info.build,
        "toolchain": toolchain,
        "kdagen": __version__,
    }
    return sha256_bytes(json.dumps(parts, sort_keys=True).encode())


@dataclass
class Step:
    variant: Variant
    kind: str  # ninja rule
    inputs: list[Path]
    artifact: Path
    log: Path
    key: str
    key_file: Path


def artifact_name(variant: Variant) -> str:
    build = TARGETS[variant.target].build
    return {"nvcc": f"{variant.name}.fatbin", "jit": "checked.stamp", "ascend": "translated.json"}[build]


def artifact_path(build_root: Path, variant: Variant) -> Path:
    """Where the build of `variant` in a spec's build folder `build_root` puts its artifact."""
    return Path(build_root) / variant.name / artifact_name(variant)


def find_generated(spec_name: str) -> Path:
    """The generated folder holding spec `spec_name`: the checkout's generated/, else the cache."""
    if SOURCE_GENERATED_DIR is not None and (SOURCE_GENERATED_DIR / spec_name / MANIFEST).exists():
        return SOURCE_GENERATED_DIR
    return cache_generated_dir()


def plan(spec_name: str, variants: list[Variant], gen_manifest: dict, build_root: Path,
         generated_dir: Path | None = None) -> list[Step]:
    shas = {e["name"]: e["source_sha256"] for e in gen_manifest["variants"]}
    generated_dir = generated_dir or find_generated(spec_name)
    steps = []
    for v in variants:
        gen_dir = generated_dir / spec_name / v.name
        out_dir = build_root / v.name
        info = TARGETS[v.target]
        inputs = [gen_dir / fname for _, fname in info.templates]
        key = cache_key(v, shas[v.name])
        steps.append(Step(v, info.build, inputs, artifact_path(build_root, v), out_dir / "build.log", key,
                          out_dir / "cache_key"))
    return steps


def _ninja_file(steps: list[Step], build_root: Path) -> str:
    py = shlex.quote(sys.executable)
    lines = [
        "# Written by `kdagen build`; do not edit.",
        "ninja_required_version = 1.8",
        "",
        # A failed step removes its output: an artifact left from an earlier success would match
        # that success's content key on the next build and be kept beside the failure's log.
        "rule nvcc",
        "  command = $nvcc_cmd > $log 2>&1 || { cat $log; rm -f $out; exit 1; }",
        "  description = nvcc $variant",
        "",
        "rule jit",
        f"  command = {py} -m kdagen.build_step jit $variant $in $out > $log 2>&1 || {{ cat $log; rm -f $out; exit 1; }}",
        "  description = check $variant",
        "",
        "rule ascend",
        f"  command = {py} -m kdagen.build_step ascend $variant $in $out > $log 2>&1 || {{ cat $log; rm -f $out; exit 1; }}",
        "  description = translate $variant",
        "",
    ]
    for s in steps:
        ins = " ".join(shlex.quote(str(p)) for p in s.inputs)
        lines.append(f"build {s.artifact}: {s.kind} {ins} | {s.key_file}")
        lines.append(f"  variant = {s.variant.name}")
        lines.append(f"  log = {s.log}")
        if s.kind == "nvcc":
            cmd = " ".join(shlex.quote(c) for c in nvcc_command(s.variant, s.inputs[0], s.artifact))
            lines.append(f"  nvcc_cmd = {cmd}")
        lines.append("")
    return "\n".join(lines)


PTXAS_RE = re.compile(
    r"ptxas info\s*: Compiling entry function '(?P<fn>[^']+)' for '(?P<arch>sm_\d+a?)'"
)
USED_RE = re.compile(r"Used (\d+) registers")
FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
SMEM_RE = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> list[dict]:
    """Per (kernel, arch): registers, stack frame, spills, static smem."""
    out: list[dict] = []
    cur: dict | None = None
    for line in log.splitlines():
        m = PTXAS_RE.search(line)
        if m:
            cur = {"kernel": m.group("fn"), "arch": m.group("arch"), "registers": None, "stack_bytes": None,
                   "spill_stores": None, "spill_loads": None, "smem_bytes": 0}
            out.append(cur)
            continue
        if cur is None:
            continue
        if (m := FRAME_RE.search(line)):
            cur["stack_bytes"], cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
        if (m := USED_RE.search(line)):
            cur["registers"] = int(m.group(1))
            if (s := SMEM_RE.search(line)):
                cur["smem_bytes"] = int(s.group(1))
    return out


def build_spec(spec_name: str, *, names: list[str] | None = None, jobs: int | None = None,
               build_dir: Path | None = None, generated_dir: Path | None = None, quiet: bool = False) -> dict:
    """Build (a subset of) the variants generated for `spec_name`; returns the build manifest.

    generated_dir: where the spec was rendered (default: the checkout's generated/, else the
    cache); build_dir: where to build (default: the folder that goes with generated_dir).
    The spec's build folder is locked for the whole build, so concurrent processes never
    corrupt it. quiet: no header line, and ninja's progress ([k/N] per variant) goes to stderr.
    """
    from .cache import locked

    generated_dir = Path(generated_dir or find_generated(spec_name)).resolve()
    gen_manifest_path = generated_dir / spec_name / MANIFEST
    if not gen_manifest_path.exists():
        raise BuildError(f"{rel(gen_manifest_path)} not found: run `kdagen generate --spec specs/{spec_name}.yaml` first")
    gen_manifest = json.loads(gen_manifest_path.read_text())
    variants = [Variant.from_dict(e) for e in gen_manifest["variants"]]
    if names is not None:
        unknown = sorted(set(names) - {v.name for v in variants})
        if unknown:
            raise BuildError(f"not in spec {spec_name}: {', '.join(unknown)}")
        variants = [v for v in variants if v.name in names]
    build_root = (Path(build_dir) if build_dir is not None else build_dir_for(generated_dir)).resolve() / spec_name
    steps = plan(spec_name, variants, gen_manifest, build_root, generated_dir)
    if any(s.kind == "nvcc" for s in steps) and not nvcc_path():
        n = sum(s.kind == "nvcc" for s in steps)
        raise BuildError(f"nvcc not found (PATH, CUDACXX, /usr/local/cuda/bin): needed for {n} CUDA variant(s) "
                         f"of spec {spec_name}; install the CUDA toolkit (12.4+) or build a spec without CUDA targets")
    with locked(build_root, f"building spec {spec_name}"):
        return _build_locked(spec_name, build_root, steps, gen_manifest, jobs, quiet)


def _build_locked(spec_name: str, build_root: Path, steps: list[Step], gen_manifest: dict, jobs: int | None,
                  quiet: bool) -> dict:
    # Folders of variants the spec no longer names would only confuse readers of build/.
    known = {e["name"] for e in gen_manifest["variants"]}
    if build_root.exists():
        for d in build_root.iterdir():
            if d.is_dir() and d.name.startswith("kda_fwd_") and d.name not in known:
                shutil.rmtree(d)
    for s in steps:
        s.artifact.parent.mkdir(parents=True, exist_ok=True)
        write_if_different(s.key_file, (s.key + "\n").encode())
    fresh = _trust_content_keys(build_root, steps)
    ninja_file = build_root / "build.ninja"
    write_if_different(ninja_file, _ninja_file(steps, build_root).encode())
    jobs = jobs or default_jobs()
    if not quiet:
        print(f"kdagen: building {len(steps)} variant(s) of spec {spec_name} with {jobs} job(s) "
              f"[nvcc {nvcc_version()}] in {rel(build_root)}", flush=True)
    env = dict(os.environ, NINJA_STATUS="[%f/%t] ", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # Only what the content keys call stale goes to ninja: a build folder carried to another
    # checkout path has other command lines (absolute paths) in build.ninja, which ninja alone
    # would take for changes and rebuild everything.
    targets = [str(s.artifact) for s in steps if s.variant.name not in fresh]
    t0 = time.monotonic()
    if fresh and not quiet:
        print(f"kdagen: {len(fresh)} of {len(steps)} up to date by content key", flush=True)
    proc = subprocess.run([ninja_path(), "-f", str(ninja_file), "-j", str(jobs), *targets], cwd=build_root, env=env,
                          stdout=2 if quiet else None) if targets else None  # fd 2: progress on stderr
    if proc is not None and proc.returncode != 0:
        raise BuildError(f"build of spec {spec_name} failed (see the quoted log above; logs are in {rel(build_root)}/<variant>/build.log)")
    if not quiet:
        for s in steps:  # a step's own report (the Ascend translation's time estimates)
            summary = _step_json(s).get("summary")
            if summary:
                print(summary, flush=True)
        print(f"kdagen: spec {spec_name} done in {time.monotonic() - t0:.1f} s", flush=True)
    return write_build_manifest(spec_name, build_root, steps, known)


def _step_json(s: Step) -> dict:
    """A JSON artifact's contents ({} for binaries and stamps)."""
    if s.artifact.suffix != ".json" or not s.artifact.exists():
        return {}
    try:
        return json.loads(s.artifact.read_text())
    except json.JSONDecodeError:
        return {}


def _trust_content_keys(build_root: Path, steps: list[Step]) -> set[str]:
    """The variants whose artifact the build manifest records under the current cache key: those
    are up to date whatever their mtimes (a copied or unpacked folder has arbitrary ones). Their
    artifacts are also made newer than their inputs, so a plain `ninja` leaves them alone."""
    path = build_root / MANIFEST
    if not path.exists():
        return set()
    try:
        recorded = json.loads(path.read_text()).get("variants", {})
    except (json.JSONDecodeError, AttributeError):
        return set()
    now = time.time()
    fresh = set()
    for s in steps:
        entry = recorded.get(s.variant.name) or {}
        if entry.get("cache_key") == s.key and s.artifact.exists():
            fresh.add(s.variant.name)
            newest = max([p.stat().st_mtime for p in (*s.inputs, s.key_file) if p.exists()], default=0.0)
            if s.artifact.stat().st_mtime <= newest:
                os.utime(s.artifact, (max(now, newest + 1), max(now, newest + 1)))
    return fresh


def write_build_manifest(spec_name: str, build_root: Path, steps: list[Step], known: set[str]) -> dict:
    path = build_root / MANIFEST
    old = json.loads(path.read_text()) if path.exists() else {"variants": {}}
    # Keep earlier entries of variants still in the spec (a partial build adds to them).
    entries = {n: e for n, e in old.get("variants", {}).items() if n in known}
    for s in steps:
        entry = {"artifact": rel(s.artifact), "cache_key": s.key, "target": s.variant.target, "build": s.kind}
        if s.kind == "nvcc":
            entry["toolchain"] = nvcc_version()  # lets a machine without nvcc check the key
            if s.log.exists():
                entry["ptxas"] = parse_ptxas(s.log.read_text())
        entry.update(_step_json(s).get("manifest", {}))
        entries[s.variant.name] = entry
    manifest = {"kdagen_version": __version__, "spec": spec_name, "nvcc": nvcc_version(), "variants": entries}
    write_if_different(path, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return manifest
