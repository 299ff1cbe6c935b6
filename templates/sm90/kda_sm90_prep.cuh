// kdagen sm90: the prep (NTP = 2K threads). Per chunk it turns the bulk-copied q, k, g rows (and
// beta, read from global one chunk ahead) into the chunk record the consumers read: Qd, W, Kr, Mqk,
// (I+L)^-1 diag(b) and Gamma_C. The arithmetic is the sm80 chunk-16 prep's (GPU-verified there);
// what differs is where inputs come from and where outputs go. Here: the bulk copies, the phases
// as functions, and prep_role, the prep as one group; kda_sm90_prep_pipe.cuh pipelines two groups.
#pragma once
#include "kda_sm90_layout.cuh"
#include "kda_chunk_math.cuh"

namespace kda {

// What both roles know about the CTA's (sequence, value head).
struct SeqInfo {
  int n, h, vb, len, nc;  // sequence, value head, V block (columns vb * BV ..), length, chunks
  long long bidx, tb;  // batch index (0 with cu_seqlens), first token of the sequence in its row
#if KDA_SM90_PAIR_ON
  int rank, nloc;      // the pair: this CTA's rank in the cluster, chunks it preps
#endif
};
// The chunks this CTA preps, and the global chunk of its local chunk j (the pair preps chunks rank,
// rank + 2, ..; compile-time identities otherwise).
__device__ __forceinline__ int pair_rank(const SeqInfo& si) {
#if KDA_SM90_PAIR_ON
  return si.rank;
#else
  return 0;
#endif
}
__device__ __forceinline__ int nlocal(const SeqInfo& si) {
#if KDA_SM90_PAIR_ON
  return si.nloc;
#else
  return si.nc;
#endif
}
#if KDA_SM90_PAIR_ON
#define KDA_GCHUNK(si, j) (2 * (j) + (si).rank)
#else
#define KDA_GCHUNK(si, j) (j)  // (a macro: as a function it changed the default images' scheduling)
#endif

// Row `row` of tensor `ten` (0 q, 1 k, 2 g, 3 v) of global chunk cc: its global source, its place in
// input stage st or V stage vs, and its bytes.
struct RowCopy {
  const char* src;
  char* dst;
  uint32_t bytes;
};
__device__ __forceinline__ RowCopy row_copy(const KdaParams& p, const SeqInfo& si, int cc, int ten, int row, char* base,
                                            int st, int vs) {
  const long long t = si.tb + (long long)cc * C + row;
  const int hq = si.h / p.group;
  char* const in = base + SM_IN + st * IN_BYTES;
  RowCopy rc;
  rc.bytes = QROW;
  if (ten == 0) {
    rc.src = (const char*)((const in_t*)p.q + si.bidx * p.q_s[0] + hq * p.q_s[2] + t * p.q_s[1]);
    rc.dst = in + IN_Q + row * QROW;
  } else if (ten == 1) {
    rc.src = (const char*)((const in_t*)p.k + si.bidx * p.k_s[0] + hq * p.k_s[2] + t * p.k_s[1]);
    rc.dst = in + IN_K + row * QROW;
  } else if (ten == 2) {
    const int gsz = p.g_fp32 ? 4 : 2;
    rc.src = (const char*)p.g + (si.bidx * p.g_s[0] + si.h * p.g_s[2] + t * p.g_s[1]) * gsz;
    rc.dst = in + IN_G + row * GROW;
    rc.bytes = K * gsz;
  } else {
    rc.src = (const char*)((const in_t*)p.v + si.bidx * p.v_s[0] + si.h * p.v_s[2] + t * p.v_s[1] + si.vb * BV);
    rc.dst = base + SM_V + vs * V_BYTES + row * VROW;
    rc.bytes = BV * 2;
  }
  return rc;
}

// Issue the bulk copies of chunk cc (q, k, g into its IN stage; v into its V stage) from the 32
// lanes of the prep group's copy warp. The IN stage was last read by the prep group's chunk
// cc - NIN, in phases 0-2 of that chunk (this runs in its phase 4); the V stage is released by
// the consumers (v_empty).
__device__ __forceinline__ void issue_chunk(const KdaParams& p, const SeqInfo& si, int cc, char* base, uint64_t* bars,
                                            int lane) {
  if (cc >= si.nc) return;
  const int st = cc % NIN, vs = cc % NV;
  const int rows = min(C, si.len - cc * C);
  const int gsz = p.g_fp32 ? 4 : 2;
  uint64_t* in_full = bars + B_IN_FULL + st;
  uint64_t* v_full = bars + B_V_FULL + vs;
  sm90::mbar_wait(bars + B_V_EMPTY + vs, ((cc / NV) & 1) ^ 1);
  if (lane == 0) {
    sm90::mbar_arrive_expect_tx(in_full, (uint32_t)rows * (2 * QROW + K * gsz));
    sm90::mbar_arrive_expect_tx(v_full, (uint32_t)rows * (BV * 2));
  }
  __syncwarp();
  if (lane < rows) {
#pragma unroll
    for (int ten = 0; ten < 4; ++ten) {
      const RowCopy rc = row_copy(p, si, cc, ten, lane, base, st, vs);
      sm90::bulk_g2s(rc.dst, rc.src, rc.bytes, ten == 3 ? v_full : in_full);
    }
  }
}

// The same copies as issue_chunk, spread over NW warps (default COPY_NW) (w = 0 .. NW - 1): copy
// pi = w + NW * lane is tensor pi % 4 (q, k, g, v) of row pi / 4, one per lane, so each
// warp's serial loop over distinct uniform operands is ~4 C / NW copies instead of 4 C.
// The expect_tx may follow another warp's complete_tx (the tx-count may go negative; the phase
// still needs the arrival). Every issuing warp waits for the V stage before any copy.
template <int NW = COPY_NW>
__device__ __forceinline__ void issue_chunk_spread(const KdaParams& p, const SeqInfo& si, int cc, char* base,
                                                   uint64_t* bars, int w, int lane) {
  if (cc >= si.nc) return;
  const int st = cc % NIN, vs = cc % NV;
  const int rows = min(C, si.len - cc * C);
  const int gsz = p.g_fp32 ? 4 : 2;
  uint64_t* in_full = bars + B_IN_FULL + st;
  uint64_t* v_full = bars + B_V_FULL + vs;
  sm90::mbar_wait(bars + B_V_EMPTY + vs, ((cc / NV) & 1) ^ 1);
  if (w == 0 && lane == 0) {
    sm90::mbar_arrive_expect_tx(in_full, (uint32_t)rows * (2 * QROW + K * gsz));
    sm90::mbar_arrive_expect_tx(v_full, (uint32_t)rows * (BV * 2));
  }
  const int pi = w + NW * lane, ten = pi & 3, row = pi >> 2;
  if (row < rows) {
    const RowCopy rc = row_copy(p, si, cc, ten, row, base, st, vs);
    sm90::bulk_g2s(rc.dst, rc.src, rc.bytes, ten == 3 ? v_full : in_full);
  }
}

// The pair's copies. issue_qkg: q, k, g rows of local chunk j (global KDA_GCHUNK(j)) into input stage
// j % NIN, from NW warps (copy pi = w + NW lane: tensor pi / C, row pi % C). issue_v: the v rows of
// global chunk cc into V stage cc % NV, one row per lane of the NW consumer warps.
template <int NW>
__device__ __forceinline__ void issue_qkg(const KdaParams& p, const SeqInfo& si, int j, char* base, uint64_t* bars,
                                          int w, int lane) {
  if (j >= nlocal(si)) return;
  const int cc = KDA_GCHUNK(si, j), st = j % NIN;
  const int rows = min(C, si.len - cc * C);
  const int gsz = p.g_fp32 ? 4 : 2;
  uint64_t* in_full = bars + B_IN_FULL + st;
  if (w == 0 && lane == 0) sm90::mbar_arrive_expect_tx(in_full, (uint32_t)rows * (2 * QROW + K * gsz));
  const int pi = w + NW * lane, ten = pi / C, row = pi % C;
  if (ten < 3 && row < rows) {
    const RowCopy rc = row_copy(p, si, cc, ten, row, base, st, 0);
    sm90::bulk_g2s(rc.dst, rc.src, rc.bytes, in_full);
  }
}
template <int NW>
__device__ __forceinline__ void issue_v(const KdaParams& p, const SeqInfo& si, int cc, char* base, uint64_t* bars,
                                        int w, int lane) {
  if (cc >= si.nc) return;
  const int vs = cc % NV;
  const int rows = min(C, si.len - cc * C);
  uint64_t* v_full = bars + B_V_FULL + vs;
  sm90::mbar_wait(bars + B_V_EMPTY + vs, ((cc / NV) & 1) ^ 1);
  if (w == 0 && lane == 0) sm90::mbar_arrive_expect_tx(v_full, (uint32_t)rows * (BV * 2));
  const int row = w + NW * lane;
  if (row < rows) {
    const RowCopy rc = row_copy(p, si, cc, 3, row, base, 0, vs);
    sm90::bulk_g2s(rc.dst, rc.src, rc.bytes, v_full);
  }
}

// beta of row ri of chunk cc (raw bits: fp32, or the input type in the low 16 bits).
__device__ __forceinline__ uint32_t load_beta(const KdaParams& p, const SeqInfo& si, int cc, int ri) {
  if (cc >= si.nc) return 0u;
  const int rows = min(C, si.len - cc * C);
  const long long t = si.tb + (long long)cc * C + min(ri, rows - 1);
  const long long bo = si.bidx * p.b_s[0] + t * p.b_s[1] + si.h * p.b_s[2];
  return p.beta_fp32 ? __ldg(reinterpret_cast<const unsigned*>(p.beta) + bo)
                     : (uint32_t)__ldg(reinterpret_cast<const unsigned short*>(p.beta) + bo);
}

// The prep's phases as functions of the shared base and the chunk, used by prep_role (one group) and
// by the pipelined groups (kda_sm90_prep_pipe.cuh). There phases 0-1 of chunk c (group A) write the
// scratch set of chunk parity c & 1 and phases 2-5 (group B) read it (S_HALF = 0 without the
// pipeline: one set); spart, sLT, sInv are B's own. Each function names its arrays with this macro.
__device__ __forceinline__ int scr_set(int c) { return (c & 1) * S_HALF; }
constexpr float LOG2E = 1.4426950408889634f;  // log2(e): natural units to log2 units (GFOLD, G2)
// e^x of a cumulative-gate value x (G2: 2^x, x in log2 units, one MUFU.EX2 without the multiply by log2(e)), and the
// gate span (natural units: 80) past which a 16-column slice of L / Mqk takes the exact fallback.
__device__ __forceinline__ float gexp(float x) {
  if constexpr (G2) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  } else {
    return __expf(x);
  }
}
constexpr float SPAN_MAX = G2 ? 80.f * LOG2E : 80.f;
// m softplus(t) in log2 units for t in log2 units: m (max(t, 0) + log2(1 + 2^-|t|)) (GSOFT). The MUFU ops' error is
// ~2^-22 absolute in the log term; 2^-|t| flushes to 0 past |t| = 126, where softplus is t or 0 in fp32 anyway.
__device__ __forceinline__ float softplus2(float t, float m) {
  float l;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(l) : "f"(1.f + gexp(-fabsf(t))));  // (GSOFT implies G2: gexp is ex2)
  return m * (fmaxf(t, 0.f) + l);
}
#define KDA_PREP_SCRATCH(base, c)                                                         \
  char* const scr = (base) + SM_SCR;                                                       \
  char* const scs = scr + scr_set(c);                                                      \
  float* const sG = reinterpret_cast<float*>(scs + S_G);                                   \
  float* const srq = reinterpret_cast<float*>(scs + S_RQ);                                 \
  float* const srk = reinterpret_cast<float*>(scs + S_RK);                                 \
  float* const sdg = reinterpret_cast<float*>(scs + S_DG);                                 \
  bf16* const sAK = reinterpret_cast<bf16*>(scs + S_AK);                                   \
  bf16* const sAQ = reinterpret_cast<bf16*>(scs + S_AQ);                                   \
  bf16* const sBK = reinterpret_cast<bf16*>(scs + S_BK);                                   \
  bf16* const sXh = reinterpret_cast<bf16*>(scs + S_XH);                                   \
  bf16* const sXl = reinterpret_cast<bf16*>(scs + S_XL);                                   \
  char* const sown = scr + ((c) & 1) * S_OWN2; /* group B's arrays (by parity with DUAL) */ \
  float* const spart = reinterpret_cast<float*>(sown + S_PART);                            \
  float* const sLT = reinterpret_cast<float*>(sown + S_LT);                                \
  float* const sbc = reinterpret_cast<float*>(scr + S_B) + ((c) & 1) * C; /* by parity */  \
  float* const sInv = reinterpret_cast<float*>(sown + S_INV);                              \
  const char* const in = (base) + SM_IN + ((c) % NIN) * IN_BYTES;                          \
  char* const rec = (base) + SM_REC + ((c) % NREC) * REC_BYTES;                            \
  (void)sG; (void)srq; (void)srk; (void)sdg; (void)sAK; (void)sAQ; (void)sBK; (void)sXh;  \
  (void)sXl; (void)spart; (void)sLT; (void)sbc; (void)sInv; (void)in; (void)rec

