// kdagen sm80 KDA prefill: two kernels per variant.
//   kda_prep  (grid: chunks x sequences x value heads): gate, L2 norm, beta, per-channel cumsum,
//             Qd / Kr / Gamma_C, L and Mqk (anchored 16-row sub-tiles), exact (I+L)^-1 applied by
//             fp32 forward substitution -> W = A^-1 diag(b) Kd, U0 = A^-1 (b v) into a workspace.
//   kda_recur (grid: V blocks x sequences x value heads): serial chunk recurrence on a [BV, K]
//             slice of the state held in fp32 registers (mma accumulator layout), next chunk
//             prefetched with cp.async (three stages where they fit). At K = 128 two warps share
//             16 rows of V (split K) and exchange partial sums once per chunk.
// The including translation unit defines KDA_C, KDA_K, KDA_V, KDA_BV, KDA_IN_T, KDA_GATE,
// KDA_STATE (see kda_fwd.cu.j2).
#pragma once
#include "kda_common.cuh"

namespace kda {

constexpr int C = KDA_C;
constexpr int K = KDA_K;
constexpr int V = KDA_V;
constexpr int BV = KDA_BV;
using in_t = KDA_IN_T;
using bf16 = __nv_bfloat16;

#if KDA_STATE == 2
using state_t = __nv_bfloat16;
#else
using state_t = float;
#endif

static_assert(C == 16 || C == 64, "chunk");
static_assert(K % 16 == 0 && V % 16 == 0 && V % BV == 0 && BV % 16 == 0, "dims");

// ---- workspace record (one per chunk and value head), bytes ----
constexpr long long OFF_W = 0;                         // bf16 [C][K]  W = A^-1 diag(b) Kd
constexpr long long OFF_Q = 1LL * C * K * 2;           // bf16 [C][K]  Qd (scale folded in)
constexpr long long OFF_R = 2LL * C * K * 2;           // bf16 [C][K]  Kr = k Gamma_C / Gamma
constexpr long long OFF_M = 3LL * C * K * 2;           // bf16 [C][C]  Mqk (lower incl. diagonal)
constexpr long long OFF_U = OFF_M + 1LL * C * C * 2;   // bf16 [V][C]  U0^T = (A^-1 (b v))^T
constexpr long long OFF_GM = OFF_U + 1LL * V * C * 2;  // f32  [K]     Gamma_C
constexpr long long REC = OFF_GM + 4LL * K;

// Shared memory per block: an A100's opt-in maximum. Every image of the fatbin (sm_80, sm_90,
// compute_80 PTX) comes from the same compute_80 source, so one budget holds for all of them;
// the launcher checks the device's own limit (sm_86/89 allow less) before a launch.
constexpr int SMEM_MAX = 163 * 1024;

// ---- kernel 1 ----
constexpr int NT1 = K + V;  // one thread per column of [Kd | v] in the substitution
constexpr int NW1 = NT1 / 32;
constexpr int KP = K + 4;   // fp32 row pitch (bank spread, 16-byte aligned rows)
constexpr int CP = C + 4;
// c16 blocks are short-lived and latency-bound: keep four per SM (caps registers at 64).
constexpr int MINB1 = C == 16 ? 4 : 1;
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
// Split-K: at K = 128 two warps share 16 rows of V, each holding K/2 state columns. Per warp
// this halves the MMAs and the dependent chain of a step (the recurrence is issue-bound with
// one warp per scheduler) and doubles the warps in flight when there are few heads; the two
// partial sums of S W^T and S Qd^T are exchanged through shared memory once per chunk.
constexpr int KSPLIT = K >= 128 ? 2 : 1;
static_assert(KSPLIT <= 2, "the split-K exchange pairs two warps");
constexpr int KH = K / KSPLIT;  // state columns per warp
// V rows per warp: 16 * MT. With two 16-row tiles per warp each W / Qd / Kr fragment loaded from
// shared memory feeds two MMAs, halving the ldmatrix traffic per V row: that pays where several
// blocks share an SM's shared-memory pipe (block_v 64: four warps per block at MT 2, eight at
// MT 1). With one block per SM the warps' own instruction streams bound a step instead, and
// more warps with shorter streams win: H200, c16 block_v 32, B1 T65536 H24 (96 blocks),
// recurrence 2.10 -> 1.86 ms and the full call 3.00 -> 2.78 ms with MT 1 (two V tiles, four
// compute warps); B1 T8192 H96 (384 blocks) 0.64 -> 0.68 ms, where block_v 64 at MT 2 is the
// faster variant. (Before the copy warp and the swizzled stages, MT 2 had won at block_v 32
// too: 2.37 -> 2.10 ms.) Chunk 16 only: at chunk 64 the registers do not allow it.
#ifdef KDA_MT
constexpr int MT = KDA_MT;
#else
constexpr int MT = C == 16 && BV >= 64 ? 2 : 1;
#endif
constexpr int NWV = BV / (16 * MT);  // warps along V
static_assert(NWV >= 1 && BV % (16 * MT) == 0, "block_v must hold whole warp tiles");
constexpr int NW2 = NWV * KSPLIT;  // compute warps
// Plus one copy warp that issues every cp.async of the workspace stream. Measured on an H200
// (c16 bv32, T65536 H24): the copies cost the compute warps 0.21 of 0.65 us per step when they
// issued them themselves (instructions, and stalls until a queued copy has read its address
// registers); a warp of its own takes that off the compute warps' in-order instruction stream.
constexpr int NT2 = (NW2 + 1) * 32;
// A stage: W, Qd, Kr [C][K], Mqk [C][C], this block's U0^T [BV][C] (16-bit, rows unpadded,
// 16-byte chunks swizzled: see tile_at), Gamma_C [K] (fp32).
constexpr int STAGE = (3 * C * K + C * C + BV * C) * 2 + K * 4;
// Split-K exchange, per warp and 16-row tile: its partial U^T [16 v, C] (C/8 float4 per lane) and
// the partial S Qd^T n-tiles its partner finishes (C/16 float4 per lane). Float4 j of tile m of
// lane l of warp w sits at ((w * MT + m) * XW4 + j) * 32 + l: conflict-free.
constexpr int XU4 = C / 8;
constexpr int XO4 = C / 16;
constexpr int XW4 = XU4 + XO4;
constexpr int XBUF = KSPLIT > 1 ? NW2 * MT * 32 * XW4 * 16 : 0;
// o: each warp finishes C / KSPLIT time steps of its 16 * MT V columns, staged per 16-row tile in
// its own slice of shared memory (48-byte rows: the 2-byte writes hit distinct banks) for 16-byte
// stores. At chunk 16 the copy warp stores chunk c's o during step c + 1 (so the staging is
// double buffered), which takes the stores' address arithmetic, and their hold on the data
// registers into the next step, off the compute warps: H200, c16 block_v 64, B1 T8192 H96,
// recurrence 0.71 -> 0.68 ms (block_v 32 at B1 T65536 H24: unchanged). At chunk 64 the stages
// left no room for a second slot (K = 128), and the compute warps store their own.
constexpr bool O_BY_COPY = C == 16;
constexpr int OROWS = C / KSPLIT;
constexpr int OP = 24;
constexpr int OSLOT = NW2 * MT * OROWS * OP;  // elements of one chunk's staging
constexpr int OBUF = (O_BY_COPY ? 2 : 1) * OSLOT * 2;
// Four stages where they fit (chunk c + 3 streams in while chunk c is worked on), else fewer.
// KDA_NSTAGE (a compile-time -D) overrides, for measuring the prefetch depth.
#ifdef KDA_NSTAGE
constexpr int NSTAGE = KDA_NSTAGE;
#else
constexpr int NSTAGE = 4 * STAGE + XBUF + OBUF <= SMEM_MAX ? 4 : 3 * STAGE + XBUF + OBUF <= SMEM_MAX ? 3 : 2;
#endif
constexpr int SMEM2 = NSTAGE * STAGE + XBUF + OBUF;
static_assert(STAGE % 16 == 0 && XBUF % 16 == 0 && SMEM2 <= SMEM_MAX, "kda_recur shared memory");

__device__ __forceinline__ float gate_act(float x, float aexp, float lb) {
#if KDA_GATE == 0
  return lb * sigmoidf_(aexp * x);
#elif KDA_GATE == 1
  return -aexp * softplusf_(x);
#else
  return x;
#endif
}

// x <- (I + L)^-1 x for unit lower-triangular I + L, L given transposed (sLT[j][i] = L[i][j],
// row pitch CP): right-looking forward substitution, one right-hand side per thread.
__device__ __forceinline__ void forward_subst(float (&x)[C], const float* sLT) {
#pragma unroll
  for (int j = 0; j < C - 1; ++j) {
    const float xj = x[j];
#pragma unroll
    for (int i4 = (j + 1) / 4; i4 < C / 4; ++i4) {
      const float4 l = *reinterpret_cast<const float4*>(sLT + j * CP + 4 * i4);
      if (4 * i4 + 0 > j) x[4 * i4 + 0] -= l.x * xj;
      if (4 * i4 + 1 > j) x[4 * i4 + 1] -= l.y * xj;
      if (4 * i4 + 2 > j) x[4 * i4 + 2] -= l.z * xj;
      if (4 * i4 + 3 > j) x[4 * i4 + 3] -= l.w * xj;
    }
  }
}

// What a kda_prep block works on: chunk blockIdx.x of sequence blockIdx.y, value head
// blockIdx.z. False when the chunk lies past the end of its sequence.
struct PrepChunk {
  int h, rows;
  long long bidx, t0;  // batch index (0 with cu_seqlens), first token of the chunk
  char* wsr;           // the chunk's workspace record
  const in_t* qp;      // q and k of the query head (GQA) at the batch index
  const in_t* kp;
};
__device__ __forceinline__ bool prep_chunk(const KdaParams& p, PrepChunk& w) {
  const int c = blockIdx.x, n = blockIdx.y;
  w.h = blockIdx.z;
  int bos, len;
  seq_bounds(p, n, bos, len);
  if (c * C >= len) return false;
  w.rows = min(C, len - c * C);
  w.bidx = p.cu_seqlens ? 0 : n;
  w.t0 = (long long)(p.cu_seqlens ? bos : 0) + (long long)c * C;
  const long long rec = (long long)bos / C + n + c;
  w.wsr = (char*)p.ws + (rec * p.HV + w.h) * REC;
  const int hq = w.h / p.group;
  w.qp = (const in_t*)p.q + w.bidx * p.q_s[0] + hq * p.q_s[2];
  w.kp = (const in_t*)p.k + w.bidx * p.k_s[0] + hq * p.k_s[2];
  return true;
}

}  // namespace kda

