"""The `kdagen` command: list, generate, build and verify the variants of a spec; doctor."""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

import click

from .bench import CASE_SETS, TUNE_CASES  # no torch: the CLI's import stays light
from .errors import KdagenError, SpecError
from .paths import DEFAULT_SPEC, SPECS_DIR, generated_dir_for, rel


def _fail(e: Exception) -> None:
    click.echo(f"kdagen: error: {e}", err=True)
    sys.exit(2)


def resolve_spec(name: str) -> Path:
    """A spec file path, or the name of a shipped spec (`h800`, `h800.yaml`, `specs/h800.yaml`
    also work from outside the source tree)."""
    p = Path(name)
    if p.is_file():
        return p
    for cand in (SPECS_DIR / p.name, SPECS_DIR / f"{p.name}.yaml"):
        if cand.is_file():
            return cand
    shipped = ", ".join(sorted(q.stem for q in SPECS_DIR.glob("*.yaml")))
    raise SpecError(name, "<file>", f"no such file, nor a shipped spec of that name (shipped: {shipped})")


def _specs(paths: tuple[str, ...]) -> list[Path]:
    return [resolve_spec(p) for p in paths] if paths else [DEFAULT_SPEC]


spec_option = click.option("--spec", "specs", multiple=True,
                           help=f"spec file or shipped spec name (repeatable; default {DEFAULT_SPEC.stem})")


@click.group()
@click.version_option(package_name="kdagen")
def main() -> None:
    """Generate, build and select Kimi Delta Attention prefill kernels."""


@main.command("list")
@spec_option
@click.option("--filter", "pattern", default="*", help="glob on the variant name")
@click.option("-v", "--verbose", is_flag=True, help="also show the dropped combinations and why")
def list_cmd(specs: tuple[str, ...], pattern: str, verbose: bool) -> None:
    """Print the variants a spec would generate."""
    from .spec import expand_all, load_spec

    try:
        for path in _specs(specs):
            spec = load_spec(path)
            kept, dropped = expand_all(spec)
            kept = [v for v in kept if fnmatch.fnmatch(v.name, pattern)]
            click.echo(f"# spec {spec.name} ({rel(path)}): {len(kept)} variant(s)")
            for v in kept:
                hw = "" if v.hardware_validated else "  [hardware-validated: no]"
                click.echo(f"{v.name}  layouts={','.join(v.layouts)} varlen={'yes' if v.varlen else 'no'} "
                           f"gqa={'yes' if v.gqa else 'no'}{hw}")
            if verbose:
                dropped = [d for d in dropped if fnmatch.fnmatch(d.variant.name, pattern)]
                click.echo(f"# dropped: {len(dropped)}")
                for d in dropped:
                    click.echo(f"- {d.variant.name}: {d.reason}")
        if verbose:
            _echo_coverage()
    except KdagenError as e:
        _fail(e)


def _echo_coverage() -> None:
    """What each target covers: the head dims it builds, and the padding of the others."""
    from .inputs import MAX_HEAD_DIM
    from .targets import TARGETS

    click.echo(f"# targets: head dims each builds (K and V apart); the runtime zero-pads any other K, V up to "
               f"{MAX_HEAD_DIM} to the next size a target builds")
    for name, t in sorted(TARGETS.items()):
        dims = sorted(t.head_dims)
        beyond = f", none above {dims[-1]}" if dims[-1] < MAX_HEAD_DIM else ""
        click.echo(f"- {name}: head dims {'/'.join(map(str, dims))} (other sizes up to {dims[-1]} by padding{beyond}), "
                   f"dtypes {'/'.join(t.dtypes)}, gates {'/'.join(t.gates)}, states {'/'.join(t.states)}, "
                   f"chunks {'/'.join(map(str, t.chunks))}, devices {'/'.join(t.devices or ()) or '-'}")


