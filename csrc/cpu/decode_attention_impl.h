// Template implementation of the CPU decode-step attention (flashreinforce/decode_attention.h).
// Included by main_pass_generic.cpp, main_pass_avx2.cpp and main_pass_avx512.cpp inside different
// namespaces, like the main pass (see main_pass.h): every function here has internal linkage and no
// standard-library container is used, so nothing is emitted as a symbol those files could share.
//
// One task is one (request, key/value head) pair; its keys and values are read once from memory.
// 1. The attended positions are listed (the mask is read once; no branch in the loops after it).
// 2. Scores: the dot products of each query with a block of as many key rows as a vector register
//    has lanes (GCC/Clang vector extensions: 16 floats with AVX-512, 8 with AVX2, 4 otherwise), the
//    rows' sums transposed into one register; each key row's value row is prefetched meanwhile.
// 3. Softmax per query, with the core's vectorizable float32 exponential.
// 4. Output: the probability-weighted sum of the value rows, each value row read (and converted from
//    bfloat16) once for all the queries of its group, one accumulator per query and register block
//    (a single query: four accumulators per block over the rows instead).
// A head_dim that is not a multiple of the register width takes plain loops with the same arithmetic order per
// output element. All sums are float32, in an order fixed by the sizes (never by the threads).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

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

#ifdef FR_ATTN_TRANSPOSED_SUMS
// A bfloat16 block of key rows is converted to float32 once for all the queries of its group when
// head_dim is at most this (the block lives on the stack: kAttnLanes * 256 floats, 16 KiB with AVX-512).
constexpr int64_t kAttnMaxConvertedDim = 256;

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
#endif

// Scores of NG queries (qf rows, already float32) against the listed key rows: s[n * L + i] for the
// i-th attended position. The value row of each key row is prefetched on the way, so that the
// values pass finds it in cache.
template <int NG, class T>
static void attn_scores_blocked(const float* qf, int64_t D, const T* k, int64_t k_stride_pos, const T* v,
                                int64_t v_stride_pos, bool prefetch_values, const int32_t* idx, int64_t count,
                                float scale, float* s, int64_t L) {
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
    if constexpr (!std::is_same_v<T, float> && NG > 1) {
      // bfloat16 rows scored by more than one query: converted to float32 once, into a block that
      // stays in L1, instead of once per query.
      if (D <= kAttnMaxConvertedDim) {
        alignas(64) float converted[kAttnLanes * kAttnMaxConvertedDim];
        const float* crows[kAttnLanes];
        for (int r = 0; r < kAttnLanes; ++r) {
          float* dst = converted + r * D;
          for (int64_t c = 0; c < blocks; ++c) {
            const AttnVec x = attn_load(rows[r] + kAttnLanes * c);
            std::memcpy(dst + kAttnLanes * c, &x, sizeof x);
          }
          crows[r] = dst;
        }
        attn_block_scores<NG>(qf, D, crows, scale, s + i, L);
        continue;
      }
    }
    attn_block_scores<NG>(qf, D, rows, scale, s + i, L);
  }
#endif
  for (; i < count; ++i) {
    const T* kj = k + static_cast<int64_t>(idx[i]) * k_stride_pos;
    if (prefetch_values) attn_prefetch_row(v + static_cast<int64_t>(idx[i]) * v_stride_pos, row_bytes);
    AttnVec acc[NG];
    for (int n = 0; n < NG; ++n) acc[n] = AttnVec{};
    for (int64_t c = 0; c < blocks; ++c) {
      const AttnVec kc = attn_load(kj + kAttnLanes * c);
      for (int n = 0; n < NG; ++n) acc[n] += attn_load(qf + n * D + kAttnLanes * c) * kc;
    }
    for (int n = 0; n < NG; ++n) s[n * L + i] = attn_hsum(acc[n]) * scale;
  }
}