extern "C" __device__ int kda_meta[8] = {(int)kda::REC, kda::SMEM1, kda::SMEM2, kda::NT1,
                                          kda::NT2, kda::C, kda::BV, 0};

#if KDA_C == 16
// Chunk 16: one block per chunk, NT1 = 2K threads. Values live in registers in the layout each
// phase needs; shared memory carries only what crosses threads:
//   0. row-major: thread = (row, 8 columns) loads q, k, v, beta and L2-normalises q, k (shuffles
//      within the row); column-major: two threads per column activate the gate and cumsum it.
//   1. row-major: e^G, e^-G, e^(G_C - G) once per element -> Qd, Kr (workspace), the bf16 MMA
//      operands k e^G, q e^G, k e^-G, and X = [b k e^G | b v] split into bf16 hi + lo.
//   2. L and Mqk on tensor cores, split over K (two 16-column slices per warp at K = 128).
//   3. partial sums in warp order (deterministic) -> L^T (shared), Mqk (workspace).
//   4. (I + L)^-1 by forward substitution, 16 threads, one column each, split into hi + lo.
//   5. [W | U0] = (I + L)^-1 X on tensor cores with split operands (hi hi + hi lo + lo hi:
//      about 16 mantissa bits, as good as the fp32 substitution for bf16 outputs).
extern "C" __global__ void __launch_bounds__(kda::NT1, kda::MINB1) kda_prep(const KdaParams p) {
  using namespace kda;
  extern __shared__ __align__(16) float smem1[];
  float* sG = smem1;                // [C][KP] cumulative gate
  float* spart = sG + C * KP;       // [NMW][2][16][16] per-warp partial L, Mqk
  float* sLT = spart + NMW * 512;   // [C][CP] L transposed (times b)
  float* sb = sLT + C * CP;         // [C] beta
  float* srq = sb + C;              // [C] L2-norm factors of q and k (exact fallback)
  float* srk = srq + C;
  bf16* sAK = reinterpret_cast<bf16*>(srk + C);  // [C][KB1] k e^G      (later: W staging)
  bf16* sAQ = sAK + C * KB1;                     // [C][KB1] q e^G      (later: U0^T staging)
  bf16* sBK = sAQ + C * KB1;                     // [C][KB1] k e^-G
  bf16* sXh = sBK + C * KB1;                     // [C][XB1] X, high bf16 part
  bf16* sXl = sXh + C * XB1;                     // [C][XB1] X - high part
  bf16* sIh = sXl + C * XB1;                     // [16][IP1] (I + L)^-1, high part
  bf16* sIl = sIh + 16 * IP1;

  PrepChunk w;
  if (!prep_chunk(p, w)) return;
  const auto [h, rows, bidx, t0, wsr, qp, kp] = w;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // ---- 0. loads. Every global load of the phase is issued before any result is used, so a
  // block waits for one memory round trip, not one per input: written in the order of use, the
  // compiler converted q/k/v before loading beta, and evaluated beta and A_log before loading
  // g (ncu, H200: four waits in turn, a fifth of the prep's stall samples).
  constexpr int GPR = K / 8;  // 8-column groups per row; C * GPR == NT1
  const int ri = tid / GPR, d = (tid % GPR) * 8;
  const bool live = ri < rows;
  const long long t = t0 + (live ? ri : rows - 1);  // rows past the end load a live row, zeroed below
  const uint4 rq = __ldg(reinterpret_cast<const uint4*>(qp + t * p.q_s[1] + d));
  const uint4 rk = __ldg(reinterpret_cast<const uint4*>(kp + t * p.k_s[1] + d));
  const uint4 rv = __ldg(reinterpret_cast<const uint4*>((const in_t*)p.v + bidx * p.v_s[0] + h * p.v_s[2] + t * p.v_s[1] + d));
  const long long bo = bidx * p.b_s[0] + t * p.b_s[1] + h * p.b_s[2];
  const uint32_t rb = p.beta_fp32 ? __ldg(reinterpret_cast<const unsigned*>(p.beta) + bo)
                                  : (uint32_t)__ldg(reinterpret_cast<const unsigned short*>(p.beta) + bo);
  // Gate, column-major: lanes 0-15 of a warp take rows 0-7 of 16 columns, lanes 16-31 rows 8-15
  // of the same columns (raw bits here; activated and summed below).
  const int col = (lane & 15) + 16 * warp, half = lane >> 4;
#if KDA_GATE != 2
  const float alog = __ldg(p.A_log + h);
  const float bias = p.dt_bias ? __ldg(p.dt_bias + h * K + col) : 0.f;
#endif
  uint32_t rg[8];
  {
    const long long goff = bidx * p.g_s[0] + h * p.g_s[2] + col;
    // One pointer walk per thread (no per-row 64-bit index products), the input type chosen once
    // for the whole loop, and no per-row bounds test for full chunks (all but the last).
    auto gate_rows = [&, t0 = t0, rows = rows](auto tag) {
      using GT = decltype(tag);
      const long long gsb = p.g_s[1] * (long long)sizeof(GT);  // row stride in bytes
      const char* gp = reinterpret_cast<const char*>(reinterpret_cast<const GT*>(p.g) + goff) + (t0 + 8 * half) * gsb;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        rg[j] = rows == C || 8 * half + j < rows ? (uint32_t)__ldg(reinterpret_cast<const GT*>(gp)) : 0u;
        gp += gsb;
        asm("" : "+l"(gp));  // keep the walk: otherwise each row gets its own 64-bit product
      }
    };
    if (p.g_fp32) gate_rows(0u);
    else gate_rows((unsigned short)0);
  }

  float xq[8], xk[8], xv[8];
  unpack8<in_t>(rq, xq);
  unpack8<in_t>(rk, xk);
  unpack8<in_t>(rv, xv);
  if (!live) {
#pragma unroll
    for (int e = 0; e < 8; ++e) xq[e] = xk[e] = xv[e] = 0.f;
  }
  float b = 0.f;
  if (live) {
    const float x = p.beta_fp32 ? __uint_as_float(rb) : to_f(bits_as<in_t>(rb));
    b = sigmoidf_(x) * (p.neg_eigval ? 2.f : 1.f);
  }
  {
#if KDA_GATE != 2
    const float aexp = __expf(alog);
#else
    const float aexp = 0.f, bias = 0.f;
#endif
    float a[8];
    float run = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      // Activated unconditionally and then selected: a branch per row would serialize the
      // rows' exp / reciprocal chains.
      const float x = p.g_fp32 ? __uint_as_float(rg[j]) : to_f(bits_as<in_t>(rg[j]));
      const float act = gate_act(x + bias, aexp, p.lower_bound);
      run += rows == C || 8 * half + j < rows ? act : 0.f;  // rows past the end: no decay
      a[j] = run;
    }
    // The second half adds the first half's total (one shuffle).
    const float first = __shfl_up_sync(0xffffffffu, run, 16);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (half) a[j] += first;
    }
    // Rows 8 apart share banks at pitch KP; the second half writes rotated by 4 rows.
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int jr = half ? ((j + 4) & 7) : j;
      sG[(8 * half + jr) * KP + col] = half ? a[(j + 4) & 7] : a[j];
    }
    if (half) reinterpret_cast<float*>(wsr + OFF_GM)[col] = __expf(a[7]);
  }
  {
    float aq = 1.f, ak = 1.f;
    if (p.use_l2norm) {
      aq = ak = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) { aq += xq[e] * xq[e]; ak += xk[e] * xk[e]; }
#pragma unroll
      for (int o = GPR / 2; o > 0; o >>= 1) {
        aq += __shfl_xor_sync(0xffffffffu, aq, o);
        ak += __shfl_xor_sync(0xffffffffu, ak, o);
      }
      aq = rsqrtf(aq + 1e-6f);
      ak = rsqrtf(ak + 1e-6f);
#pragma unroll
      for (int e = 0; e < 8; ++e) { xq[e] *= aq; xk[e] *= ak; }
    }
    if (d == 0) {
      sb[ri] = b;
      srq[ri] = aq;
      srk[ri] = ak;
    }
  }
  __syncthreads();

  // ---- 1. decays, once per element
  {
    float G[8], GL[8];
    const float4* gp = reinterpret_cast<const float4*>(sG + ri * KP + d);
    const float4* gl = reinterpret_cast<const float4*>(sG + (C - 1) * KP + d);
    float4 x0 = gp[0], x1 = gp[1], y0 = gl[0], y1 = gl[1];
    G[0] = x0.x; G[1] = x0.y; G[2] = x0.z; G[3] = x0.w; G[4] = x1.x; G[5] = x1.y; G[6] = x1.z; G[7] = x1.w;
    GL[0] = y0.x; GL[1] = y0.y; GL[2] = y0.z; GL[3] = y0.w; GL[4] = y1.x; GL[5] = y1.y; GL[6] = y1.z; GL[7] = y1.w;
    uint32_t pk[4], pq[4], pb[4], pqd[4], pkr[4], xkh[4], xkl[4], xvh[4], xvl[4];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      const float e0 = __expf(G[e]), e1 = __expf(G[e + 1]);
      const float i0 = __expf(-G[e]), i1 = __expf(-G[e + 1]);
      const float k0 = xk[e] * e0, k1 = xk[e + 1] * e1, q0 = xq[e] * e0, q1 = xq[e + 1] * e1;
      pk[e / 2] = pack_bf16(k0, k1);
      pq[e / 2] = pack_bf16(q0, q1);
      pqd[e / 2] = pack_bf16(p.scale * q0, p.scale * q1);
      pb[e / 2] = pack_bf16(xk[e] * i0, xk[e + 1] * i1);
      pkr[e / 2] = pack_bf16(xk[e] * __expf(GL[e] - G[e]), xk[e + 1] * __expf(GL[e + 1] - G[e + 1]));
      split_bf16(b * k0, b * k1, xkh[e / 2], xkl[e / 2]);
      split_bf16(b * xv[e], b * xv[e + 1], xvh[e / 2], xvl[e / 2]);
    }
    *reinterpret_cast<uint4*>(sAK + ri * KB1 + d) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
    *reinterpret_cast<uint4*>(sAQ + ri * KB1 + d) = make_uint4(pq[0], pq[1], pq[2], pq[3]);
    *reinterpret_cast<uint4*>(sBK + ri * KB1 + d) = make_uint4(pb[0], pb[1], pb[2], pb[3]);
    *reinterpret_cast<uint4*>(sXh + ri * XB1 + d) = make_uint4(xkh[0], xkh[1], xkh[2], xkh[3]);
    *reinterpret_cast<uint4*>(sXl + ri * XB1 + d) = make_uint4(xkl[0], xkl[1], xkl[2], xkl[3]);
    *reinterpret_cast<uint4*>(sXh + ri * XB1 + K + d) = make_uint4(xvh[0], xvh[1], xvh[2], xvh[3]);
    *reinterpret_cast<uint4*>(sXl + ri * XB1 + K + d) = make_uint4(xvl[0], xvl[1], xvl[2], xvl[3]);
    *reinterpret_cast<uint4*>(wsr + OFF_Q + (ri * K + d) * 2) = make_uint4(pqd[0], pqd[1], pqd[2], pqd[3]);
    *reinterpret_cast<uint4*>(wsr + OFF_R + (ri * K + d) * 2) = make_uint4(pkr[0], pkr[1], pkr[2], pkr[3]);
  }
  __syncthreads();

  // ---- 2. L (b, strictly lower) and Mqk (scale, lower incl. diagonal) over K slices. The anchor
  // is G = 0 before the chunk: <q_i e^{G_i}, k_j e^{-G_j}> with e^{-G_j} <= e^{span}; a slice
  // with span > 80 (beyond fp32/bf16 range) uses exact pairwise exp(G_i - G_j) on CUDA cores,
  // reading q and k again from global memory (rare: only for extreme gates).
  const int g8 = lane >> 2, t4 = lane & 3, lm = lane >> 3, lr = lane & 7;
  if (warp < NMW) {
    float accL[2][4] = {}, accM[2][4] = {};
    unsigned fallback = 0;
#pragma unroll
    for (int sl = 0; sl < SPW; ++sl) {
      const int c0 = 16 * (warp * SPW + sl);
      float span = lane < 16 ? -sG[(C - 1) * KP + c0 + lane] : 0.f;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) span = fmaxf(span, __shfl_xor_sync(0xffffffffu, span, o));
      if (span <= 80.f) {
        uint32_t ak[4], aq[4], bk[4];
        ldsm_x4(ak, sAK + (lr + 8 * (lm & 1)) * KB1 + c0 + 8 * (lm >> 1));
        ldsm_x4(aq, sAQ + (lr + 8 * (lm & 1)) * KB1 + c0 + 8 * (lm >> 1));
        ldsm_x4(bk, sBK + (lr + 8 * (lm >> 1)) * KB1 + c0 + 8 * (lm & 1));
        mma_bf16(accL[0], ak, bk[0], bk[1]);
        mma_bf16(accL[1], ak, bk[2], bk[3]);
        mma_bf16(accM[0], aq, bk[0], bk[1]);
        mma_bf16(accM[1], aq, bk[2], bk[3]);
      } else {
        fallback |= 1u << sl;
      }
    }
    float* pL = spart + warp * 512;
    float* pM = pL + 256;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = g8 + 8 * hh, j = 8 * nt + 2 * t4;
        *reinterpret_cast<float2*>(pL + i * 16 + j) = make_float2(accL[nt][2 * hh], accL[nt][2 * hh + 1]);
        *reinterpret_cast<float2*>(pM + i * 16 + j) = make_float2(accM[nt][2 * hh], accM[nt][2 * hh + 1]);
      }
    if (fallback) {
      __syncwarp();
      for (int sl = 0; sl < SPW; ++sl) {
        if (!(fallback >> sl & 1u)) continue;
        const int c0 = 16 * (warp * SPW + sl);
        for (int pi = lane; pi < 136; pi += 32) {
          int i = (int)((sqrtf(8.f * pi + 1.f) - 1.f) * 0.5f);
          while ((i + 1) * (i + 2) / 2 <= pi) ++i;
          while (i * (i + 1) / 2 > pi) --i;
          const int j = pi - i * (i + 1) / 2;
          if (i >= rows) continue;  // q_i = k_i = 0 (and j <= i)
          const in_t* qi = qp + (t0 + i) * p.q_s[1];
          const in_t* ki = kp + (t0 + i) * p.k_s[1];
          const in_t* kj = kp + (t0 + j) * p.k_s[1];
          float l = 0.f, m = 0.f;
          for (int dd = c0; dd < c0 + 16; ++dd) {
            const float w = __expf(sG[i * KP + dd] - sG[j * KP + dd]) * to_f(kj[dd]);
            l += to_f(ki[dd]) * w;
            m += to_f(qi[dd]) * w;
          }
          pL[i * 16 + j] += l * srk[i] * srk[j];
          pM[i * 16 + j] += m * srq[i] * srk[j];
        }
      }
    }
  }
  __syncthreads();

  // ---- 3. sum the partials in warp order
  for (int u = tid; u < 256; u += NT1) {
    const int i = u >> 4, j = u & 15;
    float l = 0.f, m = 0.f;
#pragma unroll
    for (int w = 0; w < NMW; ++w) {
      l += spart[w * 512 + u];
      m += spart[w * 512 + 256 + u];
    }
    if (i > j) sLT[j * CP + i] = sb[i] * l;
    reinterpret_cast<bf16*>(wsr + OFF_M)[u] = __float2bfloat16_rn(i >= j ? p.scale * m : 0.f);
  }
  __syncthreads();

  // ---- 4. (I + L)^-1, column j on thread j: right-looking forward substitution on e_j.
  if (tid < C) {
    const int j = tid;
    float x[C];
#pragma unroll
    for (int i = 0; i < C; ++i) x[i] = i == j ? 1.f : 0.f;
    forward_subst(x, sLT);
#pragma unroll
    for (int i = 0; i < C; ++i) {
      const bf16 hi = __float2bfloat16_rn(x[i]);
      sIh[i * IP1 + j] = hi;
      sIl[i * IP1 + j] = __float2bfloat16_rn(x[i] - __bfloat162float(hi));
    }
  }
  __syncthreads();

  // ---- 5. [W | U0] = (I + L)^-1 X: each warp takes 32 of the 2K columns (4 n-tiles of 8).
  {
    static_assert(2 * K == 32 * NW1, "chunk 16: 32 columns of [Kd | v] per warp");
    bf16* sWst = sAK;  // [C][KB1]  W rows
    bf16* sUst = sAQ;  // [V][UP1]  U0^T rows (C time steps each)
    uint32_t ah[4], al[4];
    ldsm_x4(ah, sIh + (lr + 8 * (lm & 1)) * IP1 + 8 * (lm >> 1));
    ldsm_x4(al, sIl + (lr + 8 * (lm & 1)) * IP1 + 8 * (lm >> 1));
#pragma unroll
    for (int pr = 0; pr < 2; ++pr) {
      const int n0 = 32 * warp + 16 * pr;
      uint32_t bh[4], bl[4];
      ldsm_x4_t(bh, sXh + (lr + 8 * (lm & 1)) * XB1 + n0 + 8 * (lm >> 1));
      ldsm_x4_t(bl, sXl + (lr + 8 * (lm & 1)) * XB1 + n0 + 8 * (lm >> 1));
      float acc[2][4] = {};
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        mma_bf16(acc[hh], al, bh[2 * hh], bh[2 * hh + 1]);
        mma_bf16(acc[hh], ah, bl[2 * hh], bl[2 * hh + 1]);
        mma_bf16(acc[hh], ah, bh[2 * hh], bh[2 * hh + 1]);
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int col = n0 + 8 * hh + 2 * t4;  // warp-uniform side: n0 + 16 <= K or n0 >= K
        if (n0 < K) {
          *reinterpret_cast<uint32_t*>(sWst + g8 * KB1 + col) = pack_bf16(acc[hh][0], acc[hh][1]);
          *reinterpret_cast<uint32_t*>(sWst + (g8 + 8) * KB1 + col) = pack_bf16(acc[hh][2], acc[hh][3]);
        } else {
          const int vv = col - K;
          sUst[vv * UP1 + g8] = __float2bfloat16_rn(acc[hh][0]);
          sUst[(vv + 1) * UP1 + g8] = __float2bfloat16_rn(acc[hh][1]);
          sUst[vv * UP1 + g8 + 8] = __float2bfloat16_rn(acc[hh][2]);
          sUst[(vv + 1) * UP1 + g8 + 8] = __float2bfloat16_rn(acc[hh][3]);
        }
      }
    }
    __syncthreads();
    for (int u = tid; u < C * K / 8; u += NT1) {
      const int i = u / (K / 8), ch = u % (K / 8);
      *reinterpret_cast<uint4*>(wsr + OFF_W + (i * K + ch * 8) * 2) =
          *reinterpret_cast<const uint4*>(sWst + i * KB1 + ch * 8);
    }
    for (int u = tid; u < V * 2; u += NT1) {
      const int vv = u >> 1, hf = u & 1;
      *reinterpret_cast<uint4*>(wsr + OFF_U + (vv * C + hf * 8) * 2) =
          *reinterpret_cast<const uint4*>(sUst + vv * UP1 + hf * 8);
    }
  }
}
#else
// Chunk 64: one block per chunk; inputs staged in fp32 shared memory, L and Mqk in anchored
// 16x16 blocks, one block per warp unit.
extern "C" __global__ void __launch_bounds__(kda::NT1, kda::MINB1) kda_prep(const KdaParams p) {
  using namespace kda;
  extern __shared__ __align__(16) float smem1[];
  float* sq = smem1;
  float* sk = sq + C * KP;
  float* sG = sk + C * KP;
  float* sLT = sG + (C + 1) * KP;  // L transposed: sLT[j][i] = L[i][j]
  float* sM = sLT + C * CP;  // Mqk[i][j]
  float* sb = sM + C * CP;
  in_t* sv = reinterpret_cast<in_t*>(sb + C);  // [C][VP16]

  PrepChunk w;
  if (!prep_chunk(p, w)) return;
  const auto [h, rows, bidx, t0, wsr, qp, kp] = w;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long goff = bidx * p.g_s[0] + h * p.g_s[2];
#if KDA_GATE != 2
  const float aexp = __expf(p.A_log[h]);
#else
  const float aexp = 0.f;
#endif
  const float lb = p.lower_bound;

  // 1. load q, k (fp32), gate activations; zero rows past the end of the sequence.
  for (int u = tid; u < C * K / 8; u += NT1) {
    const int i = u / (K / 8), d = (u % (K / 8)) * 8;
    float xq[8], xk[8], xa[8];
    if (i < rows) {
      const long long t = t0 + i;
      load8(qp + t * p.q_s[1] + d, xq);
      load8(kp + t * p.k_s[1] + d, xk);
      if (p.g_fp32) load8((const float*)p.g + goff + t * p.g_s[1] + d, xa);
      else load8((const in_t*)p.g + goff + t * p.g_s[1] + d, xa);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float x = xa[e];
#if KDA_GATE != 2
        if (p.dt_bias) x += p.dt_bias[h * K + d + e];
#endif
        xa[e] = gate_act(x, aexp, lb);
      }
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) xq[e] = xk[e] = xa[e] = 0.f;
    }
    float4* dq = reinterpret_cast<float4*>(sq + i * KP + d);
    float4* dk = reinterpret_cast<float4*>(sk + i * KP + d);
    float4* dg = reinterpret_cast<float4*>(sG + i * KP + d);
    dq[0] = make_float4(xq[0], xq[1], xq[2], xq[3]); dq[1] = make_float4(xq[4], xq[5], xq[6], xq[7]);
    dk[0] = make_float4(xk[0], xk[1], xk[2], xk[3]); dk[1] = make_float4(xk[4], xk[5], xk[6], xk[7]);
    dg[0] = make_float4(xa[0], xa[1], xa[2], xa[3]); dg[1] = make_float4(xa[4], xa[5], xa[6], xa[7]);
  }
  {
    const in_t* vp = (const in_t*)p.v + bidx * p.v_s[0] + h * p.v_s[2];
    for (int u = tid; u < C * V / 8; u += NT1) {
      const int i = u / (V / 8), d = (u % (V / 8)) * 8;
      // kept in the input type (exact): fp32 here would take the block past an A100's 163 KB
      *reinterpret_cast<uint4*>(sv + i * VP16 + d) =
          i < rows ? *reinterpret_cast<const uint4*>(vp + (t0 + i) * p.v_s[1] + d) : make_uint4(0, 0, 0, 0);
    }
  }
  if (tid < C) {
    float b = 0.f;
    if (tid < rows) {
      const long long bo = bidx * p.b_s[0] + (t0 + tid) * p.b_s[1] + h * p.b_s[2];
      const float x = p.beta_fp32 ? ((const float*)p.beta)[bo] : to_f(((const in_t*)p.beta)[bo]);
      b = sigmoidf_(x) * (p.neg_eigval ? 2.f : 1.f);
    }
    sb[tid] = b;
  }
  for (int e = tid; e < C * CP; e += NT1) { sM[e] = 0.f; sLT[e] = 0.f; }
  if (tid < K) sG[C * KP + tid] = 0.f;  // anchor row "G before the chunk"

  __syncthreads();

  // 2. L2 norm (warp per row) and per-channel cumsum of the gate.
  if (p.use_l2norm) {
    for (int i = warp; i < C; i += NW1) {
      float a = 0.f, b = 0.f;
      for (int d = lane; d < K; d += 32) {
        a += sq[i * KP + d] * sq[i * KP + d];
        b += sk[i * KP + d] * sk[i * KP + d];
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
      }
      a = rsqrtf(a + 1e-6f);
      b = rsqrtf(b + 1e-6f);
      for (int d = lane; d < K; d += 32) {
        sq[i * KP + d] *= a;
        sk[i * KP + d] *= b;
      }
    }
  }
  if (tid < K) {
    float run = 0.f;
#pragma unroll 8
    for (int i = 0; i < C; ++i) {
      run += sG[i * KP + tid];
      sG[i * KP + tid] = run;
    }
  }
  __syncthreads();

  // 3. Qd, Kr, Gamma_C -> workspace (bf16 / fp32).
  for (int u = tid; u < C * K / 8; u += NT1) {
    const int i = u / (K / 8), d = (u % (K / 8)) * 8;
    uint32_t oq[4], orr[4];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      const float g0 = sG[i * KP + d + e], g1 = sG[i * KP + d + e + 1];
      const float l0 = sG[(C - 1) * KP + d + e], l1 = sG[(C - 1) * KP + d + e + 1];
      oq[e / 2] = pack_bf16(p.scale * sq[i * KP + d + e] * __expf(g0),
                            p.scale * sq[i * KP + d + e + 1] * __expf(g1));
      orr[e / 2] = pack_bf16(sk[i * KP + d + e] * __expf(l0 - g0), sk[i * KP + d + e + 1] * __expf(l1 - g1));
    }
    *reinterpret_cast<uint4*>(wsr + OFF_Q + (i * K + d) * 2) = make_uint4(oq[0], oq[1], oq[2], oq[3]);
    *reinterpret_cast<uint4*>(wsr + OFF_R + (i * K + d) * 2) = make_uint4(orr[0], orr[1], orr[2], orr[3]);
  }
  if (tid < K) reinterpret_cast<float*>(wsr + OFF_GM)[tid] = __expf(sG[(C - 1) * KP + tid]);

  // 4. L (times b, strictly lower) and Mqk (times scale, lower incl. diagonal), one 16x16 block
  //    (r, s), s <= r, per warp unit, on tensor cores with a per-block anchor row G_a:
  //      <x_i e^{G_i - G_a}, k_j e^{G_a - G_j}> = <x_i, k_j e^{G_i - G_j}>.
  //    Off-diagonal (s < r): a = last row of block s, both factors <= 1.
  //    Diagonal (s = r): a = the row before block r (G = 0 before the chunk); the right factor
  //    is <= e^{span} with span = max_k (G_a - G_{16r+15}); used when span <= 80 (fp32/bf16
  //    range), else the block falls back to exact pairwise exp(G_i - G_j) on CUDA cores.
  const int g8 = lane >> 2, t4 = lane & 3;
  {
  constexpr int NB = C / 16;
  for (int unit = warp; unit < NB * (NB + 1) / 2; unit += NW1) {
    int r = (int)((sqrtf(8.f * unit + 1.f) - 1.f) * 0.5f);
    while ((r + 1) * (r + 2) / 2 <= unit) ++r;
    while (r * (r + 1) / 2 > unit) --r;
    const int s = unit - r * (r + 1) / 2;
    const bool diag = (s == r);
    const float* ga = diag ? (r == 0 ? sG + C * KP : sG + (16 * r - 1) * KP) : sG + (16 * s + 15) * KP;
    bool use_mma = true;
    if (diag) {
      float span = 0.f;
      for (int d = lane; d < K; d += 32) span = fmaxf(span, ga[d] - sG[(16 * r + 15) * KP + d]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) span = fmaxf(span, __shfl_xor_sync(0xffffffffu, span, o));
      use_mma = span <= 80.f;
    }
    if (use_mma) {
      const int i0 = 16 * r + g8;
      float accL[2][4] = {}, accM[2][4] = {};
#pragma unroll 2
      for (int ks = 0; ks < K / 16; ++ks) {
        const int c0 = 16 * ks + 2 * t4;
        uint32_t aK[4], aQ[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = i0 + (e & 1) * 8, col = c0 + (e >> 1) * 8;
          const float2 gr = *reinterpret_cast<const float2*>(sG + row * KP + col);
          const float2 gA = *reinterpret_cast<const float2*>(ga + col);
          const float2 kr = *reinterpret_cast<const float2*>(sk + row * KP + col);
          const float2 qr = *reinterpret_cast<const float2*>(sq + row * KP + col);
          const float e0 = __expf(gr.x - gA.x), e1 = __expf(gr.y - gA.y);
          aK[e] = pack_bf16(kr.x * e0, kr.y * e1);
          aQ[e] = pack_bf16(qr.x * e0, qr.y * e1);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int j = 16 * s + 8 * nt + g8;
          uint32_t bb[2];
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int col = c0 + 8 * hh;
            const float2 gj = *reinterpret_cast<const float2*>(sG + j * KP + col);
            const float2 gA = *reinterpret_cast<const float2*>(ga + col);
            const float2 kj = *reinterpret_cast<const float2*>(sk + j * KP + col);
            bb[hh] = pack_bf16(kj.x * __expf(gA.x - gj.x), kj.y * __expf(gA.y - gj.y));
          }
          mma_bf16(accL[nt], aK, bb[0], bb[1]);
          mma_bf16(accM[nt], aQ, bb[0], bb[1]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = i0 + (e >> 1) * 8, j = 16 * s + 8 * nt + 2 * t4 + (e & 1);
          if (!diag || i > j) sLT[j * CP + i] = sb[i] * accL[nt][e];
          if (!diag || i >= j) sM[i * CP + j] = p.scale * accM[nt][e];
        }
    } else {
      for (int pi = lane; pi < 136; pi += 32) {
        int ii = (int)((sqrtf(8.f * pi + 1.f) - 1.f) * 0.5f);
        while ((ii + 1) * (ii + 2) / 2 <= pi) ++ii;
        while (ii * (ii + 1) / 2 > pi) --ii;
        const int jj = pi - ii * (ii + 1) / 2;
        const int i = 16 * r + ii, j = 16 * r + jj;
        float l = 0.f, m = 0.f;
#pragma unroll 4
        for (int d = 0; d < K; d += 4) {
          const float4 gi = *reinterpret_cast<const float4*>(sG + i * KP + d);
          const float4 gj = *reinterpret_cast<const float4*>(sG + j * KP + d);
          const float4 ki = *reinterpret_cast<const float4*>(sk + i * KP + d);
          const float4 kj = *reinterpret_cast<const float4*>(sk + j * KP + d);
          const float4 qi = *reinterpret_cast<const float4*>(sq + i * KP + d);
          float w;
          w = __expf(gi.x - gj.x) * kj.x; l += ki.x * w; m += qi.x * w;
          w = __expf(gi.y - gj.y) * kj.y; l += ki.y * w; m += qi.y * w;
          w = __expf(gi.z - gj.z) * kj.z; l += ki.z * w; m += qi.z * w;
          w = __expf(gi.w - gj.w) * kj.w; l += ki.w * w; m += qi.w * w;
        }
        if (ii > jj) sLT[j * CP + i] = sb[i] * l;
        sM[i * CP + j] = p.scale * m;
      }
    }
  }
  }
  __syncthreads();

  // 5. Mqk -> workspace.
  for (int u = tid; u < C * C / 8; u += NT1) {
    const int i = u / (C / 8), d = (u % (C / 8)) * 8;
    const float* src = sM + i * CP + d;
    *reinterpret_cast<uint4*>(wsr + OFF_M + (i * C + d) * 2) =
        make_uint4(pack_bf16(src[0], src[1]), pack_bf16(src[2], src[3]), pack_bf16(src[4], src[5]),
                   pack_bf16(src[6], src[7]));
  }

  // 6. X = (I + L)^-1 [b Kd | b v], one column per thread, right-looking forward substitution.
  {
    const int col = tid;
    float x[C];
    if (col < K) {
#pragma unroll
      for (int i = 0; i < C; ++i) x[i] = sb[i] * sk[i * KP + col] * __expf(sG[i * KP + col]);
    } else {
#pragma unroll
      for (int i = 0; i < C; ++i) x[i] = sb[i] * to_f(sv[i * VP16 + col - K]);
    }
    forward_subst(x, sLT);
    // W goes out through shared memory (the q tile is free by now) as 16-byte row pieces.
    bf16* sWt = reinterpret_cast<bf16*>(sq);
    if (col < K) {
#pragma unroll
      for (int i = 0; i < C; ++i) sWt[i * K + col] = __float2bfloat16_rn(x[i]);
    } else {
      char* u = wsr + OFF_U + (long long)(col - K) * C * 2;
#pragma unroll
      for (int i = 0; i < C; i += 8)
        *reinterpret_cast<uint4*>(u + i * 2) =
            make_uint4(pack_bf16(x[i], x[i + 1]), pack_bf16(x[i + 2], x[i + 3]),
                       pack_bf16(x[i + 4], x[i + 5]), pack_bf16(x[i + 6], x[i + 7]));
    }
    __syncthreads();
    for (int u = tid; u < C * K / 8; u += NT1)
      *reinterpret_cast<uint4*>(wsr + OFF_W + u * 16) = *reinterpret_cast<const uint4*>(sWt + u * 8);
  }
}

