// The learner's RMS norm and SwiGLU activation, forward and backward (flashreinforce/layer_glue.h),
// on float32 or bfloat16 data (float32 arithmetic).
// Each row (norm) or block of elements (SwiGLU) is one task; its loops are written for the compiler to
// vectorize, and on x86-64 with GCC or Clang compiled for AVX-512, AVX2 and the baseline, the loader
// picking the widest the CPU has (function multiversioning). Per-lane partial sums make a row's sums
// differ from a sequential sum by rounding only; they depend on the sizes, never on the threads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "flashreinforce/layer_glue.h"
#include "flashreinforce/token_math.h"
#include "row_loops.h"
#include "thread_pool.h"

namespace flashreinforce {
namespace {

// Elements per SwiGLU task: large enough that a task's start costs nothing, small enough to balance.
constexpr int64_t kSiluBlock = 16384;

// sum_i grad_out[i] * w[i] * x[i]
FR_CPU_CLONES float dot3(const float* g, const float* w, const float* x, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += g[i] * w[i] * x[i];
  return s;
}

FR_CPU_CLONES void norm_grad_row(const float* g, const float* w, const float* x, float inv, float c, float* gx,
                                  int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) gx[i] = inv * (g[i] * w[i] - x[i] * c);
}

// acc[i] += g[i] * x[i] * inv
FR_CPU_CLONES void weight_grad_row(const float* g, const float* x, float inv, float* acc, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += g[i] * (x[i] * inv);
}

// The gradients of silu(g) * u at one element, given s = sigmoid(g): one formula for the three loops
// below, so that a gradient computed alone has the same bits as computed beside the other.
inline float sigmoid_of(float g) { return 1.0f / (1.0f + math::exp_fast(-g)); }
inline float silu_mul_grad_gate(float dy, float u, float g, float s) { return dy * u * (s * (1.0f + g * (1.0f - s))); }
inline float silu_mul_grad_up(float dy, float g, float s) { return dy * (g * s); }

FR_CPU_CLONES void silu_mul_grad_block(const float* g, const float* u, const float* dy, float* dg, float* du,
                                       int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid_of(g[i]);
    dg[i] = silu_mul_grad_gate(dy[i], u[i], g[i], s);
    du[i] = silu_mul_grad_up(dy[i], g[i], s);
  }
}

FR_CPU_CLONES void silu_mul_grad_gate_block(const float* g, const float* u, const float* dy, float* dg, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dg[i] = silu_mul_grad_gate(dy[i], u[i], g[i], sigmoid_of(g[i]));
}

FR_CPU_CLONES void silu_mul_grad_up_block(const float* g, const float* dy, float* du, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) du[i] = silu_mul_grad_up(dy[i], g[i], sigmoid_of(g[i]));
}

// The gradients wanted (dg, du: either may be nullptr, not both; u is not read when only du is).
void silu_mul_grad(const float* g, const float* u, const float* dy, float* dg, float* du, int64_t n) {
  if (dg != nullptr && du != nullptr) {
    silu_mul_grad_block(g, u, dy, dg, du, n);
  } else if (dg != nullptr) {
    silu_mul_grad_gate_block(g, u, dy, dg, n);
  } else {
    silu_mul_grad_up_block(g, dy, du, n);
  }
}

int64_t blocks_of(int64_t size, int64_t block) { return (size + block - 1) / block; }

// ---------------------------------------------------------------------- bfloat16 data, float32 arithmetic
// bfloat16 arrays go through float32 in chunks of kChunk elements: widened into a local buffer, worked
// on by the float32 loops above, each result rounded once on the way out (separate loops, each of
// which the compiler vectorizes; one loop doing all three does not).
constexpr int64_t kChunk = 512;

using math::BFloat16;
using rows::narrow;
using rows::widen;

// out[i] = bf16(w[i] * (x[i] * inv))
void scaled_times_weight_to_bf16(const float* x, float inv, const float* w, BFloat16* out, int64_t n) {
  float buf[kChunk];
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t len = std::min(kChunk, n - i0);
    rows::scaled_times_weight(x + i0, inv, w + i0, buf, len);
    narrow(buf, out + i0, len);
  }
}

