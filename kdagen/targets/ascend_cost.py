"""Static cost model of a translated Ascend kernel, and a time estimate for Ascend 950.

``static_costs`` reads the translated MLIR (the AIC and AIV functions of the one MIX kernel) and
sums, per program context, what each op site costs: cube FLOPs (``asccube.mmad`` m x k x n),
bytes through each memory path (every copy op, from its burst parameters or its on-chip memref),
and vector instructions (``ascvec`` ops inside VF regions; exp/div/sqrt counted apart). Constant
loops multiply their bodies; ``scf.if`` takes the costlier branch; the dynamic loops (trip counts
set by the call's shapes) define the contexts:

    kernel        outside every dynamic loop (once per block)
    group         once per group of chunks
    stage1_task   once per stage-1 task, a (chunk, batch x head)
    stage2_task   once per stage-2 task, a (batch x head, V slice), per group
    stage2_chunk  once per chunk of a stage-2 task

AIV numbers are per vector subblock (both run the AIV function). ``totals`` multiplies the
contexts out for one call; tests check that against the CPU model's counts of the same call.
``estimate`` turns the counts into Ascend 950 time under the stated ``Ascend950`` assumptions.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

CONTEXTS = ("kernel", "group", "stage1_task", "stage2_task", "stage2_chunk")
_PATH_DYN = {(): "kernel", (0,): "group", (0, 0): "stage1_task", (0, 1): "stage2_task", (0, 1, 0): "stage2_chunk"}
_DT_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "i64": 8, "i8": 1, "i16": 2}
_TRANSCENDENTAL = {"exp", "div", "sqrt"}
_NOT_VECTOR_INSTR = {"get_buf", "release_buf", "mem_bar", "vf", "set_copy_pad_val", "vreg"}
_COPY_PATHS = {
    "ascvec.copy_gm2ub": "GM->UB", "ascvec.copy_ub2gm": "UB->GM", "ascvec.copy_ub2l1_strided": "UB->L1",
    "ascvec.copy_ub2l1": "UB->L1", "asccube.copy_gm2l1": "GM->L1", "asccube.copy_l12l0a": "L1->L0A",
    "asccube.copy_l12l0b": "L1->L0B", "asccube.copy_l0c2ub": "L0C->UB", "asccube.copy_l0c2l1": "L0C->L1",
    "asccube.copy_l0c2gm": "L0C->GM",
}


class CostModelError(RuntimeError):
    pass


def _funcs(mlir: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    name = None
    for line in mlir.splitlines():
        m = re.match(r"^  func\.func @(\w+)\(", line)
        if m:
            name = m.group(1)
            out[name] = []
        elif name is not None:
            out[name].append(line)
    return out


class _Eval:
    """Constant-folds the i32/i64/index SSA values an op's parameters are built from. Values that
    depend on the call's shapes are unknown; min(unknown, c) is c and select(unknown, a, b) is
    max(a, b): the full tiles of a T that is a multiple of the chunk.

    SSA names are scoped by region (sibling regions reuse numbers; VF bodies are isolated): a
    name is looked up from the using line's region outwards, stopping at a VF boundary."""

    _BIN = {"addi": lambda a, b: a + b, "subi": lambda a, b: a - b, "muli": lambda a, b: a * b,
            "divsi": lambda a, b: a // b, "divui": lambda a, b: a // b, "remsi": lambda a, b: a % b,
            "remui": lambda a, b: a % b, "maxsi": max, "maxui": max}
    _CMP = {"slt": lambda a, b: a < b, "ult": lambda a, b: a < b, "sle": lambda a, b: a <= b,
            "ule": lambda a, b: a <= b, "sgt": lambda a, b: a > b, "ugt": lambda a, b: a > b,
            "sge": lambda a, b: a >= b, "uge": lambda a, b: a >= b, "eq": lambda a, b: a == b,
            "ne": lambda a, b: a != b}

    def __init__(self, lines: list[str], paths: list[tuple], isolated: set):
        self.defs: dict[tuple, tuple[str, tuple]] = {}
        for line, path in zip(lines, paths):
            m = re.match(r"\s*(%[\w]+)(?::\d+)? = (.*)$", line)
            if m:
                self.defs[(path[-1], m.group(1))] = (m.group(2), path)
        self.isolated = isolated
        self.memo: dict[tuple, int | None] = {}

    def _find(self, name: str, path: tuple):
        for rid in reversed(path):
            d = self.defs.get((rid, name))
            if d is not None:
                return d
            if rid in self.isolated:
                return None
        return None

    def __call__(self, name: str, path: tuple, depth: int = 0) -> int | None:
        found = self._find(name, path)
        if found is None or depth > 60:
            return None
        key = (found[1][-1], name)
        if key not in self.memo:
            self.memo[key] = self._eval(found[0], found[1], depth)
        return self.memo[key]

    def _eval(self, d: str, path: tuple, depth: int) -> int | None:
        m = re.match(r"arith\.constant (-?\d+)\b", d)
        if m:
            return int(m.group(1))
        m = re.match(r"arith\.(index_cast|extsi|extui|trunci) (%\w+)", d)
        if m:
            return self(m.group(2), path, depth + 1)
        m = re.match(r"arith\.cmpi (\w+), (%\w+), (%\w+)", d)
        if m:
            a, b = self(m.group(2), path, depth + 1), self(m.group(3), path, depth + 1)
            if a is None or b is None:
                return None
            return int(self._CMP[m.group(1)](a, b))
        m = re.match(r"arith\.select (%\w+), (%\w+), (%\w+)", d)
        if m:
            cond = self(m.group(1), path, depth + 1)
            a, b = self(m.group(2), path, depth + 1), self(m.group(3), path, depth + 1)
            if cond is not None:
                return a if cond else b
            return None if a is None or b is None else max(a, b)
        m = re.match(r"arith\.(\w+) (%\w+), (%\w+)", d)
        if m:
            op, a, b = m.group(1), self(m.group(2), path, depth + 1), self(m.group(3), path, depth + 1)
            if op in ("minsi", "minui"):
                known = [x for x in (a, b) if x is not None]
                return min(known) if known else None
            if a is None or b is None or op not in self._BIN:
                return None
            return self._BIN[op](a, b)
        return None