#endif  // KDA_C

namespace kda {

// Stage tiles keep the record's unpadded rows with their 16-byte chunks XOR-swizzled by row:
// the 8 rows one ldmatrix reads fall on distinct banks, and a cp.async pass writes whole
// 128-byte lines. With rows padded by 16 bytes instead (the earlier layout) the cp.async writes
// took 2-6x the ideal shared-memory wavefronts (ncu, H200, c16 bv32: about 240 extra per step,
// beside some 260 of the compute warps). Measured on an H200: the recurrence of c16 block_v 64
// at B1 T8192 H96 0.68 -> 0.64-0.66 ms and of c64 block_v 32 at B1 T65536 H24 1.94 -> 1.82 ms
// (several warps per SM share the pipe there); c16 block_v 32 at H24 unchanged.
// NCH: 16-byte chunks per row.
template <int NCH>
__device__ __forceinline__ int swz(int row, int ch) {
  if constexpr (NCH >= 8) return ch ^ (row & 7);
  else return ch ^ ((row / (8 / NCH)) & (NCH - 1));
}
// Element offset of (row, col) in a swizzled tile of 16-bit elements.
template <int NCH>
__device__ __forceinline__ int tile_at(int row, int col) {
  return row * NCH * 8 + swz<NCH>(row, col >> 3) * 8 + (col & 7);
}

// cp.async a swizzled tile of ROWS rows of NCH 16-byte chunks (contiguous rows in global) by the
// 32 lanes of the copy warp. The swizzle of a lane's chunk repeats every PER passes; each of the
// PER destination addresses and the source address advance by a constant and are kept opaque to
// the compiler (see copy_rows).
template <int ROWS, int NCH>
__device__ __forceinline__ void copy_tile(char* dst, const char* src, int lane) {
  static_assert(32 % NCH == 0, "copy_tile: whole rows per pass");
  constexpr int RB = NCH * 16, RSTEP = 32 / NCH, TOTAL = ROWS * NCH;
  constexpr int PER = NCH >= 8 ? NCH / 4 : 1;
  const int r = lane / NCH, ch = lane % NCH;
  uint32_t d[PER];
#pragma unroll
  for (int q = 0; q < PER; ++q) d[q] = smem_u32(dst) + (r + q * RSTEP) * RB + swz<NCH>(r + q * RSTEP, ch) * 16;
  const char* g = src + r * RB + ch * 16;
#pragma unroll
  for (int i = 0; i < (TOTAL + 31) / 32; ++i) {
    if (TOTAL % 32 == 0 || lane + i * 32 < TOTAL) cp_async16_s(d[i % PER], g);
    d[i % PER] += PER * RSTEP * RB;
    g += RSTEP * RB;
    asm volatile("" : "+r"(d[i % PER]), "+l"(g));
  }
}

// cp.async ROWS rows of PER_ROW 16-byte pieces (row pitches in bytes), by the 32 lanes of the
// copy warp (lane = its lane). The addresses advance
// by a constant per copy and are kept opaque to the compiler: otherwise it precomputes every
// copy's address for the whole chunk loop, which costs over a hundred registers at chunk 64.
template <int ROWS, int PER_ROW, int DST_PITCH, int SRC_PITCH>
__device__ __forceinline__ void copy_rows(char* dst, const char* src, int lane) {
  constexpr int TOTAL = ROWS * PER_ROW;
  static_assert(32 % PER_ROW == 0, "copy_rows: whole rows per pass");
  constexpr int RSTEP = 32 / PER_ROW;
  const int r = lane / PER_ROW, ch = lane % PER_ROW;
  uint32_t d = smem_u32(dst) + r * DST_PITCH + ch * 16;
  const char* g = src + r * SRC_PITCH + ch * 16;
#pragma unroll
  for (int i = 0; i < (TOTAL + 31) / 32; ++i) {
    if (TOTAL % 32 == 0 || lane + i * 32 < TOTAL) cp_async16_s(d, g);
    d += RSTEP * DST_PITCH;
    g += RSTEP * SRC_PITCH;
    asm volatile("" : "+r"(d), "+l"(g));
  }
}

// Issue the cp.async copies of one chunk record (this block's V slice of U0^T) into a stage.
__device__ __forceinline__ void prefetch_chunk(char* stage, const char* rec, int vb, int lane) {
  // W, Qd, Kr rows back to back: [3C][K] in the record and in shared memory (C % 8 == 0, so a
  // row's swizzle is the same counted from W or from its own tile).
  copy_tile<3 * C, K / 8>(stage, rec, lane);
  char* sm = stage + 3 * C * K * 2;
  copy_tile<C, C / 8>(sm, rec + OFF_M, lane);
  char* su = sm + C * C * 2;
  copy_tile<BV, C / 8>(su, rec + OFF_U + (long long)vb * BV * C * 2, lane);
  copy_rows<1, K / 4, 0, 0>(su + BV * C * 2, rec + OFF_GM, lane);
}

// Store one chunk's staged o (OSLOT elements; see OROWS) with the copy warp: 16-byte pieces,
// rows past the end of the sequence skipped. obase is o at the chunk's first token and this
// block's first V column.
__device__ __forceinline__ void store_o_chunk(const in_t* so, in_t* obase, long long ostride, int rows, int lane) {
  constexpr int PIECES = NW2 * MT * OROWS * 2;
#pragma unroll
  for (int i = 0; i < (PIECES + 31) / 32; ++i) {
    const int u = lane + 32 * i;
    if (PIECES % 32 != 0 && u >= PIECES) break;
    const int half = u & 1, r = (u >> 1) % OROWS, m = (u >> 1) / OROWS % MT, w = u / (2 * OROWS * MT);
    const int vt = w % NWV, kh = w / NWV;
    const int t = KSPLIT == 1 ? r : 16 * (r >> 3) + 8 * kh + (r & 7);
    if (t < rows)
      *reinterpret_cast<uint4*>(obase + t * ostride + vt * 16 * MT + 16 * m + half * 8) =
          *reinterpret_cast<const uint4*>(so + ((w * MT + m) * OROWS + r) * OP + half * 8);
  }
}

// Barrier of the two warps of V tile vt (id 1 + vt). Immediate ids: with a register id ptxas
// reserves all 16 hardware barriers per block, which caps the blocks per SM.
template <int I>
__device__ __forceinline__ void bar_tile(int vt) {
  if constexpr (I < NWV) {
    if (vt == I) asm volatile("bar.sync %0, 64;\n" ::"n"(I + 1) : "memory");
    bar_tile<I + 1>(vt);
  }
}

// Register-held state slice <-> memory (rows vr0, vr0 + 8; columns k0 + 8 nt + 2 t4 + {0,1}).
// The layout is a template parameter so that element offsets are immediates.
template <bool KV, typename ST>
__device__ __forceinline__ void store_state_l(ST* base, const float (*s)[4], int vr0, int k0, int t4) {
  ST* b = base + (KV ? (long long)(k0 + 2 * t4) * V + vr0 : (long long)vr0 * K + k0 + 2 * t4);
#pragma unroll
  for (int nt = 0; nt < KH / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int dv = (e >> 1) * 8, dk = 8 * nt + (e & 1);
      b[KV ? dk * V + dv : dv * K + dk] = from_f<ST>(s[nt][e]);
    }
}
template <typename ST>
__device__ __forceinline__ void store_state(ST* base, const float (*s)[4], int vr0, int k0, int t4, bool kv) {
  if (kv) store_state_l<true>(base, s, vr0, k0, t4);
  else store_state_l<false>(base, s, vr0, k0, t4);
}
template <bool KV, typename ST>
__device__ __forceinline__ void load_state_l(const ST* base, float (*s)[4], int vr0, int k0, int t4) {
  const ST* b = base + (KV ? (long long)(k0 + 2 * t4) * V + vr0 : (long long)vr0 * K + k0 + 2 * t4);
#pragma unroll
  for (int nt = 0; nt < KH / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int dv = (e >> 1) * 8, dk = 8 * nt + (e & 1);
      s[nt][e] = to_f(b[KV ? dk * V + dv : dv * K + dk]);
    }
}

}  // namespace kda

