// kdagen sm80: kda_prep for chunk 16.
#pragma once
#include "kda_prep.cuh"

static_assert(KDA_C == 16, "kda_prep_c16.cuh is the chunk-16 prep");

// Chunk 16: one block per chunk, NT1 = 2K threads. Values live in registers in the layout each
// phase needs; shared memory carries only what crosses threads:
//   0. row-major: thread = (row, 8 columns) loads q, k, v, beta and L2-normalises q, k (shuffles
//      within the row); column-major: two threads per column activate the gate and cumsum it.
//   1. row-major: e^G, e^-G, e^(G_C - G) once per element -> Qd, Kr (workspace), the bf16 MMA
//      operands k e^G, q e^G, k e^-G, and X = [b k e^G | b v] split into bf16 hi + lo.
//   2. L and Mqk on tensor cores, split over K (two 16-column slices per warp at K >= 128).
//   3. partial sums in warp order (deterministic) -> L^T (shared), Mqk (workspace).
//   4. (I + L)^-1 by forward substitution, 16 threads, one column each, split into hi + lo.
//   5. [W | U0] = (I + L)^-1 X on tensor cores with split operands (hi hi + hi lo + lo hi:
//      about 16 mantissa bits, as good as the fp32 substitution for bf16 outputs).
// PRECISE (kda_layout.cuh) writes Mqk's diagonal in fp32 (phase 0), its strictly lower part in
// hi + lo (phase 3) and P^T = (diag(b) (I + L)^-T) in hi + lo (phase 4) in place of U0: it reads
// no v, and phase 5 forms W alone.
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
  // block waits for one memory round trip, not one per input (NOTES.md: the compiler otherwise
  // orders them by use).
  constexpr int GPR = K / 8;  // 8-column groups per row; C * GPR == NT1
  const int ri = tid / GPR, d = (tid % GPR) * 8;
  const bool live = ri < rows;
  const long long t = t0 + (live ? ri : rows - 1);  // rows past the end load a live row, zeroed below
  const uint4 rq = __ldg(reinterpret_cast<const uint4*>(qp + t * p.q_s[1] + d));
  const uint4 rk = __ldg(reinterpret_cast<const uint4*>(kp + t * p.k_s[1] + d));
  uint4 rv = make_uint4(0, 0, 0, 0);
  if constexpr (!PRECISE)
    rv = __ldg(reinterpret_cast<const uint4*>((const in_t*)p.v + bidx * p.v_s[0] + h * p.v_s[2] + t * p.v_s[1] + d));
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
    b = beta_coef(p.beta_mode, x);
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
    if constexpr (PRECISE) {  // Mqk's diagonal, scale <q^_i, k^_i> in fp32 (the gates cancel on it)
      float qk = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) qk += xq[e] * xk[e];
