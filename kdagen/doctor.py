"""`kdagen doctor`: what this machine has and what kdagen can run on it, one line each."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
from pathlib import Path


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _devices():
    """(torch device, one-line description) of every device type kdagen could use here."""
    import torch

    out = [(torch.device("cpu"), f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append((torch.device("cuda", i), f"cuda:{i}: {p.name}, compute capability {p.major}.{p.minor}, "
                        f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB"))
    else:
        out.append((None, "cuda: no CUDA GPU visible to torch"))
    try:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():  # type: ignore[attr-defined]
            out.append((torch.device("npu", 0), "npu:0: Ascend NPU (torch_npu)"))
    except Exception:
        pass
    return out


def _launch_line() -> str:
    """How the sm80 bound launch reaches the driver here (the launch shim or cuda-bindings)."""
    from .targets.cuda_driver import driver_binding
    from .targets.launch_shim import active

    shim, how = active()
    if shim is not None:
        return f"launch: sm80 calls launch through {how}, {shim.path}"
    return f"launch: sm80 calls launch through {driver_binding()} (launch shim not used: {how})"


def _tuning_line(device) -> str:
    """The tuning file dispatch reads on a CUDA device, where it comes from (KDAGEN_TUNING, the
    cache's, shipped with kdagen) and whether it applies there."""
    from . import tuning
    from .select import _sm_count

    label = f"tuning {device}"
    name = tuning._device_name(device.index if device.index is not None else 0)
    if name is None:
        return f"{label}: none (torch gives no device name)"
    if tuning.disabled():
        return f"{label}: off ({tuning.ENV}={os.environ.get(tuning.ENV)}): the targets' constants"
    found = tuning.lookup(name)
    if found is None:
        return (f"{label}: none for {name!r}: the targets' constants (`kdagen tune` writes "
                f"{tuning.default_path(name)})")
    path, source = found
    where = tuning.describe_source(source)
    if not path.exists():
        return f"{label}: {path} ({where}) does not exist: the targets' constants"
    try:
        t = tuning.load(path)
    except tuning.TuningError as e:
        return f"{label}: {e}"
    if not tuning.made_for(t.gpu, name, source):
        return f"{label}: {path} ({where}) was made on {t.gpu!r}, the device is {name!r}: dispatch raises an error"
    if t.gpu != name:
        where += f", measured on the same silicon: {t.gpu}"
    sms = _sm_count(device)
    made = ", ".join(f"{k} {t.meta[k]}" for k in ("date", "commit") if t.meta.get(k))
    if t.sm_count != sms:
        return (f"{label}: {path} ({where}) ignored: made for {t.sm_count} SMs, the device has {sms}: "
                "the targets' constants")
    return f"{label}: {path} ({where}), {len(t.rules)} rule(s){' (' + made + ')' if made else ''}{_gate_cover(t)}"


def _gate_cover(t) -> str:
    """The rules per gate form where they name one, and the forms left with none (their calls get
    the targets' constants: a rule measured on one gate form says nothing of another)."""
    from .dtypes import GATES

    if all(r.gate is None for r in t.rules):
        return ""
    per = {g: sum(r.gate == g for r in t.rules) for g in GATES}
    text = "; per gate form: " + ", ".join(f"{g} {n}" for g, n in per.items())
    bare = [g for g, n in per.items() if n == 0]
    if bare and not any(r.gate is None for r in t.rules):
        text += (f"; no rule for the {' and '.join(bare)} gate{'s' if len(bare) > 1 else ''} "
                 "(`kdagen tune` measures every form by default)")
    return text


def report() -> list[str]:
    from . import __version__, env
    from .build import compiler_reason, nvcc_path, nvcc_version
    from .paths import SOURCE_TREE, SPECS_DIR, TEMPLATES_DIR, cache_dir
    from .runtime import registry
    from .select import READY, device_reason
    from .targets import TARGETS

    reg = registry()  # first: it renders into the cache when installed
    lines = [f"kdagen {__version__}: {'source tree ' + str(SOURCE_TREE) if SOURCE_TREE else 'installed'} "
             f"({Path(__file__).resolve().parent})"]
    lines.append(f"python {platform.python_version()}, torch {_version('torch')}, triton {_version('triton')}, "
                 f"cuda-bindings {_version('cuda-bindings')}")
    devices = _devices()
    lines += [f"device {d}" for _, d in devices]
    lines += [_tuning_line(dev) for dev, _ in devices if dev is not None and dev.type == "cuda"]
    nvcc = nvcc_path()
    lines.append(f"nvcc: {nvcc} ({nvcc_version()})" if nvcc else "nvcc: not found (CUDA variants run only if prebuilt)")
    lines.append(f"ninja: {shutil.which('ninja') or 'from the ninja package'}")
    cache = cache_dir()
    writable = os.access(cache if cache.exists() else cache.parent if cache.parent.exists() else Path.home(), os.W_OK)
    lines.append(f"cache: {cache} ({'exists' if cache.exists() else 'not created yet'}, "
                 f"{'writable' if writable else 'NOT writable'})")
    lines.append(f"package data: templates {TEMPLATES_DIR}, specs {SPECS_DIR} "
                 f"({len(list(SPECS_DIR.glob('*.yaml')))} shipped)")
    lines.append(_launch_line())
    for name, what in env.VARIABLES.items():
        if name in os.environ:
            lines.append(f"env {name}={os.environ[name]} ({what})")
    by_target: dict[str, list[str]] = {}
    for n, e in reg.entries.items():
        by_target.setdefault(e.variant.target, []).append(n)
    for target, info in sorted(TARGETS.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 99)):
        names = by_target.get(target, [])
        ready = sum(reg.status(n)[0] == READY for n in names)
        runs = [str(dev) for dev, _ in devices if dev is not None and device_reason(target, dev) is None]
        why = "; ".join(sorted({device_reason(target, dev) for dev, _ in devices if dev is not None} - {None}))
        build = compiler_reason(info.build)
        lines.append(f"target {target}: {len(names)} variant(s) registered, {ready} ready; "
                     f"runs here on {', '.join(runs) if runs else 'nothing'}"
                     f"{'' if runs else ' (' + why + ')'}"
                     f"{'; cannot build here: ' + build if build else ''}")
    return lines