void silu_times_bf16(const BFloat16* g, const BFloat16* u, BFloat16* out, int64_t n) {
  float gf[kChunk], uf[kChunk];
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t len = std::min(kChunk, n - i0);
    widen(g + i0, gf, len);
    widen(u + i0, uf, len);
    rows::silu_times(gf, uf, gf, len);
    narrow(gf, out + i0, len);
  }
}

// The gradients on bfloat16 data: either may be nullptr (not wanted); u is not read when only du is.
void silu_mul_grad_bf16(const BFloat16* g, const BFloat16* u, const BFloat16* dy, BFloat16* dg, BFloat16* du,
                        int64_t n) {
  float gf[kChunk], uf[kChunk], df[kChunk], a[kChunk], b[kChunk];
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t len = std::min(kChunk, n - i0);
    widen(g + i0, gf, len);
    widen(dy + i0, df, len);
    if (dg != nullptr) widen(u + i0, uf, len);
    silu_mul_grad(gf, uf, df, dg != nullptr ? a : nullptr, du != nullptr ? b : nullptr, len);
    if (dg != nullptr) narrow(a, dg + i0, len);
    if (du != nullptr) narrow(b, du + i0, len);
  }
}

bool float_or_bf16(DType dt) { return dt == DType::kFloat32 || dt == DType::kBFloat16; }

template <class T>
const T* at(const void* p, int64_t i) { return p == nullptr ? nullptr : static_cast<const T*>(p) + i; }
template <class T>
T* at(void* p, int64_t i) { return p == nullptr ? nullptr : static_cast<T*>(p) + i; }

}  // namespace

const char* norm_forward_check(const NormForwardParams& p) {
  if (p.rows < 0 || p.hidden < 1) return "rows / hidden: rows >= 0 and hidden >= 1";
  if (!(p.eps >= 0.0f)) return "eps: must be >= 0";
  if (!float_or_bf16(p.out_dtype)) return "out_dtype: float32 or bfloat16 only";
  if (p.rows > 0 && (p.x == nullptr || p.weight == nullptr || p.out == nullptr)) {
    return "x, weight and out: a null data pointer";
  }
  return "";
}

const char* norm_backward_check(const NormBackwardParams& p) {
  if (p.rows < 0 || p.hidden < 1) return "rows / hidden: rows >= 0 and hidden >= 1";
  if (p.rows > 0 && (p.x == nullptr || p.weight == nullptr || p.inv == nullptr || p.grad_out == nullptr)) {
    return "x, weight, inv and grad_out: a null data pointer";
  }
  return "";
}

const char* silu_mul_forward_check(const SiluMulForwardParams& p) {
  if (p.size < 0) return "size: must be >= 0";
  if (!float_or_bf16(p.dtype)) return "dtype: float32 or bfloat16 only";
  if (p.size > 0 && (p.gate == nullptr || p.up == nullptr || p.out == nullptr)) {
    return "gate, up and out: a null data pointer";
  }
  return "";
}

const char* silu_mul_backward_check(const SiluMulBackwardParams& p) {
  if (p.size < 0) return "size: must be >= 0";
  if (!float_or_bf16(p.dtype)) return "dtype: float32 or bfloat16 only";
  if (p.size > 0 && (p.gate == nullptr || p.up == nullptr || p.grad_out == nullptr)) {
    return "gate, up and grad_out: a null data pointer";
  }
  return "";
}

void norm_forward_cpu(const NormForwardParams& p, int num_threads) {
  const int64_t n = p.hidden;
  cpu::parallel_for_host_threads(num_threads, p.rows, [&](int64_t r) {
    const float* x = p.x + r * n;
    const float inv = 1.0f / std::sqrt(rows::sum_of_squares(x, n) / static_cast<float>(n) + p.eps);
    if (p.inv != nullptr) p.inv[r] = inv;
    if (p.out_dtype == DType::kFloat32) {
      rows::scaled_times_weight(x, inv, p.weight, static_cast<float*>(p.out) + r * n, n);
    } else {
      scaled_times_weight_to_bf16(x, inv, p.weight, static_cast<BFloat16*>(p.out) + r * n, n);
    }
  });
}

