// Template implementation of the CPU entropy filter (docs/semantics.md step 5): entropy validation
// and the per-trajectory selection of the kept tokens, written as 1 / 0 flags into the gradient
// buffer for the main pass. Included by the per-instruction-set TUs like main_pass_impl.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>
#include <vector>

#include "flashreinforce/core.h"
#include "flashreinforce/token_math.h"
#include "main_pass.h"
#include "thread_pool.h"

namespace flashreinforce {
namespace cpu {
namespace FR_ISA_NAMESPACE {


template <class E> using KeyOf = typename math::EntropyKey<E>::type;

// A token of the threshold bin: its key and position. A type of this namespace rather than
// std::pair, so that the containers and algorithms instantiated for it are this file's own
// (main_pass.h).
template <class K> struct Candidate {
  K key;
  int64_t pos;
};
template <class E> using ValueOf = typename math::EntropyKey<E>::value;

template <class E> static KeyOf<E> key_at(const E* e, int64_t t) {
  return math::entropy_key(static_cast<ValueOf<E>>(math::to_compute(e[t], ValueOf<E>())));
}

// Keys of the tokens [a, a + len) (len <= kKeyBlock) into `keys`; tokens off the policy get the
// key 0, which no finite entropy has (it is the key of a NaN bit pattern), so it sorts below every
// policy token and never matches a threshold prefix. Vectorizable: no branch, no library call.
constexpr int64_t kKeyBlock = 2048;

template <class E>
static void block_keys(const E* __restrict e, const uint8_t* __restrict mask, int64_t a, int64_t len,
                KeyOf<E>* __restrict keys) {
  if (mask) {
    // The key of every token, then the select: a load under the condition would need masked loads
    // to vectorize (AVX2 has them; SSE2 and NEON do not).
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
      const KeyOf<E> key = key_at(e, a + j);
      keys[j] = mask[a + j] ? key : KeyOf<E>(0);
    }
  } else {
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) keys[j] = key_at(e, a + j);
  }
}

// First policy token (in [c0, c1)) whose entropy is not finite, or -1.
template <class E>
static int64_t first_bad_entropy(const E* e, const uint8_t* mask, int64_t c0, int64_t c1) {
  using V = ValueOf<E>;
  int bad = 0;
  if (mask) {
#pragma omp simd reduction(| : bad)
    for (int64_t t = c0; t < c1; ++t) {
      const V v = math::to_compute(e[t], V());
      bad |= static_cast<int>((mask[t] != 0) & !(v - v == V(0)));
    }
  } else {
#pragma omp simd reduction(| : bad)
    for (int64_t t = c0; t < c1; ++t) {
      const V v = math::to_compute(e[t], V());
      bad |= static_cast<int>(!(v - v == V(0)));
    }
  }
  if (!bad) return -1;
  for (int64_t t = c0; t < c1; ++t) {
    const V v = math::to_compute(e[t], V());
    if ((!mask || mask[t]) && !(v - v == V(0))) return t;
  }
  return -1;
}

// The kept tokens of a failed trajectory [a, b) with k of its T policy tokens kept (0 < k < T)
// are exactly those whose (key, -position) is >= (key*, -pos*) lexicographically, where
// (key*, pos*) is the k-th largest. Found with a radix select on the key's top bits; the
// candidates of the threshold bin are then ordered exactly (nth_element) when they are few, or
// the radix passes continue and the ties are resolved by position when they are many.
template <class E>
static Candidate<KeyOf<E>> select_threshold(const E* e, const uint8_t* mask, int64_t a, int64_t b, int64_t k,
                                            std::vector<Candidate<KeyOf<E>>>& scratch) {
  using K = KeyOf<E>;
  constexpr int kBits = 11;
  constexpr int kKeyBits = static_cast<int>(sizeof(K) * 8);
  constexpr size_t kScratchMax = 1 << 16;  // bounded scratch, independent of N
  constexpr int kBins = 1 << kBits;
  int64_t hist[kBins + 1];  // + the discard bin
  K keys[kKeyBlock];
  uint32_t digits[kKeyBlock];
  // Range of the policy keys: the first digit starts below their common leading bits, so the
  // 2048 bins spread over the values actually present (entropies share their top exponent bits).
  K kmin = std::numeric_limits<K>::max(), kmax = 0;
  for (int64_t blk = a; blk < b; blk += kKeyBlock) {
    const int64_t len = std::min(kKeyBlock, b - blk);
    block_keys(e, mask, blk, len, keys);
#pragma omp simd reduction(min : kmin) reduction(max : kmax)
    for (int64_t j = 0; j < len; ++j) {
      kmax = keys[j] > kmax ? keys[j] : kmax;
      const K v = keys[j] == K(0) ? std::numeric_limits<K>::max() : keys[j];  // skip sentinels
      kmin = v < kmin ? v : kmin;
    }
  }
  if (kmin == kmax) {
    // Every policy entropy is equal: keep the first k policy tokens.
    int64_t seen = 0;
    for (int64_t t = a; t < b; ++t) {
      if ((!mask || mask[t]) && ++seen == k) return {kmin, t};
    }
    return {kmin, b - 1};  // unreachable: k <= T
  }
  const K diff = static_cast<K>(kmin ^ kmax);
  const int common = sizeof(K) == 8 ? __builtin_clzll(static_cast<unsigned long long>(diff))
                                     : __builtin_clz(static_cast<unsigned int>(diff));
  int fixed_bits = common;  // number of fixed top bits
  K prefix = fixed_bits > 0 ? static_cast<K>(kmin >> (kKeyBits - fixed_bits)) : K(0);
  int shift = kKeyBits - fixed_bits - kBits;
  int64_t remaining = k;
  for (;;) {
    std::fill(std::begin(hist), std::end(hist), 0);
    const int width = shift >= 0 ? kBits : kBits + shift;
    const int low = shift >= 0 ? shift : 0;
    const K digit_mask = static_cast<K>((K(1) << width) - 1);
    // Non-policy tokens carry the key 0; it passes the prefix test only while the prefix is 0, and
    // then lands in bin 0, where no policy key can be (the top 11 bits of a finite entropy's key
    // are never all 0).
    const bool sentinels_in_bin0 = prefix == K(0);
    for (int64_t blk = a; blk < b; blk += kKeyBlock) {
      const int64_t len = std::min(kKeyBlock, b - blk);
      block_keys(e, mask, blk, len, keys);
      // Digits in a vectorized loop (tokens outside the prefix go to the discard bin kBins),
      // then a plain increment loop.
      const int prefix_shift = kKeyBits - fixed_bits;  // == kKeyBits when nothing is fixed
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) {
        const K key = keys[j];
        const bool in_prefix = prefix_shift >= kKeyBits || (key >> (prefix_shift & (kKeyBits - 1))) == prefix;
        digits[j] = in_prefix ? static_cast<uint32_t>((key >> low) & digit_mask) : static_cast<uint32_t>(kBins);
      }
      for (int64_t j = 0; j < len; ++j) ++hist[digits[j]];
    }
    if (sentinels_in_bin0) hist[0] = 0;
    int64_t above = 0;
    int64_t bin = (int64_t(1) << width) - 1;
    for (; bin > 0; --bin) {
      if (above + hist[bin] >= remaining) break;
      above += hist[bin];
    }
    remaining -= above;
    const int64_t in_bin = hist[bin];
    prefix = static_cast<K>((fixed_bits > 0 ? (prefix << width) : K(0)) | static_cast<K>(bin));
    fixed_bits += width;
    const int free_bits = kKeyBits - fixed_bits;
    if (in_bin == remaining) {
      // Every token of the bin is kept: the threshold is the bin's smallest key, no position cut.
      const K lowest = free_bits > 0 ? static_cast<K>(prefix << free_bits) : prefix;
      return {lowest, std::numeric_limits<int64_t>::max()};
    }
    if (free_bits == 0) {
      // Ties on the full key: keep the first `remaining` of them by position.
      int64_t seen = 0;
      for (int64_t t = a; t < b; ++t) {
        if (mask && !mask[t]) continue;
        if (key_at(e, t) == prefix && ++seen == remaining) return {prefix, t};
      }
      return {prefix, b - 1};  // unreachable: the bin holds at least `remaining` ties
    }
    if (static_cast<size_t>(in_bin) <= kScratchMax) {
      scratch.clear();
      for (int64_t blk = a; blk < b; blk += kKeyBlock) {
        const int64_t len = std::min(kKeyBlock, b - blk);
        block_keys(e, mask, blk, len, keys);
        for (int64_t j = 0; j < len; ++j) {
          if ((keys[j] >> free_bits) == prefix) scratch.push_back(Candidate<K>{keys[j], blk + j});
        }
      }
      auto before = [](const Candidate<K>& x, const Candidate<K>& y) {
        return x.key != y.key ? x.key > y.key : x.pos < y.pos;
      };
      std::nth_element(scratch.begin(), scratch.begin() + (remaining - 1), scratch.end(), before);
      return scratch[remaining - 1];
    }
    shift -= kBits;
  }
}