@main.command()
@spec_option
@click.option("--all", "all_specs", is_flag=True, help=f"every spec in {rel(SPECS_DIR)}/")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="output folder (default: generated/ of the source tree for its specs, else the cache)")
@click.option("--check", is_flag=True, help="write nothing; exit 1 if the output is stale")
def generate(specs: tuple[str, ...], all_specs: bool, out: str | None, check: bool) -> None:
    """Render the spec's variants into generated/<spec>/ and write its manifest.json."""
    from .generate import generate as run
    from .spec import load_spec

    paths = sorted(SPECS_DIR.glob("*.yaml")) if all_specs else _specs(specs)
    stale = False
    try:
        for path in paths:
            spec = load_spec(path)
            res = run(spec, Path(out) if out else None, check=check)
            n = len(res.manifest["variants"])
            if check:
                if res.changed:
                    stale = True
                    click.echo(f"{spec.name}: STALE ({len(res.written)} file(s) differ, {len(res.removed)} extra)")
                    for p in (res.written + res.removed)[:20]:
                        click.echo(f"  {rel(p)}")
                else:
                    click.echo(f"{spec.name}: up to date ({n} variants)")
            else:
                click.echo(f"{spec.name}: {n} variants, {len(res.written)} file(s) written, {len(res.removed)} removed")
    except KdagenError as e:
        _fail(e)
    if stale:
        click.echo("generated/ is stale: run `kdagen generate --all` and commit the result", err=True)
        sys.exit(1)


@main.command()
@spec_option
@click.option("--filter", "pattern", default="*", help="glob on the variant name")
@click.option("--variant", "variants", multiple=True,
              help="a canonical variant name no spec needs to list (repeatable): generated and built in the cache")
@click.option("-j", "--jobs", type=int, default=None, help="parallel jobs (default: MAX_JOBS or the core count)")
def build(specs: tuple[str, ...], pattern: str, variants: tuple[str, ...], jobs: int | None) -> None:
    """Compile the variants of a spec (ninja) ahead of time: into build/ for the specs of a
    source tree, into the cache directory otherwise (what the runtime loads)."""
    import json

    from .build import build_spec
    from .cache import ONDEMAND_SPEC, ensure_generated
    from .generate import MANIFEST, generate as render
    from .paths import SOURCE_GENERATED_DIR
    from .spec import load_spec

    try:
        jobs_done = []
        if variants:
            from .ondemand import parse_name, register

            parsed = [parse_name(n) for n in variants]
            gen = register(parsed)
            jobs_done.append((ONDEMAND_SPEC, build_spec(ONDEMAND_SPEC, names=[v.name for v in parsed],
                                                          generated_dir=gen, jobs=jobs)))
        for path in (_specs(specs) if specs or not variants else []):
            spec = load_spec(path)
            gen = generated_dir_for(path)
            if SOURCE_GENERATED_DIR is not None and gen == SOURCE_GENERATED_DIR:
                if not (gen / spec.name / MANIFEST).exists():
                    render(spec, gen)  # a checkout's committed tree is otherwise taken as it is
            else:
                ensure_generated(path, gen)
            man_path = gen / spec.name / MANIFEST
            names = None
            if pattern != "*":
                names = [e["name"] for e in json.loads(man_path.read_text())["variants"]
                         if fnmatch.fnmatch(e["name"], pattern)]
            jobs_done.append((spec.name, build_spec(spec.name, names=names, jobs=jobs, generated_dir=gen)))
        for name, manifest in jobs_done:
            worst = [(n, r) for n, e in manifest["variants"].items() for r in e.get("ptxas", [])
                     if r["spill_stores"] or r["spill_loads"] or r["stack_bytes"]]
            click.echo(f"{name}: {len(manifest['variants'])} variant(s) built")
            for n, r in worst:
                click.echo(f"  WARNING {n} {r['arch']}: {r['stack_bytes']} B stack, "
                           f"{r['spill_stores']} B spill stores, {r['spill_loads']} B spill loads")
        _build_launch_shim()
    except KdagenError as e:
        _fail(e)


