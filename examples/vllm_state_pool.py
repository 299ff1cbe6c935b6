"""A serving engine's prefill step (vLLM/SGLang style): recurrent states live in a pool
[P, HV, V, K]; each sequence of the packed batch names its slot (int32, -1 = a padding
sequence, neither read nor written); cu_seqlens (query_start_loc) is int32 with its host copy;
the output buffer is preallocated; the pool is updated in place. As vLLM's KDA layer passes
them: g is the log-decay the layer's fused gate already computed (fp32, the precomputed gate)
and beta is sigmoid(b) in fp32 (beta_is_logit=False: the kernels read it as given).

    python examples/vllm_state_pool.py     (CPU: runs on Triton's interpreter)
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kdagen  # noqa: E402


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    P, H, HV, D = 8, 2, 4, 64 if dev == "cuda" else 32
    lens = [512, 0, 200, 64] if dev == "cuda" else [20, 0, 12, 7]  # the 0-length one is a padding row
    T = sum(lens)
    pool = torch.randn(P, HV, D, D, device=dev) * 0.1  # fp32 [P, HV, V, K], the engine's state cache
    slots = torch.tensor([5, -1, 2, 7], dtype=torch.int32, device=dev)
    qsl_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    qsl = qsl_cpu.to(dev)
    q, k = (torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, T, HV, D, device=dev, dtype=torch.bfloat16)
    # the layer's own gate: -exp(A_log) * softplus(g_raw + dt_bias), a log-decay per channel
    A_log, dt_bias = torch.randn(HV, device=dev), torch.randn(HV, D, device=dev)
    g_raw = torch.randn(1, T, HV, D, device=dev)
    g = -A_log.exp()[:, None] * torch.nn.functional.softplus(g_raw + dt_bias)
    beta = torch.sigmoid(torch.randn(1, T, HV, device=dev))  # probabilities
    call = dict(gate="precomputed", beta_is_logit=False, cu_seqlens=qsl, cu_seqlens_cpu=qsl_cpu)
    out = torch.empty_like(v)
    before = pool.clone()
    # assume_valid: the engine promises valid slots and offsets, so nothing is read on the host
    kdagen.kda_prefill(q, k, v, g, beta, **call, state_pool=pool, state_indices=slots, out=out, assume_valid=True)
    untouched = [s for s in range(P) if s not in (5, 2, 7)]
    assert all(torch.equal(pool[s], before[s]) for s in untouched)
    # the same step as a plain call on the gathered states
    h0 = before[slots.clamp(min=0).long()].clone()
    h0[1] = 0
    o2, fs = kdagen.kda_prefill(q, k, v, g, beta, **call, initial_state=h0, output_final_state=True)
    assert torch.equal(out, o2) and all(torch.equal(pool[s], fs[n]) for n, s in enumerate([5, -1, 2, 7]) if s >= 0)
    print(f"pool updated in place: slots 5, 2, 7 written, {len(untouched)} slots untouched; o {tuple(out.shape)}")


if __name__ == "__main__":
    main()
