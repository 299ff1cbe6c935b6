"""The normalised call every target's launcher receives.

The runtime validates the user's tensors (once per call signature) and turns them into a
``KdaCall``: layouts become strides, varlen becomes a nullable int32 pointer, state in/out
become nullable pointers, outputs are allocated (or the caller's buffers). Launchers map this
onto their kernel's arguments and check only what their kernels add (alignment, shared memory,
workspace size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class KdaCall:
    # Input tensors exactly as the user passed them (no copies); index them with the
    # strides below. Element strides (batch, time, head) per tensor; the last
    # (feature) dimension is always contiguous (stride 1).
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    o: torch.Tensor  # output, same shape/layout/dtype as v, preallocated
    q_strides: tuple[int, int, int]
    k_strides: tuple[int, int, int]
    v_strides: tuple[int, int, int]
    g_strides: tuple[int, int, int]
    beta_strides: tuple[int, int, int]
    o_strides: tuple[int, int, int]
    B: int  # batch rows of the tensors (1 with varlen)
    T: int  # tokens per batch row (total tokens with varlen)
    N: int  # sequences (B, or len(cu_seqlens) - 1)
    H: int  # q/k heads
    HV: int  # v/g/beta heads; value head h reads q/k head h // (HV // H)
    K: int
    V: int
    cu_seqlens: Optional[torch.Tensor]  # int32 [N + 1] on the device, or None
    A_log: Optional[torch.Tensor]  # fp32 [HV] contiguous, or None (precomputed gate)
    dt_bias: Optional[torch.Tensor]  # fp32 [HV, K] contiguous, or None (= zeros)
    scale: float
    lower_bound: float  # used by the bounded gate only
    use_qk_l2norm: bool
    allow_neg_eigval: bool
    # States are contiguous [N, HV, V, K] ("VK") or [N, HV, K, V] (state_kv=True),
    # in the variant's state dtype.
    initial_state: Optional[torch.Tensor]
    final_state: Optional[torch.Tensor]  # preallocated output, or None
    state_kv: bool
    # State entering every chunk_stride-th chunk (chunks 0, m, 2m, ...): contiguous
    # [rows, HV, *state] in the state dtype (fp32 for state "none" variants); sequence n owns rows
    # chunk_offsets[n] .. chunk_offsets[n+1]-1, chunk c at row chunk_offsets[n] + c // m.
    chunk_states: Optional[torch.Tensor]
    chunk_offsets: Optional[torch.Tensor]  # int32 [N + 1] on the device, or None
    max_len: int = 0  # longest sequence (tokens), or an upper bound (T); bounds grids that tile time
    # Caller-provided scratch memory (uint8, contiguous, at least the launcher's
    # workspace_bytes(call)); None: the launcher allocates from torch's caching allocator.
    workspace: Optional[torch.Tensor] = None
    # State runs per value head (launchers with supports_twins): 2 adds, for head h, a run of the
    # same chunks with v = 0 as state head HV + h, so o, the states and the chunk states carry
    # 2 HV heads (the scan's transition maps share the prep of its from-zero maps).
    twins: int = 1
    # beta as the caller passed it: a logit (b = sigmoid(beta), x2 with allow_neg_eigval), or
    # the coefficient b itself (kda_prefill's beta_is_logit=False: fla's and the engines' call).
    beta_is_logit: bool = True
    # Chunk states kept (KdaParams::chunk_stride): every chunk_stride-th chunk's, >= 1.
    chunk_stride: int = 1
    # A state pool read and written in place (launchers with pool_indices): initial_state and
    # final_state are then the pool [P, HV, *state], and sequence n's states are at slots
    # h0_index[n] and ht_index[n] (int32 [N] on the device; -1: zeros read, nothing written).
    h0_index: Optional[torch.Tensor] = None
    ht_index: Optional[torch.Tensor] = None

    @property
    def uses_pool_slots(self) -> bool:
        """Whether the states are a state pool's slots (h0_index or ht_index given)."""
        return self.h0_index is not None or self.ht_index is not None

    @property
    def beta_mode(self) -> int:
        """How the kernels form b from beta (KdaParams.beta_mode, Triton's BETA_MODE): 0 sigmoid,
        1 twice sigmoid (negative eigenvalues), 2 beta as given."""
        return int(self.allow_neg_eigval) if self.beta_is_logit else 2
