// kdagen sm90: the prep group as two pipelined 4-warp groups (K = 128 unless KDA_SM90_PREP_PIPE=0;
// templates/sm90/DESIGN.md "Prep pipeline"), built from the phase functions of kda_sm90_prep.cuh:
// per element the arithmetic is the one-group prep's, so o is bitwise the same.
#pragma once
#include "kda_sm90_prep.cuh"

namespace kda {

// Two 4-warp groups pipelined by chunk. Group A (warps 0-3) runs phases 0-1 of chunk c in two
// passes over the rows (8 p .. 8 p + 7) and gate columns (64 p ..), so each element's arithmetic is
// the one-group prep's; group B (warps 4-7) runs phases 2-5 of chunk c (A is by then on chunk
// c + 1) and issues the bulk copies (PIPE_COPIES). The scratch arrays between them are doubled by
// chunk parity: A waits scr_empty (B has finished chunk c - 2 with the set), B waits scr_full.
// rec_full counts both groups.
constexpr int NTG = 128;                 // threads per group
// KDA_SM90_PIPE_ROLL=1: group A's two phase-1 passes as a loop instead of unrolled (ncu had a quarter
// of the samples no_instruction). Default at bv128, not in the pair (H200 2026-12-01: bv128 T8192 H96
// 1.84 -> 1.60 ms, -9..-13% on four rows; the pair's groups A and B +4-5%; phase 0 rolled too: +5% in the pair,
// and it spilled at bv128). DUAL: unrolled again since its groups have 160 registers (H200 2026-12-03, with the
// consumers at 160: the pair -2..-5% on three of four rows, varlen H96 flat; rolled, it had paid at 144 registers).
#ifdef KDA_SM90_PIPE_ROLL
constexpr int PIPE_ROLL = KDA_SM90_PIPE_ROLL;
#else
constexpr int PIPE_ROLL = NCONS == 2 ? 1 : 0;
#endif
static_assert(PIPE_ROLL == 0 || PIPE_ROLL == 1, "KDA_SM90_PIPE_ROLL is 0 or 1");
constexpr int BAR_PREP_A = 1, BAR_PREP_B = 2;
// KDA_SM90_NOPREP=bits (diagnostic, wrong results; 1: phases 0-1, 2: phase 2, 4: 3, 8: 4, 16: 5): the prep groups skip
// those phases and keep every wait, barrier, arrival, fence and the record's forward, so 23 runs at the pace of the
// consumers, copies and protocol: what a free prep would leave (H200 2026-12-03: -21% on every row). Bit 8 made ptxas
// serialize the consumers' wgmma (C7511) in every combination tried.
#ifdef KDA_SM90_NOPREP
constexpr int NOPREP_MODE = KDA_SM90_NOPREP;
#else
constexpr int NOPREP_MODE = 0;
#endif
constexpr bool NOPREP_A = NOPREP_MODE & 1, NOPREP_P2 = NOPREP_MODE & 2, NOPREP_P3 = NOPREP_MODE & 4,
               NOPREP_P4 = NOPREP_MODE & 8, NOPREP_P5 = NOPREP_MODE & 16;
static_assert(NTP == 2 * NTG && NMW == 4 && NIN >= 3, "prep pipeline: K = 128, NIN >= 3");
// PAIR_CW: the copy warpgroup (warps 8-11). Local chunk j's q, k, g go into stage j % NIN once group B's phase 2
// of chunk j - NIN released it (in_empty: B's phase 2 of a chunk follows group A's phases 0-1 of it, the stage's
// other reader); global chunks 2 j, 2 j + 1's v into their V stages once the consumers loaded chunk 2 j - NV's
// (v_empty). Lookahead: NIN local chunks of q, k, g, NV global chunks of v.
#ifdef KDA_SM90_CW_REGS
constexpr int CW_REGS = KDA_SM90_CW_REGS;
#else
// (DUAL: 24, so that each prep group gets 144; H200 2026-12-02, with phase 1 rolled: B4 T4096 H32 and varlen H96
// -3..-5%, the other rows within noise)
constexpr int CW_REGS = DUAL ? 24 : 40;
#endif
__device__ __forceinline__ void copy_role_pair(const KdaParams& p, const SeqInfo& si, char* base, uint64_t* bars) {
  const int w = (threadIdx.x - NTP) >> 5, lane = threadIdx.x & 31;
  const int nl = nlocal(si);
  // (v copies further ahead than local chunk j's q, k, g measured slower: H200 2026-12-03, 1-4 local chunks +0..+6%)
  for (int j = 0; j < nl || 2 * j < si.nc; ++j) {
    if (j < nl) {
      sm90::mbar_wait(bars + B_IN_EMPTY + j % NIN, ((j / NIN) & 1) ^ 1);
      issue_qkg<4>(p, si, j, base, bars, w, lane);
    }
    issue_v<4>(p, si, 2 * j, base, bars, w, lane);
    issue_v<4>(p, si, 2 * j + 1, base, bars, w, lane);
  }
}

// Phases 0-1 of local chunk c by one 4-warp group (tid: 0 .. 127 within it; BAR its named barrier): two passes
// over the rows (8 p .. 8 p + 7) and gate columns (col0 + 64 p). The caller waited for the slot and the inputs.
template <int BAR>
__device__ __forceinline__ void group_a_chunk(const KdaParams& p, const SeqInfo& si, char* base, int c, int rows, int ri,
                                              int d, int col0, int half, uint32_t rb0, uint32_t rb1, float aexp,
                                              float bias0, float bias1) {
  const int col1 = col0 + 16 * 4;
  float xq0[8], xk0[8], b0, xq1[8], xk1[8], b1;
  {
    const P0In ld0 = prep_phase0_load(p, base, c, ri, d, col0, half);
    const P0In ld1 = prep_phase0_load(p, base, c, ri + 8, d, col1, half);
    prep_phase0(p, base, c, rows, ri, d, col0, half, rb0, aexp, bias0, ld0, xq0, xk0, b0);
    prep_phase0(p, base, c, rows, ri + 8, d, col1, half, rb1, aexp, bias1, ld1, xq1, xk1, b1);
  }
  sm90::named_sync<BAR, NTG>();
  KDA_STAMP(threadIdx.x % NTG == 0, KDA_GCHUNK(si, c), ST_A_P0);
  if constexpr (PIPE_ROLL) {
    float GL[8];
    prep_gate_row(base, c, C - 1, d, GL);
#pragma unroll 1
    for (int pp = 0; pp < 2; ++pp) {
      float xq[8], xk[8], G[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        xq[e] = pp ? xq1[e] : xq0[e];
        xk[e] = pp ? xk1[e] : xk0[e];
      }
      prep_gate_row(base, c, ri + 8 * pp, d, G);
      prep_phase1(p, base, c, ri + 8 * pp, d, xq, xk, pp ? b1 : b0, G, GL);
    }
  } else {
    // (pass 1's row read after pass 0's stores: reading both first spilled at a 96-register limit
    // and measured no faster)
    float G[8], GL[8];
    prep_gate_row(base, c, ri, d, G);
    prep_gate_row(base, c, C - 1, d, GL);
    prep_phase1(p, base, c, ri, d, xq0, xk0, b0, G, GL);
    prep_gate_row(base, c, ri + 8, d, G);
    prep_phase1(p, base, c, ri + 8, d, xq1, xk1, b1, G, GL);
  }
}

// What a thread of a group running phases 0-1 keeps across chunks (tid: 0 .. 127 within the group): its row ri
// (pass pp: ri + 8 pp), columns d .. d + 7, gate column col0 (pass pp: + 64 pp) and that column's gate constants, and
// beta of its two rows for the group's next chunk.
struct ARows {
  int ri, d, half, col0;
  float aexp, bias0, bias1;
  uint32_t rb0, rb1;
};
__device__ __forceinline__ ARows a_rows(const KdaParams& p, const SeqInfo& si, int tid, int c0) {
  constexpr int GPR = K / 8;
  const int lane = tid & 31, warp = tid >> 5;
  ARows a;
  a.ri = tid / GPR;
  a.d = (tid % GPR) * 8;
  a.half = lane >> 4;
  a.aexp = gate_aexp(p, si);
  a.col0 = (lane & 15) + 16 * warp;
  a.bias0 = gate_bias(p, si, a.col0);
  a.bias1 = gate_bias(p, si, a.col0 + 16 * 4);
  a.rb0 = load_beta(p, si, KDA_GCHUNK(si, c0), a.ri);
  a.rb1 = load_beta(p, si, KDA_GCHUNK(si, c0), a.ri + 8);
  return a;
}

// Phases 0-1 of local chunk c with their waits (the scratch set with SCR, the record slot, the inputs) and
// arrivals (rec_full; scr_full with SCR); beta then loads for chunk c + STEP, the group's next.
template <int BAR, int STEP, bool SCR>
__device__ __forceinline__ void group_a_step(const KdaParams& p, const SeqInfo& si, char* base, uint64_t* bars,
                                             int tid, ARows& a, int c, int rows) {
  const uint32_t rb0 = a.rb0, rb1 = a.rb1;
  const int r = c % NREC, h = c & 1;
  KDA_STAMP(tid == 0, KDA_GCHUNK(si, c), ST_A_WAIT);
  // The scratch set is free once B finished chunk c - 2 with it.
  if constexpr (SCR) sm90::mbar_wait(bars + B_SCR_EMPTY + h, ((c >> 1) & 1) ^ 1);
  // The record slot is free once the consumers finished chunk c - NREC with it; then the inputs.
  // (in the pair also the peer's consumers, with remote arrivals)
  sm90::mbar_wait(bars + B_REC_EMPTY + r, ((c / NREC) & 1) ^ 1);
  sm90::mbar_wait(bars + B_IN_FULL + (c % NIN), (c / NIN) & 1);
  KDA_STAMP(tid == 0, KDA_GCHUNK(si, c), ST_A_GO);
  if constexpr (!NOPREP_A)
    group_a_chunk<BAR>(p, si, base, c, rows, a.ri, a.d, a.col0, a.half, rb0, rb1, a.aexp, a.bias0, a.bias1);
  // beta one chunk ahead, loaded here (not at the top) so that it is not live across phase 1
  a.rb0 = load_beta(p, si, KDA_GCHUNK(si, c + STEP), a.ri);
  a.rb1 = load_beta(p, si, KDA_GCHUNK(si, c + STEP), a.ri + 8);
  // Qd, Kr, Gamma_C of the record: visible to the consumers' wgmma (async proxy).
  sm90::fence_proxy_async();
  KDA_STAMP(tid == 0, KDA_GCHUNK(si, c), ST_A_DONE);
  sm90::mbar_arrive(bars + B_REC_FULL + r);
  if constexpr (SCR) sm90::mbar_arrive(bars + B_SCR_FULL + h);
}

// Group A (tid: 0 .. 127 within the group; BAR its named barrier).
template <int BAR>
__device__ __forceinline__ void prep_group_a(const KdaParams& p, const SeqInfo& si, char* base, uint64_t* bars,
                                             int tid) {
  const int lane = tid & 31, warp = tid >> 5;
  ARows a = a_rows(p, si, tid, 0);
  // Copies: chunk cc needs its input stage released by B's phase 2 of chunk cc - NIN (in_empty)
  // and its V stage by the consumers (v_empty, in issue_chunk_spread).
  auto issue = [&](int cc) {
    if (cc >= si.nc) return;
    sm90::mbar_wait(bars + B_IN_EMPTY + cc % NIN, ((cc / NIN) & 1) ^ 1);
    issue_chunk_spread<4>(p, si, cc, base, bars, warp, lane);
  };
  if constexpr (PIPE_COPIES == 0) {
    for (int cc = 0; cc < NIN - 2; ++cc) issue(cc);
  }
  // The pair's v copies come from group A, which waits for free record slots anyway, so the consumer
  // step, the pair's bound, issues none (H200 2026-12-02: -1.5..-2%, o bitwise equal): v of global
  // chunks 0-3 first; local chunk c then copies chunks 2 c + 4 and 2 c + 5 (their stages were last read
  // at chunks 2 c - 4, 2 c - 3: at most 4 global chunks behind this one's record, which never waits on
  // these copies)
  if constexpr (PAIR && !PAIR_CW) {
    for (int cc = 0; cc < 4; ++cc) issue_v<4>(p, si, cc, base, bars, warp, lane);
  }
  // (c: the local chunk, which indexes every ring and scratch set; KDA_GCHUNK(c) the data's chunk)
  for (int c = 0; c < nlocal(si); ++c) {
    group_a_step<BAR, 1, true>(p, si, base, bars, tid, a, c, min(C, si.len - KDA_GCHUNK(si, c) * C));
    // The stage of chunk c - 2 (B's phase 2 of it is done: A waited scr_empty of c - 2's set).
    if constexpr (PIPE_COPIES == 0) issue(c + NIN - 2);
    if constexpr (PAIR && !PAIR_CW) {
      issue_v<4>(p, si, 2 * c + 4, base, bars, warp, lane);
      issue_v<4>(p, si, 2 * c + 5, base, bars, warp, lane);
    }
  }
}

// Phases 2-5 of local chunk c by one 4-warp group (tb: 0 .. 127 within it, warps W0 .. W0 + 3; BAR its named
// barrier), and in the pair the record's forwarding copy to the peer. SCR: release the scratch set to group A
// (scr_empty). The caller saw phases 0-1 of chunk c done (scr_full, or its own named barrier).
template <int BAR, int W0, bool SCR>
__device__ __forceinline__ void group_b_chunk(const KdaParams& p, const SeqInfo& si, char* base, uint64_t* bars, int c,
                                              int rows, int tb) {
  const int warp = threadIdx.x >> 5, r = c % NREC, st = c % NIN;
  // (the exact fallback reads the input stage: it waits for the stage's copies itself)
  if constexpr (!NOPREP_P2) prep_phase2<W0>(base, c, rows, p.scale, bars + B_IN_FULL + st, (c / NIN) & 1);
  // the stage's last read (mode 1: B refills the stage itself, and an mbarrier whose phases
  // complete unwaited is an error to synccheck)
  if constexpr (PIPE_COPIES == 0 || PAIR_CW) sm90::mbar_arrive(bars + B_IN_EMPTY + st);
  sm90::named_sync<BAR, NTG>();
  KDA_STAMP(tb == 0, KDA_GCHUNK(si, c), ST_B_P2);
  if constexpr (!NOPREP_P3) prep_phase3<NTG>(p, base, c, tb);
  sm90::named_sync<BAR, NTG>();
  KDA_STAMP(tb == 0, KDA_GCHUNK(si, c), ST_B_P3);
  if (!NOPREP_P4 && tb < C) prep_phase4(base, c, tb);
  sm90::named_sync<BAR, NTG>();
  KDA_STAMP(tb == 0, KDA_GCHUNK(si, c), ST_B_P4);
  if constexpr (!NOPREP_P5) prep_phase5_ainv<NTG>(base, c, tb);
  if constexpr (!UKG) {  // (UKG: the consumers apply (I+L)^-1 diag(b) to v^T - S Kg^T themselves)
    uint32_t ah[4], al[4];
    prep_inv_frags(base, c, threadIdx.x & 31, ah, al);
    prep_w16(base, c, ah, al, 2 * (warp - W0));
    prep_w16(base, c, ah, al, 2 * (warp - W0) + 1);
  }
  if constexpr (SCR) sm90::mbar_arrive(bars + B_SCR_EMPTY + (c & 1));  // the set's last read
  sm90::fence_proxy_async();
  KDA_STAMP(tb == 0, KDA_GCHUNK(si, c), ST_B_DONE);
  KDA_STAMP(tb == 32 || tb == 64 || tb == 96, KDA_GCHUNK(si, c), ST_B_DONE1 + tb / 32 - 1);
  sm90::mbar_arrive(bars + B_REC_FULL + r);
  if constexpr (PAIR) {
    // Forward the record to the peer ring's slot r. Phases 0-1's part is visible since scr_full (or the
    // group's barrier; their threads fenced before arriving), phases 2-5's after this barrier (each thread fenced).
    // Waiting rec_full here instead took ~2800 cycles after the last B warp had arrived (stamps, H200
    // 2026-12-02), and the copies first were slower. The peer's slot is free: its consumers released
    // it on this CTA's rec_empty, which phase 0 waited before this chunk.
    sm90::named_sync<BAR, NTG>();
    if (tb == 0) {
      KDA_STAMP(true, KDA_GCHUNK(si, c), ST_B_FULL);
      const uint32_t peer = pair_rank(si) ^ 1u;
      const uint32_t pbar = sm90::peer_addr(bars + B_REC_PEER + r, peer);
      sm90::mbar_arrive_expect_tx_remote(pbar, REC_USED);
      sm90::bulk_s2peer(sm90::peer_addr(base + SM_REC + (NREC + r) * REC_BYTES, peer), base + SM_REC + r * REC_BYTES,
                        REC_USED, pbar);
      KDA_STAMP(true, KDA_GCHUNK(si, c), ST_B_FWD);
    }
  }
}

__device__ __forceinline__ void prep_group_b(const KdaParams& p, const SeqInfo& si, char* base, uint64_t* bars) {
  const int tid = threadIdx.x, tb = tid - NTG, warp = tid >> 5;
  if constexpr (PAIR) {
    if constexpr (!PAIR_CW) {
      for (int cc = 0; cc < NIN; ++cc) issue_qkg<4>(p, si, cc, base, bars, warp - 4, tid & 31);
    }
  } else if constexpr (PIPE_COPIES == 1) {
    for (int cc = 0; cc < NIN; ++cc) issue_chunk_spread<4>(p, si, cc, base, bars, warp - 4, tid & 31);
  }
  for (int c = 0; c < nlocal(si); ++c) {
    const int rows = min(C, si.len - KDA_GCHUNK(si, c) * C);
    const int h = c & 1;
    KDA_STAMP(tb == 0, KDA_GCHUNK(si, c), ST_B_WAIT);
    sm90::mbar_wait(bars + B_SCR_FULL + h, (c >> 1) & 1);
    KDA_STAMP(tb == 0, KDA_GCHUNK(si, c), ST_B_GO);
    group_b_chunk<BAR_PREP_B, 4, true>(p, si, base, bars, c, rows, tb);
    // Stage c % NIN: A read it in phases 0-1 of chunk c (before scr_full) and B's phase 2 is past the group
    // barrier, so chunk c + NIN may land there (the pair's copy warpgroup waits in_empty instead).
    if constexpr (PAIR) {
      if constexpr (!PAIR_CW) issue_qkg<4>(p, si, c + NIN, base, bars, warp - 4, tid & 31);
    } else if constexpr (PIPE_COPIES == 1) {
      issue_chunk_spread<4>(p, si, c + NIN, base, bars, warp - 4, tid & 31);
    }
  }
}

// DUAL: group G (warps 4 G .. 4 G + 3, named barrier 1 + G) runs phases 0-5 of local chunks G, G + 2, .. (scratch
// sets and group B's arrays by chunk parity). Each group's chunk is as long as A's and B's together, but the two
// overlap, so a local chunk takes half of that where A's phases 0-1 alone had paced the pipeline (stamps, H200
// 2026-12-02: A works ~3700 of a ~4400-cycle chunk, B waits ~1100 of it).
template <int G>
__device__ __forceinline__ void prep_group_dual(const KdaParams& p, const SeqInfo& si, char* base, uint64_t* bars) {
  constexpr int BAR = 1 + G;
  const int tid = threadIdx.x - G * NTG;
  ARows a = a_rows(p, si, tid, G);
  for (int c = G; c < nlocal(si); c += 2) {
    const int rows = min(C, si.len - KDA_GCHUNK(si, c) * C);
    group_a_step<BAR, 2, false>(p, si, base, bars, tid, a, c, rows);
    sm90::named_sync<BAR, NTG>();  // phase 1's scratch and record rows, read by other warps in phase 2
    KDA_STAMP(tid == 0, KDA_GCHUNK(si, c), ST_B_WAIT);
    KDA_STAMP(tid == 0, KDA_GCHUNK(si, c), ST_B_GO);
    group_b_chunk<BAR, 4 * G, false>(p, si, base, bars, c, rows, tid);
  }
}

// Each group is a warpgroup, so each gets its own register limit: at 512 threads group A (the chain,
// two passes of phase 0 in flight) takes 104 and B 88 (96 for both spills group A of the
// softplus-gate build; 112 / 80 spills group B). The pair with its copy warpgroup: A and B keep the launch's 128
// (setmaxnreg.dec only lowers; B at 112 spilled the unbounded-gate build), copies 40, consumers 200.
constexpr int PREP_A_REGS = NT == 512 ? (PAIR_CW ? 128 : 104) : PREP_REGS;
constexpr int PREP_B_REGS = NT == 512 ? (PAIR_CW ? 128 : 88) : PREP_REGS;
static_assert(PREP_A_REGS <= LAUNCH_REGS && PREP_B_REGS <= LAUNCH_REGS && CW_REGS <= LAUNCH_REGS,
              "setmaxnreg.dec only lowers a warpgroup's registers (a raise is an illegal instruction)");
static_assert(!REALLOC || NTG * (PREP_A_REGS + PREP_B_REGS) + NTX * CW_REGS + 128 * NCONS * CONS_REGS <=
                              NT * LAUNCH_REGS,
              "register budget");

// DUAL: each group holds the loop invariants of phases 0-1 and 2-5 (at the launch's 128 registers the first build
// spilled 168 bytes); with the copy warpgroup at 24 the groups take what the consumers leave, rounded down to a multiple
// of 8: 160 beside 160 (256 x 160 + 128 x 24 + 128 x 160 = 64512 of 65536; see CONS_REGS).
#ifdef KDA_SM90_DUAL_REGS
constexpr int DUAL_REGS = KDA_SM90_DUAL_REGS;
#else
constexpr int DUAL_REGS = (NT * LAUNCH_REGS - NTX * CW_REGS - 128 * NCONS * CONS_REGS) / NTP / 8 * 8;  // (the rest)
#endif
static_assert(!DUAL || NTP * DUAL_REGS + NTX * CW_REGS + 128 * NCONS * CONS_REGS <= NT * LAUNCH_REGS, "register budget");

__device__ __forceinline__ void prep_role_pipe(const KdaParams& p, const SeqInfo& si, char* base, uint64_t* bars) {
  // (NTX: the pair's copy warpgroup, threads NTP .. NTP + 127)
  if constexpr (DUAL) {  // (the groups raise to DUAL_REGS, the copy warpgroup drops to CW_REGS)
    if (threadIdx.x < NTG) {
      sm90::regs_inc<DUAL_REGS>();
      prep_group_dual<0>(p, si, base, bars);
    } else if (threadIdx.x < NTP) {
      sm90::regs_inc<DUAL_REGS>();
      prep_group_dual<1>(p, si, base, bars);
    } else {
      sm90::regs_dec<CW_REGS>();
      copy_role_pair(p, si, base, bars);
    }
  } else if (threadIdx.x < NTG) {
    if constexpr (REALLOC && PREP_A_REGS < LAUNCH_REGS) sm90::regs_dec<PREP_A_REGS>();
    prep_group_a<BAR_PREP_A>(p, si, base, bars, threadIdx.x);
  } else if (NTX == 0 || threadIdx.x < NTP) {
    if constexpr (REALLOC && PREP_B_REGS < LAUNCH_REGS) sm90::regs_dec<PREP_B_REGS>();
    prep_group_b(p, si, base, bars);
  } else {
    if constexpr (REALLOC) sm90::regs_dec<CW_REGS>();
    copy_role_pair(p, si, base, bars);
  }
}

}  // namespace kda
