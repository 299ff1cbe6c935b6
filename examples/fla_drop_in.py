"""fla's chunk_kda call, served by kdagen: the same keywords with the same meaning (raw gate and
beta logits fused in, fp32 state [N, HV, K, V], flat dt_bias, int64 cu_seqlens). With kdagen
imported, fla's own `fla.ops.kda.chunk_kda` under inference mode dispatches to kdagen too
(fla-core 0.6's backend registry; KDAGEN_FLA_BACKEND=0 turns that off).

    python examples/fla_drop_in.py        (CPU: runs on Triton's interpreter)
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import kdagen  # noqa: E402


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    lens = [700, 324] if dev == "cuda" else [20, 12]
    T, H, HV, D = sum(lens), 2, 4, 64  # GVA: 2 value heads per q/k head
    q, k = (torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, T, HV, D, device=dev, dtype=torch.bfloat16)
    g = torch.randn(1, T, HV, D, device=dev, dtype=torch.bfloat16)  # raw gate input
    beta = torch.randn(1, T, HV, device=dev, dtype=torch.bfloat16)  # logits
    A_log, dt_bias = torch.randn(HV, device=dev), torch.randn(HV * D, device=dev)
    h0 = torch.randn(len(lens), HV, D, D, device=dev) * 0.1  # fp32 [N, HV, K, V]
    cu_cpu = torch.tensor([0, lens[0], T], dtype=torch.int64)
    call = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias,
                cu_seqlens=cu_cpu.to(dev), cu_seqlens_cpu=cu_cpu)
    with torch.inference_mode():
        o, ht = kdagen.chunk_kda(q, k, v, g, beta, **call)
    print(f"kdagen.chunk_kda: o {tuple(o.shape)} {o.dtype}, final state {tuple(ht.shape)} {ht.dtype}")
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        print("fla not installed: skipping fla's own chunk_kda")
        return
    with torch.inference_mode():
        o2, ht2 = chunk_kda(q, k, v, g, beta, **call)  # dispatched to kdagen
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    print("fla.ops.kda.chunk_kda under inference mode: served by kdagen (identical result)")


if __name__ == "__main__":
    main()
