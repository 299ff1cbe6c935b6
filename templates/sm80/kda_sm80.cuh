// kdagen sm80 KDA prefill: two kernels per variant.
//   kda_prep  (grid: chunks x sequences x value heads): gate, L2 norm, beta, per-channel cumsum,
//             Qd / Kr / Gamma_C, L and Mqk (anchored 16-row sub-tiles), exact (I+L)^-1 applied by
//             fp32 forward substitution -> W = A^-1 diag(b) Kd, U0 = A^-1 (b v) into a workspace.
//   kda_recur (grid: V blocks x sequences x value heads): serial chunk recurrence on a [BV, K]
//             slice of the state held in fp32 registers (mma accumulator layout), next chunk
//             prefetched with cp.async. Each warp owns 16 rows of V: no inter-warp traffic.
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

// ---- kernel 1 ----
constexpr int NT1 = K + V;  // one thread per column of [Kd | v] in the substitution
constexpr int NW1 = NT1 / 32;
constexpr int KP = K + 4;   // fp32 row pitch (bank spread, 16-byte aligned rows)
constexpr int CP = C + 4;
// c16 blocks are short-lived and latency-bound: keep four per SM (caps registers at 64, which
// ptxas meets without spills now that the L/Mqk work is split over the warps).
constexpr int MINB1 = C == 16 ? 4 : 1;
// Chunk 16: each warp forms L and Mqk over its own 16 columns of K; partials [NW1][2][16][16].
constexpr int PART1 = C == 16 ? NW1 * 2 * 256 : 0;
constexpr int VP = V + 4;
// + a zero row after sG; v rows (fp32) are loaded up front with the other inputs
constexpr int SMEM1 = (3 * C * KP + KP + 2 * C * CP + C + PART1 + C * VP) * 4;

// ---- kernel 2 ----
// Split-K: at K = 128 two warps share 16 rows of V, each holding K/2 state columns. Per warp
// this halves the MMAs and the dependent chain of a step (the recurrence is issue-bound with
// one warp per scheduler) and doubles the warps in flight when there are few heads; the two
// partial sums of S W^T and S Qd^T are exchanged through shared memory once per chunk.
constexpr int KSPLIT = K >= 128 ? 2 : 1;
constexpr int KH = K / KSPLIT;  // state columns per warp
constexpr int NWV = BV / 16;    // warps along V
constexpr int NW2 = NWV * KSPLIT;
constexpr int NT2 = NW2 * 32;
constexpr int KS = K + 8;  // bf16 row pitch: 16-byte shift per row, conflict-free ldmatrix
constexpr int CS = C + 8;
constexpr int STAGE = (3 * C * KS + C * CS + BV * CS) * 2 + K * 4;
constexpr int XF = C / 2;  // fp32 per lane of one [16, C] accumulator tile
// Exchange slots: every warp's partial U^T and partial S Qd^T (through shared memory rather
// than registers: it keeps chunk 64 within 255 registers without spills).
constexpr int XBUF = 2 * NW2 * 32 * XF * 4;
constexpr int OP = BV + 8;     // staged o row pitch (elements): spreads the 2-byte writes
constexpr int OBUF = C * OP * 2;
constexpr int SMEM2 = 2 * STAGE + XBUF + OBUF;
static_assert(STAGE % 16 == 0 && XBUF % 16 == 0 && SMEM2 <= 227 * 1024, "kda_recur shared memory");

__device__ __forceinline__ float gate_act(float x, float aexp, float lb) {
#if KDA_GATE == 0
  return lb * sigmoidf_(aexp * x);
#elif KDA_GATE == 1
  return -aexp * softplusf_(x);
#else
  return x;
#endif
}

}  // namespace kda

extern "C" __device__ int kda_meta[8] = {(int)kda::REC, kda::SMEM1, kda::SMEM2, kda::NT1,
                                          kda::NT2, kda::C, kda::BV, 0};

