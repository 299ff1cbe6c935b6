// kdagen sm80: helpers of both kda_prep kernels (the L/Mqk n-tile product, lower-triangle
// indices, the chunk a block works on); the gate and the substitution are in common/.
#pragma once
#include "kda_layout.cuh"
#include "kda_chunk_math.cuh"

namespace kda {

// One 16x8 n-tile of L (A = k e^G) and of Mqk (A = q e^G) against the same B fragment (k e^-G),
// as both preps build their 16x16 blocks.
__device__ __forceinline__ void l_mqk_mma(float (&accL)[4], float (&accM)[4], const uint32_t (&ak)[4],
                                          const uint32_t (&aq)[4], uint32_t b0, uint32_t b1) {
  mma_bf16(accL, ak, b0, b1);
  mma_bf16(accM, aq, b0, b1);
}

// (i, j), j <= i, of the u-th entry of a lower triangle stored row by row (u = i (i + 1) / 2 + j).
__device__ __forceinline__ void tri_pair(int u, int& i, int& j) {
  i = (int)((sqrtf(8.f * u + 1.f) - 1.f) * 0.5f);
  while ((i + 1) * (i + 2) / 2 <= u) ++i;  // the float root can be one off either way
  while (i * (i + 1) / 2 > u) --i;
  j = u - i * (i + 1) / 2;
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
