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
  int hq;                 // q / k head (GQA: h / group)
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
#if KDA_SM90_PAIR_ON && defined(KDA_SM90_C32) && KDA_SM90_C32
// (C32: local sub-chunk j = 2 l + h is sub-chunk h of the CTA's local record l, global record 2 l + rank)
#define KDA_GCHUNK(si, j) (4 * ((j) >> 1) + 2 * (si).rank + ((j) & 1))
#elif KDA_SM90_PAIR_ON
#define KDA_GCHUNK(si, j) (2 * (j) + (si).rank)
#else
#define KDA_GCHUNK(si, j) (j)  // (a macro: as a function it changed the default images' scheduling)
#endif

// The tensor-map copies of global chunk cc (kda_sm90_tma.cuh), each one box of C rows of this CTA's head from
// row si.tb + C cc: q, k, g into input stage st, v (its BV columns, 64-column boxes) into V stage vs. Rows past
// the tensor's end are zero-filled, rows past the sequence's end belong to the next one: the prep selects zeros
// for both, and the consumers mask v^T in a short chunk. The expected bytes are the full boxes.
__device__ __forceinline__ void tma_qkg(const KdaParams& p, const SeqInfo& si, int cc, char* base, uint64_t* bars,
                                        int st) {
  const KdaTmap* tm = tmaps(p);
  const int t = (int)si.tb + cc * C, hq = si.hq, b = (int)si.bidx;
  char* const in = base + SM_IN + st * IN_BYTES;
  uint64_t* full = bars + B_IN_FULL + st;
  sm90::mbar_arrive_expect_tx(full, (uint32_t)(C * (2 * QROW + K * (p.g_fp32 ? 4 : 2))));
  sm90::tma_load_4d(in + IN_Q, tm + TM_Q, 0, t, hq, b, full);
  sm90::tma_load_4d(in + IN_K, tm + TM_K, 0, t, hq, b, full);
  sm90::tma_load_4d(in + IN_G, tm + TM_G, 0, t, si.h, b, full);
}
__device__ __forceinline__ void tma_v(const KdaParams& p, const SeqInfo& si, int cc, char* base, uint64_t* bars,
                                      int vs) {
  const KdaTmap* tm = tmaps(p);
  const int t = (int)si.tb + cc * C, b = (int)si.bidx;
  uint64_t* full = bars + B_V_FULL + vs;
  sm90::mbar_arrive_expect_tx(full, (uint32_t)V_BYTES);
#pragma unroll
  for (int hb = 0; hb < BV / 64; ++hb)
    sm90::tma_load_4d(base + SM_V + vs * V_BYTES + hb * V_BOX, tm + TM_V, si.vb * BV + 64 * hb, t, si.h, b, full);
}

// Issue the copies of chunk cc (q, k, g into its IN stage; v into its V stage) from the prep group's copy warp
// (one thread). The IN stage was last read by the prep group's chunk cc - NIN; the V stage is released by the
// consumers (v_empty).
__device__ __forceinline__ void issue_chunk(const KdaParams& p, const SeqInfo& si, int cc, char* base, uint64_t* bars,
                                            int lane) {
  if (cc >= si.nc) return;
  const int vs = cc % NV;
  sm90::mbar_wait(bars + B_V_EMPTY + vs, ((cc / NV) & 1) ^ 1);
  if (lane == 0) {
    tma_qkg(p, si, cc, base, bars, cc % NIN);
    tma_v(p, si, cc, base, bars, vs);
  }
}

// The same copies from warp w == 0 of the NW issuing warps (the others have nothing to do: one thread issues
// the four boxes).
template <int NW = COPY_NW>
__device__ __forceinline__ void issue_chunk_spread(const KdaParams& p, const SeqInfo& si, int cc, char* base,
                                                   uint64_t* bars, int w, int lane) {
  if (w == 0) issue_chunk(p, si, cc, base, bars, lane);
}

