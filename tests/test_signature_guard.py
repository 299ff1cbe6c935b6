"""kdagen.signature_guard: torch's C++ tensor guard as the runtime's first check of a repeated
signature, used only where it passes its self-test."""

from __future__ import annotations

import pytest
import torch

from kdagen import signature_guard as sg


def test_the_guard_tells_apart_every_fact_of_a_signature():
    assert sg.available()
    a, b = sg.placeholders(2)
    assert a is not b and type(a) is type(b) is sg._Absent
    x, y = torch.randn(2, 5, 3), torch.randn(5)
    guard = sg.make_guard((x, a, y, b))
    assert guard.check(torch.zeros(2, 5, 3), a, torch.zeros(5), b) is True  # values do not matter
    for other in [
        (torch.zeros(2, 5, 4), a, y, b),                      # shape
        (torch.zeros(2, 3, 5).transpose(1, 2), a, y, b),      # strides
        (x.double(), a, y, b),                                # dtype
        (x.clone().requires_grad_(), a, y, b),                # autograd
        (torch.empty(2, 5, 3, device="meta"), a, y, b),       # device
        (x, torch.zeros(0), y, b),                            # a tensor where there was none
        (x, a, y, a),                                         # a slot's placeholder in another slot
    ]:
        assert guard.check(*other) is False


def test_one_tensor_in_two_slots_gets_no_guard():
    x = torch.randn(3)
    assert sg.make_guard((x, x)) is None  # torch's guard fails such calls: the Python key serves them
    assert sg.make_guard((x, x.clone())) is not None


def test_without_torchs_guard_there_is_none(monkeypatch):
    monkeypatch.setattr(sg, "_tensor_guards", lambda: None)
    sg.available.cache_clear()
    try:
        assert not sg.available() and sg.make_guard((torch.randn(3),)) is None
    finally:
        sg.available.cache_clear()


def test_a_guard_that_cannot_tell_facts_apart_is_not_used(monkeypatch):
    class Blind:  # passes everything, like a guard that ignored strides would for some calls
        def __init__(self, *tensors, **kwargs):
            pass

        def check(self, *tensors):
            return True

    monkeypatch.setattr(sg, "_tensor_guards", lambda: Blind)
    sg.available.cache_clear()
    try:
        assert not sg.available() and sg.make_guard((torch.randn(3),)) is None
    finally:
        monkeypatch.undo()
        sg.available.cache_clear()
    assert sg.available()


@pytest.mark.gpu
def test_the_guard_tells_devices_apart():
    x = torch.randn(4, device="cuda")
    guard = sg.make_guard((x,))
    assert guard.check(torch.zeros(4, device="cuda")) is True
    assert guard.check(torch.zeros(4)) is False
    if torch.cuda.device_count() > 1:
        assert guard.check(torch.zeros(4, device="cuda:1")) is False
