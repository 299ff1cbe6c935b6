// kdagen: the variant's compile-time constants and element types, for every CUDA target. The
// including translation unit defines KDA_C, KDA_K, KDA_V, KDA_BV, KDA_IN_T, KDA_GATE, KDA_STATE
// (see the target's kda_fwd.cu.j2).
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

}  // namespace kda