// The pair's copies. issue_qkg: q, k, g of local chunk j (global KDA_GCHUNK(j)) into input stage j % NIN.
// issue_v: the v of global chunk cc into V stage cc % NV (waits for the stage). Warp w == 0 of NW issues.
template <int NW>
__device__ __forceinline__ void issue_qkg(const KdaParams& p, const SeqInfo& si, int j, char* base, uint64_t* bars,
                                          int w, int lane) {
  if (j >= nlocal(si)) return;
  if (w == 0 && lane == 0) tma_qkg(p, si, KDA_GCHUNK(si, j), base, bars, j % NIN);
}
template <int NW>
__device__ __forceinline__ void issue_v(const KdaParams& p, const SeqInfo& si, int cc, char* base, uint64_t* bars,
                                        int w, int lane) {
  if (cc >= si.nc || w != 0) return;
  const int vs = cc % NV;
  sm90::mbar_wait(bars + B_V_EMPTY + vs, ((cc / NV) & 1) ^ 1);
  if (lane == 0) tma_v(p, si, cc, base, bars, vs);
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
// The record slot of local chunk c, and (C32) the first record row of its sub-chunk.
__device__ __forceinline__ int rec_slot(int c) { return (C32 ? c >> 1 : c) % NREC; }
__device__ __forceinline__ int rec_row0(int c) { return C32 ? (c & 1) * C : 0; }
// The cumulative gate [C][GKP] (C32: in place of g in the input stage).
__device__ __forceinline__ float* gate_arr(char* base, int c) {
  if constexpr (C32) {
    return reinterpret_cast<float*>(base + SM_IN + (c % NIN) * IN_BYTES + IN_G);
  } else {
    return reinterpret_cast<float*>(base + SM_SCR + scr_set(c) + S_G);
  }
}
#define KDA_PREP_SCRATCH(base, c)                                                         \
  char* const scr = (base) + SM_SCR;                                                       \
  char* const scs = scr + scr_set(c);                                                      \
  float* const sG = gate_arr(base, c);                                                     \
  float* const srq = reinterpret_cast<float*>(scs + S_RQ);                                 \
  float* const srk = reinterpret_cast<float*>(scs + S_RK);                                 \
  float* const sdg = reinterpret_cast<float*>(scs + S_DG);                                 \
  bf16* const sAK = reinterpret_cast<bf16*>(scs + S_AK);                                   \
  bf16* const sAQ = reinterpret_cast<bf16*>(scs + S_AQ);                                   \
  bf16* const sBK = reinterpret_cast<bf16*>(scs + S_BK);                                   \
  bf16* const sXh = reinterpret_cast<bf16*>(scs + S_XH);                                   \
  bf16* const sXl = reinterpret_cast<bf16*>(scs + S_XL);                                   \
  float* const spart = reinterpret_cast<float*>(scr + S_PART);                             \
  float* const sLT = reinterpret_cast<float*>(scr + S_LT);                                 \
  float* const sbc = reinterpret_cast<float*>(scr + S_B) + ((c) & 1) * C; /* by parity */  \
  float* const sInv = reinterpret_cast<float*>(scr + S_INV) + (C32 ? ((c) & 1) * 16 * IPF : 0); \
  float* const sGM = reinterpret_cast<float*>(scs + S_GM); /* C32 */                       \
  const char* const in = (base) + SM_IN + ((c) % NIN) * IN_BYTES;                          \
  char* const rec = (base) + SM_REC + rec_slot(c) * REC_BYTES;                             \
  const int rh = rec_row0(c);                                                              \
  (void)sG; (void)srq; (void)srk; (void)sdg; (void)sAK; (void)sAQ; (void)sBK; (void)sXh;  \
  (void)sXl; (void)spart; (void)sLT; (void)sbc; (void)sInv; (void)sGM; (void)in; (void)rec; (void)rh

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
  // (the tensor map's dense rows: K * 4 bytes for fp32 g, K * 2 for 16-bit g)
  const int gpitch = p.g_fp32 ? K * 4 : K * 2;
  const char* gp = in + IN_G + (8 * half) * gpitch;
#pragma unroll
  for (int j = 0; j < 8; ++j)
    x.gx[j] = p.g_fp32 ? reinterpret_cast<const float*>(gp + j * gpitch)[col]
                       : to_f(reinterpret_cast<const in_t*>(gp + j * gpitch)[col]);
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
    b = sigmoidf_(x) * (p.neg_eigval ? 2.f : 1.f);
  }
  {
    float a[8];
    float run = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      // activated unconditionally, then selected: rows past the end do not decay
      const float act = gate_act(ld.gx[j] + bias, aexp, p.lower_bound);
      run += 8 * half + j < rows ? act : 0.f;
      a[j] = run;
    }
    const float first = __shfl_up_sync(0xffffffffu, run, 16);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (half) a[j] += first;
    }
    // Rows 8 apart share banks at pitch KP; the second half writes rotated by 4 rows. (C32's dense pitch: 2-way)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int jr = half ? ((j + 4) & 7) : j;
      sG[(8 * half + jr) * GKP + col] = half ? a[(j + 4) & 7] : a[j];
    }
    if (half) {
      const float e = __expf(a[7]);
      if constexpr (C32) {
        // e^G of the sub-chunk's last row: sub-chunk 1 reads sub-chunk 0's (this thread wrote it) for the
        // record's Gamma_C and its rows' decays from the record start; B reads sub-chunk 1's for Kr
        if (c & 1) reinterpret_cast<float*>(rec + R_GM)[col] = reinterpret_cast<const float*>(scr + S_GM)[col] * e;
        sGM[col] = e;
      } else {
        reinterpret_cast<float*>(rec + R_GM)[col] = e;
      }
    }
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
__device__ __forceinline__ void prep_gate_row(char* base, int c, int r, int d, float (&G)[8]) {
  const float* sG = gate_arr(base, c);
  const float4* gp = reinterpret_cast<const float4*>(sG + r * GKP + d);
  const float4 x0 = gp[0], x1 = gp[1];
  G[0] = x0.x; G[1] = x0.y; G[2] = x0.z; G[3] = x0.w; G[4] = x1.x; G[5] = x1.y; G[6] = x1.z; G[7] = x1.w;
}

