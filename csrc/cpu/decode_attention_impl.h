// Template implementation of the CPU decode-step attention (flashreinforce/decode_attention.h).
// Included by main_pass_generic.cpp, main_pass_avx2.cpp and main_pass_avx512.cpp inside different
// namespaces, like the main pass (see main_pass.h), and by decode_attention_avx512_bf16.cpp (AVX-512
// with its BF16 extension, for bfloat16 caches): every function here has internal linkage and no
// standard-library container is used, so nothing is emitted as a symbol those files could share.
//
// One task is one (request, key/value head) pair; its keys and values are read once from memory.
// 1. The attended positions are listed (the mask read eight bytes at a time; no branch in the loops
//    after it).
// 2. Scores: the dot products of each query with a block of as many key rows as a vector register
//    has lanes (GCC/Clang vector extensions: 16 floats with AVX-512, 8 with AVX2, 4 otherwise), the
//    rows' sums transposed into one register; each key row's value row is prefetched meanwhile.
//    bfloat16 rows: with AVX-512 BF16, the stored queries and rows multiplied as they are
//    (vdpbf16ps); elsewhere the block converted to float32 once for all the group's queries.
// 3. Softmax per query, with the core's vectorizable float32 exponential.
// 4. Output: the probability-weighted sum of the value rows, each value row read (and converted from
//    bfloat16) once for all the queries of its group, one accumulator per query and register block
//    (a single query: four accumulators per block over the rows instead).
// bfloat16 rows whose head_dim is a multiple of two registers are read in "pair order": one load of
// 2 x lanes elements gives the even and the odd elements as two float32 blocks, exactly, with two
// instructions (attn_load_pair); the queries are laid out in that order and the outputs put back.
// A head_dim that is not a multiple of the register width takes plain loops with the same arithmetic
// order per output element. All sums are float32, in an order fixed by the sizes and the build (never
// by the threads).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "flashreinforce/decode_attention.h"
#include "flashreinforce/token_math.h"
#include "main_pass.h"

