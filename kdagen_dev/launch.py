"""Direct launches of one variant's kernels for timing and A/B experiments (GPU scripts).

The call record comes from kda_prefill itself (`capture_call`), so the benchmarks and scripts
that time a launcher alone pass it exactly what the runtime would. Timing itself is
kdagen.timing's (the harness of `kdagen bench`).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable


def built_variants(target: str = "sm80") -> list[tuple[Any, Path]]:
    """(Variant, artifact) of every registered `target` variant whose artifact is built here."""
    from kdagen.paths import ROOT
    from kdagen.registry import Registry

    try:
        reg = Registry.load()
    except Exception:  # no generated/ yet: nothing built
        return []
    out = []
    for _, e in sorted(reg.entries.items()):
        if e.variant.target == target and e.built and (ROOT / e.built["artifact"]).exists():
            out.append((e.variant, ROOT / e.built["artifact"]))
    return out


@contextmanager
def launcher_swapped(variant: str, device_key: str, launcher: Callable):
    """kda_prefill launches `variant` on `device_key` through `launcher` inside the block: the
    registry's launcher is replaced, the variant counts as built (its artifact is not what runs, so a
    stale or missing one must not stop an A/B script, with KDAGEN_DISABLE_JIT=1 or without), and the
    runtime's cached plans (which hold launchers) are forgotten on entry and on exit."""
    import kdagen.runtime as rt
    from kdagen.select import READY

    reg = rt.registry()
    key = (variant, device_key)
    saved = reg._launchers.get(key)
    saved_status = reg._status.get(variant)

    def forget_plans():
        rt._PLANS.clear()
        rt._LAST = rt._NO_PLAN

    reg._launchers[key] = launcher
    reg._status[variant] = (READY, None)
    forget_plans()
    try:
        yield launcher
    finally:
        forget_plans()
        if saved is None:
            reg._launchers.pop(key, None)
        else:
            reg._launchers[key] = saved
        if saved_status is None:
            reg._status.pop(variant, None)
        else:
            reg._status[variant] = saved_status


def capture_call(kw: dict, variant: str):
    """The KdaCall that kda_prefill(**kw, variant=variant) hands its launcher (nothing runs):
    outputs are allocated as the runtime allocates them."""
    import kdagen.runtime as rt

    captured: list = []
    dev = next(t.device for t in kw.values() if hasattr(t, "device"))
    with launcher_swapped(variant, f"{dev.type}:{dev.index}", captured.append):
        rt.kda_prefill(**kw, variant=variant)
    return captured[0]


def bound_args(call) -> tuple:
    """A KdaCall's tensors in the positional order of a bound launch's `launch` (Sm80Bound, Sm90Bound)."""
    return (call.q, call.k, call.v, call.g, call.beta, call.o, call.A_log, call.dt_bias, call.cu_seqlens,
            call.initial_state, call.final_state, call.chunk_states, call.chunk_offsets, call.workspace, call.max_len)
