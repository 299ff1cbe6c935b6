// Throughput of the conversion and transcendental instructions on one SM (session-15 diagnostic).
#include <cstdio>
#include <cstdint>
#define ITER 2048
template <int MODE>
__global__ void __launch_bounds__(1024, 1) k(float* out, long long* cyc) {
  float x[8];
  for (int j = 0; j < 8; ++j) x[j] = 1.0f + threadIdx.x * 1e-3f + j;
  __syncthreads();
  long long t0 = clock64();
  for (int it = 0; it < ITER; ++it) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint32_t r; float y;
      if (MODE == 0) {  // F2FP pack
        asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x[j]), "f"(x[(j + 1) & 7]));
        x[j] = __uint_as_float(r);
      } else if (MODE == 1) {  // MUFU.EX2
        asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x[j]));
        x[j] = y;
      } else if (MODE == 2) {  // half F2FP, half EX2
        if (j & 1) { asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x[j])); x[j] = y; }
        else { asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x[j]), "f"(x[(j + 1) & 7])); x[j] = __uint_as_float(r); }
      } else if (MODE == 3) {  // integer pack: 2 IADD + PRMT per pair (per j: one pack)
        r = __byte_perm(__float_as_uint(x[j]) + 0x8000u, __float_as_uint(x[(j + 1) & 7]) + 0x8000u, 0x7632);
        x[j] = __uint_as_float(r);
      } else if (MODE == 4) {  // FFMA reference
        x[j] = fmaf(x[j], 1.0001f, 0.5f);
      } else if (MODE == 5) {  // scalar cvt.rn.bf16.f32 (F2F)
        unsigned short h; asm volatile("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x[j])); x[j] = __uint_as_float((uint32_t)h << 16 | 1u);
      }
    }
  }
  long long t1 = clock64();
  float s = 0; for (int j = 0; j < 8; ++j) s += x[j];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) cyc[blockIdx.x] = t1 - t0;
}
template <int MODE> void run(const char* name, float* out, long long* cyc, int nsm) {
  k<MODE><<<nsm, 1024>>>(out, cyc);
  k<MODE><<<nsm, 1024>>>(out, cyc);
  cudaDeviceSynchronize();
  long long h[256]; cudaMemcpy(h, cyc, nsm * sizeof(long long), cudaMemcpyDeviceToHost);
  double m = 0; for (int i = 0; i < nsm; ++i) m += h[i]; m /= nsm;
  printf("%-28s %8.1f instr/clk/SM (warp-instr: %.2f /clk/SM)\n", name, 1024.0 * ITER * 8 / m, 32.0 * ITER * 8 / m);
}
int main() {
  int nsm; cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0);
  float* out; long long* cyc; cudaMalloc(&out, nsm * 1024 * 4); cudaMalloc(&cyc, nsm * 8);
  run<4>("FFMA (reference)", out, cyc, nsm);
  run<0>("cvt.rn.bf16x2.f32 (F2FP)", out, cyc, nsm);
  run<5>("cvt.rn.bf16.f32 (scalar)", out, cyc, nsm);
  run<1>("ex2.approx (MUFU)", out, cyc, nsm);
  run<2>("F2FP + MUFU alternating", out, cyc, nsm);
  run<3>("2 IADD + PRMT (per pack)", out, cyc, nsm);
  return 0;
}