// G: the cumulative gate of row ri, GL of the chunk's last row (columns d .. d + 7), read by the
// caller before any phase-1 store (see P0In).
__device__ __forceinline__ void prep_phase1(const KdaParams& p, char* base, int c, int ri, int d, const float (&xq)[8],
                                            const float (&xk)[8], float b, const float (&G)[8], const float (&GL)[8]) {
  KDA_PREP_SCRATCH(base, c);
  uint32_t pk[4], pq[4], pb[4], pqd[4], pkr[4], xkh[4], xkl[4];
  // C32, sub-chunk 1: the record's Kg and Qd rows decay from the record's start (times sub-chunk 0's e^G of
  // its last row), L's and Mqk's row operands from this sub-chunk's (pk, pqd into S_AK1, S_AQ1)
  const bool sub1 = C32 && (c & 1);
  uint32_t pk2[4], pqd2[4];
  float e15[8];
  if (sub1) {
    const float4* gp = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(scr + S_GM) + d);
    const float4 x0 = gp[0], x1 = gp[1];
    e15[0] = x0.x; e15[1] = x0.y; e15[2] = x0.z; e15[3] = x0.w; e15[4] = x1.x; e15[5] = x1.y; e15[6] = x1.z; e15[7] = x1.w;
  }
#pragma unroll
  for (int e = 0; e < 8; e += 2) {
    const float e0 = __expf(G[e]), e1 = __expf(G[e + 1]);
    const float i0 = __expf(-G[e]), i1 = __expf(-G[e + 1]);
    const float k0 = xk[e] * e0, k1 = xk[e + 1] * e1, q0 = xq[e] * e0, q1 = xq[e + 1] * e1;
    pk[e / 2] = pack_bf16(k0, k1);
    pq[e / 2] = pack_bf16(q0, q1);
    pqd[e / 2] = pack_bf16(p.scale * q0, p.scale * q1);
    if (sub1) {
      pk2[e / 2] = pack_bf16(k0 * e15[e], k1 * e15[e + 1]);
      pqd2[e / 2] = pack_bf16(p.scale * q0 * e15[e], p.scale * q1 * e15[e + 1]);
    }
    pb[e / 2] = pack_bf16(xk[e] * i0, xk[e + 1] * i1);
    pkr[e / 2] = pack_bf16(xk[e] * __expf(GL[e] - G[e]), xk[e + 1] * __expf(GL[e + 1] - G[e + 1]));
    if constexpr (!UKG) split_bf16(b * k0, b * k1, xkh[e / 2], xkl[e / 2]);
  }
  if constexpr (!UKG) {  // (the Kg record: phase 2 reads the record's Kg and Qd instead)
    *reinterpret_cast<uint4*>(sAK + ri * KB1 + d) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
    *reinterpret_cast<uint4*>(sAQ + ri * KB1 + d) = make_uint4(pq[0], pq[1], pq[2], pq[3]);
  }
  *reinterpret_cast<uint4*>(sBK + ri * KB1 + d) = make_uint4(pb[0], pb[1], pb[2], pb[3]);
  constexpr uint32_t ng = 0x80008000u;
  if (sub1) {
    *reinterpret_cast<uint4*>(scr + S_AK1 + (ri * KB1 + d) * 2) = make_uint4(pk[0] ^ ng, pk[1] ^ ng, pk[2] ^ ng, pk[3] ^ ng);
    *reinterpret_cast<uint4*>(scr + S_AQ1 + (ri * KB1 + d) * 2) = make_uint4(pqd[0], pqd[1], pqd[2], pqd[3]);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      pk[e] = pk2[e];
      pqd[e] = pqd2[e];
    }
  }
  if constexpr (YO) {  // -Kg (sign bits flipped) in rows 0 .. CR-1 of the [2CR][K] tile of -Kg and Qd
    *reinterpret_cast<uint4*>(rec + sm90::sw128_k<2 * CR>(rh + ri, d)) = make_uint4(pk[0] ^ ng, pk[1] ^ ng, pk[2] ^ ng, pk[3] ^ ng);
  } else if constexpr (UKG) {  // Kg [j][K] in the W slot (the consumers' B of S Kg^T)
    *reinterpret_cast<uint4*>(rec + R_W + sm90::sw128_k<C>(ri, d)) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
  } else {
    *reinterpret_cast<uint4*>(sXh + ri * KB1 + d) = make_uint4(xkh[0], xkh[1], xkh[2], xkh[3]);
    *reinterpret_cast<uint4*>(sXl + ri * KB1 + d) = make_uint4(xkl[0], xkl[1], xkl[2], xkl[3]);
  }
  // Qd [i][K] and Kr [j][K]: 16-byte pieces of one row; in the swizzled tiles the 8 pieces
  // a quarter-warp writes are one 128-byte row of an atom (conflict-free).
  if constexpr (YO) {  // rows CR .. 2CR - 1 of the [2CR][K] tile
    *reinterpret_cast<uint4*>(rec + sm90::sw128_k<2 * CR>(CR + rh + ri, d)) = make_uint4(pqd[0], pqd[1], pqd[2], pqd[3]);
  } else {
    *reinterpret_cast<uint4*>(rec + R_QD + sm90::sw128_k<C>(ri, d)) = make_uint4(pqd[0], pqd[1], pqd[2], pqd[3]);
  }
  // (C32: sub-chunk 0's rows decay to its own end here; group B rescales them to the record's end)
  *reinterpret_cast<uint4*>(rec + R_KR + sm90::sw128_mn<K>(rh + ri, d)) = make_uint4(pkr[0], pkr[1], pkr[2], pkr[3]);
}