// Register budgets, measured per build (ptxas 13.0, sm_80 and sm_90 images), not derived. Left to
// itself ptxas caps some shapes below what they need and spills loop invariants: chunk 64 at 168
// registers, block_v 16 (three warps) at 96. Asking for one block per SM lifts the cap; at chunk
// 64, K = 64 ptxas then schedules more aggressively and spills on sm_90, so an explicit cap there
// (232 until the stage tiles were swizzled; since then 232, 240 and 248 spill and 255 does not).
#if KDA_C == 64 && KDA_K == 64
#define KDA_RECUR_BOUNDS __maxnreg__(255)
#elif KDA_C == 64 || KDA_BV == 16
#define KDA_RECUR_BOUNDS __launch_bounds__(kda::NT2, 1)
#else
#define KDA_RECUR_BOUNDS __launch_bounds__(kda::NT2)
#endif
extern "C" __global__ void KDA_RECUR_BOUNDS kda_recur(const KdaParams p) {
  using namespace kda;
  extern __shared__ __align__(16) char smem2[];
  float4* xbuf = reinterpret_cast<float4*>(smem2 + NSTAGE * STAGE);
  const int vb = blockIdx.x, n = blockIdx.y, h = blockIdx.z;
  int bos, len;
  seq_bounds(p, n, bos, len);
  const int nc = (len + C - 1) / C;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const char* rec_c = (const char*)p.ws + (((long long)bos / C + n) * p.HV + h) * REC;  // chunk 0
  const long long rstride = (long long)p.HV * REC;

  const long long bidx = p.cu_seqlens ? 0 : n;
  const long long tb = p.cu_seqlens ? bos : 0;
  in_t* const so_all = reinterpret_cast<in_t*>(smem2 + NSTAGE * STAGE + XBUF);  // o staging

  if (warp == NW2) {
    // The copy warp: stage c + NSTAGE - 1 is refilled in step c, once every warp has passed the
    // step's barrier (so is done with chunk c - 1, which that stage held). It waits for chunk
    // c + 1 before the next barrier, which then publishes it to the compute warps. After the
    // barrier of step c it also stores chunk c - 1's o (staged in slot (c - 1) & 1 before that
    // barrier; the compute warps write the other slot in step c), and the last chunk's after one
    // more barrier past the loop.
    in_t* ob = (in_t*)p.o + bidx * p.o_s[0] + h * p.o_s[2] + vb * BV + tb * p.o_s[1];
    const long long ostride = p.o_s[1];
#pragma unroll
    for (int j = 0; j < NSTAGE - 1; ++j) {
      if (j < nc) prefetch_chunk(smem2 + j * STAGE, rec_c + j * rstride, vb, lane);
      cp_async_commit();
    }
    for (int c = 0; c < nc; ++c) {
      cp_async_wait<NSTAGE - 2>();
      __syncthreads();
      if (c + NSTAGE - 1 < nc)
        prefetch_chunk(smem2 + ((c + NSTAGE - 1) % NSTAGE) * STAGE, rec_c + (c + NSTAGE - 1) * rstride, vb, lane);
      cp_async_commit();
      if (O_BY_COPY && c > 0)
        store_o_chunk(so_all + ((c - 1) & 1) * OSLOT, ob + (long long)(c - 1) * C * ostride, ostride, C, lane);
    }
    if constexpr (O_BY_COPY) {
      __syncthreads();
      if (nc > 0)
        store_o_chunk(so_all + ((nc - 1) & 1) * OSLOT, ob + (long long)(nc - 1) * C * ostride, ostride,
                      len - (nc - 1) * C, lane);
    }
    return;
  }

  const int vt = warp % NWV, kh = warp / NWV;  // (16 * MT)-row V tile and K slice of this warp
  const int k0 = kh * KH;
  const int g8 = lane >> 2, t4 = lane & 3, lm = lane >> 3, lr = lane & 7;
  const int vw = vt * 16 * MT;       // this warp's first V row within the block's slice
  const int vr0 = vb * BV + vw + g8;  // state row of tile 0 (tile m: + 16 m)
#if KDA_STATE != 0
  const long long st_off = ((long long)n * p.HV + h) * V * K;  // initial / final state
#endif
  const bool kv = p.state_kv != 0;

  float s[MT][KH / 8][4];
#if KDA_STATE != 0
  if (p.h0) {
    const state_t* h0 = (const state_t*)p.h0 + st_off;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (kv) load_state_l<true>(h0, s[m], vr0 + 16 * m, k0, t4);
      else load_state_l<false>(h0, s[m], vr0 + 16 * m, k0, t4);
    }
  } else
