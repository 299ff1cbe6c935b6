"""kdagen.signature_guard: torch's C++ tensor guard as the runtime's first check of a repeated
signature, used only where it passes its self-test."""

from __future__ import annotations

import pytest
import torch

from kdagen import signature_guard as sg


def test_the_guard_tells_apart_every_fact_of_a_signature():
    assert sg.available()
    x, y = torch.randn(2, 5, 3), torch.randn(5)
    guard = sg.make_guard((x, y))
    assert guard.check(torch.zeros(2, 5, 3), torch.zeros(5)) is True  # values do not matter
    for other in [
        (torch.zeros(2, 5, 4), y),                      # shape
        (torch.zeros(2, 3, 5).transpose(1, 2), y),      # strides
        (x.double(), y),                                # dtype
        (x.clone().requires_grad_(), y),                # autograd
        (torch.empty(2, 5, 3, device="meta"), y),       # device
        (torch.nn.Parameter(x.clone()), y),             # Python type
    ]:
        assert guard.check(*other) is False


def test_a_check_tells_absent_arguments_apart():
    x, y = torch.randn(2, 5, 3), torch.randn(5)
    check = sg.make_check((x, None, y, None))
    assert check(torch.zeros(2, 5, 3), None, torch.zeros(5), None) is True
    assert check(x, torch.zeros(0), y, None) is False  # a tensor where there was none
    assert check(x, None, y, y.clone()) is False
    assert check(x, None, torch.zeros(6), None) is False  # the present ones: the guard
    # None or no tensor where a tensor was: False (the runtime's Python key then names it)
    assert check(x, None, None, None) is False and check(x, None, [1.0] * 5, None) is False
    # one compiled function per pattern of absent slots, each with its own guard
    other = sg.make_check((x, None, torch.randn(3), None))
    assert other(x, None, torch.zeros(3), None) is True and check(x, None, torch.zeros(3), None) is False
    assert sg._check_factory.cache_info().currsize >= 1
    assert sg.make_check((None, y))(None, torch.ones(5)) is True


def test_one_tensor_in_two_slots_gets_no_guard():
    x = torch.randn(3)
    assert sg.make_guard((x, x)) is None  # torch's guard fails such calls: the Python key serves them
    assert sg.make_check((x, None, x)) is None
    assert sg.make_guard((x, x.clone())) is not None


def test_without_torchs_guard_there_is_none(monkeypatch):
    monkeypatch.setattr(sg, "_tensor_guards", lambda: None)
    sg.available.cache_clear()
    try:
        assert not sg.available() and sg.make_guard((torch.randn(3),)) is None
        assert sg.make_check((torch.randn(3), None)) is None
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