// Phase 0's shared-memory reads of one pass (row ri, columns d .. d + 7; gate column col, rows
// 8 half .. 8 half + 7). Group A reads both passes before either writes: the compiler cannot move a
// shared load above a possibly aliasing shared store, so loads inside each pass would serialise
// the two passes (ncu: group A issued once per ~5 cycles per warp).
struct P0In {
  uint4 rq, rk;
  float gx[8];
};
__device__ __forceinline__ P0In prep_phase0_load(const KdaParams& p, const char* base, int c, int ri, int d, int col,
                                                 int half) {
  const char* const in = base + SM_IN + (c % NIN) * IN_BYTES;
  P0In x;
  x.rq = *reinterpret_cast<const uint4*>(in + IN_Q + ri * QROW + d * 2);
  x.rk = *reinterpret_cast<const uint4*>(in + IN_K + ri * QROW + d * 2);
  const char* gp = in + IN_G + (8 * half) * GROW;
#pragma unroll
  for (int j = 0; j < 8; ++j)
    x.gx[j] = p.g_fp32 ? reinterpret_cast<const float*>(gp + j * GROW)[col]
                       : to_f(reinterpret_cast<const in_t*>(gp + j * GROW)[col]);
  return x;
}

// ---- 0. inputs of row ri, columns d .. d + 7 (read into ld; rows past the end are stale shared
// memory: selected away, never multiplied), and the gate cumsum of column col, rows 8 half ..
// 8 half + 7. The caller has waited for the record slot and the input stage.
__device__ __forceinline__ void prep_phase0(const KdaParams& p, char* base, int c, int rows, int ri, int d, int col,
                                            int half, uint32_t rb, float aexp, float bias, const P0In& ld,
                                            float (&xq)[8], float (&xk)[8], float& b) {
  constexpr int GPR = K / 8;
  KDA_PREP_SCRATCH(base, c);
  const bool live = ri < rows;
  unpack8<in_t>(ld.rq, xq);
  unpack8<in_t>(ld.rk, xk);
  if (!live) {
#pragma unroll
    for (int e = 0; e < 8; ++e) xq[e] = xk[e] = 0.f;
  }
  b = 0.f;
  if (live) {
    const float x = p.beta_fp32 ? __uint_as_float(rb) : to_f(bits_as<in_t>(rb));
    b = beta_coef(p.beta_mode, x);
  }
  {
    const float lbg = G2 ? p.lower_bound * LOG2E : p.lower_bound;  // (G2: log2 units)
    float a[8];
    float run = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      // activated unconditionally, then selected: rows past the end do not decay
      float act;
      if constexpr (GFOLD) act = lbg * (1.f / (1.f + exp2f(fmaf(ld.gx[j], aexp, bias))));
      else if constexpr (GSOFT) act = softplus2(fmaf(ld.gx[j], LOG2E, bias), aexp);
      else act = gate_act(ld.gx[j] + bias, aexp, p.lower_bound);
      run += 8 * half + j < rows ? act : 0.f;
      a[j] = run;
    }
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
    if (half) reinterpret_cast<float*>(rec + R_GM)[col] = gexp(a[7]);
  }
  {
    float aq = QFOLD ? p.scale : 1.f, ak = 1.f;
    if (p.use_l2norm) {
      aq = ak = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) { aq += xq[e] * xq[e]; ak += xk[e] * xk[e]; }
#pragma unroll
      for (int o = GPR / 2; o > 0; o >>= 1) {
        aq += __shfl_xor_sync(0xffffffffu, aq, o);
        ak += __shfl_xor_sync(0xffffffffu, ak, o);
      }
      aq = QFOLD ? p.scale * rsqrtf(aq + 1e-6f) : rsqrtf(aq + 1e-6f);
      ak = rsqrtf(ak + 1e-6f);
#pragma unroll
      for (int e = 0; e < 8; ++e) { xq[e] *= aq; xk[e] *= ak; }
    } else if constexpr (QFOLD) {
#pragma unroll
      for (int e = 0; e < 8; ++e) xq[e] *= aq;
    }
    // Mqk's diagonal is <q^_i, k^_i> (the decays cancel): in fp32 here, not from bf16 operands
    // (the largest single error of o otherwise: rel RMSE 4.0e-3 -> 3.1e-3 in the emulation).
    float dqk = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) dqk += xq[e] * xk[e];