#endif
  {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int nt = 0; nt < KH / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[m][nt][e] = 0.f;
  }

  in_t* op = (in_t*)p.o + bidx * p.o_s[0] + h * p.o_s[2] + vb * BV + vw;  // (chunk 64)
  const long long ostride = p.o_s[1];
  const int coff = p.hc ? p.chunk_offsets[n] : 0;


  for (int c = 0; c < nc; ++c) {
    if (p.hc) {
#pragma unroll
      for (int m = 0; m < MT; ++m) {
#if KDA_STATE == 2
        store_state((bf16*)p.hc + ((long long)(coff + c) * p.HV + h) * V * K, s[m], vr0 + 16 * m, k0, t4, kv);
#else
        store_state((float*)p.hc + ((long long)(coff + c) * p.HV + h) * V * K, s[m], vr0 + 16 * m, k0, t4, kv);
#endif
      }
    }
    // The one block-wide barrier of a step: chunk c has landed (the copy warp waited for it),
    // and every warp is done with step c - 1 (its stage can be refilled, the exchange slots
    // reused).
    __syncthreads();

    const bf16* sW = reinterpret_cast<const bf16*>(smem2 + (c % NSTAGE) * STAGE);
    const bf16* sQ = sW + C * K;
    const bf16* sR = sQ + C * K;
    const bf16* sMq = sR + C * K;
    const bf16* sU = sMq + C * C;
    const float* sGam = reinterpret_cast<const float*>(sU + BV * C);

    // Issue order matters: one warp per scheduler issues in program order, so the step is laid
    // out along its dependency chain (S -> S W^T -> exchange -> U -> S update); independent work
    // (o) sits where it fills the tensor-core latency instead of delaying the chain.
    // S slice as bf16 A fragments (accumulator layout == A layout), then S <- S diag(Gamma_C).
    uint32_t sa[MT][KH / 16][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int ks = 0; ks < KH / 16; ++ks) acc_to_a(s[m][2 * ks], s[m][2 * ks + 1], sa[m][ks]);
    // Partial S W^T ([16 v, C] per tile) over this warp's K slice. At chunk 16 with one tile the
    // K steps alternate between two accumulators, halving the dependent tensor-core chain at the
    // head of the step (two tiles are two independent chains already).
    constexpr int NACC = C == 16 && KH >= 32 && MT == 1 ? 2 : 1;
    float ut[MT][C / 8][4] = {};
    float ut2[C / 8][4] = {};  // unused (and dropped) when NACC == 1
#pragma unroll
    for (int ntp = 0; ntp < C / 16; ++ntp)
#pragma unroll
      for (int ks = 0; ks < KH / 16; ++ks) {
        const int row = 16 * ntp + 8 * (lm >> 1) + lr, col = k0 + 16 * ks + 8 * (lm & 1);
        uint32_t b[4];
        ldsm_x4(b, sW + tile_at<K / 8>(row, col));
        if (NACC > 1 && (ks & 1)) {
          mma_bf16(ut2[2 * ntp], sa[0][ks], b[0], b[1]);
          mma_bf16(ut2[2 * ntp + 1], sa[0][ks], b[2], b[3]);
        } else {
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            mma_bf16(ut[m][2 * ntp], sa[m][ks], b[0], b[1]);
            mma_bf16(ut[m][2 * ntp + 1], sa[m][ks], b[2], b[3]);
          }
        }
      }
    if constexpr (NACC > 1) {
#pragma unroll
      for (int nt = 0; nt < C / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ut[0][nt][e] += ut2[nt][e];
    }
    // Partial S Qd^T over this warp's K slice (off the chain: o only).
    float oq[MT][C / 16][2][4] = {};
#pragma unroll
    for (int ntp = 0; ntp < C / 16; ++ntp)
#pragma unroll
      for (int ks = 0; ks < KH / 16; ++ks) {
        const int row = 16 * ntp + 8 * (lm >> 1) + lr, col = k0 + 16 * ks + 8 * (lm & 1);
        uint32_t bq[4];
        ldsm_x4(bq, sQ + tile_at<K / 8>(row, col));
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma_bf16(oq[m][ntp][0], sa[m][ks], bq[0], bq[1]);
          mma_bf16(oq[m][ntp][1], sa[m][ks], bq[2], bq[3]);
        }
      }
    // With two tiles per warp, the partial U is written for the partner as soon as the S Qd^T
    // MMAs are issued, ahead of this step's other shared-memory loads, which otherwise queue in
    // front of the exchange: H200, c16 block_v 64, B1 T8192 H96, recurrence 0.63-0.65 -> 0.59 ms.
    // With one tile per warp (block_v 32, B1 T65536 H24) it was slower, 1.86 -> 2.04 ms.
    constexpr bool XCH_EARLY = KSPLIT > 1 && MT > 1;
    if constexpr (XCH_EARLY) {
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        float4* xw = xbuf + (warp * MT + m) * XW4 * 32 + lane;
#pragma unroll
        for (int nt = 0; nt < C / 8; ++nt)
          xw[nt * 32] = make_float4(ut[m][nt][0], ut[m][nt][1], ut[m][nt][2], ut[m][nt][3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < KH / 8; ++nt) {
      const float2 gm = *reinterpret_cast<const float2*>(sGam + k0 + 8 * nt + 2 * t4);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        s[m][nt][0] *= gm.x; s[m][nt][1] *= gm.y; s[m][nt][2] *= gm.x; s[m][nt][3] *= gm.y;
      }
    }
    // Operands of the chain's second half, loaded before the exchange barrier (a barrier also
    // fences shared-memory loads, so after it they would sit on the chain): U0^T of this warp's
    // V rows and, at chunk 16, the Kr fragments of the S update.
    constexpr int NU0 = C == 16 ? C / 8 : 1;  // preloaded U0 n-tiles (registers allow at C = 16)
    float u0r[MT][NU0][4];
    auto u0_at = [&](int m, int nt, int e) {
      return __bfloat162float(sU[tile_at<C / 8>(vw + 16 * m + g8 + 8 * (e >> 1), 8 * nt + 2 * t4 + (e & 1))]);
    };
    if constexpr (C == 16) {
      // One ldmatrix per 16-row tile: its four 8x8 matrices in A-fragment order hold the bf16
      // pairs of the accumulator layout (register 2 nt + e / 2, low half for even e).
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        uint32_t b[4];
        ldsm_x4(b, sU + tile_at<C / 8>(vw + 16 * m + (lane & 15), 8 * (lane >> 4)));
#pragma unroll
        for (int nt = 0; nt < C / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const uint32_t pr = b[2 * nt + (e >> 1)];
            u0r[m][nt][e] = __uint_as_float((e & 1) ? (pr & 0xffff0000u) : (pr << 16));
          }
      }
    }
    auto u0 = [&](int m, int nt, int e) {
      if constexpr (C == 16) return u0r[m][nt][e];
      else return u0_at(m, nt, e);
    };
    constexpr int NKR = C == 16 ? KH / 16 : 1;  // preloaded Kr fragments (registers allow at C = 16)
    uint32_t kr[NKR][4];
    auto load_kr = [&](uint32_t (&b)[4], int ntp, int kc) {
      const int row = 16 * kc + 8 * (lm & 1) + lr, col = k0 + 16 * ntp + 8 * (lm >> 1);
      ldsm_x4_t(b, sR + tile_at<K / 8>(row, col));
    };
    if constexpr (C == 16) {
#pragma unroll
      for (int ntp = 0; ntp < KH / 16; ++ntp) load_kr(kr[ntp], ntp, 0);
    }
    // The o^T n-tiles (8 time steps each) are split between the two warps of a V tile, n-tile
    // 2 ntp + kh to warp kh: it keeps those partials and hands the others to its partner. Split
    // this way, the triangular U^T Mqk^T work is balanced too.
    constexpr int NH = KSPLIT == 1 ? 2 : 1;  // n-tiles per 16 time steps this warp finishes
    float ok[MT][C / 16][NH][4];
    if constexpr (KSPLIT == 1) {
#pragma unroll
      for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int ntp = 0; ntp < C / 16; ++ntp)
