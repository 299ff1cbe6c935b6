"""Every target describes itself to dispatch (issue 13): a target registered in kdagen.targets
without its capability entry fails here, not at a user's first call."""

from __future__ import annotations

import pytest

from kdagen.targets import TARGETS

DEVICE_TYPES = {"cuda", "cpu", "npu"}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_target_has_its_capability_entry(name):
    info = TARGETS[name]
    assert info.name == name
    assert info.devices and set(info.devices) <= DEVICE_TYPES, f"{name}: devices {info.devices}"
    assert isinstance(info.rank, int), f"{name}: no rank"
    if "cuda" in info.devices:
        cc = info.min_compute_capability
        assert isinstance(cc, tuple) and len(cc) == 2 and all(isinstance(x, int) for x in cc), \
            f"{name}: runs on cuda without a minimum compute capability"
    for dev, var, val in info.device_env:
        assert dev in info.devices and var and val, f"{name}: device_env {(dev, var, val)}"
    assert info.chunks and info.head_dims and info.dtypes and info.gates and info.states and info.block_v
    assert info.build in ("jit", "nvcc", "ascend") and ":" in info.launcher


def test_ranks_order_the_targets_of_each_device():
    for dev in DEVICE_TYPES:
        ranks = [TARGETS[n].rank for n in TARGETS if dev in TARGETS[n].devices]
        assert len(ranks) == len(set(ranks)), f"two targets of {dev} share a rank: {ranks}"