extern "C" __global__ void __launch_bounds__(kda::NT1, kda::MINB1) kda_prep(const KdaParams p) {
  using namespace kda;
  extern __shared__ __align__(16) float smem1[];
  float* sq = smem1;
  float* sk = sq + C * KP;
  float* sG = sk + C * KP;
  float* sLT = sG + (C + 1) * KP;  // L transposed: sLT[j][i] = L[i][j]
  float* sM = sLT + C * CP;  // Mqk[i][j]
  float* sb = sM + C * CP;
  float* spart = sb + C;  // chunk 16 only
  float* sv = spart + PART1;

  const int c = blockIdx.x, n = blockIdx.y, h = blockIdx.z;
  int bos, len;
  seq_bounds(p, n, bos, len);
  if (c * C >= len) return;
  const int rows = min(C, len - c * C);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long bidx = p.cu_seqlens ? 0 : n;
  const long long t0 = (long long)(p.cu_seqlens ? bos : 0) + (long long)c * C;
  const int hq = h / p.group;
  const long long rec = (long long)bos / C + n + c;
  char* wsr = (char*)p.ws + (rec * p.HV + h) * REC;

  const in_t* qp = (const in_t*)p.q + bidx * p.q_s[0] + hq * p.q_s[2];
  const in_t* kp = (const in_t*)p.k + bidx * p.k_s[0] + hq * p.k_s[2];
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
      float xv[8];
      if (i < rows) {
        load8(vp + (t0 + i) * p.v_s[1] + d, xv);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) xv[e] = 0.f;
      }
      float4* dv = reinterpret_cast<float4*>(sv + i * VP + d);
      dv[0] = make_float4(xv[0], xv[1], xv[2], xv[3]);
      dv[1] = make_float4(xv[4], xv[5], xv[6], xv[7]);
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
  if constexpr (C == 16) {
    // One block, split over K: warp w sums its 16 columns (one MMA k-step) into its own partial;
    // the partials are added in warp order afterwards (deterministic, no atomics).
    static_assert(K / 16 == NW1, "chunk 16: one K slice per warp");
    const int c0 = 16 * warp;
    const float* ga = sG + C * KP;  // the zero row: G before the chunk
    float span = 0.f;
    if (lane < 16) span = -sG[15 * KP + c0 + lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) span = fmaxf(span, __shfl_xor_sync(0xffffffffu, span, o));
    float* pL = spart + warp * 512;
    float* pM = pL + 256;
    if (span <= 80.f) {
      float accL[2][4] = {}, accM[2][4] = {};
      uint32_t aK[4], aQ[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = g8 + (e & 1) * 8, col = c0 + 2 * t4 + (e >> 1) * 8;
        const float2 gr = *reinterpret_cast<const float2*>(sG + row * KP + col);
        const float2 kr = *reinterpret_cast<const float2*>(sk + row * KP + col);
        const float2 qr = *reinterpret_cast<const float2*>(sq + row * KP + col);
        const float e0 = __expf(gr.x), e1 = __expf(gr.y);
        aK[e] = pack_bf16(kr.x * e0, kr.y * e1);
        aQ[e] = pack_bf16(qr.x * e0, qr.y * e1);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int j = 8 * nt + g8;
        uint32_t bb[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int col = c0 + 2 * t4 + 8 * hh;
          const float2 gj = *reinterpret_cast<const float2*>(sG + j * KP + col);
          const float2 kj = *reinterpret_cast<const float2*>(sk + j * KP + col);
          bb[hh] = pack_bf16(kj.x * __expf(-gj.x), kj.y * __expf(-gj.y));
        }
        mma_bf16(accL[nt], aK, bb[0], bb[1]);
        mma_bf16(accM[nt], aQ, bb[0], bb[1]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = g8 + (e >> 1) * 8, j = 8 * nt + 2 * t4 + (e & 1);
          pL[i * 16 + j] = accL[nt][e];
          pM[i * 16 + j] = accM[nt][e];
        }
    } else {
      // exact pairwise exp(G_i - G_j) over this warp's 16 columns (lower triangle incl. diagonal)
      for (int pi = lane; pi < 136; pi += 32) {
        int i = (int)((sqrtf(8.f * pi + 1.f) - 1.f) * 0.5f);
        while ((i + 1) * (i + 2) / 2 <= pi) ++i;
        while (i * (i + 1) / 2 > pi) --i;
        const int j = pi - i * (i + 1) / 2;
        float l = 0.f, m = 0.f;
#pragma unroll 4
        for (int d = c0; d < c0 + 16; ++d) {
          const float w = __expf(sG[i * KP + d] - sG[j * KP + d]) * sk[j * KP + d];
          l += sk[i * KP + d] * w;
          m += sq[i * KP + d] * w;
        }
        pL[i * 16 + j] = l;
        pM[i * 16 + j] = m;
      }
    }
    __syncthreads();
    for (int u = tid; u < 256; u += NT1) {
      const int i = u >> 4, j = u & 15;
      float l = 0.f, m = 0.f;
#pragma unroll
      for (int w = 0; w < NW1; ++w) {
        l += spart[w * 512 + u];
        m += spart[w * 512 + 256 + u];
      }
      if (i > j) sLT[j * CP + i] = sb[i] * l;
      if (i >= j) sM[i * CP + j] = p.scale * m;
    }
  } else {
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
      for (int i = 0; i < C; ++i) x[i] = sb[i] * sv[i * VP + col - K];
    }
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

namespace kda {

// cp.async ROWS rows of PER_ROW 16-byte pieces (row pitches in bytes). The addresses advance
// by a constant per copy and are kept opaque to the compiler: otherwise it precomputes every
// copy's address for the whole chunk loop, which costs over a hundred registers at chunk 64.
template <int ROWS, int PER_ROW, int DST_PITCH, int SRC_PITCH>
__device__ __forceinline__ void copy_rows(char* dst, const char* src, int tid) {
  constexpr int TOTAL = ROWS * PER_ROW;
  static_assert(NT2 % PER_ROW == 0, "copy_rows: whole rows per pass");
  constexpr int RSTEP = NT2 / PER_ROW;
  const int r = tid / PER_ROW, ch = tid % PER_ROW;
  uint32_t d = smem_u32(dst) + r * DST_PITCH + ch * 16;
  const char* g = src + r * SRC_PITCH + ch * 16;
#pragma unroll
  for (int i = 0; i < (TOTAL + NT2 - 1) / NT2; ++i) {
    if (TOTAL % NT2 == 0 || tid + i * NT2 < TOTAL) cp_async16_s(d, g);
    d += RSTEP * DST_PITCH;
    g += RSTEP * SRC_PITCH;
    asm volatile("" : "+r"(d), "+l"(g));
  }
}

// Issue the cp.async copies of one chunk record (this block's V slice of U0^T) into a stage.
__device__ __forceinline__ void prefetch_chunk(char* stage, const char* rec, int vb, int tid) {
  // W, Qd, Kr rows back to back: [3C][K] in the record, pitch KS in shared memory.
  copy_rows<3 * C, K / 8, KS * 2, K * 2>(stage, rec, tid);
  char* sm = stage + 3 * C * KS * 2;
  copy_rows<C, C / 8, CS * 2, C * 2>(sm, rec + OFF_M, tid);
  char* su = sm + C * CS * 2;
  copy_rows<BV, C / 8, CS * 2, C * 2>(su, rec + OFF_U + (long long)vb * BV * C * 2, tid);
  copy_rows<1, K / 4, 0, 0>(su + BV * CS * 2, rec + OFF_GM, tid);
}

// Ask L2 for BYTES from p (one prefetch per 128-byte line, spread over the block).
template <int BYTES>
__device__ __forceinline__ void l2_prefetch(const char* p, int tid) {
  constexpr int LINES = (BYTES + 127) / 128;
  const char* a = p + tid * 128;
#pragma unroll
  for (int i = 0; i < (LINES + NT2 - 1) / NT2; ++i) {
    if (LINES % NT2 == 0 || tid + i * NT2 < LINES) asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
    a += NT2 * 128;
    asm volatile("" : "+l"(a));
  }
}

// The record of a chunk two steps ahead: kda_prep wrote it and it usually sits in HBM only;
// the cp.async of the next step then finds it in L2 (the recurrence waits on these loads).
__device__ __forceinline__ void l2_prefetch_chunk(const char* rec, int vb, int tid) {
  l2_prefetch<(int)OFF_U>(rec, tid);
  l2_prefetch<BV * C * 2>(rec + OFF_U + (long long)vb * BV * C * 2, tid);
  l2_prefetch<K * 4>(rec + OFF_GM, tid);
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

// Write a staged [C, BV] o tile (rows < rows) with 16-byte stores, all threads of the block.
__device__ __forceinline__ void flush_o(in_t* op, long long ostride, const in_t* so, int rows, int tid) {
  constexpr int CH = BV / 8;
  for (int u = tid; u < C * CH; u += NT2) {
    const int t = u / CH, ch = u % CH;
    if (t < rows)
      *reinterpret_cast<uint4*>(op + t * ostride + ch * 8) = *reinterpret_cast<const uint4*>(so + t * OP + ch * 8);
  }
}

}  // namespace kda

extern "C" __global__ void __launch_bounds__(kda::NT2) kda_recur(const KdaParams p) {
  using namespace kda;
  extern __shared__ __align__(16) char smem2[];
  float4* xbuf = reinterpret_cast<float4*>(smem2 + 2 * STAGE);
  in_t* so = reinterpret_cast<in_t*>(smem2 + 2 * STAGE + XBUF);
  const int vb = blockIdx.x, n = blockIdx.y, h = blockIdx.z;
  int bos, len;
  seq_bounds(p, n, bos, len);
  const int nc = (len + C - 1) / C;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int vt = warp % NWV, kh = warp / NWV;  // 16-row V tile and K slice of this warp
  const int k0 = kh * KH;
  const int g8 = lane >> 2, t4 = lane & 3, lm = lane >> 3, lr = lane & 7;
  const int vr0 = vb * BV + vt * 16 + g8;
  const long long rec0 = (long long)bos / C + n;
  const char* wsb = (const char*)p.ws;
  const long long st_off = ((long long)n * p.HV + h) * V * K;
  const bool kv = p.state_kv != 0;

  float s[KH / 8][4];
#if KDA_STATE != 0
  if (p.h0) {
    const state_t* h0 = (const state_t*)p.h0 + st_off;
    if (kv) load_state_l<true>(h0, s, vr0, k0, t4);
    else load_state_l<false>(h0, s, vr0, k0, t4);
  } else
#endif
  {
#pragma unroll
    for (int nt = 0; nt < KH / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
  }

  const long long bidx = p.cu_seqlens ? 0 : n;
  const long long tb = p.cu_seqlens ? bos : 0;
  in_t* op = (in_t*)p.o + bidx * p.o_s[0] + h * p.o_s[2] + vb * BV;
  const long long ostride = p.o_s[1];
  const int coff = p.hc ? p.chunk_offsets[n] : 0;

  if (nc > 0) prefetch_chunk(smem2, wsb + (rec0 * p.HV + h) * REC, vb, tid);
  cp_async_commit();
  if (nc > 1) l2_prefetch_chunk(wsb + ((rec0 + 1) * p.HV + h) * REC, vb, tid);

  for (int c = 0; c < nc; ++c) {
    if (p.hc) {
#if KDA_STATE == 2
      store_state((bf16*)p.hc + ((long long)(coff + c) * p.HV + h) * V * K, s, vr0, k0, t4, kv);
#else
      store_state((float*)p.hc + ((long long)(coff + c) * p.HV + h) * V * K, s, vr0, k0, t4, kv);
#endif
    }
    // o of the previous chunk (staged last step; the barrier at its end made it visible)
    if (c > 0) flush_o(op + (tb + (long long)(c - 1) * C) * ostride, ostride, so, C, tid);
    if (c + 1 < nc)
      prefetch_chunk(smem2 + ((c + 1) & 1) * STAGE, wsb + ((rec0 + c + 1) * p.HV + h) * REC, vb, tid);
    cp_async_commit();
    if (c + 2 < nc) l2_prefetch_chunk(wsb + ((rec0 + c + 2) * p.HV + h) * REC, vb, tid);
    cp_async_wait<1>();
    __syncthreads();

    const bf16* sW = reinterpret_cast<const bf16*>(smem2 + (c & 1) * STAGE);
    const bf16* sQ = sW + C * KS;
    const bf16* sR = sQ + C * KS;
    const bf16* sMq = sR + C * KS;
    const bf16* sU = sMq + C * CS;
    const float* sGam = reinterpret_cast<const float*>(sU + BV * CS);

    // S slice as bf16 A fragments (accumulator layout == A layout).
    uint32_t sa[KH / 16][4];
#pragma unroll
    for (int ks = 0; ks < KH / 16; ++ks) {
      sa[ks][0] = pack_bf16(s[2 * ks][0], s[2 * ks][1]);
      sa[ks][1] = pack_bf16(s[2 * ks][2], s[2 * ks][3]);
      sa[ks][2] = pack_bf16(s[2 * ks + 1][0], s[2 * ks + 1][1]);
      sa[ks][3] = pack_bf16(s[2 * ks + 1][2], s[2 * ks + 1][3]);
    }
    // -U^T = S W^T - U0^T ([16 v, C]); the kh = 0 warp brings -U0^T, the others start at 0.
    float ut[C / 8][4];
    const int ur = vt * 16 + g8;
#pragma unroll
    for (int nt = 0; nt < C / 8; ++nt) {
      if (kh == 0) {
        const __nv_bfloat162 x0 = *reinterpret_cast<const __nv_bfloat162*>(sU + ur * CS + 8 * nt + 2 * t4);
        const __nv_bfloat162 x1 = *reinterpret_cast<const __nv_bfloat162*>(sU + (ur + 8) * CS + 8 * nt + 2 * t4);
        ut[nt][0] = -__low2float(x0); ut[nt][1] = -__high2float(x0);
        ut[nt][2] = -__low2float(x1); ut[nt][3] = -__high2float(x1);
      } else {
        ut[nt][0] = ut[nt][1] = ut[nt][2] = ut[nt][3] = 0.f;
      }
    }
#pragma unroll
    for (int ntp = 0; ntp < C / 16; ++ntp)
#pragma unroll
      for (int ks = 0; ks < KH / 16; ++ks) {
        const int row = 16 * ntp + 8 * (lm >> 1) + lr, col = k0 + 16 * ks + 8 * (lm & 1);
        uint32_t b[4];
        ldsm_x4(b, sW + row * KS + col);
        mma_bf16(ut[2 * ntp], sa[ks], b[0], b[1]);
        mma_bf16(ut[2 * ntp + 1], sa[ks], b[2], b[3]);
      }
    // Partial sums over this warp's K slice go through shared memory: U^T (needed by every warp
    // of the V tile) in slot `warp`, S Qd^T in slot NW2 + warp (summed by the kh = 0 warp).
    // Float4 j of lane l of slot q sits at (q * XF / 4 + j) * 32 + l: conflict-free.
    {
      if constexpr (KSPLIT > 1) {
        float4* xu = xbuf + (warp * (XF / 4)) * 32 + lane;
#pragma unroll
        for (int nt = 0; nt < C / 8; ++nt) xu[nt * 32] = make_float4(ut[nt][0], ut[nt][1], ut[nt][2], ut[nt][3]);
      }
      float4* xo = xbuf + ((NW2 + warp) * (XF / 4)) * 32 + lane;
#pragma unroll
      for (int ntp = 0; ntp < C / 16; ++ntp) {
        float oq[2][4] = {};
#pragma unroll
        for (int ks = 0; ks < KH / 16; ++ks) {
          const int row = 16 * ntp + 8 * (lm >> 1) + lr, col = k0 + 16 * ks + 8 * (lm & 1);
          uint32_t bq[4];
          ldsm_x4(bq, sQ + row * KS + col);
          mma_bf16(oq[0], sa[ks], bq[0], bq[1]);
          mma_bf16(oq[1], sa[ks], bq[2], bq[3]);
        }
        xo[(2 * ntp) * 32] = make_float4(oq[0][0], oq[0][1], oq[0][2], oq[0][3]);
        xo[(2 * ntp + 1) * 32] = make_float4(oq[1][0], oq[1][1], oq[1][2], oq[1][3]);
      }
    }
    __syncthreads();
    if constexpr (KSPLIT > 1) {
      // Sum the K slices in slot order, so all warps of a V tile get the same U bit for bit.
#pragma unroll
      for (int nt = 0; nt < C / 8; ++nt) {
        float4 a = xbuf[((vt * (XF / 4)) + nt) * 32 + lane];
#pragma unroll
        for (int q = 1; q < KSPLIT; ++q) {
          const float4 b = xbuf[(((q * NWV + vt) * (XF / 4)) + nt) * 32 + lane];
          a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w;
        }
        ut[nt][0] = a.x; ut[nt][1] = a.y; ut[nt][2] = a.z; ut[nt][3] = a.w;
      }
    }
    // U^T as bf16 A fragments.
    uint32_t ua[C / 16][4];
#pragma unroll
    for (int kc = 0; kc < C / 16; ++kc) {
      ua[kc][0] = pack_bf16(-ut[2 * kc][0], -ut[2 * kc][1]);
      ua[kc][1] = pack_bf16(-ut[2 * kc][2], -ut[2 * kc][3]);
      ua[kc][2] = pack_bf16(-ut[2 * kc + 1][0], -ut[2 * kc + 1][1]);
      ua[kc][3] = pack_bf16(-ut[2 * kc + 1][2], -ut[2 * kc + 1][3]);
    }
    if (kh == 0) {
      // o^T = sum of the S Qd^T slices + U^T Mqk^T (Mqk lower triangular: skip blocks above the
      // diagonal), 16 time steps at a time, staged in shared memory for 16-byte stores.
#pragma unroll
      for (int ntp = 0; ntp < C / 16; ++ntp) {
        float oacc[2][4];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          float4 a = xbuf[(((NW2 + vt) * (XF / 4)) + 2 * ntp + hh) * 32 + lane];
#pragma unroll
          for (int q = 1; q < KSPLIT; ++q) {
            const float4 b = xbuf[(((NW2 + q * NWV + vt) * (XF / 4)) + 2 * ntp + hh) * 32 + lane];
            a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w;
          }
          oacc[hh][0] = a.x; oacc[hh][1] = a.y; oacc[hh][2] = a.z; oacc[hh][3] = a.w;
        }
#pragma unroll
        for (int kc = 0; kc <= ntp; ++kc) {
          const int row = 16 * ntp + 8 * (lm >> 1) + lr, col = 16 * kc + 8 * (lm & 1);
          uint32_t b[4];
          ldsm_x4(b, sMq + row * CS + col);
          mma_bf16(oacc[0], ua[kc], b[0], b[1]);
          mma_bf16(oacc[1], ua[kc], b[2], b[3]);
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            so[(16 * ntp + 8 * hh + 2 * t4 + (e & 1)) * OP + vt * 16 + g8 + (e >> 1) * 8] = from_f<in_t>(oacc[hh][e]);
      }
    }
    // S = S diag(Gamma_C) + U^T Kr (this warp's K slice)
#pragma unroll
    for (int nt = 0; nt < KH / 8; ++nt) {
      const float2 gm = *reinterpret_cast<const float2*>(sGam + k0 + 8 * nt + 2 * t4);
      s[nt][0] *= gm.x; s[nt][1] *= gm.y; s[nt][2] *= gm.x; s[nt][3] *= gm.y;
    }
#pragma unroll
    for (int ntp = 0; ntp < KH / 16; ++ntp)
#pragma unroll
      for (int kc = 0; kc < C / 16; ++kc) {
        const int row = 16 * kc + 8 * (lm & 1) + lr, col = k0 + 16 * ntp + 8 * (lm >> 1);
        uint32_t b[4];
        ldsm_x4_t(b, sR + row * KS + col);
        mma_bf16(s[2 * ntp], ua[kc], b[0], b[1]);
        mma_bf16(s[2 * ntp + 1], ua[kc], b[2], b[3]);
      }
    // state "bf16": bf16 in memory (initial / final / chunk states); the register-held state
    // stays fp32 between chunks (rounding it every chunk costs accuracy and saves nothing).
    __syncthreads();
  }
  if (nc > 0) flush_o(op + (tb + (long long)(nc - 1) * C) * ostride, ostride, so, len - (nc - 1) * C, tid);
#if KDA_STATE != 0
  if (p.ht) store_state((state_t*)p.ht + st_off, s, vr0, k0, t4, kv);
#endif
}
