// The decode step's small operations (flashreinforce/decode_step.h). Each row is converted to float32
// once (bfloat16 data), worked on in a loop the compiler vectorizes, and rounded once on the way out.
// On x86-64 with GCC or Clang the loops are compiled for AVX-512, AVX2 and the baseline, and the
// loader picks the widest one the CPU has (function multiversioning); the results of the float32
// path are the same on each except for the order of the sum of squares (per-lane partial sums).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "flashreinforce/decode_step.h"
#include "flashreinforce/token_math.h"
#include "row_loops.h"
#include "thread_pool.h"

namespace flashreinforce {
namespace {

using math::BFloat16;

// ---------------------------------------------------------------------------- float32 row loops
// bfloat16 data: y = bf16(x * inv), out = bf16(w * y), in float32.
FR_CPU_CLONES void scaled_times_weight_rounded(const float* x, float inv, const float* w, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float y = math::bf16_to_float(math::float_to_bf16(x[i] * inv));
    out[i] = w[i] * y;
  }
}

FR_CPU_CLONES void round_to_bf16(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = math::bf16_to_float(math::float_to_bf16(x[i]));
}

// rotate_half: out[i] = v[i] c[i] - v[i + h] s[i], out[i + h] = v[i + h] c[i + h] + v[i] s[i + h].
FR_CPU_CLONES void rotate(const float* v, const float* c, const float* s, float* out, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    out[i] = v[i] * c[i] - v[i + half] * s[i];
    out[i + half] = v[i + half] * c[i + half] + v[i] * s[i + half];
  }
}

using rows::narrow;
using rows::widen;

// ---------------------------------------------------------------------------- rows of either type
// A row in float32: the data itself (float32) or a converted copy in `buf` (bfloat16).
const float* as_float(const void* src, DType dt, int64_t n, float* buf) {
  if (dt == DType::kFloat32) return static_cast<const float*>(src);
  widen(static_cast<const BFloat16*>(src), buf, n);
  return buf;
}

void store(const float* src, void* dst, DType dt, int64_t n) {
  if (dt == DType::kFloat32) {
    if (src != dst) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  } else {
    narrow(src, static_cast<BFloat16*>(dst), n);
  }
}

size_t elem(DType dt) { return dt == DType::kFloat32 ? 4 : 2; }

template <class P>
const char* common_check(const P& p) {
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16) return "dtype: float32 or bfloat16 only";
  return "";
}

// Per-thread float32 scratch, kept from call to call.
float* scratch(size_t floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < floats) buffer.resize(floats);
  return buffer.data();
}

}  // namespace

const char* decode_norm_check(const DecodeNormParams& p) {
  if (*common_check(p)) return common_check(p);
  if (p.rows < 0 || p.hidden < 1) return "rows / hidden: rows >= 0 and hidden >= 1";
  if (p.rows == 0) return "";
  if (p.x == nullptr || p.weight == nullptr || p.out == nullptr) return "x, weight and out: a null data pointer";
  if ((p.rows > 1 && (p.x_stride < p.hidden || p.out_stride < p.hidden)) ||
      (p.update != nullptr && p.rows > 1 && p.update_stride < p.hidden)) {
    return "strides: smaller than hidden";
  }
  if (!(p.eps >= 0.0f)) return "eps: must be >= 0";
  return "";
}

const char* decode_rotary_check(const DecodeRotaryParams& p) {
  if (*common_check(p)) return common_check(p);
  if (p.batch < 0 || p.heads < 1 || p.kv_heads < 1 || p.head_dim < 2 || p.head_dim % 2 != 0) {
    return "sizes: batch >= 0, heads and kv_heads >= 1, head_dim even";
  }
  if (p.batch == 0) return "";
  if (p.qkv == nullptr || p.cos == nullptr || p.sin == nullptr || p.q_out == nullptr || p.k_slot == nullptr ||
      p.v_slot == nullptr) {
    return "qkv, cos, sin, q_out, k_slot and v_slot: a null data pointer";
  }
  const int64_t row = (p.heads + 2 * p.kv_heads) * p.head_dim;
  if (p.batch > 1 && (p.qkv_stride < row || p.cs_stride < p.head_dim)) return "qkv_stride / cs_stride: too small";
  if (p.kv_heads > 1 && (p.k_stride_head < p.head_dim || p.v_stride_head < p.head_dim)) {
    return "k_stride_head / v_stride_head: smaller than head_dim";
  }
  if (p.batch > 1 && (p.k_stride_batch < p.head_dim || p.v_stride_batch < p.head_dim)) {
    return "k_stride_batch / v_stride_batch: smaller than head_dim";
  }
  return "";
}

