// The framework-agnostic C++ API of the fused FlashREINFORCE loss.
//
// Everything here is plain C++17: tensor views (pointer, element type, element count), one
// parameter struct and (for CUDA) a stream handle passed as an opaque pointer. No PyTorch and no
// pybind11 header is included anywhere in the core, so one built library serves any PyTorch
// release. The contract implemented by both the CPU and the CUDA path is docs/semantics.md.
//
// Division of labour: the caller validates the arguments of the objective (types, shapes, dtypes,
// devices, option values: flashreinforce/ops/contract.py does it for Python) and fills one
// LossParams; check_params() only checks the structure the core relies on for memory safety
// (present views, element counts, element types). Value errors that need a pass over the data
// (offsets, masks, non-finite values, overflows) are found by the core during its pass and
// returned as an Error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

namespace flashreinforce {

// Element types the core reads and writes.
enum class DType : int32_t {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat64 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kBool = 6,    // one byte per element, 0 or 1
  kInt8 = 7,    // integer types below: only accepted for rewards
  kUInt8 = 8,
  kInt16 = 9,
  kUInt16 = 10,
  kUInt32 = 11,
  kUInt64 = 12,
};
constexpr int kNumDTypes = 13;

const char* dtype_name(DType dtype);  // "float16", "bfloat16", ... (PyTorch's names)
bool is_floating(DType dtype);
size_t dtype_size(DType dtype);

// A non-owning view of one contiguous tensor: data pointer, element type and element count. Every
// argument of the loss, input or output, is one. Inputs are only read. Host memory for the CPU
// path, device memory for the CUDA path. An absent optional input has data == nullptr.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t numel = 0;

  bool present() const { return data != nullptr; }
  template <class T> T* as() const { return static_cast<T*>(data); }
};

// Per-trajectory loss scale s_i (docs/semantics.md, "Loss aggregation").
enum class LossAgg : int32_t {
  kSeqMeanTokenMean = 0,     // s_i = 1 / (T_i * num_trajectories)        (the method)
  kTokenMean = 1,            // s_i = 1 / num_policy_tokens                 (one mean over all tokens)
  kSeqMeanTokenSumNorm = 2,  // s_i = 1 / (loss_scale_factor * num_trajectories)
};
constexpr const char* kLossAggNames[] = {"seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"};

// The per-token divergence whose mean over a trajectory's policy tokens the trust gate compares
// with delta (docs/semantics.md, "Gate metrics"). b = behavior log-prob, c = current log-prob,
// p = clamp(e^b), q = clamp(e^c) (clamps to [1e-6, 1 - 1e-6]).
enum class GateMetric : int32_t {
  kBinaryKl = 0,  // KL(Bern(p) || Bern(q))                       (the method)
  kKpop = 1,      // max(KL(Bern(p) || Bern(q)), KL(Bern(q) || Bern(p)))
  kK3 = 2,        // e^(c-b) - 1 - (c-b)   (k3 estimator of KL(behavior || current), unclamped)
  kLogRatio = 3,  // |c - b|               (a geometric-mean ratio bound)
};
constexpr int kNumGateMetrics = 4;
const char* gate_metric_name(GateMetric metric);  // "binary_kl", "kpop", "k3", "log_ratio"
constexpr const char* kGateMetricNames[] = {"binary_kl", "kpop", "k3", "log_ratio"};

// is_truncation's "off": ratios are never clipped.
constexpr double kNoTruncation = std::numeric_limits<double>::infinity();

// The keyword options of the objective, already validated by the caller.
struct LossOptions {
  double delta = 3e-3;                    // trust threshold (inclusive; the Python LossOptions.delta default); inf disables the gate
  double negative_token_fraction = 1.0;  // q in [0, 1]; < 1 enables the entropy filter
  bool has_reward_baseline = false;
  double reward_baseline = 0.0;
  int64_t num_trajectories = 0;  // 0: the batch size B
  LossAgg loss_agg = LossAgg::kSeqMeanTokenMean;
  double loss_scale_factor = 0.0;  // seq-mean-token-sum-norm only
  int64_t num_policy_tokens = 0;   // 0: the batch's policy-token count (token-mean)
  bool no_is = false;              // current policy as the detached denominator
  GateMetric gate_metric = GateMetric::kBinaryKl;  // what the trust gate averages per trajectory
  double is_truncation = kNoTruncation;  // >= 1: importance ratios clipped at this value (truncated IS); inf: not clipped

  bool filter() const { return negative_token_fraction < 1.0; }
};

// How a caller fills LossOptions by name: one row per field, which the bindings (csrc/bindings.cpp)
// iterate; no other code names an option on its way from Python to the core. The Python side is
// flashreinforce.objective.LossOptions (the fields its metadata marks "kernel") plus the call's scalars
// (flashreinforce.ops.contract.CALL_SCALARS); a test checks that both sides list the same names and
// choices. Adding an option: its LossOptions member above, its row here, and the kernels that read it.
enum class OptionKind : int32_t {
  kReal = 0,          // double (below a finite `minimum`, NaN included: refused)
  kOptionalReal = 1,  // double, or None: 0.0 (and the bool at `given_offset`, if any, false)
  kCount = 2,         // int64_t, or None: 0
  kFlag = 3,          // bool
  kChoice = 4,        // an int32_t enum, given by its name among `choices`
};
constexpr size_t kNoMember = static_cast<size_t>(-1);
struct OptionField {
  const char* name;
  OptionKind kind;
  size_t offset;                           // of the member in LossOptions
  size_t given_offset = kNoMember;         // kOptionalReal: of its bool "given" member, if any
  const char* const* choices = nullptr;    // kChoice: the names by enum value
  int num_choices = 0;
  double minimum = -std::numeric_limits<double>::infinity();  // kReal
};
const char* option_kind_name(OptionKind kind);  // "real", "optional_real", "count", "flag", "choice"