#pragma unroll
          for (int e = 0; e < 4; ++e) { ok[m][ntp][0][e] = oq[m][ntp][0][e]; ok[m][ntp][1][e] = oq[m][ntp][1][e]; }
#pragma unroll
        for (int nt = 0; nt < C / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) ut[m][nt][e] = u0(m, nt, e) - ut[m][nt][e];
      }
    } else {
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        float4* xw = xbuf + (warp * MT + m) * XW4 * 32 + lane;
        if constexpr (!XCH_EARLY) {
#pragma unroll
          for (int nt = 0; nt < C / 8; ++nt)
            xw[nt * 32] = make_float4(ut[m][nt][0], ut[m][nt][1], ut[m][nt][2], ut[m][nt][3]);
        }
#pragma unroll
        for (int ntp = 0; ntp < C / 16; ++ntp) {
          xw[(XU4 + ntp) * 32] = kh ? make_float4(oq[m][ntp][0][0], oq[m][ntp][0][1], oq[m][ntp][0][2], oq[m][ntp][0][3])
                                    : make_float4(oq[m][ntp][1][0], oq[m][ntp][1][1], oq[m][ntp][1][2], oq[m][ntp][1][3]);
        }
      }
      bar_tile<0>(vt);  // the two warps of this V tile
      // U = U0 - (own partial + partner's): floating-point addition commutes, so both warps hold
      // the same U bit for bit.
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const float4* xp = xbuf + (((1 - kh) * NWV + vt) * MT + m) * XW4 * 32 + lane;
#pragma unroll
        for (int nt = 0; nt < C / 8; ++nt) {
          const float4 b = xp[nt * 32];
          const float o4[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) ut[m][nt][e] = u0(m, nt, e) - (ut[m][nt][e] + o4[e]);
        }
