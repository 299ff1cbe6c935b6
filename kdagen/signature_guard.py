"""A fast check that a call's tensors have the signature a plan was made for.

The runtime's plan lookup builds a Python key of every tensor's dtype, shape, strides and device
(about 0.45 us a tensor, most of a repeated call's host cost). torch.compile checks the same
facts of its inputs with a guard written in C++ (torch._C._dynamo.guards.TensorGuards: Python
type, dispatch keys, dtype, device index, requires_grad, sizes, strides, one call for all
tensors). The runtime asks such a guard first whether a call matches the latest call's plan and
builds the Python key only when it does not. The guard is torch's private API: it is used only
where it passes a self-test of what it must tell apart; elsewhere make_guard returns None and
every call takes the Python key.

Optional arguments: make_check's function tests the slots that were None with `is None` and
gives the guard only the tensors (the guard costs about 0.13 us a tensor; a placeholder tensor
per absent slot cost as much as a real one).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Optional

import torch


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
        guard = _build(cls, (torch.zeros(2, 3), torch.zeros(1)))
        same = guard.check(torch.ones(2, 3), torch.ones(1)) is True
        one = torch.ones(1)
        others = [
            (torch.ones(2, 4), one),                           # shape
            (torch.ones(3, 2).t(), one),                       # strides
            (torch.ones(2, 3, dtype=torch.float64), one),      # dtype
            (torch.ones(2, 3, requires_grad=True), one),       # autograd
            (torch.empty(2, 3, device="meta"), one),           # device type
            (torch.nn.Parameter(torch.ones(2, 3)), one),       # Python type
        ]
        return same and all(guard.check(*o) is False for o in others)
    except Exception:
        return False


def make_guard(tensors: tuple) -> Optional[Any]:
    """A guard of these tensors: its check(*tensors) of another call's tensors is True only when
    they have the same signature. None where torch's guard is unusable or fails these very
    tensors (one tensor passed twice)."""
    if not available():
        return None
    try:
        guard = _build(_tensor_guards(), tensors)
        return guard if guard.check(*tensors) is True else None
    except Exception:
        return None


@lru_cache(maxsize=None)
def _check_factory(absent: tuple[bool, ...]) -> Callable:
    """`make(guard_check)` -> a function of len(absent) arguments: the absent slots are None and
    the others pass guard_check. Written out per pattern (one `is None` a slot, then one call
    with the tensors, no tuple built per call); compiled once per pattern."""
    names = [f"a{i}" for i in range(len(absent))]
    tests = [f"{n} is None" for n, a in zip(names, absent) if a]
    present = ", ".join(n for n, a in zip(names, absent) if not a)
    src = (f"def make(guard_check):\n"
           f"    def check({', '.join(names)}):\n"
           f"        return {' and '.join(tests + [f'guard_check({present})'])}\n"
           f"    return check\n")
    scope: dict = {}
    exec(compile(src, f"<kdagen.signature_guard check {''.join('-' if a else 't' for a in absent)}>", "exec"), scope)
    return scope["make"]


def make_check(args: tuple) -> Optional[Callable[..., bool]]:
    """A check of call arguments (tensors, or None for absent optional ones): check(*other) is
    True only when `other` has None in the same slots and tensors of the same signature in the
    others (False where one of those holds no tensor). None where torch's guard is unusable or
    fails these very arguments."""
    guard = make_guard(tuple(a for a in args if a is not None))
    if guard is None:
        return None
    return _check_factory(tuple(a is None for a in args))(guard.check)