// ---- 2. L (b, strictly lower) and Mqk (scale, lower incl. diagonal) partials of the K slices of
// L/Mqk warp w = warp - W0 (< NMW). The anchor is G = 0 before the chunk: <q_i e^{G_i}, k_j e^{-G_j}> with
// e^{-G_j} <= e^{span}; a slice with span > 80 (beyond fp32/bf16 range) uses exact pairwise
// exp(G_i - G_j) on CUDA cores, reading q and k again from the input stage (rare: only for extreme
// gates). in_full (or nullptr): the input stage's barrier, waited before that read where the
// stage's own wait was another warp's.
// C32: the cross block of a record's sub-chunk 1 (rows) and 0 (columns): partials of this warp's K slices of
// -(k_1 e^(G - G_15)) (k_0 e^(G_15 - G))^T and (scale q_1 e^(G - G_15)) (k_0 e^(G_15 - G))^T, both factors <= 1.
struct CrossAcc {
  float l[2][4], m[2][4];
};
template <int W0, bool CROSS = false>
__device__ __forceinline__ void prep_phase2(char* base, int c, int rows, float scale, uint64_t* in_full = nullptr,
                                            uint32_t in_parity = 0, CrossAcc* cross = nullptr) {
  const int tid = threadIdx.x, lane = tid & 31, w = (tid >> 5) - W0;
  KDA_PREP_SCRATCH(base, c);
  const int g8 = lane >> 2, t4 = lane & 3, lm = lane >> 3, lr = lane & 7;
  if (w >= NMW) return;
  float accL[2][4] = {}, accM[2][4] = {};
  if constexpr (CROSS) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) cross->l[nt][e] = cross->m[nt][e] = 0.f;
  }
  unsigned fallback = 0;