#pragma unroll
        for (int ntp = 0; ntp < C / 16; ++ntp) {
          const float4 b = xp[(XU4 + ntp) * 32];
          const float o4[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) ok[m][ntp][0][e] = (kh ? oq[m][ntp][1][e] : oq[m][ntp][0][e]) + o4[e];
        }
      }
    }
    // U^T as bf16 A fragments.
    uint32_t ua[MT][C / 16][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int kc = 0; kc < C / 16; ++kc) acc_to_a(ut[m][2 * kc], ut[m][2 * kc + 1], ua[m][kc]);
    // S += U^T Kr (this warp's K slice): the end of the chain, issued before the o work.
#pragma unroll
    for (int ntp = 0; ntp < KH / 16; ++ntp)
#pragma unroll
      for (int kc = 0; kc < C / 16; ++kc) {
        uint32_t b[4];
        if constexpr (C == 16) {
#pragma unroll
          for (int e = 0; e < 4; ++e) b[e] = kr[ntp][e];
        } else {
          load_kr(b, ntp, kc);
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma_bf16(s[m][2 * ntp], ua[m][kc], b[0], b[1]);
          mma_bf16(s[m][2 * ntp + 1], ua[m][kc], b[2], b[3]);
        }
      }
    // o^T += U^T Mqk^T on this warp's n-tiles (Mqk lower triangular: blocks kc <= ntp), staged in
    // this warp's slice of the chunk's o slot ([MT][OROWS][OP]) for the copy warp to store.
    in_t* so = so_all + (O_BY_COPY ? (c & 1) * OSLOT : 0) + warp * MT * OROWS * OP;
