"""The width of a Triton kernel's global addresses, read from its TTIR (compiled without a GPU).

A data tensor's element offset passes 2^31 in ordinary calls (a 128K-token prefill whose q, k, v
are views of a fused projection; the scan's chain at 131072 segment-heads), and an int32 product
wraps silently there: the scan's chain and the Ascend twin both did, and only a 26 GB GPU run showed
the chain's. The rule: every offset applied to a kernel's data pointer argument, directly or through
the splat that turns it into a tile of pointers, is i64. Offsets on a pointer already moved (a tile
within the program's rows) may stay i32, and so may the index into a table of i32 (offsets, run
tables: one entry per sequence, segment or chunk) and into the arguments a kernel names as bounded
(per-head vectors, a workspace of bounded size).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

_FUNC = re.compile(r"tt\.func public @(\w+)\((.*?)\)\s*attributes", re.S)
_PTR_ARG = re.compile(r"%(\w+): !tt\.ptr<(\w+)>")
_DEF = re.compile(r"^\s*%(\w+)\s*=\s*(tt\.\w+)\s+(.*)$")
_ADDPTR = re.compile(r"^%(\w+),\s*%(\w+)\s*:(.*)$")
_WIDTH = re.compile(r"(?:x|\s|<)i(\d+)\b")
_TILES = ("tt.splat", "tt.broadcast", "tt.expand_dims")  # a pointer made into (a larger) tile of itself


@dataclass(frozen=True)
class Offset:
    """One offset applied to a data pointer argument (or a tile of it)."""

    kernel: str
    arg: str
    bits: int
    line: str


def _func(ttir: str) -> re.Match:
    m = _FUNC.search(ttir)
    if m is None:
        raise ValueError("no public tt.func in the TTIR")
    return m


def _data_args(m: re.Match, bounded: Iterable[str]) -> list[str]:
    skip = set(bounded)
    return [n for n, elem in _PTR_ARG.findall(m.group(2)) if elem not in ("i32", "i64") and n not in skip]


def data_pointers(ttir: str, bounded: Iterable[str] = ()) -> tuple[str, list[str]]:
    """(kernel name, its data pointer arguments): pointers to anything but i32/i64, less `bounded`."""
    m = _func(ttir)
    return m.group(1), _data_args(m, bounded)


def data_offsets(ttir: str, bounded: Iterable[str] = ()) -> list[Offset]:
    """Every offset applied to a data pointer argument of the TTIR's kernel, with its width."""
    m = _func(ttir)
    kernel = m.group(1)
    tile_of = {a: a for a in _data_args(m, bounded)}  # SSA name -> the argument it is (a tile of)
    out: list[Offset] = []
    for line in ttir[m.end():].splitlines():
        d = _DEF.match(line)
        if d is None:
            continue
        res, op, rest = d.groups()
        if op in _TILES:
            src = re.match(r"%(\w+)", rest)
            if src and src.group(1) in tile_of:
                tile_of[res] = tile_of[src.group(1)]
        elif op == "tt.addptr":
            a = _ADDPTR.match(rest)
            if a and a.group(1) in tile_of:
                offset_type = a.group(3).split(",")[-1]
                bits = _WIDTH.findall(offset_type)
                out.append(Offset(kernel, tile_of[a.group(1)], int(bits[-1]) if bits else 0, line.strip()))
    return out


def check(kernels: dict, bounded: Iterable[str] = ()) -> tuple[int, list[str]]:
    """(offsets checked, one line per narrow one) over compiled Triton kernels {name: CompiledKernel}."""
    seen, bad = 0, []
    for name, k in sorted(kernels.items()):
        for o in data_offsets(k.asm["ttir"], bounded):
            seen += 1
            if o.bits != 64:
                bad.append(f"{name}: {o.arg} + an i{o.bits} offset ({o.line.split(' loc(')[0]})")
    return seen, bad