// Writes 1 (kept) or 0 into grad over [a, b) for the selection (key*, pos*).
template <class E, class LP>
static void write_keep_flags(const E* e, const uint8_t* mask, LP* __restrict grad, int64_t a, int64_t b,
                      KeyOf<E> key_star, int64_t pos_star) {
  const LP one = math::Store<LP>::from(1.0f), zero = math::Store<LP>::from(0.0f);
  KeyOf<E> keys[kKeyBlock];
  for (int64_t blk = a; blk < b; blk += kKeyBlock) {
    const int64_t len = std::min(kKeyBlock, b - blk);
    block_keys(e, mask, blk, len, keys);  // non-policy tokens get key 0 < key*: not kept
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
      const KeyOf<E> key = keys[j];
      const bool kept = (key > key_star) | ((key == key_star) & (blk + j <= pos_star));
      grad[blk + j] = kept ? one : zero;
    }
  }
}

template <class E, class LP>
static void select_and_flag(const LossParams& p, const std::vector<int64_t>& cu,
                     const std::vector<int64_t>& selected, const std::vector<int64_t>& keep_count,
                     int num_threads) {
  using K = KeyOf<E>;
  const E* e = p.entropies.as<const E>();
  const uint8_t* mask = p.action_mask.as<const uint8_t>();
  LP* grad = p.grad.as<LP>();
  parallel_for(num_threads, static_cast<int64_t>(selected.size()), [&](int64_t j) {
    thread_local std::vector<Candidate<K>> scratch;
    const int64_t i = selected[j];
    const auto star = select_threshold<E>(e, mask, cu[i], cu[i + 1], keep_count[i], scratch);
    write_keep_flags<E, LP>(e, mask, grad, cu[i], cu[i + 1], star.key, star.pos);
    if (scratch.capacity() > (1u << 16)) std::vector<Candidate<K>>().swap(scratch);
  });
}