def _build_launch_shim() -> None:
    """The sm80 launch shim into the cache too (ahead of time, like the kernels); its absence only
    costs host time, so a failure is said, not raised."""
    from . import env
    from .targets import launch_shim

    if not env.launch_shim():
        click.echo("launch shim: not built (KDAGEN_LAUNCH_SHIM=0)")
        return
    try:
        click.echo(f"launch shim: {launch_shim.build()}")
    except KdagenError as e:
        click.echo(f"launch shim: not built, sm80 calls launch through cuda-bindings: {e}")


@main.command()
@spec_option
@click.option("--filter", "pattern", default="*", help="glob on the variant name")
def verify(specs: tuple[str, ...], pattern: str) -> None:
    """Run every variant this machine can run against the float64 reference."""
    from .spec import load_spec
    from .verify import verify_spec

    try:
        ok = all([verify_spec(load_spec(p), pattern) for p in _specs(specs)])
    except KdagenError as e:
        _fail(e)
    sys.exit(0 if ok else 1)


class _Bar:
    """bench.Progress on click's progress bar (stderr)."""

    def __init__(self, label: str) -> None:
        self.label, self.bar = label, None

    def start(self, total: int) -> None:
        self.bar = click.progressbar(length=total, label=self.label, file=sys.stderr, show_pos=True,
                                     item_show_func=lambda x: x)
        self.bar.__enter__()

    def advance(self, label: str) -> None:
        if self.bar is not None:
            self.bar.update(1, label)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def _bench_options(compare: str, compare_all: bool, variants: str | None, top: int | None, no_graphs: bool,
                   warm_procs: int, budget_ms: float, rounds: int = 1):
    from .bench import BenchError, Options, parse_compare

    if top is not None and top < 0:
        raise BenchError(f"--top: expected 0 (every candidate) or a positive count, found {top}")
    if warm_procs < 0:
        raise BenchError(f"--warm-procs: expected 0 or more processes, found {warm_procs}")
    if not budget_ms > 0:
        raise BenchError(f"--budget-ms: expected a positive number of milliseconds, found {budget_ms}")
    if rounds < 1:
        raise BenchError(f"--rounds: expected 1 or more rounds, found {rounds}")
    # a glob names the variants to time: all of them unless --top says otherwise
    top = (0 if variants else 3) if top is None else top
    return Options(compare=parse_compare(compare), compare_all=compare_all, variants=variants, top=top,
                   graphs=not no_graphs, warm_procs=warm_procs, budget_ms=budget_ms, rounds=rounds)


def _bench_common(cases_default: str):
    """The options bench and tune share; --cases defaults to `cases_default`."""
    opts = [
        click.option("--cases", "cases", default=cases_default, show_default=True,
                     help=f"comma-separated case sets ({', '.join(CASE_SETS)}), case names of the sets and "
                          ".yaml/.json files of cases"),
        click.option("--variants", default=None, help="glob on variant names: time the matching candidates "
                     "(all of them unless --top is given); the auto-selected one is always timed"),
        click.option("--top", type=int, default=None,
                     help="time the N most-preferred candidates of each target (default 3; 0: all)"),
        click.option("--warm-procs", type=int, default=8, show_default=True,
                     help="make the first calls (fla autotuning, Triton compiles) in this many processes at once"),
        click.option("--budget-ms", type=float, default=200.0, show_default=True,
                     help="measured time per implementation and case (20 to 200 calls)"),
        click.option("--rounds", type=int, default=None,
                     help="time a case's candidates in this many interleaved rounds, the budget split among them "
                          "(default: bench 1, tune 3): a GPU drifting during the case then ranks no variant by "
                          "its place in the order"),
    ]

    def add(f):
        for opt in reversed(opts):
            f = opt(f)
        return f
    return add


@main.command()
@_bench_common("default")
@click.option("--compare", default="fla,flashkda", show_default=True,
              help="peers timed in the same run where importable (fla, flashkda; none)")
@click.option("--compare-all", is_flag=True, help="time the peers on every case (default: the cases marked "
              "compare; fla autotunes for minutes per head count)")
@click.option("--no-graphs", is_flag=True, help="skip the CUDA-graph times of the short cases")
@click.option("--out", type=click.Path(file_okay=False), default="bench_out", show_default=True,
              help="folder for bench.json, bench.md and bench.png")