def _operands(line: str) -> list[str]:
    """The op's SSA operands before its type signature, brackets dropped: ['%alloc_3', '%c64_i32', ...]."""
    body = line.split(" : ", 1)[0]
    body = re.sub(r"\[[^\]]*\]", "", body)
    return re.findall(r"%[\w]+", body.split(" ", 1)[1] if " " in body.strip() else "")


def _memrefs(line: str) -> list[tuple[int, int, str]]:
    """(elements, bytes per element, space) of each memref in the op's type signature."""
    sig = line.split(" : ", 1)[1] if " : " in line else ""
    return [(int(n), _DT_BYTES.get(dt, 4), sp or "gm") for n, dt, sp in re.findall(r"memref<(\d+)x(\w+)(?:, (\d))?>", sig)]


def _new() -> Counter:
    return Counter()


def _op_cost(line: str, ev, in_vf: bool) -> Counter:
    c: Counter = Counter()
    m = re.match(r"\s*(?:%[\w:#]+ = )?(asccube|ascvec)\.(\w+)", line)
    if not m:
        return c
    dialect, op = m.groups()
    full = f"{dialect}.{op}"
    args = _operands(line)
    if full == "asccube.mmad":
        mm, kk, nn = (ev(a) for a in args[3:6])
        if None in (mm, kk, nn):
            raise CostModelError(f"mmad with a dynamic shape: {line.strip()[:160]}")
        c["cube_flops"] += 2 * mm * kk * nn
        c["mmads"] += 1
        return c
    path = _COPY_PATHS.get(full)
    if path is not None:
        refs = _memrefs(line)
        if full in ("ascvec.copy_gm2ub", "ascvec.copy_ub2gm"):
            nburst, burst = ev(args[2]), ev(args[3])
            nbytes = nburst * burst if None not in (nburst, burst) else None
            onchip = refs[0] if full == "ascvec.copy_gm2ub" else refs[1]
        elif full.startswith("ascvec.copy_ub2l1"):
            nburst, blocks = ev(args[2]), ev(args[3])
            nbytes = nburst * blocks * 32 if None not in (nburst, blocks) else None
            onchip = refs[1]
        elif full in ("asccube.copy_l0c2ub", "asccube.copy_l0c2gm", "asccube.copy_l0c2l1"):
            n_, m_ = ev(args[2]), ev(args[3])
            dst_bytes = refs[0][1]
            nbytes = n_ * m_ * dst_bytes if None not in (n_, m_) else None
            onchip = refs[1]
        else:  # gm2l1, l12l0a/b: whole on-chip destination slots (the kernel copies no windows into L1/L0)
            nbytes = refs[0][0] * refs[0][1]
            onchip = refs[0]
        if nbytes is None:     # a burst count the folding could not resolve: the on-chip tile's size
            nbytes = onchip[0] * onchip[1]
            c["bytes_unresolved"] += nbytes
        c[f"bytes:{path}"] += nbytes
        return c
    if dialect == "ascvec" and in_vf and op not in _NOT_VECTOR_INSTR and not op.startswith("sync"):
        c["vector_instr"] += 1
        if op in _TRANSCENDENTAL:
            c["vector_transcendental"] += 1
    if full.endswith("sync_all"):
        c["global_syncs"] += 1
    return c