#define FR_OPTION(member, kind) #member, OptionKind::kind, offsetof(LossOptions, member)
inline constexpr OptionField kLossOptionFields[] = {
    {FR_OPTION(delta, kReal)},
    {FR_OPTION(negative_token_fraction, kReal)},
    {FR_OPTION(reward_baseline, kOptionalReal), offsetof(LossOptions, has_reward_baseline)},
    {FR_OPTION(num_trajectories, kCount)},
    {FR_OPTION(loss_agg, kChoice), kNoMember, kLossAggNames, 3},
    {FR_OPTION(loss_scale_factor, kOptionalReal)},
    {FR_OPTION(num_policy_tokens, kCount)},
    {FR_OPTION(no_is, kFlag)},
    {FR_OPTION(gate_metric, kChoice), kNoMember, kGateMetricNames, kNumGateMetrics},
    {FR_OPTION(is_truncation, kReal), kNoMember, nullptr, 0, 1.0},
};
#undef FR_OPTION
constexpr int kNumLossOptionFields = sizeof(kLossOptionFields) / sizeof(kLossOptionFields[0]);

// Everything one loss evaluation reads and writes. N = log_probs.numel (tokens),
// B = rewards.numel (trajectories); C is the compute dtype (compute_dtype(log_probs.dtype)).
struct LossParams {
  // Inputs.
  TensorView log_probs;           // [N] float16/bfloat16/float32/float64, current policy
  TensorView behavior_log_probs;  // [N] float, behavior policy
  TensorView rewards;             // [B] any real type
  TensorView cu_seqlens;          // [B+1] int32/int64; absent for the padded form
  int64_t padded_row_length = 0;  // padded form (cu_seqlens absent): cu[i] = i * padded_row_length
  TensorView action_mask;         // [N] bool, or absent: every token is a policy token
  TensorView entropies;           // [N] float, read only when options.filter()
  TensorView failures;            // [B] bool, read only when options.filter()
  LossOptions options;
  // Outputs, preallocated by the caller.
  TensorView loss;             // [] C
  TensorView grad;             // [N] dtype of log_probs: d loss / d log_probs (zeros off the active tokens)
  TensorView advantages;       // [B] C
  TensorView sequence_kl;      // [B] C
  TensorView admitted;         // [B] bool
  TensorView acceptance_rate;  // [] C
  TensorView policy_tokens;    // [B] int64
  TensorView retained_tokens;  // [B] int64

  int64_t num_tokens() const { return log_probs.numel; }
  int64_t batch() const { return rewards.numel; }
};

// Compute dtype of a given log_probs dtype: float64 stays float64, everything else is float32.
DType compute_dtype(DType log_probs_dtype);

// Checks the structure the core relies on (views present where needed, element counts, element
// types). Returns nullptr when usable, else a static message naming the field. It does not check
// option values or data: see the division of labour above.
const char* check_params(const LossParams& p);

// Errors found while computing. The numeric order is the reporting priority: when several errors
// are present the smallest code wins, then the smallest index. Both paths report the same
// (code, index) for the same input; flashreinforce/ops/contract.py turns them into exceptions.
enum class ErrorCode : int32_t {
  kOk = 0,
  kBadCuSeqlens = 1,         // index: i with cu[i] > cu[i+1]; or 0 / B for a bad first / last offset
  kNoPolicyTokens = 2,       // index: trajectory
  kTooFewPolicyTokens = 3,   // index: the batch's policy-token count (num_policy_tokens is below it)
  kNonFiniteReward = 4,      // index: trajectory (reward not finite in the compute dtype)
  kNonFiniteAdvantage = 5,   // index: trajectory (reward - baseline not finite in the compute dtype)
  kBadLogProb = 6,           // index: token (NaN, infinite or positive on a policy token)
  kBadBehaviorLogProb = 7,   // index: token
  kBadEntropy = 8,           // index: token (non-finite on a policy token, filter on)
  kRatioOverflow = 9,        // index: token (exp(log_prob - behavior) overflowed on an active token)
  kGradientOverflow = 10,    // index: token (the gradient overflowed the dtype of log_probs)
};
constexpr int kNumErrorCodes = 11;
const char* error_code_name(ErrorCode code);  // "ok", "bad_cu_seqlens", ...

// Error record. On CUDA it lives in device memory as two int64 values {code, index} so that a
// graph-captured launch can leave it for the caller to check later.
struct Error {
  ErrorCode code = ErrorCode::kOk;
  int64_t index = -1;
};

// ---------------------------------------------------------------------------------------------
// CPU path. Runs on the calling thread plus up to num_threads - 1 pool threads. Results do not
// depend on num_threads. Returns the first error by priority (code, then index).
Error loss_forward_cpu(const LossParams& p, int num_threads);

// ---------------------------------------------------------------------------------------------
// CUDA path (available when has_cuda()). `stream` is a cudaStream_t passed as void*.
// `workspace` is device memory of at least cuda_workspace_bytes(N, B, filter) bytes (any
// content); `error_record` is device memory of two int64 {code, index} that the launch
// overwrites. When `synchronize_errors` is true the call waits for the stream, reads the record
// and returns it; otherwise it returns kOk immediately (graph-capturable: no host
// synchronization) and the caller reads error_record later.
bool has_cuda();
size_t cuda_workspace_bytes(int64_t num_tokens, int64_t batch, bool filter);
Error loss_forward_cuda(const LossParams& p, void* workspace, int64_t* error_record, void* stream,
                        bool synchronize_errors);

}  // namespace flashreinforce