const char* decode_silu_mul_check(const DecodeSiluMulParams& p) {
  if (*common_check(p)) return common_check(p);
  if (p.rows < 0 || p.width < 1) return "rows / width: rows >= 0 and width >= 1";
  if (p.rows == 0) return "";
  if (p.gate_up == nullptr || p.out == nullptr) return "gate_up and out: a null data pointer";
  if (p.rows > 1 && (p.stride < 2 * p.width || p.out_stride < p.width)) return "strides: too small";
  return "";
}

void decode_norm_cpu(const DecodeNormParams& p, int num_threads) {
  if (p.rows == 0) return;
  const DType dt = p.dtype;
  const int64_t n = p.hidden;
  const size_t es = elem(dt);
  cpu::parallel_for_host_threads(num_threads, p.rows, [&](int64_t r) {
    float* buf = scratch(static_cast<size_t>(4 * n));
    char* xr = static_cast<char*>(p.x) + r * p.x_stride * es;
    // x (float32: the data itself, updated in place; bfloat16: a float copy, rounded like the data)
    float* xf = dt == DType::kFloat32 ? reinterpret_cast<float*>(xr) : buf;
    if (dt != DType::kFloat32) widen(reinterpret_cast<const BFloat16*>(xr), xf, n);
    if (p.update != nullptr) {
      const float* df = as_float(static_cast<const char*>(p.update) + r * p.update_stride * es, dt, n, buf + n);
      rows::add_in_place(xf, df, n);
      if (dt != DType::kFloat32) {
        round_to_bf16(xf, n);
        narrow(xf, reinterpret_cast<BFloat16*>(xr), n);
      }
    }
    const float inv = 1.0f / std::sqrt(rows::sum_of_squares(xf, n) / static_cast<float>(n) + p.eps);
    const float* wf = as_float(p.weight, dt, n, buf + 2 * n);
    float* out = buf + 3 * n;
    if (dt == DType::kFloat32) {
      rows::scaled_times_weight(xf, inv, wf, out, n);
    } else {
      scaled_times_weight_rounded(xf, inv, wf, out, n);
    }
    store(out, static_cast<char*>(p.out) + r * p.out_stride * es, dt, n);
  });
}

void decode_rotary_cpu(const DecodeRotaryParams& p, int num_threads) {
  if (p.batch == 0) return;
  const DType dt = p.dtype;
  const int64_t d = p.head_dim, half = d / 2, heads = p.heads, kv = p.kv_heads;
  const size_t es = elem(dt);
  cpu::parallel_for_host_threads(num_threads, p.batch, [&](int64_t b) {
    float* buf = scratch(static_cast<size_t>(5 * d));
    const char* row = static_cast<const char*>(p.qkv) + b * p.qkv_stride * es;
    const float* c = as_float(static_cast<const char*>(p.cos) + b * p.cs_stride * es, dt, d, buf);
    const float* s = as_float(static_cast<const char*>(p.sin) + b * p.cs_stride * es, dt, d, buf + d);
    float* vf = buf + 2 * d;
    float* out = buf + 3 * d;
    for (int64_t h = 0; h < heads + kv; ++h) {
      const float* v = as_float(row + h * d * es, dt, d, vf);
      rotate(v, c, s, out, half);
      void* dst = h < heads ? static_cast<void*>(static_cast<char*>(p.q_out) + (b * heads + h) * d * es)
                            : static_cast<void*>(static_cast<char*>(p.k_slot) +
                                                 (b * p.k_stride_batch + (h - heads) * p.k_stride_head) * es);
      store(out, dst, dt, d);
    }
    for (int64_t h = 0; h < kv; ++h) {
      std::memcpy(static_cast<char*>(p.v_slot) + (b * p.v_stride_batch + h * p.v_stride_head) * es,
                  row + (heads + kv + h) * d * es, static_cast<size_t>(d) * es);
    }
  });
}

void decode_silu_mul_cpu(const DecodeSiluMulParams& p, int num_threads) {
  if (p.rows == 0) return;
  const DType dt = p.dtype;
  const int64_t n = p.width;
  const size_t es = elem(dt);
  cpu::parallel_for_host_threads(num_threads, p.rows, [&](int64_t r) {
    float* buf = scratch(static_cast<size_t>(3 * n));
    const char* row = static_cast<const char*>(p.gate_up) + r * p.stride * es;
    const float* g = as_float(row, dt, n, buf);
    const float* u = as_float(row + n * es, dt, n, buf + n);
    char* dst = static_cast<char*>(p.out) + r * p.out_stride * es;
    float* out = dt == DType::kFloat32 ? reinterpret_cast<float*>(dst) : buf + 2 * n;
    rows::silu_times(g, u, out, n);
    if (dt != DType::kFloat32) narrow(out, reinterpret_cast<BFloat16*>(dst), n);
  });
}

}  // namespace flashreinforce
