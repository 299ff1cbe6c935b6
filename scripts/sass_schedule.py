"""Issue-schedule model of one pass through a kernel's loop, read from its SASS (no GPU needed).

    python scripts/sass_schedule.py build/h800/<variant>/<variant>.fatbin [--kernel kda_recur]
        [--loop 0x7ea0] [--taken 0x1640] [--list] [--lat LDS=33 ...] [--bar 24] [--ghz 1.98]

One warp alone on its scheduler, issuing in order. Each instruction issues once (a) the previous
one's compiler-set stall count has passed and (b) the scoreboards it waits on are released. A
variable-latency instruction releases its scoreboard after an assumed latency (--lat). A block
barrier costs --bar cycles (the other warps are assumed to arrive at the same time).
Path: the innermost-widest loop (the backward branch spanning the most code), in address order.
Predicated forward branches fall through unless listed with --taken; unpredicated forward
branches are taken.

This is a model, not a measurement. It leaves out contention with other warps, shared-memory
bank conflicts and cp.async data arriving late. Use it to compare two builds of the same loop
(instructions, stall cycles, scoreboard waits), then confirm on the GPU.
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from kdagen_dev.sass import BRANCH as _BRA
from kdagen_dev.sass import disassemble

LATENCY = {"LDSM": 33, "LDS": 33, "LDC": 30, "LDG": 600, "S2UR": 20, "S2R": 20, "LDGSTS": 20,
           "STS": 20, "STG": 20, "SHFL": 24, "MUFU": 18, "I2F": 18, "F2I": 18}


def latency(op: str, table: dict[str, int]) -> int:
    for key in sorted(table, key=len, reverse=True):
        if op.startswith(key):
            return table[key]
    return 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--kernel", default="kda_recur")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--taken", nargs="*", default=[], help="addresses of predicated branches to take")
    ap.add_argument("--lat", nargs="*", default=[], help="OPCODE=cycles overrides")
    ap.add_argument("--bar", type=int, default=24, help="cycles per BAR.SYNC")
    ap.add_argument("--ghz", type=float, default=1.98)
    ap.add_argument("--list", action="store_true", help="print each instruction with its issue cycle")
    ap.add_argument("--loop", help="address of the loop head to model (default: the widest loop)")
    a = ap.parse_args()
    table = dict(LATENCY, **{k: int(v) for k, v in (x.split("=") for x in a.lat)})
    k = disassemble(a.artifact, a.arch)[a.kernel]
    ops = [text.split()[0] for text in k.instructions]
    index = {addr: i for i, addr in enumerate(k.addresses)}
    loops = k.loops()
    if not loops:
        print(f"{a.kernel}: no loop")
        return 1
    if a.loop:
        heads = [x for x in loops if x[0] == int(a.loop, 16)]
        if not heads:
            print(f"{a.kernel}: no loop starts at {a.loop}; loops: " + ", ".join(f"{h:#x}-{t:#x}" for h, t in loops))
            return 1
        head, last = max(heads, key=lambda x: x[1] - x[0])
    else:
        head, last = max(loops, key=lambda x: x[1] - x[0])
    end = index[last]
    taken = {int(x, 16) for x in a.taken}
    t, sb, i = 0, [0] * 6, index[head]
    stalls = waits = bars = n = 0
    branches = []  # predicated forward branches met on the path, and whether taken
    while i <= end:
        raw, c, op = k.raw[i], k.controls[i], ops[i]
        ready = max([sb[j] for j in range(6) if c.wait_mask >> j & 1] + [t])
        waits += ready - t
        t = ready
        if a.list:
            print(f"{t:5d}  {k.addresses[i]:05x}  stall {c.stall:2d}  {raw}")
        if op.startswith("BAR.SYNC"):
            t += a.bar
            bars += a.bar
        if c.write_sb < 6:
            sb[c.write_sb] = t + latency(op, table)
        if c.read_sb < 6:
            sb[c.read_sb] = max(sb[c.read_sb], t + 4)
        step = max(c.stall, 1)
        stalls += step
        t += step
        n += 1
        m = _BRA.match(raw)
        go = bool(m) and i != end and int(m.group("target"), 16) > k.addresses[i]
        if go and m.group("pred"):
            branches.append(f"{k.addresses[i]:#x} {m.group('pred').strip()}->{m.group('target')}"
                            f"{' (taken)' if k.addresses[i] in taken else ''}")
            go = k.addresses[i] in taken
        i = index[int(m.group("target"), 16)] if go else i + 1
    print(f"{a.kernel} loop {head:#x}-{k.addresses[end]:#x}: {n} instructions, {stalls} cycles of issue "
          f"and stall counts, {waits} waiting on scoreboards, {bars} at barriers: {t} cycles "
          f"({t / a.ghz / 1e3:.3f} us at {a.ghz} GHz)")
    print("predicated forward branches on the path (fall through unless --taken): " + ", ".join(branches))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the listing quietly
    raise SystemExit(main())