def _regions(lines: list[str]) -> tuple[list[tuple], set]:
    """The region path of each line (ids from the function's region inwards), and the ids of
    VF regions (isolated from above)."""
    paths, stack, isolated, nxt = [], [0], set(), 1
    for line in lines:
        s = line.strip()
        if s.startswith("}"):
            if len(stack) == 1:            # the function's own closing brace
                paths.append((0,))
                continue
            stack.pop()
            if s.endswith("{"):            # } else {: a sibling region
                stack.append(nxt)
                nxt += 1
            paths.append(tuple(stack))
            continue
        paths.append(tuple(stack))
        if s.endswith("{"):
            if "ascvec.vf(" in s:
                isolated.add(nxt)
            stack.append(nxt)
            nxt += 1
    return paths, isolated


def _function_costs(lines: list[str]) -> dict[str, Counter]:
    """Costs per context of one function (see the module doc)."""
    paths, isolated = _regions(lines)
    ev = _Eval(lines, paths, isolated)
    # frame: [kind, trip (int | None), costs, if-branches, dynamic path, in_vf]
    root = ["func", 1, _new(), None, (), False]
    stack = [root]
    out: dict[str, Counter] = {k: _new() for k in CONTEXTS}
    dyn_children: dict[tuple, int] = Counter()

    def add(costs: Counter, frame) -> None:
        ctx = _PATH_DYN.get(frame[4])
        if ctx is None:
            raise CostModelError(f"op inside an unexpected dynamic loop nest {frame[4]}")
        # ops are charged to the innermost dynamic context; constant loops multiply into it
        frame[2].update(costs)

    for line, path in zip(lines, paths):
        s = line.strip()
        if s.startswith("}"):
            frame = stack.pop()
            if frame is root:
                break
            if s.startswith("} else {"):   # the then-branch waits for the else-branch's cost
                stack.append(["if", 1, _new(), frame[3] + [frame[2]], frame[4], frame[5]])
                continue
            parent = stack[-1]
            body = frame[2]
            if frame[0] == "if":
                branches = frame[3] + [body]
                body = Counter({k: max(b.get(k, 0) for b in branches) for b in branches for k in b})
            if frame[0] == "for" and frame[1] is None:
                out[_PATH_DYN[frame[4]]].update(body)       # a dynamic loop: its own context
            else:
                mult = frame[1] if frame[0] == "for" else 1
                for k, v in body.items():
                    parent[2][k] += v * mult
            continue
        if s.endswith("{"):
            top = stack[-1]
            m = re.search(r"scf\.for %\w+ = (%\w+) to (%\w+) step (%\w+)", s)
            if m:
                lb, ub, st = (ev(x, path) for x in m.groups())
                if None in (lb, ub, st):
                    idx = dyn_children[top[4]]
                    dyn_children[top[4]] += 1
                    path = top[4] + (idx,)
                    if path not in _PATH_DYN:
                        raise CostModelError(f"unexpected dynamic loop nest {path}: {s[:120]}")
                    stack.append(["for", None, _new(), None, path, top[5]])
                else:
                    stack.append(["for", max(0, -(-(ub - lb) // st)), _new(), None, top[4], top[5]])
            elif re.search(r"\bscf\.if\b", s):
                stack.append(["if", 1, _new(), [], top[4], top[5]])
            else:
                stack.append(["region", 1, _new(), None, top[4], top[5] or "ascvec.vf" in s])
            continue
        cost = _op_cost(line, lambda x: ev(x, path), stack[-1][5])
        if cost:
            add(cost, stack[-1])
    out["kernel"].update(root[2])
    return out


def static_costs(mlir: str) -> dict[str, dict[str, dict[str, int]]]:
    """{"cube": {context: counts}, "vector": {context: counts}} of the translated kernel."""
    funcs = _funcs(mlir)
    aic = [b for n, b in funcs.items() if n.endswith("_aic")]
    aiv = [b for n, b in funcs.items() if n.endswith("_aiv")]
    if len(aic) != 1 or len(aiv) != 1:
        raise CostModelError(f"expected one AIC and one AIV function, found {sorted(funcs)}")
    return {unit: {ctx: dict(sorted(c.items())) for ctx, c in _function_costs(body[0]).items()}
            for unit, body in (("cube", aic), ("vector", aiv))}


# ----------------------------------------------------------------------------- call totals

@dataclass(frozen=True)
class Shape:
    """One call: batch, value heads, tokens per sequence, chunks per group, V slices, blocks."""

    B: int
    HV: int
    T: int
    G: int
    NV: int
    blocks: int
    C: int = 64

    @property
    def groups(self) -> int:
        return -(-(self.T // self.C) // self.G)

    def group_sizes(self) -> list[int]:
        nc = self.T // self.C
        return [min(self.G, nc - g0) for g0 in range(0, nc, self.G)]


def _scaled(costs: dict[str, dict[str, int]], reps: dict[str, int]) -> Counter:
    out: Counter = Counter()
    for ctx, n in reps.items():
        for k, v in costs.get(ctx, {}).items():
            out[k] += v * n
    return out


def totals(costs: dict[str, dict[str, dict[str, int]]], shape: Shape) -> dict[str, Counter]:
    """What one call does in all (summed over blocks; vector counts per subblock, both run them)."""
    bh = shape.B * shape.HV
    gs = shape.group_sizes()
    reps = {
        "kernel": shape.blocks,
        "group": shape.blocks * len(gs),
        "stage1_task": sum(g * bh for g in gs),
        "stage2_task": len(gs) * bh * shape.NV,
        "stage2_chunk": sum(gs) * bh * shape.NV,
    }
    return {unit: _scaled(c, reps) for unit, c in costs.items()}


# ----------------------------------------------------------------------------- time estimate

@dataclass(frozen=True)
class Ascend950:
    """Assumed Ascend 950PR figures (none measured here; public numbers where they exist).

    Public: 32 AI cores in the seed's launch (1 cube + 2 vector cores each), HBM (HiBL 1.0)
    1.6 TB/s, FP8 1 PFLOPS. Assumed: bf16 cube at half the FP8 rate (16 x 16 x 16 MAC per cycle
    per core at ~1.9 GHz) and fp32 operands at a quarter of bf16; a vector core issues one
    256-byte instruction per cycle, exp/div/sqrt a quarter as fast; per-core copy engines move
    128 B/cycle (GM/L2 <-> UB/L1, fixpipe) and 256 B/cycle (L1 -> L0); the workspace stays in L2
    (it is sized to a quarter of it), whose bandwidth is taken as 3x HBM; an AIC <-> AIV handoff
    on the stage-2 critical path costs 0.5 us, a global_sync_all 5 us.
    """

    cores: int = 32
    clock_ghz: float = 1.9
    cube_flops_per_cycle_fp32: int = 2048
    vector_cycles_per_instr: float = 1.0
    vector_cycles_transcendental: float = 4.0
    mte_bytes_per_cycle: int = 128
    l1_l0_bytes_per_cycle: int = 256
    hbm_bytes_per_s: float = 1.6e12
    l2_bytes_per_s: float = 4.8e12
    handoff_us: float = 0.5
    global_sync_us: float = 5.0


_GM_PATHS = ("GM->UB", "UB->GM", "GM->L1", "L0C->GM")


def _unit_seconds(c: Counter, hw: Ascend950, unit: str) -> dict[str, float]:
    cyc = 1e-9 / hw.clock_ghz
    if unit == "cube":
        compute = c.get("cube_flops", 0) / hw.cube_flops_per_cycle_fp32 * cyc
    else:
        plain = c.get("vector_instr", 0) - c.get("vector_transcendental", 0)
        compute = (plain * hw.vector_cycles_per_instr + c.get("vector_transcendental", 0)
                   * hw.vector_cycles_transcendental) * cyc
    mte = sum(v for k, v in c.items() if k.startswith("bytes:") and k[6:] not in ("L1->L0A", "L1->L0B")) \
        / hw.mte_bytes_per_cycle * cyc
    mte += (c.get("bytes:L1->L0A", 0) + c.get("bytes:L1->L0B", 0)) / hw.l1_l0_bytes_per_cycle * cyc
    return {"compute": compute, "copy": mte}


def estimate(costs: dict[str, dict[str, dict[str, int]]], shape: Shape, hw: Ascend950 = Ascend950(),
             compulsory_bytes: float = 0.0) -> dict[str, Any]:
    """Estimated time of one call (ms) and its parts.

    Stage 1: tasks are independent, so per wave of ``cores`` tasks the slowest unit sets the pace
    (cube, either vector subblock, or its copy engines), pipelined across tasks. Stage 2: each
    chunk waits for the previous one (the state), so a chunk costs the sum of its cube, vector
    and copy time plus the AIC <-> AIV handoffs on the chain (S -> W S^T -> U -> U^T Kr -> S).
    GM traffic also has to fit HBM (the call's compulsory q/k/v/g/o/state bytes) and L2 (the
    workspace); the larger of compute-side and bandwidth-side time is taken per stage.
    """
    bh = shape.B * shape.HV
    cores = min(hw.cores, shape.blocks)
    out: dict[str, Any] = {"shape": asdict(shape)}
    t1 = t2 = 0.0
    s1 = {u: _unit_seconds(Counter(costs[u]["stage1_task"]), hw, u) for u in costs}
    per_task1 = max(max(v.values()) for v in s1.values())
    s2c = {u: _unit_seconds(Counter(costs[u]["stage2_chunk"]), hw, u) for u in costs}
    s2t = {u: _unit_seconds(Counter(costs[u]["stage2_task"]), hw, u) for u in costs}
    per_chunk2 = sum(sum(v.values()) for v in s2c.values()) + 4 * hw.handoff_us * 1e-6
    per_task2 = sum(sum(v.values()) for v in s2t.values())
    tot = totals(costs, shape)
    gm_bytes = sum(tot[u].get(f"bytes:{p}", 0) * (2 if u == "vector" else 1) for u in tot for p in _GM_PATHS)
    for g in shape.group_sizes():
        t1 += math.ceil(g * bh / cores) * per_task1
        t2 += math.ceil(bh * shape.NV / cores) * (per_task2 + g * per_chunk2)
    syncs = 2 * shape.groups * hw.global_sync_us * 1e-6
    t_bw = max(compulsory_bytes / hw.hbm_bytes_per_s, gm_bytes / hw.l2_bytes_per_s)
    total = max(t1 + t2 + syncs, t_bw)
    out.update({
        "ms": round(total * 1e3, 3),
        "stage1_ms": round(t1 * 1e3, 3), "stage2_ms": round(t2 * 1e3, 3), "sync_ms": round(syncs * 1e3, 3),
        "bandwidth_floor_ms": round(t_bw * 1e3, 3),
        "stage1_task_us": {u: {k: round(v * 1e6, 2) for k, v in s.items()} for u, s in s1.items()},
        "stage2_chunk_us": round(per_chunk2 * 1e6, 2),
        "cube_gflop": round(tot["cube"].get("cube_flops", 0) / 1e9, 2),
        "gm_gb": round(gm_bytes / 1e9, 3),
    })
    return out


def compulsory_bytes(B: int, H: int, HV: int, T: int, K: int, V: int) -> int:
    """The call's unavoidable GM traffic: q, k, v (bf16), g (fp32), beta, o (bf16), state in/out (fp32)."""
    return B * T * (2 * H * K * 2 + HV * V * 2 + HV * K * 4 + HV * 4 + HV * V * 2) + 2 * B * HV * V * K * 4


# ----------------------------------------------------------------------------- the seed's table

# The seed article's configurations (B1, D128, N value heads, S tokens) and the times it reports
# for its own CANNBot-DSL kernel on an Ascend 950.
SEED_HEADS = (24, 32, 48)
SEED_LENGTHS = (8192, 16384, 32768, 65536)
SEED_REPORTED_MS = {(24, 65536): 6.338, (32, 32768): 4.018}


def selected_block_v(variant, B: int, HV: int, T: int) -> int:
    """The block_v kdagen's selection would run for this call, among the target's widths."""
    import dataclasses
    from types import SimpleNamespace

    from ..inputs import CallInfo
    from ..select import preference
    from . import TARGETS

    info = TARGETS[variant.target]
    cands = [dataclasses.replace(variant, block_v=bv) for bv in info.block_v if bv <= variant.v and variant.v % bv == 0]
    call = CallInfo(device=SimpleNamespace(type="npu", index=0), dtype=variant.dtype, layout="bsnd", B=B, T=T, N=B,
                    H=HV, HV=HV, K=variant.k, V=variant.v, gate=variant.gate, state=variant.state, varlen=False,
                    chunk_size=None, max_len=T, cu_seqlens_host=None)
    return min(cands, key=lambda v: preference(v, call, 1)).block_v


def seed_estimates(variant, costs, hw: Ascend950 = Ascend950()) -> list[dict[str, Any]]:
    """This variant's estimated time for each of the seed's configurations (its own block_v),
    whether selection would pick it there, and the seed's reported time where there is one."""
    from .ascend import BLOCKS, group_chunks

    rows = []
    for n in SEED_HEADS:
        for t in SEED_LENGTHS:
            shape = Shape(B=1, HV=n, T=t, G=group_chunks(variant.chunk, variant.k, variant.v, n, t // variant.chunk),
                          NV=variant.v // variant.block_v, blocks=BLOCKS)
            est = estimate(costs, shape, hw, compulsory_bytes(1, n, n, t, variant.k, variant.v))
            rows.append({"N": n, "S": t, "block_v": variant.block_v, "G": shape.G,
                         "selected": selected_block_v(variant, 1, n, t) == variant.block_v,
                         "seed_ms": SEED_REPORTED_MS.get((n, t)), **{k: est[k] for k in (
                             "ms", "stage1_ms", "stage2_ms", "sync_ms", "bandwidth_floor_ms", "stage2_chunk_us",
                             "cube_gflop", "gm_gb")}})
    return rows


def format_estimates(name: str, rows: list[dict[str, Any]]) -> str:
    """The lines `kdagen build` prints for one variant: the configurations selection runs it for."""
    out = []
    for r in rows:
        if not r["selected"]:
            continue
        seed = f"  (seed's kernel: {r['seed_ms']} ms)" if r["seed_ms"] else ""
        out.append(f"  {name}: B1 N{r['N']} S{r['S'] // 1024}K D128 ~{r['ms']:.3f} ms on Ascend 950 "
                   f"[stage 1 {r['stage1_ms']:.3f}, stage 2 {r['stage2_ms']:.3f} ({r['stage2_chunk_us']:.1f} us/chunk), "
                   f"syncs {r['sync_ms']:.3f}, bandwidth floor {r['bandwidth_floor_ms']:.3f}]{seed}")
    return "\n".join(out)
