// Products of a few rows by a weight matrix packed once per version, on the CPU: the matrix products of
// a decode step, where each request contributes one row (a few dozen rows against weights of hundreds
// of columns). Framework-agnostic like the rest of the core (no Python, no PyTorch).
//
//     y[r, n] = T(sum_k x[r, k] * w[n, k] + bias[n])      r < rows, n < out_features, k < in_features
//
// with float32 accumulation and T the rounding to the data type (float32 or bfloat16; bias optional).
//
// The weight is first copied by skinny_gemm_pack into panels of kSkinnyPanel output columns: a panel
// holds, for each k (float32) or each pair of k (bfloat16, the pair adjacent as the AVX-512 BF16 dot
// product reads it), its columns side by side, zero-padded past out_features and, for bfloat16, past
// an odd in_features. The product walks the panels, each once from memory, and multiplies every group
// of up to 8 rows by a panel while it sits in the core's cache: the weight is read from memory once
// per call, whatever the number of rows, and each weight element loaded into a register serves 8 rows.
//
// The sum over k runs in the order of k for every output (a pair at a time for bfloat16), so results
// do not depend on the number of threads or on the row's group. They differ from a BLAS's summation
// order by float rounding.
//
// The kernels need AVX-512F (float32) and AVX-512 BF16 (bfloat16); skinny_gemm_supported says whether
// this build and CPU have them. Where not, the caller multiplies some other way (the hf engine uses
// oneDNN's packed product).
#pragma once

#include <cstdint>

#include "flashreinforce/core.h"

namespace flashreinforce {

// Output columns per packed panel.
constexpr int64_t kSkinnyPanel = 48;

struct SkinnyPackParams {
  DType dtype = DType::kFloat32;  // of the weight and the packed copy: kFloat32 or kBFloat16
  int64_t out_features = 0, in_features = 0;
  const void* weight = nullptr;  // w[n, k] at weight + n * weight_stride + k
  int64_t weight_stride = 0;
  void* packed = nullptr;  // skinny_gemm_packed_elements(...) elements of dtype
};

struct SkinnyGemmParams {
  DType dtype = DType::kFloat32;  // of x, the packed weight, bias and y
  int64_t rows = 0, in_features = 0, out_features = 0;
  const void* x = nullptr;  // x[r, k] at x + r * x_stride + k
  int64_t x_stride = 0;
  const void* packed = nullptr;  // from skinny_gemm_pack with the same dtype and sizes
  const void* bias = nullptr;    // [out_features], or nullptr
  void* y = nullptr;             // y[r, n] at y + r * y_stride + n
  int64_t y_stride = 0;
};

// Whether this build and CPU run the kernels for dtype.
bool skinny_gemm_supported(DType dtype);

// Elements (of the dtype) of a packed copy of an [out_features, in_features] weight.
int64_t skinny_gemm_packed_elements(DType dtype, int64_t out_features, int64_t in_features);

// Checks sizes, strides and pointers (no data is read): an empty string when valid, else what is wrong.
const char* skinny_pack_check(const SkinnyPackParams& p);
const char* skinny_gemm_check(const SkinnyGemmParams& p);

// The packing and the product above on up to num_threads threads (the host's OpenMP threads where it
// has them). skinny_gemm_cpu must only be called where skinny_gemm_supported(p.dtype).
void skinny_pack_cpu(const SkinnyPackParams& p, int num_threads);
void skinny_gemm_cpu(const SkinnyGemmParams& p, int num_threads);

}  // namespace flashreinforce
