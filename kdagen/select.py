"""Pick the variant for a call: exact functional key first, then preference.

The targets describe themselves (kdagen.targets: device types, minimum compute capability,
rank); nothing here names a target. Preference, in order: the targets measured fastest in the
call's regime (the GPU's tuning file), a target whose own preferred regimes hold the call, the
target's rank, the chunk and V-split the tuning file
measured fastest in the regime, what is ready (built) before what needs a build before what must
first be generated, then state I/O, chunk size and V-split width (the targets' constants), and a
precise variant before its plain twin (Variant.precise). Every
rejection has a reason (logged at KDAGEN_LOGLEVEL=2); a miss raises NoVariantError with Supported
vs Found and the command that builds a fitting variant.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Optional, Union

import torch

from .errors import NoVariantError
from . import tuning
from .inputs import CallInfo
from .targets import TARGETS, TargetInfo
from .variant import Variant

log = logging.getLogger("kdagen")

READY, NEEDS_BUILD, GENERATE = "ready", "build", "generate"
_READINESS = {READY: 0, NEEDS_BUILD: 1, GENERATE: 2}


@dataclass(frozen=True)
class Candidate:
    variant: Variant
    readiness: str = READY  # READY | NEEDS_BUILD | GENERATE
    blocked: Optional[str] = None  # why it cannot be made ready here (no compiler, JIT disabled)


@lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_reason(target: str, device: torch.device) -> Optional[str]:
    """Why `target` cannot run on `device` (None when it can), from the target's self-description."""
    info = TARGETS.get(target)
    if info is None:
        return f"unknown target {target}"
    if device.type not in (info.devices or ()):
        return f"{target} runs on {', '.join(info.devices or ()) or 'no device'}, not on {device.type}"
    for dev_type, var, val in info.device_env:
        if dev_type == device.type and os.environ.get(var) != val:
            return f"{target} on {device.type} needs {var}={val}"
    if device.type == "cuda" and info.min_compute_capability is not None:
        have = _capability(device.index if device.index is not None else torch.cuda.current_device())
        need = info.min_compute_capability
        if tuple(have) < tuple(need):
            return f"{target} needs compute capability {need[0]}.{need[1]}, the device has {have[0]}.{have[1]}"
    return None


def variant_device_reason(v: Variant, device: torch.device) -> Optional[str]:
    """Why variant `v` cannot run on `device` though its target can (None when it can)."""
    info = TARGETS.get(v.target)
    for dev_type, max_k, why in (info.device_max_k if info is not None else ()):
        if dev_type == device.type and v.k > max_k:
            return f"{v.target} runs K <= {max_k} on {dev_type} ({why}), the variant has K={v.k}"
    return None


def functional_reason(v: Variant, c: CallInfo) -> Optional[str]:
    """Why variant `v` cannot compute this call (None when it can)."""
    if v.dtype != c.dtype:
        return f"dtype {v.dtype} != {c.dtype}"
    if (v.k, v.v) != (c.K, c.V):
        return f"head dims K={v.k},V={v.v} != K={c.K},V={c.V}"
    if c.layout not in v.layouts:
        return f"layout {c.layout} not in {','.join(v.layouts)}"
    if v.gate != c.gate:
        return f"gate {v.gate} != {c.gate}"
    if c.state != "none" and v.state != c.state:
        return f"state {v.state} != {c.state}"
    if c.varlen and not v.varlen:
        return "no varlen"
    if c.HV != c.H and not v.gqa:
        return "no GQA"
    if c.chunk_size is not None and v.chunk != c.chunk_size:
        return f"chunk {v.chunk} != {c.chunk_size}"
    return None


@lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())
    return 1


def _as_candidate(x: Union[Variant, Candidate]) -> Candidate:
    return x if isinstance(x, Candidate) else Candidate(x)


def _regime_index(info: TargetInfo, c: CallInfo, sms: int) -> int:
    """The index of the target's preferred regime that holds call `c` (on `sms` SMs), -1 for none."""
    if not info.preferred_regimes or c.device.type != "cuda":
        return -1
    tps, shs = tuning.regime(c.T, c.B, c.N, c.HV, sms)
    return next((i for i, (dims, tok, sh) in enumerate(info.preferred_regimes)
                 if c.K in dims and tok[0] <= tps < tok[1] and sh[0] <= shs < sh[1]), -1)


