// The learner's RMS norm and SwiGLU activation, forward and backward (flashreinforce/layer_glue.h).
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

int64_t blocks_of(int64_t size, int64_t block) { return (size + block - 1) / block; }

}  // namespace

const char* norm_forward_check(const NormForwardParams& p) {
  if (p.rows < 0 || p.hidden < 1) return "rows / hidden: rows >= 0 and hidden >= 1";
  if (!(p.eps >= 0.0f)) return "eps: must be >= 0";
  if (p.rows > 0 && (p.x == nullptr || p.weight == nullptr || p.out == nullptr || p.inv == nullptr)) {
    return "x, weight, out and inv: a null data pointer";
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
  if (p.size > 0 && (p.gate == nullptr || p.up == nullptr || p.out == nullptr)) {
    return "gate, up and out: a null data pointer";
  }
  return "";
}

const char* silu_mul_backward_check(const SiluMulBackwardParams& p) {
  if (p.size < 0) return "size: must be >= 0";
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
    p.inv[r] = inv;
    rows::scaled_times_weight(x, inv, p.weight, p.out + r * n, n);
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
    rows::silu_times(p.gate + i0, p.up + i0, p.out + i0, len);
  });
}

void silu_mul_backward_cpu(const SiluMulBackwardParams& p, int num_threads) {
  if (p.grad_gate == nullptr && p.grad_up == nullptr) return;
  cpu::parallel_for_host_threads(num_threads, blocks_of(p.size, kSiluBlock), [&](int64_t b) {
    const int64_t i0 = b * kSiluBlock, len = std::min(kSiluBlock, p.size - i0);
    if (p.grad_gate != nullptr && p.grad_up != nullptr) {
      silu_mul_grad_block(p.gate + i0, p.up + i0, p.grad_out + i0, p.grad_gate + i0, p.grad_up + i0, len);
    } else if (p.grad_gate != nullptr) {
      silu_mul_grad_gate_block(p.gate + i0, p.up + i0, p.grad_out + i0, p.grad_gate + i0, len);
    } else {
      silu_mul_grad_up_block(p.gate + i0, p.grad_out + i0, p.grad_up + i0, len);
    }
  });
}

}  // namespace flashreinforce
