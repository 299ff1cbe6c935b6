"""State pools: engines keep every request's recurrent state in one tensor [P, HV, V, K]
([P, HV, K, V] for the "KV" state layout) and pass each sequence's slot index; -1 marks a
padding sequence, whose slot is neither read nor written.

Implemented around the kernel call, on the current stream: the sequences' states are gathered
into a scratch initial state (index_select; padding rows zeroed), the kernel writes a scratch
final state, and that is copied back into the pool (index_copy_). Nothing is read on the host
when the caller promises valid indices (assume_valid) or passes them on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .errors import KdaInputError
from .scan.layout import device_ints
from .targets.cuda_driver import current_stream_capturing


_CPU = torch.device("cpu")


@dataclass
class PoolCall:
    pool: torch.Tensor
    index: torch.Tensor  # int64 [N] on the pool's device
    valid: Optional[torch.Tensor]  # bool [N] on the device; None when every index is known to be >= 0
    host: Optional[list[int]]  # the indices on the host, when known
    initial_state: torch.Tensor  # [N, HV, *state] scratch, gathered
    final_state: torch.Tensor  # [N, HV, *state] scratch the kernel writes


def _found(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, {t.device}"


def head_dims(q: torch.Tensor, v: torch.Tensor, layout: str, state_layout: str) -> tuple[int, tuple[int, int]]:
    """(HV, one state's shape) of a call's q and v, checked 4-dim (before the kernels' checks, which
    the pool's gather precedes)."""
    for name, t in (("q", q), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise KdaInputError(f"{name}: expected a 4-dim tensor, found "
                                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if state_layout not in ("VK", "KV"):  # the kernels' check, ahead of the pool's shape it decides
        raise KdaInputError(f"state_layout: expected 'VK' ([N, HV, V, K]) or 'KV' ([N, HV, K, V]), found "
                            f"{state_layout!r}")
    HV = v.shape[2] if str(layout).upper() == "BSND" else v.shape[1]
    K, V = q.shape[-1], v.shape[-1]
    return HV, ((K, V) if state_layout == "KV" else (V, K))


def check_pool(pool: torch.Tensor, *, HV: int, state_shape: tuple[int, int], device: torch.device,
               state_dtype: Optional[torch.dtype]) -> None:
    """The pool's shape [P, HV, *state_shape], dtype (float32/bfloat16, state_dtype's) and device."""
    if not isinstance(pool, torch.Tensor) or pool.dim() != 4 or tuple(pool.shape[1:]) != (HV, *state_shape):
        raise KdaInputError(f"state_pool: expected a tensor of shape [P, HV, ...] = (P, {HV}, {state_shape[0]}, "
                            f"{state_shape[1]}) (state_layout decides the last two), found {_found(pool)}")
    if pool.dtype not in (torch.float32, torch.bfloat16):
        raise KdaInputError(f"state_pool: expected dtype float32 or bfloat16, found {pool.dtype}")
    if pool.device != device:
        raise KdaInputError(f"state_pool: expected a tensor on {device} (same as q), found {pool.device}")
    if state_dtype is not None and state_dtype != pool.dtype:
        raise KdaInputError(f"state_dtype: expected {pool.dtype} (the state pool's dtype) or None, found {state_dtype}")


def check_slots(pool: torch.Tensor, indices: torch.Tensor, *, N: int, HV: int, state_shape: tuple[int, int],
                device: torch.device, state_dtype: Optional[torch.dtype], assume_valid: bool) -> Optional[list[int]]:
    """Check the pool and its indices (on the host unless assume_valid); the indices as a host list
    when they were read (or lie on the CPU), else None."""
    check_pool(pool, HV=HV, state_shape=state_shape, device=device, state_dtype=state_dtype)
    return check_indices(pool, indices, N=N, device=device, assume_valid=assume_valid)


def check_indices(pool: torch.Tensor, indices: torch.Tensor, *, N: int, device: torch.device, assume_valid: bool
                  ) -> Optional[list[int]]:
    """check_slots without the pool's own checks (a call of an already checked pool's signature)."""
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64) \
            or indices.numel() != N:
        raise KdaInputError(f"state_indices: expected a 1-D int32 or int64 tensor of {N} slot indices (one per "
                            f"sequence; -1: padding), found {_found(indices)}")
    if indices.device not in (device, _CPU):
        raise KdaInputError(f"state_indices: expected a tensor on {device} or on the CPU, found {indices.device}")
    if device.type == "cuda" and current_stream_capturing():
        if indices.device.type == "cpu":
            raise KdaInputError("state_indices: expected a tensor on the GPU under CUDA graph capture (a graph "
                                "cannot copy host memory in again on replay), found one on the CPU")
        if not assume_valid:
            raise KdaInputError("state_indices: cannot be checked during CUDA graph capture; pass assume_valid=True "
                                "(they are read by the kernels' gather on every replay)")
    P = pool.shape[0]
    host = None
    # Read on the host to check them (a device sync when they live on a GPU: pass them on the
    # CPU, or assume_valid), or because they are there anyway. A CPU call with assume_valid
    # takes the device path (nothing read), as a GPU call would.
    if not assume_valid or (indices.device.type == "cpu" and device.type != "cpu"):
        host = indices.tolist()
        if not assume_valid:
            _check(host, P)
    return host


def kernel_slots(indices: torch.Tensor, host: Optional[list[int]], device: torch.device) -> torch.Tensor:
    """The slots as kernels read them (KdaCall.h0_index/ht_index): int32 [N] on `device`; from the
    host list, a device copy cached by value (read-only), else converted on the device."""
    if host is not None:
        return device_ints(host, device)
    if indices.dtype is torch.int32 and indices.device == device and indices.is_contiguous():
        return indices  # (an engine's own int32 slots; .to and .contiguous go through the dispatcher)
    return indices.to(device=device, dtype=torch.int32).contiguous()


def gather(pool: torch.Tensor, indices: torch.Tensor, *, N: int, HV: int, state_shape: tuple[int, int],
           device: torch.device, state_dtype: Optional[torch.dtype], assume_valid: bool, read: bool = True,
           checked: Optional[tuple] = None) -> PoolCall:
    """Check the pool and its indices; gather the sequences' initial states (with read=False,
    only the slots to scatter final states to: initial_state is left unset scratch). checked:
    (check_slots' result,) where the caller has checked them already."""
    host = checked[0] if checked is not None else check_slots(
        pool, indices, N=N, HV=HV, state_shape=state_shape, device=device, state_dtype=state_dtype,
        assume_valid=assume_valid)
    P = pool.shape[0]
    # Known on the host: a device copy cached by value (a model's layers pass one step's slots), read-only
    index = device_ints(host, device, torch.int64) if host is not None else \
        indices.to(device=device, dtype=torch.int64, non_blocking=True)
    all_valid = host is not None and all(i >= 0 for i in host)
    if not read:
        h0 = torch.empty((N, HV, *state_shape), dtype=pool.dtype, device=device)
        return PoolCall(pool, index, None if all_valid else index >= 0, host, h0, torch.empty_like(h0))
    if P == 0:  # only padding sequences (checked above unless assume_valid)
        h0 = torch.zeros((N, HV, *state_shape), dtype=pool.dtype, device=device)
        return PoolCall(pool, index, torch.zeros(N, dtype=torch.bool, device=device), host, h0, torch.empty_like(h0))
    if all_valid:
        h0 = pool.index_select(0, index)
        valid = None
    else:
        valid = index >= 0
        h0 = pool.index_select(0, index.clamp(min=0))
        h0.masked_fill_(~valid.view(-1, 1, 1, 1), 0)
    return PoolCall(pool, index, valid, host, h0, torch.empty_like(h0))


def _check(host: list[int], P: int) -> None:
    # The common case in builtins (a model's every layer checks the step's slots): in range and distinct
    if not host or (min(host) >= -1 and max(host) < P and len(set(host)) + max(0, host.count(-1) - 1) == len(host)):
        return
    seen: dict[int, int] = {}
    for n, i in enumerate(host):
        if i < -1 or i >= P:
            raise KdaInputError(f"state_indices: expected slot indices in [0, {P}) or -1 (padding), found {i} at "
                                f"position {n}")
        if i >= 0:
            if i in seen:
                raise KdaInputError(f"state_indices: expected distinct slots (-1 excepted), found slot {i} at "
                                    f"positions {seen[i]} and {n}")
            seen[i] = n


def scatter(pc: PoolCall) -> None:
    """Write the sequences' final states into their slots, in place; padding rows write nothing."""
    pool, fs = pc.pool, pc.final_state
    if pool.shape[0] == 0 or fs.shape[0] == 0:
        return
    if pc.valid is None:
        pool.index_copy_(0, pc.index, fs)
        return
    if pc.host is not None:
        rows = [n for n, i in enumerate(pc.host) if i >= 0]
        if rows:
            sel = device_ints(rows, pool.device, torch.int64)
            pool.index_copy_(0, pc.index.index_select(0, sel), fs.index_select(0, sel))
        return
    # Indices unknown on the host: every row is written, a padding row to the slot of the first
    # real sequence with that sequence's very state (duplicate indices with equal values give
    # the same result in any order), or, with no real sequence at all, slot 0 with its own value.
    valid = pc.valid
    N = valid.shape[0]
    first = valid.to(torch.int32).argmax().view(1)
    any_valid = valid.any()
    fallback = torch.where(any_valid, pc.index.gather(0, first), torch.zeros_like(first))
    target = torch.where(valid, pc.index, fallback)
    src_rows = torch.where(valid, torch.arange(N, device=valid.device), first)
    src = torch.where(any_valid, fs.index_select(0, src_rows), pool[:1])
    pool.index_copy_(0, target, src)
