// The packed skinny product (flashreinforce/skinny_gemm.h): checks, packing, and the split of a product
// into tasks of whole panels run by the AVX-512 kernels (skinny_gemm_kernels.h). Compiled for the
// baseline; the kernels' files are compiled for their instruction sets and called only where the CPU
// has them.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "flashreinforce/skinny_gemm.h"
#include "thread_pool.h"
#if defined(FLASHREINFORCE_HAVE_SKINNY_AVX512)
#include "skinny_gemm_isa.h"
#endif

namespace flashreinforce {
namespace {

bool float32_or_bf16(DType dt) { return dt == DType::kFloat32 || dt == DType::kBFloat16; }

int64_t panels(int64_t out_features) { return (out_features + kSkinnyPanel - 1) / kSkinnyPanel; }

// k positions a panel holds: in_features, rounded up to a whole pair for bfloat16.
int64_t packed_depth(DType dt, int64_t in_features) {
  return dt == DType::kBFloat16 ? in_features + (in_features & 1) : in_features;
}

// Panels per task: at least 2 (a panel of a small layer is a few microseconds of work), and enough
// tasks that a thread slowed by another process does not hold the call up for long.
int64_t panels_per_task(int64_t total, int num_threads) {
  const int64_t most = 4 * int64_t{std::max(num_threads, 1)};
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>((total + 1) / 2, most));
  return (total + tasks - 1) / tasks;
}

// One panel q of the weight into its packed place (module header's layout); padding is zero. Each
// weight row is read in order; float32 elements go one by one, bfloat16 ones as pairs (32 bits).
void pack_panel_f32(const SkinnyPackParams& p, int64_t q) {
  const float* w = static_cast<const float*>(p.weight);
  float* out = static_cast<float*>(p.packed) + q * kSkinnyPanel * p.in_features;
  std::memset(static_cast<void*>(out), 0, sizeof(float) * kSkinnyPanel * p.in_features);
  const int64_t first = q * kSkinnyPanel, columns = std::min<int64_t>(kSkinnyPanel, p.out_features - first);
  for (int64_t c = 0; c < columns; ++c) {
    const float* row = w + (first + c) * p.weight_stride;
    for (int64_t k = 0; k < p.in_features; ++k) out[k * kSkinnyPanel + c] = row[k];
  }
}

void pack_panel_bf16(const SkinnyPackParams& p, int64_t q) {
  const uint16_t* w = static_cast<const uint16_t*>(p.weight);
  const int64_t pairs = (p.in_features + 1) / 2, whole = p.in_features / 2;
  uint16_t* out = static_cast<uint16_t*>(p.packed) + q * kSkinnyPanel * 2 * pairs;
  std::memset(static_cast<void*>(out), 0, sizeof(uint16_t) * kSkinnyPanel * 2 * pairs);
  const int64_t first = q * kSkinnyPanel, columns = std::min<int64_t>(kSkinnyPanel, p.out_features - first);
  for (int64_t c = 0; c < columns; ++c) {
    const uint16_t* row = w + (first + c) * p.weight_stride;
    for (int64_t i = 0; i < whole; ++i) std::memcpy(out + (i * kSkinnyPanel + c) * 2, row + 2 * i, 4);
    if (whole < pairs) out[(whole * kSkinnyPanel + c) * 2] = row[2 * whole];  // odd in_features: pairs with 0
  }
}

}  // namespace

bool skinny_gemm_supported(DType dtype) {
#if defined(FLASHREINFORCE_HAVE_SKINNY_AVX512)
  // AVX-512F, BW, DQ and VL, checked by the CPU path's dispatch (which FLASHREINFORCE_CPU_ISA can lower).
  static const bool avx512 = std::strcmp(cpu::cpu_isa_name(), "avx512") == 0;
  static const bool bf16 = cpu::cpu_uses_avx512_bf16();  // "avx512" and the CPU's BF16 extension, unless lowered
  if (dtype == DType::kFloat32) return avx512;
  if (dtype == DType::kBFloat16) return bf16;
#else
  (void)dtype;
#endif
  return false;
}

int64_t skinny_gemm_packed_elements(DType dtype, int64_t out_features, int64_t in_features) {
  return panels(out_features) * kSkinnyPanel * packed_depth(dtype, in_features);
}

const char* skinny_pack_check(const SkinnyPackParams& p) {
  if (!float32_or_bf16(p.dtype)) return "dtype: float32 or bfloat16 only";
  if (p.out_features < 1 || p.in_features < 1) return "out_features / in_features: at least 1";
  if (p.weight == nullptr || p.packed == nullptr) return "weight and packed: a null data pointer";
  if (p.out_features > 1 && p.weight_stride < p.in_features) return "weight_stride: smaller than in_features";
  return "";
}

const char* skinny_gemm_check(const SkinnyGemmParams& p) {
  if (!float32_or_bf16(p.dtype)) return "dtype: float32 or bfloat16 only";
  if (p.rows < 0 || p.out_features < 1 || p.in_features < 1) {
    return "sizes: rows >= 0, out_features and in_features >= 1";
  }
  if (p.rows == 0) return "";
  if (p.x == nullptr || p.packed == nullptr || p.y == nullptr) return "x, packed and y: a null data pointer";
  if (p.rows > 1 && (p.x_stride < p.in_features || p.y_stride < p.out_features)) {
    return "strides: x_stride smaller than in_features or y_stride smaller than out_features";
  }
  if (!skinny_gemm_supported(p.dtype)) return "this build or CPU lacks the AVX-512 kernels for this dtype";
  return "";
}

void skinny_pack_cpu(const SkinnyPackParams& p, int num_threads) {
  const int64_t total = panels(p.out_features);
  const int64_t per_task = panels_per_task(total, num_threads);
  cpu::parallel_for_host_threads(num_threads, (total + per_task - 1) / per_task, [&](int64_t task) {
    const int64_t end = std::min(total, (task + 1) * per_task);
    for (int64_t q = task * per_task; q < end; ++q) {
      if (p.dtype == DType::kFloat32) {
        pack_panel_f32(p, q);
      } else {
        pack_panel_bf16(p, q);
      }
    }
  });
}

void skinny_gemm_cpu(const SkinnyGemmParams& p, int num_threads) {
  if (p.rows == 0) return;
#if defined(FLASHREINFORCE_HAVE_SKINNY_AVX512)
  const auto run = p.dtype == DType::kFloat32 ? &cpu::skinny_panels_avx512_f32 : &cpu::skinny_panels_avx512_bf16;
  const int64_t total = panels(p.out_features);
  const int64_t per_task = panels_per_task(total, num_threads);
  cpu::parallel_for_host_threads(num_threads, (total + per_task - 1) / per_task, [&](int64_t task) {
    run(p, task * per_task, std::min(total, (task + 1) * per_task));
  });
#else
  (void)num_threads;
#endif
}

}  // namespace flashreinforce
