// The framework-agnostic C++ API of the fused FlashREINFORCE loss.
//
// Everything here is plain C++17: raw pointers, lengths, a dtype enum and (for CUDA) a stream
// handle passed as an opaque pointer. No PyTorch and no pybind11 header is included anywhere in
// the core, so one built library serves any PyTorch release. The contract implemented by both the
// CPU and the CUDA path is ../../../shared/SEMANTICS.md (copied in spirit to docs/kernel.md).
#pragma once

#include <cstddef>
#include <cstdint>

namespace flashreinforce {

// Element types the core reads and writes.
enum class DType : int32_t {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat64 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kBool = 6,   // one byte per element, 0 or 1
  kInt8 = 7,   // only accepted for rewards
  kUInt8 = 8,  // only accepted for rewards
  kInt16 = 9,  // only accepted for rewards
};

const char* dtype_name(DType dtype);
bool is_floating(DType dtype);
size_t dtype_size(DType dtype);

// Per-trajectory loss scale s_i (SETTINGS.md "flash_loss_agg").
enum class LossAgg : int32_t {
  kSeqMeanTokenMean = 0,     // s_i = 1 / (T_i * num_trajectories)        (the method)
  kTokenMean = 1,            // s_i = 1 / num_policy_tokens                 (one mean over all tokens)
  kSeqMeanTokenSumNorm = 2,  // s_i = 1 / (loss_scale_factor * num_trajectories)
};

// Errors found while computing (value errors the bindings turn into Python exceptions).
// The numeric order is the reporting priority: when several errors are present the smallest code
// wins, then the smallest index. Both paths report the same (code, index) for the same input.
enum class ErrorCode : int32_t {
  kOk = 0,
  kBadCuSeqlens = 1,        // index: i with cu[i] > cu[i+1]; or 0 / B for a bad first / last offset
  kNoPolicyTokens = 2,      // index: trajectory
  kNonFiniteReward = 3,     // index: trajectory
  kBadLogProb = 4,          // index: token (NaN, infinite or positive on a policy token)
  kBadBehaviorLogProb = 5,  // index: token
  kBadEntropy = 6,          // index: token (non-finite on a policy token, filter on)
  kRatioOverflow = 7,       // index: token (exp(log_prob - behavior) overflowed on an active token)
};

// Error record. On CUDA it lives in device memory as two int64 values {code, index} so that a
// graph-captured launch can leave it for the caller to check later.
struct Error {
  ErrorCode code = ErrorCode::kOk;
  int64_t index = -1;
  double value = 0.0;  // the offending value where known (CPU path), else 0
};

// All inputs of one loss evaluation. Token arrays have num_tokens elements, per-trajectory arrays
// batch elements. Pointers are host pointers for the CPU path and device pointers for the CUDA path.
struct LossInputs {
  int64_t num_tokens = 0;  // N
  int64_t batch = 0;       // B

  const void* log_probs = nullptr;  // [N] float*: current-policy log-probabilities
  DType log_probs_dtype = DType::kFloat32;
  const void* behavior_log_probs = nullptr;  // [N] float*: behavior-policy log-probabilities
  DType behavior_dtype = DType::kFloat32;
  const void* rewards = nullptr;  // [B] any real dtype
  DType rewards_dtype = DType::kFloat32;

  // Offsets: cu_seqlens [B+1] int32/int64, or nullptr for the padded form with uniform rows of
  // padded_row_length tokens (cu[i] = i * padded_row_length).
  const void* cu_seqlens = nullptr;
  DType cu_dtype = DType::kInt64;
  int64_t padded_row_length = 0;

  const uint8_t* action_mask = nullptr;  // [N] bool, or nullptr: every token is a policy token
  const void* entropies = nullptr;       // [N] float*, only read when the filter is on
  DType entropies_dtype = DType::kFloat32;
  const uint8_t* failures = nullptr;  // [B] bool, only read when the filter is on

  double delta = 3e-3;                    // trust threshold (inclusive); inf disables the gate
  double negative_token_fraction = 1.0;  // q in [0, 1]; < 1 enables the entropy filter
  bool has_reward_baseline = false;
  double reward_baseline = 0.0;
  int64_t num_trajectories = 0;  // <= 0: use batch
  LossAgg loss_agg = LossAgg::kSeqMeanTokenMean;
  double loss_scale_factor = 0.0;  // seq-mean-token-sum-norm only
  int64_t num_policy_tokens = 0;   // token-mean only; <= 0: sum of T_i
  bool no_is = false;              // current policy as the detached denominator
};

// Outputs, preallocated by the caller. Float outputs use the compute dtype C (float64 when
// log_probs is float64, else float32); grad uses log_probs' dtype.
struct LossOutputs {
  void* loss = nullptr;            // [] C
  void* grad = nullptr;            // [N] dtype of log_probs: d loss / d log_probs (zeros off policy)
  void* advantages = nullptr;      // [B] C
  void* sequence_kl = nullptr;     // [B] C
  uint8_t* admitted = nullptr;     // [B] bool
  void* acceptance_rate = nullptr; // [] C
  int64_t* policy_tokens = nullptr;    // [B] int64
  int64_t* retained_tokens = nullptr;  // [B] int64
};

// Compute dtype of a given log_probs dtype.
DType compute_dtype(DType log_probs_dtype);

// Checks the scalar options (delta, q, loss_agg with its scale factor, counts, baseline).
// Returns nullptr when valid, else a static message naming the argument.
const char* check_options(const LossInputs& in);

// ---------------------------------------------------------------------------------------------
// CPU path. Runs on the calling thread plus up to num_threads - 1 pool threads. Results do not
// depend on num_threads. Returns the first error by priority (code, then index).
Error loss_forward_cpu(const LossInputs& in, const LossOutputs& out, int num_threads);

// ---------------------------------------------------------------------------------------------
// CUDA path (available when has_cuda()). `stream` is a cudaStream_t passed as void*.
// `workspace` is device memory of at least cuda_workspace_bytes(in) bytes (any content);
// `error_record` is device memory of two int64 {code, index} that the launch overwrites.
// When `synchronize_errors` is true the call waits for the stream, reads the record and returns
// it; otherwise it returns kOk immediately (graph-capturable: no host synchronization) and the
// caller reads error_record later.
bool has_cuda();
size_t cuda_workspace_bytes(const LossInputs& in);
Error loss_forward_cuda(const LossInputs& in, const LossOutputs& out, void* workspace,
                        int64_t* error_record, void* stream, bool synchronize_errors);

}  // namespace flashreinforce