#pragma unroll
  for (int sl = 0; sl < SPW; ++sl) {
    const int c0 = 16 * (w * SPW + sl);
    float span = lane < 16 ? -sG[(C - 1) * GKP + c0 + lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) span = fmaxf(span, __shfl_xor_sync(0xffffffffu, span, o));
    const int ar = lr + 8 * (lm & 1), ac = c0 + 8 * (lm >> 1);  // A fragment: row, 8 columns
    if constexpr (CROSS) {  // (sub-chunk 1 of a C32 record: operands anchored at the sub-chunk, in S_AK1, S_AQ1)
      uint32_t ak[4], aq[4], bk[4], bx[4];
      ldsm_x4(ak, reinterpret_cast<const bf16*>(scr + S_AK1) + ar * KB1 + ac);
      ldsm_x4(aq, reinterpret_cast<const bf16*>(scr + S_AQ1) + ar * KB1 + ac);
      // sub-chunk 0's Kr rows (k e^(G_15 - G), still to its own end): B fragments, rows j, 8 columns
      ldsm_x4(bx, rec + R_KR + sm90::sw128_mn<K>(lr + 8 * (lm >> 1), c0 + 8 * (lm & 1)));
      mma_bf16(cross->l[0], ak, bx[0], bx[1]);
      mma_bf16(cross->l[1], ak, bx[2], bx[3]);
      mma_bf16(cross->m[0], aq, bx[0], bx[1]);
      mma_bf16(cross->m[1], aq, bx[2], bx[3]);
      if (span <= 80.f) {
        ldsm_x4(bk, sBK + (lr + 8 * (lm >> 1)) * KB1 + c0 + 8 * (lm & 1));
        mma_bf16(accL[0], ak, bk[0], bk[1]);
        mma_bf16(accL[1], ak, bk[2], bk[3]);
        mma_bf16(accM[0], aq, bk[0], bk[1]);
        mma_bf16(accM[1], aq, bk[2], bk[3]);
      } else {
        fallback |= 1u << sl;
      }
    } else if (span <= 80.f) {
      uint32_t ak[4], aq[4], bk[4];
      if constexpr (YO) {  // -Kg and Qd (scale included) in the record's [2CR][K] tile
        ldsm_x4(ak, rec + sm90::sw128_k<2 * CR>(ar, ac));
        ldsm_x4(aq, rec + sm90::sw128_k<2 * CR>(CR + ar, ac));
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
          const float wv = __expf(sG[i * GKP + dd] - sG[j * GKP + dd]) * to_f(kj[dd]);
          l += to_f(ki[dd]) * wv;
          m += to_f(qi[dd]) * wv;
        }
        // (the Kg record's MMA partials are of -L with YO, and of Mqk with the scale included)
        pL[i * 16 + j] += (YO ? -l : l) * srk[i] * srk[j];
        pM[i * 16 + j] += (UKG ? scale * m : m) * srq[i] * srk[j];
      }
    }
  }
}

