// kdagen: shared device helpers for the CUDA targets (params struct, mma/ldmatrix/cp.async).
// Written for kdagen; Ampere-level PTX only.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// Kernel parameters, passed by value. Mirrored field by field by kdagen/targets/sm80.py.
struct KdaParams {
  const void* q;
  const void* k;
  const void* v;
  const void* g;
  const void* beta;
  void* o;
  const float* A_log;       // [HV] or null (precomputed gate)
  const float* dt_bias;     // [HV, K] or null (zeros)
  const int* cu_seqlens;    // [N + 1] or null
  const void* h0;           // initial state or null
  void* ht;                 // final state or null
  void* hc;                 // per-chunk states or null
  const int* chunk_offsets; // [N + 1] or null
  void* ws;                 // workspace written by kda_prep, read by kda_recur
  long long q_s[3];         // element strides (batch, time, head)
  long long k_s[3];
  long long v_s[3];
  long long g_s[3];
  long long b_s[3];
  long long o_s[3];
  int B, T, N, H, HV, group, max_len;
  float scale;
  float lower_bound;
  int use_l2norm;
  int beta_mode;  // b from beta: 0 sigmoid(beta), 1 2 sigmoid(beta) (negative eigenvalues), 2 beta itself
  int state_kv, g_fp32, beta_fp32;
  // State runs per value head in sm80's kda_recur (0 or 1: one). At 2, state head HV + h reruns
  // head h's records with U = 0 (v = 0), so the scan's transition run shares one kda_prep.
  int twins;
  // Chunk states kept: those entering chunks 0, m, 2m, ... of each sequence (m = chunk_stride, 0
  // or 1: every chunk), chunk c at row chunk_offsets[n] + c / m (prefix caching keeps 1/m of them).
  int chunk_stride;
  // A state pool (serving engines), read by sm80's kda_recur and sm90's kda_fused_slots: h0 and
  // ht are [P, HV, ...] and sequence n's states are at slots h0_idx[n] and ht_idx[n] (-1: none
  // read, zeros; none written). Null: row n. sm90's kda_fused ignores them (reading them there
  // cost its plain calls up to 2%, H100, benchmarks/NOTES.md session 52).
  const int* h0_idx;
  const int* ht_idx;
};

namespace kda {

// The state row (in [rows, state heads, ...]) of sequence n's value head hs: n's own, or its
// pool slot idx[n] when idx is set; negative for a pool's padding sequence (slot -1).
__device__ __forceinline__ long long state_row(const KdaParams& p, const int* idx, int n, int hs, bool twins) {
  if (idx) return (long long)idx[n] * p.HV + hs;
  return (long long)n * (twins ? 2 * p.HV : p.HV) + hs;
}

__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(float x) { return x; }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

// Pack two floats into a bf16x2 register (lo in the low half).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// x = hi + lo to about 16 mantissa bits: hi = bf16(x), lo = bf16(x - hi), two lanes at a time.
__device__ __forceinline__ void split_bf16(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = pack_bf16(x0 - __low2float(h), x1 - __high2float(h));
}
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
// Two m16n8 fp32 accumulator tiles (n columns 0-7 and 8-15) as the bf16 A fragment of an
// m16n8k16 MMA: the accumulator layout of a lane is its A layout.
__device__ __forceinline__ void acc_to_a(const float (&lo)[4], const float (&hi)[4], uint32_t (&a)[4]) {
  a[0] = pack_bf16(lo[0], lo[1]);
  a[1] = pack_bf16(lo[2], lo[3]);
  a[2] = pack_bf16(hi[0], hi[1]);
  a[3] = pack_bf16(hi[2], hi[3]);
}
// The part of the same two accumulators that acc_to_a's bf16 fragment a drops, as bf16 A fragments
// (x = a + l to about 16 mantissa bits: the hi + lo operands of a split product).
__device__ __forceinline__ void acc_lo_to_a(const float (&lo)[4], const float (&hi)[4], const uint32_t (&a)[4],
                                            uint32_t (&l)[4]) {
  auto rest = [](float x0, float x1, uint32_t pr) {
    return pack_bf16(x0 - __uint_as_float(pr << 16), x1 - __uint_as_float(pr & 0xffff0000u));
  };
  l[0] = rest(lo[0], lo[1], a[0]);
  l[1] = rest(lo[2], lo[3], a[1]);
  l[2] = rest(hi[0], hi[1], a[2]);
  l[3] = rest(hi[2], hi[3], a[3]);
}

// Eight consecutive 16-bit (bf16 / fp16) or 32-bit values -> float[8]; 16-byte aligned loads.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* out) {
  uint4 r = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&r);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = to_f(e[i]);
}
template <>
__device__ __forceinline__ void load8<float>(const float* p, float* out) {
  float4 a = *reinterpret_cast<const float4*>(p);
  float4 b = *reinterpret_cast<const float4*>(p + 4);
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

// Eight 16-bit values from one 16-byte load, to fp32 (the load issued apart from the conversion).
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& r, float* out) {
  static_assert(sizeof(T) == 2, "16-bit input type");
  const T* e = reinterpret_cast<const T*>(&r);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = to_f(e[i]);
}