#pragma unroll
    for (int o = GPR / 2; o > 0; o >>= 1) dqk += __shfl_xor_sync(0xffffffffu, dqk, o);
    if (d == 0) {
      sbc[ri] = b;
      srq[ri] = aq;
      srk[ri] = ak;
      sdg[ri] = dqk;
    }
  }
}

// ---- 1. decays of row ri, columns d .. d + 7, once per element; Qd and Kr into the record
// Eight consecutive fp32 of the cumulative gate (row r, columns d .. d + 7).
__device__ __forceinline__ void prep_gate_row(const char* base, int c, int r, int d, float (&G)[8]) {
  const float* sG = reinterpret_cast<const float*>(base + SM_SCR + scr_set(c) + S_G);
  const float4* gp = reinterpret_cast<const float4*>(sG + r * KP + d);
  const float4 x0 = gp[0], x1 = gp[1];
  G[0] = x0.x; G[1] = x0.y; G[2] = x0.z; G[3] = x0.w; G[4] = x1.x; G[5] = x1.y; G[6] = x1.z; G[7] = x1.w;
}

// G: the cumulative gate of row ri, GL of the chunk's last row (columns d .. d + 7), read by the
// caller before any phase-1 store (see P0In).
__device__ __forceinline__ void prep_phase1(const KdaParams& p, char* base, int c, int ri, int d, const float (&xq)[8],
                                            const float (&xk)[8], float b, const float (&G)[8], const float (&GL)[8]) {
  KDA_PREP_SCRATCH(base, c);
  uint32_t pk[4], pq[4], pb[4], pqd[4], pkr[4], xkh[4], xkl[4];
#pragma unroll
  for (int e = 0; e < 8; e += 2) {
    const float e0 = gexp(G[e]), e1 = gexp(G[e + 1]);
    const float i0 = gexp(-G[e]), i1 = gexp(-G[e + 1]);
    const float k0 = xk[e] * e0, k1 = xk[e + 1] * e1, q0 = xq[e] * e0, q1 = xq[e + 1] * e1;
    pk[e / 2] = pack_bf16(k0, k1);
    pq[e / 2] = pack_bf16(q0, q1);
    pqd[e / 2] = QFOLD ? pack_bf16(q0, q1) : pack_bf16(p.scale * q0, p.scale * q1);  // (QFOLD: xq has the scale)
    pb[e / 2] = pack_bf16(xk[e] * i0, xk[e + 1] * i1);
    pkr[e / 2] = pack_bf16(xk[e] * gexp(GL[e] - G[e]), xk[e + 1] * gexp(GL[e + 1] - G[e + 1]));
    if constexpr (!UKG) split_bf16(b * k0, b * k1, xkh[e / 2], xkl[e / 2]);
  }
  if constexpr (!UKG) {  // (the Kg record: phase 2 reads the record's Kg and Qd instead)
    *reinterpret_cast<uint4*>(sAK + ri * KB1 + d) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
    *reinterpret_cast<uint4*>(sAQ + ri * KB1 + d) = make_uint4(pq[0], pq[1], pq[2], pq[3]);
  }
  *reinterpret_cast<uint4*>(sBK + ri * KB1 + d) = make_uint4(pb[0], pb[1], pb[2], pb[3]);
  if constexpr (YO) {  // -Kg (sign bits flipped) in rows 0 .. C-1 of the [2C][K] tile of -Kg and Qd
    constexpr uint32_t ng = 0x80008000u;
    *reinterpret_cast<uint4*>(rec + sm90::sw128_k<2 * C>(ri, d)) = make_uint4(pk[0] ^ ng, pk[1] ^ ng, pk[2] ^ ng, pk[3] ^ ng);
  } else if constexpr (UKG) {  // Kg [j][K] in the W slot (the consumers' B of S Kg^T)
    *reinterpret_cast<uint4*>(rec + R_W + sm90::sw128_k<C>(ri, d)) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
  } else {
    *reinterpret_cast<uint4*>(sXh + ri * KB1 + d) = make_uint4(xkh[0], xkh[1], xkh[2], xkh[3]);
    *reinterpret_cast<uint4*>(sXl + ri * KB1 + d) = make_uint4(xkl[0], xkl[1], xkl[2], xkl[3]);
  }
  // Qd [i][K] and Kr [j][K]: 16-byte pieces of one row; in the swizzled tiles the 8 pieces
  // a quarter-warp writes are one 128-byte row of an atom (conflict-free).
  if constexpr (YO) {  // rows C .. 2C - 1 of the [2C][K] tile
    *reinterpret_cast<uint4*>(rec + sm90::sw128_k<2 * C>(C + ri, d)) = make_uint4(pqd[0], pqd[1], pqd[2], pqd[3]);
  } else {
    *reinterpret_cast<uint4*>(rec + R_QD + sm90::sw128_k<C>(ri, d)) = make_uint4(pqd[0], pqd[1], pqd[2], pqd[3]);
  }
  *reinterpret_cast<uint4*>(rec + R_KR + sm90::sw128_mn<K>(ri, d)) = make_uint4(pkr[0], pkr[1], pkr[2], pkr[3]);
}

