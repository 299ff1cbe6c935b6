// kdagen sm90: tensor-map (TMA) copies. The launcher (kdagen/targets/tma.py) encodes one map per input tensor,
// 4D (K or V, time, heads, batch) with its strides, and passes them after the parameter struct; a copy is one
// 16-row box of one head, so a chunk's q, k, g and v are 4 instructions from one thread (per-row bulk copies
// cost ~100-140 cycles each in the issuing warp, H200 stamps 2026-12-02: 1700-2300 cycles per chunk in group B).
#pragma once
#include <cstddef>
#include "kda_common.cuh"
#include "kda_sm90_ptx.cuh"

struct alignas(64) KdaTmap {  // a CUtensorMap: 128 opaque bytes
  unsigned long long w[16];
};
enum KdaTmapId { TM_Q = 0, TM_K, TM_G, TM_V, TM_N };
// The kernel's one argument: the parameters, then the tensor maps (64-byte aligned, in parameter space).
struct KdaParams90 {
  KdaParams p;
  KdaTmap tm[TM_N];
};

namespace kda {

// The maps of the KdaParams90 that p is the first member of (p refers into the kernel's parameter space).
__device__ __forceinline__ const KdaTmap* tmaps(const KdaParams& p) {
  return reinterpret_cast<const KdaTmap*>(reinterpret_cast<const char*>(&p) + offsetof(KdaParams90, tm));
}

namespace sm90 {
// Box (c0 .., c1 .., c2, c3) of tensor map `map` into shared memory at dst (128-byte aligned; 1024 with the
// 128-byte swizzle), completing on mbarrier bar with the box's bytes (out-of-range elements are zero-filled
// and counted).
__device__ __forceinline__ void tma_load_4d(void* dst, const KdaTmap* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(saddr(dst)),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(saddr(bar))
      : "memory");
}
}  // namespace sm90
}  // namespace kda

// Read by the launcher: sizeof(KdaParams90), the maps' offset, sizeof(KdaParams).
#ifndef KDA_LAYOUT_ONLY
extern "C" __device__ int kda_param_meta[3] = {(int)sizeof(KdaParams90), (int)offsetof(KdaParams90, tm),
                                               (int)sizeof(KdaParams)};
#endif