namespace flashreinforce {
namespace cpu {
namespace FR_ISA_NAMESPACE {

// One vector register of floats on the instruction set this file is compiled for: the blocks the
// head dimension is cut into.
#if defined(__AVX512F__)
constexpr int kAttnLanes = 16;
#elif defined(__AVX2__)
constexpr int kAttnLanes = 8;
#else
constexpr int kAttnLanes = 4;
#endif
typedef float AttnVec __attribute__((vector_size(4 * kAttnLanes)));
typedef uint16_t AttnHalfBits __attribute__((vector_size(2 * kAttnLanes)));  // bfloat16 bit patterns
typedef uint32_t AttnWordBits __attribute__((vector_size(4 * kAttnLanes)));  // float bit patterns

static inline AttnVec attn_load(const float* p) {
  AttnVec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

static inline AttnVec attn_load(const math::BFloat16* p) {
  AttnHalfBits h;
  std::memcpy(&h, p, sizeof h);
  const AttnWordBits w = __builtin_convertvector(h, AttnWordBits) << 16;
  AttnVec v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

// Two blocks of a bfloat16 row from one load of 2 * kAttnLanes elements, exactly: the even
// elements (the low half of each 32-bit word, shifted up) and the odd ones (the high half, the low
// bits cleared). Half the conversion instructions of two attn_load calls; the blocks come out in the
// task's "pair order" (see decode_attention_task_in), not the row's.
static inline void attn_load_pair(const math::BFloat16* p, AttnVec& even, AttnVec& odd) {
  AttnWordBits w;
  std::memcpy(&w, p, sizeof w);
  const AttnWordBits lo = w << 16, hi = w & 0xffff0000u;
  std::memcpy(&even, &lo, sizeof even);
  std::memcpy(&odd, &hi, sizeof odd);
}

// Blocks c0 .. c0 + N - 1 of a row (c0 counted by the caller: `row` points at block c0). Pairs: the
// row is read in pair order (N even), each pair of blocks from one attn_load_pair.
template <bool Pairs, int N, class T>
static inline void attn_load_blocks(const T* row, AttnVec* out) {
  if constexpr (Pairs) {
    static_assert(N % 2 == 0 && !std::is_same_v<T, float>, "pair order: bfloat16 rows, whole pairs of blocks");
    for (int s = 0; s < N / 2; ++s) attn_load_pair(row + 2 * kAttnLanes * s, out[2 * s], out[2 * s + 1]);
  } else {
    for (int c = 0; c < N; ++c) out[c] = attn_load(row + kAttnLanes * c);
  }
}

static inline float attn_hsum(AttnVec v) {
  float lanes[kAttnLanes];
  std::memcpy(lanes, &v, sizeof lanes);
  for (int width = kAttnLanes / 2; width >= 1; width /= 2) {  // pairwise, in a fixed order
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  }
  return lanes[0];
}

// Shuffles that fold pairs of vectors: with __builtin_shufflevector (Clang, GCC 12 and newer), the
// per-row sums of a block of kAttnLanes key rows come out of one transposing reduction (about three
// vector operations a row); without it, each row's sum is added up lane by lane.
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define FR_ATTN_TRANSPOSED_SUMS 1
// Lane `lane` of the first operand of the fold that turns segments of width B into segments of
// width B / 2 (x's segments first, then y's; each output segment is the input's two halves added).
template <int B>
constexpr int attn_fold_index(int lane) {
  return (lane / (B / 2) < kAttnLanes / B ? 0 : kAttnLanes) + ((lane / (B / 2)) % (kAttnLanes / B)) * B +
         lane % (B / 2);
}

template <int B, size_t... Lane>
static inline AttnVec attn_fold(AttnVec x, AttnVec y, std::index_sequence<Lane...>) {
  return __builtin_shufflevector(x, y, attn_fold_index<B>(Lane)...) +
         __builtin_shufflevector(x, y, (attn_fold_index<B>(Lane) + B / 2)...);
}

// a[0, N) (N = kAttnLanes at the first call): afterwards lane r of a[0] is the sum of the lanes of
// the original a[r].
template <int B, int N>
static inline void attn_row_sums(AttnVec* a) {
  for (int i = 0; i < N / 2; ++i) a[i] = attn_fold<B>(a[2 * i], a[2 * i + 1], std::make_index_sequence<kAttnLanes>{});
  if constexpr (B > 2) attn_row_sums<B / 2, N / 2>(a);
}
#endif

static inline void attn_prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

// A bfloat16 block of key rows is converted to float32 once for all the queries of its group when
// head_dim is at most this (the block lives on the stack: kAttnLanes * 256 floats, 16 KiB with AVX-512).
constexpr int64_t kAttnMaxConvertedDim = 256;

// Whether a task reads its bfloat16 rows in pair order (attn_load_pair): head_dim a whole number of
// pairs of blocks, within the converted block's size. float32 rows are always read in row order.
template <class T>
static inline bool attn_pair_order(int64_t D) {
  return !std::is_same_v<T, float> && D % (2 * kAttnLanes) == 0 && D <= kAttnMaxConvertedDim;
}

// Row order to pair order and back, for n rows of D elements (D a multiple of 2 * kAttnLanes): each
// stretch of 2 * kAttnLanes elements holds its even elements, then its odd ones. Loops the compiler
// vectorizes (interleaved loads and stores).
static inline void attn_to_pair_order(const float* x, int64_t n, int64_t D, float* y) {
  for (int64_t base = 0; base < n * D; base += 2 * kAttnLanes) {
    for (int i = 0; i < kAttnLanes; ++i) {
      y[base + i] = x[base + 2 * i];
      y[base + kAttnLanes + i] = x[base + 2 * i + 1];
    }
  }
}

static inline void attn_from_pair_order(const float* x, int64_t n, int64_t D, float* y) {
  for (int64_t base = 0; base < n * D; base += 2 * kAttnLanes) {
    for (int i = 0; i < kAttnLanes; ++i) {
      y[base + 2 * i] = x[base + i];
      y[base + 2 * i + 1] = x[base + kAttnLanes + i];
    }
  }
}

#ifdef FR_ATTN_TRANSPOSED_SUMS
// Scores of NG queries against one block of kAttnLanes key rows (rows[r]: D elements each): s[n * L + r].
template <int NG, class R>
static inline void attn_block_scores(const float* qf, int64_t D, const R* const* rows, float scale, float* s,
                                     int64_t L) {
  const int64_t blocks = D / kAttnLanes;
  for (int n = 0; n < NG; ++n) {
    AttnVec acc[kAttnLanes];
    for (int r = 0; r < kAttnLanes; ++r) acc[r] = AttnVec{};
    for (int64_t c = 0; c < blocks; ++c) {
      const AttnVec qc = attn_load(qf + n * D + kAttnLanes * c);
      for (int r = 0; r < kAttnLanes; ++r) acc[r] += qc * attn_load(rows[r] + kAttnLanes * c);
    }
    attn_row_sums<kAttnLanes, kAttnLanes>(acc);
    const AttnVec scores = acc[0] * scale;
    std::memcpy(s + n * L, &scores, sizeof scores);
  }
}

// Converts a block of kAttnLanes bfloat16 rows of D elements to float32 rows in `converted` (in pair
// order where Pairs); crows[r] points at row r.
template <bool Pairs>
static inline void attn_convert_rows(const math::BFloat16* const* rows, int64_t D, float* converted,
                                     const float** crows) {
  constexpr int P = Pairs ? 2 : 1;  // blocks per load
  const int64_t blocks = D / kAttnLanes;
  for (int r = 0; r < kAttnLanes; ++r) {
    float* dst = converted + r * D;
    for (int64_t c = 0; c < blocks; c += P) {
      AttnVec x[P];
      attn_load_blocks<Pairs, P>(rows[r] + kAttnLanes * c, x);
      for (int y = 0; y < P; ++y) std::memcpy(dst + kAttnLanes * (c + y), &x[y], sizeof(AttnVec));
    }
    crows[r] = dst;
  }
}

#if defined(__AVX512BF16__)
// Scores of NG bfloat16 queries (qb[n]: D elements, D a multiple of 32) against a block of 16 bfloat16
// key rows by vdpbf16ps (AVX-512 BF16): each instruction multiplies 32 pairs of elements exactly and
// adds each pair to one of 16 float32 sums, so the rows are read as they are stored, with no
// conversion. s[n * L + r].
template <int NG>
static inline void attn_block_scores_dot(const math::BFloat16* const* qb, int64_t D,
                                         const math::BFloat16* const* rows, float scale, float* s, int64_t L) {
  static_assert(kAttnLanes == 16, "AVX-512: 16 float32 sums a register");
  const int64_t pairs = D / 32;
  for (int n = 0; n < NG; ++n) {
    __m512 sums[kAttnLanes];
    for (int r = 0; r < kAttnLanes; ++r) sums[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < pairs; ++c) {
      const __m512bh qc = reinterpret_cast<__m512bh>(_mm512_loadu_si512(qb[n] + 32 * c));
      for (int r = 0; r < kAttnLanes; ++r) {
        sums[r] = _mm512_dpbf16_ps(sums[r], qc, reinterpret_cast<__m512bh>(_mm512_loadu_si512(rows[r] + 32 * c)));
      }
    }
    AttnVec acc[kAttnLanes];
    for (int r = 0; r < kAttnLanes; ++r) acc[r] = reinterpret_cast<AttnVec>(sums[r]);
    attn_row_sums<kAttnLanes, kAttnLanes>(acc);
    const AttnVec scores = acc[0] * scale;
    std::memcpy(s + n * L, &scores, sizeof scores);
  }
}
#endif
#endif

// Scores of NG queries (qf rows, already float32, in the rows' reading order) against the listed key
// rows: s[n * L + i] for the i-th attended position. The value row of each key row is prefetched on
// the way, so that the values pass finds it in cache.
template <int NG, bool Pairs, class T>
static void attn_scores_blocked(const float* qf, const T* q, int64_t q_stride_group, int64_t D, const T* k,
                                int64_t k_stride_pos, const T* v, int64_t v_stride_pos, bool prefetch_values,
                                const int32_t* idx, int64_t count, float scale, float* s, int64_t L) {
  constexpr int P = Pairs ? 2 : 1;  // blocks per load
  const int64_t blocks = D / kAttnLanes;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  int64_t i = 0;
#ifdef FR_ATTN_TRANSPOSED_SUMS
  for (; i + kAttnLanes <= count; i += kAttnLanes) {
    const T* rows[kAttnLanes];
    for (int r = 0; r < kAttnLanes; ++r) {
      rows[r] = k + static_cast<int64_t>(idx[i + r]) * k_stride_pos;
      if (prefetch_values) {
        attn_prefetch_row(v + static_cast<int64_t>(idx[i + r]) * v_stride_pos, row_bytes);
        // and the key rows two blocks ahead (the hardware prefetcher stops at each 4 KiB page)
        if (i + r + 2 * kAttnLanes < count) {
          attn_prefetch_row(k + static_cast<int64_t>(idx[i + r + 2 * kAttnLanes]) * k_stride_pos, row_bytes);
        }
      }
    }
#if defined(__AVX512BF16__)
    if constexpr (!std::is_same_v<T, float>) {
      if (D % 32 == 0) {  // the stored queries and rows multiplied as they are (vdpbf16ps)
        const T* qb[NG];
        for (int n = 0; n < NG; ++n) qb[n] = q + n * q_stride_group;
        attn_block_scores_dot<NG>(qb, D, rows, scale, s + i, L);
        continue;
      }
    }
#else
    (void)q, (void)q_stride_group;
#endif
    if constexpr (!std::is_same_v<T, float>) {
      // bfloat16 rows scored by more than one query, or read in pair order: converted to float32 once,
      // into a block that stays in L1, instead of once per query.
      if (Pairs || (NG > 1 && D <= kAttnMaxConvertedDim)) {  // (pair order implies the size)
        alignas(64) float converted[kAttnLanes * kAttnMaxConvertedDim];
        const float* crows[kAttnLanes];
        attn_convert_rows<Pairs>(rows, D, converted, crows);
        attn_block_scores<NG>(qf, D, crows, scale, s + i, L);
        continue;
      }
    }
    if constexpr (!Pairs) attn_block_scores<NG>(qf, D, rows, scale, s + i, L);
  }
#endif
  for (; i < count; ++i) {
    const T* kj = k + static_cast<int64_t>(idx[i]) * k_stride_pos;
    if (prefetch_values) attn_prefetch_row(v + static_cast<int64_t>(idx[i]) * v_stride_pos, row_bytes);
    AttnVec acc[NG];
    for (int n = 0; n < NG; ++n) acc[n] = AttnVec{};
    for (int64_t c = 0; c < blocks; c += P) {
      AttnVec kc[P];
      attn_load_blocks<Pairs, P>(kj + kAttnLanes * c, kc);
      for (int x = 0; x < P; ++x) {
        for (int n = 0; n < NG; ++n) acc[n] += attn_load(qf + n * D + kAttnLanes * (c + x)) * kc[x];
      }
    }
    for (int n = 0; n < NG; ++n) s[n * L + i] = attn_hsum(acc[n]) * scale;
  }
}

// out[n, :] = sum_i p[n * L + i] * v[idx[i], :] for NG queries, block by block: one accumulator per
// query and register block of the head dimension (CB blocks at a time, see attn_values_chunk_blocks),
// every value row read and converted once per chunk of blocks for all NG queries (not once per
// query), and the rows added in position order. The outputs are in the rows' reading order.
template <int NG, int CB, bool Pairs, class T>
static inline void attn_values_chunk(const float* p, int64_t L, const T* v, int64_t v_stride_pos, const int32_t* idx,
                                     int64_t count, int64_t D, int64_t c0, float* acc) {
  AttnVec a[NG][CB];
  for (int n = 0; n < NG; ++n) {
    for (int c = 0; c < CB; ++c) a[n][c] = AttnVec{};
  }
  for (int64_t i = 0; i < count; ++i) {
    AttnVec vc[CB];
    attn_load_blocks<Pairs, CB>(v + static_cast<int64_t>(idx[i]) * v_stride_pos + kAttnLanes * c0, vc);
    for (int n = 0; n < NG; ++n) {
      const float pn = p[n * L + i];
      for (int c = 0; c < CB; ++c) a[n][c] += pn * vc[c];
    }
  }
  for (int n = 0; n < NG; ++n) {
    for (int c = 0; c < CB; ++c) std::memcpy(acc + n * D + kAttnLanes * (c0 + c), &a[n][c], sizeof(AttnVec));
  }
}

// One query (NG = 1): four accumulators over the rows per block, so that the additions do not wait
// on each other (a single query gives only CB independent chains otherwise).
template <bool Pairs, class T>
static void attn_values_single(const float* p, const T* v, int64_t v_stride_pos, const int32_t* idx, int64_t count,
                               int64_t D, float* acc) {
  constexpr int P = Pairs ? 2 : 1;  // blocks per load
  const int64_t blocks = D / kAttnLanes;
  const auto row = [&](int64_t i, int64_t c) {
    return v + static_cast<int64_t>(idx[i]) * v_stride_pos + kAttnLanes * c;
  };
  for (int64_t c = 0; c < blocks; c += P) {
    AttnVec a[4][P];
    for (int u = 0; u < 4; ++u) {
      for (int x = 0; x < P; ++x) a[u][x] = AttnVec{};
    }
    int64_t i = 0;
    for (; i + 4 <= count; i += 4) {
      for (int u = 0; u < 4; ++u) {
        AttnVec vc[P];
        attn_load_blocks<Pairs, P>(row(i + u, c), vc);
        for (int x = 0; x < P; ++x) a[u][x] += p[i + u] * vc[x];
      }
    }
    for (; i < count; ++i) {
      AttnVec vc[P];
      attn_load_blocks<Pairs, P>(row(i, c), vc);
      for (int x = 0; x < P; ++x) a[0][x] += p[i] * vc[x];
    }
    for (int x = 0; x < P; ++x) {
      const AttnVec total = (a[0][x] + a[1][x]) + (a[2][x] + a[3][x]);
      std::memcpy(acc + kAttnLanes * (c + x), &total, sizeof total);
    }
  }
}

// Vector registers of the instruction set (AVX-512: 32; AVX2 and SSE: 16).
#if defined(__AVX512F__)
constexpr int kAttnVectorRegisters = 32;
#else
constexpr int kAttnVectorRegisters = 16;
#endif

// Blocks of the head dimension per chunk for NG queries: at most four, and few enough that the
// NG * CB accumulators, the CB loaded value blocks and the broadcast probability stay in registers
// (AVX-512: 4 for every NG; AVX2: 4 for two queries, 3 for three or four); in pair order an even
// number (AVX2: 2 for three or four queries). Each output element's sum runs over the rows in the
// same order whatever CB is.
constexpr int attn_values_chunk_blocks(int ng, bool pairs) {
  int cb = 4;
  while (cb > 1 && ng * cb + cb + 1 > kAttnVectorRegisters) --cb;
  return pairs ? (cb < 2 ? 2 : cb - cb % 2) : cb;
}

template <int NG, bool Pairs, class T>
static void attn_values_blocked(const float* p, int64_t L, const T* v, int64_t v_stride_pos, const int32_t* idx,
                                int64_t count, int64_t D, float* acc) {
  if constexpr (NG == 1) {
    (void)L;
    return attn_values_single<Pairs>(p, v, v_stride_pos, idx, count, D, acc);
  } else {
    const int64_t blocks = D / kAttnLanes;
    int64_t c0 = 0;
    constexpr int CB = attn_values_chunk_blocks(NG, Pairs);
    for (; c0 + CB <= blocks; c0 += CB) attn_values_chunk<NG, CB, Pairs>(p, L, v, v_stride_pos, idx, count, D, c0, acc);
    if constexpr (Pairs) {  // blocks and CB are even: two blocks or none left
      if (blocks - c0 == 2) attn_values_chunk<NG, 2, true>(p, L, v, v_stride_pos, idx, count, D, c0, acc);
      return;
    } else {
      switch (blocks - c0) {  // fewer than CB blocks left
        case 3: return attn_values_chunk<NG, 3, false>(p, L, v, v_stride_pos, idx, count, D, c0, acc);
        case 2: return attn_values_chunk<NG, 2, false>(p, L, v, v_stride_pos, idx, count, D, c0, acc);
        case 1: return attn_values_chunk<NG, 1, false>(p, L, v, v_stride_pos, idx, count, D, c0, acc);
        default: return;
      }
    }
  }
}

// The same two steps for any head_dim, element by element.
template <class T>
static void attn_scores_plain(const float* qf, int ng, int64_t D, const T* k, int64_t k_stride_pos,
                              const int32_t* idx, int64_t count, float scale, float* s, int64_t L) {
  for (int64_t i = 0; i < count; ++i) {
    const T* kj = k + static_cast<int64_t>(idx[i]) * k_stride_pos;
    for (int n = 0; n < ng; ++n) {
      float dot = 0.0f;
      for (int64_t d = 0; d < D; ++d) dot += qf[n * D + d] * math::to_compute(kj[d], 0.0f);
      s[n * L + i] = dot * scale;
    }
  }
}

template <class T>
static void attn_values_plain(const float* p, int ng, int64_t L, const T* v, int64_t v_stride_pos,
                              const int32_t* idx, int64_t count, int64_t D, float* acc) {
  for (int n = 0; n < ng; ++n) {
    for (int64_t d = 0; d < D; ++d) {
      float a = 0.0f;
      for (int64_t i = 0; i < count; ++i) {
        a += p[n * L + i] * math::to_compute(v[static_cast<int64_t>(idx[i]) * v_stride_pos + d], 0.0f);
      }
      acc[n * D + d] = a;
    }
  }
}

// qf: the ng queries in float32 (in the rows' reading order); q: the same queries as stored (rows
// q_stride_group apart), which the AVX-512 BF16 build multiplies as they are.
template <bool Pairs, class T>
static void attn_scores(int ng, const float* qf, const T* q, int64_t qs, int64_t D, const T* k, int64_t ks, const T* v,
                        int64_t vs, bool prefetch_values, const int32_t* idx, int64_t count, float scale, float* s,
                        int64_t L) {
  if (!Pairs && D % kAttnLanes != 0) return attn_scores_plain(qf, ng, D, k, ks, idx, count, scale, s, L);
  switch (ng) {
    case 1: return attn_scores_blocked<1, Pairs>(qf, q, qs, D, k, ks, v, vs, prefetch_values, idx, count, scale, s, L);
    case 2: return attn_scores_blocked<2, Pairs>(qf, q, qs, D, k, ks, v, vs, prefetch_values, idx, count, scale, s, L);
    case 3: return attn_scores_blocked<3, Pairs>(qf, q, qs, D, k, ks, v, vs, prefetch_values, idx, count, scale, s, L);
    default: return attn_scores_blocked<4, Pairs>(qf, q, qs, D, k, ks, v, vs, prefetch_values, idx, count, scale, s, L);
  }
}

template <bool Pairs, class T>
static void attn_values(int ng, const float* p, int64_t L, const T* v, int64_t vs, const int32_t* idx,
                        int64_t count, int64_t D, float* acc) {
  if (!Pairs && D % kAttnLanes != 0) return attn_values_plain(p, ng, L, v, vs, idx, count, D, acc);
  switch (ng) {
    case 1: return attn_values_blocked<1, Pairs>(p, L, v, vs, idx, count, D, acc);
    case 2: return attn_values_blocked<2, Pairs>(p, L, v, vs, idx, count, D, acc);
    case 3: return attn_values_blocked<3, Pairs>(p, L, v, vs, idx, count, D, acc);
    default: return attn_values_blocked<4, Pairs>(p, L, v, vs, idx, count, D, acc);
  }
}

// Lists the positions j < L with m[j] != 0 in idx; returns how many. Eight mask bytes at a time, so
// that a run of attended (or of skipped) positions, the usual mask, costs one comparison per eight.
static inline int64_t attn_attended_positions(const uint8_t* m, int64_t L, int32_t* idx) {
  constexpr uint64_t kAllAttended = 0x0101010101010101ull;  // eight bool bytes, all true
  int64_t count = 0, j = 0;
  for (; j + 8 <= L; j += 8) {
    uint64_t word;
    std::memcpy(&word, m + j, sizeof word);
    if (word == 0) continue;
    if (word == kAllAttended) {
      for (int t = 0; t < 8; ++t) idx[count + t] = static_cast<int32_t>(j + t);
      count += 8;
      continue;
    }
    for (int t = 0; t < 8; ++t) {
      idx[count] = static_cast<int32_t>(j + t);
      count += m[j + t] != 0;
    }
  }
  for (; j < L; ++j) {
    idx[count] = static_cast<int32_t>(j);
    count += m[j] != 0;
  }
  return count;
}

// Bytes of the next task's first key rows prefetched while a task sums its values (a pass that
// reads only cached rows): the next task starts with its rows on the way instead of waiting on
// memory for each of its first blocks.
constexpr int64_t kAttnNextTaskPrefetchBytes = 6144;

// One (request, key/value head) task; `next_task` is the task this thread runs next (-1: none
// known). scratch: groups * (2 head_dim + length + 1) + length floats (decode_attention_cpu
// allocates it).
//
// bfloat16 rows whose head_dim allows it are read in pair order (attn_load_pair): the queries are
// laid out in that order too, so every score is the same dot product with its terms in another
// order, and the outputs are put back in row order at the end. Each output element's sum over the
// positions runs in the same order either way.
template <bool Pairs, class T>
static void decode_attention_task_in(const DecodeAttentionParams& p, int64_t task, int64_t next_task, float* scratch) {
  const int64_t G = p.groups, D = p.head_dim, L = p.length;
  const int64_t b = task / p.kv_heads, h = task % p.kv_heads;
  const T* q = static_cast<const T*>(p.q) + b * p.q_stride_batch + h * p.q_stride_head;
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride_batch + h * p.k_stride_head;
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride_batch + h * p.v_stride_head;
  T* out = static_cast<T*>(p.out) + task * G * D;
  float* qf = scratch;                                  // [G, D] the queries in float32
  float* acc = qf + G * D;                              // [G, D] the outputs before the division
  float* s = acc + G * D;                               // [G, L] scores, then probabilities
  int32_t* idx = reinterpret_cast<int32_t*>(s + G * L);  // [L] the attended positions
  float* inv = reinterpret_cast<float*>(idx + L);       // [G] 1 / the softmax sums

  const int64_t count = attn_attended_positions(p.mask + b * p.mask_stride_batch, L, idx);
  if (count == 0) {
    for (int64_t i = 0; i < G * D; ++i) out[i] = math::Store<T>::from(0.0f);
    return;
  }
  float* q_rows = Pairs ? acc : qf;  // in pair order, acc holds the queries in row order first
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = q + g * p.q_stride_group;
    for (int64_t d = 0; d < D; ++d) q_rows[g * D + d] = math::to_compute(qg[d], 0.0f);
  }
  if constexpr (Pairs) attn_to_pair_order(acc, G, D, qf);
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int ng = static_cast<int>(G - g0 < 4 ? G - g0 : 4);
    attn_scores<Pairs>(ng, qf + g0 * D, q + g0 * p.q_stride_group, p.q_stride_group, D, k, p.k_stride_pos, v,
                       p.v_stride_pos, g0 == 0, idx, count, p.scale, s + g0 * L, L);
  }
  for (int64_t g = 0; g < G; ++g) {  // softmax numerators; the sum divides the output
    float* sg = s + g * L;
    float mx = sg[0];
#pragma omp simd reduction(max : mx)
    for (int64_t i = 1; i < count; ++i) mx = sg[i] > mx ? sg[i] : mx;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < count; ++i) {
      const float e = math::exp_fast(sg[i] - mx);
      sg[i] = e;
      sum += e;
    }
    inv[g] = 1.0f / sum;
  }
  if (next_task >= 0) {  // the next task's first attended key rows (the same request's: these positions)
    const int64_t next_b = next_task / p.kv_heads;
    const T* next_k =
        static_cast<const T*>(p.k) + next_b * p.k_stride_batch + (next_task % p.kv_heads) * p.k_stride_head;
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
    const int64_t budget = kAttnNextTaskPrefetchBytes / row_bytes;
    if (next_b == b) {
      for (int64_t i = 0; i < count && i < budget; ++i) attn_prefetch_row(next_k + idx[i] * p.k_stride_pos, row_bytes);
    } else {
      for (int64_t j = 0; j < L && j < budget; ++j) attn_prefetch_row(next_k + j * p.k_stride_pos, row_bytes);
    }
  }
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int ng = static_cast<int>(G - g0 < 4 ? G - g0 : 4);
    attn_values<Pairs>(ng, s + g0 * L, L, v, p.v_stride_pos, idx, count, D, acc + g0 * D);
  }
  if constexpr (Pairs) {  // the queries are no longer needed: their buffer takes the outputs in row order
    attn_from_pair_order(acc, G, D, qf);
    acc = qf;
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = math::Store<T>::from(acc[g * D + d] * inv[g]);
  }
}

template <class T>
static void decode_attention_task(const DecodeAttentionParams& p, int64_t task, int64_t next_task, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    decode_attention_task_in<false, T>(p, task, next_task, scratch);
  } else if (attn_pair_order<T>(p.head_dim)) {
    decode_attention_task_in<true, T>(p, task, next_task, scratch);
  } else {
    decode_attention_task_in<false, T>(p, task, next_task, scratch);
  }
}

static inline void fill_decode_attention(KernelTable& table) {
  table.decode_attention[static_cast<int>(DType::kFloat32)] = &decode_attention_task<float>;
  table.decode_attention[static_cast<int>(DType::kBFloat16)] = &decode_attention_task<math::BFloat16>;
}

}  // namespace FR_ISA_NAMESPACE
}  // namespace cpu
}  // namespace flashreinforce
