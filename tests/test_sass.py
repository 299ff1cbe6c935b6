"""Structure of the built sm80 kernels, read from their SASS (no GPU needed).

These pin design properties that only a GPU could otherwise reveal (as time): the recurrence
meets the whole block once per chunk, the split-K warp pairs meet at 64-thread named barriers,
and the chunk-16 prep does its matrix products on tensor cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdagen.sass import disassemble, find_cuobjdump


def _built_sm80() -> list[tuple[dict, Path]]:
    """(generated-manifest entry, fatbin) of the sm80 variants the specs name now, where built."""
    from kdagen.paths import BUILD_DIR, GENERATED_DIR

    out = []
    for gen in sorted(GENERATED_DIR.glob("*/manifest.json")):
        for e in json.loads(gen.read_text())["variants"]:
            art = BUILD_DIR / gen.parent.name / e["name"] / f"{e['name']}.fatbin"
            if e["target"] == "sm80" and art.exists():
                out.append((e, art))
    return out


ARTIFACTS = _built_sm80()
C16 = [(e, a) for e, a in ARTIFACTS if e["chunk"] == 16]
pytestmark = [
    pytest.mark.skipif(find_cuobjdump() is None, reason="cuobjdump/nvdisasm not installed"),
    pytest.mark.skipif(not ARTIFACTS, reason="no sm80 variant built (make build SPEC=specs/a100.yaml)"),
]


@pytest.mark.parametrize("entry,art", ARTIFACTS, ids=[e["name"] for e, _ in ARTIFACTS])
def test_recurrence_barriers(entry: dict, art: Path):
    """One block-wide barrier per chunk step; at K = 128 one 64-thread named barrier per V tile."""
    for arch in ("sm_80", "sm_90"):
        bars = disassemble(art, arch)["kda_recur"].barriers()
        assert sum(b.endswith(" 0x0") for b in bars) == 1, f"{entry['name']} {arch}: {bars}"
        named = [b for b in bars if not b.endswith(" 0x0")]
        if entry["k"] >= 128:  # split K: warps vt and vt + NWV pair up under ids 1..NWV
            want = [f"BAR.SYNC.DEFER_BLOCKING {hex(i + 1)}, 0x40" for i in range(entry["block_v"] // 16)]
            assert named == want, f"{entry['name']} {arch}: {named}"
        else:
            assert named == [], f"{entry['name']} {arch}: {named}"


@pytest.mark.parametrize("entry,art", C16, ids=[e["name"] for e, _ in C16])
def test_chunk16_prep_on_tensor_cores(entry: dict, art: Path):
    """L/Mqk (4 MMAs per 16-column K slice, K/16 slices over 4 warps: the per-warp code holds
    K/64 of them) and [W | U0] (3 split-bf16 MMAs x 4 n-tiles per warp) are mma.sync."""
    prep = disassemble(art, "sm_90")["kda_prep"]
    hmma = sum(n for op, n in prep.opcodes().items() if op.startswith("HMMA"))
    assert hmma == 4 * (entry["k"] // 64) + 12, (entry["name"], hmma)
