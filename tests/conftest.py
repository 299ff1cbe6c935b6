"""Shared test setup: the Triton CPU interpreter when no GPU, and hardware markers."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before any Triton kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _has_npu() -> bool:
    try:
        import torch_npu  # noqa: F401

        return torch.npu.is_available()  # type: ignore[attr-defined]
    except Exception:
        return False


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run the I-th (0-based) of N shards: parallel processes on one GPU machine "
                          "(scripts/gpu_check.sh test). Tests of variants that share inputs stay in one "
                          "shard, so each Triton kernel compiles once and each reference is computed once.")


def _variant(item):
    params = getattr(getattr(item, "callspec", None), "params", {})
    v = params.get("v", params.get("variant"))
    return v if hasattr(v, "gate") else None


def _shard_key(item) -> str:
    v = _variant(item)
    # the inputs of kdagen.cases depend on these fields only
    return item.nodeid if v is None else f"{v.k}/{v.v}/{v.dtype}/{v.gate}/{v.state}"


def _select_shard(config, items) -> None:
    spec = config.getoption("--shard")
    if not spec:
        return
    try:
        index, count = (int(x) for x in spec.split("/"))
        assert 0 <= index < count
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"--shard: expected I/N with 0 <= I < N, found {spec!r}") from None
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(_shard_key(item), []).append(item)

    def weight(key: str) -> int:
        # a test costs a launch and (cached) a reference; a Triton variant also its JIT compiles,
        # a few seconds each (about 40 tests' worth); fla's autotuning of a new shape about 130 s
        # (the whole of a shard's other work, so such a test gets a shard of its own); a triton_twin
        # test compiles its own specialization, 12-78 s each on the H100 (session 45: five in one shard
        # took 180 s of its 334 and pushed it past a 330 s limit)
        its = groups[key]
        triton = {v.name for v in map(_variant, its) if v is not None and v.target.startswith("triton")}
        twin = sum(1 for v in map(_variant, its) if v is not None and v.target == "triton_twin")
        fla = sum(1 for it in its if it.get_closest_marker("fla_autotune"))
        return len(its) + 40 * len(triton) + 150 * twin + 700 * fla

    # heaviest groups first onto the least loaded shard (every shard process computes the same plan)
    load = [0] * count
    mine = set()
    for key in sorted(groups, key=lambda k: (-weight(k), k)):
        s = min(range(count), key=lambda i: (load[i], i))
        load[s] += weight(key)
        if s == index:
            mine.add(key)
    kept = [it for it in items if _shard_key(it) in mine]
    config.hook.pytest_deselected(items=[it for it in items if _shard_key(it) not in mine])
    items[:] = kept


def pytest_collection_modifyitems(config, items):
    _select_shard(config, items)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_npu = pytest.mark.skip(reason="needs an Ascend NPU with torch_npu")
    has_npu = None
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "npu" in item.keywords:
            if has_npu is None:
                has_npu = _has_npu()
            if not has_npu:
                item.add_marker(skip_npu)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


def pytest_runtest_logreport(report):
    """KDAGEN_EAGER_FAILURES=1 prints a failure as soon as it happens: on a time-limited
    GPU run, the end-of-run summary may never come."""
    if report.failed and os.environ.get("KDAGEN_EAGER_FAILURES") == "1":
        msg = str(report.longrepr).splitlines()
        print(f"\nFAILED {report.nodeid} ({report.when})\n" + "\n".join(msg[-25:]), flush=True)
