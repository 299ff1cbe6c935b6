"""States at interior positions of each sequence (prefix caching), taken from the states the
kernels write entering every chunk (return_chunk_states) and the final state.

A state after `pos` tokens of a sequence of length L (pos a multiple of the kernel's chunk) is
the state entering chunk pos / chunk when pos < L, and the final state when pos == L.

Cost: the kernel keeps the state entering every m-th chunk (return_chunk_states=m, m =
checkpoint_every / chunk: one state per checkpoint) in a scratch tensor, followed by the final
states, from which one gather makes the checkpoints.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .errors import KdaInputError
from .inputs import kept_stride
from .scan.layout import device_ints
from .targets.cuda_driver import current_stream_capturing

KERNEL_CHUNKS = (64, 16)  # the chunk sizes the kernels have (the one-GPU call tries its plan's chunk first)


def require_spacing(every: Optional[int]) -> None:
    """checkpoints= / checkpoint_offsets= come with checkpoint_every."""
    if every is None:
        raise KdaInputError("checkpoint_every: expected the checkpoints' spacing in tokens with checkpoints= / "
                            "checkpoint_offsets=, found None")


def kernel_chunks(every: int, chunk_size: Optional[int], arg: str = "checkpoint_every") -> tuple[int, ...]:
    """The kernel chunk sizes (largest first) whose chunk states include every
    multiple of `every` (it must be a multiple of one of them)."""
    if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
        raise KdaInputError(f"{arg}: expected a positive number of tokens, found {every!r}")
    if chunk_size is not None:
        if every % chunk_size:
            raise KdaInputError(f"{arg}: expected a multiple of chunk_size={chunk_size}, found {every}")
        return (chunk_size,)
    fits = tuple(c for c in KERNEL_CHUNKS if every % c == 0)
    if not fits:
        raise KdaInputError(f"{arg}: expected a multiple of the kernels' chunk size "
                            f"({' or '.join(map(str, sorted(KERNEL_CHUNKS)))}), found {every}")
    return fits


def caller_chunks(every: int, chunk_size: Optional[int], return_chunk_states: bool | int,
                  chunk_states: Optional[torch.Tensor]) -> tuple[tuple[int, ...], int]:
    """kernel_chunks for a call with checkpoints, and the stride of the chunk states its caller
    asks for besides them (0: none): those need chunk_size, and a spacing that every divides."""
    stride = kept_stride(return_chunk_states, chunk_states)
    if stride and chunk_size is None:
        raise KdaInputError("chunk_size: expected 16 or 64 when return_chunk_states=True (the states' spacing), "
                            "found None")
    chunks = kernel_chunks(every, chunk_size)
    if stride > 1 and every % (chunk_size * stride):
        raise KdaInputError(f"checkpoint_every: expected a multiple of chunk_size x return_chunk_states = "
                            f"{chunk_size * stride} (the chunk states kept), found {every}")
    return chunks, stride


@dataclass
class Rows:
    """Which rows of the chunk states / final state go to which output rows (int64, device)."""

    chunk_src: torch.Tensor
    chunk_dst: torch.Tensor
    final_src: torch.Tensor
    final_dst: torch.Tensor

    def copy(self, out: torch.Tensor, chunk_states: torch.Tensor, final_state: Optional[torch.Tensor]) -> None:
        if self.chunk_src.numel():
            out.index_copy_(0, self.chunk_dst, chunk_states.index_select(0, self.chunk_src))
        if self.final_src.numel():
            out.index_copy_(0, self.final_dst, final_state.index_select(0, self.final_src))


def rows(lens: Sequence[int], chunk: int, positions: Sequence[Sequence[int]], dst_first: Sequence[int],
         device: torch.device) -> Rows:
    """Rows for the states after positions[n] tokens of sequence n (each a multiple of `chunk`,
    at most lens[n]), written to rows dst_first[n], dst_first[n] + 1, ...; `chunk` is the chunk
    states' spacing in tokens (the kernel's chunk times the stride it kept them at)."""
    return Rows(*_on_device(*_indices(lens, chunk, positions, dst_first), device))


def _indices(lens, chunk, positions, dst_first) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """rows()'s four index lists, flat, and their sizes."""
    chunk_src, chunk_dst, final_src, final_dst = [], [], [], []
    first_chunk = 0
    for n, (L, pos, dst) in enumerate(zip(lens, positions, dst_first)):
        for j, p in enumerate(pos):
            if p < L:
                chunk_src.append(first_chunk + p // chunk)
                chunk_dst.append(dst + j)
            else:
                final_src.append(n)
                final_dst.append(dst + j)
        first_chunk += -(-L // chunk)
    parts = (chunk_src, chunk_dst, final_src, final_dst)
    return tuple(x for p in parts for x in p), tuple(map(len, parts))


def _on_device(flat: tuple[int, ...], sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The index lists on `device` (views of one tensor), cached by value, one copy per stream:
    READ-ONLY (index_select / index_copy_ only read them). A plain copy from pageable memory
    waited for the stream on every call."""
    if device.type == "cuda" and current_stream_capturing():
        raise KdaInputError("checkpoint_every: not under CUDA graph capture (the rows are placed from host "
                            "lengths, which a replay would not see change)")
    t = device_ints(flat, device, torch.int64)
    # device_ints hands out the same tensor for the same values, so its views are made once (six
    # slices were ~10 us of host time a call); keyed by id, checked by identity
    hit = _VIEWS.get(id(t))
    if hit is None or hit[0] is not t or hit[1] != sizes:
        at, parts = 0, []
        for n in sizes:
            parts.append(t[at:at + n])
            at += n
        if len(_VIEWS) >= 256:
            _VIEWS.clear()
        hit = _VIEWS[id(t)] = (t, sizes, tuple(parts))
    return hit[2]


_VIEWS: dict = {}  # id(index tensor) -> (it, sizes, its views)


@functools.lru_cache(maxsize=256)
def _plan_indices(every: int, chunk: int, lens: tuple[int, ...], dst_first: tuple[int, ...]):
    """plan()'s index lists, by value (a model's layers repeat one layout): rows()'s four, then
    the checkpoints' rows in [chunk states; final states] and their buffer rows, in buffer order;
    the flat tuple, the six sizes and the chunk-state rows a call keeps at spacing `chunk`."""
    positions = [[(j + 1) * every for j in range(L // every)] for L in lens]
    flat, sizes = _indices(lens, chunk, positions, dst_first)
    kept = sum(-(-L // chunk) for L in lens)
    a, b, c = itertools.accumulate(sizes[:3])
    # the final states sit after the kept chunk-state rows in the stacked source
    src_of = dict(zip(flat[a:b], flat[:a])) | dict(zip(flat[c:], (kept + n for n in flat[b:c])))
    dst = sorted(src_of)
    need = max((d + L // every for d, L in zip(dst_first, lens)), default=0)  # rows the checkpoints reach
    return flat + tuple(src_of[d] for d in dst) + tuple(dst), sizes + (len(dst), len(dst)), kept, need


@functools.lru_cache(maxsize=256)
def _packed_offsets(every: int, lens: tuple[int, ...]) -> list[int]:
    """place()'s offsets without a caller's buffer or offsets (READ-ONLY: cached)."""
    return [0, *itertools.accumulate(L // every for L in lens)]


@dataclass
class Checkpoints:
    """Where a call's checkpoints come from and go. From one stacked tensor [chunk states (`kept`
    rows at the plan's spacing); final states (N)], which the call writes as its chunk_states= and
    final_state=, `fill` gathers them in one op (two with the caller's buffer or offsets); `rows`
    copies them from separate chunk-state and final-state tensors."""

    rows: Rows
    buffer: Optional[torch.Tensor]  # the caller's, or None: allocated (`shape`) by fill / target
    offsets: list[int]
    kept: int
    stacked_src: torch.Tensor
    stacked_dst: torch.Tensor
    packed: bool  # no caller buffer or offsets: the checkpoints are the new buffer's rows in order
    shape: tuple[int, ...]

    def target(self, like: torch.Tensor) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(self.shape, dtype=like.dtype, device=like.device)
        return self.buffer

    def fill(self, stacked: torch.Tensor) -> torch.Tensor:
        """The buffer with every checkpoint taken from `stacked`."""
        if self.packed:
            # each index_select / index_copy_ costs 30-40 us of host time (H100 host, session 45)
            self.buffer = stacked.index_select(0, self.stacked_src)
        elif self.stacked_src.numel():
            self.target(stacked).index_copy_(0, self.stacked_dst, stacked.index_select(0, self.stacked_src))
        return self.target(stacked)


def plan(every: int, lens: Sequence[int], *, HV: int, state_shape: tuple[int, int], dtype: torch.dtype,
         device: torch.device, chunk: int, buffer: Optional[torch.Tensor], offsets: Optional[torch.Tensor],
         assume_valid: bool) -> Checkpoints:
    """Where each sequence's checkpoints go: sequence n's j-th (the state after (j + 1) * every
    tokens, for j < L_n // every) to row offsets[n] + j of `buffer` (allocated when None);
    `chunk` is the spacing in tokens of the chunk states the call keeps."""
    packed = buffer is None and offsets is None
    lens = tuple(lens)
    if packed:  # nothing to check: the offsets follow from the lengths (and are cached with them)
        offs = _packed_offsets(every, lens)
    else:
        buffer, offs = place(every, lens, HV=HV, state_shape=state_shape, dtype=dtype, device=device, buffer=buffer,
                             offsets=offsets, assume_valid=assume_valid, allocate=False)
    flat, sizes, kept, need = _plan_indices(every, chunk, lens, tuple(offs[:len(lens)]))
    parts = _on_device(flat, sizes, device)
    return Checkpoints(Rows(*parts[:4]), buffer, offs, kept, parts[4], parts[5], packed,
                       (max(need, offs[-1]), HV, *state_shape))


def place(every: int, lens: Sequence[int], *, HV: int, state_shape: tuple[int, int], dtype: torch.dtype,
          device: torch.device, buffer: Optional[torch.Tensor], offsets: Optional[torch.Tensor],
          assume_valid: bool, allocate: bool = True) -> tuple[Optional[torch.Tensor], list[int]]:
    """The checkpoints' buffer (checked, or allocated when None and `allocate`) and every
    sequence's first row (offsets [N + 1], READ-ONLY; default: packed in order)."""
    N = len(lens)
    counts = [L // every for L in lens]
    if offsets is None:
        offs = _packed_offsets(every, tuple(lens))
    else:
        if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() != N + 1 \
                or offsets.dtype not in (torch.int32, torch.int64):
            raise KdaInputError(f"checkpoint_offsets: expected a 1-D int32/int64 tensor of N + 1 = {N + 1} row "
                                f"offsets (sequence n's checkpoints start at row offsets[n]), found "
                                f"{tuple(offsets.shape) if isinstance(offsets, torch.Tensor) else type(offsets).__name__}")
        offs = offsets.tolist()  # a device sync when they live on a GPU: pass them on the CPU
        if not assume_valid:
            for n in range(N):
                if offs[n] < 0 or offs[n + 1] - offs[n] < counts[n]:
                    raise KdaInputError(f"checkpoint_offsets: sequence {n} ({lens[n]} tokens, checkpoint_every="
                                        f"{every}) needs {counts[n]} rows from offsets[{n}]={offs[n]}, found room for "
                                        f"{offs[n + 1] - offs[n]}")
    need = max((offs[n] + counts[n] for n in range(N)), default=0)
    rows_shape = (HV, *state_shape)
    if buffer is None:
        if allocate:
            buffer = torch.empty((max(need, offs[-1]), *rows_shape), dtype=dtype, device=device)
    elif not isinstance(buffer, torch.Tensor) or buffer.dim() != 4 or tuple(buffer.shape[1:]) != rows_shape \
            or buffer.dtype != dtype or buffer.device != device or buffer.shape[0] < need:
        found = (f"shape {tuple(buffer.shape)}, dtype {buffer.dtype}, {buffer.device}"
                 if isinstance(buffer, torch.Tensor) else type(buffer).__name__)
        raise KdaInputError(f"checkpoints: expected a tensor of at least {need} rows, shape (rows, {HV}, "
                            f"{state_shape[0]}, {state_shape[1]}), dtype {dtype}, on {device}, found {found}")
    return buffer, offs


def host_lengths(B: int, T: int, cu_seqlens: Optional[torch.Tensor], cu_seqlens_cpu: Optional[torch.Tensor],
                 what: str) -> list[int]:
    """Every sequence's length on the host (a device read of cu_seqlens unless cu_seqlens_cpu)."""
    if cu_seqlens is None:
        return [T] * B
    if cu_seqlens_cpu is not None:
        cu = cu_seqlens_cpu.tolist()
    elif torch.cuda.is_available() and current_stream_capturing():
        raise KdaInputError(f"cu_seqlens_cpu: {what} needs the sequence lengths on the host; pass cu_seqlens_cpu "
                            "(cu_seqlens cannot be read during CUDA graph capture)")
    else:
        cu = cu_seqlens.tolist()
    return [b - a for a, b in zip(cu, cu[1:])]
