// The register kernels of the packed skinny product (flashreinforce/skinny_gemm.h), written with
// AVX-512 intrinsics. Included by skinny_gemm_avx512.cpp (float32; compiled with AVX-512F) and
// skinny_gemm_avx512_bf16.cpp (bfloat16; compiled with AVX-512 BF16 as well), each of which defines
// one entry point of skinny_gemm_isa.h with FR_SKINNY_DTYPE. Internal linkage: nothing here is
// visible outside the including file.
//
// A kernel call multiplies up to 8 rows of x by one panel of kSkinnyPanel = 48 columns (3 vectors of
// 16 float32 lanes): 8 x 3 accumulators stay in registers over the whole sum, each weight vector
// loaded once per k (per pair of k for bfloat16) serves every row, and each row's element is
// broadcast once per k. The panel (48 x in_features elements) stays in the core's cache across the
// row groups, so only the first group reads it from memory.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "flashreinforce/skinny_gemm.h"

namespace flashreinforce {
namespace cpu {
namespace {

constexpr int kVectors = static_cast<int>(kSkinnyPanel / 16);  // accumulator vectors per row
constexpr int kRowGroup = 8;                                    // rows per kernel call

static_assert(kSkinnyPanel == 16 * kVectors, "a panel is a whole number of 16-lane vectors");

// Lanes of the panel's vector j that are real columns (the rest is padding).
inline __mmask16 column_mask(int64_t columns, int j) {
  const int64_t c = columns - 16 * static_cast<int64_t>(j);
  if (c <= 0) return 0;
  return c >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << c) - 1u);
}

template <int R>
inline void clear(__m512 (&acc)[R][kVectors]) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVectors; ++j) acc[r][j] = _mm512_setzero_ps();
}

// acc[r][j] += bias[j] (the panel's bias in float32 lanes; zero past its columns).
template <int R>
inline void add_bias(__m512 (&acc)[R][kVectors], const __m512 (&bias)[kVectors]) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVectors; ++j) acc[r][j] = _mm512_add_ps(acc[r][j], bias[j]);
}

#if FR_SKINNY_DTYPE == 32
// ---------------------------------------------------------------------------- float32
// Panel layout: element (k, c) at panel[k * 48 + c].
template <int R>
void rows_by_panel(const float* x, int64_t x_stride, const float* panel, int64_t k_size, const float* bias,
                   float* y, int64_t y_stride, int64_t columns) {
  __m512 acc[R][kVectors];
  clear<R>(acc);
  for (int64_t k = 0; k < k_size; ++k) {
    __m512 w[kVectors];
    for (int j = 0; j < kVectors; ++j) w[j] = _mm512_loadu_ps(panel + k * kSkinnyPanel + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * x_stride + k]);
      for (int j = 0; j < kVectors; ++j) acc[r][j] = _mm512_fmadd_ps(xr, w[j], acc[r][j]);
    }
  }
  if (bias != nullptr) {
    __m512 b[kVectors];
    for (int j = 0; j < kVectors; ++j) b[j] = _mm512_maskz_loadu_ps(column_mask(columns, j), bias + 16 * j);
    add_bias<R>(acc, b);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVectors; ++j) {
      _mm512_mask_storeu_ps(y + r * y_stride + 16 * j, column_mask(columns, j), acc[r][j]);
    }
}
using Element = float;

#elif FR_SKINNY_DTYPE == 16
// ---------------------------------------------------------------------------- bfloat16
// Panel layout: elements (2i, c) and (2i + 1, c) at panel[(i * 48 + c) * 2] and the next one.
inline __m512i broadcast_pair(const uint16_t* x, int64_t k, int64_t k_size) {
  uint32_t pair = 0;
  if (k + 1 < k_size) {
    std::memcpy(&pair, x + k, sizeof(pair));
  } else {
    pair = x[k];  // odd in_features: the last element pairs with zero (the packed weight's padding)
  }
  return _mm512_set1_epi32(static_cast<int>(pair));
}

