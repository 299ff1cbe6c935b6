"""The kernels' algorithms in torch, on CPU, with their bf16 rounding points: one head's problem
and its float64 reference, and the errors of an emulation against it. The sm80 and sm90 emulation
tests check a kernel's formulas and the accuracy its rounding points allow without a GPU."""

from __future__ import annotations

import torch


def bf(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (hi, lo) bf16 parts
    return bf(x), bf(x - bf(x))


def hl(x, t) -> torch.Tensor:  # x t^T in hi + lo: hi hi + hi lo + lo hi
    return x[0] @ (t[0] + t[1]).T + x[1] @ t[0].T


def emulation_problem(T: int, K: int, gs: float):
    """One head's inputs for the emulation tests (seed 3; g shifted by gs, bounded gate, lower bound -5) as
    the kernels see them: normalized q and k, v, the activated gate a, beta's b and S0 [V, K] in fp32; and
    the float64 reference (o, final state, chunk states every 16 tokens)."""
    from kdagen.reference import activate_gate, kda_reference

    torch.manual_seed(3)
    q, k, v = (torch.randn(1, T, 1, K).bfloat16() for _ in range(3))
    g, beta = torch.randn(1, T, 1, K) + gs, torch.randn(1, T, 1)
    A_log, dt_bias = torch.tensor([0.3]), torch.randn(1, K) * 0.5
    S0 = torch.randn(1, 1, K, K) * 0.5  # [N, HV, V, K]
    ref = kda_reference(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, gate="bounded",
                        initial_state=S0, output_final_state=True, chunk_states_size=16)
    a = activate_gate(g, gate="bounded", A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0).float()[0, :, 0]
    nrm = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    return (nrm(q.float()[0, :, 0]), nrm(k.float()[0, :, 0]), v.float()[0, :, 0], a, torch.sigmoid(beta[0, :, 0]),
            S0[0, 0].clone(), ref)


def emulation_errors(ref, o, S, states, chunk: int) -> tuple[float, float, float]:
    """rel RMSE of o, the final state and the chunk states (entering each `chunk`-token chunk) against ref."""
    from kdagen.reference import rel_rmse

    ro, rs, rcs = ref
    return (rel_rmse(o[None, :, None].double(), ro), rel_rmse(S[None, None].double(), rs),
            rel_rmse(torch.stack(states)[:, None].double(), rcs[::chunk // 16]))


def chunks(C: int, *xs: torch.Tensor):
    """Per C-token chunk of the per-token tensors xs: (first token, live rows, each x's rows zero-padded to C)."""
    T = xs[0].shape[0]
    for c0 in range(0, T, C):
        rows = min(C, T - c0)
        yield c0, rows, [torch.cat([x[c0:c0 + rows], x.new_zeros(C - rows, *x.shape[1:])]) for x in xs]
