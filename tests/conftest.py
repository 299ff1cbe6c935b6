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


def pytest_collection_modifyitems(config, items):
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
