// CPU path of the fused FlashREINFORCE loss (driver). See docs/kernel.md for the design:
//   1. offsets: validate cu_seqlens (or build the padded ones), count T_i from the mask;
//   2. per trajectory: advantages, loss scale, keep mode of the entropy filter;
//   3. filter: validate entropies, select the kept tokens of each failed trajectory by a radix
//      select on order-preserving keys, and write keep flags (1 / 0) into the gradient buffer;
//   4. main pass over fixed chunks (main_pass_impl.h): KL sums, validation, gradient, loss terms;
//   5. combine the per-chunk partial sums in a fixed order, gate, zero rejected trajectories.
// No temporary buffer proportional to N is allocated: only O(B + N / kChunk) bookkeeping and a
// small per-thread scratch for the filter's candidate tokens.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "flashreinforce/core.h"
#include "flashreinforce/token_math.h"
#include "main_pass.h"
#include "thread_pool.h"

namespace flashreinforce {
namespace cpu {
namespace {

using math::BFloat16;
using math::Half;

double load_double(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat16: return math::half_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kBFloat16: return math::bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kFloat32: return static_cast<const float*>(p)[i];
    case DType::kFloat64: return static_cast<const double*>(p)[i];
    case DType::kInt32: return static_cast<const int32_t*>(p)[i];
    case DType::kInt64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::kBool:
    case DType::kUInt8: return static_cast<const uint8_t*>(p)[i];
    case DType::kInt8: return static_cast<const int8_t*>(p)[i];
    case DType::kInt16: return static_cast<const int16_t*>(p)[i];
  }
  return 0.0;
}

void store_compute(void* p, DType compute, int64_t i, double v) {
  if (compute == DType::kFloat64) {
    static_cast<double*>(p)[i] = v;
  } else {
    static_cast<float*>(p)[i] = static_cast<float>(v);
  }
}

double round_to_compute(DType compute, double v) {
  return compute == DType::kFloat64 ? v : static_cast<double>(static_cast<float>(v));
}

int64_t num_chunks(int64_t n) { return (n + kChunk - 1) / kChunk; }

// Trajectory containing token t (the last i with cu[i] <= t).
int64_t segment_of(const std::vector<int64_t>& cu, int64_t t) {
  return static_cast<int64_t>(std::upper_bound(cu.begin(), cu.end(), t) - cu.begin()) - 1;
}

// ---------------------------------------------------------------------------------------------
// Policy-token counts T_i from the mask: per chunk, the same body/head split as the main pass.
void count_policy_tokens(const uint8_t* mask, const std::vector<int64_t>& cu, int64_t n,
                         int num_threads, std::vector<int64_t>& counts) {
  const int64_t b = static_cast<int64_t>(cu.size()) - 1;
  const int64_t chunks = num_chunks(n);
  std::vector<int64_t> head_seg(chunks, -1), head_count(chunks, 0);
  counts.assign(b, 0);
  parallel_for(num_threads, chunks, [&](int64_t c) {
    const int64_t c0 = c * kChunk, c1 = std::min(n, c0 + kChunk);
    int64_t seg = segment_of(cu, c0);
    int64_t t = c0;
    while (t < c1) {
      while (cu[seg + 1] <= t) ++seg;
      const int64_t end = std::min(cu[seg + 1], c1);
      int64_t sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t u = t; u < end; ++u) sum += mask[u] != 0;
      if (cu[seg] >= c0) {
        counts[seg] = sum;
      } else {
        head_seg[c] = seg;
        head_count[c] = sum;
      }
      t = end;
    }
  });
  for (int64_t c = 0; c < chunks; ++c) {
    if (head_seg[c] >= 0) counts[head_seg[c]] += head_count[c];
  }
}

// ---------------------------------------------------------------------------------------------
// Entropy filter.

template <class E> using KeyOf = typename math::EntropyKey<E>::type;
template <class E> using ValueOf = typename math::EntropyKey<E>::value;

template <class E> KeyOf<E> key_at(const E* e, int64_t t) {
  return math::entropy_key(static_cast<ValueOf<E>>(math::to_compute(e[t], ValueOf<E>())));
}

// First policy token (in [c0, c1)) whose entropy is not finite, or -1.
template <class E>
int64_t first_bad_entropy(const E* e, const uint8_t* mask, int64_t c0, int64_t c1) {
  using V = ValueOf<E>;
  int bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t t = c0; t < c1; ++t) {
    const V v = math::to_compute(e[t], V());
    bad |= static_cast<int>((!mask || mask[t]) & !(v - v == V(0)));
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
std::pair<KeyOf<E>, int64_t> select_threshold(const E* e, const uint8_t* mask, int64_t a,
                                              int64_t b, int64_t k,
                                              std::vector<std::pair<KeyOf<E>, int64_t>>& scratch) {
  using K = KeyOf<E>;
  constexpr int kBits = 11;
  constexpr int kKeyBits = static_cast<int>(sizeof(K) * 8);
  constexpr size_t kScratchMax = 1 << 16;  // bounded scratch, independent of N
  std::vector<int64_t> hist(size_t(1) << kBits);
  int shift = kKeyBits - kBits;
  K prefix = 0;       // digits above `shift + kBits` fixed so far
  int fixed_bits = 0;  // number of fixed top bits
  int64_t remaining = k;
  for (;;) {
    std::fill(hist.begin(), hist.end(), 0);
    const int width = shift >= 0 ? kBits : kBits + shift;
    const int low = shift >= 0 ? shift : 0;
    const K digit_mask = static_cast<K>((K(1) << width) - 1);
    for (int64_t t = a; t < b; ++t) {
      if (mask && !mask[t]) continue;
      const K key = key_at(e, t);
      if (fixed_bits > 0 && (key >> (kKeyBits - fixed_bits)) != prefix) continue;
      ++hist[(key >> low) & digit_mask];
    }
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
      for (int64_t t = a; t < b; ++t) {
        if (mask && !mask[t]) continue;
        const K key = key_at(e, t);
        if ((key >> free_bits) == prefix) scratch.emplace_back(key, t);
      }
      auto before = [](const std::pair<K, int64_t>& x, const std::pair<K, int64_t>& y) {
        return x.first != y.first ? x.first > y.first : x.second < y.second;
      };
      std::nth_element(scratch.begin(), scratch.begin() + (remaining - 1), scratch.end(), before);
      return scratch[remaining - 1];
    }
    shift -= kBits;
  }
}

// Writes 1 (kept) or 0 into grad over [a, b) for the selection (key*, pos*).
template <class E, class LP>
void write_keep_flags(const E* e, const uint8_t* mask, LP* grad, int64_t a, int64_t b,
                      KeyOf<E> key_star, int64_t pos_star) {
  const LP one = math::Store<LP>::from(1.0f), zero = math::Store<LP>::from(0.0f);
  for (int64_t t = a; t < b; ++t) {
    const KeyOf<E> key = key_at(e, t);
    const bool kept = (!mask || mask[t]) && (key > key_star || (key == key_star && t <= pos_star));
    grad[t] = kept ? one : zero;
  }
}

template <class E, class LP>
void select_and_flag(const LossInputs& in, const std::vector<int64_t>& cu,
                     const std::vector<int64_t>& selected, const std::vector<int64_t>& keep_count,
                     void* grad, int num_threads) {
  using K = KeyOf<E>;
  const E* e = static_cast<const E*>(in.entropies);
  parallel_for(num_threads, static_cast<int64_t>(selected.size()), [&](int64_t j) {
    thread_local std::vector<std::pair<K, int64_t>> scratch;
    const int64_t i = selected[j];
    const auto star = select_threshold<E>(e, in.action_mask, cu[i], cu[i + 1], keep_count[i], scratch);
    write_keep_flags<E, LP>(e, in.action_mask, static_cast<LP*>(grad), cu[i], cu[i + 1], star.first,
                            star.second);
    if (scratch.capacity() > (1u << 16)) std::vector<std::pair<K, int64_t>>().swap(scratch);
  });
}

template <class E>
void select_dispatch_lp(const LossInputs& in, const std::vector<int64_t>& cu,
                        const std::vector<int64_t>& selected, const std::vector<int64_t>& keep_count,
                        void* grad, int num_threads) {
  switch (in.log_probs_dtype) {
    case DType::kFloat16: return select_and_flag<E, Half>(in, cu, selected, keep_count, grad, num_threads);
    case DType::kBFloat16: return select_and_flag<E, BFloat16>(in, cu, selected, keep_count, grad, num_threads);
    case DType::kFloat32: return select_and_flag<E, float>(in, cu, selected, keep_count, grad, num_threads);
    default: return select_and_flag<E, double>(in, cu, selected, keep_count, grad, num_threads);
  }
}

template <class E>
int64_t check_entropies(const LossInputs& in, int num_threads) {
  const int64_t chunks = num_chunks(in.num_tokens);
  std::vector<int64_t> bad(chunks, -1);
  const E* e = static_cast<const E*>(in.entropies);
  parallel_for(num_threads, chunks, [&](int64_t c) {
    const int64_t c0 = c * kChunk, c1 = std::min(in.num_tokens, c0 + kChunk);
    bad[c] = first_bad_entropy<E>(e, in.action_mask, c0, c1);
  });
  for (int64_t c = 0; c < chunks; ++c) {
    if (bad[c] >= 0) return bad[c];
  }
  return -1;
}

const MainPassTable& best_table_for(DType lp, DType blp) {
  const int i = static_cast<int>(lp), j = static_cast<int>(blp);
#if defined(__x86_64__) || defined(__i386__)
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                             __builtin_cpu_supports("fma");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx512 && main_pass_avx512() && main_pass_avx512()->fn[i][j]) return *main_pass_avx512();
  if (avx2 && main_pass_avx2() && main_pass_avx2()->fn[i][j]) return *main_pass_avx2();
#endif
  (void)i;
  (void)j;
  return main_pass_generic();
}