// ---- 2. L (b, strictly lower) and Mqk (scale, lower incl. diagonal) partials of the K slices of
// L/Mqk warp w = warp - W0 (< NMW). The anchor is G = 0 before the chunk: <q_i e^{G_i}, k_j e^{-G_j}> with
// e^{-G_j} <= e^{span}; a slice with span > 80 (beyond fp32/bf16 range) uses exact pairwise
// exp(G_i - G_j) on CUDA cores, reading q and k again from the input stage (rare: only for extreme
// gates). in_full (or nullptr): the input stage's barrier, waited before that read where the
// stage's own wait was another warp's.
template <int W0>
__device__ __forceinline__ void prep_phase2(char* base, int c, int rows, float scale, uint64_t* in_full = nullptr,
                                            uint32_t in_parity = 0) {
  const int tid = threadIdx.x, lane = tid & 31, w = (tid >> 5) - W0;
  KDA_PREP_SCRATCH(base, c);
  const int g8 = lane >> 2, t4 = lane & 3, lm = lane >> 3, lr = lane & 7;
  if (w >= NMW) return;
  float accL[2][4] = {}, accM[2][4] = {};
  unsigned fallback = 0;
#pragma unroll
  for (int sl = 0; sl < SPW; ++sl) {
    const int c0 = 16 * (w * SPW + sl);
    bool near;
    if constexpr (SPAN_VOTE) {  // (one vote instead of a five-shuffle max chain; the same decision)
      near = !__any_sync(0xffffffffu, lane < 16 && -sG[(C - 1) * KP + c0 + lane] > SPAN_MAX);
    } else {
      float span = lane < 16 ? -sG[(C - 1) * KP + c0 + lane] : 0.f;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) span = fmaxf(span, __shfl_xor_sync(0xffffffffu, span, o));
      near = span <= SPAN_MAX;
    }
    if (near) {
      uint32_t ak[4], aq[4], bk[4];
      const int ar = lr + 8 * (lm & 1), ac = c0 + 8 * (lm >> 1);  // A fragment: row, 8 columns
      if constexpr (YO) {  // -Kg and Qd (scale included) in the record's [2C][K] tile
        ldsm_x4(ak, rec + sm90::sw128_k<2 * C>(ar, ac));
        ldsm_x4(aq, rec + sm90::sw128_k<2 * C>(C + ar, ac));
      } else if constexpr (UKG) {  // Kg and Qd (scale included) in the record's tiles
        ldsm_x4(ak, rec + R_W + sm90::sw128_k<C>(ar, ac));
        ldsm_x4(aq, rec + R_QD + sm90::sw128_k<C>(ar, ac));
      } else {
        ldsm_x4(ak, sAK + ar * KB1 + ac);
        ldsm_x4(aq, sAQ + ar * KB1 + ac);
      }
      ldsm_x4(bk, sBK + (lr + 8 * (lm >> 1)) * KB1 + c0 + 8 * (lm & 1));
      mma_bf16(accL[0], ak, bk[0], bk[1]);
      mma_bf16(accL[1], ak, bk[2], bk[3]);
      mma_bf16(accM[0], aq, bk[0], bk[1]);
      mma_bf16(accM[1], aq, bk[2], bk[3]);
    } else {
      fallback |= 1u << sl;
    }
  }
  float* pL = spart + w * 512;
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
    if (in_full) sm90::mbar_wait(in_full, in_parity);
    for (int sl = 0; sl < SPW; ++sl) {
      if (!(fallback >> sl & 1u)) continue;
      const int c0 = 16 * (w * SPW + sl);
      for (int pi = lane; pi < 136; pi += 32) {
        int i = (int)((sqrtf(8.f * pi + 1.f) - 1.f) * 0.5f);
        while ((i + 1) * (i + 2) / 2 <= pi) ++i;
        while (i * (i + 1) / 2 > pi) --i;
        const int j = pi - i * (i + 1) / 2;
        if (i >= rows) continue;  // q_i = k_i = 0 (and j <= i)
        const in_t* qi = reinterpret_cast<const in_t*>(in + IN_Q + i * QROW);
        const in_t* ki = reinterpret_cast<const in_t*>(in + IN_K + i * QROW);
        const in_t* kj = reinterpret_cast<const in_t*>(in + IN_K + j * QROW);
        float l = 0.f, m = 0.f;
        for (int dd = c0; dd < c0 + 16; ++dd) {
          const float wv = gexp(sG[i * KP + dd] - sG[j * KP + dd]) * to_f(kj[dd]);
          l += to_f(ki[dd]) * wv;
          m += to_f(qi[dd]) * wv;
        }
        // (the Kg record's MMA partials are of -L with YO, and of Mqk with the scale included)
        pL[i * 16 + j] += (YO ? -l : l) * srk[i] * srk[j];
        pM[i * 16 + j] += (UKG && !QFOLD ? scale * m : m) * srq[i] * srk[j];  // (QFOLD: srq has the scale)
      }
    }
  }
}

