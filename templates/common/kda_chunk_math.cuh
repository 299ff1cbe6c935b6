// kdagen: per-chunk arithmetic the CUDA targets' preps share: the gate activation of the variant's
// gate form and the forward substitution with (I + L). Included after the target's layout header,
// which defines the chunk C and the fp32 row pitch CP of L^T.
#pragma once

namespace kda {

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

}  // namespace kda
