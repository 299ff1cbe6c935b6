"""The catalogue of the mutation check (kdagen_dev/mutate.py): plausible bugs in the Triton
template, the runtime, the input checks, selection and the sm80 launcher's host-side plans, each
with the CPU tests expected to kill it.

Written as (file, exact snippet, replacement) so that an entry is retargeted by editing a string
when the code it names moves; an entry whose snippet is gone is reported as stale. `kills` are
pytest arguments (node ids); `scripts/mutate.py --suite` also runs the CPU suite on survivors.
"""

from __future__ import annotations

from .mutate import Mutation

TEMPLATE = "templates/triton/kda_fused.py.j2"
RUNTIME = "kdagen/runtime.py"
INPUTS = "kdagen/inputs.py"

# fp32 variants of specs/ci.yaml (fp32: a bug cannot hide in 16-bit rounding)
C16 = "kda_fwd_triton_c16_k32_v32_fp32_gb_sfp32_bv16"
C64 = "kda_fwd_triton_c64_k32_v32_fp32_gb_sfp32_bv16"
KV16 = "kda_fwd_triton_c16_k32_v64_fp32_gb_sfp32_bv16"  # K < V
VK16 = "kda_fwd_triton_c16_k64_v32_fp32_gb_sfp32_bv16"  # K > V
GU16 = "kda_fwd_triton_c16_k32_v32_fp32_gu_sfp32_bv16"
BF16_SBF16 = "kda_fwd_triton_c16_k32_v32_bf16_gb_sbf16_bv16"


def path(case: str, *variants: str) -> tuple[str, ...]:
    return tuple(f"tests/test_kernels.py::test_paths[{v}-{case}-cpu]" for v in variants)


def shape(case: str, *variants: str) -> tuple[str, ...]:
    return tuple(f"tests/test_kernels.py::test_shapes[{v}-{case}-cpu]" for v in variants)


def gates(case: str, *variants: str) -> tuple[str, ...]:
    return tuple(f"tests/test_kernels.py::test_gates[{v}-{case}-cpu]" for v in variants)


def errors(*ids: str) -> tuple[str, ...]:
    return tuple(f"tests/test_runtime_errors.py::{i}" for i in ids)


BAD_CALLS = "tests/test_runtime_errors.py::test_bad_call_messages"

