// The CPU decode-step attention's driver (flashreinforce/decode_attention.h): checks, then one task
// per (request, key/value head), each with the kernel of the instruction set chosen for this CPU
// (main_pass.h) and its own scratch, in runs of consecutive tasks (each task told the next one, to
// prefetch its keys), on the host's OpenMP threads where it has them (the call sits between the
// host's matrix products; thread_pool.h says why) and on the core's pool elsewhere.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "flashreinforce/decode_attention.h"
#include "main_pass.h"
#include "thread_pool.h"

namespace flashreinforce {

const char* decode_attention_check(const DecodeAttentionParams& p) {
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16) return "dtype: float32 or bfloat16 only";
  if (p.batch < 0) return "batch: negative";
  if (p.kv_heads < 1) return "kv_heads: must be at least 1";
  if (p.groups < 1) return "groups: must be at least 1";
  if (p.head_dim < 1) return "head_dim: must be at least 1";
  if (p.length < 1) return "length: must be at least 1";
  if (p.batch == 0) return "";
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.mask == nullptr || p.out == nullptr) {
    return "q, k, v, mask and out: a null data pointer";
  }
  const int64_t strides[] = {p.q_stride_batch, p.q_stride_head, p.q_stride_group, p.k_stride_batch,
                             p.k_stride_head,  p.k_stride_pos,  p.v_stride_batch, p.v_stride_head,
                             p.v_stride_pos,   p.mask_stride_batch};
  for (int64_t s : strides) {
    if (s < 0) return "strides: negative";
  }
  // Rows of head_dim contiguous elements must not overlap along the dimensions the kernel walks.
  if (p.groups > 1 && p.q_stride_group < p.head_dim) return "q_stride_group: smaller than head_dim";
  if (p.length > 1 && (p.k_stride_pos < p.head_dim || p.v_stride_pos < p.head_dim)) {
    return "k_stride_pos / v_stride_pos: smaller than head_dim";
  }
  if (p.batch > 1 && p.mask_stride_batch < p.length) return "mask_stride_batch: smaller than length";
  return "";
}

void decode_attention_cpu(const DecodeAttentionParams& p, int num_threads) {
  if (p.batch == 0) return;
  const cpu::DecodeAttentionFn fn = cpu::cpu_kernels().decode_attention[static_cast<int>(p.dtype)];
  const int64_t scratch = p.groups * (2 * p.head_dim + p.length + 1) + p.length;  // decode_attention_impl.h
  // Runs of consecutive tasks, so that a thread knows the task it runs next and prefetches its first
  // keys; a few runs per thread keep the threads' shares even.
  const int64_t tasks = p.batch * p.kv_heads;
  const int64_t runs = std::min<int64_t>(tasks, 4 * std::max(num_threads, 1));
  cpu::parallel_for_host_threads(num_threads, runs, [&](int64_t run) {
    // Each thread keeps its scratch (a few KiB, warm in its cache) from call to call.
    thread_local std::vector<float> buffer;
    if (buffer.size() < static_cast<size_t>(scratch)) buffer.resize(static_cast<size_t>(scratch));
    const int64_t first = run * tasks / runs, end = (run + 1) * tasks / runs;
    for (int64_t task = first; task < end; ++task) fn(p, task, task + 1 < end ? task + 1 : -1, buffer.data());
  });
}

}  // namespace flashreinforce