// ---- 3. sum the partials in warp order; Mqk (hi + lo bf16) into the record (u = u0, u0 + STEP ..)
template <int STEP>
__device__ __forceinline__ void prep_phase3(const KdaParams& p, char* base, int c, int u0) {
  KDA_PREP_SCRATCH(base, c);
  for (int u = u0; u < 256; u += STEP) {
    const int i = u >> 4, j = u & 15;
    float l = 0.f, m = 0.f;
#pragma unroll
    for (int w = 0; w < NMW; ++w) {
      l += spart[w * 512 + u];
      m += spart[w * 512 + 256 + u];
    }
    if (i > j) sLT[j * CP + i] = sbc[i] * (YO ? -l : l);  // (YO: the partials are of -Kg)
    const float mq = i > j ? (UKG ? m : p.scale * m) : i == j ? p.scale * sdg[i] : 0.f;  // (UKG: Qd has the scale)
    const bf16 mh = __float2bfloat16_rn(mq);
    *reinterpret_cast<bf16*>(rec + R_MQ + il_rec(rh + i, rh + j)) = mh;
    *reinterpret_cast<bf16*>(rec + R_ML + il_rec(rh + i, rh + j)) = __float2bfloat16_rn(mq - __bfloat162float(mh));
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
  for (int u = u0; u < 256; u += STEP) {
    const int i = u >> 4, j = u & 15;
    const float y = sInv[i * IPF + j] * sbc[j];
    const bf16 yh = __float2bfloat16_rn(y);
    *reinterpret_cast<bf16*>(rec + R_AH + il_rec(rh + i, rh + j)) = yh;
    *reinterpret_cast<bf16*>(rec + R_AL + il_rec(rh + i, rh + j)) = __float2bfloat16_rn(y - __bfloat162float(yh));
    // (C32, sub-chunk 0: kept in fp32 for the cross block, which needs T_00 diag(b_0); beta's parity slot is
    // rewritten by group A's next record before B gets there)
    if (C32 && !(c & 1)) sInv[i * IPF + j] = y;
  }
}
// ---- C32: a record's off-diagonal blocks (group B, thread tb of NTG = 128).
// Sub-chunk 0: the upper blocks (rows 0-15, columns 16-31) of Mqk and A, hi and lo, are zero: the 512 bytes at
// the start of each part's second k-slab.
__device__ __forceinline__ void prep_c32_zero(char* base, int c, int tb) {
  KDA_PREP_SCRATCH(base, c);
  *reinterpret_cast<uint4*>(rec + R_MQ + (tb >> 5) * TILE_MA + 16 * CR * 2 + (tb & 31) * 16) = make_uint4(0, 0, 0, 0);
}
// Sub-chunk 1, after phase 3 read the partials: this warp's cross partials into spart (phase 2's order).
__device__ __forceinline__ void prep_cross_store(char* base, int c, int w, int lane, const CrossAcc& x) {
  KDA_PREP_SCRATCH(base, c);
  const int g8 = lane >> 2, t4 = lane & 3;
  float* pL = spart + w * 512;
  float* pM = pL + 256;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = g8 + 8 * hh, j = 8 * nt + 2 * t4;
      *reinterpret_cast<float2*>(pL + i * 16 + j) = make_float2(x.l[nt][2 * hh], x.l[nt][2 * hh + 1]);
      *reinterpret_cast<float2*>(pM + i * 16 + j) = make_float2(x.m[nt][2 * hh], x.m[nt][2 * hh + 1]);
    }
}
// Sub-chunk 1, after phase 2 read them: sub-chunk 0's Kr rows times e^G of the record's last row (relative to
// sub-chunk 1's start), so that they decay to the record's end. (Rounded twice: emulation o +2% at strong gates.)
__device__ __forceinline__ void prep_kr0_rescale(char* base, int c, int tb) {
  KDA_PREP_SCRATCH(base, c);
#pragma unroll
  for (int pi = tb; pi < C * K / 8; pi += NTP / 2) {
    const int j = pi / (K / 8), d = (pi % (K / 8)) * 8;
    uint4* pk = reinterpret_cast<uint4*>(rec + R_KR + sm90::sw128_mn<K>(j, d));
    const uint4 x = *pk;
    const float4 g0 = *reinterpret_cast<const float4*>(sGM + d), g1 = *reinterpret_cast<const float4*>(sGM + d + 4);
    const uint32_t xs[4] = {x.x, x.y, x.z, x.w};
    const float gg[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
    uint32_t ys[4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      ys[e] = pack_bf16(__uint_as_float(xs[e] << 16) * gg[2 * e], __uint_as_float(xs[e] & 0xffff0000u) * gg[2 * e + 1]);
    *pk = make_uint4(ys[0], ys[1], ys[2], ys[3]);
  }
}
// Sub-chunk 1: the summed cross blocks. M_10 (scale in) into the record; L_10 = diag(b_1) (k_1 ..)(k_0 ..)^T into
// warp 0's L partials (in place: element u is read and written by one thread only).
template <int STEP>
__device__ __forceinline__ void prep_cross_sum(char* base, int c, int u0) {
  KDA_PREP_SCRATCH(base, c);
  for (int u = u0; u < 256; u += STEP) {
    const int i = u >> 4, j = u & 15;
    float l = 0.f, m = 0.f;
#pragma unroll
    for (int w = 0; w < NMW; ++w) {
      l += spart[w * 512 + u];
      m += spart[w * 512 + 256 + u];
    }
    spart[u] = -sbc[i] * l;  // (the partials are of -k_1 ..)
    const bf16 mh = __float2bfloat16_rn(m);
    *reinterpret_cast<bf16*>(rec + R_MQ + il_rec(C + i, j)) = mh;
    *reinterpret_cast<bf16*>(rec + R_ML + il_rec(C + i, j)) = __float2bfloat16_rn(m - __bfloat162float(mh));
  }
}
// Sub-chunk 1: X = T_11 L_10 into sLT (free since phase 4), T_11 = (I + L_11)^-1 (lower triangular).
template <int STEP>
__device__ __forceinline__ void prep_cross_x(char* base, int c, int u0) {
  KDA_PREP_SCRATCH(base, c);
  for (int u = u0; u < 256; u += STEP) {
    const int i = u >> 4, j = u & 15;
    float x = 0.f;
#pragma unroll
    for (int k = 0; k < C; ++k) x += k <= i ? sInv[i * IPF + k] * spart[k * 16 + j] : 0.f;
    sLT[i * CP + j] = x;
  }
}
// Sub-chunk 1: the lower block of (I + L)^-1 diag(b), -X T_00 diag(b_0) (sub-chunk 0 left T_00 diag(b_0) in its
// sInv), hi + lo into the record.
template <int STEP>
__device__ __forceinline__ void prep_cross_a10(char* base, int c, int u0) {
  KDA_PREP_SCRATCH(base, c);
  const float* sInv0 = reinterpret_cast<const float*>(scr + S_INV);
  for (int u = u0; u < 256; u += STEP) {
    const int i = u >> 4, j = u & 15;
    float y = 0.f;
#pragma unroll
    for (int k = 0; k < C; ++k) y -= k >= j ? sLT[i * CP + k] * sInv0[k * IPF + j] : 0.f;
    const bf16 yh = __float2bfloat16_rn(y);
    *reinterpret_cast<bf16*>(rec + R_AH + il_rec(C + i, j)) = yh;
    *reinterpret_cast<bf16*>(rec + R_AL + il_rec(C + i, j)) = __float2bfloat16_rn(y - __bfloat162float(yh));
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

// Gate constants of column col (A_log's exponent; dt_bias or 0).
__device__ __forceinline__ float gate_aexp(const KdaParams& p, const SeqInfo& si) {
#if KDA_GATE != 2
  return __expf(__ldg(p.A_log + si.h));
#else
  return 0.f;
#endif
}
__device__ __forceinline__ float gate_bias(const KdaParams& p, const SeqInfo& si, int col) {
#if KDA_GATE != 2
  return p.dt_bias ? __ldg(p.dt_bias + si.h * K + col) : 0.f;
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