// The low 16 bits of a raw load as a bf16 / fp16 value.
template <typename T> __device__ __forceinline__ T bits_as(uint32_t x);
template <> __device__ __forceinline__ __nv_bfloat16 bits_as<__nv_bfloat16>(uint32_t x) {
  return __ushort_as_bfloat16((unsigned short)x);
}
template <> __device__ __forceinline__ __half bits_as<__half>(uint32_t x) { return __ushort_as_half((unsigned short)x); }

// D = A * B + D, m16n8k16, bf16 inputs, fp32 accumulators. Not volatile: a pure register
// operation, so the compiler may interleave independent MMAs with other work.
__device__ __forceinline__ void mma_bf16(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x2(uint32_t* r, const void* p) {  // addresses of lanes 0-15
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async16_s(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem));
}
// src_bytes < 16 zero-fills the rest (0: no global read at all, for rows past a sequence's end).
__device__ __forceinline__ void cp_async16_zfill(uint32_t smem_addr, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ---- mbarriers (shared::cta, 64-bit), for every CUDA target ----
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// One arrival (release at CTA scope: this thread's earlier shared-memory writes are visible to a
// thread whose wait observes the phase completion). sm_80 code: a MEMBAR.CTA, then the arrive.
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// The asm of a wait until the phase of parity %1 of the mbarrier at shared address %0 has completed
// (acquire at CTA scope), polling with mbarrier.WAIT (try_wait from sm_90, test_wait on sm_80).
// A freshly initialised barrier is in phase 0, so waiting for parity 1 returns at once. A wait that
// spins far longer than any legitimate one (2^28 polls: seconds, where waits here take
// microseconds, milliseconds under compute-sanitizer) traps: a protocol error becomes a launch
// failure the caller sees, not a hang. One asm block: a C++ loop around try_wait changed the
// schedule enough to spill (ptxas 13.0, sm90 512-thread variants).
#define KDA_MBAR_WAIT_PARITY_ASM(WAIT)                                 \
  "{\n"                                                                \
  ".reg .pred done, stuck;\n"                                          \
  ".reg .u32 tries;\n"                                                 \
  "mov.u32 tries, 0;\n"                                                \
  "WAIT_%=:\n"                                                         \
  "mbarrier." WAIT ".parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n" \
  "@done bra DONE_%=;\n"                                               \
  "add.u32 tries, tries, 1;\n"                                         \
  "setp.eq.u32 stuck, tries, 268435456;\n"                             \
  "@stuck trap;\n"                                                     \
  "bra WAIT_%=;\n"                                                     \
  "DONE_%=:\n"                                                         \
  "}\n"
// sm_80 PTX (no try_wait): the poll is a shared-memory load of the barrier word.
__device__ __forceinline__ void mbar_wait_parity_poll(uint64_t* bar, uint32_t parity) {
  asm volatile(KDA_MBAR_WAIT_PARITY_ASM("test_wait") ::"r"(smem_u32(bar)), "r"(parity) : "memory");
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + __expf(-x)); }
// beta's coefficient b as beta_mode (KdaParams) says; mode 2 takes b as given (fla's and the engines'
// call passes sigmoid(beta) already), which spares the caller a logit pass.
__device__ __forceinline__ float beta_coef(int mode, float x) {
  return mode == 2 ? x : sigmoidf_(x) * (mode ? 2.f : 1.f);
}
__device__ __forceinline__ float softplusf_(float x) { return x > 20.f ? x : log1pf(__expf(x)); }

// Sequence n's first token (in the flattened B*T token axis) and length.
__device__ __forceinline__ void seq_bounds(const KdaParams& p, int n, int& bos, int& len) {
  if (p.cu_seqlens) {
    bos = p.cu_seqlens[n];
    len = p.cu_seqlens[n + 1] - bos;
  } else {
    bos = n * p.T;
    len = p.T;
  }
}

}  // namespace kda
