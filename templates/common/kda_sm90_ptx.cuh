// kdagen: Hopper (sm_90a) PTX helpers for the sm90 target: mbarriers, bulk copies, wgmma,
// shared-memory matrix descriptors, setmaxnreg, named barriers. Written for kdagen; inline PTX
// only (no CUTLASS/CuTe headers: they would dominate compile time).
#pragma once
#include <stdint.h>
#include "kda_common.cuh"

namespace kda {
namespace sm90 {

__device__ __forceinline__ uint32_t saddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarriers (shared::cta, 64-bit): init and arrive are the common ones ----
using kda::mbar_arrive;
using kda::mbar_init;
// One arrival that also expects `bytes` more transaction bytes in the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(saddr(bar)), "r"(bytes)
               : "memory");
}
// Wait until the phase with the given parity has completed (see KDA_MBAR_WAIT_PARITY_ASM):
// "empty" barriers are waited with the flipped parity and need no initial arrival.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(KDA_MBAR_WAIT_PARITY_ASM("try_wait") ::"r"(saddr(bar)), "r"(parity) : "memory");
}

// ---- thread-block clusters (the sm90 CTA pair) ----
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Every thread of every CTA of the cluster; release / acquire order the shared-memory accesses
// before it (barrier initialisation, the last remote arrivals) with those after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
// The shared::cluster address of this CTA's shared object `p` in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t peer_addr(const void* p, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(saddr(p)), "r"(rank));
  return r;
}
// Arrivals on a barrier of another CTA of the cluster (address from peer_addr), with CTA-scope
// release: they order nothing but the signal (the consumers' wgmma reads have completed, the copy's
// data travels in the async proxy). Cluster-scope release compiled to MEMBAR.ALL.GPU + ERRBAR,
// which waits for the thread's outstanding global stores (H200 ncu, 2026-12-01).
__device__ __forceinline__ void mbar_arrive_remote(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx_remote(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cluster.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// `bytes` (a multiple of 16) of this CTA's shared memory at `src` into another CTA's shared memory
// at `dst`, completing on that CTA's barrier `bar` (dst and bar from peer_addr).
__device__ __forceinline__ void bulk_s2peer(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "r"(saddr(src)), "r"(bytes), "r"(bar)
      : "memory");
}

// ---- bulk copies (TMA engine, no tensor map) ----
// `bytes` (a multiple of 16) from global `src` (16-byte aligned) to this CTA's shared `dst`
// (16-byte aligned); completion is counted in transaction bytes on `bar`.
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(saddr(dst)),
      "l"(src), "r"(bytes), "r"(saddr(bar))
      : "memory");
}

// Four 8x8 16-bit matrices in the mma accumulator layout (register i: matrix i, row lane / 4,
// columns 2 (lane % 4) (+ 1)), each stored transposed: lane l gives the shared address of memory
// row l % 8 of matrix l / 8, which receives the matrix's column l % 8.
__device__ __forceinline__ void stsm_x4_t(uint32_t a, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
// 16 bytes of shared memory at shared address a.
__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
  return v;
}

// Generic-proxy shared-memory writes made visible to the async proxy (wgmma operand reads).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- named barriers (ids 1..15; 0 is __syncthreads) ----
template <int ID, int COUNT>
__device__ __forceinline__ void named_sync() {
  static_assert(ID > 0 && ID < 16 && COUNT % 32 == 0, "named barrier");
  asm volatile("bar.sync %0, %1;\n" ::"n"(ID), "n"(COUNT) : "memory");
}

