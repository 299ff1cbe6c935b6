"""Ascend 950 target: CANNBot-DSL kernels translated to AscendC on CPU.

``translate`` runs the DSL pipeline up to AscendC code generation
(``CANNBOTDSL_PIPE_STAGE=translate``) in a subprocess, once per layout, and
returns facts read from the translated MLIR (cube matmuls per core function,
on-chip bytes per memory vs capacity) and the workspace plan (bytes per group of
chunks against the L2 budget). No CANN toolkit is needed for that.
``AscendLauncher`` runs the kernel through torch_npu (not hardware-validated), or, with
``AscendSettings(backend="model")``, runs the same generated program on the CPU model of the DSL
(``kdagen.ascend_sim``); ``model_prefill`` is kda_prefill for that model.

Chunk groups: the kernel loops over groups of G chunks (stage 1 for the group's
(chunk, batch x head) pairs, a cross-core sync, stage 2 over the group's chunks with the
fp32 state carried in GM between groups, a sync). The workspace holds one group,
G x B x HV x ``ws_bytes_per_chunk_head`` bytes; ``group_chunks`` picks G (the Triton
twin uses the same function, so it runs the same grouping).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

from ..errors import KdaInputError
from ..paths import ROOT, rel
from .ascend_cost import Ascend950, format_estimates, seed_estimates, static_costs
from .loader import load_generated_module

# On-chip capacities of dav-3510 (Ascend 950PR/DT) in bytes, as cannbotdsl 0.7.1 reports them
# (cannbotdsl.get_mem_size); tests cross-check this table against the installed package.
CAPACITY = {"ub": 253952, "l1": 524288, "l0a": 65536, "l0b": 65536, "l0c": 262144}
# MLIR memref address spaces emitted by the DSL.
_SPACES = {"1": "ub", "2": "l1", "3": "l0a", "4": "l0b", "5": "l0c"}
_DT_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "i64": 8, "i8": 1, "ui8": 1, "i16": 2}
LAYOUTS = ("bsnd", "bnsd")

# Workspace plan. Ascend 950PR's L2 is 128 MB per a CANN 950PR example (other notes say ~112 MiB;
# not measured here). The stage-1 -> stage-2 workspace should stay L2-resident while the group's
# q/k/v/g reads, o writes and the state carrier also pass through L2, so it gets a quarter of it.
L2_BYTES_ASSUMED = 128 * 2**20
WORKSPACE_BUDGET = 32 * 2**20
# Blocks the launcher starts (one resident wave: global_sync_all needs every block resident);
# stage 1 fills them when a group has at least this many (chunk, head) tasks.
BLOCKS = 32
# Head counts the translate facts tabulate (the DESIGN anchors), at a long sequence.
PLAN_HEADS = (4, 8, 16, 24, 32, 48, 64, 96)
PLAN_T = 65536


@dataclass(frozen=True)
class AscendSettings:
    """How AscendLauncher runs a variant.

    group_chunks: chunks per group (None: ``group_chunks`` below, from the L2 budget);
    blocks: AI cores launched (one resident wave: global_sync_all needs them all resident);
    backend: "npu" (torch_npu, an Ascend 950) or "model" (kdagen.ascend_sim on the CPU).
    """

    group_chunks: Optional[int] = None
    blocks: int = BLOCKS
    backend: str = "npu"


def ws_bytes_per_chunk_head(chunk: int, k: int, v: int) -> int:
    """fp32 workspace of one (chunk, head): Qd, Kr, W [C, K], U [C, V], Mqk [C, C], gamma_C [K]."""
    return 4 * (chunk * (3 * k + v + chunk) + k)


def group_chunks(chunk: int, k: int, v: int, hv: int, n_chunks: int,
                 budget: int = WORKSPACE_BUDGET) -> int:
    """Chunks per group G: the most that keep G x hv x per-chunk bytes within ``budget`` (at least
    1, at most ``n_chunks``), then evened out over the groups that count needs (same number of
    groups, no small last group, a smaller workspace). Stage 1 runs G x hv (chunk, head) tasks per
    group: at least ``BLOCKS`` whenever the sequence has that many, since BLOCKS x per-chunk bytes
    (< 5 MiB at K = V = 128) is far inside the budget. Only hv x per-chunk bytes > budget (more
    than ~220 heads at K = V = 128) leaves G = 1 over budget; ``workspace_plan`` says so."""
    n_chunks = max(1, n_chunks)
    g = max(1, min(budget // (hv * ws_bytes_per_chunk_head(chunk, k, v)), n_chunks))
    n_groups = -(-n_chunks // g)
    return -(-n_chunks // n_groups)


def workspace_plan(chunk: int, k: int, v: int, hv: int, T: int,
                   budget: int = WORKSPACE_BUDGET) -> dict[str, Any]:
    """The grouping ``group_chunks`` gives one (hv, T): what translate reports and tests check."""
    nc = -(-T // chunk)
    per = ws_bytes_per_chunk_head(chunk, k, v)
    g = group_chunks(chunk, k, v, hv, nc, budget)
    n_groups = -(-nc // g)
    return {
        "heads": hv, "T": T, "chunks": nc, "group_chunks": g, "groups": n_groups,
        "workspace_bytes_per_group": g * hv * per,
        "workspace_bytes_whole_sequence": nc * hv * per,
        "stage1_tasks_per_group": g * hv,
        "global_syncs": 2 * n_groups,
        "within_budget": g * hv * per <= budget,
    }


class AscendError(RuntimeError):
    pass


def _funcs(mlir: str) -> dict[str, str]:
    """Split a module into its func.func bodies, by symbol name."""
    out: dict[str, str] = {}
    parts = re.split(r"^  func\.func @", mlir, flags=re.M)
    for part in parts[1:]:
        out[part.split("(", 1)[0]] = part
    return out


def mlir_facts(mlir: str) -> dict[str, Any]:
    funcs = _funcs(mlir)
    aic = {n: b for n, b in funcs.items() if n.endswith("_aic")}
    aiv = {n: b for n, b in funcs.items() if n.endswith("_aiv")}
    used: dict[str, int] = {}
    for body in list(aic.values()) + list(aiv.values()):
        for off, n, dt, space in re.findall(
            r"cannir\.byte_offset = (\d+) : i64\} : memref<(\d+)x(\w+), (\d)>", body
        ):
            mem = _SPACES.get(space)
            if mem is None:
                continue
            end = int(off) + int(n) * _DT_BYTES.get(dt, 4)
            used[mem] = max(used.get(mem, 0), end)
    return {
        "cube_functions": sorted(aic),
        "vector_functions": sorted(aiv),
        "cube_matmuls": sum(b.count("asccube.mmad") for b in aic.values()),
        "vector_matmuls": sum(b.count("asccube.mmad") for b in aiv.values()),
        "global_syncs": sum(b.count("sync_all") for b in funcs.values()),
        "vector_exp": sum(b.count("ascvec.exp") for b in aiv.values()),
        "onchip_bytes": used,
        "capacity_bytes": dict(CAPACITY),
        "fits": all(used.get(m, 0) <= CAPACITY[m] for m in CAPACITY),
    }


_C_DECL = re.compile(r"^\s*((?:u?int(?:8|16|32|64)_t)|bool|float)\s+(\w+)\s*=\s*(.*);\s*$", re.M)
_C_LOOP = re.compile(r"for \(((?:u?int(?:8|16|32|64)_t))\s+(\w+)\s*=\s*([^;]*);")
_GM_OFFSET = re.compile(r"\b(gm\d+)\s*\+\s*(\w+)")
_NARROW = ("int8_t", "uint8_t", "int16_t", "uint16_t", "int32_t", "uint32_t")


def gm_offset_facts(asc: str) -> dict[str, Any]:
    """How the translated AscendC forms its global-memory addresses (every one is ``gmN + offset``).

    For each offset, its declared type and, through the declarations it is computed from, any
    32-bit-or-narrower value or cast on the way. Element offsets pass 2^31 in an ordinary long
    prefill (a 128K-token sequence over a 16K-column projection), so a narrow one is a wrong
    address there, not a slow one."""
    decl = {name: (ty, expr) for ty, name, expr in _C_DECL.findall(asc) + _C_LOOP.findall(asc)}
    by_type: dict[str, int] = {}
    narrow: set[str] = set()
    for _gm, off in _GM_OFFSET.findall(asc):
        ty = "literal" if off.isdigit() else decl.get(off, ("undeclared", ""))[0]
        by_type[ty] = by_type.get(ty, 0) + 1
        seen, todo = set(), [off]
        while todo:
            name = todo.pop()
            if name in seen or name not in decl:
                continue
            seen.add(name)
            t, expr = decl[name]
            if t in _NARROW or re.search(r"\((?:u?int(?:8|16|32)_t)\)", expr):
                narrow.add(f"{off}: {t} {name} = {expr}")
                continue
            todo += [x for x in re.findall(r"[A-Za-z_]\w*", expr) if x in decl]
    return {"offsets": sum(by_type.values()), "by_type": by_type, "narrow": sorted(narrow)}


def translate(variant, source: pathlib.Path, out_dir: pathlib.Path) -> dict:
    """Translate ``source`` (the rendered kernel.py) to AscendC/MLIR for each layout.

    Writes ``<layout>/kda_fwd.{mlir,asc}``, ``translate.log`` and ``facts.json`` into
    ``out_dir``; raises ``AscendError`` with the log tail when the DSL rejects the kernel.
    """
    source = pathlib.Path(source).resolve()
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_lines: list[str] = []
    facts: dict[str, Any] = {"variant": variant.name, "hardware_validated": False, "layouts": {},
                             "source": rel(source)}
    C, K, V = variant.chunk, variant.k, variant.v
    facts["workspace"] = {
        "bytes_per_chunk_head": ws_bytes_per_chunk_head(C, K, V),
        "budget_bytes": WORKSPACE_BUDGET,
        "l2_bytes_assumed": L2_BYTES_ASSUMED,
        "blocks": BLOCKS,
        # G is a run-time dimension of the kernel (rows of ws_gc = G x HV), so this one translation
        # covers every group size; the plans show what group_chunks picks at T = PLAN_T.
        "group_dim": "dynamic",
        "plans": [workspace_plan(C, K, V, hv, PLAN_T) for hv in PLAN_HEADS],
    }
    if importlib.util.find_spec("cannbotdsl") is None:
        raise AscendError(f"translating {variant.name} needs the CANNBot DSL, which this Python "
                          f"({sys.executable}) lacks: pip install 'cannbot-dsl==0.7.1' "
                          f"(or leave the Ascend specs out of the build)")
    for layout in LAYOUTS:
        dump = out_dir / layout
        dump.mkdir(exist_ok=True)
        env = dict(os.environ)
        env.update(
            CANNBOTDSL_PIPE_STAGE="translate",
            CANNBOTDSL_DUMP_ASCENDC="1",
            CANNBOTDSL_DUMP_MLIR="1",
            CANNBOTDSL_DUMP_DIR=str(dump),
            CANNBOTDSL_NPU_ARCH="dav-3510",
        )
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(source), layout], env=env, cwd=str(dump),
            capture_output=True, text=True,
        )
        dt = time.perf_counter() - t0
        log_lines += [f"== {variant.name} {layout}: rc={proc.returncode} {dt:.2f}s", proc.stdout, proc.stderr]
        (out_dir / "translate.log").write_text("\n".join(log_lines))
        mlir = dump / "kda_fwd.mlir"
        asc = dump / "kda_fwd.asc"
        if proc.returncode != 0 or not mlir.exists() or not asc.exists():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise AscendError(
                f"CANNBot-DSL translation of {variant.name} ({layout}) failed (rc={proc.returncode}); "
                f"log: {out_dir / 'translate.log'}\n{tail}"
            )
        lf = mlir_facts(mlir.read_text())
        lf["costs"] = static_costs(mlir.read_text())
        lf["ascendc_bytes"] = asc.stat().st_size
        lf["ascendc_has_mmad"] = "asc_mmad" in asc.read_text()
        lf["gm_offsets"] = gm_offset_facts(asc.read_text())
        lf["seconds"] = round(dt, 2)
        facts["layouts"][layout] = lf
    if K == 128:  # the seed's configurations are D128
        rows = seed_estimates(variant, facts["layouts"]["bsnd"]["costs"])
        facts["estimates"] = rows
        facts["estimate_assumptions"] = " ".join(Ascend950.__doc__.split())
        # what `kdagen build` prints and records in the build manifest
        facts["summary"] = format_estimates(variant.name, rows)
        facts["manifest"] = {"ascend950_estimates_ms": {f"N{r['N']}_S{r['S']}": r["ms"] for r in rows if r["selected"]}}
    (out_dir / "facts.json").write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
    return facts


class AscendLauncher:
    """Runs a generated Ascend variant: on an NPU through torch_npu (CANNBot-DSL JIT compiles on
    first call), or on the CPU model of the DSL (``settings.backend == "model"``), with the same
    argument preparation either way.

    ``artifact``: the generated kernel.py path, the directory containing it, or the build's
    translated.json (which names its source).
    """

    def __init__(self, variant, artifact, settings: Optional[AscendSettings] = None):
        self.variant = variant
        path = pathlib.Path(artifact)
        if path.suffix == ".json":
            path = ROOT / json.loads(path.read_text())["source"]
        self.source = path / "kernel.py" if path.is_dir() else path
        self.settings = settings or AscendSettings()
        self._hosts: dict = {}
        self._mod = None
        self.last_group_chunks: Optional[int] = None

    def _require_npu(self):
        try:
            import torch_npu  # noqa: F401
        except Exception as exc:  # pragma: no cover - depends on the machine
            raise AscendError(
                f"{self.variant.name}: running Ascend kernels needs torch_npu and an Ascend 950 "
                f"(NPU ARCH 3510) with CANN; import torch_npu failed: {exc}. "
                "On CPU, AscendSettings(backend='model') runs the kernel on the DSL model (kdagen.ascend_sim)."
            ) from exc

    def module(self):
        """The generated kernel module, bound to the real DSL or to the CPU model."""
        if self._mod is None:
            if self.settings.backend == "model":
                from ..ascend_sim import load_kernel_module

                self._mod = load_kernel_module(self.source, self.variant.name)
            elif self.settings.backend == "npu":
                self._mod = load_generated_module(self.variant.name, self.source)
            else:
                raise AscendError(f"AscendSettings.backend: expected 'npu' or 'model', found {self.settings.backend!r}")
        return self._mod

    def check(self, call) -> None:
        """Reject what the kernel does not implement, with the reason."""
        v = self.variant
        C = v.chunk
        if getattr(call, "twins", 1) != 1:
            raise AscendError(f"{v.name}: twins={call.twins}; the Ascend kernel runs one state per value head")
        if getattr(call, "h0_index", None) is not None or getattr(call, "ht_index", None) is not None:
            raise AscendError(f"{v.name}: h0_index/ht_index given; the Ascend kernel takes no state pool slots "
                              f"(the runtime gathers and scatters a pool around them)")
        if call.cu_seqlens is not None:
            raise AscendError(f"{v.name}: varlen (cu_seqlens) is not supported by the Ascend kernel")
        if call.T % C:
            raise AscendError(f"{v.name}: T={call.T} must be a multiple of the chunk {C}")
        if call.state_kv:
            raise AscendError(f"{v.name}: state layout [K,V] is not supported; use [V,K]")
        if call.chunk_states is not None:
            raise AscendError(f"{v.name}: per-chunk states are not emitted by the Ascend kernel")
        if call.A_log is None:
            raise AscendError(f"{v.name}: the Ascend kernel implements the bounded gate only")
        if not call.use_qk_l2norm:
            raise AscendError(f"{v.name}: the Ascend kernel always L2-normalises q and k (use_qk_l2norm=True)")
        if (call.K, call.V) != (v.k, v.v):
            raise AscendError(f"{v.name}: head dims K={call.K} V={call.V} do not match the variant")
        lb_min = self.module().LOWER_BOUND_MIN
        if call.lower_bound < lb_min:
            raise KdaInputError(
                f"lower_bound: expected a value >= {lb_min:g} for the Ascend kernel (its sub-tile anchors are "
                f"exact in fp32 down to there), found {call.lower_bound!r}")

    def __call__(self, call) -> None:
        import torch

        if self.settings.backend == "npu":
            self._require_npu()
        self.check(call)
        mod = self.module()
        v = self.variant
        C = v.chunk
        B, T, H, HV, K, V = call.B, call.T, call.H, call.HV, call.K, call.V
        # [B, T, HV, V] has head stride V. A size-1 head axis has no meaningful stride, but then both
        # layouts are the same memory order; v has the most heads (HV >= H), so it decides.
        bsnd = HV == 1 or call.v_strides[2] == V
        dev = call.q.device
        f32 = dict(device=dev, dtype=torch.float32)
        if bsnd:
            rows = B * T
            q2, k2 = call.q.reshape(rows, H * K), call.k.reshape(rows, H * K)
            v2, o2 = call.v.reshape(rows, HV * V), call.o.view(rows, HV * V)
            g2 = call.g.to(torch.float32).reshape(rows, HV * K).contiguous()
            beta2 = call.beta.to(torch.float32).reshape(B, T, HV).permute(0, 2, 1).reshape(B * HV, T).contiguous()
        else:
            q2, k2 = call.q.reshape(B * H * T, K), call.k.reshape(B * H * T, K)
            v2, o2 = call.v.reshape(B * HV * T, V), call.o.view(B * HV * T, V)
            g2 = call.g.to(torch.float32).reshape(B * HV * T, K).contiguous()
            beta2 = call.beta.to(torch.float32).reshape(B * HV, T).contiguous()
        # One group's workspace: the kernel reads G from its shape and loops over the groups.
        nc = T // C
        G = self.settings.group_chunks or group_chunks(C, K, V, B * HV, nc)
        G = max(1, min(G, nc))
        self.last_group_chunks = G
        ws = [torch.empty(r, c, **f32) for r, c in mod.workspace_shapes(G * B * HV)]
        a_log = torch.zeros(HV, 8, **f32)
        a_log[:, 0] = call.A_log.reshape(HV)
        dt_bias = call.dt_bias if call.dt_bias is not None else torch.zeros(HV, K, **f32)
        ht = torch.empty(B * HV * V, K, **f32)   # the fp32 state carried between groups; final state at the end
        h0 = call.initial_state.reshape(B * HV * V, K).float() if call.initial_state is not None else ht
        eye = torch.eye(C, 64, **f32)
        key = (H, HV, call.scale, call.lower_bound, bsnd, call.beta_mode, call.initial_state is not None)
        if key not in self._hosts:
            self._hosts[key] = mod.make_host(*key, self.settings.blocks)
        self._hosts[key](q2, k2, v2, g2, beta2, o2, a_log, dt_bias, h0, ht, eye, *ws)
        if call.final_state is not None:
            call.final_state.copy_(ht.view_as(call.final_state))


def model_prefill(variant, source, q, k, v, g, beta, *, settings: Optional[AscendSettings] = None,
                  A_log=None, dt_bias=None, scale=None, lower_bound=-5.0, gate=None, initial_state=None,
                  output_final_state=False, layout="BSND", state_layout="VK", use_qk_l2norm=True,
                  allow_neg_eigval=False, beta_is_logit=True, poison=True, **unsupported):
    """kda_prefill on the CPU model of the DSL: validates the call like kda_prefill, runs the
    generated kernel ``source`` of ``variant`` through AscendLauncher(backend="model") and returns
    (o, final_state). Outputs start as NaN (``poison``), so an element the kernel skips shows."""
    import dataclasses

    import torch

    from ..abi import KdaCall
    from ..inputs import check_call
    from ..runtime import _strides

    extra = {n: x for n, x in unsupported.items() if x not in (None, False)}
    if extra:
        raise AscendError(f"{variant.name}: the Ascend kernel does not take {sorted(extra)}")
    info = check_call(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, lower_bound=lower_bound,
                      gate=gate, initial_state=initial_state, output_final_state=output_final_state,
                      cu_seqlens=None, layout=layout, state_layout=state_layout, state_dtype=None,
                      chunk_size=None, return_chunk_states=False)
    o = torch.empty_like(v)
    final_state = None
    if output_final_state:
        final_state = torch.empty((info.N, info.HV, info.V, info.K), dtype=torch.float32)
    if poison:
        for t in (o, final_state):
            if t is not None:
                t.fill_(float("nan"))
    call = KdaCall(
        q=q, k=k, v=v, g=g, beta=beta, o=o,
        q_strides=_strides(q, info.layout), k_strides=_strides(k, info.layout), v_strides=_strides(v, info.layout),
        g_strides=_strides(g, info.layout), beta_strides=_strides(beta.unsqueeze(-1), info.layout),
        o_strides=_strides(o, info.layout),
        B=info.B, T=info.T, N=info.N, H=info.H, HV=info.HV, K=info.K, V=info.V, cu_seqlens=None,
        A_log=A_log.to(torch.float32).contiguous().reshape(-1) if A_log is not None else None,
        dt_bias=dt_bias.to(torch.float32).contiguous().reshape(info.HV, info.K) if dt_bias is not None else None,
        scale=float(scale) if scale is not None else info.K ** -0.5,
        lower_bound=float(lower_bound) if lower_bound is not None else 0.0,
        use_qk_l2norm=bool(use_qk_l2norm), allow_neg_eigval=bool(allow_neg_eigval),
        initial_state=initial_state.contiguous() if initial_state is not None else None,
        final_state=final_state, state_kv=state_layout == "KV", chunk_states=None, chunk_offsets=None,
        max_len=info.max_len, beta_is_logit=bool(beta_is_logit),
    )
    settings = dataclasses.replace(settings or AscendSettings(), backend="model")
    AscendLauncher(variant, source, settings)(call)
    return o, final_state