// out[n, :] = sum_i p[n * L + i] * v[idx[i], :] for NG queries, block by block: one accumulator per
// query and register block of the head dimension (CB blocks at a time, see attn_values_chunk_blocks),
// every value row read and converted once per chunk of blocks for all NG queries (not once per
// query), and the rows added in position order.
template <int NG, int CB, class T>
static inline void attn_values_chunk(const float* p, int64_t L, const T* v, int64_t v_stride_pos, const int32_t* idx,
                                     int64_t count, int64_t D, int64_t c0, float* acc) {
  AttnVec a[NG][CB];
  for (int n = 0; n < NG; ++n) {
    for (int c = 0; c < CB; ++c) a[n][c] = AttnVec{};
  }
  for (int64_t i = 0; i < count; ++i) {
    const T* row = v + static_cast<int64_t>(idx[i]) * v_stride_pos + kAttnLanes * c0;
    AttnVec vc[CB];
    for (int c = 0; c < CB; ++c) vc[c] = attn_load(row + kAttnLanes * c);
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
template <class T>
static void attn_values_single(const float* p, const T* v, int64_t v_stride_pos, const int32_t* idx, int64_t count,
                               int64_t D, float* acc) {
  const int64_t blocks = D / kAttnLanes;
  for (int64_t c = 0; c < blocks; ++c) {
    AttnVec a0{}, a1{}, a2{}, a3{};
    int64_t i = 0;
    for (; i + 4 <= count; i += 4) {
      a0 += p[i] * attn_load(v + static_cast<int64_t>(idx[i]) * v_stride_pos + kAttnLanes * c);
      a1 += p[i + 1] * attn_load(v + static_cast<int64_t>(idx[i + 1]) * v_stride_pos + kAttnLanes * c);
      a2 += p[i + 2] * attn_load(v + static_cast<int64_t>(idx[i + 2]) * v_stride_pos + kAttnLanes * c);
      a3 += p[i + 3] * attn_load(v + static_cast<int64_t>(idx[i + 3]) * v_stride_pos + kAttnLanes * c);
    }
    for (; i < count; ++i) a0 += p[i] * attn_load(v + static_cast<int64_t>(idx[i]) * v_stride_pos + kAttnLanes * c);
    const AttnVec total = (a0 + a1) + (a2 + a3);
    std::memcpy(acc + kAttnLanes * c, &total, sizeof total);
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
// (AVX-512: 4 for every NG; AVX2: 4 for two queries, 3 for three or four). Each output element's
// sum runs over the rows in the same order whatever CB is.
constexpr int attn_values_chunk_blocks(int ng) {
  int cb = 4;
  while (cb > 1 && ng * cb + cb + 1 > kAttnVectorRegisters) --cb;
  return cb;
}

template <int NG, class T>
static void attn_values_blocked(const float* p, int64_t L, const T* v, int64_t v_stride_pos, const int32_t* idx,
                                int64_t count, int64_t D, float* acc) {
  if constexpr (NG == 1) {
    (void)L;
    return attn_values_single(p, v, v_stride_pos, idx, count, D, acc);
  } else {
    const int64_t blocks = D / kAttnLanes;
    int64_t c0 = 0;
    constexpr int CB = attn_values_chunk_blocks(NG);
    for (; c0 + CB <= blocks; c0 += CB) attn_values_chunk<NG, CB>(p, L, v, v_stride_pos, idx, count, D, c0, acc);
    switch (blocks - c0) {  // fewer than CB blocks left
      case 3: return attn_values_chunk<NG, 3>(p, L, v, v_stride_pos, idx, count, D, c0, acc);
      case 2: return attn_values_chunk<NG, 2>(p, L, v, v_stride_pos, idx, count, D, c0, acc);
      case 1: return attn_values_chunk<NG, 1>(p, L, v, v_stride_pos, idx, count, D, c0, acc);
      default: return;
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

template <class T>
static void attn_scores(int ng, const float* qf, int64_t D, const T* k, int64_t ks, const T* v, int64_t vs,
                        bool prefetch_values, const int32_t* idx, int64_t count, float scale, float* s, int64_t L) {
  if (D % kAttnLanes != 0) return attn_scores_plain(qf, ng, D, k, ks, idx, count, scale, s, L);
  switch (ng) {
    case 1: return attn_scores_blocked<1>(qf, D, k, ks, v, vs, prefetch_values, idx, count, scale, s, L);
    case 2: return attn_scores_blocked<2>(qf, D, k, ks, v, vs, prefetch_values, idx, count, scale, s, L);
    case 3: return attn_scores_blocked<3>(qf, D, k, ks, v, vs, prefetch_values, idx, count, scale, s, L);
    default: return attn_scores_blocked<4>(qf, D, k, ks, v, vs, prefetch_values, idx, count, scale, s, L);
  }
}

template <class T>
static void attn_values(int ng, const float* p, int64_t L, const T* v, int64_t vs, const int32_t* idx,
                        int64_t count, int64_t D, float* acc) {
  if (D % kAttnLanes != 0) return attn_values_plain(p, ng, L, v, vs, idx, count, D, acc);
  switch (ng) {
    case 1: return attn_values_blocked<1>(p, L, v, vs, idx, count, D, acc);
    case 2: return attn_values_blocked<2>(p, L, v, vs, idx, count, D, acc);
    case 3: return attn_values_blocked<3>(p, L, v, vs, idx, count, D, acc);
    default: return attn_values_blocked<4>(p, L, v, vs, idx, count, D, acc);
  }
}

// One (request, key/value head) task. scratch: groups * (2 head_dim + length + 1) + length floats
// (decode_attention_cpu allocates it).
template <class T>
static void decode_attention_task(const DecodeAttentionParams& p, int64_t task, float* scratch) {
  const int64_t G = p.groups, D = p.head_dim, L = p.length;
  const int64_t b = task / p.kv_heads, h = task % p.kv_heads;
  const T* q = static_cast<const T*>(p.q) + b * p.q_stride_batch + h * p.q_stride_head;
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride_batch + h * p.k_stride_head;
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride_batch + h * p.v_stride_head;
  const uint8_t* m = p.mask + b * p.mask_stride_batch;
  T* out = static_cast<T*>(p.out) + task * G * D;
  float* qf = scratch;                                  // [G, D] the queries in float32
  float* acc = qf + G * D;                              // [G, D] the outputs before the division
  float* s = acc + G * D;                               // [G, L] scores, then probabilities
  int32_t* idx = reinterpret_cast<int32_t*>(s + G * L);  // [L] the attended positions
  float* inv = reinterpret_cast<float*>(idx + L);       // [G] 1 / the softmax sums

  int64_t count = 0;
  for (int64_t j = 0; j < L; ++j) {
    idx[count] = static_cast<int32_t>(j);
    count += m[j] != 0;
  }
  if (count == 0) {
    for (int64_t i = 0; i < G * D; ++i) out[i] = math::Store<T>::from(0.0f);
    return;
  }
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = q + g * p.q_stride_group;
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = math::to_compute(qg[d], 0.0f);
  }
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int ng = static_cast<int>(G - g0 < 4 ? G - g0 : 4);
    attn_scores(ng, qf + g0 * D, D, k, p.k_stride_pos, v, p.v_stride_pos, g0 == 0, idx, count, p.scale, s + g0 * L, L);
  }
  for (int64_t g = 0; g < G; ++g) {  // softmax numerators; the sum divides the output
    float* sg = s + g * L;
    float mx = sg[0];
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
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int ng = static_cast<int>(G - g0 < 4 ? G - g0 : 4);
    attn_values(ng, s + g0 * L, L, v, p.v_stride_pos, idx, count, D, acc + g0 * D);
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = math::Store<T>::from(acc[g * D + d] * inv[g]);
  }
}

static inline void fill_decode_attention(KernelTable& table) {
  table.decode_attention[static_cast<int>(DType::kFloat32)] = &decode_attention_task<float>;
  table.decode_attention[static_cast<int>(DType::kBFloat16)] = &decode_attention_task<math::BFloat16>;
}

}  // namespace FR_ISA_NAMESPACE
}  // namespace cpu
}  // namespace flashreinforce
