// Decode-step attention of a grouped-query model on the CPU: one new query per attention head, read
// against a key/value cache. Framework-agnostic like the loss (no Python, no PyTorch): plain
// pointers, element strides and sizes.
//
// For every request b and key/value head h, the `groups` query heads that share h (query head
// h * groups + g) attend to the positions j < length with mask[b, j] != 0:
//
//   s[g, j] = scale * <q[b, h, g, :], k[b, h, j, :]>            (float32 accumulation)
//   p[g, j] = exp(s[g, j] - max_j s[g, j]) / sum_j exp(...)      (float32)
//   out[b, h, g, :] = sum_j p[g, j] v[b, h, j, :]                (float32, then the output dtype)
//
// which is scaled_dot_product_attention of a one-token step, with the mask as its key padding mask.
// A request with no attended position gets zeros (SDPA would give NaN). Each (b, h) pair is one task
// with its own output slots, and every sum runs in an order fixed by the sizes alone, so results do
// not depend on the number of threads.
#pragma once

#include <cstdint>

#include "flashreinforce/core.h"

namespace flashreinforce {

struct DecodeAttentionParams {
  DType dtype = DType::kFloat32;  // of q, k, v and out: kFloat32 or kBFloat16
  int64_t batch = 0;              // requests
  int64_t kv_heads = 0;           // key/value heads
  int64_t groups = 0;             // query heads per key/value head
  int64_t head_dim = 0;
  int64_t length = 0;             // cache positions to read (the last one is this step's token)
  float scale = 1.0f;

  // q[b, h, g, d] at q + b * q_stride_batch + h * q_stride_head + g * q_stride_group + d (elements).
  const void* q = nullptr;
  int64_t q_stride_batch = 0, q_stride_head = 0, q_stride_group = 0;
  // k[b, h, j, d] at k + b * k_stride_batch + h * k_stride_head + j * k_stride_pos + d; v likewise.
  const void* k = nullptr;
  int64_t k_stride_batch = 0, k_stride_head = 0, k_stride_pos = 0;
  const void* v = nullptr;
  int64_t v_stride_batch = 0, v_stride_head = 0, v_stride_pos = 0;
  // mask[b, j] at mask + b * mask_stride_batch + j (one byte: 0 = not attended).
  const uint8_t* mask = nullptr;
  int64_t mask_stride_batch = 0;
  // out[b, h, g, d], contiguous: [batch, kv_heads, groups, head_dim].
  void* out = nullptr;
};

// Checks the sizes, strides and pointers a call needs for memory safety (no data is read); returns
// an empty string when they are valid, else what is wrong, naming the field.
const char* decode_attention_check(const DecodeAttentionParams& p);

// Computes out (see above) on up to num_threads threads (the caller's included). Preconditions:
// decode_attention_check(p) is empty.
void decode_attention_cpu(const DecodeAttentionParams& p, int num_threads);

}  // namespace flashreinforce
