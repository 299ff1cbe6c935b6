"""Pick the variant for a call: exact functional key first, then preference.

Every rejection has a reason; a miss raises NoVariantError with Supported vs Found
and the spec entry + commands that would build a fitting variant.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Optional

import torch

from .errors import NoVariantError
from .inputs import CallInfo
from .targets import TARGETS
from .variant import Variant

# Lower is preferred, per device type.
TARGET_RANK = {
    "cuda": {"sm90": 0, "sm80": 1, "triton": 2, "triton_twin": 3},
    "cpu": {"triton": 0, "triton_twin": 1},
    "npu": {"ascend": 0},
}


def device_reason(target: str, device: torch.device) -> Optional[str]:
    """Why `target` cannot run on `device` (None when it can)."""
    if target in ("triton", "triton_twin"):
        if device.type == "cuda":
            return None
        if device.type == "cpu":
            return None if os.environ.get("TRITON_INTERPRET") == "1" else "Triton on CPU needs TRITON_INTERPRET=1"
        return f"Triton target does not run on {device.type}"
    if target in ("sm80", "sm90"):
        if device.type != "cuda":
            return f"CUDA target, tensors are on {device.type}"
        major, minor = torch.cuda.get_device_capability(device)
        need = (8, 0) if target == "sm80" else (9, 0)
        return None if (major, minor) >= need else f"needs compute capability {need[0]}.{need[1]}, device has {major}.{minor}"
    if target == "ascend":
        return None if device.type == "npu" else f"Ascend target, tensors are on {device.type}"
    return f"unknown target {target}"


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


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def preference(v: Variant, c: CallInfo, sms: int) -> tuple:
    rank = TARGET_RANK.get(c.device.type, {}).get(v.target, 99)
    # A call without state I/O prefers a variant compiled without it.
    state_rank = 0 if v.state == c.state else (1 if v.state == "fp32" else 2)
    # A target's measured chunk preference wins; otherwise long sequences take larger
    # chunks (fewer serial steps).
    preferred = TARGETS[v.target].preferred_chunk if v.target in TARGETS else None
    if preferred is not None:
        chunk_rank = 0 if v.chunk == preferred else 1
    else:
        avg_len = c.T * c.B / max(c.N, 1)
        chunk_rank = 0 if (v.chunk == 64) == (avg_len >= 512) else 1
    # V-split: the widest block that still gives enough programs per SM (a per-target
    # figure, measured where the target says so); on CPU, the widest.
    programs = c.N * c.HV * (v.v // v.block_v)
    waves = TARGETS[v.target].vsplit_min_waves if v.target in TARGETS else 2.0
    preferred_bv = TARGETS[v.target].preferred_block_v if v.target in TARGETS else None
    enough = programs >= waves * sms
    if enough:
        bv_rank = (0, 0) if v.block_v == preferred_bv else (1, -v.block_v)
    else:
        bv_rank = (2, v.block_v)
    return (rank, state_rank, chunk_rank, bv_rank, v.name)


def select(variants: list[Variant], c: CallInfo) -> Variant:
    rejected: list[tuple[Variant, str]] = []
    fits = []
    for v in variants:
        why = functional_reason(v, c) or device_reason(v.target, c.device)
        if why:
            rejected.append((v, why))
        else:
            fits.append(v)
    if not fits:
        raise NoVariantError(miss_message(rejected, c))
    sms = _sm_count(c.device)
    return min(fits, key=lambda v: preference(v, c, sms))


def miss_message(rejected: list[tuple[Variant, str]], c: CallInfo) -> str:
    lines = ["no kernel variant fits this call.", f"  Found:     {c.describe()}"]
    if not rejected:
        lines.append("  Supported: nothing is registered (no generated/*/manifest.json); run `make setup` or "
                     "`kdagen generate --spec specs/ci.yaml`")
    else:
        supported = Counter(f"{v.target}: dtype={v.dtype} K={v.k} V={v.v} gate={v.gate} state={v.state} "
                            f"chunk={v.chunk} layouts={','.join(v.layouts)}" for v, _ in rejected)
        lines.append(f"  Supported ({len(rejected)} registered variants):")
        for s in sorted(supported)[:12]:
            lines.append(f"    {s}")
        if len(supported) > 12:
            lines.append(f"    ... and {len(supported) - 12} more (`kdagen list`)")
        reasons = Counter(why for _, why in rejected)
        lines.append("  Rejections: " + "; ".join(f"{why} ({n}x)" for why, n in reasons.most_common(6)))
    target = {"cuda": "sm80", "cpu": "triton", "npu": "ascend"}.get(c.device.type, "triton")
    state = "fp32" if c.state == "none" else c.state
    entry = (f"{{target: {target}, chunk: {c.chunk_size or 64}, head_dim: [{c.K}, {c.V}], dtype: {c.dtype}, "
             f"gate: {c.gate}, state: {state}, block_v: 32}}")
    lines.append(f"  To build one: add {entry} under `variants:` of a spec, then "
                 "`kdagen generate --spec <spec> && make build SPEC=<spec>`")
    return "\n".join(lines)
