// Pieces of the core shared by the CPU and CUDA paths: dtype helpers and option checks.
#include <cmath>

#include "flashreinforce/core.h"

namespace flashreinforce {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kBool: return "bool";
    case DType::kInt8: return "int8";
    case DType::kUInt8: return "uint8";
    case DType::kInt16: return "int16";
  }
  return "unknown";
}

bool is_floating(DType dtype) {
  return dtype == DType::kFloat16 || dtype == DType::kBFloat16 || dtype == DType::kFloat32 ||
         dtype == DType::kFloat64;
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kInt16: return 2;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kFloat64:
    case DType::kInt64: return 8;
    case DType::kBool:
    case DType::kInt8:
    case DType::kUInt8: return 1;
  }
  return 0;
}

DType compute_dtype(DType log_probs_dtype) {
  return log_probs_dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
}

const char* check_options(const LossInputs& in) {
  if (std::isnan(in.delta) || in.delta < 0) {
    return "delta must be a non-negative number (inf disables the gate)";
  }
  const double q = in.negative_token_fraction;
  if (std::isnan(q) || q < 0.0 || q > 1.0) return "negative_token_fraction must be in [0, 1]";
  if (q < 1.0 && (in.entropies == nullptr || in.failures == nullptr)) {
    return "negative_token_fraction < 1 needs entropies and failures";
  }
  if (in.loss_agg == LossAgg::kSeqMeanTokenSumNorm) {
    if (!std::isfinite(in.loss_scale_factor) || in.loss_scale_factor <= 0) {
      return "loss_scale_factor must be a positive finite number for seq-mean-token-sum-norm";
    }
  }
  if (in.has_reward_baseline && !std::isfinite(in.reward_baseline)) {
    return "reward_baseline must be finite";
  }
  return nullptr;
}

}  // namespace flashreinforce