void norm_backward_cpu(const NormBackwardParams& p, int num_threads) {
  const int64_t n = p.hidden;
  if (p.grad_x == nullptr && p.grad_weight == nullptr) return;
  // One task per block of kNormBlockRows rows: their rows of grad_x, and their partial sum of
  // grad_weight (rows in order), in one pass over x and grad_out; then the blocks' sums in order.
  const int64_t blocks = blocks_of(p.rows, kNormBlockRows);
  std::vector<float> partial(p.grad_weight != nullptr ? static_cast<size_t>(blocks * n) : 0, 0.0f);
  cpu::parallel_for_host_threads(num_threads, blocks, [&](int64_t b) {
    const int64_t end = std::min(p.rows, (b + 1) * kNormBlockRows);
    for (int64_t r = b * kNormBlockRows; r < end; ++r) {
      const float* x = p.x + r * n;
      const float* g = p.grad_out + r * n;
      const float inv = p.inv[r];
      if (p.grad_x != nullptr) {
        const float c = dot3(g, p.weight, x, n) / static_cast<float>(n) * inv * inv;
        norm_grad_row(g, p.weight, x, inv, c, p.grad_x + r * n, n);
      }
      if (p.grad_weight != nullptr) weight_grad_row(g, x, inv, partial.data() + b * n, n);
    }
  });
  if (p.grad_weight == nullptr) return;
  if (blocks == 0) {
    std::fill(p.grad_weight, p.grad_weight + n, 0.0f);
    return;
  }
  constexpr int64_t kColumns = 256;  // columns per reduction task
  cpu::parallel_for_host_threads(num_threads, blocks_of(n, kColumns), [&](int64_t t) {
    const int64_t c0 = t * kColumns, width = std::min(kColumns, n - c0);
    float* dst = p.grad_weight + c0;
    std::copy(partial.data() + c0, partial.data() + c0 + width, dst);
    for (int64_t b = 1; b < blocks; ++b) rows::add_in_place(dst, partial.data() + b * n + c0, width);
  });
}

void silu_mul_forward_cpu(const SiluMulForwardParams& p, int num_threads) {
  cpu::parallel_for_host_threads(num_threads, blocks_of(p.size, kSiluBlock), [&](int64_t b) {
    const int64_t i0 = b * kSiluBlock, len = std::min(kSiluBlock, p.size - i0);
    if (p.dtype == DType::kFloat32) {
      rows::silu_times(at<float>(p.gate, i0), at<float>(p.up, i0), at<float>(p.out, i0), len);
    } else {
      silu_times_bf16(at<BFloat16>(p.gate, i0), at<BFloat16>(p.up, i0), at<BFloat16>(p.out, i0), len);
    }
  });
}

void silu_mul_backward_cpu(const SiluMulBackwardParams& p, int num_threads) {
  if (p.grad_gate == nullptr && p.grad_up == nullptr) return;
  cpu::parallel_for_host_threads(num_threads, blocks_of(p.size, kSiluBlock), [&](int64_t b) {
    const int64_t i0 = b * kSiluBlock, len = std::min(kSiluBlock, p.size - i0);
    if (p.dtype == DType::kFloat32) {
      silu_mul_grad(at<float>(p.gate, i0), at<float>(p.up, i0), at<float>(p.grad_out, i0), at<float>(p.grad_gate, i0),
                    at<float>(p.grad_up, i0), len);
    } else {
      silu_mul_grad_bf16(at<BFloat16>(p.gate, i0), at<BFloat16>(p.up, i0), at<BFloat16>(p.grad_out, i0),
                         at<BFloat16>(p.grad_gate, i0), at<BFloat16>(p.grad_up, i0), len);
    }
  });
}

}  // namespace flashreinforce