#pragma unroll
    for (int ntp = 0; ntp < C / 16; ++ntp) {
#pragma unroll
      for (int kc = 0; kc <= ntp; ++kc) {
        if constexpr (KSPLIT == 1) {
          const int row = 16 * ntp + 8 * (lm >> 1) + lr, col = 16 * kc + 8 * (lm & 1);
          uint32_t b[4];
          ldsm_x4(b, sMq + tile_at<C / 8>(row, col));
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            mma_bf16(ok[m][ntp][0], ua[m][kc], b[0], b[1]);
            mma_bf16(ok[m][ntp][NH - 1], ua[m][kc], b[2], b[3]);
          }
        } else {
          const int row = 16 * ntp + 8 * kh + lr, col = 16 * kc + 8 * (lm & 1);
          uint32_t b[2];
          ldsm_x2(b, sMq + tile_at<C / 8>(row, col));
#pragma unroll
          for (int m = 0; m < MT; ++m) mma_bf16(ok[m][ntp][0], ua[m][kc], b[0], b[1]);
        }
      }
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int hh = 0; hh < NH; ++hh) {
          const int r0 = (KSPLIT == 1 ? 16 * ntp + 8 * hh : 8 * ntp) + 2 * t4;
#pragma unroll
          for (int e = 0; e < 4; ++e)
            so[(m * OROWS + r0 + (e & 1)) * OP + g8 + (e >> 1) * 8] = from_f<in_t>(ok[m][ntp][hh][e]);
        }
    }
    if constexpr (!O_BY_COPY) {
      __syncwarp();
      // A staged row is 16 V columns of one time step (32 bytes).
      const int rows = min(C, len - c * C);
      in_t* oc = op + (tb + (long long)c * C) * ostride;
#pragma unroll
      for (int u = lane; u < MT * OROWS * 2; u += 32) {
        const int m = u / (OROWS * 2), r = (u >> 1) % OROWS, half = u & 1;
        const int t = KSPLIT == 1 ? r : 16 * (r >> 3) + 8 * kh + (r & 7);
        if (t < rows)
          *reinterpret_cast<uint4*>(oc + t * ostride + 16 * m + half * 8) =
              *reinterpret_cast<const uint4*>(so + (m * OROWS + r) * OP + half * 8);
      }
    }
    // state "bf16": bf16 in memory (initial / final / chunk states); the register-held state
    // stays fp32 between chunks (rounding it every chunk costs accuracy and saves nothing).
  }
  if constexpr (O_BY_COPY) __syncthreads();  // the last chunk's o is staged: the copy warp stores it
#if KDA_STATE != 0
  if (p.ht) {
#pragma unroll
    for (int m = 0; m < MT; ++m) store_state((state_t*)p.ht + st_off, s[m], vr0 + 16 * m, k0, t4, kv);
  }
#endif
}