Error make_error(ErrorCode code, int64_t index, double value = 0.0) {
  Error e;
  e.code = code;
  e.index = index;
  e.value = value;
  return e;
}

}  // namespace

// Name of the instruction set the CPU main pass uses for float32 inputs on this machine.
const char* cpu_isa_name() {
  const MainPassTable& t = best_table_for(DType::kFloat32, DType::kFloat32);
  if (main_pass_avx512() && &t == main_pass_avx512()) return "avx512";
  if (main_pass_avx2() && &t == main_pass_avx2()) return "avx2";
  return "generic";
}

}  // namespace cpu

Error loss_forward_cpu(const LossInputs& in, const LossOutputs& out, int num_threads) {
  using namespace cpu;
  const int64_t n = in.num_tokens, b = in.batch;
  num_threads = std::max(1, num_threads);
  const DType compute = compute_dtype(in.log_probs_dtype);

  // 1. Offsets.
  std::vector<int64_t> cu(b + 1);
  if (in.cu_seqlens == nullptr) {
    for (int64_t i = 0; i <= b; ++i) cu[i] = i * in.padded_row_length;
  } else if (in.cu_dtype == DType::kInt32) {
    const int32_t* c = static_cast<const int32_t*>(in.cu_seqlens);
    for (int64_t i = 0; i <= b; ++i) cu[i] = c[i];
  } else {
    std::memcpy(cu.data(), in.cu_seqlens, sizeof(int64_t) * (b + 1));
  }
  if (cu[0] != 0) return make_error(ErrorCode::kBadCuSeqlens, 0, static_cast<double>(cu[0]));
  for (int64_t i = 0; i < b; ++i) {
    if (cu[i + 1] < cu[i]) return make_error(ErrorCode::kBadCuSeqlens, i + 1, static_cast<double>(cu[i + 1]));
  }
  if (cu[b] != n) return make_error(ErrorCode::kBadCuSeqlens, b, static_cast<double>(cu[b]));

  std::vector<int64_t> counts;
  if (in.action_mask) {
    count_policy_tokens(in.action_mask, cu, n, num_threads, counts);
  } else {
    counts.resize(b);
    for (int64_t i = 0; i < b; ++i) counts[i] = cu[i + 1] - cu[i];
  }
  for (int64_t i = 0; i < b; ++i) {
    if (counts[i] == 0) return make_error(ErrorCode::kNoPolicyTokens, i);
  }

  // 2. Per trajectory: advantages, scales, keep modes.
  std::vector<double> rewards(b);
  double reward_sum = 0.0;
  for (int64_t i = 0; i < b; ++i) {
    rewards[i] = load_double(in.rewards, in.rewards_dtype, i);
    if (!std::isfinite(rewards[i])) return make_error(ErrorCode::kNonFiniteReward, i, rewards[i]);
    reward_sum += rewards[i];
  }
  const double baseline = in.has_reward_baseline ? in.reward_baseline : reward_sum / static_cast<double>(b);
  const double num_traj = in.num_trajectories > 0 ? static_cast<double>(in.num_trajectories) : static_cast<double>(b);
  int64_t total_policy = 0;
  for (int64_t i = 0; i < b; ++i) total_policy += counts[i];
  const double num_policy = in.num_policy_tokens > 0 ? static_cast<double>(in.num_policy_tokens)
                                                     : static_cast<double>(total_policy);
  const bool filter = in.negative_token_fraction < 1.0;
  std::vector<double> coef(b);
  std::vector<uint8_t> keep(b, kKeepAll);
  std::vector<int64_t> keep_count(counts);
  std::vector<int64_t> selected;
  for (int64_t i = 0; i < b; ++i) {
    const double advantage = round_to_compute(compute, rewards[i] - baseline);
    store_compute(out.advantages, compute, i, advantage);
    double scale;
    switch (in.loss_agg) {
      case LossAgg::kTokenMean: scale = 1.0 / num_policy; break;
      case LossAgg::kSeqMeanTokenSumNorm: scale = 1.0 / (in.loss_scale_factor * num_traj); break;
      default: scale = 1.0 / (static_cast<double>(counts[i]) * num_traj); break;
    }
    coef[i] = advantage * scale;
    out.policy_tokens[i] = counts[i];
    if (filter && in.failures[i]) {
      const int64_t k = static_cast<int64_t>(std::ceil(in.negative_token_fraction * static_cast<double>(counts[i])));
      keep_count[i] = std::min(k, counts[i]);
      if (k <= 0) {
        keep[i] = kKeepNone;
      } else if (k < counts[i]) {
        keep[i] = kKeepFlags;
        selected.push_back(i);
      }
    }
  }

  // 3. Filter: validate entropies, then select and write keep flags into grad.
  int64_t bad_entropy = -1;
  if (filter) {
    switch (in.entropies_dtype) {
      case DType::kFloat16: bad_entropy = check_entropies<Half>(in, num_threads); break;
      case DType::kBFloat16: bad_entropy = check_entropies<BFloat16>(in, num_threads); break;
      case DType::kFloat32: bad_entropy = check_entropies<float>(in, num_threads); break;
      default: bad_entropy = check_entropies<double>(in, num_threads); break;
    }
    if (bad_entropy >= 0) {
      // Still run the main pass (log-prob errors are reported first), without the selection.
      for (int64_t i : selected) keep[i] = kKeepAll;
    } else if (!selected.empty()) {
      switch (in.entropies_dtype) {
        case DType::kFloat16: select_dispatch_lp<Half>(in, cu, selected, keep_count, out.grad, num_threads); break;
        case DType::kBFloat16: select_dispatch_lp<BFloat16>(in, cu, selected, keep_count, out.grad, num_threads); break;
        case DType::kFloat32: select_dispatch_lp<float>(in, cu, selected, keep_count, out.grad, num_threads); break;
        default: select_dispatch_lp<double>(in, cu, selected, keep_count, out.grad, num_threads); break;
      }
    }
  }

  // 4. Main pass.
  const int64_t chunks = num_chunks(n);
  std::vector<double> body_kl(b, 0.0), body_loss(b, 0.0), head_kl(chunks, 0.0), head_loss(chunks, 0.0);
  std::vector<int64_t> body_overflow(b, -1), head_segment(chunks, -1), head_overflow(chunks, -1);
  std::vector<int64_t> bad_lp(chunks, -1), bad_blp(chunks, -1);
  MainPassArgs args;
  args.num_tokens = n;
  args.batch = b;
  args.log_probs = in.log_probs;
  args.behavior = in.behavior_log_probs;
  args.mask = in.action_mask;
  args.grad = out.grad;
  args.cu = cu.data();
  args.coef = coef.data();
  args.keep = keep.data();
  args.no_is = in.no_is;
  args.body_kl = body_kl.data();
  args.body_loss = body_loss.data();
  args.body_overflow = body_overflow.data();
  args.head_segment = head_segment.data();
  args.head_kl = head_kl.data();
  args.head_loss = head_loss.data();
  args.head_overflow = head_overflow.data();
  args.bad_log_prob = bad_lp.data();
  args.bad_behavior = bad_blp.data();
  const MainChunkFn fn = best_table_for(in.log_probs_dtype, in.behavior_dtype)
                             .fn[static_cast<int>(in.log_probs_dtype)][static_cast<int>(in.behavior_dtype)];
  parallel_for(num_threads, chunks, [&](int64_t c) { fn(args, c); });

  // 5. Combine in a fixed order, then report errors by priority.
  for (int64_t c = 0; c < chunks; ++c) {
    if (bad_lp[c] >= 0) {
      return make_error(ErrorCode::kBadLogProb, bad_lp[c], load_double(in.log_probs, in.log_probs_dtype, bad_lp[c]));
    }
  }
  for (int64_t c = 0; c < chunks; ++c) {
    if (bad_blp[c] >= 0) {
      return make_error(ErrorCode::kBadBehaviorLogProb, bad_blp[c],
                        load_double(in.behavior_log_probs, in.behavior_dtype, bad_blp[c]));
    }
  }
  if (bad_entropy >= 0) {
    return make_error(ErrorCode::kBadEntropy, bad_entropy, load_double(in.entropies, in.entropies_dtype, bad_entropy));
  }
  std::vector<int64_t> overflow(body_overflow);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t s = head_segment[c];
    if (s < 0) continue;
    body_kl[s] += head_kl[c];
    body_loss[s] += head_loss[c];
    if (overflow[s] < 0) overflow[s] = head_overflow[c];
  }
  std::vector<uint8_t> admitted(b);
  int64_t first_overflow = -1;
  int64_t num_admitted = 0;
  double loss = 0.0;
  for (int64_t i = 0; i < b; ++i) {
    const double kl = in.no_is ? 0.0 : round_to_compute(compute, std::max(0.0, body_kl[i] / static_cast<double>(counts[i])));
    const bool ok = kl <= in.delta;
    admitted[i] = ok;
    store_compute(out.sequence_kl, compute, i, kl);
    out.admitted[i] = ok;
    out.retained_tokens[i] = ok ? keep_count[i] : 0;
    if (ok) {
      ++num_admitted;
      loss += body_loss[i];
      if (overflow[i] >= 0 && (first_overflow < 0 || overflow[i] < first_overflow)) first_overflow = overflow[i];
    }
  }
  if (first_overflow >= 0) {
    return make_error(ErrorCode::kRatioOverflow, first_overflow,
                      load_double(in.log_probs, in.log_probs_dtype, first_overflow) -
                          load_double(in.behavior_log_probs, in.behavior_dtype, first_overflow));
  }
  std::vector<int64_t> rejected;
  for (int64_t i = 0; i < b; ++i) {
    if (!admitted[i]) rejected.push_back(i);
  }
  const size_t elem = dtype_size(in.log_probs_dtype);
  parallel_for(num_threads, static_cast<int64_t>(rejected.size()), [&](int64_t j) {
    const int64_t i = rejected[j];
    // All-zero bits is +0.0 in every float format.
    std::memset(static_cast<char*>(out.grad) + cu[i] * elem, 0, (cu[i + 1] - cu[i]) * elem);
  });
  // Non-policy tokens of admitted trajectories already hold 0 (written by the main pass).
  store_compute(out.loss, compute, 0, loss);
  store_compute(out.acceptance_rate, compute, 0, static_cast<double>(num_admitted) / static_cast<double>(b));
  return Error{};
}

}  // namespace flashreinforce
