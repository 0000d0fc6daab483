// Template implementation of the CPU main pass. Included by main_pass_generic.cpp,
// main_pass_avx2.cpp and main_pass_avx512.cpp inside different namespaces; see main_pass.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "flashreinforce/token_math.h"
#include "main_pass.h"

namespace flashreinforce {
namespace cpu {
namespace FR_ISA_NAMESPACE {

using math::Store;

// Tokens per block. A chunk is processed block by block in two stages:
//   1. token stage, over the whole block regardless of trajectory boundaries (one long
//      vectorized loop, so short trajectories cost no scalar remainder of exp / log): the
//      Bernoulli-KL term and the importance ratio of every token go to small scratch arrays
//      (L1-resident), and the validity checks are OR-reduced;
//   2. piece stage, per trajectory piece inside the block: KL and loss sums and the gradient,
//      from the scratch arrays (a multiply and two adds per token).
// Sums inside a block are kept in the compute type (float32 lanes vectorize; a mixed float/double
// reduction does not), then added to double accumulators. With 16 lanes a lane sums at most 32
// terms, so the relative error of a block sum is ~2e-6 of the sum of magnitudes, and the block
// sums add up in double. Block boundaries are fixed offsets from the chunk start, so the order of
// every sum depends on kChunk and kBlock alone, never on the number of threads.
constexpr int64_t kBlock = 512;

template <class C>
struct BlockFlags {
  int bad = 0;           // a policy token with an invalid log_prob
  int bad_behavior = 0;  // a token whose behavior log-prob is used and invalid
  C max_rho = C(0);      // the largest importance ratio of the block (inf when one overflows)
};

// Scratch of the float32 token stage: the policy flags as floats and the KL between its two halves
// (math::kl_partial, math::kl_finish).
struct KlScratch {
  alignas(64) float policy[kBlock];
  alignas(64) float z[kBlock];
  alignas(64) float P[kBlock];
  alignas(64) float near[kBlock];
  alignas(64) float far[kBlock];
  alignas(64) float exp_log_ratio[kBlock];
};

// Stage 1 over [a, b) (b - a <= kBlock): kl[t - a] = the token's KL term (0 where the behavior
// policy is not used), rho[t - a] = its importance ratio and xs[t - a] = its log-prob in C (both 0
// off the policy tokens, so the piece stage needs no mask), and the block's largest ratio (an
// order-independent max: results do not depend on how the loop is vectorized). kNoIs: ratios are
// exactly 1 and the behavior log-probs are never read. Compile-time options only: GCC unswitches
// loops on loop-invariant runtime conditions and then silently drops the vectorized copy.
//
// Float32 runs in three loops. One loop over the whole computation is bound by the latency of its
// dependency chain (the core overlaps too few iterations of a long body), and a loop that reads the
// byte mask is vectorized 32 tokens per iteration (the width of its narrowest type), which spills
// most registers and packs every flag to bytes. So: a light loop turns the mask into floats, then
// the validation with the first half of the KL, then its second half with the ratio, which comes
// from the KL's e^log_ratio (math::ratio_from_kl) unless a log-prob of the block is below ln 1e-6: then
// a fourth loop computes the block's ratios with exp.
template <class LP, class BLP, bool kMask, bool kNoIs>
static BlockFlags<typename math::ComputeOf<LP>::type> token_stage(const LP* __restrict lp, const BLP* __restrict blp, const uint8_t* __restrict mask,
                              int64_t a, int64_t b, typename math::ComputeOf<LP>::type* __restrict kl,
                              typename math::ComputeOf<LP>::type* __restrict rho,
                              typename math::ComputeOf<LP>::type* __restrict xs, KlScratch& __restrict scratch) {
  using C = typename math::ComputeOf<LP>::type;
  int bad = 0, bad_behavior = 0;
  C max_rho = C(0);
  const int64_t len = b - a;
  lp += a;
  blp += a;
  if (kMask) mask += a;
  if constexpr (kNoIs) {
#pragma omp simd reduction(| : bad)
    for (int64_t u = 0; u < len; ++u) {
      const bool policy = kMask ? mask[u] != 0 : true;
      const C x = math::to_compute(lp[u], C());
      bad |= static_cast<int>(policy & !math::valid_log_prob(x));
      kl[u] = C(0);
      rho[u] = policy ? C(1) : C(0);
      xs[u] = policy ? x : C(0);
    }
    max_rho = C(1);
  } else if constexpr (std::is_same<C, double>::value) {
#pragma omp simd reduction(| : bad, bad_behavior) reduction(max : max_rho)
    for (int64_t u = 0; u < len; ++u) {
      const bool policy = kMask ? mask[u] != 0 : true;
      const C x = math::to_compute(lp[u], C());
      const C y = math::to_compute(blp[u], C());
      bad |= static_cast<int>(policy & !math::valid_log_prob(x));
      bad_behavior |= static_cast<int>(policy & !math::valid_log_prob(y));
      const C d = math::bernoulli_kl(y, x);
      kl[u] = policy ? d : C(0);
      const C r = policy ? math::exp_c(x - y) : C(0);
      rho[u] = r;
      xs[u] = policy ? x : C(0);
      max_rho = r > max_rho ? r : max_rho;
    }
  } else {
    float* __restrict pol = scratch.policy;
    float* __restrict z = scratch.z;
    float* __restrict P = scratch.P;
    float* __restrict near = scratch.near;
    float* __restrict far = scratch.far;
    float* __restrict exp_log_ratio = scratch.exp_log_ratio;
    if (kMask) {
#pragma omp simd
      for (int64_t u = 0; u < len; ++u) pol[u] = mask[u] != 0 ? 1.0f : 0.0f;
    }
#pragma omp simd reduction(| : bad, bad_behavior)
    for (int64_t u = 0; u < len; ++u) {
      const bool policy = kMask ? pol[u] != 0.0f : true;
      const float x = math::to_compute(lp[u], float());
      const float y = math::to_compute(blp[u], float());
      bad |= static_cast<int>(policy & !math::valid_log_prob(x));
      bad_behavior |= static_cast<int>(policy & !math::valid_log_prob(y));
      const math::KlPartial k = math::kl_partial(y, x);
      z[u] = k.z;
      P[u] = k.P;
      near[u] = k.near;
      far[u] = k.far;
      exp_log_ratio[u] = k.exp_log_ratio;
    }
    int inexact = 0;
#pragma omp simd reduction(max : max_rho) reduction(| : inexact)
    for (int64_t u = 0; u < len; ++u) {
      const bool policy = kMask ? pol[u] != 0.0f : true;
      math::KlPartial k;
      k.z = z[u];
      k.P = P[u];
      k.near = near[u];
      k.far = far[u];
      const float d = math::kl_finish(k);
      kl[u] = policy ? d : 0.0f;
      const float x = math::to_compute(lp[u], float());
      const float y = math::to_compute(blp[u], float());
      float ratio;
      const bool exact = math::ratio_from_kl(y, x, exp_log_ratio[u], &ratio);
      inexact |= static_cast<int>(policy & !exact);
      const float r = policy ? ratio : 0.0f;
      rho[u] = r;
      xs[u] = policy ? x : 0.0f;
      max_rho = r > max_rho ? r : max_rho;
    }
    if (inexact) {  // rare: a log-prob below ln 1e-6, whose ratio needs an exp of its own
      max_rho = 0.0f;
#pragma omp simd reduction(max : max_rho)
      for (int64_t u = 0; u < len; ++u) {
        const bool policy = kMask ? pol[u] != 0.0f : true;
        const float ratio = math::exp_c(math::to_compute(lp[u], float()) - math::to_compute(blp[u], float()));
        const float r = policy ? ratio : 0.0f;  // computed for every token: a conditional exp stays a branch (SSE2)
        rho[u] = r;
        max_rho = r > max_rho ? r : max_rho;
      }
    }
  }
  BlockFlags<C> f;
  f.bad = bad;
  f.bad_behavior = bad_behavior;
  f.max_rho = max_rho;
  return f;
}

// After token_stage, for a gate metric other than the Bernoulli KL: kl[t - a] = the metric's
// per-token term (math::gate_term; 0 off the policy tokens), over the block token_stage just read
// (still in L1). One simd loop per metric: the switch stays outside the loops (see token_stage).
template <class LP, class BLP, bool kMask>
static void metric_stage(const LP* __restrict lp, const BLP* __restrict blp, const uint8_t* __restrict mask,
                         int64_t a, int64_t b, GateMetric metric, typename math::ComputeOf<LP>::type* __restrict kl) {
  using C = typename math::ComputeOf<LP>::type;
  const int64_t len = b - a;
  lp += a;
  blp += a;
  if (kMask) mask += a;
  switch (metric) {
    case GateMetric::kKpop:
#pragma omp simd
      for (int64_t u = 0; u < len; ++u) {
        const C d = math::kpop_term(math::to_compute(blp[u], C()), math::to_compute(lp[u], C()));
        kl[u] = (kMask ? mask[u] != 0 : true) ? d : C(0);
      }
      break;
    case GateMetric::kK3:
#pragma omp simd
      for (int64_t u = 0; u < len; ++u) {
        const C d = math::k3_term(math::to_compute(blp[u], C()), math::to_compute(lp[u], C()));
        kl[u] = (kMask ? mask[u] != 0 : true) ? d : C(0);
      }
      break;
    case GateMetric::kLogRatio:
#pragma omp simd
      for (int64_t u = 0; u < len; ++u) {
        const C d = math::log_ratio_term(math::to_compute(blp[u], C()), math::to_compute(lp[u], C()));
        kl[u] = (kMask ? mask[u] != 0 : true) ? d : C(0);
      }
      break;
    case GateMetric::kBinaryKl:
      break;
  }
}

// Truncated importance sampling: every ratio of the block clipped at `cap` (0 stays 0 off the
// policy tokens; an overflowed ratio becomes `cap`, so it no longer counts as an overflow).
template <class C>
static void truncate_ratios(C* __restrict rho, int64_t len, C cap, C& max_rho) {
#pragma omp simd
  for (int64_t u = 0; u < len; ++u) rho[u] = rho[u] < cap ? rho[u] : cap;
  max_rho = max_rho < cap ? max_rho : cap;
}

// Pieces shorter than this take the scalar loop of piece_stage.
constexpr int64_t kShortPiece = 16;

struct PieceSums {
  double kl = 0.0;
  double loss = 0.0;
  bool overflow = false;  // a kept token with a non-finite ratio
};

// Stage 2 over one piece [a, b) of one trajectory inside the block that starts at `blk` (kl, rho
// and xs are that block's scratch arrays, rho and xs 0 off the policy tokens). kFlags: kept flags
// are in grad (entropy filter; 0 off the policy tokens); otherwise every policy token is kept when
// keep_all, none when not. keep_all enters as a bit mask on the gradient, never as a select on the
// invariant itself (see token_stage). Gradients are -rho * coef on kept tokens and +0 elsewhere.
template <class LP, bool kFlags>
static PieceSums piece_stage(LP* __restrict grad, int64_t blk, int64_t a, int64_t b,
                             const typename math::ComputeOf<LP>::type* __restrict kl,
                             const typename math::ComputeOf<LP>::type* __restrict rho,
                             const typename math::ComputeOf<LP>::type* __restrict xs,
                             typename math::ComputeOf<LP>::type coef, bool keep_all) {
  using C = typename math::ComputeOf<LP>::type;
  using Bits = typename math::BitsOf<C>::type;
  const C kMax = std::numeric_limits<C>::max();
  const C ncoef = -coef;
  const Bits keep_bits = keep_all ? ~Bits(0) : Bits(0);
  C kl_sum = C(0), loss_sum = C(0);
  int overflow = 0;
  const int64_t len = b - a;
  grad += a;
  kl += a - blk;
  rho += a - blk;
  xs += a - blk;
  auto body = [&](int64_t u, C& kl_acc, C& loss_acc, int& overflow_acc) {
    kl_acc += kl[u];
    const C r = rho[u];
    C g;
    if (kFlags) {
      const bool kept = math::to_compute(grad[u], C()) != C(0);
      overflow_acc |= static_cast<int>(kept & !(r <= kMax));
      g = kept ? r * ncoef : C(0);
    } else {
      overflow_acc |= static_cast<int>(!(r <= kMax));
      g = math::from_bits(math::bits_of(r * ncoef + C(0)) & keep_bits);  // + 0: no -0 off the policy
    }
    grad[u] = Store<LP>::from(g);
    loss_acc += g * xs[u];
  };
  if (len < kShortPiece) {
    // Short pieces (many trajectories of a few tokens): a plain loop, without the set-up and
    // horizontal reductions of the vector loop, which cost more than the tokens themselves.
    for (int64_t u = 0; u < len; ++u) body(u, kl_sum, loss_sum, overflow);
  } else {
#pragma omp simd reduction(+ : kl_sum, loss_sum) reduction(| : overflow)
    for (int64_t u = 0; u < len; ++u) body(u, kl_sum, loss_sum, overflow);
  }
  PieceSums s;
  s.kl = static_cast<double>(kl_sum);
  s.loss = static_cast<double>(loss_sum);
  s.overflow = overflow != 0 && (kFlags || keep_all);
  return s;
}

// First policy token in [a, b) whose log-prob in `v` is invalid, or -1 (rare path: scalar).
template <class T, class C>
static int64_t first_invalid(const T* v, const uint8_t* mask, int64_t a, int64_t b) {
  for (int64_t u = a; u < b; ++u) {
    if ((!mask || mask[u]) && !math::valid_log_prob(math::to_compute(v[u], C()))) return u;
  }
  return -1;
}

template <class LP, class BLP, bool kMask, bool kNoIs>
static void main_chunk_impl(const MainPassArgs& A, int64_t chunk) {
  using C = typename math::ComputeOf<LP>::type;
  const LP* lp = static_cast<const LP*>(A.log_probs);
  const BLP* blp = static_cast<const BLP*>(A.behavior);
  const uint8_t* mask = kMask ? A.mask : nullptr;
  LP* grad = static_cast<LP*>(A.grad);
  const int64_t c0 = chunk * kChunk;
  const int64_t c1 = std::min(A.num_tokens, c0 + kChunk);
  alignas(64) C kl[kBlock];
  alignas(64) C rho[kBlock];
  alignas(64) C xs[kBlock];
  KlScratch kl_scratch;
  // 0.999 of the largest gradient magnitude the storage dtype holds (finite in C for float32 /
  // float64 storage), see math::store_limit.
  const C gradient_alarm = C(0.999) * std::min<C>(static_cast<C>(math::store_limit(LP())),
                                                  std::numeric_limits<C>::max());
  A.head_segment[chunk] = -1;
  A.head_overflow[chunk] = MainPassArgs::Overflow();
  int64_t first_bad = -1, first_bad_behavior = -1;

  // Trajectory containing c0: the last i with cu[i] <= c0 (trajectories are never empty here:
  // the driver rejects a trajectory without policy tokens before the main pass).
  int64_t seg = static_cast<int64_t>(std::upper_bound(A.cu, A.cu + A.batch + 1, c0) - A.cu) - 1;
  double seg_kl = 0.0, seg_loss = 0.0;
  MainPassArgs::Overflow seg_overflow;
  auto flush = [&] {  // the sums of `seg` over this chunk are complete
    if (A.cu[seg] >= c0) {
      A.body_kl[seg] = seg_kl;
      A.body_loss[seg] = seg_loss;
      A.body_overflow[seg] = seg_overflow;
    } else {
      A.head_segment[chunk] = seg;
      A.head_kl[chunk] = seg_kl;
      A.head_loss[chunk] = seg_loss;
      A.head_overflow[chunk] = seg_overflow;
    }
    seg_kl = seg_loss = 0.0;
    seg_overflow = MainPassArgs::Overflow();
  };

  for (int64_t blk = c0; blk < c1; blk += kBlock) {
    const int64_t blk_end = std::min(c1, blk + kBlock);
    BlockFlags<C> f = token_stage<LP, BLP, kMask, kNoIs>(lp, blp, mask, blk, blk_end, kl, rho, xs, kl_scratch);
    if constexpr (!kNoIs) {  // without importance correction every ratio is 1 and every metric 0
      if (A.gate_metric != GateMetric::kBinaryKl) metric_stage<LP, BLP, kMask>(lp, blp, mask, blk, blk_end, A.gate_metric, kl);
      if (A.truncation < kNoTruncation) truncate_ratios<C>(rho, blk_end - blk, static_cast<C>(A.truncation), f.max_rho);
    }
    if (f.bad && first_bad < 0) first_bad = first_invalid<LP, C>(lp, mask, blk, blk_end);
    if (f.bad_behavior && first_bad_behavior < 0) {
      first_bad_behavior = first_invalid<BLP, C>(blp, mask, blk, blk_end);
    }
    int64_t t = blk;
    while (t < blk_end) {
      if (A.cu[seg + 1] <= t) {
        flush();
        while (A.cu[seg + 1] <= t) ++seg;
      }
      const int64_t end = std::min(A.cu[seg + 1], blk_end);
      const C coef = static_cast<C>(A.coef[seg]);
      const uint8_t keep = A.keep[seg];
      const PieceSums s =
          keep == kKeepFlags ? piece_stage<LP, true>(grad, blk, t, end, kl, rho, xs, coef, false)
                             : piece_stage<LP, false>(grad, blk, t, end, kl, rho, xs, coef, keep == kKeepAll);
      seg_kl += s.kl;
      seg_loss += s.loss;
      // s.overflow: a kept token's ratio overflowed. A gradient -rho * coef can overflow the
      // storage dtype only if the block's largest ratio times |coef| comes near its limit (a
      // superset test without any per-token work; false alarms only cost the scan below).
      const C abs_coef = coef < C(0) ? -coef : coef;
      const bool may_overflow = s.overflow || !(f.max_rho * abs_coef < gradient_alarm);
      if (may_overflow && (seg_overflow.ratio < 0 || seg_overflow.gradient < 0)) {
        // Rare path: the stored gradient of an overflowing token is non-finite (every other
        // token's is finite or 0; a false alarm finds none); the ratio tells which kind it is.
        for (int64_t u = t; u < end; ++u) {
          const C g = math::to_compute(grad[u], C());
          if (g == g && g - g == C(0)) continue;
          const C r = rho[u - blk];
          int64_t& first = (r - r == C(0)) ? seg_overflow.gradient : seg_overflow.ratio;
          if (first < 0) first = u;
          if (seg_overflow.ratio >= 0 && seg_overflow.gradient >= 0) break;
        }
      }
      t = end;
    }
  }
  if (c1 > c0) flush();
  A.bad_log_prob[chunk] = first_bad;
  A.bad_behavior[chunk] = first_bad_behavior;
}

template <class LP, class BLP>
static void main_chunk(const MainPassArgs& A, int64_t chunk) {
  if (A.mask) {
    A.no_is ? main_chunk_impl<LP, BLP, true, true>(A, chunk) : main_chunk_impl<LP, BLP, true, false>(A, chunk);
  } else {
    A.no_is ? main_chunk_impl<LP, BLP, false, true>(A, chunk) : main_chunk_impl<LP, BLP, false, false>(A, chunk);
  }
}

template <class LP>
static void fill_row(KernelTable& table) {
  const int i = static_cast<int>(DTypeOf<LP>::value);
  table.main[i][static_cast<int>(DType::kFloat16)] = &main_chunk<LP, math::Half>;
  table.main[i][static_cast<int>(DType::kBFloat16)] = &main_chunk<LP, math::BFloat16>;
  table.main[i][static_cast<int>(DType::kFloat32)] = &main_chunk<LP, float>;
  table.main[i][static_cast<int>(DType::kFloat64)] = &main_chunk<LP, double>;
}

// Float32-compute rows (log_probs half / bf16 / float32); the float64 row only when asked.
static void fill_main(KernelTable& table, bool with_float64_log_probs) {
  fill_row<math::Half>(table);
  fill_row<math::BFloat16>(table);
  fill_row<float>(table);
  if (with_float64_log_probs) fill_row<double>(table);
}

}  // namespace FR_ISA_NAMESPACE
}  // namespace cpu
}  // namespace flashreinforce
