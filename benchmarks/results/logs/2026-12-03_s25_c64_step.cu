// Consumer-step microbenchmark (kdagen session 25, diagnostic). NWG warpgroups per SM each run the consumer's per-step
// products and register work for a C-token step, as the pair's chunk-16 step does them (YO) and as a chunk-32/64 step
// would: [Y^T | o^T] = S [-Kg; Qd]^T (m64n(2C)k16 x K/16), Y^T += v^T, U^T = Y^T A^T in hi + lo (3 x C/16 m64nCk16),
// S = S Gamma_C + U^T Kr (C/16 m64n128k16, B transposed), o^T += U^T Mqk^T in hi + lo (3 x C/16 m64nCk16), o^T out
// through stmatrix. Records are static in shared memory; no mbarriers, no copies: the step's floor with ptxas's schedule.
// Each accumulator is a whole array of its own (a sub-range of one as a smaller wgmma's accumulator serializes every
// wgmma: C7511).
#include <cstdio>
#include <cstdint>
#include "kda_sm90_ptx.cuh"
using namespace kda;
#include "wg_gen.inc"

#define ITER 128

__device__ __forceinline__ void to_a(const float* d, int ks, uint32_t* a) {
  a[0] = pack_bf16(d[8 * ks + 0], d[8 * ks + 1]);
  a[1] = pack_bf16(d[8 * ks + 2], d[8 * ks + 3]);
  a[2] = pack_bf16(d[8 * ks + 4], d[8 * ks + 5]);
  a[3] = pack_bf16(d[8 * ks + 6], d[8 * ks + 7]);
}
__device__ __forceinline__ void to_a_split(const float* d, int ks, uint32_t* h, uint32_t* l) {
#pragma unroll
  for (int q = 0; q < 4; ++q) split_bf16(d[8 * ks + 2 * q], d[8 * ks + 2 * q + 1], h[q], l[q]);
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t* r, uint32_t a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ float lo_f(uint32_t x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float hi_f(uint32_t x) { return __uint_as_float(x & 0xffff0000u); }

// Shared layout (bytes): [-Kg; Qd] tile [2C][128] (K-major, 128-byte swizzle), A hi/lo and Mqk hi/lo [C][C] (C = 16:
// interleaved [16][16]; else K-major swizzled), Kr [C][128] (MN-major swizzled), v rows (pitch 144), Gamma_C, o tiles.
template <int C, int NWG> struct L {
  static constexpr int YO = 0, AB = C == 16 ? 512 : C * 128;
  static constexpr int AH = 2 * C * 256, AL = AH + AB, MH = AL + AB, ML = MH + AB;
  static constexpr int KR = ((ML + AB + 1023) / 1024) * 1024, VR = KR + C * 256, GM = VR + C * 144;
  static constexpr int OST = GM + 512, END = OST + 4 * NWG * C * 32;
};

template <int C, int NWG>
__global__ void __launch_bounds__(128 * NWG, 1) step_kernel(float* out, long long* cyc, uint4* ob) {
  extern __shared__ __align__(1024) char sm[];
  using Y = L<C, NWG>;
  for (int i = threadIdx.x; i < Y::END / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(sm)[i] = 0x3c003c00u + (i & 7);
  for (int i = threadIdx.x; i < 128; i += blockDim.x) reinterpret_cast<float*>(sm + Y::GM)[i] = 0.99f;
  __syncthreads();
  const int w = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, t4 = lane & 3, wg_i = threadIdx.x >> 7;
  const uint32_t b = sm90::saddr(sm);
  const uint64_t dYO = sm90::make_desc(b + Y::YO, 16, 1024, sm90::LAYOUT_SW128);
  const uint64_t dKr = sm90::make_desc(b + Y::KR, 1024, 2048, sm90::LAYOUT_SW128);
  const uint64_t dAH = C == 16 ? sm90::make_desc(b + Y::AH, 128, 256, sm90::LAYOUT_INTERLEAVE)
                               : sm90::make_desc(b + Y::AH, 16, 1024, sm90::LAYOUT_SW128);
  const uint64_t dAL = dAH + (Y::AB >> 4), dMH = dAH + (2 * Y::AB >> 4), dML = dAH + (3 * Y::AB >> 4);
  constexpr int NA = C / 2;  // floats per thread of an m64nC accumulator
  float s[64], yo[C];
#pragma unroll
  for (int i = 0; i < 64; ++i) s[i] = 0.01f * (i & 3);
#pragma unroll
  for (int i = 0; i < C; ++i) yo[i] = 0.f;
  const uint32_t vaddr = b + Y::VR + (((lane >> 3) >> 1) * 8 + (lane & 7)) * 144 + (16 * w + ((lane >> 3) & 1) * 8) * 2;
  const uint32_t oaddr = b + Y::OST + (wg_i * 4 + w) * C * 32 + lane * 16;
  uint4* og = ob + (blockIdx.x * blockDim.x + threadIdx.x) * (C / 16);
  long long t0 = clock64();
#pragma unroll 1
  for (int it = 0; it < ITER; ++it) {
    uint32_t a[8][4];
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) to_a(s, ks, a[ks]);
    sm90::reg_fence(a);
    sm90::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) wg<2 * C, 0>(yo, a[ks], dYO + (((ks >> 2) * (2 * C * 128) + (ks & 3) * 32) >> 4), ks > 0);
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::reg_fence(yo);
    float o[NA];
#pragma unroll
    for (int e = 0; e < NA; ++e) o[e] = yo[NA + e];
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {  // S *= Gamma_C
      const float2 g = *reinterpret_cast<const float2*>(sm + Y::GM + (8 * nt + 2 * t4) * 4);
      s[4 * nt] *= g.x; s[4 * nt + 1] *= g.y; s[4 * nt + 2] *= g.x; s[4 * nt + 3] *= g.y;
    }
#pragma unroll
    for (int vb = 0; vb < C / 16; ++vb) {  // Y^T += v^T
      uint32_t r[4];
      ldsm_x4_t(r, vaddr + vb * 16 * 144);
#pragma unroll
      for (int q = 0; q < 4; ++q) { yo[8 * vb + 2 * q] += lo_f(r[q]); yo[8 * vb + 2 * q + 1] += hi_f(r[q]); }
    }
    uint32_t yh[C / 16][4], yl[C / 16][4];
#pragma unroll
    for (int kk = 0; kk < C / 16; ++kk) to_a_split(yo, kk, yh[kk], yl[kk]);
    sm90::reg_fence(yh);
    sm90::reg_fence(yl);
    float u[NA];
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < C / 16; ++kk) {  // U^T = Y^T A^T (hi hi + hi lo + lo hi)
      const uint64_t off = (kk * (C == 16 ? 0 : 32)) >> 4;
      wg<C, 0>(u, yh[kk], dAH + off, kk > 0);
      wg<C, 0>(u, yh[kk], dAL + off);
      wg<C, 0>(u, yl[kk], dAH + off);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::reg_fence(u);
    uint32_t uh[C / 16][4], ul[C / 16][4];
#pragma unroll
    for (int kk = 0; kk < C / 16; ++kk) to_a_split(u, kk, uh[kk], ul[kk]);
    sm90::reg_fence(uh);
    sm90::reg_fence(ul);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < C / 16; ++kk) wg<128, 1>(s, uh[kk], dKr + ((kk * 4096) >> 4));
#pragma unroll
    for (int kk = 0; kk < C / 16; ++kk) {  // o^T += U^T Mqk^T (hi hi + hi lo + lo hi)
      const uint64_t off = (kk * (C == 16 ? 0 : 32)) >> 4;
      wg<C, 0>(o, uh[kk], dMH + off);
      wg<C, 0>(o, uh[kk], dML + off);
      wg<C, 0>(o, ul[kk], dMH + off);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::reg_fence(s);
    sm90::reg_fence(o);
#pragma unroll
    for (int m = 0; m < C / 16; ++m) {  // o^T out: bf16, stmatrix.trans, 16-byte pieces to global
      const float* om = o + 8 * m;
      sm90::stsm_x4_t(oaddr + m * 512, pack_bf16(om[0], om[1]), pack_bf16(om[2], om[3]), pack_bf16(om[4], om[5]),
                      pack_bf16(om[6], om[7]));
    }
    __syncwarp();
#pragma unroll
    for (int m = 0; m < C / 16; ++m) og[m] = sm90::lds128(oaddr + m * 512);
  }
  long long t1 = clock64();
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) acc += s[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  if (threadIdx.x == 0) cyc[blockIdx.x] = t1 - t0;
}

template <int C, int NWG> void run(float* out, long long* cyc, uint4* ob, int nsm) {
  constexpr int smem = L<C, NWG>::END + 1024;
  cudaFuncSetAttribute(step_kernel<C, NWG>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  for (int r = 0; r < 3; ++r) step_kernel<C, NWG><<<nsm, 128 * NWG, smem>>>(out, cyc, ob);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) { printf("chunk %d, %d warpgroups: %s\n", C, NWG, cudaGetErrorString(e)); return; }
  long long h[1024];
  cudaMemcpy(h, cyc, nsm * sizeof(long long), cudaMemcpyDeviceToHost);
  double m = 0;
  for (int i = 0; i < nsm; ++i) m += h[i];
  m /= nsm * (double)ITER;
  printf("chunk %2d, %d warpgroup(s) per SM: %7.1f cycles per step, %6.1f per 16 tokens and warpgroup\n", C, NWG, m,
         m * 16 / C);
}
int main() {
  int nsm;
  cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0);
  float* out; long long* cyc; uint4* ob;
  cudaMalloc(&out, nsm * 256 * 4); cudaMalloc(&cyc, nsm * 8); cudaMalloc(&ob, nsm * 256 * 4 * 16);
  run<16, 1>(out, cyc, ob, nsm);
  run<32, 1>(out, cyc, ob, nsm);
  run<64, 1>(out, cyc, ob, nsm);
  run<16, 2>(out, cyc, ob, nsm);
  run<64, 2>(out, cyc, ob, nsm);
  return 0;
}