@click.option("--from-json", "from_json", type=click.Path(dir_okay=False), default=None,
              help="measure nothing: make bench.md and bench.png from this bench.json into --out")
def bench(cases: str, compare: str, compare_all: bool, variants: str | None, top: int | None, no_graphs: bool,
          warm_procs: int, budget_ms: float, rounds: int | None, out: str, from_json: str | None) -> None:
    """Time every candidate variant of each case, the auto-selected one and the peers on this GPU;
    write bench.json, a markdown report and a plot."""
    from . import bench as b
    from .bench_report import write_report

    try:
        if from_json:
            results = b.read_results(Path(from_json))
        else:
            opts = _bench_options(compare, compare_all, variants, top, no_graphs, warm_procs, budget_ms,
                                  1 if rounds is None else rounds)
            case_list = b.load_cases(cases)
            bar = _Bar("bench")
            command = "kdagen bench " + " ".join(sys.argv[2:])

            def partial(res: dict) -> None:  # bench.json after every case: a run cut short keeps its cases
                b.write_results(dict(res, command=command), Path(out))

            try:
                results = b.run(case_list, opts, echo=lambda m: click.echo(m, err=True), progress=bar,
                                partial=partial)
            finally:
                bar.close()
            results["command"] = command
            click.echo(f"results: {b.write_results(results, Path(out))}")
        made = write_report(results, Path(out), command=results.get("command"))
        click.echo(f"report: {made['report']}" + (f", plot: {made['plot']}" if made["plot"] else ""))
        if made["plot_error"]:
            click.echo(made["plot_error"], err=True)
    except KdagenError as e:
        _fail(e)


@main.command()
@_bench_common(TUNE_CASES)
@click.option("--out", "out_file", type=click.Path(dir_okay=False), default=None,
              help="the tuning file to write (default: KDAGEN_TUNING's file, else <cache>/tuning/<GPU>.json, "
                   "which dispatch then reads before the one shipped with kdagen)")
def tune(cases: str, variants: str | None, top: int | None, warm_procs: int, budget_ms: float, rounds: int | None,
         out_file: str | None) -> None:
    """Measure the candidate variants per shape regime and write this GPU's tuning file (dispatch
    prefers, in each regime, the chunk size and V-split measured fastest there)."""
    from . import bench as b

    try:
        opts = _bench_options("none", False, variants, 0 if top is None else top, True, warm_procs, budget_ms,
                              3 if rounds is None else rounds)
        case_list = [c for c in b.load_cases(cases)]
        bar = _Bar("tune")
        try:
            path, results = b.tune(case_list, opts, Path(out_file) if out_file else None,
                                   echo=lambda m: click.echo(m, err=True), progress=bar)
        finally:
            bar.close()
        from .tuning import load

        t = load(path)
        click.echo(f"tuning file: {path} ({len(t.rules)} rule(s) for {t.gpu})")
        for r in t.rules:
            hi_t = "inf" if r.tokens_per_seq[1] == float("inf") else f"{r.tokens_per_seq[1]:g}"
            hi_s = "inf" if r.seq_heads_per_sm[1] == float("inf") else f"{r.seq_heads_per_sm[1]:g}"
            gate = "" if r.gate is None else f" {r.gate} gate"
            click.echo(f"  {r.target} {r.dtype} D{r.head_dim}{gate}: tokens/seq [{r.tokens_per_seq[0]:g}, {hi_t}) "
                       f"seq x heads/SM [{r.seq_heads_per_sm[0]:g}, {hi_s}): chunk {r.chunk} block_v {r.block_v} "
                       f"{'' if r.rank is None else f'rank {r.rank} '}"
                       f"({', '.join(r.evidence.get('cases', []))})")
    except KdagenError as e:
        _fail(e)


@main.command()
def doctor() -> None:
    """What this machine has and can run: GPU, compilers, cache, built variants, one line each."""
    from .doctor import report

    try:
        for line in report():
            click.echo(line)
    except KdagenError as e:
        _fail(e)


if __name__ == "__main__":
    main()
