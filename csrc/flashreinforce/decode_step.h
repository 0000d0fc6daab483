// The small operations of a decode step between its matrix products, on the CPU: what the hf engine's
// own decode step (flashreinforce/engines/hf/fast_decode.py) runs between the products of each layer, a
// few dozen rows at a time. Framework-agnostic like the rest of the core (no Python, no PyTorch):
// plain pointers, element strides and sizes; float32 or bfloat16 data, float32 arithmetic, each
// result rounded once to the data's type.
//
// * norm: the residual update and RMS norm of a Llama layer,
//     x[r, :] += update[r, :]                                  (when update is given; x is updated)
//     out[r, i] = weight[i] * T(x[r, i] / sqrt(mean_i x[r, i]^2 + eps))
//   with T the rounding to the data type (as transformers' norm casts before the weight's product).
// * rotary: the rotary embedding of one step's queries and keys (rotate_half convention: the two
//   halves of a head), the queries written to q_out, this step's keys and values to the cache slots.
// * silu_mul: out[r, i] = silu(gate_up[r, i]) * gate_up[r, width + i] (a SwiGLU MLP's activation).
//
// Rows are independent tasks; sums run in an order fixed by the sizes alone, so results do not depend
// on the number of threads.
#pragma once

#include <cstdint>

#include "flashreinforce/core.h"

namespace flashreinforce {

struct DecodeNormParams {
  DType dtype = DType::kFloat32;  // of x, update, weight and out: kFloat32 or kBFloat16
  int64_t rows = 0, hidden = 0;
  void* x = nullptr;  // x[r, i] at x + r * x_stride + i
  int64_t x_stride = 0;
  const void* update = nullptr;  // nullptr: no residual update
  int64_t update_stride = 0;
  const void* weight = nullptr;  // [hidden]
  void* out = nullptr;
  int64_t out_stride = 0;
  float eps = 1e-6f;
};

struct DecodeRotaryParams {
  DType dtype = DType::kFloat32;  // of every tensor below
  int64_t batch = 0, heads = 0, kv_heads = 0, head_dim = 0;  // head_dim even
  // Row b of the fused projection: heads query heads, then kv_heads key heads, then kv_heads value
  // heads, each head_dim elements, at qkv + b * qkv_stride.
  const void* qkv = nullptr;
  int64_t qkv_stride = 0;
  const void* cos = nullptr;  // cos[b, d] at cos + b * cs_stride + d; sin likewise
  const void* sin = nullptr;
  int64_t cs_stride = 0;
  void* q_out = nullptr;  // [batch, heads, head_dim], contiguous
  // This step's key of (b, h) goes to k_slot + b * k_stride_batch + h * k_stride_head (head_dim
  // contiguous elements); its value to v_slot likewise.
  void* k_slot = nullptr;
  int64_t k_stride_batch = 0, k_stride_head = 0;
  void* v_slot = nullptr;
  int64_t v_stride_batch = 0, v_stride_head = 0;
};

struct DecodeSiluMulParams {
  DType dtype = DType::kFloat32;
  int64_t rows = 0, width = 0;
  const void* gate_up = nullptr;  // gate_up[r, :2 width] at gate_up + r * stride
  int64_t stride = 0;
  void* out = nullptr;  // out[r, :width] at out + r * out_stride
  int64_t out_stride = 0;
};

// Checks sizes, strides and pointers (no data is read): an empty string when valid, else what is wrong.
const char* decode_norm_check(const DecodeNormParams& p);
const char* decode_rotary_check(const DecodeRotaryParams& p);
const char* decode_silu_mul_check(const DecodeSiluMulParams& p);

// The computations above on up to num_threads threads (the host's OpenMP threads where it has them).
void decode_norm_cpu(const DecodeNormParams& p, int num_threads);
void decode_rotary_cpu(const DecodeRotaryParams& p, int num_threads);
void decode_silu_mul_cpu(const DecodeSiluMulParams& p, int num_threads);

}  // namespace flashreinforce
