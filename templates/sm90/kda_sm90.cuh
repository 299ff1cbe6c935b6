// kdagen sm90 KDA prefill: one fused kernel per variant (templates/sm90/DESIGN.md).
//   kda_fused (grid: sequences x value heads; 2K prep threads + V/64 consumer warpgroups):
//   the prep group streams q, k, g, v in with bulk copies and turns each 16-token chunk into a
//   record in shared memory; the consumers run the chunk recurrence on it with the fp32 state in
//   wgmma accumulators. No per-chunk workspace goes through HBM.
#pragma once
#include <type_traits>
#include "kda_sm90_recur.cuh"
#if KDA_SM90_PIPE_ON
#include "kda_sm90_prep_pipe.cuh"
#endif

extern "C" __global__ void __launch_bounds__(kda::NT, 1) kda_fused(const KdaParams p) {
  using namespace kda;
  extern __shared__ __align__(16) char smem_raw[];
  // Swizzled record tiles need 1024-byte aligned atoms: align the dynamic base (SMEM_BYTES
  // carries the slack).
  char* base = smem_raw + ((1024u - (sm90::saddr(smem_raw) & 1023u)) & 1023u);
  uint64_t* bars = reinterpret_cast<uint64_t*>(base + SM_BAR);

  SeqInfo si;
  si.n = blockIdx.x;
  si.h = blockIdx.y;
  si.vb = blockIdx.z;
  int bos;
  seq_bounds(p, si.n, bos, si.len);
  si.nc = (si.len + C - 1) / C;
  si.bidx = p.cu_seqlens ? 0 : si.n;
  si.tb = p.cu_seqlens ? bos : 0;

  if (threadIdx.x == 0) {
    for (int i = 0; i < NIN; ++i) sm90::mbar_init(bars + B_IN_FULL + i, 1);
    for (int i = 0; i < NV; ++i) {
      sm90::mbar_init(bars + B_V_FULL + i, 1);
      sm90::mbar_init(bars + B_V_EMPTY + i, 128 * NCONS);
    }
    for (int i = 0; i < NREC; ++i) {
      sm90::mbar_init(bars + B_REC_FULL + i, NTP);
      sm90::mbar_init(bars + B_REC_EMPTY + i, 128 * NCONS);
    }
#if KDA_SM90_PIPE_ON
    for (int i = 0; i < 2; ++i) {
      sm90::mbar_init(bars + B_SCR_FULL + i, NTG);   // group A's threads
      sm90::mbar_init(bars + B_SCR_EMPTY + i, NTG);  // group B's threads
    }
    for (int i = 0; i < NIN; ++i) sm90::mbar_init(bars + B_IN_EMPTY + i, NTG);
#endif
    // barrier initialisation visible to the async proxy (the bulk copies' complete_tx)
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (threadIdx.x < NTP) {
#if KDA_SM90_PIPE_ON
    prep_role_pipe(p, si, base, bars);  // (each group sets its own register limit)
#else
    if constexpr (REALLOC) sm90::regs_dec<PREP_REGS>();
    prep_role(p, si, base, bars);
#endif
  } else {
    if constexpr (REALLOC) sm90::regs_inc<CONS_REGS>();
    consumer_role(p, si, base, bars, (threadIdx.x - NTP) / 128);
  }
}
