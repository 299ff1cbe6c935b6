// kdagen sm80: kda_recur, the serial chunk recurrence on a [BV, K] slice of the state held in
// fp32 registers (mma accumulator layout); a copy warp streams the workspace records in with
// cp.async. At K >= 128 two warps share 16 rows of V (split K) and exchange partial sums once
// per chunk.
#pragma once
#include "kda_layout.cuh"

namespace kda {

// Stage tiles keep the record's unpadded rows with their 16-byte chunks XOR-swizzled by row:
// the 8 rows one ldmatrix reads fall on distinct banks, and a cp.async pass writes whole
// 128-byte lines (padded rows cost 2-6x the ideal wavefronts: NOTES.md). NCH: 16-byte chunks per row.
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

// cp.async the C rows of this block's v slice (BV columns; PRECISE) into a swizzled [C][BV] tile; rows
// past the sequence's end (row >= rows) are zero-filled without a read. vsrc: the chunk's first row.
__device__ __forceinline__ void copy_v_tile(char* dst, const char* vsrc, long long vpitch, int rows, int lane) {
  constexpr int NCH = BV / 8, RSTEP = 32 / NCH;
  static_assert(32 % NCH == 0 && (C * NCH) % 32 == 0, "copy_v_tile: whole rows per pass");
  const int r = lane / NCH, ch = lane % NCH;
#pragma unroll
  for (int i = 0; i < C * NCH / 32; ++i) {
    const int row = r + i * RSTEP;
    const bool in = row < rows;
    cp_async16_zfill(smem_u32(dst) + row * NCH * 16 + swz<NCH>(row, ch) * 16,
                     vsrc + (in ? row * vpitch : 0) + ch * 16, in ? 16 : 0);
  }
}

// Issue the cp.async copies of one chunk record (this block's V slice of U0^T; PRECISE: of v, from
// the input, vsrc its first row) into a stage. zero_u: a twin run (v = 0) keeps the stage's U tiles
// at the zeros written before the loop.
__device__ __forceinline__ void prefetch_chunk(char* stage, const char* rec, int vb, int lane, bool zero_u,
                                               const char* vsrc, long long vpitch, int rows) {
  // W, Qd, Kr rows back to back: [3C][K] in the record and in shared memory (C % 8 == 0, so a
  // row's swizzle is the same counted from W or from its own tile); likewise Mqk's hi and lo and
  // (PRECISE) P^T's hi and lo.
  copy_tile<3 * C, K / 8>(stage, rec, lane);
  copy_tile<(MQ_TILES + (PRECISE ? 2 : 0)) * C, C / 8>(stage + 3 * C * K * 2, rec + OFF_M, lane);
  char* su = stage + STAGE_U;
  if (!zero_u) {
    if constexpr (PRECISE) copy_v_tile(su, vsrc, vpitch, rows, lane);
    else copy_tile<BV, C / 8>(su, rec + OFF_U + (long long)vb * BV * C * 2, lane);
  }
  // Gamma_C: K / 4 16-byte pieces, in rows of at most 32 (one pass of the warp); the diagonal C / 4.
  char* sg = stage + STAGE_GM;
  if constexpr (K / 4 <= 32) copy_rows<1, K / 4, 0, 0>(sg, rec + OFF_GM, lane);
  else copy_rows<K / 128, 32, 512, 512>(sg, rec + OFF_GM, lane);
  if constexpr (PRECISE) copy_rows<1, C / 4, 0, 0>(sg + K * 4, rec + OFF_D, lane);
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

// The block-wide barrier of kda_recur. The copy warp and the compute warps reach it at different
// instructions (each role runs its own loop: one shared loop measured 15% slower at T65536 H24), so
// it is the non-aligned barrier.sync, which PTX allows in divergent code (bar.sync / __syncthreads
// is the aligned form and must be reached at the same instruction by every thread).
// KDA_BLOCK_BAR_ALIGNED=1 rebuilds the earlier aligned bar.sync (undefined behaviour here), only to
// time the fix against it in one run; the other options measured were dropped
// (benchmarks/results/2026-12-01_s9_h200_sm80_sync_ab.md, _s10_*_sync_mix.md, _s11_*_no_copy_warp.md).
#if KDA_BLOCK_BAR_ALIGNED == 1
__device__ __forceinline__ void block_sync() { asm volatile("bar.sync 0;\n" ::: "memory"); }
#else
__device__ __forceinline__ void block_sync() { asm volatile("barrier.sync 0;\n" ::: "memory"); }
#endif

// Named barrier of the two warps of V tile vt (id 1 + vt; the KDA_PAIR_MBAR=0 path). Immediate
// ids: with a register id ptxas reserves all 16 hardware barriers per block, which caps the
// blocks per SM.
template <int I>
__device__ __forceinline__ void bar_tile(int vt) {
  if constexpr (I < NWV) {
    if (vt == I) asm volatile("bar.sync %0, 64;\n" ::"n"(I + 1) : "memory");
    bar_tile<I + 1>(vt);
  }
}

// The split-K exchange of step c between the two warps of V tile vt (see PAIR_MBAR). The tile's
// mbarrier counts the 64 threads' arrivals; its phase completes once per step, so step c waits
// for parity c & 1 (a warp cannot run a step ahead: the block barrier separates steps).
__device__ __forceinline__ void pair_sync(uint64_t* pair_bars, int vt, int c) {
  if constexpr (PAIR_MBAR) {
    mbar_arrive(pair_bars + vt);
    mbar_wait_parity_poll(pair_bars + vt, c & 1);
  } else {
    bar_tile<0>(vt);
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

// One block of the recurrence. TWINS: compiled for KdaParams::twins == 2 (kda_recur_twins, 2 HV
// state heads); the plain kda_recur is built without the twins' code, which moved its schedule
// (recur +19% at chunk 16, block_v 32, T65536 H24 on the H200 with one kernel for both;
// benchmarks/NOTES.md, session 30).
template <bool TWINS>
__device__ __forceinline__ void recur_block(const KdaParams& p) {
  extern __shared__ __align__(16) char smem2[];
  float4* xbuf = reinterpret_cast<float4*>(smem2 + NSTAGE * STAGE);
  // hs: the state head (o, states); h: the value head whose records it reads. With twins, state
  // heads HV..2HV-1 rerun heads 0..HV-1 with U = 0, the run of v = 0 (KdaParams::twins).
  const int vb = blockIdx.x, n = blockIdx.y, hs = blockIdx.z;
  const bool zero_u = TWINS && hs >= p.HV;
  const int h = zero_u ? hs - p.HV : hs;
  int bos, len;
  seq_bounds(p, n, bos, len);
  const int nc = (len + C - 1) / C;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const char* rec_c = (const char*)p.ws + (((long long)bos / C + n) * p.HV + h) * REC;  // chunk 0
  const long long rstride = (long long)p.HV * REC;

  const long long bidx = p.cu_seqlens ? 0 : n;
  const long long tb = p.cu_seqlens ? bos : 0;
  in_t* const so_all = reinterpret_cast<in_t*>(smem2 + NSTAGE * STAGE + XBUF);  // o staging
  uint64_t* const pair_bars = reinterpret_cast<uint64_t*>(smem2 + OFF_PAIRBAR);
  if (PAIR_MBAR && tid < NWV) mbar_init(pair_bars + tid, 64);  // published by the first block barrier

  if (warp == NW2) {
    // The copy warp: stage c + NSTAGE - 1 is refilled in step c, once every warp has passed the
    // step's barrier (so is done with chunk c - 1, which that stage held). It waits for chunk
    // c + 1 before the next barrier, which then publishes it to the compute warps. After the
    // barrier of step c it also stores chunk c - 1's o (staged in slot (c - 1) & 1 before that
    // barrier; the compute warps write the other slot in step c), and the last chunk's after one
    // more barrier past the loop. Its barriers are other instructions than the compute warps'
    // (block_sync: the non-aligned form).
    in_t* ob = (in_t*)p.o + bidx * p.o_s[0] + hs * p.o_s[2] + vb * BV + tb * p.o_s[1];
    const long long ostride = p.o_s[1];
    if (zero_u) {  // every stage's U tile, once: published to the compute warps by the first block barrier
      for (int i = lane; i < NSTAGE * BV * C / 8; i += 32) {
        const int st = i / (BV * C / 8), e = i % (BV * C / 8);
        reinterpret_cast<uint4*>(smem2 + st * STAGE + STAGE_U)[e] = make_uint4(0, 0, 0, 0);
      }
    }
    // PRECISE: this block's v columns at the sequence's first token (16-bit rows, vpitch bytes apart).
    const long long vpitch = PRECISE ? p.v_s[1] * 2 : 0;
    const char* vsrc = PRECISE ? reinterpret_cast<const char*>((const in_t*)p.v + bidx * p.v_s[0] + h * p.v_s[2] +
                                                               tb * p.v_s[1] + vb * BV)
                               : nullptr;
    auto prefetch = [&](int j) {
      prefetch_chunk(smem2 + (j % NSTAGE) * STAGE, rec_c + j * rstride, vb, lane, zero_u,
                     vsrc + (PRECISE ? (long long)j * C * vpitch : 0), vpitch, len - j * C);
    };
#pragma unroll
    for (int j = 0; j < NSTAGE - 1; ++j) {
      if (j < nc) prefetch(j);
      cp_async_commit();
    }
    for (int c = 0; c < nc; ++c) {
      cp_async_wait<NSTAGE - 2>();
      block_sync();
      if (c + NSTAGE - 1 < nc) prefetch(c + NSTAGE - 1);
      cp_async_commit();
      if (O_BY_COPY && c > 0)
        store_o_chunk(so_all + ((c - 1) & 1) * OSLOT, ob + (long long)(c - 1) * C * ostride, ostride, C, lane);
    }
    if constexpr (O_BY_COPY) {
      block_sync();
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
  const bool kv = p.state_kv != 0;

  float s[MT][KH / 8][4];
#if KDA_STATE != 0
  // the initial state: sequence n's, or a state pool's slot h0_idx[n] (none at -1)
  const long long h0_row = state_row(p, p.h0_idx, n, hs, TWINS);
  if (p.h0 && h0_row >= 0) {
    const state_t* h0 = (const state_t*)p.h0 + h0_row * V * K;
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

  in_t* op = (in_t*)p.o + bidx * p.o_s[0] + hs * p.o_s[2] + vb * BV + vw;  // (chunk 64)
  const long long ostride = p.o_s[1];
  // Which chunks' entering states are kept (return_chunk_states=m: chunks 0, m, 2m, ...) and their
  // rows. KDA_KEPT_COUNT: counted, the next kept chunk and its row in registers; else c % m and
  // c / m, a runtime division at the top of every step. Counting ran fastest on plain and strided
  // calls alike but spills where registers are tightest; kda_fwd.cu.j2 picks (benchmarks/NOTES.md,
  // sessions 48-49).
  const int cstride = p.chunk_stride > 1 ? p.chunk_stride : 1;
#if KDA_KEPT_COUNT
  int next_kept = p.hc ? 0 : nc;
  long long crow = p.hc ? p.chunk_offsets[n] : 0;
#else
  const int coff = p.hc ? p.chunk_offsets[n] : 0;
#endif

  for (int c = 0; c < nc; ++c) {
#if KDA_KEPT_COUNT
    if (c == next_kept) {
      next_kept += cstride;
#else
    if (p.hc && c % cstride == 0) {
      const long long crow = coff + c / cstride;
#endif
#pragma unroll
      for (int m = 0; m < MT; ++m) {
#if KDA_STATE == 2
        store_state((bf16*)p.hc + (crow * (TWINS ? 2 * p.HV : p.HV) + hs) * V * K, s[m],
                    vr0 + 16 * m, k0, t4, kv);
#else
        store_state((float*)p.hc + (crow * (TWINS ? 2 * p.HV : p.HV) + hs) * V * K, s[m],
                    vr0 + 16 * m, k0, t4, kv);
#endif
      }
#if KDA_KEPT_COUNT
      ++crow;
#endif
    }
    // The one block-wide barrier of a step: chunk c has landed (the copy warp waited for it),
    // and every warp is done with step c - 1 (its stage can be refilled, the exchange slots
    // reused).
    block_sync();

    const bf16* sW = reinterpret_cast<const bf16*>(smem2 + (c % NSTAGE) * STAGE);
    const bf16* sQ = sW + C * K;
    const bf16* sR = sQ + C * K;
    const bf16* sMq = sR + C * K;
    const bf16* sP = sMq + MQ_TILES * C * C;  // PRECISE: P^T, hi then lo
    const bf16* sU = sP + (PRECISE ? 2 * C * C : 0);  // plain: U0^T [BV][C]; PRECISE: v [C][BV]
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
    // PRECISE: U0^T = v^T P^T on the tensor cores, in fp32 (v exact, P in hi + lo), off the chain:
    // every warp forms all of U0 for use after the split-K exchange. (Each warp forming only its own
    // n-tile and folding it into the partial it sends halves these MMAs, but the send then waits
    // for them: recur +8-12% at block_v 32, T65536 H24 and T8192 H64; benchmarks/NOTES.md, session 36.)
    float u0p[PRECISE ? MT : 1][C / 8][4] = {};
    if constexpr (PRECISE) {
      uint32_t bp[2][4];  // P^T's B fragments, hi and lo: n-tiles 0 (regs 0, 1) and 1 (regs 2, 3)
      ldsm_x4_t(bp[0], sP + tile_at<C / 8>(lr + 8 * (lm & 1), 8 * (lm >> 1)));
      ldsm_x4_t(bp[1], sP + C * C + tile_at<C / 8>(lr + 8 * (lm & 1), 8 * (lm >> 1)));
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        uint32_t va[4];  // v^T's A fragment: [16 V rows][C time steps]
        ldsm_x4_t(va, sU + tile_at<BV / 8>(lr + 8 * (lm >> 1), vw + 16 * m + 8 * (lm & 1)));
#pragma unroll
        for (int hl = 1; hl >= 0; --hl) {
          mma_bf16(u0p[m][0], va, bp[hl][0], bp[hl][1]);
          mma_bf16(u0p[m][1], va, bp[hl][2], bp[hl][3]);
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
    // With two tiles per warp the partial U goes to the partner right after the S Qd^T MMAs,
    // ahead of the step's other shared-memory loads; with one tile per warp that measured slower.
    constexpr bool XCH_EARLY = KSPLIT > 1 && MT > 1;
    // This warp's partial U^T of tile m, for its split-K partner.
    auto send_partial_u = [&](int m) {
      float4* xw = xbuf + (warp * MT + m) * XW4 * 32 + lane;
#pragma unroll
      for (int nt = 0; nt < C / 8; ++nt)
        xw[nt * 32] = make_float4(ut[m][nt][0], ut[m][nt][1], ut[m][nt][2], ut[m][nt][3]);
    };
    if constexpr (XCH_EARLY) {
#pragma unroll
      for (int m = 0; m < MT; ++m) send_partial_u(m);
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
    constexpr int NU0 = C == 16 && !PRECISE ? C / 8 : 1;  // preloaded U0 n-tiles (registers allow at C = 16)
    float u0r[MT][NU0][4];
    auto u0_at = [&](int m, int nt, int e) {  // chunk 64 (never PRECISE)
      return __bfloat162float(sU[tile_at<C / 8>(vw + 16 * m + g8 + 8 * (e >> 1), 8 * nt + 2 * t4 + (e & 1))]);
    };
    if constexpr (C == 16 && !PRECISE) {
      // One ldmatrix per 16-row tile: its four 8x8 matrices in A-fragment order hold the bf16
      // pairs of the accumulator layout (register 2 nt + e / 2, low half for even e).
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const int at = tile_at<C / 8>(vw + 16 * m + (lane & 15), 8 * (lane >> 4));
        uint32_t b[4];
        ldsm_x4(b, sU + at);
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
      if constexpr (PRECISE) return u0p[m][nt][e];
      else if constexpr (C == 16) return u0r[m][nt][e];
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
        if constexpr (!XCH_EARLY) send_partial_u(m);
#pragma unroll
        for (int ntp = 0; ntp < C / 16; ++ntp) {
          xw[(XU4 + ntp) * 32] = kh ? make_float4(oq[m][ntp][0][0], oq[m][ntp][0][1], oq[m][ntp][0][2], oq[m][ntp][0][3])
                                    : make_float4(oq[m][ntp][1][0], oq[m][ntp][1][1], oq[m][ntp][1][2], oq[m][ntp][1][3]);
        }
      }
      pair_sync(pair_bars, vt, c);  // the two warps of this V tile
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
    // PRECISE, off the chain (after the S update's issue): what bf16 dropped of U^T, as A fragments
    // for the o product, and o^T += U^T diag(Mqk) in fp32. Each o^T n-tile of this warp is n-tile
    // 2 ntp + (hh or kh) of U^T, in the same accumulator layout.
    uint32_t ul[PRECISE ? MT : 1][PRECISE ? C / 16 : 1][4];
    if constexpr (PRECISE) {
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int kc = 0; kc < C / 16; ++kc) acc_lo_to_a(ut[m][2 * kc], ut[m][2 * kc + 1], ua[m][kc], ul[m][kc]);
      const float* sD = sGam + K;
#pragma unroll
      for (int ntp = 0; ntp < C / 16; ++ntp)
#pragma unroll
        for (int hh = 0; hh < NH; ++hh) {
          const int nt = 2 * ntp + (KSPLIT == 1 ? hh : kh);
          const float2 dg = *reinterpret_cast<const float2*>(sD + 8 * nt + 2 * t4);
#pragma unroll
          for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float u = KSPLIT == 1 ? ut[m][2 * ntp + hh][e] : (kh ? ut[m][2 * ntp + 1][e] : ut[m][2 * ntp][e]);
              ok[m][ntp][hh][e] = fmaf((e & 1) ? dg.y : dg.x, u, ok[m][ntp][hh][e]);
            }
        }
    }
    // o^T += U^T Mqk^T on this warp's n-tiles (Mqk lower triangular: blocks kc <= ntp), staged in
    // this warp's slice of the chunk's o slot ([MT][OROWS][OP]) for the copy warp to store.
    // PRECISE: Mqk's strictly lower part in hi + lo (hi hi + lo hi + hi lo; its diagonal went in
    // above): o's error against float64 halves (bf16 Mqk and U^T were the largest part of it).
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
          if constexpr (PRECISE) {
            uint32_t bl[4];
            ldsm_x4(bl, sMq + C * C + tile_at<C / 8>(row, col));
#pragma unroll
            for (int m = 0; m < MT; ++m) {
              mma_bf16(ok[m][ntp][0], ul[m][kc], b[0], b[1]);
              mma_bf16(ok[m][ntp][NH - 1], ul[m][kc], b[2], b[3]);
              mma_bf16(ok[m][ntp][0], ua[m][kc], bl[0], bl[1]);
              mma_bf16(ok[m][ntp][NH - 1], ua[m][kc], bl[2], bl[3]);
            }
          }
        } else {
          const int row = 16 * ntp + 8 * kh + lr, col = 16 * kc + 8 * (lm & 1);
          uint32_t b[2];
          ldsm_x2(b, sMq + tile_at<C / 8>(row, col));
#pragma unroll
          for (int m = 0; m < MT; ++m) mma_bf16(ok[m][ntp][0], ua[m][kc], b[0], b[1]);
          if constexpr (PRECISE) {
            uint32_t bl[2];
            ldsm_x2(bl, sMq + C * C + tile_at<C / 8>(row, col));
#pragma unroll
            for (int m = 0; m < MT; ++m) {
              mma_bf16(ok[m][ntp][0], ul[m][kc], b[0], b[1]);
              mma_bf16(ok[m][ntp][0], ua[m][kc], bl[0], bl[1]);
            }
          }
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
  if constexpr (O_BY_COPY) block_sync();  // the last chunk's o is staged: the copy warp stores it
#if KDA_STATE != 0
  const long long ht_row = state_row(p, p.ht_idx, n, hs, TWINS);  // read here: no register held the loop through
  if (p.ht && ht_row >= 0) {
#pragma unroll
    for (int m = 0; m < MT; ++m) store_state((state_t*)p.ht + ht_row * V * K, s[m], vr0 + 16 * m, k0, t4, kv);
  }
#endif
}

}  // namespace kda

// Register budgets, found per build (ptxas 13.0, sm_80 and sm_90 images), not derived: left to
// itself ptxas caps chunk 64 and block_v 16 too low and spills; at chunk 64, K = 64 only an
// explicit 255 avoids spills (NOTES.md; the ptxas-report test guards every variant). K = 256
// (chunk 16) needs no bound of its own: block_v 16/32 take 159-168, block_v 64 (MT 2) 254. With the
// PRECISE record, K = 64 (one warp per V tile) at block_v 32 spilled in kda_recur_twins' sm_80 image
// (capped at 96) without an explicit bound.
#if KDA_C == 64 && KDA_K == 64
#define KDA_RECUR_BOUNDS __maxnreg__(255)
#elif KDA_C == 64 || KDA_BV == 16 || KDA_K == 64
#define KDA_RECUR_BOUNDS __launch_bounds__(kda::NT2, 1)
#else
#define KDA_RECUR_BOUNDS __launch_bounds__(kda::NT2)
#endif
extern "C" __global__ void KDA_RECUR_BOUNDS kda_recur(const KdaParams p) { kda::recur_block<false>(p); }
extern "C" __global__ void KDA_RECUR_BOUNDS kda_recur_twins(const KdaParams p) { kda::recur_block<true>(p); }
