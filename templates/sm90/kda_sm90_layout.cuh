// kdagen sm90: compile-time shape, the shared-memory map and the chunk record layout of the fused
// kernel (see templates/sm90/DESIGN.md). The including translation unit defines KDA_C, KDA_K,
// KDA_V, KDA_BV, KDA_IN_T, KDA_GATE, KDA_STATE (see kda_fwd.cu.j2).
#pragma once
#include "kda_variant.cuh"
#include "kda_sm90_ptx.cuh"

namespace kda {

static_assert(C == 16, "sm90: chunk 16 (chunk 64 is not written yet)");
static_assert(K == V && (K == 64 || K == 128), "sm90: K = V in {64, 128}");
static_assert(BV % 64 == 0 && V % BV == 0, "sm90: block_v is a multiple of 64 (wgmma M) dividing V");

// ---- roles ----
constexpr int NTP = 2 * K;          // prep threads: thread = (row, 8 columns); 16 rows x K / 8
constexpr int NWP = NTP / 32;       // prep warps (a whole number of warpgroups)
constexpr int NCONS = BV / 64;      // consumer warpgroups, 64 rows of V (wgmma M) each
// The prep pipeline and the CTA pair (macros here: the roles below depend on them; see their constexprs).
#if KDA_K == 128 && (!defined(KDA_SM90_PREP_PIPE) || KDA_SM90_PREP_PIPE)
#define KDA_SM90_PIPE_ON 1
#else
#define KDA_SM90_PIPE_ON 0
#endif
#if KDA_SM90_PIPE_ON && KDA_BV == 64 && KDA_V == 128 && (!defined(KDA_SM90_PAIR) || KDA_SM90_PAIR)
#define KDA_SM90_PAIR_ON 1
#else
#define KDA_SM90_PAIR_ON 0
#endif
// The pair's copy warpgroup (default; KDA_SM90_PAIR_CW=0 for group B's q, k, g and group A's v copies): a fourth
// warpgroup issues every bulk copy, so no prep group's cycle holds a copy loop (stamps, H200 2026-12-02: each
// cp.async.bulk issue took ~35 cycles, serialised across the SM's warps; B spent ~1600 of its ~4800-cycle chunk
// in its copies, A ~1100 in its v copies, and the consumer step followed that cycle).
#if KDA_SM90_PAIR_ON && (!defined(KDA_SM90_PAIR_CW) || KDA_SM90_PAIR_CW)
#define KDA_SM90_CW_ON 1
#else
#define KDA_SM90_CW_ON 0
#endif
constexpr bool PAIR_CW = KDA_SM90_CW_ON;
constexpr int NTX = PAIR_CW ? 128 : 0;  // threads of the copy warpgroup (after the prep, before the consumers)
constexpr int NT = NTP + NTX + 128 * NCONS;
static_assert(NWP % 4 == 0, "consumer warpgroups must start on a warpgroup boundary");
// Registers after setmaxnreg (K = 128: 512 threads launched at 128 each; the pair without its copy warpgroup 384 at 168): the
// prep needs few, the consumers hold the 64 x 128 fp32 state (64 per thread) plus its bf16 copy
// (32). Without the reallocation ptxas spills the 384-thread kernel at 168 registers.
constexpr bool REALLOC = NT > 256;
constexpr int LAUNCH_REGS = NT == 512 ? 128 : 168;
constexpr int PREP_REGS = NT == 512 ? 96 : 152;
// (CONS_REGS, the consumers' registers, follows DUAL below)

// ---- input stage (q, k, g rows of one chunk; bulk-copied) ----
constexpr int QROW = K * 2;            // bytes of a q / k row
constexpr int GROW = K * 4 + 16;       // g row pitch (room for fp32; +16 spreads the banks)
constexpr int IN_Q = 0;
constexpr int IN_K = C * QROW;
constexpr int IN_G = 2 * C * QROW;
constexpr int IN_BYTES = 2 * C * QROW + C * GROW;
// ---- v stage (this CTA's BV columns; rows padded by 16 bytes: conflict-free ldmatrix.trans) ----
constexpr int VROW = BV * 2 + 16;
constexpr int V_BYTES = C * VROW;

// ---- chunk record (written by the prep, read by the consumers' wgmma) ----
constexpr int R_QD = 0;                 // bf16 [C][K] Qd, K-major 128B-swizzled
constexpr int R_W = C * K * 2;          // bf16 [C][K] W, K-major 128B-swizzled
constexpr int R_KR = 2 * C * K * 2;     // bf16 [C][K] Kr, MN-major 128B-swizzled
constexpr int R_MQ = 3 * C * K * 2;     // bf16 [16][16] Mqk, K-major interleaved, high part
constexpr int R_ML = R_MQ + 512;        //                                        low part
constexpr int R_AH = R_ML + 512;        // bf16 [16][16] (I+L)^-1 diag(b), high part
constexpr int R_AL = R_AH + 512;        //                                 low part
constexpr int R_GM = R_AL + 512;        // fp32 [K] Gamma_C
constexpr int REC_BYTES = (R_GM + K * 4 + 1023) / 1024 * 1024;  // stages stay 1024-aligned

// ---- prep scratch (the sm80 chunk-16 prep's shared arrays) ----
constexpr int KP = K + 4;    // fp32 row pitch
constexpr int CP = C + 4;
constexpr int SPW = K >= 128 ? 2 : 1;  // 16-column K slices per L/Mqk warp
constexpr int NMW = K / 16 / SPW;      // warps computing L/Mqk partials
constexpr int KB1 = K + 8;             // bf16 row pitch (conflict-free ldmatrix)
constexpr int IPF = 20;                // fp32 row pitch of (I+L)^-1 (16-byte rows)
// The prep pipeline (K = 128; KDA_SM90_PREP_PIPE=0 turns it off; K = 64 keeps one group): the prep
// splits into two 4-warp groups pipelined by chunk (templates/sm90/DESIGN.md "Prep pipeline"): group A runs phases
// 0-1 of chunk c while group B runs phases 2-5 of chunk c - 1, so the arrays A writes and B reads
// (sG .. sXl; sb is already by parity) are doubled, by chunk parity, S_HALF bytes apart.
constexpr bool PREP_PIPE = KDA_SM90_PIPE_ON;
// The CTA pair (K = 128, block_v 64, the default there; KDA_SM90_PAIR=0 turns it off): the two V
// halves of a head are a cluster of two CTAs; each preps every other chunk (global chunk 2 j + rank is
// its local chunk j) and forwards the record into the other's peer ring with one shared-to-shared
// bulk copy, so a head's prep is split over two SMs instead of repeated on both (templates/sm90/
// DESIGN.md "CTA pair"; H200 2026-12-01: T8192 H64 1.84 -> 0.99 ms, o bitwise equal).
constexpr bool PAIR = KDA_SM90_PAIR_ON;
// Who issues the bulk copies in the pipeline (KDA_SM90_PIPE_COPIES): 0 group A after its phase 1
// (chunk c + NIN - 2); 1 group B at the end of its chunk c (chunk c + NIN, into the stage B's own
// phase 2 has just released); 2 the consumer warps, chunk c + NIN once the record of chunk c is
// complete, behind their U and o products. Default 2 with two consumer warpgroups, else 1 (H200
// 2026-12-01, ncu: group B was the chain and 40% of it the copy loop; copies 2 at bv128: T8192 H64
// 1.90 -> 1.72 ms, H96 +1%). The pair: its copy warpgroup (PAIR_CW), or (=0) group B q, k, g and group A v
// (the consumers copying q, k, g measured 28% slower).
#ifdef KDA_SM90_PIPE_COPIES
constexpr int PIPE_COPIES = KDA_SM90_PIPE_COPIES;
#else
constexpr int PIPE_COPIES = NCONS == 2 ? 2 : 1;
#endif
static_assert(PIPE_COPIES >= 0 && PIPE_COPIES <= 2, "KDA_SM90_PIPE_COPIES is 0, 1 or 2");
static_assert(!PAIR || PIPE_COPIES == 1, "the pair: its consumers issue no copies (PIPE_COPIES 1)");
constexpr bool CONS_COPIES = PREP_PIPE && PIPE_COPIES == 2;
// KDA_SM90_UKG (the prep pipeline; default 1, =0 for the W record): the record's W slot holds Kg = k^ Gamma
// (bf16, the prep's L operand) instead of W = (I+L)^-1 diag(b) Kg, and the consumers form
// U^T = (v^T - S Kg^T) A^T: group B makes no W tiles and group A no X scratch, for one more wgmma round
// trip per consumer step (H200 2026-12-02: bv128 -6..-8%, the pair -5%; o within 7e-5 of the W record's).
#if !defined(KDA_SM90_UKG) || KDA_SM90_UKG
constexpr bool UKG = PREP_PIPE;  // (the one-group prep, K = 64, keeps W)
#else
constexpr bool UKG = false;
#endif
// KDA_SM90_DUAL (the pair with its copy warpgroup and the Kg record; default 1, =0 for groups A and B): warps 0-3
// and 4-7 each run phases 0-5 of every other local chunk (kda_sm90_prep_pipe.cuh, prep_group_dual) instead of
// phases 0-1 (A) and 2-5 (B) of every chunk. (The W record's scratch leaves no room for group B's second set.)
#if KDA_SM90_CW_ON && (!defined(KDA_SM90_DUAL) || KDA_SM90_DUAL)
constexpr bool DUAL = UKG;
#else
constexpr bool DUAL = false;
#endif
// KDA_SM90_YO (the Kg record; default 1, =0 for separate tiles): -Kg and Qd share one K-major 128B-swizzled
// [2C][K] tile (rows 0 .. C-1 -Kg, C .. 2C-1 Qd; the W and Qd slots' bytes), so the consumers' Y^T = v^T - S Kg^T
// and o^T = S Qd^T are one m64n32k16 wgmma per k-step (v^T added after the wait), instead of
// 1 + 2 K / 16 m64n16k16 (the identity product among them). The pair only: at bv128 it spilled.
#if !defined(KDA_SM90_YO) || KDA_SM90_YO
constexpr bool YO = UKG && PAIR;
#else
constexpr bool YO = false;
#endif
static_assert(R_W == R_QD + C * K * 2 && R_KR == R_W + C * K * 2, "YO: the [2C][K] tile takes the Qd and W slots");
// The consumers' registers (setmaxnreg.inc). DUAL: 160; the prep groups keep 160 (kda_sm90_prep_pipe.cuh: DUAL_REGS
// rounds the rest down to a multiple of 8, so 1024 registers stay unused). H200 2026-12-02: consumers / groups 184 / 152
// with LATE_DECAY was -2..-3% on every pair row against 200 / 144 (three interleaved passes), and 168 / 160 another
// -0.4..-1.9% (session 21: the prep paces the pair); 2026-12-03: 160 / 160 with phase 1 unrolled another -2..-5%
// (152 / 168 the same within 1%).
#ifdef KDA_SM90_CONS_REGS
constexpr int CONS_REGS = KDA_SM90_CONS_REGS;
#else
constexpr int CONS_REGS = DUAL ? 160 : NT == 512 && !PAIR_CW ? 160 : 200;
#endif
static_assert(!REALLOC || ((NTP + NTX) * PREP_REGS + 128 * NCONS * CONS_REGS) <= NT * LAUNCH_REGS, "register budget");
// KDA_SM90_LATE_DECAY (default with YO; =0 for the decay before the products): the consumers apply Gamma_C to S
// while the step's first products run ([Y^T | o^T] reads bf16(S) of the chunk start), not ahead of them. bv128 and
// K = 64 measured flat. (Storing o there too, or deferring a chunk's last o products and its slot release into the
// next step, made the pair 3-12% slower, H200 2026-12-02: the prep groups waited longer for slots.)
#if !defined(KDA_SM90_LATE_DECAY) || KDA_SM90_LATE_DECAY
constexpr bool LATE_DECAY = YO;
#else
constexpr bool LATE_DECAY = false;
#endif
// KDA_SM90_P3U (=0 turns it off): phase 3 and 5a with every entry's loads first, unrolled and without branches
// (stamps, H200 2026-12-02: phase 3 took ~870 cycles of a pair group's ~8000-cycle chunk, 341 after; the pair -2..-9%,
// o bitwise equal). With SPAN_VOTE, H200 2026-12-03: K = 64 -15..-16%, bv128 -0.3..-1.3%, o bitwise equal.
#if defined(KDA_SM90_P3U)
constexpr bool P3U = KDA_SM90_P3U;
#else
constexpr bool P3U = UKG || !PREP_PIPE;  // (the pipeline's W-record A/B baseline spills 4 bytes with it)
#endif
// KDA_SM90_GFOLD (the bounded gate, K = 128; =0 turns it off): phase 0's gate activation with its affine part folded
// into one FFMA, lb / (1 + 2^(x m + a)), two instructions fewer per gate element (H200 2026-12-03: the pair -0.2..-3%,
// geomean -1.4% over four rows and three passes; bv128 -1.3..-2.6%; o within 4e-5 of the unfolded gate's). K = 64's
// one-group prep measured +1..+3% with it: off there.
#if !defined(KDA_SM90_GFOLD) || KDA_SM90_GFOLD
constexpr bool GFOLD = KDA_GATE == 0 && PREP_PIPE;
#else
constexpr bool GFOLD = false;
#endif
// KDA_SM90_G2 (GFOLD or GSOFT; =0 turns it off): the cumulative gate in log2 units (lb log2(e) in phase 0's FFMA), so phase
// 1's three exponentials per element are bare ex2 (no multiply by log2(e)); phase 2's span bar scales with it.
// KDA_SM90_QFOLD (the Kg record with GFOLD; =0 turns it off): the attention scale folded into q's norm factor in phase 0, so phase 1
// stores Qd without a multiply per element and phase 3 takes the fp32 diagonal as it is.
// Both together (H200 2026-12-03, session 24 call 2, three passes): the pair -0.75% geomean over issue 16's six rows
// (varlen 8x1024 and B4 T4096 -2%, T8192 H96 and varlen H96 -1%, T16384 H48 flat, T8192 H64 +2%); bv128 -2.2%; o within
// 7e-5 of the unfolded prep's. About 70 fewer fp32 instructions per prep group and chunk.
// KDA_SM90_GSOFT (the unbounded gate; =0 turns it off): phase 0's softplus in log2 units from two MUFU ops,
// -e^A_log (max(t, 0) + log2(1 + 2^-|t|)) with t = (x + dt_bias) log2(e), instead of log1pf(e^x), a software routine
// (H200 2026-12-04 stamps, bv128 T8192 H64: group A's phase 0 took 4760 cycles per chunk against the bounded gate's
// 2390, and group A is the ring's chain; T8192 H64 bv128 1.79 -> 1.22 ms, the pair 0.73 -> 0.55, K = 64 1.84 -> 1.54 at
// H32; o within 1e-4 of log1pf's). With it the unbounded gate is in log2 units too (G2). The precomputed gate in log2
// units (g log2(e) in phase 0) measured flat (bv128 -1%, the pair +0.4%): not taken.
#if !defined(KDA_SM90_GSOFT) || KDA_SM90_GSOFT
#define KDA_SM90_GSOFT_ON (KDA_GATE == 1)
#else
#define KDA_SM90_GSOFT_ON 0
#endif
#if !defined(KDA_SM90_G2) || KDA_SM90_G2
constexpr bool G2 = GFOLD || KDA_SM90_GSOFT_ON;
#else
constexpr bool G2 = false;
#endif
constexpr bool GSOFT = KDA_SM90_GSOFT_ON && G2;  // (its softplus is in log2 units: KDA_SM90_G2=0 turns it off too)
#if !defined(KDA_SM90_QFOLD) || KDA_SM90_QFOLD
constexpr bool QFOLD = UKG && GFOLD;  // (where it was measured; with GSOFT: no spill, the pair +2%, bv128 flat)
#else
constexpr bool QFOLD = false;
#endif
// KDA_SM90_SPAN_VOTE (=0 turns it off): phase 2 decides a slice's exact fallback with one warp vote instead of a
// max over five shuffles (H200 2026-12-02: the pair -1..-6% alone, o bitwise equal; bv128 and K = 64: see P3U).
#if defined(KDA_SM90_SPAN_VOTE)
constexpr bool SPAN_VOTE = KDA_SM90_SPAN_VOTE;
#else
constexpr bool SPAN_VOTE = true;
#endif
// OHL (K = 64, `KDA_SM90_OHL=0` turns it off): the o product takes S in hi + lo bf16 (K/16 more m64n16k16, off
// the step's chain). K = 64 has half the terms per output to average bf16(S)'s rounding over: rel RMSE of o at
// g = -8 4.02e-3 on the H200 (sm80 4.9e-3), over issue 16's 4e-3; 3.92e-3 -> 3.58e-3 in the emulation.
#if !defined(KDA_SM90_OHL) || KDA_SM90_OHL
constexpr bool OHL = K == 64;
#else
constexpr bool OHL = false;
#endif
#if KDA_SM90_PIPE_ON
constexpr int S_G = 0;                          // f32 [C][KP] cumulative gate            (set)
constexpr int S_RQ = S_G + C * KP * 4;          // f32 [C] L2-norm factors of q, k         (set)
constexpr int S_RK = S_RQ + C * 4;
constexpr int S_DG = S_RK + C * 4;              // f32 [C] <q^_i, k^_i>                    (set)
// (the Kg record: L's and Mqk's row operands are the record's Kg and Qd tiles, so no AK / AQ: 17 KB less)
constexpr int S_AK = S_DG + C * 4;              // bf16 [C][KB1] k e^G       (set; W record only)
constexpr int S_AQ = S_AK + (UKG ? 0 : C * KB1 * 2);  // bf16 [C][KB1] q e^G (set; W record only)
constexpr int S_BK = S_AQ + (UKG ? 0 : C * KB1 * 2);  // bf16 [C][KB1] k e^-G                    (set)
constexpr int S_XH = S_BK + C * KB1 * 2;        // bf16 [C][KB1] b k e^G, high part (W record only)
constexpr int S_XL = S_XH + C * KB1 * 2;        //                       low part  (W record only)
constexpr int S_HALF = UKG ? S_XH : S_XL + C * KB1 * 2;  // one set (Kg: no X); the second follows
constexpr int S_PART = 2 * S_HALF;              // f32 [NMW][2][16][16] partial L, Mqk (group B)
constexpr int S_LT = S_PART + NMW * 512 * 4;    // f32 [C][CP] L^T (times b)            (group B)
constexpr int S_B = S_LT + C * CP * 4;          // f32 [2][C] beta (by chunk parity)
constexpr int S_INV = S_B + 2 * C * 4;          // f32 [16][IPF] (I+L)^-1               (group B)
static_assert(S_HALF % 16 == 0, "16-byte aligned scratch sets");
#else
constexpr int S_HALF = 0;                       // one set
constexpr int S_G = 0;                          // f32 [C][KP] cumulative gate
constexpr int S_PART = S_G + C * KP * 4;        // f32 [NMW][2][16][16] partial L, Mqk
constexpr int S_LT = S_PART + NMW * 512 * 4;    // f32 [C][CP] L^T (times b)
constexpr int S_B = S_LT + C * CP * 4;          // f32 [2][C] beta (by chunk parity: phase 5 of
                                                //   chunk c reads it while chunk c + 1 starts)
constexpr int S_RQ = S_B + 2 * C * 4;           // f32 [C] L2-norm factors of q, k
constexpr int S_RK = S_RQ + C * 4;
constexpr int S_DG = S_RK + C * 4;              // f32 [C] <q^_i, k^_i> (Mqk's diagonal, exact)
constexpr int S_AK = S_DG + C * 4;              // bf16 [C][KB1] k e^G
constexpr int S_AQ = S_AK + C * KB1 * 2;        // bf16 [C][KB1] q e^G
constexpr int S_BK = S_AQ + C * KB1 * 2;        // bf16 [C][KB1] k e^-G
constexpr int S_XH = S_BK + C * KB1 * 2;        // bf16 [C][KB1] b k e^G, high part
constexpr int S_XL = S_XH + C * KB1 * 2;        //                       low part
constexpr int S_INV = S_XL + C * KB1 * 2;       // f32 [16][IPF] (I+L)^-1
#endif
constexpr int S_END = (S_INV + 16 * IPF * 4 + 15) / 16 * 16;
// DUAL: each group runs phases 2-5 of its own chunks, so group B's arrays (S_PART .. the end) are doubled by chunk
// parity too; parity 1's copy follows the end (S_B, already by parity, is read at parity 0's offset only).
constexpr int S_OWN2 = DUAL ? S_END - S_PART : 0;
constexpr int SCR_BYTES = S_END + S_OWN2;
static_assert(C * (K / 8) == NTP && NMW <= NWP && K / 16 == NWP, "chunk 16 prep layout");

// ---- ring depths ----
// Loads are issued NIN - 1 chunks ahead of the prep; the consumers trail the prep by up to
// NREC chunks; NV = NIN + NREC never holds the prep's copy warp longer than the REC ring does.
#ifdef KDA_NIN
constexpr int NIN = KDA_NIN;
#elif KDA_SM90_PIPE_ON
// (the second scratch set takes a stage's room; DUAL's second set of group B's arrays another, with the v ring
// of 12: H200 2026-12-02, NIN 3 with the v ring of 12 measured 3-7% faster than NIN 4 with 8)
constexpr int NIN = DUAL ? 3 : 4;
#else
constexpr int NIN = 5;
#endif
#ifdef KDA_NREC
constexpr int NREC = KDA_NREC;
#else
// (the pair holds two rings of NREC: its own records and its peer's. With the copy warpgroup, 3 and a v ring of
// 12: H200 2026-12-02, T8192 H64 -8..-11%, T16384 H48 -10..-16%, T8192 H96 -13% against 2 and 8 without it; the
// copy warpgroup alone -4..-6%, the deeper rings alone 0..-2%.)
constexpr int NREC = PAIR && !(PAIR_CW && UKG) ? 2 : 3;  // (the W record's scratch leaves no room for 3 there)
#endif
// The v ring (the pair's copy warpgroup issues v up to NV chunks ahead of the consumers).
#ifdef KDA_NV
constexpr int NV = KDA_NV;
#else
constexpr int NV = PAIR ? (NREC == 3 ? 12 : 8) : NIN + NREC;
#endif
constexpr int NRSLOT = PAIR ? 2 * NREC : NREC;  // record slots: own ring, then the peer ring
constexpr int REC_USED = R_GM + K * 4;          // bytes of a record the pair forwards
static_assert(NIN >= 2 && NREC >= 1, "ring depths");

// Who issues the bulk copies (templates/sm90/DESIGN.md "measured from SASS"; default 2: on the
// H200 2026-12-01, B1 T8192 H96 bv128 2.99 -> 2.27 (mode 1) -> 2.07 ms (mode 2), o bitwise equal):
//   0: the last prep warp, chunk c + NIN in phase 4 of chunk c (one warp: 4 x 16 copies in a
//      serial uniform-operand loop, on the prep's chain);
//   1: the same point, the copies spread over warps 1 .. NWP-1 (warp 0 substitutes);
//   2: chunk c + NIN - 1 in phase 2 of chunk c, spread over the warps without an L/Mqk slice
//      (K = 128: warps 4-7; where every warp has a slice (K = 64) this is mode 1).
#ifdef KDA_SM90_COPY_SPREAD
constexpr int COPY_MODE_REQ = KDA_SM90_COPY_SPREAD;
#else
constexpr int COPY_MODE_REQ = 2;
#endif
static_assert(COPY_MODE_REQ >= 0 && COPY_MODE_REQ <= 2, "KDA_SM90_COPY_SPREAD is 0, 1 or 2");
constexpr int COPY_MODE = COPY_MODE_REQ == 2 && 32 * (NWP - NMW) < 4 * C ? 1 : COPY_MODE_REQ;
constexpr int COPY_W0 = COPY_MODE == 2 ? NMW : 1;  // first issuing warp (modes 1, 2)
constexpr int COPY_NW = NWP - COPY_W0;             // issuing warps: one copy per lane at most
static_assert(COPY_MODE == 0 || 32 * COPY_NW >= 4 * C, "spread copies: one per lane");

// ---- shared-memory map (offsets from a 1024-aligned base) ----
constexpr int SM_REC = 0;
constexpr int SM_IN = SM_REC + NRSLOT * REC_BYTES;
constexpr int SM_V = SM_IN + NIN * IN_BYTES;
constexpr int SM_SCR = SM_V + NV * V_BYTES;
// o^T of each consumer warp on its way out: 16 time steps x 16 V columns of the input type
constexpr int OST_BYTES = C * 16 * 2;
constexpr int SM_OST = SM_SCR + SCR_BYTES;
// UKG: a 16 x 16 identity (bf16, interleaved K-major) for v^T I, the first product of Y^T = v^T - S Kg^T
constexpr int SM_ID = SM_OST + 4 * NCONS * OST_BYTES;
constexpr int ID_BYTES = UKG && !YO ? 512 : 0;
constexpr int SM_BAR = SM_ID + ID_BYTES;
// barriers: in_full[NIN], v_full[NV], v_empty[NV], rec_full[NREC], rec_empty[NREC]
// (+ the prep pipeline's scr_full[2], scr_empty[2], in_empty[NIN])
constexpr int B_IN_FULL = 0, B_V_FULL = NIN, B_V_EMPTY = NIN + NV, B_REC_FULL = NIN + 2 * NV,
              B_REC_EMPTY = NIN + 2 * NV + NREC;
#if KDA_SM90_PIPE_ON
// (+ the pair's rec_peer[NREC]: its peer ring's slots, full once the peer's forwarding copy landed)
constexpr int B_SCR_FULL = NIN + 2 * NV + 2 * NREC, B_SCR_EMPTY = B_SCR_FULL + 2, B_IN_EMPTY = B_SCR_FULL + 4,
              B_REC_PEER = B_IN_EMPTY + NIN, NBAR = B_REC_PEER + (PAIR ? NREC : 0);
#else
constexpr int NBAR = NIN + 2 * NV + 2 * NREC;
constexpr int B_REC_PEER = NBAR;  // (the pair only)
#endif
constexpr int SMEM_USED = SM_BAR + NBAR * 8;
constexpr int SMEM_BYTES = SMEM_USED + 1024;  // slack to align the dynamic base to 1024
constexpr int SMEM_MAX = 227 * 1024;          // H100 / H200 opt-in maximum per block
static_assert(IN_BYTES % 16 == 0 && V_BYTES % 16 == 0 && SCR_BYTES % 16 == 0, "16-byte aligned stages");
static_assert(SMEM_BYTES <= SMEM_MAX, "sm90 shared memory");

// KDA_SM90_STAMPS=1 (diagnostic builds only; scripts/sm90_stamps.py): one thread of each role writes
// clock64() and %globaltimer at the ring's handoffs of chunks STAMP_C0 .. STAMP_C0 + STAMP_N - 1 of the
// first STAMP_CTAS CTAs into p.ws (unused by sm90 otherwise): [CTA][chunk][event] pairs of u64. Events
// below; the host script turns them into the cycle's segments.
#if defined(KDA_SM90_STAMPS) && KDA_SM90_STAMPS
constexpr int STAMP_C0 = 64, STAMP_N = 64, STAMP_CTAS = 8;
enum StampEvent {
  ST_A_WAIT = 0,  // group A: before its scratch / record-slot / input waits
  ST_A_GO,        // group A: all three waited
  ST_A_DONE,      // group A: before its rec_full arrival
  ST_B_WAIT,      // group B: before its scr_full wait
  ST_B_GO,        // group B: scr_full waited
  ST_B_DONE,      // group B: before its rec_full arrival
  ST_B_FWD,       // group B (the pair): the forward copy issued
  ST_C_WAIT,      // consumer warpgroup 0: before the record wait
  ST_C_GO,        // consumer warpgroup 0: record waited
  ST_C_DONE,      // consumer warpgroup 0: products waited, before the slot release
  ST_C_TOP,       // consumer warpgroup 0: the step's start (KDA_SM90_STAMPS=2 only: these two cost the pair ~20%)
  ST_C_VGO,       // consumer warpgroup 0: v_full waited (=2 only)
  ST_B_FULL,      // group B (the pair): the forwarding thread past group B's barrier
  ST_B_DONE1,     // group B: ST_B_DONE of lane 0 of its warps 1, 2, 3
  ST_B_DONE2,
  ST_B_DONE3,
  ST_A_P0,        // group A (DUAL: the group's phase-0 part): past the barrier after phase 0
  ST_B_P2,        // group B (DUAL: the group's phase 2-5 part): past the barrier after phase 2
  ST_B_P3,        // .. after phase 3
  ST_B_P4,        // .. after phase 4
  ST_NEV
};
__device__ __forceinline__ void stamp(const KdaParams& p, int gc, int ev) {
  const int cta = (blockIdx.y * gridDim.x + blockIdx.x) * gridDim.z + blockIdx.z;  // (a pair's CTAs adjacent)
  if (!p.ws || cta >= STAMP_CTAS || gc < STAMP_C0 || gc >= STAMP_C0 + STAMP_N) return;
  unsigned long long g;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
  unsigned long long* w = reinterpret_cast<unsigned long long*>(p.ws) + 2 * ((cta * STAMP_N + gc - STAMP_C0) * ST_NEV + ev);
  w[0] = (unsigned long long)clock64();
  w[1] = g;
}
#define KDA_STAMP(cond, gc, ev) \
  do {                          \
    if (cond) stamp(p, (gc), (ev)); \
  } while (0)
#define KDA_STAMP2(cond, gc, ev) \
  do {                           \
    if (KDA_SM90_STAMPS >= 2 && (cond)) stamp(p, (gc), (ev)); \
  } while (0)
#else
#define KDA_STAMP(cond, gc, ev) \
  do {                          \
  } while (0)
#define KDA_STAMP2(cond, gc, ev) \
  do {                           \
  } while (0)
#endif

// Named barrier of the prep group (consumers use mbarriers and wgmma waits only).
constexpr int BAR_PREP = 1;
// Named barrier of the consumer warpgroups (UKG: the identity tile written before the first step).
constexpr int BAR_CONS = 4;

}  // namespace kda

// Read by the launcher: (shared memory bytes, threads, chunk, K, V, consumer warpgroups (BV / 64),
// NIN, NREC).
#ifndef KDA_LAYOUT_ONLY  // (host-side tools that print the layout define it)
extern "C" __device__ int kda_meta[8] = {kda::SMEM_BYTES, kda::NT, kda::C, kda::K, kda::V, kda::NCONS, kda::NIN,
                                          kda::NREC};
#if defined(KDA_SM90_STAMPS) && KDA_SM90_STAMPS
// Read by scripts/sm90_stamps.py: (first chunk, chunks, CTAs, events).
extern "C" __device__ int kda_stamp_meta[4] = {kda::STAMP_C0, kda::STAMP_N, kda::STAMP_CTAS, kda::ST_NEV};
#endif
#endif
