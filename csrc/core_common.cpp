// Pieces of the core shared by the CPU and CUDA paths: dtype helpers, error-code names and the
// structural check of the parameters.
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
    case DType::kUInt16: return "uint16";
    case DType::kUInt32: return "uint32";
    case DType::kUInt64: return "uint64";
  }
  return "unknown";
}

bool is_floating(DType dtype) {
  return dtype == DType::kFloat16 || dtype == DType::kBFloat16 || dtype == DType::kFloat32 ||
         dtype == DType::kFloat64;
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBool:
    case DType::kInt8:
    case DType::kUInt8: return 1;
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kInt16:
    case DType::kUInt16: return 2;
    case DType::kFloat32:
    case DType::kInt32:
    case DType::kUInt32: return 4;
    case DType::kFloat64:
    case DType::kInt64:
    case DType::kUInt64: return 8;
  }
  return 0;
}

DType compute_dtype(DType log_probs_dtype) {
  return log_probs_dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
}

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk: return "ok";
    case ErrorCode::kBadCuSeqlens: return "bad_cu_seqlens";
    case ErrorCode::kNoPolicyTokens: return "no_policy_tokens";
    case ErrorCode::kTooFewPolicyTokens: return "too_few_policy_tokens";
    case ErrorCode::kNonFiniteReward: return "non_finite_reward";
    case ErrorCode::kNonFiniteAdvantage: return "non_finite_advantage";
    case ErrorCode::kBadLogProb: return "bad_log_prob";
    case ErrorCode::kBadBehaviorLogProb: return "bad_behavior_log_prob";
    case ErrorCode::kBadEntropy: return "bad_entropy";
    case ErrorCode::kRatioOverflow: return "ratio_overflow";
    case ErrorCode::kGradientOverflow: return "gradient_overflow";
  }
  return "unknown";
}

const char* option_kind_name(OptionKind kind) {
  switch (kind) {
    case OptionKind::kReal: return "real";
    case OptionKind::kOptionalReal: return "optional_real";
    case OptionKind::kCount: return "count";
    case OptionKind::kFlag: return "flag";
    case OptionKind::kChoice: return "choice";
  }
  return "unknown";
}

const char* gate_metric_name(GateMetric metric) {
  switch (metric) {
    case GateMetric::kBinaryKl: return "binary_kl";
    case GateMetric::kKpop: return "kpop";
    case GateMetric::kK3: return "k3";
    case GateMetric::kLogRatio: return "log_ratio";
  }
  return "unknown";
}

namespace {

bool is_real(DType dtype) { return dtype != DType::kBool && static_cast<int>(dtype) >= 0 &&
                                   static_cast<int>(dtype) < kNumDTypes; }

}  // namespace

const char* check_params(const LossParams& p) {
  const int64_t n = p.num_tokens(), b = p.batch();
  if (!p.log_probs.present() || !is_floating(p.log_probs.dtype) || n <= 0) {
    return "log_probs: a non-empty float16/bfloat16/float32/float64 view is required";
  }
  if (!p.behavior_log_probs.present() || !is_floating(p.behavior_log_probs.dtype) ||
      p.behavior_log_probs.numel != n) {
    return "behavior_log_probs: a float view of N elements is required";
  }
  if (!p.rewards.present() || !is_real(p.rewards.dtype) || b <= 0) {
    return "rewards: a non-empty view of a real (non-bool) type is required";
  }
  if (p.cu_seqlens.present()) {
    if ((p.cu_seqlens.dtype != DType::kInt32 && p.cu_seqlens.dtype != DType::kInt64) ||
        p.cu_seqlens.numel != b + 1 || p.padded_row_length != 0) {
      return "cu_seqlens: an int32/int64 view of B+1 elements is required (and padded_row_length 0)";
    }
  } else if (p.padded_row_length <= 0 || p.padded_row_length * b != n) {
    return "padded_row_length: without cu_seqlens, N must equal B * padded_row_length > 0";
  }
  if (p.action_mask.present() && (p.action_mask.dtype != DType::kBool || p.action_mask.numel != n)) {
    return "action_mask: a bool view of N elements is required when present";
  }
  if (p.options.filter()) {
    if (!p.entropies.present() || !is_floating(p.entropies.dtype) || p.entropies.numel != n) {
      return "entropies: a float view of N elements is required when negative_token_fraction < 1";
    }
    if (!p.failures.present() || p.failures.dtype != DType::kBool || p.failures.numel != b) {
      return "failures: a bool view of B elements is required when negative_token_fraction < 1";
    }
  }
  const DType c = compute_dtype(p.log_probs.dtype);
  struct Want {
    const TensorView* view;
    DType dtype;
    int64_t numel;
    const char* message;
  };
  const Want outputs[] = {
      {&p.loss, c, 1, "loss: a compute-dtype view of 1 element is required"},
      {&p.grad, p.log_probs.dtype, n, "grad: a view of N elements of the dtype of log_probs is required"},
      {&p.advantages, c, b, "advantages: a compute-dtype view of B elements is required"},
      {&p.sequence_kl, c, b, "sequence_kl: a compute-dtype view of B elements is required"},
      {&p.admitted, DType::kBool, b, "admitted: a bool view of B elements is required"},
      {&p.acceptance_rate, c, 1, "acceptance_rate: a compute-dtype view of 1 element is required"},
      {&p.policy_tokens, DType::kInt64, b, "policy_tokens: an int64 view of B elements is required"},
      {&p.retained_tokens, DType::kInt64, b, "retained_tokens: an int64 view of B elements is required"},
  };
  for (const Want& w : outputs) {
    if (!w.view->present() || w.view->dtype != w.dtype || w.view->numel != w.numel) return w.message;
  }
  return nullptr;
}

}  // namespace flashreinforce
