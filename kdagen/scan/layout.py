"""Sequences split into segments on chunk boundaries (the unit every scan step works on).

Tokens are packed: sequence n covers [cu[n], cu[n+1]). Each sequence is cut into consecutive
segments whose boundaries fall on multiples of `align` tokens from the sequence's start (a
multiple of the chunk size, so every segment is chunked exactly as the one-piece call chunks the
sequence); only a sequence's last segment may end mid-chunk. Segments tile the packed tokens in
order, so their offsets are a refinement of cu and serve directly as a varlen cu_seqlens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from ..targets.cuda_driver import current_stream_capturing, current_stream_handle

__all__ = ["SegmentLayout", "split", "balanced", "host_to_device", "device_ints"]


def host_to_device(values: Sequence[int] | torch.Tensor, device: torch.device, dtype: torch.dtype = torch.int32
                   ) -> torch.Tensor:
    """Host offsets or indices on `device` without stopping the host: a plain copy from pageable
    memory waits for the stream, which left the GPU idle while the host prepared the next launch
    (profiled on the H200, benchmarks/NOTES.md, session 29). Pinned memory with a non-blocking
    copy is safe: torch's host allocator keeps the block until the copy is done."""
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(list(values), dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=256)
def _cached_ints(values: tuple[int, ...], device: torch.device, dtype: torch.dtype, stream: int) -> torch.Tensor:
    return host_to_device(values, device, dtype)


def device_ints(values: Sequence[int], device: torch.device | str, dtype: torch.dtype = torch.int32
                ) -> torch.Tensor:
    """host_to_device cached by value: READ-ONLY (callers must not write it). The scan's offsets
    and indices repeat call after call (a model's layers, a cp rank's layout), and each fresh
    copy cost ~20-40 us of host time before the first kernel (benchmarks/NOTES.md, session 33).
    Fresh under CUDA graph capture (a graph's memory is its own).

    One copy per CUDA stream: a copy is queued on the stream that first asked, so another stream
    could read it before it lands; and the caching allocator may hand an evicted copy's memory
    to new work on its own stream only, which is safe when that is the one stream using it."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return _cached_ints(tuple(map(int, values)), dev, dtype, 0)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    # (torch's C queries: torch.cuda.current_stream builds a Stream object per call)
    if current_stream_capturing():
        return host_to_device(values, dev, dtype)
    return _cached_ints(tuple(map(int, values)), dev, dtype, current_stream_handle(dev.index))


def balanced(units: int, parts: int) -> list[int]:
    """`units` split into `parts` sizes that differ by at most one (larger first)."""
    if units < 0 or parts < 1:
        raise ValueError(f"balanced: expected units >= 0 and parts >= 1, found {units}, {parts}")
    return [units // parts + (1 if i < units % parts else 0) for i in range(parts)]


@dataclass(frozen=True)
class SegmentLayout:
    """cu: the sequences' packed offsets [N + 1]; bounds: the segments' [S + 1]; counts[n]:
    segments of sequence n (at least one; an empty sequence has one empty segment)."""

    cu: tuple[int, ...]
    bounds: tuple[int, ...]
    counts: tuple[int, ...]
    align: int

    @property
    def num_sequences(self) -> int:
        return len(self.counts)

    @property
    def num_segments(self) -> int:
        return len(self.bounds) - 1

    @functools.cached_property  # layouts are cached (split) and read per sequence: build once
    def first(self) -> list[int]:
        """Index of each sequence's first segment (read-only)."""
        out, at = [], 0
        for c in self.counts:
            out.append(at)
            at += c
        return out

    @functools.cached_property
    def last(self) -> list[int]:
        """Index of each sequence's last segment (read-only)."""
        return [f + c - 1 for f, c in zip(self.first, self.counts)]

    @property
    def sequence_of(self) -> list[int]:
        """The sequence of every segment."""
        return [n for n, c in enumerate(self.counts) for _ in range(c)]

    @property
    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    @property
    def split_any(self) -> bool:
        return any(c > 1 for c in self.counts)

    def chunks(self, chunk: int) -> list[int]:
        """Chunks of `chunk` tokens in every segment (a ragged tail counts as one)."""
        if self.align % chunk:
            raise ValueError(f"chunk: expected a divisor of the layout's alignment {self.align}, found {chunk}")
        return [-(-n // chunk) for n in self.lengths]

    def bounds_tensor(self, device=None, dtype=torch.int32) -> torch.Tensor:
        """The segments' offsets as a varlen cu_seqlens (cached: read-only)."""
        return device_ints(self.bounds, device or "cpu", dtype)

    @property
    def equal_counts(self) -> int:
        """c where every sequence has c segments (its first segments are then every c-th), else 0."""
        c = self.counts[0] if self.counts else 0
        return c if all(x == c for x in self.counts) else 0


def split(cu: Sequence[int], segments: int | Sequence[int], align: int) -> SegmentLayout:
    """Cut each sequence of `cu` into `segments` (one count for all, or one per sequence) near-equal
    segments of whole `align`-token units; a sequence of fewer units gets fewer segments."""
    return _split(tuple(int(x) for x in cu),
                  int(segments) if isinstance(segments, int) else tuple(int(s) for s in segments), int(align))


@functools.lru_cache(maxsize=256)
def _split(cu: tuple[int, ...], segments: int | tuple[int, ...], align: int) -> SegmentLayout:
    cu = list(cu)
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu: expected non-decreasing offsets from 0 with at least 2 entries, found {cu}")
    if align < 1:
        raise ValueError(f"align: expected a positive number of tokens, found {align}")
    N = len(cu) - 1
    want = [int(segments)] * N if isinstance(segments, int) else [int(s) for s in segments]
    if len(want) != N or any(s < 1 for s in want):
        raise ValueError(f"segments: expected one count >= 1 or {N} of them, found {segments}")
    bounds, counts = [0], []
    for (a, b), s in zip(zip(cu, cu[1:]), want):
        units = -(-(b - a) // align)
        sizes = [u for u in balanced(units, max(1, min(s, units)))]
        at = a
        for u in sizes[:-1]:
            at += u * align
            bounds.append(at)
        bounds.append(b)
        counts.append(len(sizes))
    return SegmentLayout(tuple(cu), tuple(bounds), tuple(counts), align)