// Entry (i, j) of a 16 x 16 record tile pair (interleaved K-major at offsets hi, lo): x as bf16 and what it rounded off.
__device__ __forceinline__ void put_hl(char* rec, int hi, int lo, int i, int j, float x) {
  const bf16 xh = __float2bfloat16_rn(x);
  *reinterpret_cast<bf16*>(rec + hi + sm90::il16_k(i, j)) = xh;
  *reinterpret_cast<bf16*>(rec + lo + sm90::il16_k(i, j)) = __float2bfloat16_rn(x - __bfloat162float(xh));
}

// ---- 3. sum the partials in warp order; Mqk (hi + lo bf16) into the record (u = u0, u0 + STEP ..)
template <int STEP>
__device__ __forceinline__ void prep_phase3(const KdaParams& p, char* base, int c, int u0) {
  KDA_PREP_SCRATCH(base, c);
  if constexpr (P3U) {
    // every entry's loads first, then selects (no branches): the loop as written compiled to a branchy loop with
    // one entry's loads in flight at a time
    static_assert(256 % STEP == 0, "phase 3: whole entries per thread");
    constexpr int NU = 256 / STEP;
    float l[NU], m[NU], dg[NU], bi[NU];
#pragma unroll
    for (int it = 0; it < NU; ++it) {
      const int u = u0 + it * STEP;
      l[it] = m[it] = 0.f;
#pragma unroll
      for (int w = 0; w < NMW; ++w) {
        l[it] += spart[w * 512 + u];
        m[it] += spart[w * 512 + 256 + u];
      }
      dg[it] = sdg[u >> 4];
      bi[it] = sbc[u >> 4];
    }
#pragma unroll
    for (int it = 0; it < NU; ++it) {
      const int u = u0 + it * STEP, i = u >> 4, j = u & 15;
      if (i > j) sLT[j * CP + i] = bi[it] * (YO ? -l[it] : l[it]);  // (YO: the partials are of -Kg)
      const float mq = i > j ? (UKG ? m[it] : p.scale * m[it]) : i == j ? (QFOLD ? dg[it] : p.scale * dg[it]) : 0.f;
      put_hl(rec, R_MQ, R_ML, i, j, mq);
    }
    return;
  }
  for (int u = u0; u < 256; u += STEP) {
    const int i = u >> 4, j = u & 15;
    float l = 0.f, m = 0.f;
#pragma unroll
    for (int w = 0; w < NMW; ++w) {
      l += spart[w * 512 + u];
      m += spart[w * 512 + 256 + u];
    }
    if (i > j) sLT[j * CP + i] = sbc[i] * (YO ? -l : l);  // (YO: the partials are of -Kg)
    const float mq = i > j ? (UKG ? m : p.scale * m) : i == j ? (QFOLD ? sdg[i] : p.scale * sdg[i]) : 0.f;  // (UKG: Qd has the scale)
    put_hl(rec, R_MQ, R_ML, i, j, mq);
  }
}

