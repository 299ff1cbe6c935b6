// Self-test kernels for the sm90 target's primitives (tests/test_sm90.py compiles this file with
// nvcc and checks each result against torch on the GPU). Each kernel is one warpgroup exercising
// one operand form exactly as templates/sm90 uses it, so a failure names the broken piece:
//   t_k16:  D[64x16]  = sum_ks A_ks B_ks^T, A from registers, B K-major 128B-swizzled [16][128]
//           (8 k-steps: the Qd / W descriptors), scale-a +1 (t_k16n: -1)
//   t_mn:   D[64x128] = A B, A [64x16] from registers, B MN-major 128B-swizzled [16][128] (Kr)
//   t_vt:   D[64x16]  = v^T Bil^T: v [16][64] bulk-copied (mbarrier complete_tx) into rows of
//           144 bytes, A = v^T by ldmatrix.trans with time steps >= rows zeroed, B interleaved
//           [16][16] (Mqk / (I+L)^-1 descriptors)
#include <cuda_bf16.h>
#include <stdint.h>

#include "kda_common.cuh"
#include "kda_sm90_ptx.cuh"

using namespace kda;

struct SelfTestArgs {
  const __nv_bfloat16* a;  // A operand, row-major
  const __nv_bfloat16* b;  // B operand, row-major as described per kernel
  float* d;                // result, row-major
  int flag;                // t_vt: valid time steps
  int pad;
};

// A fragment (m16n8k16 layout per warp) of rows 16 w .. of a row-major [64][lda] bf16 matrix,
// columns k0 .. k0 + 15.
__device__ __forceinline__ void load_afrag(const __nv_bfloat16* A, int lda, int k0, uint32_t (&a)[4]) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g8 = lane >> 2, t4 = lane & 3;
  const __nv_bfloat16* r0 = A + (16 * w + g8) * lda + k0 + 2 * t4;
  const __nv_bfloat16* r1 = r0 + 8 * lda;
  a[0] = *reinterpret_cast<const uint32_t*>(r0);
  a[1] = *reinterpret_cast<const uint32_t*>(r1);
  a[2] = *reinterpret_cast<const uint32_t*>(r0 + 8);
  a[3] = *reinterpret_cast<const uint32_t*>(r1 + 8);
}

// A 1024-byte aligned pointer into a static buffer with 1024 bytes of slack (swizzled tiles).
__device__ __forceinline__ char* align1024(char* p) {
  return p + ((1024u - (sm90::saddr(p) & 1023u)) & 1023u);
}

// Store an m64nN accumulator (N / 8 n-tiles of 4) row-major into D [64][N].
template <int NT>
__device__ __forceinline__ void store_acc(float* D, const float (&acc)[NT][4]) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g8 = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) D[(16 * w + g8 + 8 * (e >> 1)) * (8 * NT) + 8 * nt + 2 * t4 + (e & 1)] = acc[nt][e];
}

template <int SCALE_A>
__device__ __forceinline__ void k16_body(const SelfTestArgs& p) {
  __shared__ __align__(16) char sraw[16 * 128 * 2 + 1024];
  char* sb = align1024(sraw);
  for (int e = threadIdx.x; e < 16 * 128; e += 128) {
    const int n = e / 128, k = e % 128;
    *reinterpret_cast<__nv_bfloat16*>(sb + sm90::sw128_k<16>(n, k)) = p.b[e];  // B [16 n][128 k]
  }
  sm90::fence_proxy_async();
  __syncthreads();
  uint32_t a[8][4];
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) load_afrag(p.a, 128, 16 * ks, a[ks]);
  float acc[8] = {};
  const uint32_t ra = sm90::saddr(sb);
  sm90::reg_fence(a);
  sm90::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    const uint64_t desc = sm90::make_desc(ra + (ks >> 2) * (16 * 128) + (ks & 3) * 32, 16, 1024, sm90::LAYOUT_SW128);
    sm90::wgmma_m64n16_rs<SCALE_A>(acc, a[ks], desc, ks > 0);
  }
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::reg_fence(acc);
  store_acc<2>(p.d, *reinterpret_cast<const float(*)[2][4]>(acc));
}

extern "C" __global__ void __launch_bounds__(128) t_k16(const SelfTestArgs p) { k16_body<1>(p); }
extern "C" __global__ void __launch_bounds__(128) t_k16n(const SelfTestArgs p) { k16_body<-1>(p); }

extern "C" __global__ void __launch_bounds__(128) t_mn(const SelfTestArgs p) {
  __shared__ __align__(16) char sraw[16 * 128 * 2 + 1024];
  char* sb = align1024(sraw);
  for (int e = threadIdx.x; e < 16 * 128; e += 128) {
    const int k = e / 128, n = e % 128;
    *reinterpret_cast<__nv_bfloat16*>(sb + sm90::sw128_mn<128>(k, n)) = p.b[e];  // B [16 k][128 n]
  }
  sm90::fence_proxy_async();
  __syncthreads();
  uint32_t a[4];
  load_afrag(p.a, 16, 0, a);
  float acc[16][4] = {};
  const uint64_t desc = sm90::make_desc(sm90::saddr(sb), 1024, 128 * 16, sm90::LAYOUT_SW128);
  sm90::reg_fence(a);
  sm90::reg_fence(acc);
  sm90::wgmma_fence();
  sm90::wgmma_m64nN_rs_tb<128>(acc, a, desc);
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::reg_fence(acc);
  store_acc<16>(p.d, acc);
}

extern "C" __global__ void __launch_bounds__(128) t_vt(const SelfTestArgs p) {
  constexpr int ROW = 64 * 2 + 16;
  __shared__ __align__(16) char sv[16 * ROW];
  __shared__ __align__(128) char sb[512];
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    sm90::mbar_init(&bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  for (int e = threadIdx.x; e < 256; e += 128)
    *reinterpret_cast<__nv_bfloat16*>(sb + sm90::il16_k(e / 16, e % 16)) = p.b[e];  // B [16 n][16 k]
  sm90::fence_proxy_async();
  __syncthreads();
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, t4 = lane & 3;
  if (w == 0) {  // bulk copies of the 16 rows of v [16][64] (128 bytes each), as issue_chunk does
    if (lane == 0) sm90::mbar_arrive_expect_tx(&bar, 16 * 128);
    __syncwarp();
    if (lane < 16) sm90::bulk_g2s(sv + lane * ROW, p.a + lane * 64, 128, &bar);
  }
  sm90::mbar_wait(&bar, 0);
  uint32_t va[4];
  const int vt_row = ((lane >> 3) >> 1) * 8 + (lane & 7), vt_col = 16 * w + ((lane >> 3) & 1) * 8;
  ldsm_x4_t(va, sv + vt_row * ROW + vt_col * 2);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int k0 = 2 * t4 + 8 * (q >> 1);
    va[q] &= (k0 < p.flag ? 0x0000ffffu : 0u) | (k0 + 1 < p.flag ? 0xffff0000u : 0u);
  }
  float acc[8] = {};
  sm90::reg_fence(va);
  sm90::wgmma_fence();
  sm90::wgmma_m64n16_rs<1>(acc, va, sm90::make_desc(sm90::saddr(sb), 128, 256, sm90::LAYOUT_INTERLEAVE), false);
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::reg_fence(acc);
  store_acc<2>(p.d, *reinterpret_cast<const float(*)[2][4]>(acc));
}