#pragma unroll
      for (int o = GPR / 2; o > 0; o >>= 1) qk += __shfl_xor_sync(0xffffffffu, qk, o);
      if (d == 0) reinterpret_cast<float*>(wsr + OFF_D)[ri] = p.scale * qk;
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
      if constexpr (!PRECISE) split_bf16(b * xv[e], b * xv[e + 1], xvh[e / 2], xvl[e / 2]);
    }
    *reinterpret_cast<uint4*>(sAK + ri * KB1 + d) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
    *reinterpret_cast<uint4*>(sAQ + ri * KB1 + d) = make_uint4(pq[0], pq[1], pq[2], pq[3]);
    *reinterpret_cast<uint4*>(sBK + ri * KB1 + d) = make_uint4(pb[0], pb[1], pb[2], pb[3]);
    *reinterpret_cast<uint4*>(sXh + ri * XB1 + d) = make_uint4(xkh[0], xkh[1], xkh[2], xkh[3]);
    *reinterpret_cast<uint4*>(sXl + ri * XB1 + d) = make_uint4(xkl[0], xkl[1], xkl[2], xkl[3]);
    if constexpr (!PRECISE) {
      *reinterpret_cast<uint4*>(sXh + ri * XB1 + K + d) = make_uint4(xvh[0], xvh[1], xvh[2], xvh[3]);
      *reinterpret_cast<uint4*>(sXl + ri * XB1 + K + d) = make_uint4(xvl[0], xvl[1], xvl[2], xvl[3]);
    }
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
        l_mqk_mma(accL[0], accM[0], ak, aq, bk[0], bk[1]);
        l_mqk_mma(accL[1], accM[1], ak, aq, bk[2], bk[3]);
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
          int i, j;
          tri_pair(pi, i, j);
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
    if constexpr (PRECISE) {  // strictly lower, hi + lo (the diagonal went out in fp32)
      const bf16 hi = __float2bfloat16_rn(i > j ? p.scale * m : 0.f);
      reinterpret_cast<bf16*>(wsr + OFF_M)[u] = hi;
      reinterpret_cast<bf16*>(wsr + OFF_M)[C * C + u] =
          __float2bfloat16_rn(i > j ? p.scale * m - __bfloat162float(hi) : 0.f);
    } else {
      reinterpret_cast<bf16*>(wsr + OFF_M)[u] = __float2bfloat16_rn(i >= j ? p.scale * m : 0.f);
    }
  }
  __syncthreads();

  // ---- 4. (I + L)^-1, column j on thread j: right-looking forward substitution on e_j.
  // PRECISE: column j times b_j is row j of P^T, C contiguous elements: hi and lo out in 16 bytes.
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
    if constexpr (PRECISE) {
      const float bj = sb[j];
      uint32_t ph[C / 2], pl[C / 2];
#pragma unroll
      for (int i = 0; i < C; i += 2) split_bf16(bj * x[i], bj * x[i + 1], ph[i / 2], pl[i / 2]);
      uint4* dst = reinterpret_cast<uint4*>(wsr + OFF_P + j * C * 2);
#pragma unroll
      for (int u = 0; u < C / 8; ++u) {
        dst[u] = make_uint4(ph[4 * u], ph[4 * u + 1], ph[4 * u + 2], ph[4 * u + 3]);
        dst[C * C / 8 + u] = make_uint4(pl[4 * u], pl[4 * u + 1], pl[4 * u + 2], pl[4 * u + 3]);
      }
    }
  }
  __syncthreads();

  // ---- 5. [W | U0] = (I + L)^-1 X: each warp takes 32 of the 2K columns (4 n-tiles of 8);
  // PRECISE: W alone, on the first half of the warps.
  {
    static_assert(2 * K == 32 * NW1, "chunk 16: 32 columns of [Kd | v] per warp");
    bf16* sWst = sAK;  // [C][KB1]  W rows
    bf16* sUst = sAQ;  // [V][UP1]  U0^T rows (C time steps each)
    if (!PRECISE || 32 * warp < K) {
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
          } else if constexpr (!PRECISE) {
            const int vv = col - K;
            const uint32_t hi[2] = {pack_bf16(acc[hh][0], acc[hh][1]), pack_bf16(acc[hh][2], acc[hh][3])};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const uint32_t pr = hi[e >> 1];
              sUst[(vv + (e & 1)) * UP1 + g8 + 8 * (e >> 1)] = __ushort_as_bfloat16((e & 1) ? pr >> 16 : pr & 0xffffu);
            }
          }
        }
      }
    }
    __syncthreads();
    for (int u = tid; u < C * K / 8; u += NT1) {
      const int i = u / (K / 8), ch = u % (K / 8);
      *reinterpret_cast<uint4*>(wsr + OFF_W + (i * K + ch * 8) * 2) =
          *reinterpret_cast<const uint4*>(sWst + i * KB1 + ch * 8);
    }
    for (int u = tid; u < (PRECISE ? 0 : V * 2); u += NT1) {
      const int vv = u >> 1, hf = u & 1;
      *reinterpret_cast<uint4*>(wsr + OFF_U + (vv * C + hf * 8) * 2) =
          *reinterpret_cast<const uint4*>(sUst + vv * UP1 + hf * 8);
    }
  }
}