def in_preferred_regime(info: TargetInfo, c: CallInfo, sms: int) -> bool:
    """Whether call `c` lies in one of the target's preferred regimes (on `sms` SMs)."""
    return _regime_index(info, c, sms) >= 0


_REGIME_TARGETS = tuple(t for t in TARGETS.values() if t.preferred_regimes)


def regime_key(c: CallInfo) -> tuple[int, ...]:
    """What of the targets' preferred regimes a choice for `c` depends on (the runtime's choice
    cache keys on it, so a cached choice is not reused across a regime edge)."""
    if not _REGIME_TARGETS or c.device.type != "cuda":
        return ()
    sms = _sm_count(c.device)
    return tuple(_regime_index(t, c, sms) for t in _REGIME_TARGETS)


# preference()'s leading fields that order targets (regime rank, preferred regime, target rank);
# callers that insert a field of their own after them, or compare only the targets' order, slice here.
TARGET_ORDER = 3


def preference(x: Union[Variant, Candidate], c: CallInfo, sms: int) -> tuple:
    cand = _as_candidate(x)
    v = cand.variant
    info = TARGETS.get(v.target)
    rank = info.rank if info is not None and info.rank is not None else 99
    # A call without state I/O prefers a variant compiled without it.
    state_rank = 0 if v.state == c.state else (1 if v.state == "fp32" else 2)
    # The GPU's tuning file (kdagen tune) first, for the call's shape regime; then the target's
    # measured chunk preference; otherwise long sequences take larger chunks (fewer serial steps).
    rule = tuning.rule_for_call(v.target, c, sms) if c.device.type == "cuda" else None
    preferred = info.preferred_chunk if info is not None else None
    if rule is not None and rule.chunk is not None:
        preferred = rule.chunk
    if preferred is not None:
        chunk_rank = 0 if v.chunk == preferred else 1
    else:
        avg_len = c.T * c.B / max(c.N, 1)
        chunk_rank = 0 if (v.chunk == 64) == (avg_len >= 512) else 1
    # V-split: the widest block that still gives enough programs per SM (a per-target
    # figure, measured where the target says so); on CPU, the widest.
    programs = c.N * c.HV * (v.v // v.block_v)
    waves = info.vsplit_min_waves if info is not None else 2.0
    preferred_bv = info.preferred_block_v if info is not None else None
    if rule is not None and rule.block_v is not None and v.block_v == rule.block_v:
        bv_rank = (-1, 0)
    elif programs >= waves * sms:
        bv_rank = (0, 0) if v.block_v == preferred_bv else (1, -v.block_v)
    else:
        bv_rank = (2, v.block_v)
    # kdagen tune ranks the targets it measured in a regime; unranked ones follow them, a target's
    # own preferred regimes (TargetInfo.preferred_regimes) first.
    regime_rank = rule.rank if rule is not None and rule.rank is not None else 1 << 20
    default_rank = 0 if info is not None and in_preferred_regime(info, c, sms) else 1
    # A rule's chunk and block_v were measured faster in the regime: they outrank what happens to be built,
    # so that the choice does not depend on which calls came first (a build takes seconds, once).
    tuned = (int(rule is not None and rule.chunk is not None and v.chunk != rule.chunk),
             int(rule is not None and rule.block_v is not None and v.block_v != rule.block_v))
    # A precise variant (o's products in hi + lo) before its plain twin: half o's error against float64 for
    # 1.01x the time (geomean of the 22 default bench cases, 0.89-1.06x; H200, session 36), and only
    # where it fits exactly as well: a spec lists both to offer the plain one to `variant=`.
    return (regime_rank, default_rank, rank, tuned, _READINESS[cand.readiness], state_rank, chunk_rank, bv_rank,
            int(not v.precise), v.name)


def rejection(cand: Candidate, c: CallInfo) -> Optional[str]:
    """Why this candidate cannot serve the call here (None when it can)."""
    return (functional_reason(cand.variant, c) or device_reason(cand.variant.target, c.device)
            or variant_device_reason(cand.variant, c.device) or cand.blocked)


def choose(cands: Iterable[Union[Variant, Candidate]], c: CallInfo) -> tuple[Optional[Candidate],
                                                                           list[tuple[Candidate, str]]]:
    """The preferred candidate that can serve the call (None if none can) and every rejected
    one with its reason (each logged at debug level: KDAGEN_LOGLEVEL=2)."""
    rejected: list[tuple[Candidate, str]] = []
    fits: list[Candidate] = []
    for x in cands:
        cand = _as_candidate(x)
        why = rejection(cand, c)
        if why:
            rejected.append((cand, why))
        else:
            fits.append(cand)
    if log.isEnabledFor(logging.DEBUG):
        for cand, why in rejected:
            log.debug("kdagen: rejected %s: %s", cand.variant.name, why)
    if not fits:
        return None, rejected
    sms = _sm_count(c.device)
    best = min(fits, key=lambda x: preference(x, c, sms))
    if log.isEnabledFor(logging.DEBUG):
        for cand in fits:
            if cand is not best:
                log.debug("kdagen: passed over %s: %s is preferred (regime rank, preferred regime, target rank, "
                          "tuned chunk and block_v, readiness, state, chunk, block_v, precise before plain)",
                          cand.variant.name, best.variant.name)
    return best, rejected


def select(cands: Iterable[Union[Variant, Candidate]], c: CallInfo) -> Variant:
    """The variant for the call among `cands` (plain variants count as ready)."""
    cands = list(cands)
    best, rejected = choose(cands, c)
    if best is None:
        raise NoVariantError(miss_message(rejected, c))
    return best.variant


def supported_by_targets(c: CallInfo) -> list[str]:
    """One line per target that runs on the call's device: what it supports."""
    lines = []
    for name, info in sorted(TARGETS.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 99, kv[0])):
        if c.device.type not in (info.devices or ()):
            continue
        lines.append(f"{name}: dtype {'/'.join(info.dtypes)}, head dims {'/'.join(map(str, info.head_dims))}, "
                     f"gates {'/'.join(info.gates)}, states {'/'.join(info.states)}")
    return lines