// ---- register reallocation between warpgroups ----
template <int N>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// ---- wgmma ----
// Shared-memory matrix descriptor: start address, leading / stride byte offsets (all >> 4) and
// the layout: 0 interleaved (no swizzle), 1 128-byte swizzle. Base offset 0: swizzled tiles
// start 1024-byte aligned.
constexpr uint64_t LAYOUT_INTERLEAVE = 0, LAYOUT_SW128 = 1;
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_addr, uint32_t lbo, uint32_t sbo, uint64_t layout) {
  return (uint64_t)((smem_addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | (layout << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pin registers an in-flight wgmma reads or writes: the compiler must not move their other uses
// across the wgmma issue / wait (it does not know the instruction is asynchronous).
__device__ __forceinline__ void reg_fence(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void reg_fence(uint32_t& x) { asm volatile("" : "+r"(x)::"memory"); }
template <typename T, int N>
__device__ __forceinline__ void reg_fence(T (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) reg_fence(a[i]);
}
template <typename T, int N, int M>
__device__ __forceinline__ void reg_fence(T (&a)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; ++i) reg_fence(a[i]);
}

// D[64 x 16] (+)= A[64 x 16] B, A bf16 from registers (mma.m16n8k16 A-fragment layout per
// warp), B K-major from shared memory. SCALE_A = -1 negates A. accumulate = false overwrites D.
template <int SCALE_A>
__device__ __forceinline__ void wgmma_m64n16_rs(float (&d)[8], const uint32_t (&a)[4], uint64_t desc_b,
                                                bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, %14, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"((int)accumulate), "n"(SCALE_A));
}

// D[64 x 32] (+)= A[64 x 16] B, A bf16 from registers, B K-major from shared memory (d: the m64n32
// accumulator, 16 per thread; d[0..7] hold columns 0-15 in the m64n16 order, d[8..15] columns 16-31).
// accumulate = false overwrites D.
__device__ __forceinline__ void wgmma_m64n32_rs(float (&d)[16], const uint32_t (&a)[4], uint64_t desc_b,
                                                bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"((int)accumulate));
}

// D[64 x N] += A[64 x 16] B, N = 64 or 128, A bf16 from registers, B MN-major (transposed) from
// shared memory. d is the m64nN accumulator (N / 2 floats per thread).
template <int N>
__device__ __forceinline__ void wgmma_m64nN_rs_tb(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b);

template <>
__device__ __forceinline__ void wgmma_m64nN_rs_tb<64>(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n"
      "}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_m64nN_rs_tb<128>(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
      "}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
        "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]),
        "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// ---- 128-byte swizzled tiles of 16-bit elements (Swizzle<3,4,3>: 16-byte chunk c of row r of an
// 8-row, 1024-byte atom sits at chunk c ^ (r & 7)) ----
// K-major [ROWS][COLS] (COLS % 64 == 0): atoms of 8 rows x 64 columns; row groups 1024 bytes apart
// (the descriptor's SBO), 64-column groups ROWS * 128 bytes apart. Byte offset of (row, col).
template <int ROWS>
__device__ __forceinline__ uint32_t sw128_k(int row, int col) {
  return (uint32_t)((col >> 6) * (ROWS * 128) + (row >> 3) * 1024 + (row & 7) * 128 +
                    ((((col >> 3) & 7) ^ (row & 7)) << 4) + (col & 7) * 2);
}
// MN-major [KR][N] (element (k, n) of B with n contiguous; KR % 8 == 0, N % 64 == 0): atoms of 8
// k-rows x 64 n; 64-column groups 1024 bytes apart (LBO), 8-row groups N * 16 bytes apart (SBO).
template <int N>
__device__ __forceinline__ uint32_t sw128_mn(int k, int n) {
  return (uint32_t)((k >> 3) * (N * 16) + (n >> 6) * 1024 + (k & 7) * 128 + ((((n >> 3) & 7) ^ (k & 7)) << 4) +
                    (n & 7) * 2);
}
// Interleaved (no swizzle) K-major [16][16]: core matrices of 8 rows x 8 columns (128 bytes,
// 16 bytes per row); the two column halves 128 bytes apart (LBO), row halves 256 apart (SBO).
__device__ __forceinline__ uint32_t il16_k(int row, int col) {
  return (uint32_t)((row >> 3) * 256 + (col >> 3) * 128 + (row & 7) * 16 + (col & 7) * 2);
}

}  // namespace sm90
}  // namespace kda
