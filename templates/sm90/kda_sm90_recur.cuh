// kdagen sm90: a consumer warpgroup. It holds a 64 (V) x K slice of the fp32 state as a wgmma
// accumulator (the m64nK layout: warp w rows 16 w + lane / 4 (+ 8), columns 8 nt + 2 (lane % 4)
// (+ 1)), which is also the bf16 A-fragment layout of the products that read it.
#pragma once
#include "kda_sm90_prep.cuh"

namespace kda {

// Register-held state slice <-> memory (rows vr0, vr0 + 8; columns 8 nt + 2 t4 + {0, 1}), state
// layout [V][K] or (KV) [K][V]. The layout is a template parameter so that offsets are immediates.
template <bool KV, typename ST>
__device__ __forceinline__ void store_state_l(ST* base, const float (*s)[4], int vr0, int t4) {
  ST* b = base + (KV ? (long long)(2 * t4) * V + vr0 : (long long)vr0 * K + 2 * t4);
#pragma unroll
  for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int dv = (e >> 1) * 8, dk = 8 * nt + (e & 1);
      b[KV ? dk * V + dv : dv * K + dk] = from_f<ST>(s[nt][e]);
    }
}
template <typename ST>
__device__ __forceinline__ void store_state(ST* base, const float (*s)[4], int vr0, int t4, bool kv) {
  if (kv) store_state_l<true>(base, s, vr0, t4);
  else store_state_l<false>(base, s, vr0, t4);
}
template <bool KV, typename ST>
__device__ __forceinline__ void load_state_l(const ST* base, float (*s)[4], int vr0, int t4) {
  const ST* b = base + (KV ? (long long)(2 * t4) * V + vr0 : (long long)vr0 * K + 2 * t4);
#pragma unroll
  for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int dv = (e >> 1) * 8, dk = 8 * nt + (e & 1);
      s[nt][e] = to_f(b[KV ? dk * V + dv : dv * K + dk]);
    }
}

// acc_to_a with the low parts too: a = bf16 pairs of the accumulators, al = of what bf16 rounded off.
__device__ __forceinline__ void acc_to_a_split(const float (&lo)[4], const float (&hi)[4], uint32_t (&a)[4],
                                               uint32_t (&al)[4]) {
  split_bf16(lo[0], lo[1], a[0], al[0]);
  split_bf16(lo[2], lo[3], a[1], al[1]);
  split_bf16(hi[0], hi[1], a[2], al[2]);
  split_bf16(hi[2], hi[3], a[3], al[3]);
}