template <class E>
static int64_t check_entropies(const LossParams& p, int num_threads) {
  const int64_t n = p.num_tokens();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<int64_t> bad(chunks, -1);
  const E* e = p.entropies.as<const E>();
  const uint8_t* mask = p.action_mask.as<const uint8_t>();
  parallel_for(num_threads, chunks, [&](int64_t c) {
    const int64_t c0 = c * kChunk, c1 = std::min(n, c0 + kChunk);
    bad[c] = first_bad_entropy<E>(e, mask, c0, c1);
  });
  for (int64_t c = 0; c < chunks; ++c) {
    if (bad[c] >= 0) return bad[c];
  }
  return -1;
}


template <class E>
static void fill_filter_row(KernelTable& table) {
  const int e = static_cast<int>(DTypeOf<E>::value);
  table.select[e][static_cast<int>(DType::kFloat16)] = &select_and_flag<E, math::Half>;
  table.select[e][static_cast<int>(DType::kBFloat16)] = &select_and_flag<E, math::BFloat16>;
  table.select[e][static_cast<int>(DType::kFloat32)] = &select_and_flag<E, float>;
  table.select[e][static_cast<int>(DType::kFloat64)] = &select_and_flag<E, double>;
  table.check_entropies[e] = &check_entropies<E>;
}

static void fill_filter(KernelTable& table) {
  fill_filter_row<math::Half>(table);
  fill_filter_row<math::BFloat16>(table);
  fill_filter_row<float>(table);
  fill_filter_row<double>(table);
}

}  // namespace FR_ISA_NAMESPACE
}  // namespace cpu
}  // namespace flashreinforce