// ---- 4. (I + L)^-1, column j on thread j (< C): right-looking forward substitution on e_j, into
// shared memory in fp32 (the conversions are spread over every thread in phase 5).
__device__ __forceinline__ void prep_phase4(char* base, int c, int j) {
  KDA_PREP_SCRATCH(base, c);
  float x[C];
#pragma unroll
  for (int i = 0; i < C; ++i) x[i] = i == j ? 1.f : 0.f;
  forward_subst(x, sLT);
#pragma unroll
  for (int i = 0; i < C; ++i) sInv[i * IPF + j] = x[i];
}

// ---- 5a. (I + L)^-1 diag(b) (hi + lo) into the record for the consumers' U0 = A^-1 (b v)
template <int STEP>
__device__ __forceinline__ void prep_phase5_ainv(char* base, int c, int u0) {
  KDA_PREP_SCRATCH(base, c);
#pragma unroll
  for (int u = u0; u < (P3U ? u0 + 256 : 256); u += STEP) {  // (P3U: unrolled, 256 / STEP entries per thread)
    const int i = u >> 4, j = u & 15;
    const float y = sInv[i * IPF + j] * sbc[j];
    put_hl(rec, R_AH, R_AL, i, j, y);
  }
}
// ---- 5b. A fragments of (I + L)^-1 (rows g8, g8 + 8; columns 2 t4 (+ 8)), split hi + lo
__device__ __forceinline__ void prep_inv_frags(char* base, int c, int lane, uint32_t (&ah)[4], uint32_t (&al)[4]) {
  KDA_PREP_SCRATCH(base, c);
  const int g8 = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 x = *reinterpret_cast<const float2*>(sInv + (g8 + 8 * (q & 1)) * IPF + 2 * t4 + 8 * (q >> 1));
    split_bf16(x.x, x.y, ah[q], al[q]);
  }
}
// ---- 5c. W = (I + L)^-1 X (X = b k e^G, split hi + lo: hi hi + hi lo + lo hi), columns 16 n .. 16 n + 15,
// into the record (4-byte pieces: 8 rows x 16 bytes of one atom row chunk per warp store).
__device__ __forceinline__ void prep_w16(char* base, int c, const uint32_t (&ah)[4], const uint32_t (&al)[4], int n) {
  const int tid = threadIdx.x, lane = tid & 31, n0 = 16 * n;
  KDA_PREP_SCRATCH(base, c);
  const int g8 = lane >> 2, t4 = lane & 3, lm = lane >> 3, lr = lane & 7;
  uint32_t bh[4], bl[4];
  ldsm_x4_t(bh, sXh + (lr + 8 * (lm & 1)) * KB1 + n0 + 8 * (lm >> 1));
  ldsm_x4_t(bl, sXl + (lr + 8 * (lm & 1)) * KB1 + n0 + 8 * (lm >> 1));
  float acc[2][4] = {};
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    mma_bf16(acc[hh], al, bh[2 * hh], bh[2 * hh + 1]);
    mma_bf16(acc[hh], ah, bl[2 * hh], bl[2 * hh + 1]);
    mma_bf16(acc[hh], ah, bh[2 * hh], bh[2 * hh + 1]);
  }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int cl = n0 + 8 * hh + 2 * t4;
    *reinterpret_cast<uint32_t*>(rec + R_W + sm90::sw128_k<C>(g8, cl)) = pack_bf16(acc[hh][0], acc[hh][1]);
    *reinterpret_cast<uint32_t*>(rec + R_W + sm90::sw128_k<C>(g8 + 8, cl)) = pack_bf16(acc[hh][2], acc[hh][3]);
  }
}