M = Mutation
CATALOGUE: list[Mutation] = [
    # ------------------------------------------------------------------ Triton template
    M("kv_state_offset_k_for_v", TEMPLATE, "s_off = kk[:, None] * V + vv[None, :]",
      "s_off = kk[:, None] * K + vv[None, :]", shape("varlen_bnsd_kv", KV16, VK16),
      "[K, V] state offset with K where V belongs (issue 23 survivor: every variant had K == V)"),
    M("k_loaded_with_q_strides", TEMPLATE, "k = tl.load(k_ptr + b * skb + t[:, None] * skt + hq * skh",
      "k = tl.load(k_ptr + b * sqb + t[:, None] * sqt + hq * sqh", path("fused_varlen", C16),
      "k read with q's strides (issue 23 survivor: q and k always had equal strides)"),
    M("v_head_from_qk_head", TEMPLATE, "v_ptr + b * svb + t[:, None] * svt + h * svh",
      "v_ptr + b * svb + t[:, None] * svt + hq * svh", path("gva_hv4", C16), "wrong head map for v"),
    M("g_head_from_qk_head", TEMPLATE, "g_ptr + b * sgb + t[:, None] * sgt + h * sgh",
      "g_ptr + b * sgb + t[:, None] * sgt + hq * sgh", path("gva_hv4", C16), "wrong head map for g"),
    M("beta_head_from_qk_head", TEMPLATE, "beta_ptr + b * sbb + t * sbt + h * sbh",
      "beta_ptr + b * sbb + t * sbt + hq * sbh", path("gva_hv4", C16), "wrong head map for beta"),
    M("gqa_head_map_modulo", TEMPLATE, "    hq = h // (HV // H)\n    bos, eos, b, flat = _sequence(cu_ptr, n, T, IS_VARLEN)\n    t0",
      "    hq = h % H\n    bos, eos, b, flat = _sequence(cu_ptr, n, T, IS_VARLEN)\n    t0", path("gva_hv4", C16),
      "value heads grouped round-robin instead of in blocks"),
    M("dt_bias_head_from_qk_head", TEMPLATE, "dt_bias_ptr + h * K + kk", "dt_bias_ptr + hq * K + kk",
      path("gva_hv4", C16), "wrong head map for dt_bias"),
    M("a_log_head_from_qk_head", TEMPLATE, "tl.load(a_log_ptr + h)", "tl.load(a_log_ptr + hq)",
      path("gva_hv4", C16), "wrong head map for A_log"),
    M("v_time_stride_from_g", TEMPLATE, "t[:, None] * svt + h * svh", "t[:, None] * sgt + h * svh",
      shape("ragged", KV16), "v indexed with g's time stride (equal when K == V and both contiguous)"),
    M("neumann_drops_last_factor", TEMPLATE,
      '    P = _mm(P, P, tl.zeros([16, 16], tl.float32), "ieee", EMU)\n    A = _mm(A, P, A, "ieee", EMU)\n    return A',
      "    return A", path("ill_conditioned", C16),
      "(I + L)^-1 without its (I + L^8) factor (issue 23: 1e-7 on random keys)"),
    M("block_substitution_skips_a_block", TEMPLATE, "        for s in range(0, r):\n",
      "        for s in range(0, r - 1):\n", path("ill_conditioned", C64),
      "chunk-64 block forward substitution misses the sub-block just above (its L and Mqk block too)"),
    M("l_drops_beta", TEMPLATE, "Ld = tl.where(rows[:, None] > rows[None, :], Ld * bt[:, None], 0.0)",
      "Ld = tl.where(rows[:, None] > rows[None, :], Ld, 0.0)", shape("ragged", C16), "dropped factor b_i in L"),
    M("mqk_drops_scale", TEMPLATE, "Md = tl.where(rows[:, None] >= rows[None, :], Md * scale, 0.0)",
      "Md = tl.where(rows[:, None] >= rows[None, :], Md, 0.0)", shape("ragged", C16),
      "dropped factor scale in Mqk's diagonal blocks"),
    M("qd_drops_scale", TEMPLATE, "_to_ws(Qa * (ec * scale)[None, :], EMU)", "_to_ws(Qa * ec[None, :], EMU)",
      shape("ragged", C16), "dropped factor scale in Qd"),
    M("mqk_drops_diagonal", TEMPLATE, "Md = tl.where(rows[:, None] >= rows[None, :], Md * scale, 0.0)",
      "Md = tl.where(rows[:, None] > rows[None, :], Md * scale, 0.0)", shape("ragged", C16),
      "Mqk strictly lower (the token's own update missing from o)"),
    M("pairwise_decay_off_by_one", TEMPLATE, "D = tl.cumsum(tl.where(r[:, None] > j, a, 0.0), axis=0)",
      "D = tl.cumsum(tl.where(r[:, None] >= j, a, 0.0), axis=0)", shape("ragged", C16),
      "exact diagonal decay exp(G_i - G_j) summed from j instead of j + 1"),
    M("kr_suffix_off_by_one", TEMPLATE, "tri_gt = tl.where(rows[None, :] > rows[:, None], 1.0, 0.0)",
      "tri_gt = tl.where(rows[None, :] >= rows[:, None], 1.0, 0.0)", shape("ragged", C16),
      "Gamma_C / Gamma_j including step j (suffix sum off by one)"),
    M("state_not_decayed_between_chunks", TEMPLATE, "St = _mm(KrT, Ub, St * gam[:, None],",
      "St = _mm(KrT, Ub, St,", shape("ragged", C16), "dropped factor Gamma_C on the carried state"),
    M("padded_rows_decay", TEMPLATE, "a = tl.where(mk, a, 0.0)", "a = a", shape("ragged", C16),
      "the rows past a sequence's end decay the state (gate of g = 0 is not 0)"),
    M("neg_eigval_ignored", TEMPLATE, "bt = _sigmoid(beta) * (1.0 + BETA_MODE)", "bt = _sigmoid(beta)",
      path("neg_eigval", C16), "allow_neg_eigval ignored"),
    M("beta_prob_taken_as_logit", TEMPLATE, "            bt = beta\n", "            bt = _sigmoid(beta)\n",
      path("beta_prob", C16), "beta_is_logit=False ignored: b run through the sigmoid once more"),
    M("l2norm_flag_ignored", TEMPLATE, "if USE_L2NORM:", "if True:", path("no_l2norm", C16),
      "use_qk_l2norm=False ignored"),
    M("k_not_normalised", TEMPLATE, "k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6))[:, None]", "k = k",
      shape("ragged", C16), "k not L2-normalised"),
    M("bounded_gate_fixed_bound", TEMPLATE, "a = lower_bound * _sigmoid(", "a = -5.0 * _sigmoid(",
      path("lower_bound_-2", C16), "the kernel's bounded gate at a fixed -5"),
    M("softplus_sign", TEMPLATE, "tl.log(1.0 + tl.exp(-tl.abs(x)))", "tl.log(1.0 + tl.exp(-x))",
      shape("ragged", GU16), "softplus wrong for negative arguments (unbounded gate)"),
    M("chunk_state_stride_v_for_k", TEMPLATE, "cs_base = ((cs_first + c) * HV + h) * V * K",
      "cs_base = ((cs_first + c) * HV + h) * V * V", shape("varlen_bnsd_kv", VK16, KV16),
      "chunk-state record size with V where K belongs"),
    M("varlen_end_off_by_one", TEMPLATE, "eos = tl.load(cu_ptr + n + 1).to(tl.int64)",
      "eos = tl.load(cu_ptr + n + 1).to(tl.int64) - 1", shape("varlen_bnsd_kv", C16),
      "off-by-one in the varlen offsets: each sequence's last token dropped"),
    M("initial_state_ignored", TEMPLATE, "    if HAS_H0:\n", "    if False:\n", shape("ragged", C16),
      "initial state not read"),
    M("final_state_not_written", TEMPLATE, "    if HAS_HT:\n", "    if False:\n", shape("ragged", C16),
      "final state never stored (poisoned outputs show it)"),
    M("launch_dt_flag_from_a_log", TEMPLATE, "int(call.dt_bias is not None), int(call.use_qk_l2norm)",
      "int(call.A_log is not None), int(call.use_qk_l2norm)", path("no_dt_bias", C16),
      "the dt_bias flag taken from A_log's presence (issue 23 survivor: dt_bias was always given)"),
    M("launch_state_kv_dropped", TEMPLATE, "int(call.chunk_states is not None), int(call.state_kv),",
      "int(call.chunk_states is not None), int(False),", shape("varlen_bnsd_kv", C16), "[K, V] states read as [V, K]"),
    M("launch_grid_k_for_v", TEMPLATE, "kda_recur_kernel[(triton.cdiv(HEAD_V, BLOCK_V), call.N, call.HV)]",
      "kda_recur_kernel[(triton.cdiv(HEAD_K, BLOCK_V), call.N, call.HV)]", shape("ragged", KV16, VK16),
      "V-split grid sized by K (half of V unwritten when K < V)"),
    M("launch_o_strides_from_v", TEMPLATE, "ws, gam, call.o, *call.o_strides,", "ws, gam, call.o, *call.v_strides,",
      path("fused_varlen", C16), "o written with v's strides (equal when v is contiguous)"),
    M("launch_h_for_hv", TEMPLATE, "call.T, call.H, call.HV, float(call.scale)",
      "call.T, call.HV, call.HV, float(call.scale)", shape("ragged", C16), "GQA ignored: H passed as HV"),
    # ------------------------------------------------------------------ runtime
    M("runtime_fixed_lower_bound", RUNTIME,
      'self.lower_bound = float(kw["lower_bound"]) if kw["lower_bound"] is not None else 0.0',
      "self.lower_bound = -5.0", path("lower_bound_-2", C16),
      "a fixed -5 instead of the caller's lower_bound (issue 23 survivor: always -5 in the tests)"),
    M("runtime_scale_ignored", RUNTIME, 'self.scale = float(kw["scale"]) if kw["scale"] is not None else info.K ** -0.5',
      "self.scale = info.K ** -0.5", path("custom_scale", C16), "the caller's scale ignored"),
    M("runtime_default_scale_from_v", RUNTIME, "else info.K ** -0.5", "else info.V ** -0.5", shape("ragged", KV16),
      "default scale 1/sqrt(V) instead of 1/sqrt(K)"),
    M("runtime_k_strides_from_q", RUNTIME, "_strides(q, lay), _strides(k, lay)", "_strides(q, lay), _strides(q, lay)",
      path("fused_varlen", C16), "k's strides taken from q"),
    M("runtime_g_strides_from_v", RUNTIME, "_strides(v, lay), _strides(g, lay)", "_strides(v, lay), _strides(v, lay)",
      path("fused_varlen", C16), "g's strides taken from v (equal when K == V and both contiguous)"),
    M("runtime_bnsd_strides_swapped", RUNTIME, "return t.stride(0), t.stride(2), t.stride(1)",
      "return t.stride(0), t.stride(1), t.stride(2)", shape("varlen_bnsd_kv", C16) + path("fused_bnsd", C16),
      "BNSD strides read as BSND (swapped layout)"),
    M("runtime_chunk_offsets_off_by_one", RUNTIME, "offs.append(offs[-1] + -(-(b - a) // C))",
      "offs.append(offs[-1] + (b - a) // C + 1)", path("fused_varlen", C16),
      "off-by-one in the chunk-state offsets (sequences of whole chunks get one too many)"),
    M("runtime_l2norm_forced", RUNTIME, 'self.use_l2 = bool(kw["use_qk_l2norm"])', "self.use_l2 = True",
      path("no_l2norm", C16), "use_qk_l2norm ignored"),
    M("runtime_beta_form_dropped", RUNTIME, 'self.beta_logit = bool(kw["beta_is_logit"])', "self.beta_logit = True",
      path("beta_prob", C16), "beta_is_logit=False not passed to the kernel"),
    M("runtime_neg_eigval_dropped", RUNTIME, 'self.neg_eig = bool(kw["allow_neg_eigval"])', "self.neg_eig = False",
      path("neg_eigval", C16), "allow_neg_eigval ignored"),
    M("runtime_dt_bias_dropped", RUNTIME, "            if dt_bias is not None:\n",
      "            if False:\n", shape("ragged", C16), "dt_bias never passed to the kernel"),
    M("runtime_a_log_bounded_only", RUNTIME, "        if not self.precomputed:\n            A = A_log",
      '        if self.info.gate == "bounded":\n            A = A_log', shape("ragged", GU16),
      "A_log (and dt_bias) dropped for the unbounded gate"),
    M("runtime_state_kv_dropped", RUNTIME, 'self.state_kv = kw["state_layout"] == "KV"', "self.state_kv = False",
      shape("varlen_bnsd_kv", C16), "[K, V] state layout ignored"),
    M("runtime_state_shape_swapped", RUNTIME, "st = (info.K, info.V) if self.state_kv else (info.V, info.K)",
      "st = (info.V, info.K) if self.state_kv else (info.K, info.V)",
      tuple(f"tests/test_kernels.py::test_runtime_allocated_outputs[{v}]" for v in (KV16,)),
      "the states it allocates in the other layout (the same shape when K == V)"),
    M("runtime_initial_state_ignored", RUNTIME, "h = h0 if self.h0_ready else h0.contiguous()",
      "h = None", shape("ragged", C16), "initial state not passed on"),
    # ------------------------------------------------------------------ input checks
    M("inputs_hv_multiple_unchecked", INPUTS, "    if HV % H:\n", "    if False:\n", (BAD_CALLS,),
      "HV not a multiple of H accepted"),
    M("inputs_cu_end_unchecked", INPUTS, "cu[-1] != T", "cu[-1] > T", (BAD_CALLS,),
      "cu_seqlens ending before T accepted"),
    M("inputs_lower_bound_range_narrow", INPUTS, "-1e4 < float(lower_bound) <= 0", "-10 < float(lower_bound) <= 0",
      path("lower_bound_-20", C16), "a valid lower_bound (-20) refused"),
    M("inputs_dt_bias_size_from_v", INPUTS, "dt_bias.numel() != HV * K", "dt_bias.numel() != HV * V",
      shape("ragged", KV16), "dt_bias checked against V (valid inputs refused when K != V)"),
    M("inputs_g_shape_from_v", INPUTS, '("g", g, want(B, T, HV, K), "HV", "K")', '("g", g, want(B, T, HV, V), "HV", "K")',
      shape("ragged", KV16), "g's shape checked against V"),
    M("inputs_gate_inference_swapped", INPUTS, 'return "unbounded" if lower_bound is None else "bounded"',
      'return "bounded" if lower_bound is None else "unbounded"', shape("ragged", C16),
      "gate form inferred the wrong way round"),
    M("inputs_state_dtype_ignored", INPUTS, "state = dtype_name(given[0][1])", 'state = "fp32"',
      shape("ragged", BF16_SBF16), "a bf16 initial state selects an fp32-state variant"),
    M("inputs_feature_stride_unchecked", INPUTS, "if t.stride(-1) != 1:", "if False:", (BAD_CALLS,),
      "a non-contiguous feature dimension accepted"),
    M("inputs_varlen_batch_unchecked", INPUTS, "        if B != 1:\n", "        if False:\n",
      errors("test_varlen_needs_batch_one"), "cu_seqlens with B > 1 accepted"),
    # ------------------------------------------------------------------ selection
    M("select_head_dims_k_only", "kdagen/select.py", "if (v.k, v.v) != (c.K, c.V):", "if v.k != c.K:",
      ("tests/test_select.py::test_rejection_reasons", "tests/test_kernels.py::test_auto_selection_matches_k_and_v"),
      "a variant accepted for a call whose V differs"),
    # ------------------------------------------------------------------ sm80 launcher (host-side plans)
    M("sm80_segments_not_whole_chunks", "kdagen/targets/sm80.py", "step = -(-step // unit) * unit",
      "step = -(-step // 16) * 16", ("tests/test_sm80.py::test_sm80_time_segments_plan",),
      "segment boundaries off the 64-token grid (chunking would differ from the one-piece call)"),
    M("sm80_segments_off_chunk_state_grid", "kdagen/targets/sm80.py",
      "unit = 64 if call.chunk_states is None else", "unit = 64 if True else",
      ("tests/test_sm80.py::test_sm80_time_segments_plan",),
      "segments cut between kept chunk states (a segment's rows would restart off the sequence's grid)"),
    M("sm80_segment_chunk_rows_unshifted", "kdagen/targets/sm80.py", "return [a // spacing * row for a, _ in segs]",
      "return [0 for a, _ in segs]",
      ("tests/test_fastpath.py::test_sm80_segmented_bound_launch_passes_the_general_paths_launches"
       "[batch-chunk-states-every-4th]",),
      "every time segment writes its chunk states from the first row (each overwrites the last's)"),
    M("sm80_recur_smem_margin_dropped", "kdagen/targets/sm80.py", "- k * (smem1 + per_block) - smem1 // 2",
      "- k * (smem1 + per_block)", ("tests/test_sm80.py::test_sm80_recur_shared_memory_leaves_room_for_k_prep_blocks",),
      "the shared-memory claim lets k + 1 prep blocks fit beside a recurrence block"),
    # ------------------------------------------------------------------ context parallelism (kdagen/cp.py)
    M("cp_zigzag_back_slot_owner", "kdagen/cp.py",
      "return (slot, 0) if slot < self.world else (2 * self.world - 1 - slot, 1)",
      "return (slot % self.world, slot // self.world)",
      ("tests/test_cp.py::test_zigzag_context_holds_two_slots",
       "tests/test_cp.py::test_gloo_ranks_equal_the_single_process_call[kdagen-2]"),
      "a zigzag back slot's map read from the wrong rank (as if rank r held slots r and W + r)"),
    M("cp_chain_last_slot_only", "kdagen/cp.py", "for slot in p.chain:", "for slot in p.chain[-1:]:",
      ("tests/test_cp.py::test_gloo_ranks_equal_the_single_process_call[kdagen-2]",),
      "a piece's entering state from the slot just before it only (right where a sequence spans two slots)"),
    M("cp_fla_chain_off_by_one", "kdagen/cp.py", "tuple(range(slot - pre, slot)) if incoming",
      "tuple(range(slot - pre + 1, slot)) if incoming",
      ("tests/test_cp.py::test_fla_contexts_give_the_same_pieces",),
      "fla's pre_num_ranks read as the slots before, counting this one"),
    M("cp_pool_reads_the_ends", "kdagen/cp.py", "torch.tensor([host[n] for n in ctx.starts], dtype=torch.long)",
      "torch.tensor([host[n] for n in ctx.ends], dtype=torch.long)",
      ("tests/test_cp.py::test_gloo_ranks_equal_the_single_process_call[kdagen-3]",),
      "a rank's initial states read from the slots of the sequences ending on it, not starting"),
    M("cp_pool_scatter_dropped", "kdagen/cp.py", "    pool_io.scatter(rows_out)\n", "",
      ("tests/test_cp.py::test_gloo_ranks_equal_the_single_process_call[kdagen-2]",),
      "final states left in scratch, the ranks' pools never written"),
    M("cp_pool_replicas_not_reduced", "kdagen/cp.py", "    dist.all_reduce(t, group=ctx.group)\n", "",
      ("tests/test_cp.py::test_gloo_ranks_equal_the_single_process_call[kdagen-2]",),
      "replicated pools and checkpoints given only this rank's rows (zeros for the others)"),
    M("cp_ckpt_rows_per_piece_from_zero", "kdagen/cp.py", "        base += -(-n_tok // spacing)\n", "",
      ("tests/test_cp.py::test_gloo_ranks_equal_the_single_process_call[kdagen-2]",),
      "a rank's checkpoints read from its first piece's chunk states whichever piece holds them"),
    M("cp_ckpt_replicas_by_buffer_row", "kdagen/cp.py", "dst=[idx(rows) for rows in owned]",
      "dst=[idx(rows) for rows in owned[::-1]]",
      ("tests/test_cp.py::test_gloo_ranks_equal_the_single_process_call[kdagen-2]",),
      "replicated checkpoints gathered from one rank written to the rows of another's"),
    M("cp_ckpt_owner_token_before", "kdagen/cp.py", "tok = ctx.cu[n] + (pos if pos < L else L - 1)",
      "tok = ctx.cu[n] + pos - 1",
      ("tests/test_cp.py::test_gloo_ranks_equal_the_single_process_call[kdagen-2]",),
      "a checkpoint on a slot boundary owned by the rank before it (the last token before, not the one it enters)"),
    M("cp_ckpt_row_ignores_stride", "kdagen/cp.py", "rows = _checkpoint_rows(ctx, lens, offs, every, C * m, q.device)",
      "rows = _checkpoint_rows(ctx, lens, offs, every, C, q.device)",
      ("tests/test_cp.py::test_gloo_ranks_equal_the_single_process_call[kdagen-2]",),
      "a checkpoint inside a piece read from the row it would have with every chunk's state kept"),
    M("cp_ckpt_chunk_first_fit", "kdagen/cp.py",
      "C = _planned_chunk(q, k, v, g, beta, ctx, kw, fits) if len(fits) > 1 else fits[0]", "C = fits[0]",
      ("tests/test_cp.py::test_gloo_ranks_equal_the_single_process_call[kdagen-2]",),
      "checkpoints on a context run chunk 64 where the call without them runs the planned chunk 16"),
    M("cp_ckpt_stride_ignores_cuts", "kdagen/cp.py", "if n % d == 0 and _off_grid(ctx, chunk * d) is None)",
      "if n % d == 0)",
      ("tests/test_cp.py::test_checkpoints_keep_the_coarsest_chunk_states_the_slots_allow",),
      "checkpoints keep every / chunk-th state even where a slot cuts a sequence off that grid"),
    M("cp_stride_segments_per_chunk", "kdagen/cp.py", "align = (C or 64) * stride", "align = (C or 64)",
      ("tests/test_cp.py::test_gloo_ranks_equal_the_single_process_call[kdagen-2]",),
      "a piece's scan segments cut off the kept rows' grid (each segment's rows restart on its own)"),
    M("cp_stride_grid_checked_per_chunk", "kdagen/cp.py", "cut = _off_grid(ctx, C * stride) if", "cut = _off_grid(ctx, C) if",
      ("tests/test_cp.py::test_call_errors_are_named",),
      "strided chunk states let slots cut sequences between kept rows (each piece's rows on its own grid)"),
    M("stride_rows_ignore_stride", RUNTIME, "C, N, dev = self.C * self.chunk_stride, self.info.N, self.device",
      "C, N, dev = self.C, self.info.N, self.device",
      ("tests/test_kernels.py::test_chunk_state_stride[kda_fwd_triton_c16_k32_v32_bf16_gb_sbf16_bv16-cpu]",),
      "strided chunk states get a row per chunk (offsets that skip rows the kernel never writes)"),
    M("stride_triton_copy_off_by_one", "kdagen/targets/triton.py", "src = every[nc] + (r - kept[nc]) * m",
      "src = every[nc] + (r - kept[nc]) * m + 1",
      ("tests/test_kernels.py::test_chunk_state_stride[kda_fwd_triton_c64_k32_v32_bf16_gb_sfp32_bv16-cpu]",),
      "the Triton target keeps the states entering chunks 1, m + 1, ... instead of 0, m, ..."),
    M("stride_twin_row_per_chunk", "templates/triton/kda_twostage.py.j2", "ci = tl.load(cs_off + n) + cq // cs_stride",
      "ci = tl.load(cs_off + n) + cq",
      ("tests/test_ascend.py::test_twin_chunk_state_stride",),
      "the twin writes strided chunk states at a row per chunk"),
    M("checkpoints_rows_at_kernel_chunk", RUNTIME, "chunk=chunk * stride, buffer=checkpoints",
      "chunk=chunk, buffer=checkpoints",
      ("tests/test_checkpoints.py::test_checkpoints_run_the_plain_calls_kernel_keeping_one_state_each",),
      "checkpoint rows placed on the kernel chunk's grid while the kernel kept every m-th chunk state"),
    M("checkpoints_final_from_chunk_rows", "kdagen/checkpoints.py",
      "(kept + n for n in flat[b:c])", "(n for n in flat[b:c])",
      ("tests/test_checkpoints.py::test_checkpoints_run_the_plain_calls_kernel_keeping_one_state_each",),
      "a checkpoint at a sequence's end gathered from the chunk states, not from the final states stacked after them"),
    M("checkpoints_pool_scatters_stale_finals", RUNTIME, "pc.final_state = call_kw[\"final_state\"]", "pass",
      ("tests/test_checkpoints.py::test_checkpoints_with_a_state_pool_gather_from_the_stacked_final_states",),
      "the kernel writes the final states into the stacked tensor but the pool's scatter reads its own scratch"),
    M("checkpoints_caller_offsets_packed", "kdagen/checkpoints.py", "packed = buffer is None and offsets is None",
      "packed = buffer is None",
      ("tests/test_checkpoints.py::test_checkpoints_equal_the_chunk_states_at_those_positions",
       "tests/test_checkpoints.py::test_plan_reuses_the_index_rows_of_a_layout_and_follows_the_offsets"),
      "checkpoints gathered in order into a new buffer although the caller's offsets place them elsewhere"),
    M("route_per_call_short_batches_scanned", "kdagen/scan/route.py",
      "or (per_call and longest(cu_cpu) < MIN_TOKENS)", "or (per_call and longest(cu_cpu) < 0)",
      ("tests/test_scan_route.py::test_several_sequences_route_per_call[cpu]",),
      "an engine's batch of short sequences pays the scan's planning and validation on every call"),
    M("route_probe_at_first_offsets", "kdagen/scan/route.py", "[0, info.T], mode=MODE,",
      "info.cu_seqlens_host, mode=MODE,",
      ("tests/test_scan_route.py::test_several_sequences_are_offered_where_one_of_all_tokens_would_be_cut",),
      "a varlen signature offered by its first call's offsets, which later calls of the signature need not share"),
    M("stride_scan_cuts_off_grid", "kdagen/scan/engine.py", "align = (kw.get(\"chunk_size\") or 64) * stride",
      "align = kw.get(\"chunk_size\") or 64",
      ("tests/test_scan_engine.py::test_chunk_state_stride_cuts_segments_on_its_grid[correct]",),
      "the scan cuts segments between kept chunk states, so a segment's rows are not its sequence's"),
    M("stride_scan_correct_rows", "kdagen/scan/engine.py", "C = C * P.cs_stride if C else C",
      "C = C",
      ("tests/test_scan_engine.py::test_chunk_state_stride_cuts_segments_on_its_grid[correct]",),
      "the correct step adds S_in A_c to a row per chunk while the runs kept every m-th"),
]

# What CI runs (tests/test_mutations.py): the four survivors issue 23 names and one bug of each
# other kind, each killed by a single fast test.
SAMPLE = (
    "kv_state_offset_k_for_v",
    "k_loaded_with_q_strides",
    "launch_dt_flag_from_a_log",
    "runtime_fixed_lower_bound",
    "neumann_drops_last_factor",
    "gqa_head_map_modulo",
    "runtime_chunk_offsets_off_by_one",
    "inputs_hv_multiple_unchecked",
)


def by_name(names) -> list[Mutation]:
    table = {m.name: m for m in CATALOGUE}
    return [table[n] for n in names]
