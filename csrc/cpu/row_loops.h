// Float32 row loops (and the bfloat16 conversions around them) shared by the CPU kernels of the decode step (decode_step_cpu.cpp) and the learner's
// layer glue (layer_glue_cpu.cpp). Written for the compiler to vectorize; on x86-64 with GCC or Clang each
// is compiled for AVX-512, AVX2 and the baseline, and the loader picks the widest the CPU has (function
// multiversioning, FR_CPU_CLONES). Internal linkage: every file that includes this gets its own copies.
// A sum uses per-lane partial sums, so it differs from a sequential sum by rounding only, and depends on
// the length, never on the thread that runs it.
#pragma once

#include <cstdint>

#include "flashreinforce/token_math.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__APPLE__)
#define FR_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FR_CPU_CLONES
#endif

namespace flashreinforce {
namespace rows {

// sum_i x[i]^2
static FR_CPU_CLONES float sum_of_squares(const float* x, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
  return s;
}

// out[i] = w[i] * (x[i] * inv): an RMS norm's row, given inv = 1 / rms(x)
static FR_CPU_CLONES void scaled_times_weight(const float* x, float inv, const float* w, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

// x[i] += d[i]
static FR_CPU_CLONES void add_in_place(float* x, const float* d, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] + d[i];
}

// out[i] = silu(g[i]) * u[i]: SwiGLU's activation
static FR_CPU_CLONES void silu_times(const float* g, const float* u, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.0f + math::exp_fast(-g[i])) * u[i];
}

// bfloat16 <-> float32: dst[i] = src[i] widened (exact), or rounded to nearest even
static FR_CPU_CLONES void widen(const math::BFloat16* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = math::bf16_to_float(src[i].bits);
}

static FR_CPU_CLONES void narrow(const float* src, math::BFloat16* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i].bits = math::float_to_bf16(src[i]);
}

}  // namespace rows
}  // namespace flashreinforce