template <int R>
void rows_by_panel(const uint16_t* x, int64_t x_stride, const uint16_t* panel, int64_t k_size, const uint16_t* bias,
                   uint16_t* y, int64_t y_stride, int64_t columns) {
  __m512 acc[R][kVectors];
  clear<R>(acc);
  const int64_t pairs = (k_size + 1) / 2;
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh w[kVectors];
    for (int j = 0; j < kVectors; ++j) {
      w[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + (i * kSkinnyPanel + 16 * j) * 2));
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = reinterpret_cast<__m512bh>(broadcast_pair(x + r * x_stride, 2 * i, k_size));
      for (int j = 0; j < kVectors; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xr, w[j]);
    }
  }
  if (bias != nullptr) {
    float wide[kSkinnyPanel] = {};  // the panel's bias in float32 (a bfloat16 is the top half of one)
    for (int64_t c = 0; c < columns; ++c) {
      const uint32_t bits = static_cast<uint32_t>(bias[c]) << 16;
      std::memcpy(&wide[c], &bits, sizeof(bits));
    }
    __m512 b[kVectors];
    for (int j = 0; j < kVectors; ++j) b[j] = _mm512_loadu_ps(wide + 16 * j);
    add_bias<R>(acc, b);
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < kVectors; ++j) {
      const __m256i out = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[r][j]));  // round to nearest even
      _mm256_mask_storeu_epi16(y + r * y_stride + 16 * j, column_mask(columns, j), out);
    }
  }
}
using Element = uint16_t;
#else
#error "FR_SKINNY_DTYPE must be 32 or 16"
#endif

// Rows [0, rows) of x by one panel, in groups of 8 and one smaller group for the rest.
void all_rows_by_panel(const Element* x, int64_t x_stride, int64_t rows, const Element* panel, int64_t k_size,
                       const Element* bias, Element* y, int64_t y_stride, int64_t columns) {
  int64_t r = 0;
  for (; r + kRowGroup <= rows; r += kRowGroup) {
    rows_by_panel<kRowGroup>(x + r * x_stride, x_stride, panel, k_size, bias, y + r * y_stride, y_stride, columns);
  }
  const Element* xr = x + r * x_stride;
  Element* yr = y + r * y_stride;
  switch (rows - r) {
    case 1: rows_by_panel<1>(xr, x_stride, panel, k_size, bias, yr, y_stride, columns); break;
    case 2: rows_by_panel<2>(xr, x_stride, panel, k_size, bias, yr, y_stride, columns); break;
    case 3: rows_by_panel<3>(xr, x_stride, panel, k_size, bias, yr, y_stride, columns); break;
    case 4: rows_by_panel<4>(xr, x_stride, panel, k_size, bias, yr, y_stride, columns); break;
    case 5: rows_by_panel<5>(xr, x_stride, panel, k_size, bias, yr, y_stride, columns); break;
    case 6: rows_by_panel<6>(xr, x_stride, panel, k_size, bias, yr, y_stride, columns); break;
    case 7: rows_by_panel<7>(xr, x_stride, panel, k_size, bias, yr, y_stride, columns); break;
    default: break;
  }
}

// Panels [begin, end) of the product p (sizes and pointers checked by the caller).
void panels_of_product(const SkinnyGemmParams& p, int64_t begin, int64_t end) {
  const auto* x = static_cast<const Element*>(p.x);
  const auto* packed = static_cast<const Element*>(p.packed);
  const auto* bias = static_cast<const Element*>(p.bias);
  auto* y = static_cast<Element*>(p.y);
  const int64_t panel_elements = skinny_gemm_packed_elements(p.dtype, kSkinnyPanel, p.in_features);
  for (int64_t q = begin; q < end; ++q) {
    const int64_t first = q * kSkinnyPanel;
    const int64_t columns = p.out_features - first < kSkinnyPanel ? p.out_features - first : kSkinnyPanel;
    all_rows_by_panel(x, p.x_stride, p.rows, packed + q * panel_elements, p.in_features,
                      bias == nullptr ? nullptr : bias + first, y + first, p.y_stride, columns);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace flashreinforce