// Two floats as one register of two input-type values (lo in the low half), rounded as from_f.
__device__ __forceinline__ uint32_t pack_in(float lo, float hi) {
  if constexpr (std::is_same<in_t, bf16>::value) {
    return pack_bf16(lo, hi);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// The 16-bit pair of a ldmatrix register as bf16 (fp16 inputs are converted; bf16 passes).
__device__ __forceinline__ uint32_t to_bf16x2(uint32_t x) {
  if constexpr (sizeof(in_t) == 2 && !std::is_same<in_t, bf16>::value) {
    const __half2 h = *reinterpret_cast<const __half2*>(&x);
    return pack_bf16(__low2float(h), __high2float(h));
  } else {
    return x;
  }
}

// An m64n16 accumulator (8 per thread) as the bf16 A fragment of a k16 step, split into high and low parts.
__device__ __forceinline__ void acc16_split(const float (&d)[8], uint32_t (&hi)[4], uint32_t (&lo)[4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) split_bf16(d[(q >> 1) * 4 + (q & 1) * 2], d[(q >> 1) * 4 + (q & 1) * 2 + 1], hi[q], lo[q]);
}

// SLOTS: the initial and final states are a state pool's slots p.h0_idx[n], p.ht_idx[n] (kda_fused_slots);
// without, sequence n's rows (kda_fused: the slots' loads and row arithmetic cost its plain calls up to 2%).
template <bool SLOTS>
__device__ __forceinline__ void consumer_role(const KdaParams& p, const SeqInfo& si, char* base, uint64_t* bars,
                                              int cw) {
  const int tid = threadIdx.x - NTP - NTX - 128 * cw;  // 0..127 within the warpgroup
  const int w = tid >> 5, lane = tid & 31;
  const int g8 = lane >> 2, t4 = lane & 3;
  const int v0 = 64 * cw + 16 * w;    // first V row of this warp within the CTA's slice
  const int vr0 = si.vb * BV + v0 + g8;  // state row (of V) of this thread's first accumulator row
#if KDA_STATE != 0
  const long long st_off = ((long long)si.n * p.HV + si.h) * V * K;  // initial / final state
#endif
  const bool kv = p.state_kv != 0;

  float s[K / 8][4];
#if KDA_STATE != 0
  const long long h0_off = SLOTS ? state_row(p, p.h0_idx, si.n, si.h, false) * V * K : st_off;
  if (p.h0 && (!SLOTS || h0_off >= 0)) {  // (a pool's padding sequence: slot -1, a negative row)
    const state_t* h0 = (const state_t*)p.h0 + h0_off;
    if (kv) load_state_l<true>(h0, s, vr0, t4);
    else load_state_l<false>(h0, s, vr0, t4);
  } else
#endif
  {
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
  }
  const int coff = p.hc ? p.chunk_offsets[si.n] : 0;
  // o^T leaves through the warp's shared tile (SM_OST): stmatrix.trans turns the accumulator (V rows x
  // time steps) into 16 time-step rows of 16 V values, and each lane stores one 16-byte piece, time step
  // ot, V columns 8 oh .. (eight 2-byte stores per thread and their 64-bit address arithmetic were 16%
  // of the kernel's instructions at bv128, H200 ncu 2026-12-01). In the tile the two 16-byte halves of
  // rows 4-7 of every 8 are swapped: each stmatrix matrix then writes all 32 banks once.
  const int ot = lane >> 1, oh = lane & 1;
  // ldmatrix.x4.trans of v^T (A fragment: m = V rows of this warp, k = the chunk's 16 time steps):
  // matrix mi = lane / 8 holds time steps 8 (mi >> 1) .. + 7 and V columns v0 + 8 (mi & 1) .. + 7.
  const int vt_row = ((lane >> 3) >> 1) * 8 + (lane & 7), vt_col = v0 + ((lane >> 3) & 1) * 8;
  // Descriptors of the tiles of record slot 0. Slot r and the k-steps are offsets added to the
  // start-address field (bits 0-13, 16-byte units: shared addresses < 256 KB never carry out of
  // it), so a step adds constants instead of rebuilding 20 descriptors.
  // Qd / W: K-major 128B-swizzled [16][K] (k-step ks: 64-column group ks / 4, 32 bytes per step
  // inside it); Kr: MN-major 128B-swizzled [16][K]; Mqk, A: interleaved [16][16].
  const uint32_t r0 = sm90::saddr(base + SM_REC);
  const uint64_t dAH0 = sm90::make_desc(r0 + R_AH, 128, 256, sm90::LAYOUT_INTERLEAVE);
  const uint64_t dAL0 = sm90::make_desc(r0 + R_AL, 128, 256, sm90::LAYOUT_INTERLEAVE);
  const uint64_t dMq0 = sm90::make_desc(r0 + R_MQ, 128, 256, sm90::LAYOUT_INTERLEAVE);
  const uint64_t dMl0 = sm90::make_desc(r0 + R_ML, 128, 256, sm90::LAYOUT_INTERLEAVE);
  const uint64_t dKr0 = sm90::make_desc(r0 + R_KR, 1024, K * 16, sm90::LAYOUT_SW128);
  const uint64_t dQd0 = sm90::make_desc(r0 + R_QD, 16, 1024, sm90::LAYOUT_SW128);
  const uint64_t dW0 = sm90::make_desc(r0 + R_W, 16, 1024, sm90::LAYOUT_SW128);
  auto kstep = [](int ks) { return (uint64_t)(((ks >> 2) * (C * 128) + (ks & 3) * 32) >> 4); };
  // YO: the [2C][K] tile of -Kg and Qd starts at R_QD (dQd0), its 64-column groups 2C * 128 bytes apart
  auto kstep2 = [](int ks) { return (uint64_t)(((ks >> 2) * (2 * C * 128) + (ks & 3) * 32) >> 4); };
  // UKG: the identity tile, written once by warpgroup 0 and made visible to the async proxy
  const uint64_t dI = sm90::make_desc(r0 - SM_REC + SM_ID, 128, 256, sm90::LAYOUT_INTERLEAVE);
  if constexpr (UKG && !YO) {
    if (cw == 0) {
#pragma unroll
      for (int u = tid; u < 256; u += 128) {
        const int i = u >> 4, jj = u & 15;
        *reinterpret_cast<bf16*>(base + SM_ID + sm90::il16_k(i, jj)) = __float2bfloat16_rn(i == jj ? 1.f : 0.f);
      }
      sm90::fence_proxy_async();
    }
    sm90::named_sync<BAR_CONS, 128 * NCONS>();
  }
  // CONS_COPIES: the consumer warps (wi = 0 .. 4 NCONS - 1) issue the bulk copies, chunks 0 .. NIN - 1
  // here and chunk c + NIN in step c: its input stage was last read by the prep of chunk c.
  const int wi = 4 * cw + w;
  if constexpr (CONS_COPIES) {
    for (int cc = 0; cc < NIN; ++cc) issue_chunk_spread<4 * NCONS>(p, si, cc, base, bars, wi, lane);
  }

  // v^T of this warp's 16 V rows for chunk c; time steps past the end of the sequence are zeroed (the
  // stage rows there are stale). The stage is released as soon as the registers hold it.
  auto load_vt = [&](int c, int rows, uint32_t (&va)[4]) {
    const int vs = c % NV;
    sm90::mbar_wait(bars + B_V_FULL + vs, (c / NV) & 1);
    KDA_STAMP2(tid == 0 && cw == 0, c, ST_C_VGO);
    ldsm_x4_t(va, base + SM_V + vs * V_BYTES + vt_row * VROW + vt_col * 2);
#pragma unroll
    for (int q = 0; q < 4; ++q) va[q] = to_bf16x2(va[q]);
    // Only a short chunk needs the mask (a branch: as a select it kept its cost, H200 2026-12-02: bv128
    // -3..-6% without it).
    if (rows < C) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int k0 = 2 * t4 + 8 * (q >> 1);
        va[q] &= (k0 < rows ? 0x0000ffffu : 0u) | (k0 + 1 < rows ? 0xffff0000u : 0u);
      }
    }
    sm90::mbar_arrive(bars + B_V_EMPTY + vs);
  };
  // Release record slot r. A peer record's slot is tracked by the peer's rec_empty (its prep refills its
  // own slot and this one together): one remote arrival per warp.
  auto release = [&](bool own, int r) {
    if (own) sm90::mbar_arrive(bars + B_REC_EMPTY + r);
    else if (lane == 0) sm90::mbar_arrive_remote(sm90::peer_addr(bars + B_REC_EMPTY + r, pair_rank(si) ^ 1u));
  };
  // o^T of chunk c (V rows vr0, vr0 + 8; time steps 8 nt + 2 t4 (+ 1)): matrix 2 nt + hv is V rows 8 hv .. of
  // time steps 8 nt ..; rows past the end are not stored. (The syncwarps order the tile's reuse.)
  auto store_o = [&](const float (&ao)[8], int c, int rows) {
    // (shared addresses from the record's: a generic tile pointer moved the wgmma descriptors out
    // of the uniform registers, 116 more instructions per step in the pair)
    const uint32_t ost = r0 - SM_REC + SM_OST + (4 * cw + w) * OST_BYTES;
    const int sm_t = 8 * (lane >> 4) + (lane & 7);  // stmatrix: row lane % 8 of matrix lane / 8
    __syncwarp();
    sm90::stsm_x4_t(ost + sm_t * 32 + ((((lane >> 3) & 1) ^ ((sm_t >> 2) & 1)) * 16), pack_in(ao[0], ao[1]),
                    pack_in(ao[2], ao[3]), pack_in(ao[4], ao[5]), pack_in(ao[6], ao[7]));
    __syncwarp();
    const uint4 ov = sm90::lds128(ost + ot * 32 + ((oh ^ ((ot >> 2) & 1)) * 16));
    if (ot < rows)
      *reinterpret_cast<uint4*>((in_t*)p.o + si.bidx * p.o_s[0] + si.h * p.o_s[2] +
                                (si.tb + (long long)c * C + ot) * p.o_s[1] + si.vb * BV + v0 + 8 * oh) = ov;
  };
  // Chunks are stepped in order: the next kept one and its row are counted, not c % m and c / m
  // (a runtime division per step; sm80's strided recurrence ran 0.1 ms slower with it, session 48).
  const int cstride = p.chunk_stride > 1 ? p.chunk_stride : 1;
  int next_kept = p.hc ? 0 : si.nc;
  long long crow = coff;
  auto store_hc = [&](int c) {
    if (c == next_kept) {
      next_kept += cstride;
#if KDA_STATE == 2
      store_state((bf16*)p.hc + (crow * p.HV + si.h) * V * K, s, vr0, t4, kv);
#else
      store_state((float*)p.hc + (crow * p.HV + si.h) * V * K, s, vr0, t4, kv);
#endif
      ++crow;
    }
  };
  // S *= Gamma_C of the record at rec
  auto decay = [&](const char* rec) {
    const float* gm = reinterpret_cast<const float*>(rec + R_GM);
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt) {
      const float2 g = *reinterpret_cast<const float2*>(gm + 8 * nt + 2 * t4);
      s[nt][0] *= g.x; s[nt][1] *= g.y; s[nt][2] *= g.x; s[nt][3] *= g.y;
    }
  };

  // One chunk: its record in slot r (own ring, or the pair's peer ring), completed in phase ph & 1.
  auto step16 = [&](int c, bool own, int r, uint32_t ph) {
    const int slot = own ? r : NREC + r;
    const int rows = min(C, si.len - c * C);
    KDA_STAMP2(tid == 0 && cw == 0, c, ST_C_TOP);
    store_hc(c);
    // S as bf16 A fragments, k-step ks = state columns 16 ks .. 16 ks + 15.
    uint32_t sa[K / 16][4];
    // OHL (K = 64): also S's low part (S - bf16(S)) for the o product
    uint32_t sl[OHL ? K / 16 : 1][4];
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) {
      if constexpr (OHL) {
        acc_to_a_split(s[2 * ks], s[2 * ks + 1], sa[ks], sl[ks]);
      } else {
        acc_to_a(s[2 * ks], s[2 * ks + 1], sa[ks]);
      }
    }
    uint32_t va[4];
    load_vt(c, rows, va);

    KDA_STAMP(tid == 0 && cw == 0, c, ST_C_WAIT);
    if (own) sm90::mbar_wait(bars + B_REC_FULL + r, ph);
    else sm90::mbar_wait(bars + B_REC_PEER + r, ph);
    KDA_STAMP(tid == 0 && cw == 0, c, ST_C_GO);
    const char* rec = base + SM_REC + slot * REC_BYTES;
    const uint64_t so = (uint64_t)(slot * (REC_BYTES >> 4));  // the slot, in descriptor units
    // LATE_DECAY, behind the step's first products: S *= Gamma_C after a wait that returns at once (one group
    // pending) but tells ptxas that no earlier group writes S (without it ptxas injects a full wait there: C7517).
    auto late_decay = [&]() {
      if constexpr (LATE_DECAY) {
        sm90::wgmma_wait<1>();
        decay(rec);
      }
    };
    if constexpr (!LATE_DECAY) decay(rec);
    const uint64_t dAH = dAH0 + so, dAL = dAL0 + so, dMq = dMq0 + so, dMl = dMl0 + so, dKr = dKr0 + so;

    // U^T and o^T accumulators (m64n16: 8 per thread), local to the step (the first product of
    // each overwrites them: scale-d = 0).
    float au[8], ao[8];
    sm90::reg_fence(s);
    sm90::reg_fence(sa);
    if constexpr (OHL) sm90::reg_fence(sl);
    sm90::reg_fence(va);
    if constexpr (YO) {
      // [Y^T | o^T] = [v^T | 0] + S [-Kg; Qd]^T
      float ay[16];
      sm90::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < K / 16; ++ks) sm90::wgmma_m64n32_rs(ay, sa[ks], dQd0 + so + kstep2(ks), ks > 0);
      sm90::wgmma_commit();
      if constexpr (CONS_COPIES) issue_chunk_spread<4 * NCONS>(p, si, c + NIN, base, bars, wi, lane);
      late_decay();
      sm90::wgmma_wait<0>();
      sm90::reg_fence(ay);
      // + v^T (its bf16 pairs in A-fragment order are the accumulator's). (v^T as the accumulator's start
      // value, set by ALU instructions, or two 8-register accumulator operands made ptxas serialize every
      // wgmma of the kernel.)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        au[2 * q] = ay[2 * q] + __uint_as_float(va[q] << 16);
        au[2 * q + 1] = ay[2 * q + 1] + __uint_as_float(va[q] & 0xffff0000u);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) ao[e] = ay[8 + e];
    } else {
      sm90::wgmma_fence();
      if constexpr (UKG) {
        // Y^T = v^T I - S Kg^T (the W slot holds Kg); U^T = Y^T A^T after the wait below
        sm90::wgmma_m64n16_rs<1>(au, va, dI, false);
      } else {
        // U^T = v^T (A_hi + A_lo)^T - S W^T
        sm90::wgmma_m64n16_rs<1>(au, va, dAH, false);
        sm90::wgmma_m64n16_rs<1>(au, va, dAL, true);
      }
#pragma unroll
      for (int ks = 0; ks < K / 16; ++ks) sm90::wgmma_m64n16_rs<-1>(au, sa[ks], dW0 + so + kstep(ks), true);
      sm90::wgmma_commit();
      if constexpr (LATE_DECAY) {  // (one group pending: before the o products)
        late_decay();
        sm90::wgmma_fence();
      }
      // o^T = S Qd^T (off the chain: issued behind U, waited for at the end of the step)
#pragma unroll
      for (int ks = 0; ks < K / 16; ++ks) sm90::wgmma_m64n16_rs<1>(ao, sa[ks], dQd0 + so + kstep(ks), ks > 0);
      if constexpr (OHL) {
#pragma unroll
        for (int ks = 0; ks < K / 16; ++ks) sm90::wgmma_m64n16_rs<1>(ao, sl[ks], dQd0 + so + kstep(ks), true);
      }
      sm90::wgmma_commit();
      if constexpr (CONS_COPIES) issue_chunk_spread<4 * NCONS>(p, si, c + NIN, base, bars, wi, lane);
      sm90::wgmma_wait<1>();
      sm90::reg_fence(au);
    }
    if constexpr (UKG) {  // U^T = Y^T (A_hi + A_lo)^T with Y^T in hi + lo (hi hi + hi lo + lo hi)
      uint32_t yh[4], yl[4];
      acc16_split(au, yh, yl);
      sm90::reg_fence(yh);
      sm90::reg_fence(yl);
      sm90::wgmma_fence();
      sm90::wgmma_m64n16_rs<1>(au, yh, dAH, false);
      sm90::wgmma_m64n16_rs<1>(au, yh, dAL, true);
      sm90::wgmma_m64n16_rs<1>(au, yl, dAH, true);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      sm90::reg_fence(au);
    }
    // U^T as bf16 A fragments, high and low parts (the low part only feeds o: rel RMSE of o
    // 2.6e-3 -> 1.9e-3 in the emulation, for one m64n16k16).
    uint32_t ua[4], ul[4];
    acc16_split(au, ua, ul);
    sm90::reg_fence(ua);
    sm90::reg_fence(ul);
    sm90::wgmma_fence();
    // S = S diag(Gamma_C) + U^T Kr;  o^T += U^T Mqk^T (hi hi + hi lo + lo hi)
    sm90::wgmma_m64nN_rs_tb<K>(s, ua, dKr);
    sm90::wgmma_m64n16_rs<1>(ao, ua, dMq, true);
    sm90::wgmma_m64n16_rs<1>(ao, ua, dMl, true);
    sm90::wgmma_m64n16_rs<1>(ao, ul, dMq, true);
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::reg_fence(s);
    sm90::reg_fence(ao);
    KDA_STAMP(tid == 0 && cw == 0, c, ST_C_DONE);
    release(own, r);
    store_o(ao, c, rows);
  };

  for (int c = 0; c < si.nc; ++c) {
    // The record of chunk c: slot r of the own ring, or (the pair, the peer's chunks) of the peer ring.
    const bool own = !PAIR || (c & 1) == pair_rank(si);
    const int j = PAIR ? c >> 1 : c;
    step16(c, own, j % NREC, (j / NREC) & 1);
  }
#if KDA_STATE != 0
  if constexpr (SLOTS) {
    const long long ht_row = state_row(p, p.ht_idx, si.n, si.h, false);  // read here: no register held the loop through
    if (p.ht && ht_row >= 0) store_state((state_t*)p.ht + ht_row * V * K, s, vr0, t4, kv);
  } else {
    if (p.ht) store_state((state_t*)p.ht + st_off, s, vr0, t4, kv);
  }
#endif
}

}  // namespace kda
