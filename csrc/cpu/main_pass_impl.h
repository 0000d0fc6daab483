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

// One piece [a, b) of one trajectory. kMask: a mask is present; kFlags: kept flags are in grad.
template <class LP, class BLP, bool kMask, bool kFlags>
static PieceSums piece(const LP* __restrict lp, const BLP* __restrict blp,
                       const uint8_t* __restrict mask, LP* __restrict grad, int64_t a, int64_t b,
                       typename math::ComputeOf<LP>::type coef, bool keep_all, bool no_is) {
  using C = typename math::ComputeOf<LP>::type;
  double kl = 0.0, loss = 0.0;
  int bad = 0, bad_behavior = 0, overflow = 0;
  const C kMax = std::numeric_limits<C>::max();
#pragma omp simd reduction(+ : kl, loss) reduction(| : bad, bad_behavior, overflow)
  for (int64_t t = a; t < b; ++t) {
    const bool m = kMask ? (mask[t] != 0) : true;
    const C x = math::to_compute(lp[t], C());
    const C y = math::to_compute(blp[t], C());
    bad |= static_cast<int>(m & !math::valid_log_prob(x));
    bad_behavior |= static_cast<int>(m & !no_is & !math::valid_log_prob(y));
    const C d = math::bernoulli_kl<C>(y, x);
    kl += (m & !no_is) ? static_cast<double>(d) : 0.0;
    bool kept;
    if (kFlags) {
      kept = m & (math::to_compute(grad[t], C()) != C(0));
    } else {
      kept = m & keep_all;
    }
    const C rho = no_is ? C(1) : math::exp_c(x - y);
    overflow |= static_cast<int>(kept & !(rho <= kMax));
    const C g = kept ? -rho * coef : C(0);
    grad[t] = Store<LP>::from(g);
    loss += kept ? static_cast<double>(g) * static_cast<double>(x) : 0.0;
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
static void fill_row(MainPassTable& table, int lp_index, bool with_double_behavior) {
  table.fn[lp_index][static_cast<int>(DType::kFloat16)] = &main_chunk<LP, math::Half>;
  table.fn[lp_index][static_cast<int>(DType::kBFloat16)] = &main_chunk<LP, math::BFloat16>;
  table.fn[lp_index][static_cast<int>(DType::kFloat32)] = &main_chunk<LP, float>;
  table.fn[lp_index][static_cast<int>(DType::kFloat64)] =
      with_double_behavior ? &main_chunk<LP, double> : nullptr;
}

// Float32-compute rows (log_probs half / bf16 / float32); the float64 row only when asked.
static MainPassTable make_table(bool with_float64_log_probs) {
  MainPassTable table{};
  fill_row<math::Half>(table, static_cast<int>(DType::kFloat16), true);
  fill_row<math::BFloat16>(table, static_cast<int>(DType::kBFloat16), true);
  fill_row<float>(table, static_cast<int>(DType::kFloat32), true);
  if (with_float64_log_probs) fill_row<double>(table, static_cast<int>(DType::kFloat64), true);
  return table;
}

}  // namespace FR_ISA_NAMESPACE
}  // namespace cpu
}  // namespace flashreinforce
