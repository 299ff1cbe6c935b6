"""One rank of the context-parallel tests (tests/test_cp.py, scripts/cp_bench.py): problems built
alike on every rank from a seed, the rank's slice run through kdagen.cp, results saved."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch


def cu_of(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def problem(case: dict, device: str = "cpu") -> tuple[dict, dict]:
    """(tensors, keywords) of a case's whole single-process call (B = 1, packed, BSND or BNSD)."""
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    lens, H, HV, K = case["lens"], case.get("H", 1), case.get("HV", 1), case.get("K", 32)
    dtype = case.get("dtype", torch.float32)
    T = sum(lens)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=gen) * scale

    # q and k of unit norm, as models feed KDA: with |k|^2 ~ K the delta rule grows o
    # exponentially along a sequence, and a relative error then sees only the last tokens.
    unit = torch.nn.functional.normalize
    t = dict(q=unit(r(1, T, H, K), dim=-1).to(dtype), k=unit(r(1, T, H, K), dim=-1).to(dtype),
             v=r(1, T, HV, K).to(dtype), g=r(1, T, HV, K), beta=r(1, T, HV))
    if case.get("layout", "BSND") == "BNSD":
        t = {n: x.transpose(1, 2).contiguous() for n, x in t.items()}
    # "chunk": None leaves the kernel chunk to the runtime
    kw: dict[str, Any] = dict(A_log=r(HV, scale=0.5), dt_bias=r(HV, K), lower_bound=case.get("lower_bound", -1e-3),
                              layout=case.get("layout", "BSND"), state_layout=case.get("state_layout", "VK"),
                              chunk_size=case.get("chunk", 16), output_final_state=True)
    kw["initial_state"] = r(len(lens), HV, K, K, scale=0.5).to(case.get("state_dtype", torch.float32))
    if case.get("chunk_states"):
        kw["return_chunk_states"] = case["chunk_states"]  # True or a stride m
    t = {n: x.to(device) for n, x in t.items()}
    kw = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    return t, kw