// Gate constants of column col (A_log's exponent; dt_bias or 0). GFOLD: the bounded gate's affine part folded for
// phase 0's one FFMA, act = lb / (1 + 2^(x m + a)) with m = -e^A_log log2(e), a = m dt_bias. GSOFT: m = -e^A_log and
// a = dt_bias log2(e), act = softplus2(x log2(e) + a, m).
__device__ __forceinline__ float gate_aexp(const KdaParams& p, const SeqInfo& si) {
#if KDA_GATE != 2
  const float e = __expf(__ldg(p.A_log + si.h));
  return GFOLD ? -e * LOG2E : GSOFT ? -e : e;
#else
  return 0.f;
#endif
}
__device__ __forceinline__ float gate_bias(const KdaParams& p, const SeqInfo& si, int col) {
#if KDA_GATE != 2
  const float b = p.dt_bias ? __ldg(p.dt_bias + si.h * K + col) : 0.f;
  return GFOLD ? gate_aexp(p, si) * b : GSOFT ? b * LOG2E : b;
#else
  return 0.f;
#endif
}

// The prep as one group of NTP threads, one chunk at a time (K = 64, or KDA_SM90_PREP_PIPE=0): the
// phases in order, with the prep's named barrier between them; the copies as COPY_MODE says.
__device__ __forceinline__ void prep_role(const KdaParams& p, const SeqInfo& si, char* base, uint64_t* bars) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int GPR = K / 8;  // 8-column groups per row; C * GPR == NTP
  const int ri = tid / GPR, d = (tid % GPR) * 8;
  // Gate, column-major: lanes 0-15 take rows 0-7 of 16 columns, lanes 16-31 rows 8-15.
  const int col = (lane & 15) + 16 * warp, half = lane >> 4;
  const float aexp = gate_aexp(p, si), bias = gate_bias(p, si, col);
  // The copy warp (modes 0): the last prep warp, which has no part in the substitution (phase 4,
  // warp 0), issues chunk c + NIN during phase 4 of chunk c, into the stage chunk c has finished
  // reading; mode 2 issues chunk c + NIN - 1 in phase 2 of chunk c, so the prologue stops one short.
  constexpr int COPY_WARP = NWP - 1;
  if (warp == COPY_WARP) {
    for (int cc = 0; cc < (COPY_MODE == 2 ? NIN - 1 : NIN); ++cc) issue_chunk(p, si, cc, base, bars, lane);
  }
  uint32_t rb_next = load_beta(p, si, 0, ri);

  for (int c = 0; c < si.nc; ++c) {
    const uint32_t rb = rb_next;
    rb_next = load_beta(p, si, c + 1, ri);  // one chunk ahead: its latency hides behind this chunk
    const int rows = min(C, si.len - c * C);
    const int r = c % NREC;
    // The record slot is free once the consumers finished chunk c - NREC with it.
    sm90::mbar_wait(bars + B_REC_EMPTY + r, ((c / NREC) & 1) ^ 1);
    sm90::mbar_wait(bars + B_IN_FULL + (c % NIN), (c / NIN) & 1);
    float xq[8], xk[8], b;
    prep_phase0(p, base, c, rows, ri, d, col, half, rb, aexp, bias, prep_phase0_load(p, base, c, ri, d, col, half),
                xq, xk, b);
    sm90::named_sync<BAR_PREP, NTP>();
    {
      float G[8], GL[8];
      prep_gate_row(base, c, ri, d, G);
      prep_gate_row(base, c, C - 1, d, GL);
      prep_phase1(p, base, c, ri, d, xq, xk, b, G, GL);
    }
    sm90::named_sync<BAR_PREP, NTP>();
    // Mode 2: the warps without an L/Mqk slice refill the stage of chunk c - 1 (last read in its
    // phase 2) with chunk c + NIN - 1.
    if constexpr (COPY_MODE == 2) {
      if (warp >= COPY_W0) issue_chunk_spread(p, si, c + NIN - 1, base, bars, warp - COPY_W0, lane);
    }
    prep_phase2<0>(base, c, rows, p.scale);
    sm90::named_sync<BAR_PREP, NTP>();
    prep_phase3<NTP>(p, base, c, tid);
    sm90::named_sync<BAR_PREP, NTP>();
    // Meanwhile (modes 0, 1) the copies refill the input stage of this chunk (read for the last
    // time in phase 2).
    if (tid < C) prep_phase4(base, c, tid);
    if constexpr (COPY_MODE == 0) {
      if (warp == COPY_WARP) issue_chunk(p, si, c + NIN, base, bars, lane);
    } else if constexpr (COPY_MODE == 1) {
      if (warp >= COPY_W0) issue_chunk_spread(p, si, c + NIN, base, bars, warp - COPY_W0, lane);
    }
    sm90::named_sync<BAR_PREP, NTP>();
    prep_phase5_ainv<NTP>(base, c, tid);
    {
      uint32_t ah[4], al[4];
      prep_inv_frags(base, c, lane, ah, al);
      prep_w16(base, c, ah, al, warp);
    }
    // Every thread wrote part of the record: make it visible to the consumers' wgmma (async proxy).
    sm90::fence_proxy_async();
    sm90::mbar_arrive(bars + B_REC_FULL + r);
  }
}

}  // namespace kda
