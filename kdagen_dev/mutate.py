"""The mutation check of the test suite: plant one plausible bug at a time in a copy of the tree
and see whether the CPU tests notice.

A mutation is (file, exact source snippet, replacement): easy to retarget when the code moves.
For each one the tool copies the tree, replaces the snippet (once; it must occur exactly once),
regenerates generated/ when a template changed, and runs the tests named to kill it with a time
limit, stopping at the first failure. Outcomes:

- killed: a test failed (the first failing test is reported);
- survived: every test passed, so the suite cannot see this bug;
- stale: the snippet is not in the file (or occurs more than once): the catalogue needs
  retargeting, which is not the same as a survivor;
- timeout / error: the run hit its time limit, or pytest could not run the named tests.

The catalogue is kdagen_dev/mutations.py; the command line is scripts/mutate.py; CI runs a fixed
sample (tests/test_mutations.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
# Fallback when the tree is not a git checkout: what the CPU tests read.
TREE = ("kdagen", "kdagen_dev", "templates", "specs", "generated", "tests", "pyproject.toml")


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository root
    find: str  # exact snippet, must occur once
    replace: str
    kills: tuple[str, ...]  # pytest arguments: the tests expected to kill it, run first
    why: str = ""  # the bug it stands for


@dataclass
class Outcome:
    mutation: Mutation
    status: str  # killed | survived | stale | timeout | error
    killer: str = ""  # the first failing test (killed), or what went wrong
    seconds: float = 0.0
    stage: str = ""  # "kills" or "suite"
    output: str = field(default="", repr=False)


def tree_files(root: Path = ROOT) -> list[Path]:
    """The files a copy of the tree needs: tracked and untracked-but-not-ignored files."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "-co", "--exclude-standard"],
                             capture_output=True, check=True).stdout
        files = [Path(p) for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for top in TREE:
            p = root / top
            files += [f.relative_to(root) for f in (p.rglob("*") if p.is_dir() else [p]) if f.is_file()]
    return [f for f in files if (root / f).is_file() and "__pycache__" not in f.parts]


def copy_tree(dest: Path, root: Path = ROOT) -> Path:
    """Copy the tree under `dest`; build/ (compiled CUDA artifacts) is linked, not copied."""
    for rel in tree_files(root):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    if (root / "build").is_dir() and not (dest / "build").exists():
        (dest / "build").symlink_to(root / "build", target_is_directory=True)
    return dest


def count(text: str, snippet: str) -> int:
    return text.count(snippet) if snippet else 0


def stale_reason(m: Mutation, root: Path = ROOT) -> Optional[str]:
    """Why `m` cannot be applied to the tree at `root` (None when it can)."""
    path = root / m.file
    if not path.is_file():
        return f"{m.file} does not exist"
    n = count(path.read_text(), m.find)
    if n != 1:
        return f"snippet found {n} times in {m.file} (expected once)"
    return None


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    for name in [n for n in env if n.startswith("KDAGEN_")]:
        env.pop(name)  # the caller's settings and error log are not the mutant's
    # on-demand variants of this copy only (builds of its own specs still go to its build/)
    env["XDG_CACHE_HOME"] = str(tree / ".cache")
    return env


def _regenerate(tree: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kdagen.cli", "generate", "--all"], cwd=tree, env=_env(tree),
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"kdagen generate failed in {tree}:\n{r.stdout}{r.stderr}")


_FIRST_FAIL = re.compile(r"^(FAILED|ERROR) (\S+)", re.M)


def run_tests(tree: Path, args: Sequence[str], timeout: float) -> tuple[str, str, str]:
    """(status, first failing test, output) of pytest `args` in `tree`, stopping at the first failure."""
    # -v names each test as it starts, so a test that crashes the process can still be named
    cmd = [sys.executable, "-m", "pytest", "-x", "-v", "-rfE", "--tb=line", "-p", "no:cacheprovider",
           "-m", "not gpu and not npu and not mutation", *args]
    try:
        r = subprocess.run(cmd, cwd=tree, env=_env(tree), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return "timeout", f"no result in {timeout:.0f} s", out
    out = r.stdout + r.stderr
    if r.returncode == 0:
        return "passed", "", out
    if r.returncode in (1, 2):  # failures, or a collection error (the mutation broke an import)
        m = _FIRST_FAIL.search(out)
        return "failed", (m.group(2) if m else f"pytest exit {r.returncode}"), out
    if r.returncode < 0:  # a crash (e.g. a segfault from an out-of-bounds access) is a kill too
        started = re.findall(r"^(tests/\S+::\S+)", r.stdout, re.M)
        return "failed", f"crash (signal {-r.returncode}) in {started[-1] if started else 'collection'}", out
    return "error", f"pytest exit {r.returncode}: {out.strip().splitlines()[-1] if out.strip() else ''}", out


class Workspace:
    """One copy of the tree that mutations are applied to and reverted from, one at a time."""

    def __init__(self, root: Path = ROOT, base: Optional[Path] = None) -> None:
        self.root = root
        self.dir = Path(tempfile.mkdtemp(prefix="kdagen_mutant_", dir=base))
        copy_tree(self.dir, root)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, m: Mutation, timeout: float = 300.0, suite: Sequence[str] = ()) -> Outcome:
        """Apply `m`, run its kill tests (then `suite`, if they all pass), revert."""
        t0 = time.perf_counter()
        why = stale_reason(m, self.dir)
        if why:
            return Outcome(m, "stale", why)
        path = self.dir / m.file
        original = path.read_text()
        templated = m.file.startswith("templates/")
        path.write_text(original.replace(m.find, m.replace, 1))
        try:
            if templated:
                _regenerate(self.dir)
            stages = [("kills", list(m.kills))] + ([("suite", list(suite))] if suite else [])
            status, killer, out, stage = "survived", "", "", ""
            for stage, args in stages:
                res, first, out = run_tests(self.dir, args, timeout)
                if res == "failed":
                    status, killer = "killed", first
                    break
                if res in ("timeout", "error"):
                    status, killer = res, first
                    break
            return Outcome(m, status, killer, time.perf_counter() - t0, stage, out)
        finally:
            path.write_text(original)
            if templated:
                _regenerate(self.dir)


def check_imports_copy(ws: Workspace) -> None:
    """The copy, not an installed kdagen, is what its tests import (PYTHONPATH order)."""
    r = subprocess.run([sys.executable, "-c", "import kdagen, kdagen_dev; print(kdagen.__file__)"],
                       cwd=ws.dir, env=_env(ws.dir), capture_output=True, text=True)
    where = Path(r.stdout.strip() or "?").resolve()
    if ws.dir.resolve() not in where.parents:
        raise RuntimeError(f"the mutant copy imports kdagen from {where}, not from {ws.dir}")


def run_catalogue(mutations: Iterable[Mutation], *, timeout: float = 300.0, suite: Sequence[str] = (),
                  baseline: bool = True, root: Path = ROOT, progress=print) -> list[Outcome]:
    """Run every mutation in one workspace (serially); `baseline` first checks that the named kill
    tests pass on the unmutated copy, else a failing test would count as a kill."""
    mutations = list(mutations)
    outcomes = []
    with Workspace(root) as ws:
        check_imports_copy(ws)
        if baseline:
            args = sorted({a for m in mutations if not stale_reason(m, ws.dir) for a in m.kills})
            res, first, out = run_tests(ws.dir, args, timeout * 4)
            if res != "passed":
                raise RuntimeError(f"the kill tests do not pass unmutated ({res}: {first}):\n{out[-3000:]}")
            progress(f"baseline: {len(args)} kill test selection(s) pass unmutated")
        for i, m in enumerate(mutations, 1):
            o = ws.run(m, timeout=timeout, suite=suite)
            outcomes.append(o)
            progress(f"[{i}/{len(mutations)}] {o.status:8s} {m.name} ({o.seconds:.0f} s){': ' + o.killer if o.killer else ''}")
    return outcomes


def report(outcomes: Sequence[Outcome]) -> str:
    """A table of the outcomes and the counts; survivors and stale entries listed last."""
    lines = [f"{'status':9s} {'mutation':36s} {'file':34s} killer / reason"]
    order = {"killed": 0, "timeout": 1, "error": 2, "stale": 3, "survived": 4}
    for o in sorted(outcomes, key=lambda o: (order.get(o.status, 9), o.mutation.name)):
        lines.append(f"{o.status:9s} {o.mutation.name:36s} {o.mutation.file:34s} {o.killer}")
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    lines.append(", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: order.get(kv[0], 9)))
                 + f" of {len(outcomes)} mutations")
    return "\n".join(lines)
