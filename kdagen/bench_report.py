"""The report of a `kdagen bench` run, from its bench.json: a markdown table and a PNG plot.

Kept apart from the measurement (kdagen/bench.py) so a report is re-made anywhere from the JSON
(`kdagen bench --from-json F`), e.g. where matplotlib is installed and the GPU machine has none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from .bench import brief

PLOT_NAME = "bench.png"
REPORT_NAME = "bench.md"


def _short(name: Optional[str]) -> str:
    return (name or "-").replace("kda_fwd_", "")


def _ms(t: Optional[dict]) -> str:
    return f"{t['median']:.3f}" if t else "-"


def _spread(t: Optional[dict]) -> str:
    return f"{t['p10']:.3f}-{t['p90']:.3f}" if t else "-"


def _cell(row: dict, name: Optional[str]) -> Optional[dict]:
    return next((c for c in row["variants"] if c["variant"] == name and "timing" in c), None)


def _peer(row: dict, peer: str) -> str:
    p = row.get("peers", {}).get(peer)
    if p is None:
        return "-"
    if "timing" in p:
        return _ms(p["timing"])
    return "n/a"


def _tuning_line(results: dict) -> str:
    from .tuning import describe_source

    path, source = results.get("tuning_file"), results.get("tuning_source")
    if not path:
        return "none (the targets’ constants)"
    return f"{path} ({describe_source(source)})" if source else path


def markdown(results: dict, plot: Optional[str] = PLOT_NAME, command: Optional[str] = None) -> str:
    """The report: the run's environment, then one row per case, then every measured variant."""
    env = results["env"]
    opts = results.get("options", {})
    peers = [p for p in opts.get("compare", []) if any(p in r.get("peers", {}) for r in results["cases"])]
    bw = results["copy_bandwidth_Bps"]
    lines = [f"# kdagen bench: {env.get('gpu', '?')}, {env.get('date', '?')}", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [
        f"- commit {env.get('commit') or 'unknown'}, kdagen {env.get('kdagen')}",
        f"- GPU {env.get('gpu')} ({env.get('sm_count')} SMs, compute capability {env.get('capability')}), "
        f"driver {env.get('driver') or 'unknown'}",
        f"- torch {env.get('torch')} (CUDA {env.get('cuda_runtime')}), Triton {env.get('triton') or '-'}, "
        f"fla {env.get('fla') or 'not installed'}, FlashKDA {env.get('flashkda') or 'not installed'}",
        f"- copy bandwidth (device-to-device copy of 1 GiB, read + write) {bw / 1e12:.2f} TB/s; memory floor = "
        "compulsory bytes (q, k, v, g, beta in, o out, fp32 state in and out) / that bandwidth",
        "- median ms of CUDA-event times per call after warm-up, inputs rotated among sets of at least 3x the L2 "
        "cache; candidates: " + (f"the {opts['top']} most preferred by dispatch of each target" if opts.get("top")
                                 else "every variant that can serve the case")
        + (f" matching `{opts['variants']}`" if opts.get("variants") else "")
        + "; dispatch ok: the auto-selected variant within 5% of the fastest measured",
        f"- tuning file: {_tuning_line(results)}",
        "",
    ]
    if plot:
        lines += [f"![time per case]({plot})", ""]
    head = ["case", "tokens", "auto (dispatch)", "ms", "p10-p90", "graph ms", "best measured", "ms", "dispatch ok"]
    head += [f"{p} ms" for p in peers] + ["floor ms", "auto TB/s"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results["cases"]:
        auto, best = _cell(row, row.get("auto")), _cell(row, row.get("best"))
        ok = {True: "yes", False: "**no**", None: "-"}[row.get("dispatch_ok")]
        note = "see notes" if row.get("error") and row.get("dispatch_ok") is None else row.get("dispatch_note") or ""
        vals = [row["case"]["name"], str(row["tokens"]), _short(row.get("auto")), _ms(auto and auto["timing"]),
                _spread(auto and auto["timing"]), _ms(row.get("graph")), _short(row.get("best")),
                _ms(best and best["timing"]), ok + (f" ({note})" if note else "")]
        vals += [_peer(row, p) for p in peers]
        vals += [f"{row['floor_ms']:.3f}", f"{auto['TBps']:.2f}" if auto else "-"]
        lines.append("| " + " | ".join(vals) + " |")
    ok = [r.get("dispatch_ok") for r in results["cases"] if r.get("dispatch_ok") is not None]
    lines += ["", f"Dispatch picked the fastest measured variant within 5% on {sum(ok)} of {len(ok)} cases."]
    skipped = sorted({f"{p}: {v['skipped']}" for r in results["cases"] for p, v in r.get("peers", {}).items()
                      if "skipped" in v})
    notes = [(r["case"]["name"], n) for r in results["cases"] for n in r.get("notes", [])]
    notes += [(r["case"]["name"], brief(r["error"])) for r in results["cases"] if r.get("error")]
    notes += [("first call in a worker", f"{w['call']}: {w['error']}") for w in results.get("warm_up") or []
              if w.get("error")]
    if skipped or notes:
        lines += ["", "## Notes", ""]
        lines += [f"- peer {s}" for s in skipped]
        lines += [f"- {case}: {n}" for case, n in notes]
    lines += ["", "## Every measured variant", "",
              "| case | variant | ms | p10-p90 | calls | TB/s | rel RMSE of o vs auto |", "|---|---|---|---|---|---|---|"]
    for row in results["cases"]:
        for c in row["variants"]:
            if "timing" not in c:
                lines.append(f"| {row['case']['name']} | {_short(c['variant'])} | error: {brief(c.get('error'))} "
                             "| | | | |")
                continue
            t = c["timing"]
            rel = "auto" if c["auto"] else (f"{c['rel_vs_auto']:.1e}" if c.get("rel_vs_auto") is not None else "-")
            lines.append(f"| {row['case']['name']} | {_short(c['variant'])} | {t['median']:.3f} | {_spread(t)} | "
                         f"{t['n']} | {c['TBps']:.2f} | {rel} |")
        for p, v in row.get("peers", {}).items():
            if "timing" in v:
                t = v["timing"]
                rel = f"{v['rel_vs_auto']:.1e}" if v.get("rel_vs_auto") is not None else "-"
                lines.append(f"| {row['case']['name']} | {p} | {t['median']:.3f} | {_spread(t)} | {t['n']} | "
                             f"{v['TBps']:.2f} | {rel} |")
    warm = results.get("warm_up") or []
    if warm:
        slow = sorted(warm, key=lambda w: -w["s"])[:5]
        lines += ["", "First calls made in worker processes before timing (compile, autotune): "
                  + f"{len(warm)}, longest " + ", ".join(f"{w['call']} {w['s']:.0f} s" for w in slow) + "."]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> Path:
    """Horizontal bars per case (log time axis): the auto-selected variant, the fastest measured
    one where it differs, the graph replay, each peer; the memory floor drawn as a black mark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["cases"] if r.get("best") is not None or any("timing" in v for v in r["peers"].values())]
    series: list[tuple[str, str]] = [("kdagen auto", "C0"), ("kdagen best", "C9"), ("kdagen graph", "C2")]
    peers = [p for p in results.get("options", {}).get("compare", [])]
    series += [(p, f"C{3 + i}") for i, p in enumerate(peers)]

    def value(row: dict, label: str) -> Optional[float]:
        if label == "kdagen auto":
            c = _cell(row, row.get("auto"))
            return c["timing"]["median"] if c else None
        if label == "kdagen best":
            c = _cell(row, row.get("best"))
            return c["timing"]["median"] if c and row.get("best") != row.get("auto") else None
        if label == "kdagen graph":
            return row["graph"]["median"] if row.get("graph") else None
        p = row.get("peers", {}).get(label, {})
        return p["timing"]["median"] if "timing" in p else None

    series = [(label, color) for label, color in series if any(value(r, label) is not None for r in rows)]
    n = max(len(series), 1)
    h = 0.8 / n
    fig, ax = plt.subplots(figsize=(10, 0.55 * max(len(rows), 1) * max(n, 3) / 3 + 1.5))
    used = set()
    for i, row in enumerate(rows):
        y0 = len(rows) - 1 - i
        for j, (label, color) in enumerate(series):
            val = value(row, label)
            if val is None:
                continue
            ax.barh(y0 + 0.4 - (j + 0.5) * h, val, height=h, color=color, label=None if label in used else label)
            used.add(label)
        ax.plot([row["floor_ms"]] * 2, [y0 - 0.45, y0 + 0.45], color="black", lw=2,
                label="memory floor" if i == 0 else None)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["case"]["name"] for r in reversed(rows)], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("ms per call (median; log scale)")
    env = results["env"]
    ax.set_title(f"kdagen bench, {env.get('gpu')}, {env.get('date', '')[:10]}, commit {env.get('commit') or '?'}",
                 fontsize=10)
    ax.grid(axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(results: dict, out_dir: Path, command: Optional[str] = None) -> dict[str, Any]:
    """bench.md and bench.png in `out_dir`; the PNG is left out (and the report says how to make
    it) where matplotlib is not importable. Returns {"report": path, "plot": path or None,
    "plot_error": why not or None}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png, err = None, None
    try:
        png = plot(results, out_dir / PLOT_NAME)
    except ImportError as e:
        err = f"no plot: {e} (pip install 'kdagen[bench]', then `kdagen bench --from-json {out_dir / 'bench.json'}`)"
    md = markdown(results, PLOT_NAME if png else None, command)
    if err:
        md += f"\n{err}\n"
    report = out_dir / REPORT_NAME
    report.write_text(md)
    return {"report": report, "plot": png, "plot_error": err}
