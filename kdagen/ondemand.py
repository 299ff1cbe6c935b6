"""Variants no spec lists: made for a call that a target supports (another head dim, dtype or
gate form), as JIT kernel libraries do. The specs list what is built ahead of time; these
are rendered into the cache's `ondemand` spec and built there on first use (or ahead of time
with `kdagen build --variant NAME`).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from .cache import ONDEMAND_SPEC, locked
from .dtypes import GATE_TAGS
from .errors import KdagenError
from .generate import MANIFEST, emit
from .paths import cache_generated_dir
from .spec import Spec, _builtin_rejection
from .targets import TARGETS
from .variant import Variant

_TAG_GATES = {tag: gate for gate, tag in GATE_TAGS.items()}
NAME_RE = re.compile(r"kda_fwd_(?P<target>[a-z0-9_]+?)_c(?P<chunk>\d+)_k(?P<k>\d+)_v(?P<v>\d+)_(?P<dtype>[a-z0-9]+)"
                     r"_(?P<gate>g[a-z])_s(?P<state>[a-z0-9]+)_bv(?P<bv>\d+)(?P<hl>_hl)?")
NAME_FORMAT = "kda_fwd_<target>_c<chunk>_k<K>_v<V>_<dtype>_<gb|gu|gp>_s<fp32|bf16|none>_bv<block_v>[_hl]"


def unsupported(v: Variant) -> str | None:
    """Why target `v.target` cannot build `v` (None when it can)."""
    info = TARGETS.get(v.target)
    if info is None:
        return f"unknown target {v.target!r} (targets: {', '.join(sorted(TARGETS))})"
    for what, val, allowed in (("chunk", v.chunk, info.chunks), ("head dim K", v.k, info.head_dims),
                               ("head dim V", v.v, info.head_dims), ("dtype", v.dtype, info.dtypes),
                               ("gate", v.gate, info.gates), ("state", v.state, info.states),
                               ("block_v", v.block_v, info.block_v), ("precise", v.precise, info.precise)):
        if val not in allowed:
            return f"{v.target} has no {what} {val} (it has {', '.join(str(a) for a in allowed)})"
    return _builtin_rejection(v)


def parse_name(name: str) -> Variant:
    """The Variant a canonical name denotes (run-time features: everything its target has)."""
    m = NAME_RE.fullmatch(name)
    if m is None or m["gate"] not in _TAG_GATES:
        raise KdagenError(f"{name!r} is not a variant name; expected {NAME_FORMAT}")
    info = TARGETS.get(m["target"])
    if info is None:
        raise KdagenError(f"{name}: unknown target {m['target']!r} (targets: {', '.join(sorted(TARGETS))})")
    v = Variant(target=m["target"], chunk=int(m["chunk"]), k=int(m["k"]), v=int(m["v"]), dtype=m["dtype"],
                gate=_TAG_GATES[m["gate"]], state=m["state"], block_v=int(m["bv"]), precise=m["hl"] is not None,
                layouts=info.layouts,
                varlen=info.varlen, gqa=info.gqa, hardware_validated=info.hardware_validated)
    why = unsupported(v)
    if why:
        raise KdagenError(f"{name}: {why}")
    return v


def variants_for(target: str, *, dtype: str, k: int, v: int, gate: str, state: str,
                 chunk: int | None = None) -> list[Variant]:
    """Every variant `target` could build for a call with these functional fields (each chunk,
    V-split width and record it has, or only `chunk`); empty when the target supports none.
    Precise twins are offered where the target builds them (the refusals in
    targets/__init__.py apply), so dispatch's precise-first tie-break holds for generated
    variants as for listed ones."""
    info = TARGETS[target]
    if not info.on_demand:
        return []
    states = [state] if state != "none" else ["none", "fp32"]
    out = []
    for c, bv, st, hl in itertools.product(info.chunks if chunk is None else (chunk,), info.block_v, states,
                                           info.precise):
        var = Variant(target=target, chunk=c, k=k, v=v, dtype=dtype, gate=gate, state=st, block_v=bv, precise=hl,
                      layouts=info.layouts, varlen=info.varlen, gqa=info.gqa,
                      hardware_validated=info.hardware_validated)
        if unsupported(var) is None:
            out.append(var)
    return out


def ondemand_spec() -> Spec:
    root = cache_generated_dir() / ONDEMAND_SPEC
    return Spec(name=ONDEMAND_SPEC, path=str(root), description="variants generated for calls no spec lists",
                groups=[])


def register(variants: list[Variant]) -> Path:
    """Add `variants` to the cache's on-demand spec (rendered, manifest updated, under its lock);
    returns the generated folder that holds it."""
    import json

    out = cache_generated_dir()
    root = out / ONDEMAND_SPEC
    with locked(root, "adding on-demand variants"):
        have: dict[str, Variant] = {}
        man = root / MANIFEST
        if man.exists():
            have = {e["name"]: Variant.from_dict(e) for e in json.loads(man.read_text())["variants"]}
        for v in variants:
            have.setdefault(v.name, v)
        emit(ondemand_spec(), list(have.values()), out)
    return out
