// Per-trajectory rules shared by the CPU and the CUDA path (docs/semantics.md): the loss
// aggregation's scale s_i, the entropy filter's keep plan and the finiteness of rewards and
// advantages in the compute dtype. Inline __host__ __device__ functions, so that both paths run
// the same code.
#pragma once

#include <cstdint>

#include <math.h>

#include "flashreinforce/core.h"
#include "flashreinforce/host_device.h"

namespace flashreinforce {

// Per-trajectory loss scale s_i of loss = -sum_i s_i sum_t w_t log_prob_t (docs/semantics.md,
// "Loss aggregation"). num_trajectories and num_policy_tokens are the resolved denominators
// (B and the batch's policy-token count by default).
FR_HD double loss_scale(LossAgg agg, int64_t policy_tokens, double num_trajectories, double num_policy_tokens,
                        double loss_scale_factor) {
  switch (agg) {
    case LossAgg::kTokenMean: return 1.0 / num_policy_tokens;
    case LossAgg::kSeqMeanTokenSumNorm: return 1.0 / (loss_scale_factor * num_trajectories);
    default: return 1.0 / (static_cast<double>(policy_tokens) * num_trajectories);
  }
}

// How a trajectory's policy tokens are kept (entropy filter, docs/semantics.md step 5).
enum KeepMode : uint8_t {
  kKeepNone = 0,   // failed trajectory with ceil(q T) == 0
  kKeepAll = 1,    // successful trajectory, filter off, or ceil(q T) >= T
  kKeepFlags = 2,  // a selection pass writes 1 (kept) / 0 flags into grad; the main pass reads them
};

struct KeepPlan {
  uint8_t mode;  // KeepMode
  int64_t kept;  // tokens kept: min(ceil(q T), T) on a failed trajectory with the filter on, else T
};

// ceil(q * T) is evaluated in double precision exactly like the published reference's
// math.ceil(q * T) (so q = 0.07, T = 100 keeps 8 tokens: 0.07 * 100 is 7.000000000000001).
FR_HD KeepPlan keep_plan(bool filter, bool failed, double q, int64_t policy_tokens) {
  KeepPlan plan{kKeepAll, policy_tokens};
  if (filter && failed) {
    const int64_t k = static_cast<int64_t>(ceil(q * static_cast<double>(policy_tokens)));
    plan.kept = k < policy_tokens ? k : policy_tokens;
    if (k <= 0) {
      plan.mode = kKeepNone;
    } else if (k < policy_tokens) {
      plan.mode = kKeepFlags;
    }
  }
  return plan;
}

// Whether v (a reward, a baseline or an advantage computed in double) is finite once rounded to
// the compute dtype: float64, or float32 where everything from (2 - 2^-24) 2^127 up rounds to inf.
FR_HD bool finite_in_compute(double v, bool compute_double) {
  const double limit = compute_double ? 1.7976931348623157e308 : 3.4028235677973366e38;
  return compute_double ? (v <= limit) & (v >= -limit) : (v < limit) & (v > -limit);
}

}  // namespace flashreinforce
