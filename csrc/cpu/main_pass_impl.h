// Template implementation of the CPU main pass. Included by main_pass_generic.cpp,
// main_pass_avx2.cpp and main_pass_avx512.cpp inside different namespaces; see main_pass.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "flashreinforce/token_math.h"
#include "main_pass.h"

namespace flashreinforce {
namespace cpu {
namespace FR_ISA_NAMESPACE {

using math::Store;

struct PieceSums {
  double kl = 0.0;
  double loss = 0.0;
  bool bad = false;
  bool bad_behavior = false;
  bool overflow = false;
};

// Tokens per inner block: sums inside a block are kept in the compute type (float32 lanes
// vectorize; a mixed float/double reduction does not), then added to double accumulators.
// With 16 lanes a lane sums at most 32 terms, so the relative error of a block sum is ~2e-6 of
// the sum of magnitudes, and the block sums add up in double.
constexpr int64_t kBlock = 512;

// One piece [a, b) of one trajectory. kMask: a mask is present; kFlags: kept flags are in grad.
// Loop-invariant options (keep_all, no_is) enter as 0 / 1 factors of varying conditions, never
// as selects on the invariant itself: GCC unswitches loops on invariant conditions and then
// silently drops the vectorized copy.
template <class LP, class BLP, bool kMask, bool kFlags>
static PieceSums piece(const LP* __restrict lp, const BLP* __restrict blp,
                       const uint8_t* __restrict mask, LP* __restrict grad, int64_t a, int64_t b,
                       typename math::ComputeOf<LP>::type coef, bool keep_all, bool no_is) {
  using C = typename math::ComputeOf<LP>::type;
  double kl = 0.0, loss = 0.0;
  int bad = 0, bad_behavior = 0, overflow = 0;
  const C kMax = std::numeric_limits<C>::max();
  const C keep_f = keep_all ? C(1) : C(0);
  const C is_f = no_is ? C(0) : C(1);  // 0: the behavior policy is not used at all
  for (int64_t blk = a; blk < b; blk += kBlock) {
    const int64_t blk_end = std::min(b, blk + kBlock);
    C kl_b = C(0), loss_b = C(0);
#pragma omp simd reduction(+ : kl_b, loss_b) reduction(| : bad, bad_behavior, overflow)
    for (int64_t t = blk; t < blk_end; ++t) {
      const C m = kMask ? (mask[t] ? C(1) : C(0)) : C(1);
      const C x = math::to_compute(lp[t], C());
      const C y = math::to_compute(blp[t], C());
      const bool policy = m != C(0);
      const bool uses_behavior = m * is_f != C(0);
      bad |= static_cast<int>(policy & !math::valid_log_prob(x));
      bad_behavior |= static_cast<int>(uses_behavior & !math::valid_log_prob(y));
      const C d = math::bernoulli_kl<C>(y, x);
      kl_b += uses_behavior ? d : C(0);
      bool kept;
      if (kFlags) {
        kept = policy & (math::to_compute(grad[t], C()) != C(0));
      } else {
        kept = m * keep_f != C(0);
      }
      // Without importance sampling the ratio is exactly exp(0) = 1 (and y is never read).
      const C rho = math::exp_c(uses_behavior ? x - y : C(0));
      overflow |= static_cast<int>(kept & !(rho <= kMax));
      const C g = kept ? -rho * coef : C(0);
      grad[t] = Store<LP>::from(g);
      loss_b += kept ? g * x : C(0);
    }
    kl += static_cast<double>(kl_b);
    loss += static_cast<double>(loss_b);
  }
  PieceSums s;
  s.kl = kl;
  s.loss = loss;
  s.bad = bad != 0;
  s.bad_behavior = bad_behavior != 0;
  s.overflow = overflow != 0;
  return s;
}

template <class LP, class BLP>
static void main_chunk(const MainPassArgs& A, int64_t chunk) {
  using C = typename math::ComputeOf<LP>::type;
  const LP* lp = static_cast<const LP*>(A.log_probs);
  const BLP* blp = static_cast<const BLP*>(A.behavior);
  LP* grad = static_cast<LP*>(A.grad);
  const int64_t c0 = chunk * kChunk;
  const int64_t c1 = std::min(A.num_tokens, c0 + kChunk);
  // Trajectory containing c0: the last i with cu[i] <= c0 (skipping empty trajectories).
  int64_t seg = static_cast<int64_t>(std::upper_bound(A.cu, A.cu + A.batch + 1, c0) - A.cu) - 1;
  A.head_segment[chunk] = -1;
  A.head_overflow[chunk] = -1;
  A.bad_log_prob[chunk] = -1;
  A.bad_behavior[chunk] = -1;
  int64_t first_bad = -1, first_bad_behavior = -1;
  int64_t t = c0;
  while (t < c1) {
    while (A.cu[seg + 1] <= t) ++seg;
    const int64_t end = std::min(A.cu[seg + 1], c1);
    const C coef = static_cast<C>(A.coef[seg]);
    const uint8_t keep = A.keep[seg];
    PieceSums s;
    if (A.mask) {
      s = keep == kKeepFlags
              ? piece<LP, BLP, true, true>(lp, blp, A.mask, grad, t, end, coef, false, A.no_is)
              : piece<LP, BLP, true, false>(lp, blp, A.mask, grad, t, end, coef, keep == kKeepAll, A.no_is);
    } else {
      s = keep == kKeepFlags
              ? piece<LP, BLP, false, true>(lp, blp, A.mask, grad, t, end, coef, false, A.no_is)
              : piece<LP, BLP, false, false>(lp, blp, A.mask, grad, t, end, coef, keep == kKeepAll, A.no_is);
    }
    // Rare paths: locate the first offending token of the piece with a scalar rescan.
    if (s.bad && first_bad < 0) {
      for (int64_t u = t; u < end; ++u) {
        if ((!A.mask || A.mask[u]) && !math::valid_log_prob(math::to_compute(lp[u], C()))) {
          first_bad = u;
          break;
        }
      }
    }
    if (s.bad_behavior && first_bad_behavior < 0) {
      for (int64_t u = t; u < end; ++u) {
        if ((!A.mask || A.mask[u]) && !math::valid_log_prob(math::to_compute(blp[u], C()))) {
          first_bad_behavior = u;
          break;
        }
      }
    }
    int64_t overflow_at = -1;
    if (s.overflow) {
      // A kept token with an overflowing ratio has a non-finite gradient (+-inf, or NaN when the
      // advantage is 0); every other token's gradient is finite or 0. Confirm with the ratio.
      for (int64_t u = t; u < end; ++u) {
        if (A.mask && !A.mask[u]) continue;
        const C g = math::to_compute(grad[u], C());
        const C r = math::exp_c(math::to_compute(lp[u], C()) - math::to_compute(blp[u], C()));
        if (!(g == g && g - g == C(0)) && !(r - r == C(0))) {
          overflow_at = u;
          break;
        }
      }
    }
    if (A.cu[seg] >= c0) {
      A.body_kl[seg] = s.kl;
      A.body_loss[seg] = s.loss;
      A.body_overflow[seg] = overflow_at;
    } else {
      A.head_segment[chunk] = seg;
      A.head_kl[chunk] = s.kl;
      A.head_loss[chunk] = s.loss;
      A.head_overflow[chunk] = overflow_at;
    }
    t = end;
  }
  A.bad_log_prob[chunk] = first_bad;
  A.bad_behavior[chunk] = first_bad_behavior;
}

template <class LP>
static void fill_row(KernelTable& table, bool with_double_behavior) {
  const int i = static_cast<int>(DTypeOf<LP>::value);
  table.main[i][static_cast<int>(DType::kFloat16)] = &main_chunk<LP, math::Half>;
  table.main[i][static_cast<int>(DType::kBFloat16)] = &main_chunk<LP, math::BFloat16>;
  table.main[i][static_cast<int>(DType::kFloat32)] = &main_chunk<LP, float>;
  table.main[i][static_cast<int>(DType::kFloat64)] = with_double_behavior ? &main_chunk<LP, double> : nullptr;
}

// Float32-compute rows (log_probs half / bf16 / float32); the float64 row only when asked.
static void fill_main(KernelTable& table, bool with_float64_log_probs) {
  fill_row<math::Half>(table, true);
  fill_row<math::BFloat16>(table, true);
  fill_row<float>(table, true);
  if (with_float64_log_probs) fill_row<double>(table, true);
}

}  // namespace FR_ISA_NAMESPACE
}  // namespace cpu
}  // namespace flashreinforce
