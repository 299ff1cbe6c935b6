"""Context parallelism: a packed batch split over the ranks of a torch.distributed group in the
zigzag layout (rank r holds slots r and 2W-1-r of 2W, as attention layers shard for causal
balance), one all_gather per call, checked against the whole batch in one process. The same
call with fla's own context (fla.ops.cp.build_cp_context) through kdagen.chunk_kda, where fla is
installed. Then as a serving engine calls it: every rank keeps a replica of the state pool and
of the prefix cache's checkpoints, the sequences start from their slots, and every replica
receives every final state and every checkpoint.

    python examples/context_parallel.py           (starts 2 ranks with torchrun: NCCL on 2+ GPUs,
                                                   else gloo; CPU: Triton's interpreter)
    torchrun --nproc_per_node 2 examples/context_parallel.py
"""

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import torch.distributed as dist  # noqa: E402

import kdagen  # noqa: E402
from kdagen.cp import build_cp_context, from_ranks  # noqa: E402
from kdagen.reference import rel_rmse  # noqa: E402

# A gloo group still alive at interpreter exit can abort the process, and fla keeps it alive past
# destroy_process_group twice: its tensor_cache holds the group (off here, before fla is imported),
# and torch._inductor, which fla imports, holds it when imported after init_process_group.
os.environ.setdefault("FLA_DISABLE_TENSOR_CACHE", "1")
try:
    from fla.ops.cp import build_cp_context as fla_context
except ImportError:
    fla_context = None

WORLD = 2


def problem(dev: str) -> tuple[dict, dict, list[int]]:
    """The same inputs on every rank: three sequences, the middle one through every slot (cut on
    the kernel chunk's grid, as checkpoints need)."""
    gen = torch.Generator().manual_seed(0)
    lens = [256, 3584, 256] if dev == "cuda" else [16, 96, 16]
    T, H, D = sum(lens), 2, 64 if dev == "cuda" else 32
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(dev)

    t = dict(q=r(1, T, H, D).to(dtype), k=r(1, T, H, D).to(dtype), v=r(1, T, H, D).to(dtype), g=r(1, T, H, D),
             beta=r(1, T, H))
    kw = dict(A_log=r(H, scale=0.5), dt_bias=r(H, D), lower_bound=-1.0, use_qk_l2norm=True)
    return t, kw, [0, lens[0], lens[0] + lens[1], T]


def rank_main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    nccl = torch.cuda.device_count() >= world
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if nccl:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if nccl else "gloo")
    t, kw, cu = problem(dev)
    h0 = torch.randn(len(cu) - 1, t["v"].shape[2], t["q"].shape[3], t["v"].shape[3],
                     generator=torch.Generator().manual_seed(1)).to(dev) * 0.1

    # This rank's tokens (its two slots, in its buffer's order) and the initial states of the
    # sequences starting on it; it returns o for its tokens and the final states of the
    # sequences ending on it.
    ctx = build_cp_context(cu, layout="zigzag")
    local = {n: ctx.take(x, 1).contiguous() for n, x in t.items()}
    o, ht = kdagen.kda_prefill(**local, **kw, initial_state=ctx.local_initial_state(h0), output_final_state=True,
                               cp_context=ctx)

    # fla's context (no states with one, as in fla), through kdagen.chunk_kda's fla keywords
    o_fla = None
    if fla_context is not None:
        fctx = fla_context(torch.tensor(cu, device=dev), dist.group.WORLD, layout="zigzag")
        with torch.inference_mode():
            o_fla = kdagen.chunk_kda(*(local[n] for n in ("q", "k", "v", "g", "beta")), A_log=kw["A_log"],
                                     dt_bias=kw["dt_bias"], lower_bound=kw["lower_bound"], use_gate_in_kernel=True,
                                     use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True,
                                     state_v_first=True, cp_context=fctx)[0]

    # An engine's state pool, replicated on every rank (the same seed): slots 4, 0 and 2 for the
    # three sequences; the call reads their states and writes every final state into every replica,
    # and the state after every `every` tokens of each sequence into every replica's checkpoints.
    pool = torch.randn(5, *h0.shape[1:], generator=torch.Generator().manual_seed(2)).to(dev) * 0.1
    slots = torch.tensor([4, 0, 2])
    pool0 = pool.clone()
    every = 1024 if dev == "cuda" else 32
    o_pool, _, ckpts = kdagen.kda_prefill(**local, **kw, cp_context=ctx, state_pool=pool, state_indices=slots,
                                          checkpoint_every=every)

    results = [None] * world
    dist.all_gather_object(results, dict(o=o.cpu(), o_fla=None if o_fla is None else o_fla.cpu(), ht=ht.cpu(),
                                         ends=ctx.ends, o_pool=o_pool.cpu(), pool=pool.cpu(), ckpts=ckpts.cpu()))
    if rank == 0:
        whole_o, whole_ht = kdagen.kda_prefill(**t, **kw, initial_state=h0, output_final_state=True,
                                               cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev))
        whole_o2 = kdagen.kda_prefill(**t, **kw, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev))[0]
        tol = 1e-2 if dev == "cuda" else 1e-5  # bf16 o on a GPU (the scan rounds o's correction term)
        ctxs = [build_cp_context(cu, rank=r, world=world, layout="zigzag") for r in range(world)]
        e_o = rel_rmse(from_ranks([x["o"] for x in results], ctxs), whole_o.cpu())
        ends = [n for x in results for n in x["ends"]]
        e_ht = rel_rmse(torch.cat([x["ht"] for x in results]), whole_ht.cpu()[ends])
        print(f"{world} ranks, zigzag, slots {[c.local_ranges for c in ctxs]}: o rel. RMSE {e_o:.1e}, final states "
              f"{e_ht:.1e} against one process")
        assert max(e_o, e_ht) < tol, (e_o, e_ht)
        whole_pool = pool0.clone()
        whole_o3, _, whole_ck = kdagen.kda_prefill(**t, **kw, state_pool=whole_pool, state_indices=slots,
                                                   cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev),
                                                   checkpoint_every=every)
        e_po = rel_rmse(from_ranks([x["o_pool"] for x in results], ctxs), whole_o3.cpu())
        e_pool = rel_rmse(results[0]["pool"][slots], whole_pool.cpu()[slots])
        e_ck = rel_rmse(results[0]["ckpts"], whole_ck.cpu())
        same = all(torch.equal(x["pool"], results[0]["pool"]) and torch.equal(x["ckpts"], results[0]["ckpts"])
                   for x in results)
        print(f"state pool and {whole_ck.shape[0]} checkpoints: o rel. RMSE {e_po:.1e}, final states {e_pool:.1e}, "
              f"checkpoints {e_ck:.1e} against one process, replicas identical: {same}")
        assert max(e_po, e_pool, e_ck) < tol and same, (e_po, e_pool, e_ck, same)
        if results[0]["o_fla"] is not None:
            e_fla = rel_rmse(from_ranks([x["o_fla"] for x in results], ctxs), whole_o2.cpu())
            print(f"fla's context through kdagen.chunk_kda: o rel. RMSE {e_fla:.1e} against one process")
            assert e_fla < tol, e_fla
    dist.destroy_process_group()


def main() -> None:
    if "RANK" in os.environ:
        rank_main()
        return
    # Not under torchrun: start the ranks, show rank 0's report.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
           os.path.abspath(__file__)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    print(res.stdout, end="")
    if res.returncode:
        sys.stderr.write(res.stderr[-4000:])
        raise SystemExit(f"context_parallel.py: the ranks failed (exit {res.returncode})")


if __name__ == "__main__":
    main()
