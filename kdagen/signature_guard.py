"""A fast check that a call's tensors have the signature a plan was made for.

The runtime's plan lookup builds a Python key of every tensor's dtype, shape, strides and device
(about 0.45 us a tensor, most of a repeated call's host cost). torch.compile checks the same
facts of its inputs with a guard written in C++ (torch._C._dynamo.guards.TensorGuards: Python
type, dispatch keys, dtype, device index, requires_grad, sizes, strides, one call for all
tensors). The runtime asks such a guard first whether a call matches the latest call's plan and
builds the Python key only when it does not. The guard is torch's private API: it is used only
where it passes a self-test of what it must tell apart; elsewhere make_guard returns None and
every call takes the Python key.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Optional

import torch


class _Absent(torch.Tensor):
    """The type of the placeholders for absent (None) arguments: no caller's tensor has it, so a
    placeholder matches only an absent argument (a guard compares Python types exactly)."""


def placeholders(n: int) -> tuple[torch.Tensor, ...]:
    """n distinct placeholders, one per argument slot that may be None (a guard fails a call
    that passes one tensor object in two slots, so slots cannot share one)."""
    return tuple(torch.Tensor._make_subclass(_Absent, torch.empty(0)) for _ in range(n))


def _tensor_guards() -> Optional[type]:
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    return getattr(guards, "TensorGuards", None)


def _build(cls: type, tensors: tuple) -> Any:
    # static shapes: both keywords None (a list there means per-dimension dynamic sizes)
    return cls(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)


@lru_cache(maxsize=None)
def available() -> bool:
    """Whether torch's tensor guard is here and tells apart what a signature must."""
    cls = _tensor_guards()
    if cls is None:
        return False
    try:
        (none,) = placeholders(1)
        guard = _build(cls, (torch.zeros(2, 3), none))
        same = guard.check(torch.ones(2, 3), none) is True
        others = [
            (torch.ones(2, 4), none),                           # shape
            (torch.ones(3, 2).t(), none),                       # strides
            (torch.ones(2, 3, dtype=torch.float64), none),      # dtype
            (torch.ones(2, 3, requires_grad=True), none),       # autograd
            (torch.empty(2, 3, device="meta"), none),           # device type
            (torch.ones(2, 3), torch.empty(0)),                 # a tensor where none was
            (torch.nn.Parameter(torch.ones(2, 3)), none),       # Python type
        ]
        return same and all(guard.check(*o) is False for o in others)
    except Exception:
        return False


def make_guard(args: tuple) -> Optional[Any]:
    """A guard of these call arguments (tensors, placeholders for absent ones): its check(*args)
    of another call's arguments is True only when they have the same signature. None where
    torch's guard is unusable or fails these very arguments (one tensor passed twice)."""
    if not available():
        return None
    try:
        guard = _build(_tensor_guards(), args)
        return guard if guard.check(*args) is True else None
    except Exception:
        return None
