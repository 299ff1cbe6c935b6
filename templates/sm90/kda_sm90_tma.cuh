// kdagen sm90: the tensor maps of the pair's copies (KDA_SM90_TMA, templates/sm90/DESIGN.md "Who copies").
// The launcher (kdagen/targets/tma.py) encodes one map per input, 4D (K or V, time, heads, batch) with the
// tensor's strides, and passes the four after the parameter struct in one __grid_constant__ argument; a copy is
// one box of C rows of one head. Row copies took one cp.async.bulk per row, each an ELECT loop of ~9
// instructions in the copy warps: ncu (H200 2026-12-02) had the copy warpgroup at 19% of all warp-instructions
// executed, on the schedulers that issue the prep's and the consumers' chains.
#pragma once
#include <cstddef>
#include "kda_common.cuh"
#include "kda_sm90_ptx.cuh"

struct alignas(64) KdaTmap {  // a CUtensorMap: 128 opaque bytes
  unsigned long long w[16];
};
enum KdaTmapId { TM_Q = 0, TM_K, TM_G, TM_V, TM_N };
// The kernel's argument with tensor maps: the parameters, then the maps (64-byte aligned, in parameter space).
struct KdaParams90 {
  KdaParams p;
  KdaTmap tm[TM_N];
};

namespace kda {
// The maps of the KdaParams90 whose first member p is (p refers into the kernel's parameter space).
__device__ __forceinline__ const KdaTmap* tmaps(const KdaParams& p) {
  return reinterpret_cast<const KdaTmap*>(reinterpret_cast<const char*>(&p) + offsetof(KdaParams90, tm));
}

namespace sm90 {
// Box (c0, c1, c2, c3) of tensor map `map` into this CTA's shared memory at dst (128-byte aligned; 1024 with
// the 128-byte swizzle), completing on mbarrier bar with the box's bytes (elements outside the tensor are
// zero-filled and counted).
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
