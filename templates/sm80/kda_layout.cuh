// kdagen sm80: the layout every sm80 kernel shares -- types, the per-chunk workspace record that
// kda_prep writes and kda_recur reads, and both kernels' block shapes and shared-memory budgets
// (exported to the launcher through kda_meta, their one source of truth).
// The including translation unit defines KDA_C, KDA_K, KDA_V, KDA_BV, KDA_IN_T, KDA_GATE,
// KDA_STATE, KDA_PRECISE (see kda_fwd.cu.j2).
#pragma once
#include <type_traits>

#include "kda_variant.cuh"

namespace kda {

static_assert(C == 16 || C == 64, "chunk");
static_assert(K % 16 == 0 && V % 16 == 0 && V % BV == 0 && BV % 16 == 0, "dims");

// ---- workspace record (one per chunk and value head), bytes ----
// PRECISE (a variant's `precise`, name suffix _hl) carries what the o product loses in bf16 (sm90's
// scheme, measured in torch: tests/test_sm80.py::test_sm80_precise_emulation): Mqk's strictly lower
// part in hi + lo bf16 and its diagonal in fp32, which kda_recur applies to U in fp32; and in place
// of U0 (bf16 in the plain record) P^T = (A^-1 diag(b))^T in hi + lo, from which kda_recur forms
// U0 = P v in fp32 with the block's own v rows (the record shrinks by 2 V C bytes: the prep neither
// reads v nor writes U0). Bf16 only: fp16 v cannot enter a bf16 MMA. Chunk 16 only: chunk 64's
// larger stage leaves block_v 32 no room for two (an A100's 163 KB).
constexpr bool PRECISE = KDA_PRECISE != 0;
static_assert(!PRECISE || C == 16, "the precise record is chunk 16's");
static_assert(!PRECISE || std::is_same<in_t, __nv_bfloat16>::value, "the precise record is bf16's");
constexpr int MQ_TILES = PRECISE ? 2 : 1;              // Mqk: hi [+ lo]
constexpr long long OFF_W = 0;                         // bf16 [C][K]  W = A^-1 diag(b) Kd
constexpr long long OFF_Q = 1LL * C * K * 2;           // bf16 [C][K]  Qd (scale folded in)
constexpr long long OFF_R = 2LL * C * K * 2;           // bf16 [C][K]  Kr = k Gamma_C / Gamma
constexpr long long OFF_M = 3LL * C * K * 2;           // bf16 [C][C]  Mqk (PRECISE: strictly lower, hi; then lo)
constexpr long long OFF_P = OFF_M + 2LL * MQ_TILES * C * C;  // bf16 [C][C] PRECISE: P^T, hi; then lo
constexpr long long OFF_U = OFF_P + (PRECISE ? 4LL * C * C : 0);  // bf16 [V][C] plain: U0^T = (A^-1 (b v))^T
constexpr long long OFF_GM = OFF_U + (PRECISE ? 0 : 2LL * V * C);  // f32 [K] Gamma_C
constexpr long long OFF_D = OFF_GM + 4LL * K;          // f32  [C]     PRECISE: Mqk's diagonal, scale <q^_i, k^_i>
constexpr long long REC = OFF_D + (PRECISE ? 4LL * C : 0);
static_assert(REC % 16 == 0 && OFF_GM % 16 == 0, "records are copied in 16-byte pieces");

// Shared memory per block: an A100's opt-in maximum. Every image of the fatbin (sm_80, sm_90,
// compute_80 PTX) comes from the same compute_80 source, so one budget holds for all of them;
// the launcher checks the device's own limit (sm_86/89 allow less) before a launch.
constexpr int SMEM_MAX = 163 * 1024;

// ---- kernel 1 ----
constexpr int NT1 = K + V;  // one thread per column of [Kd | v] in the substitution
constexpr int NW1 = NT1 / 32;
constexpr int KP = K + 4;   // fp32 row pitch (bank spread, 16-byte aligned rows)
constexpr int CP = C + 4;
// c16 blocks are short-lived and latency-bound: keep four per SM (caps registers at 64). At
// K = 256 a block has 512 threads: two per SM hold the same 64 registers per thread.
constexpr int MINB1 = C == 16 ? (K >= 256 ? 2 : 4) : 1;
constexpr int VP16 = V + 8;  // 16-bit v rows (chunk 64): 16-byte aligned
// Chunk 16: L and Mqk are split over K in 16-column slices, SPW slices on each of NMW warps;
// partials [NMW][2][16][16]. bf16 tiles have row pitches KB1, XB1, IP1, UP1 (16-byte shift
// per row: conflict-free ldmatrix and 16-byte accesses).
constexpr int SPW = K >= 128 ? 2 : 1;
constexpr int NMW = K / 16 / SPW;
constexpr int KB1 = K + 8;
constexpr int XB1 = 2 * K + 8;
constexpr int IP1 = 24;
constexpr int UP1 = 24;
constexpr int SMEM1 = C == 16
    ? (C * KP + NMW * 512 + C * CP + 3 * C) * 4 + (3 * C * KB1 + 2 * C * XB1 + 2 * 16 * IP1) * 2
    // chunk 64: q, k, G (+ a zero row), L^T, Mqk, beta (fp32); v (input type)
    : (3 * C * KP + KP + 2 * C * CP + C) * 4 + C * VP16 * 2;
static_assert(SMEM1 <= SMEM_MAX, "kda_prep shared memory");
static_assert(C != 16 || (K == V && C * (K / 8) == NT1 && NMW <= NW1 && V * UP1 <= 2 * C * KB1),
              "chunk 16 prep layout");

// ---- kernel 2 ----
// Split-K: at K >= 128 two warps share 16 rows of V, each holding K/2 state columns (at K = 256,
// 128 columns: 64 fp32 registers of state per thread and tile). Per warp
// this halves the MMAs and the dependent chain of a step (the recurrence is issue-bound with
// one warp per scheduler) and doubles the warps in flight when there are few heads; the two
// partial sums of S W^T and S Qd^T are exchanged through shared memory once per chunk.
constexpr int KSPLIT = K >= 128 ? 2 : 1;
static_assert(KSPLIT <= 2, "the split-K exchange pairs two warps");
constexpr int KH = K / KSPLIT;  // state columns per warp
// V rows per warp: 16 * MT. Two tiles per warp let each W / Qd / Kr fragment feed two MMAs, which
// pays where several blocks share an SM's shared-memory pipe (block_v 64); with one block per SM
// more, shorter warp streams win (MT 1). Measured: benchmarks/NOTES.md, "sm80 template choices".
// Chunk 16 only: at chunk 64 the registers do not allow it.
#ifdef KDA_MT
constexpr int MT = KDA_MT;
#else
constexpr int MT = C == 16 && BV >= 64 ? 2 : 1;
#endif
constexpr int NWV = BV / (16 * MT);  // warps along V
static_assert(NWV >= 1 && BV % (16 * MT) == 0, "block_v must hold whole warp tiles");
constexpr int NW2 = NWV * KSPLIT;  // compute warps
// Plus one copy warp that issues every cp.async of the workspace stream: it takes the copies'
// instructions and address stalls off the compute warps' in-order streams (NOTES.md).
constexpr int NT2 = (NW2 + 1) * 32;
// A stage: W, Qd, Kr [C][K], Mqk [MQ_TILES][C][C], (PRECISE) P^T [2][C][C], this block's U tile
// (plain: U0^T [BV][C]; PRECISE: v [C][BV]) (16-bit, rows unpadded, 16-byte chunks swizzled: see
// tile_at), Gamma_C [K] and (PRECISE) the diagonal [C] (fp32).
constexpr int STAGE_U = (3 * C * K + MQ_TILES * C * C + (PRECISE ? 2 * C * C : 0)) * 2;  // bytes before the U tile
constexpr int STAGE_GM = STAGE_U + BV * C * 2;  // Gamma_C, then the diagonal
constexpr int STAGE = STAGE_GM + K * 4 + (PRECISE ? C * 4 : 0);
// Split-K exchange, per warp and 16-row tile: its partial U^T [16 v, C] (C/8 float4 per lane) and
// the partial S Qd^T n-tiles its partner finishes (C/16 float4 per lane). Float4 j of tile m of
// lane l of warp w sits at ((w * MT + m) * XW4 + j) * 32 + l: conflict-free.
constexpr int XU4 = C / 8;
constexpr int XO4 = C / 16;
constexpr int XW4 = XU4 + XO4;
constexpr int XBUF = KSPLIT > 1 ? NW2 * MT * 32 * XW4 * 16 : 0;
// o: each warp finishes C / KSPLIT time steps of its 16 * MT V columns, staged per 16-row tile in
// its own slice of shared memory (48-byte rows: the 2-byte writes hit distinct banks) for 16-byte
// stores. At chunk 16 the copy warp stores chunk c's o during step c + 1 (double-buffered
// staging), off the compute warps' streams; at chunk 64 (K = 128) there is no room for a second
// slot, and the compute warps store their own.
constexpr bool O_BY_COPY = C == 16;
constexpr int OROWS = C / KSPLIT;
constexpr int OP = 24;
constexpr int OSLOT = NW2 * MT * OROWS * OP;  // elements of one chunk's staging
constexpr int OBUF = (O_BY_COPY ? 2 : 1) * OSLOT * 2;
// The split-K partners' exchange is ordered by an mbarrier per V tile (arrive + parity wait), or
// with KDA_PAIR_MBAR=0 (kept for A/B timing) by a named barrier per tile. With the named barrier
// racecheck reports the copy warp's o reads at K = 128 though the block barrier orders them: a
// tool blind spot that mbarriers avoid (scripts/sanitizer/race_blind_spot.cu, MODE 1 vs 3 and 5).
#ifndef KDA_PAIR_MBAR
#define KDA_PAIR_MBAR 1
#endif
constexpr bool PAIR_MBAR = KSPLIT > 1 && KDA_PAIR_MBAR != 0;
constexpr int PAIRBAR = PAIR_MBAR ? NWV * 8 : 0;  // bytes: one 64-bit mbarrier per V tile
constexpr int XOB = XBUF + OBUF + PAIRBAR;  // shared memory besides the stages
// Four stages where they fit (chunk c + 3 streams in while chunk c is worked on), else fewer.
// At K = 256 (27 KB a stage) three, so that two blocks of block_v <= 32 share a Hopper SM
// (228 KB). KDA_NSTAGE (a compile-time -D) overrides, for measuring the prefetch depth.
#ifdef KDA_NSTAGE
constexpr int NSTAGE = KDA_NSTAGE;
#else
constexpr int NSTAGE = K < 256 && 4 * STAGE + XOB <= SMEM_MAX ? 4 : 3 * STAGE + XOB <= SMEM_MAX ? 3 : 2;
#endif
constexpr int OFF_PAIRBAR = NSTAGE * STAGE + XBUF + OBUF;
constexpr int SMEM2 = NSTAGE * STAGE + XOB;
static_assert(STAGE % 16 == 0 && XBUF % 16 == 0 && OFF_PAIRBAR % 8 == 0 && SMEM2 <= SMEM_MAX,
              "kda_recur shared memory");

}  // namespace kda

extern "C" __device__ int kda_meta[8] = {(int)kda::REC, kda::SMEM1, kda::SMEM2, kda::NT1,
                                          kda::NT2, kda::C, kda::BV, 0};
