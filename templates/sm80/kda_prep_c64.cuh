// kdagen sm80: kda_prep for chunk 64.
#pragma once
#include "kda_prep.cuh"

static_assert(KDA_C == 64, "kda_prep_c64.cuh is the chunk-64 prep");

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
      b = beta_coef(p.beta_mode, x);
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
    int r, s;
    tri_pair(unit, r, s);
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
          l_mqk_mma(accL[nt], accM[nt], aK, aQ, bb[0], bb[1]);
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
        int ii, jj;
        tri_pair(pi, ii, jj);
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

