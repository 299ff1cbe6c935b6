"""Prefix caching: prefill writes the state after every n tokens of each sequence
(checkpoint_every=n, a multiple of the kernels' chunk size) into a caller's buffer; a later
request that shares a cached prefix starts from the checkpoint and prefills only its new
tokens, with the outputs a full prefill would give.

    python examples/prefix_cache_checkpoints.py     (CPU: runs on Triton's interpreter)
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kdagen  # noqa: E402
from kdagen.reference import rel_rmse  # noqa: E402


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    H, D, EVERY = 2, 64 if dev == "cuda" else 32, 64 if dev == "cuda" else 32
    L0, NEW = (1000, 300) if dev == "cuda" else (80, 24)

    def tokens(T):
        return dict(q=torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16),
                    k=torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16),
                    v=torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16),
                    g=torch.randn(1, T, H, D, device=dev), beta=torch.randn(1, T, H, device=dev))

    gate = dict(A_log=torch.randn(H, device=dev), dt_bias=torch.randn(H, D, device=dev), lower_bound=-5.0)
    req = tokens(L0)
    # 1. prefill request 0 with checkpoints every EVERY tokens (the cache's blocks)
    n_ckpt = L0 // EVERY
    cache = torch.empty(n_ckpt, H, D, D, device=dev)  # [rows, HV, V, K], fp32
    o, _, cache = kdagen.kda_prefill(**req, **gate, checkpoint_every=EVERY, checkpoints=cache)
    # 2. a new request: request 0's first m * EVERY tokens, then NEW tokens of its own
    m = n_ckpt
    new = tokens(NEW)
    full = {n: torch.cat([req[n][:, :m * EVERY], new[n]], dim=1) for n in req}
    o_full, _ = kdagen.kda_prefill(**full, **gate)
    # 3. served from the cache: only the NEW tokens, starting from the checkpoint
    o_new, _ = kdagen.kda_prefill(**new, **gate, initial_state=cache[m - 1:m])
    err = rel_rmse(o_new.float().cpu(), o_full[:, m * EVERY:].float().cpu())
    assert err < 1e-3, err
    print(f"{n_ckpt} checkpoints of request 0; new request resumed after {m * EVERY} cached tokens: "
          f"{NEW} tokens prefilled, rel. RMSE vs the full prefill {err:.1e}")


if __name__ == "__main__":
    main()
