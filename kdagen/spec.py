"""Load and validate a YAML spec, and expand it into the sorted list of Variants.

A spec is the only place the kernel matrix is written. Format::

    name: ci                      # optional; defaults to the file's stem
    description: free text
    variants:                     # groups; each is the product of its list-valued axes
      - target: triton
        chunk: [16, 64]
        head_dim: [64, [128, 128]]  # an int means K = V; a pair is [K, V]
        dtype: [fp32, bf16]
        gate: [bounded, unbounded, precomputed]
        state: [fp32, bf16]
        block_v: 32
        precise: [false, true]    # optional axis: o's products in hi + lo bf16 (sm80 chunk 16); default false
        layouts: [bsnd, bnsd]     # optional run-time features; default: all the target has
        varlen: true
        gqa: true
    exclude:
      - when: {dtype: fp16, gate: unbounded}
        reason: why this combination is dropped
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import SpecError
from .targets import TARGETS, TargetInfo
from .variant import Variant

TOP_KEYS = ("name", "description", "variants", "exclude")
GROUP_AXES = ("target", "chunk", "head_dim", "dtype", "gate", "state", "block_v")
GROUP_OPTIONAL_AXES = ("precise",)  # default: [false]
GROUP_FEATURES = ("layouts", "varlen", "gqa")
EXCLUDE_AXES = ("target", "chunk", "k", "v", "dtype", "gate", "state", "block_v", "precise")


@dataclass(frozen=True)
class Dropped:
    variant: Variant
    reason: str


@dataclass
class Spec:
    name: str
    path: str
    description: str
    groups: list[dict[str, Any]]
    excludes: list[dict[str, Any]] = field(default_factory=list)


def _fmt(values) -> str:
    return ", ".join(str(v) for v in values)


def _as_list(val: Any) -> list[Any]:
    return list(val) if isinstance(val, list) else [val]


def load_spec(path: str | Path) -> Spec:
    """Read and validate a spec file. Raises SpecError naming the file and the key."""
    p = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SpecError(p, "<file>", f"cannot read: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError(p, "<yaml>", f"not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise SpecError(p, "<top>", f"expected a mapping with keys {_fmt(TOP_KEYS)}, found {type(data).__name__}")
    for key in data:
        if key not in TOP_KEYS:
            raise SpecError(p, str(key), f"unknown key; allowed: {_fmt(TOP_KEYS)}")
    name = data.get("name", Path(path).stem)
    if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
        raise SpecError(p, "name", f"expected a name of letters, digits, '-' and '_', found {name!r}")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise SpecError(p, "description", f"expected text, found {type(description).__name__}")
    groups = data.get("variants")
    if not isinstance(groups, list) or not groups:
        raise SpecError(p, "variants", "expected a non-empty list of variant groups")
    checked = [_check_group(p, i, g) for i, g in enumerate(groups)]
    excludes = data.get("exclude", []) or []
    if not isinstance(excludes, list):
        raise SpecError(p, "exclude", "expected a list of {when: {...}, reason: ...}")
    checked_ex = [_check_exclude(p, i, e) for i, e in enumerate(excludes)]
    return Spec(name=name, path=p, description=description, groups=checked, excludes=checked_ex)


def _check_group(p: str, i: int, g: Any) -> dict[str, Any]:
    where = f"variants[{i}]"
    if not isinstance(g, dict):
        raise SpecError(p, where, f"expected a mapping, found {type(g).__name__}")
    for key in g:
        if key not in GROUP_AXES + GROUP_OPTIONAL_AXES + GROUP_FEATURES:
            raise SpecError(p, f"{where}.{key}",
                            f"unknown key; allowed: {_fmt(GROUP_AXES + GROUP_OPTIONAL_AXES + GROUP_FEATURES)}")
    for key in GROUP_AXES:
        if key not in g:
            raise SpecError(p, f"{where}.{key}", "missing; every group names " + _fmt(GROUP_AXES))
    target = g["target"]
    if target not in TARGETS:
        raise SpecError(p, f"{where}.target", f"{target!r} is not a target; allowed: {_fmt(sorted(TARGETS))}")
    info: TargetInfo = TARGETS[target]
    out: dict[str, Any] = {"target": target}

    def check_values(key: str, allowed: tuple, kind: type, default: Any = None) -> list[Any]:
        vals = _as_list(g[key] if default is None else g.get(key, default))
        if not vals:
            raise SpecError(p, f"{where}.{key}", f"empty list; allowed: {_fmt(allowed)}")
        for v in vals:
            if kind is bool and not isinstance(v, bool):
                raise SpecError(p, f"{where}.{key}", f"expected true or false, found {v!r}")
            if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)) or v not in allowed:
                raise SpecError(p, f"{where}.{key}", f"{v!r} is not allowed for target {target}; allowed: {_fmt(allowed)}")
        return sorted(set(vals))

    out["chunk"] = check_values("chunk", info.chunks, int)
    out["dtype"] = check_values("dtype", info.dtypes, str)
    out["gate"] = check_values("gate", info.gates, str)
    out["state"] = check_values("state", info.states, str)
    out["block_v"] = check_values("block_v", info.block_v, int)
    out["precise"] = check_values("precise", info.precise, bool, default=False)
    dims = []
    for hd in _as_list(g["head_dim"]):
        pair = (hd, hd) if isinstance(hd, int) and not isinstance(hd, bool) else hd
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in pair)):
            raise SpecError(p, f"{where}.head_dim", f"expected an int (K = V) or a pair [K, V], found {hd!r}")
        for x in pair:
            if x not in info.head_dims:
                raise SpecError(p, f"{where}.head_dim", f"{x} is not allowed for target {target}; allowed: {_fmt(info.head_dims)}")
        dims.append(tuple(pair))
    out["head_dim"] = sorted(set(dims))
    layouts = g.get("layouts", list(info.layouts))
    for lay in _as_list(layouts):
        if lay not in info.layouts:
            raise SpecError(p, f"{where}.layouts", f"{lay!r} is not supported by target {target}; allowed: {_fmt(info.layouts)}")
    out["layouts"] = tuple(sorted(set(_as_list(layouts))))
    for feat, supported in (("varlen", info.varlen), ("gqa", info.gqa)):
        val = g.get(feat, supported)
        if not isinstance(val, bool):
            raise SpecError(p, f"{where}.{feat}", f"expected true or false, found {val!r}")
        if val and not supported:
            raise SpecError(p, f"{where}.{feat}", f"target {target} does not support {feat}; allowed: false")
        out[feat] = val
    return out


def _check_exclude(p: str, i: int, e: Any) -> dict[str, Any]:
    where = f"exclude[{i}]"
    if not isinstance(e, dict) or set(e) - {"when", "reason"} or "when" not in e:
        raise SpecError(p, where, "expected {when: {axis: value(s)}, reason: text}")
    when = e["when"]
    if not isinstance(when, dict) or not when:
        raise SpecError(p, f"{where}.when", f"expected a non-empty mapping of axes ({_fmt(EXCLUDE_AXES)}) to values")
    for key in when:
        if key not in EXCLUDE_AXES:
            raise SpecError(p, f"{where}.when.{key}", f"unknown axis; allowed: {_fmt(EXCLUDE_AXES)}")
    reason = e.get("reason", "excluded by the spec")
    return {"when": {k: _as_list(v) for k, v in when.items()}, "reason": str(reason)}


def _builtin_rejection(v: Variant) -> str | None:
    """Combinations no target can build, with the reason shown by `kdagen list -v`."""
    if v.block_v > v.v:
        return f"block_v {v.block_v} is wider than V = {v.v}"
    if v.v % v.block_v:
        return f"block_v {v.block_v} does not divide V = {v.v}"
    info = TARGETS.get(v.target)
    for when, reason in (info.rejects if info else ()):
        if all(getattr(v, k) == val for k, val in when):
            return reason
    return None


def expand_all(spec: Spec) -> tuple[list[Variant], list[Dropped]]:
    """All variants of the spec (sorted by name) and the dropped combinations with reasons."""
    kept: dict[str, Variant] = {}
    dropped: dict[str, Dropped] = {}
    for g in spec.groups:
        info = TARGETS[g["target"]]
        for chunk, (k, v), dtype, gate, state, bv, precise in itertools.product(
            g["chunk"], g["head_dim"], g["dtype"], g["gate"], g["state"], g["block_v"], g["precise"]
        ):
            var = Variant(
                target=g["target"], chunk=chunk, k=k, v=v, dtype=dtype, gate=gate, state=state,
                block_v=bv, precise=precise, layouts=g["layouts"], varlen=g["varlen"], gqa=g["gqa"],
                hardware_validated=info.hardware_validated,
            )
            reason = _builtin_rejection(var)
            if reason is None:
                for ex in spec.excludes:
                    if all(getattr(var, key) in vals for key, vals in ex["when"].items()):
                        reason = ex["reason"]
                        break
            if reason is not None:
                dropped[var.name] = Dropped(var, reason)
                continue
            variants = [var]
            if info.twin:
                tinfo = TARGETS[info.twin]
                variants.append(dataclasses.replace(var, target=info.twin, layouts=tinfo.layouts,
                                                    varlen=tinfo.varlen, gqa=tinfo.gqa,
                                                    hardware_validated=tinfo.hardware_validated))
            for var in variants:
                _keep(spec, kept, var)
    for name in kept:
        dropped.pop(name, None)
    return [kept[n] for n in sorted(kept)], [dropped[n] for n in sorted(dropped)]


def _keep(spec: Spec, kept: dict[str, Variant], var: Variant) -> None:
    prev = kept.get(var.name)
    if prev is not None and prev != var:
        raise SpecError(spec.path, "variants", f"{var.name} is listed twice with different features "
                        f"({prev.layouts}/{prev.varlen}/{prev.gqa} vs {var.layouts}/{var.varlen}/{var.gqa})")
    kept[var.name] = var


def expand(spec: Spec) -> list[Variant]:
    """The sorted list of variants the spec asks for."""
    return expand_all(spec)[0]