def miss_message(rejected: list[tuple[Candidate, str]], c: CallInfo) -> str:
    lines = ["no kernel variant fits this call.", f"  Found:     {c.describe()}"]
    if not rejected:
        lines.append("  Supported: nothing is registered (no generated/*/manifest.json); run `make setup` or "
                     "`kdagen generate --spec specs/ci.yaml`")
    else:
        # what runs on this device first: variants of other devices only when none does
        here = [(x, why) for x, why in rejected if not device_reason(x.variant.target, c.device)] or rejected
        supported = Counter(f"{x.variant.target}: dtype={x.variant.dtype} K={x.variant.k} V={x.variant.v} "
                            f"gate={x.variant.gate} state={x.variant.state} chunk={x.variant.chunk} "
                            f"layouts={','.join(x.variant.layouts)}" for x, _ in here)
        lines.append(f"  Supported ({len(here)} candidate variants{' on ' + c.device.type if here is not rejected else ''}):")
        for s in sorted(supported)[:12]:
            lines.append(f"    {s}")
        if len(supported) > 12:
            lines.append(f"    ... and {len(supported) - 12} more (`kdagen list`)")
        reasons = Counter(why for _, why in here)
        lines.append("  Rejections: " + "; ".join(f"{why} ({n}x)" for why, n in reasons.most_common(6)))
    blocked = sorted((x for x, _ in rejected if x.blocked and not functional_reason(x.variant, c)
                      and not device_reason(x.variant.target, c.device)),
                     key=lambda x: preference(x, c, _sm_count(c.device)))
    if blocked:
        lines.append(f"  Would fit if built: {blocked[0].variant.name}: {blocked[0].blocked}")
    else:
        lines.append("  What the targets of this device support:")
        lines += [f"    {s}" for s in supported_by_targets(c)] or [f"    no target runs on {c.device.type}"]
    return "\n".join(lines)
