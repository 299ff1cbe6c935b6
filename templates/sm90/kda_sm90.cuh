// kdagen sm90 KDA prefill: one fused kernel per variant, two entry points (templates/sm90/DESIGN.md).
//   kda_fused (grid: value heads x sequences x V blocks; 2K prep threads + V/64 consumer warpgroups),
//   and kda_fused_slots, the same with a state pool's slots for states:
//   the prep group streams q, k, g, v in with bulk copies and turns each 16-token chunk into a
//   record in shared memory; the consumers run the chunk recurrence on it with the fp32 state in
//   wgmma accumulators. No per-chunk workspace goes through HBM.
#pragma once
#include <type_traits>
#include "kda_sm90_recur.cuh"
#if KDA_SM90_PIPE_ON
#include "kda_sm90_prep_pipe.cuh"
#endif

#if KDA_SM90_PAIR_ON
#define KDA_CLUSTER_DIMS __cluster_dims__(1, 1, 2)
#else
#define KDA_CLUSTER_DIMS
#endif
namespace kda {
// Varlen: grid row r (blockIdx.y, heads along x) takes the sequence of rank r by descending length (ties by
// index), so the longest sequences' CTAs are dispatched first and the short ones fill the tail (list
// scheduling, longest first; a model of issue 16's varlen H96 row: 501 -> 387 chunk times at bv128). The
// CTA ranks the lengths itself, in shared memory before the rings exist: O(N^2 / NT) per CTA, so up to LPT_MAX
// sequences; beyond that, index order (H200 2026-12-02 at 64: 64 x 48 tokens +4% at bv128, 64 random lengths
// -2..-5% at bv128 but +3% in the pair: many CTAs per SM leave a smaller tail than the ranking costs).
constexpr int LPT_MAX = 16;
// Read by the launcher: 1 = the grid is (heads, sequences, V blocks). (Images without it took (sequences, heads).)
extern "C" __device__ int kda_grid_heads_x = 1;
__device__ __forceinline__ int longest_first(const KdaParams& p, int r, char* scratch) {
  const int N = p.N;
  if (!p.cu_seqlens || N > LPT_MAX) return r;
  int* sl = reinterpret_cast<int*>(scratch);
  int* pick = sl + LPT_MAX;
  for (int i = threadIdx.x; i < N; i += NT) sl[i] = p.cu_seqlens[i + 1] - p.cu_seqlens[i];
  __syncthreads();
  for (int i = threadIdx.x; i < N; i += NT) {
    const int li = sl[i];
    int rank = 0;
    for (int j = 0; j < N; ++j) rank += (sl[j] > li) | ((sl[j] == li) & (j < i));
    if (rank == r) *pick = i;  // (the ranks are a permutation: exactly one thread writes)
  }
  __syncthreads();
  const int n = *pick;
  __syncthreads();  // (the scratch is the first record slot's, written once the rings exist)
  return n;
}
}  // namespace kda

namespace kda {
// One CTA's work; SLOTS: its states are a state pool's slots (consumer_role).
template <bool SLOTS>
__device__ __forceinline__ void fused_cta(const KdaParams& p, char* smem_raw) {
  // Swizzled record tiles need 1024-byte aligned atoms: align the dynamic base (SMEM_BYTES
  // carries the slack).
  char* base = smem_raw + ((1024u - (sm90::saddr(smem_raw) & 1023u)) & 1023u);
  uint64_t* bars = reinterpret_cast<uint64_t*>(base + SM_BAR);

  SeqInfo si;
  si.n = longest_first(p, blockIdx.y, base);
  si.h = blockIdx.x;
  si.vb = blockIdx.z;
  int bos;
  seq_bounds(p, si.n, bos, si.len);
  si.nc = (si.len + C - 1) / C;
  si.bidx = p.cu_seqlens ? 0 : si.n;
  si.tb = p.cu_seqlens ? bos : 0;
#if KDA_SM90_PAIR_ON
  si.rank = (int)sm90::cluster_rank();
  si.nloc = (si.nc - si.rank + 1) / 2;
#endif

  if (threadIdx.x == 0) {
    for (int i = 0; i < NIN; ++i) sm90::mbar_init(bars + B_IN_FULL + i, 1);
    for (int i = 0; i < NV; ++i) {
      sm90::mbar_init(bars + B_V_FULL + i, 1);
      sm90::mbar_init(bars + B_V_EMPTY + i, 128 * NCONS);
    }
    for (int i = 0; i < NREC; ++i) {
      sm90::mbar_init(bars + B_REC_FULL + i, NTP);
      // (the pair: also the peer's consumer warps, one remote arrival each)
      sm90::mbar_init(bars + B_REC_EMPTY + i, 128 * NCONS + (PAIR ? 4 * NCONS : 0));
    }
#if KDA_SM90_PIPE_ON
    for (int i = 0; i < 2; ++i) {
      sm90::mbar_init(bars + B_SCR_FULL + i, NTG);   // group A's threads
      sm90::mbar_init(bars + B_SCR_EMPTY + i, NTG);  // group B's threads
    }
    for (int i = 0; i < NIN; ++i) sm90::mbar_init(bars + B_IN_EMPTY + i, NTG);
    if constexpr (PAIR) {
      for (int i = 0; i < NREC; ++i) sm90::mbar_init(bars + B_REC_PEER + i, 1);  // the peer's expect_tx
    }
#endif
    // barrier initialisation visible to the async proxy (the bulk copies' complete_tx)
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // (the pair: the peer's barriers are initialised before any remote arrival or copy reaches them)
  if constexpr (PAIR) sm90::cluster_sync();
  else __syncthreads();

// KDA_SM90_PAD=N (diagnostic): N never-executed instructions ahead of the roles move all their code by ~16 N bytes, the
// executed instructions unchanged: a layout control for A/Bs (H200 2026-12-03: 8 to 1024 all -0.5..-0.9% against 0).
#if defined(KDA_SM90_PAD) && KDA_SM90_PAD > 0
  if (p.q == nullptr) {  // (never)
#pragma unroll
    for (int i = 0; i < KDA_SM90_PAD; ++i) asm volatile("nanosleep.u32 1;");
  }
#endif
  if (threadIdx.x < NTP + NTX) {
#if KDA_SM90_PIPE_ON
    prep_role_pipe(p, si, base, bars);  // (each group sets its own register limit)
#else
    if constexpr (REALLOC) sm90::regs_dec<PREP_REGS>();
    prep_role(p, si, base, bars);
#endif
  } else {
    if constexpr (REALLOC) sm90::regs_inc<CONS_REGS>();
    consumer_role<SLOTS>(p, si, base, bars, (threadIdx.x - NTP - NTX) / 128);
  }
  // (the pair: neither CTA exits while the other may still arrive on its barriers)
  if constexpr (PAIR) sm90::cluster_sync();
}
}  // namespace kda

extern "C" __global__ void KDA_CLUSTER_DIMS __launch_bounds__(kda::NT, 1) kda_fused(const KdaParams p) {
  extern __shared__ __align__(16) char smem_raw[];
  kda::fused_cta<false>(p, smem_raw);
}
#if KDA_STATE != 0
// A second entry point rather than a run-time branch, so kda_fused's code is unchanged (SASS identical);
// the launcher takes it for calls whose states are a state pool's slots (KdaCall.h0_index, ht_index).
extern "C" __global__ void KDA_CLUSTER_DIMS __launch_bounds__(kda::NT, 1) kda_fused_slots(const KdaParams p) {
  extern __shared__ __align__(16) char smem_slots[];
  kda::fused_cta<true>(p, smem_slots);
}
#endif
