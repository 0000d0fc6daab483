// The learner's small layer operations with their gradients, on the CPU: the RMS norm and the SwiGLU
// activation of a Llama-style decoder layer, forward and backward, over the rows of a packed
// micro-batch (thousands of rows). Eager PyTorch runs each as four to eight elementwise passes over
// memory in each direction and keeps their intermediates for the backward; here each direction is one
// pass, and the backward keeps only the inputs (and the norm's per-row scale). Framework-agnostic like
// the rest of the core (no Python, no PyTorch): plain pointers, contiguous rows, float32 arithmetic.
// The norm reads float32 (a bf16-autocast learner keeps its residual stream in float32) and writes
// float32 or, for a forward without a backward whose output only feeds bf16 products, bfloat16 (the
// float32 value rounded once, as autocast would round it before the product). The SwiGLU reads and
// writes float32 or bfloat16 (autocast's products give bf16 gate and up); bfloat16 results are the
// float32 computation rounded once to nearest even.
//
// * norm forward:   inv[r] = 1 / sqrt(mean_i x[r, i]^2 + eps);  out[r, i] = weight[i] * (x[r, i] * inv[r])
// * norm backward:  with gw = grad_out * weight,
//                   grad_x[r, i] = inv[r] * (gw[r, i] - x[r, i] * inv[r]^2 * mean_i(gw[r, i] * x[r, i]))
//                   grad_weight[i] = sum_r grad_out[r, i] * x[r, i] * inv[r]
// * silu_mul forward:  out = silu(gate) * up, silu(g) = g * sigmoid(g)
// * silu_mul backward: grad_gate = grad_out * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))),
//                      grad_up = grad_out * silu(gate)
//
// Sums run in an order fixed by the sizes alone (grad_weight: blocks of kNormBlockRows rows, then the
// blocks in order), so results do not depend on the number of threads.
#pragma once

#include <cstdint>

#include "flashreinforce/core.h"

namespace flashreinforce {

// Rows of the norm's weight gradient summed together before the blocks are summed in order.
constexpr int64_t kNormBlockRows = 32;

struct NormForwardParams {
  int64_t rows = 0, hidden = 0;
  const float* x = nullptr;       // [rows, hidden], contiguous
  const float* weight = nullptr;  // [hidden]
  void* out = nullptr;            // [rows, hidden], contiguous, of out_dtype
  DType out_dtype = DType::kFloat32;  // kFloat32 or kBFloat16
  float* inv = nullptr;           // [rows]: 1 / RMS of each row (kept for the backward); nullptr: not wanted
  float eps = 1e-6f;
};

struct NormBackwardParams {
  int64_t rows = 0, hidden = 0;
  const float* x = nullptr;         // the forward's input, [rows, hidden]
  const float* weight = nullptr;    // [hidden]
  const float* inv = nullptr;       // the forward's inv, [rows]
  const float* grad_out = nullptr;  // [rows, hidden]
  float* grad_x = nullptr;          // [rows, hidden]; nullptr: not wanted
  float* grad_weight = nullptr;     // [hidden], overwritten; nullptr: not wanted
};

struct SiluMulForwardParams {
  DType dtype = DType::kFloat32;  // of every array: kFloat32 or kBFloat16
  int64_t size = 0;  // elements of each array (all contiguous)
  const void* gate = nullptr;
  const void* up = nullptr;
  void* out = nullptr;
};

struct SiluMulBackwardParams {
  DType dtype = DType::kFloat32;  // of every array: kFloat32 or kBFloat16
  int64_t size = 0;
  const void* gate = nullptr;
  const void* up = nullptr;
  const void* grad_out = nullptr;
  void* grad_gate = nullptr;  // nullptr: not wanted
  void* grad_up = nullptr;    // nullptr: not wanted
};

// Checks sizes and pointers (no data is read): an empty string when valid, else what is wrong.
const char* norm_forward_check(const NormForwardParams& p);
const char* norm_backward_check(const NormBackwardParams& p);
const char* silu_mul_forward_check(const SiluMulForwardParams& p);
const char* silu_mul_backward_check(const SiluMulBackwardParams& p);

// The computations above on up to num_threads threads (the host's OpenMP threads where it has them).
void norm_forward_cpu(const NormForwardParams& p, int num_threads);
void norm_backward_cpu(const NormBackwardParams& p, int num_threads);
void silu_mul_forward_cpu(const SiluMulForwardParams& p, int num_threads);
void silu_mul_backward_cpu(const SiluMulBackwardParams& p, int num_threads);

}  // namespace flashreinforce
