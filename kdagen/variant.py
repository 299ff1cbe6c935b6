"""The Variant: one compiled kernel of the matrix, identified by its canonical name."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .dtypes import GATE_TAGS


@dataclass(frozen=True, order=True)
class Variant:
    """A point of the kernel matrix.

    Only the fields that change generated code are part of the name; ``layouts``,
    ``varlen`` and ``gqa`` are run-time features (strides, a nullable pointer, an
    index map) that the spec may switch off for a target.
    """

    target: str
    chunk: int
    k: int
    v: int
    dtype: str
    gate: str
    state: str  # "fp32" | "bf16" | "none": precision of the carried state and of state in/out
    block_v: int  # V columns of the state per program/thread block (the V-split width)
    # o's products carried in hi + lo bf16 (sm80 chunk 16: Mqk in hi + lo, U0 = P v in fp32; o's error against
    # float64 halves for ~1% more time): named "_hl"; dispatch takes it over a plain twin that fits as well.
    precise: bool = False
    layouts: tuple[str, ...] = ("bnsd", "bsnd")
    varlen: bool = True
    gqa: bool = True
    hardware_validated: bool = True

    @property
    def name(self) -> str:
        return (
            f"kda_fwd_{self.target}_c{self.chunk}_k{self.k}_v{self.v}_{self.dtype}"
            f"_{GATE_TAGS[self.gate]}_s{self.state}_bv{self.block_v}{'_hl' if self.precise else ''}"
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layouts"] = list(self.layouts)
        if not self.precise:  # absent means plain: manifests and caches written before the field stay valid
            del d["precise"]
        d["name"] = self.name
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Variant":
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {key: val for key, val in d.items() if key in fields}
        kw["layouts"] = tuple(kw.get("layouts", ("bnsd", "bsnd")))
        return cls(**kw)
