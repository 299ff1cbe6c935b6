"""Read the machine code (SASS) of a built CUDA fatbin without a GPU.

Used to check a kernel's structure where only a GPU could time it: instruction mix per kernel,
the barriers it executes, and whether a source change altered the code at all (compare the
mixes of two builds). Needs `cuobjdump` and the `nvdisasm` it calls: on PATH, or from the
`nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` wheels (the test extra installs them).
"""

from __future__ import annotations

import collections
import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

_INSTR = re.compile(r"^\s*/\*(?P<addr>[0-9a-f]{4,})\*/\s+(?P<text>[^;]*);\s*/\* (?P<lo>0x[0-9a-f]+) \*/")
_HI = re.compile(r"^\s*/\* (?P<hi>0x[0-9a-f]+) \*/\s*$")
_FUNC = re.compile(r"Function : (?P<name>\S+)")
_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")
# A branch with an address target, on the raw text (optional predicate, optional condition operand).
BRANCH = re.compile(r"^(?P<pred>@!?P\w+\s+)?BRA\s+(?:[!A-Z0-9a-z]+,\s*)?(?P<target>0x[0-9a-f]+)")

# opcode prefix -> class (first match wins; order matters)
_CLASSES = (
    ("mma", ("HMMA", "HGMMA", "IMMA")),
    ("ldmatrix", ("LDSM",)),
    ("barrier", ("BAR", "DEPBAR", "LDGDEPBAR", "WARPSYNC", "BSSY", "BSYNC")),
    ("async copy", ("LDGSTS",)),
    ("global load", ("LDG",)),
    ("global store", ("STG", "RED", "ATOM")),
    ("shared load", ("LDS",)),
    ("shared store", ("STS",)),
    ("shuffle", ("SHFL",)),
    ("transcendental", ("MUFU",)),
    ("convert", ("F2F", "F2I", "I2F", "F2FP", "PRMT")),
    ("fp32", ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FCHK")),
    ("control", ("BRA", "EXIT", "RET", "CALL", "BRX", "JMP", "NOP")),
    ("uniform", ("U", "R2UR", "S2UR")),
)


@dataclass
class Control:
    """Scheduling bits the compiler set on one instruction (sm_70 and later): cycles to stall
    before the next instruction issues, the scoreboards a variable-latency result or operand
    read signals (7: none), and the scoreboards this instruction waits for (bit mask)."""
    stall: int
    write_sb: int
    read_sb: int
    wait_mask: int

    @classmethod
    def decode(cls, hi: int) -> "Control":
        c = hi >> 41
        return cls(stall=c & 0xF, write_sb=(c >> 5) & 7, read_sb=(c >> 8) & 7, wait_mask=(c >> 11) & 0x3F)


@dataclass
class KernelSass:
    name: str
    raw: list[str] = field(default_factory=list)           # instruction text, with its predicate
    addresses: list[int] = field(default_factory=list)     # byte offset of each instruction
    controls: list[Control] = field(default_factory=list)  # scheduling bits (where decoded)

    @property
    def instructions(self) -> list[str]:
        """Instruction text with the predicate removed."""
        return [_PRED.sub("", t) for t in self.raw]

    def opcodes(self) -> collections.Counter:
        return collections.Counter(i.split()[0] for i in self.instructions)

    def mix(self) -> dict[str, int]:
        """Instruction count per class (integer/other ALU work is "int/other")."""
        out: collections.Counter = collections.Counter()
        for op, n in self.opcodes().items():
            for cls, prefixes in _CLASSES:
                if op.startswith(prefixes):
                    out[cls] += n
                    break
            else:
                out["int/other"] += n
        return dict(out)

    def barriers(self, lo: int = 0, hi: int | None = None) -> list[str]:
        """The `BAR.SYNC` instructions in program order, e.g. 'BAR.SYNC.DEFER_BLOCKING 0x0'
        (those at addresses lo..hi, inclusive, when given)."""
        return [i for a, i in zip(self.addresses, self.instructions)
                if i.startswith("BAR.SYNC") and lo <= a and (hi is None or a <= hi)]

    def loops(self) -> list[tuple[int, int]]:
        """(first, last) address of each loop body: a branch back to an earlier address."""
        out = []
        for a, raw in zip(self.addresses, self.raw):
            m = BRANCH.match(raw)
            if m and int(m.group("target"), 16) < a:
                out.append((int(m.group("target"), 16), a))
        return out

    def loop_with(self, opcode_prefix: str) -> tuple[int, int]:
        """The loop holding the most instructions that start with opcode_prefix (e.g. 'HMMA')."""
        def count(lo_hi):
            return sum(lo_hi[0] <= a <= lo_hi[1] and i.startswith(opcode_prefix)
                       for a, i in zip(self.addresses, self.instructions))
        loops = self.loops()
        if not loops:
            raise ValueError(f"{self.name}: no loop")
        return max(loops, key=count)


def _find_tool(name: str) -> str | None:
    exe = shutil.which(name)
    if exe:
        return exe
    try:
        import nvidia  # namespace package of NVIDIA's PyPI wheels
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for cand in sorted(Path(root).glob(f"cu*/bin/{name}")):
            return str(cand)
    return None


@functools.lru_cache(maxsize=1)
def _tools() -> tuple[str, str] | None:
    """(cuobjdump, nvdisasm), or None unless both are available."""
    exe, dis = _find_tool("cuobjdump"), _find_tool("nvdisasm")
    return (exe, dis) if exe and dis else None


def find_cuobjdump() -> str | None:
    """cuobjdump, if it and the nvdisasm it runs are both available."""
    tools = _tools()
    return tools[0] if tools else None


def disassemble(artifact: Path, arch: str = "sm_90") -> dict[str, KernelSass]:
    """Kernels of `artifact` (fatbin or cubin) for `arch`, by name."""
    tools = _tools()
    if tools is None:
        raise RuntimeError("cuobjdump/nvdisasm not found: install the CUDA toolkit's, or "
                           "`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`")
    exe, dis = tools
    env = dict(os.environ, NVDISASM_PATH=str(Path(dis).parent))
    r = subprocess.run([exe, "-sass", "-arch", arch, str(artifact)], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"cuobjdump -sass -arch {arch} {artifact} failed: {r.stderr.strip()}")
    kernels: dict[str, KernelSass] = {}
    cur: KernelSass | None = None
    lines = r.stdout.splitlines()
    for i, line in enumerate(lines):
        if (m := _FUNC.search(line)):
            cur = kernels.setdefault(m.group("name"), KernelSass(m.group("name")))
        elif cur is not None and (m := _INSTR.match(line)):
            cur.raw.append(m.group("text").strip())
            cur.addresses.append(int(m.group("addr"), 16))
            # Volta and later: a 128-bit instruction prints as two 64-bit words, the control
            # bits in the upper one (the next line).
            hi = _HI.match(lines[i + 1]) if i + 1 < len(lines) else None
            cur.controls.append(Control.decode(int(hi.group("hi"), 16)) if hi else Control(1, 7, 7, 0))
    if not kernels:
        raise RuntimeError(f"{artifact}: no {arch} machine code found")
    return kernels
