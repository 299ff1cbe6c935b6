// wgmma issue and round-trip costs on the H200 (session-16 diagnostic): per iteration, a chain of n
// wgmma m64nNk16 (A from registers, B from shared memory) then commit + wait, and a dependent round trip
// (wgmma, wait, fp32 -> bf16 A fragments, the next wgmma), with 1 or 2 warpgroups per SM.
#include <cstdio>
#include <cstdint>
#include "kda_sm90_ptx.cuh"
using namespace kda;
#define ITER 256
template <int MODE, int NWG, int n>
__global__ void __launch_bounds__(128 * NWG, 1) k(float* out, long long* cyc) {
  extern __shared__ __align__(1024) char sm[];
  for (int i = threadIdx.x; i < 32768 / 4; i += blockDim.x) reinterpret_cast<float*>(sm)[i] = 0.001f * (i & 7);
  __syncthreads();
  const uint32_t base = sm90::saddr(sm);
  const uint64_t d = sm90::make_desc(base, 16, 1024, sm90::LAYOUT_SW128);
  const uint64_t dt = sm90::make_desc(base, 1024, 2048, sm90::LAYOUT_SW128);
  uint32_t a[4] = {0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u};
  float acc16[8] = {}, acc32[16] = {}, acc128[16][4] = {};
  long long t0 = clock64();
  for (int it = 0; it < ITER; ++it) {
    sm90::reg_fence(a);
    sm90::wgmma_fence();
    if (MODE == 0) {
#pragma unroll
      for (int j = 0; j < n; ++j) sm90::wgmma_m64n16_rs<1>(acc16, a, d + 2 * j, true);
    } else if (MODE == 1) {
#pragma unroll
      for (int j = 0; j < n; ++j) sm90::wgmma_m64n32_rs(acc32, a, d + 2 * j, true);
    } else if (MODE == 2) {
#pragma unroll
      for (int j = 0; j < n; ++j) sm90::wgmma_m64nN_rs_tb<128>(acc128, a, dt + 2 * j);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::reg_fence(acc16);
    sm90::reg_fence(acc32);
    sm90::reg_fence(acc128);
    if (MODE == 3) {  // n dependent round trips: the product's accumulator is the next A
#pragma unroll 1
      for (int j = 0; j < n; ++j) {
        sm90::wgmma_fence();
        sm90::wgmma_m64n16_rs<1>(acc16, a, d, false);
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::reg_fence(acc16);
        for (int q = 0; q < 4; ++q) a[q] = pack_bf16(acc16[2 * q], acc16[2 * q + 1]);
      }
    }
  }
  long long t1 = clock64();
  float s = 0;
  for (int j = 0; j < 8; ++j) s += acc16[j];
  for (int j = 0; j < 16; ++j) s += acc32[j] + acc128[j][0];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s + a[0];
  if (threadIdx.x == 0) cyc[blockIdx.x] = t1 - t0;
}
template <int MODE, int NWG, int n> void run(const char* name, float* out, long long* cyc, int nsm) {
  cudaFuncSetAttribute(k<MODE, NWG, n>, cudaFuncAttributeMaxDynamicSharedMemorySize, 40960);
  k<MODE, NWG, n><<<nsm, 128 * NWG, 40960>>>(out, cyc);
  k<MODE, NWG, n><<<nsm, 128 * NWG, 40960>>>(out, cyc);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) { printf("%s: %s\n", name, cudaGetErrorString(e)); return; }
  long long h[256]; cudaMemcpy(h, cyc, nsm * sizeof(long long), cudaMemcpyDeviceToHost);
  double m = 0; for (int i = 0; i < nsm; ++i) m += h[i]; m /= nsm;
  printf("%-34s n %2d  WG/SM %d  %8.1f cycles per iteration (%6.1f per wgmma)\n", name, n, NWG, m / ITER, m / ITER / n);
}
int main() {
  int nsm; cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0);
  float* out; long long* cyc; cudaMalloc(&out, nsm * 256 * 4); cudaMalloc(&cyc, nsm * 8);
#define R(M, W, N, NAME) run<M, W, N>(NAME, out, cyc, nsm)
  R(0, 1, 1, "m64n16k16 chain + wait"); R(0, 1, 2, "m64n16k16 chain + wait"); R(0, 1, 4, "m64n16k16 chain + wait");
  R(0, 1, 8, "m64n16k16 chain + wait"); R(0, 1, 16, "m64n16k16 chain + wait");
  R(1, 1, 1, "m64n32k16 chain + wait"); R(1, 1, 2, "m64n32k16 chain + wait"); R(1, 1, 4, "m64n32k16 chain + wait");
  R(1, 1, 8, "m64n32k16 chain + wait"); R(1, 1, 16, "m64n32k16 chain + wait");
  R(2, 1, 1, "m64n128k16 tnspB chain + wait"); R(2, 1, 2, "m64n128k16 tnspB chain + wait");
  R(2, 1, 4, "m64n128k16 tnspB chain + wait"); R(2, 1, 8, "m64n128k16 tnspB chain + wait");
  R(3, 1, 1, "dependent m64n16 round trips"); R(3, 1, 4, "dependent m64n16 round trips"); R(3, 1, 8, "dependent m64n16 round trips");
  R(0, 2, 1, "m64n16k16 chain + wait"); R(0, 2, 8, "m64n16k16 chain + wait"); R(0, 2, 16, "m64n16k16 chain + wait");
  R(1, 2, 1, "m64n32k16 chain + wait"); R(1, 2, 8, "m64n32k16 chain + wait"); R(2, 2, 1, "m64n128k16 tnspB chain + wait");
  R(2, 2, 4, "m64n128k16 tnspB chain + wait"); R(3, 2, 1, "dependent m64n16 round trips"); R(3, 2, 8, "dependent m64n16 round trips");
  return 0;
}