def pool_of(case: dict, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A state pool with two spare slots and each sequence's slot, shuffled; the second sequence
    is padding (-1: neither read nor written)."""
    gen = torch.Generator().manual_seed(100 + case.get("seed", 0))
    h0 = kw["initial_state"]
    N = h0.shape[0]
    pool = torch.randn(N + 2, *h0.shape[1:], generator=gen).to(h0.dtype) * 0.5
    idx = torch.randperm(N + 2, generator=gen)[:N]
    idx[1] = -1
    return pool.to(h0.device), idx


def checkpoints_of(case: dict, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint buffer of random rows (rows a call does not write keep them) and offsets
    that leave each sequence one spare row after its own."""
    gen = torch.Generator().manual_seed(200 + case.get("seed", 0))
    h0 = kw["initial_state"]
    offs = [0]
    for L in case["lens"]:
        offs.append(offs[-1] + L // case["ckpt"] + 1)
    buf = torch.randn(offs[-1], *h0.shape[1:], generator=gen).to(h0.dtype)
    return buf.to(h0.device), torch.tensor(offs, dtype=torch.int64)


def local_slice(t: dict, a: int, b: int, layout: str) -> dict:
    ax = 1 if layout == "BSND" else 2
    return {n: x.narrow(ax, a, b - a).contiguous() for n, x in t.items()}


def local_part(t: dict, ctx, layout: str) -> dict:
    """The rank's tokens (every slot it holds, in its buffer's order) of each tensor."""
    ax = 1 if layout == "BSND" else 2
    return {n: ctx.take(x, ax).contiguous() for n, x in t.items()}


def fla_call(case: dict, t: dict, kw: dict) -> tuple[tuple, dict]:
    """A case as fla's chunk_kda arguments (bounded gate in the kernel, beta logits, no states:
    fla takes none with a context)."""
    fkw = dict(A_log=kw["A_log"], dt_bias=kw["dt_bias"], lower_bound=kw["lower_bound"], use_gate_in_kernel=True,
               use_beta_sigmoid_in_kernel=True, state_v_first=kw["state_layout"] == "VK", chunk_size=64)
    return (t["q"], t["k"], t["v"], t["g"], t["beta"]), fkw


def run_rank(rank: int, world: int, store: str, cases: list[dict], out_dir: str, backend: str = "gloo",
             device: str = "cpu") -> None:
    """torch.multiprocessing.spawn entry: every case on this rank, results to out_dir/r{rank}_{i}.pt.
    Progress goes to stderr (pytest shows it with a failure: where a rank stopped)."""
    torch.set_num_threads(1)  # the ranks share the machine's few cores
    import sys

    import torch.distributed as dist

    import kdagen
    from kdagen.cp import build_cp_context, kda_prefill_cp
    from kdagen.scan.reference import reference_prefill

    if any(c.get("engine") == "fla" for c in cases):
        # Nothing may keep the group alive past destroy_process_group: its gloo threads, still
        # running at interpreter exit, aborted a rank now and then ("terminate called without an
        # active exception", CI, sessions 40-41). fla keeps it alive twice: its tensor_cache holds
        # get_cp_cu_seqlens's arguments, the group among them (off here: the variable for a first
        # import, the attribute fla reads at call time in case it was imported already), and
        # importing fla imports torch._inductor, which, imported after init_process_group, holds
        # the default group too.
        os.environ["FLA_DISABLE_TENSOR_CACHE"] = "1"
        import fla.ops.cp  # noqa: F401
        import fla.ops.kda  # noqa: F401
        import fla.utils

        fla.utils.FLA_DISABLE_TENSOR_CACHE = True

    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))

    def say(what: str) -> None:
        print(f"cp_worker rank {rank}/{world}: {what}", file=sys.stderr, flush=True)

    try:
        for i, case in enumerate(cases):
            say(f"case {i} {case}")
            t, kw = problem(case, device)
            if case.get("engine") == "fla":  # fla's context, through kdagen.chunk_kda and fla's chunk_kda
                _fla_rank(rank, case, t, kw, os.path.join(out_dir, f"r{rank}_{i}.pt"))
                continue
            ctx = build_cp_context(cu_of(case["lens"]), tokens_per_rank=case.get("tokens_per_rank"),
                                   layout=case.get("cp_layout", "contiguous"), pools=case.get("pools", "replicated"))
            loc = local_part(t, ctx, kw["layout"])
            ck = {}
            if case.get("ckpt"):  # checkpoints into each rank's own buffer, rows the same on every rank
                buf, offs = checkpoints_of(case, kw)
                ck = dict(checkpoint_every=case["ckpt"], checkpoints=buf, checkpoint_offsets=offs)
            if case.get("pool"):  # the pool replaces the states: each rank's own copy, updated in place
                pool, idx = pool_of(case, kw)
                kw["initial_state"] = None
                res = kdagen.kda_prefill(**loc, **kw, cp_context=ctx, state_pool=pool, state_indices=idx, **ck)
                assert res[1] is not None and res[1].shape[0] == len(ctx.ends)
                assert not ck or res[-1] is ck["checkpoints"]
                torch.save(dict(out=[res[0].cpu()], pool=pool.cpu(), ends=list(ctx.ends),
                                ckpt=ck["checkpoints"].cpu() if ck else None),
                           os.path.join(out_dir, f"r{rank}_{i}.pt"))
                continue
            kw["initial_state"] = ctx.local_initial_state(kw["initial_state"])
            extra = dict(segments=case.get("segments"), mode=case.get("mode", "correct"),
                         chunk_grid=case.get("chunk_grid", "sequence"))
            if case.get("engine") == "ref":
                res = kda_prefill_cp(**loc, **kw, cp_context=ctx, prefill=reference_prefill, **extra, **ck)
            elif extra["segments"] is None and extra["mode"] == "correct" and extra["chunk_grid"] == "sequence":
                res = kdagen.kda_prefill(**loc, **kw, cp_context=ctx, **ck)  # the runtime's pass-through
            else:
                res = kda_prefill_cp(**loc, **kw, cp_context=ctx, **extra, **ck)
            plain_o = None
            if ck:
                assert res[-1] is ck["checkpoints"]
                res = res[:-1]
                if case.get("same_o"):  # the call without checkpoints, for o's bit-identity
                    plain_o = kdagen.kda_prefill(**loc, **kw, cp_context=ctx)[0].cpu()
            torch.save(dict(out=[x.cpu() if x is not None else None for x in res], ends=list(ctx.ends),
                            ckpt=ck["checkpoints"].cpu() if ck else None, plain_o=plain_o),
                       os.path.join(out_dir, f"r{rank}_{i}.pt"))
        say("cases done")
    finally:
        dist.destroy_process_group()
    left = gloo_threads()
    if left:  # a group kept alive: the exit-time abort above, caught every time instead of now and then
        raise RuntimeError(f"rank {rank}: threads {left} of a gloo group still run after destroy_process_group")
    say("process group destroyed")


def gloo_threads() -> list[str]:
    """This process's gloo threads (Linux's thread names; [] elsewhere), after a collection."""
    import gc

    gc.collect()
    task = "/proc/self/task"
    if not os.path.isdir(task):
        return []
    names = []
    for t in os.listdir(task):
        try:
            with open(os.path.join(task, t, "comm")) as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while listed
            pass
    return sorted(n for n in names if "gloo" in n)


def _fla_rank(rank: int, case: dict, t: dict, kw: dict, path: str) -> None:
    import torch.distributed as dist
    from fla.ops.cp import build_cp_context as fla_context
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    import kdagen
    from kdagen.cp import from_fla

    cu = torch.tensor(cu_of(case["lens"]), dtype=torch.long)
    fctx = fla_context(cu, dist.group.WORLD, layout=case.get("cp_layout", "contiguous"))
    ctx = from_fla(fctx)
    args, fkw = fla_call(case, local_part(t, ctx, "BSND"), kw)
    fkw["return_intermediate_states"] = bool(case.get("inter"))
    with torch.inference_mode():
        res = kdagen.chunk_kda(*args, **fkw, cp_context=fctx)
        res_fla = fla_chunk_kda(*args, **fkw, cp_context=fctx)  # served by kdagen's fla backend
    torch.save(dict(out=[res[0], res_fla[0]], h=[x[2] for x in (res, res_fla)] if case.get("inter") else None,
                    pieces=[ctx.global_range(p) for p in ctx.pieces]), path)
