// The CPU main pass: one fixed-size chunk of tokens at a time.
//
// Per chunk and per trajectory piece inside it, one vectorizable loop reads log_probs,
// behavior_log_probs and the mask once, accumulates the Bernoulli-KL sum, validates the policy
// log-probabilities, and writes the gradient for the case that the trajectory is admitted (the
// driver zeroes rejected trajectories afterwards: rejections are rare, a second read of every
// token is not). Sums are per piece, in double, in an order fixed by the chunk size alone, so
// results do not depend on the number of threads.
//
// main_pass_impl.h and filter_impl.h are compiled once per instruction set (csrc/cpu/main_pass_*.cpp)
// with different target flags. Each of those files defines a single external function,
// isa_<name>::fill_kernels, and nothing else that the linker could share with other files: every
// type and template they instantiate lives in their own namespace (a shared inline function or
// template instance, emitted by several files, may end up as the AVX-512 file's copy in the
// generic code). The driver (loss_cpu.cpp, compiled for the baseline) checks what the CPU
// supports before it calls any of them.
#pragma once

#include <cstdint>
#include <vector>

#include "flashreinforce/core.h"
#include "flashreinforce/decode_attention.h"
#include "flashreinforce/token_math.h"
#include "flashreinforce/trajectory.h"

namespace flashreinforce {
namespace cpu {

// Chunk size in tokens. Fixed (never derived from the thread count) so that the summation order,
// and hence every result bit, is the same for any number of threads.
constexpr int64_t kChunk = 16384;

struct MainPassArgs {
  int64_t num_tokens = 0;
  int64_t batch = 0;
  const void* log_probs = nullptr;
  const void* behavior = nullptr;
  const uint8_t* mask = nullptr;  // nullptr: all policy
  void* grad = nullptr;
  const int64_t* cu = nullptr;      // [B+1] validated offsets
  const double* coef = nullptr;     // [B] A_i * s_i (the gradient is -rho * coef)
  const uint8_t* keep = nullptr;    // [B] KeepMode
  bool no_is = false;
  GateMetric gate_metric = GateMetric::kBinaryKl;  // the gate's per-token term (the KL unless another)
  double truncation = kNoTruncation;               // importance ratios clipped at this value (inf: not)

  // Overflow records: the first kept token whose importance ratio is not finite ("ratio"), and
  // the first kept token whose ratio is finite but whose gradient does not fit the dtype of
  // log_probs ("gradient"); -1 when none.
  struct Overflow {
    int64_t ratio = -1;
    int64_t gradient = -1;
  };

  // Per trajectory: sums of the piece that starts inside a chunk ("body"); every trajectory
  // starts in exactly one chunk.
  double* body_kl = nullptr;
  double* body_loss = nullptr;
  Overflow* body_overflow = nullptr;
  // Per chunk: the piece of the trajectory that started in an earlier chunk ("head").
  int64_t* head_segment = nullptr;   // that trajectory, or -1 when the chunk starts a trajectory
  double* head_kl = nullptr;
  double* head_loss = nullptr;
  Overflow* head_overflow = nullptr;
  // Per chunk: first invalid policy log_prob / behavior_log_prob index, or -1.
  int64_t* bad_log_prob = nullptr;
  int64_t* bad_behavior = nullptr;
};

using MainChunkFn = void (*)(const MainPassArgs&, int64_t chunk);

// Entropy filter entry points (filter_impl.h). `selected` lists the failed trajectories that keep
// keep_count[i] of their tokens (0 < keep_count[i] < T_i); their flags are written into p.grad.
using SelectFn = void (*)(const LossParams& p, const std::vector<int64_t>& cu,
                          const std::vector<int64_t>& selected, const std::vector<int64_t>& keep_count,
                          int num_threads);
// First policy token with a non-finite entropy, or -1.
using CheckEntropiesFn = int64_t (*)(const LossParams& p, int num_threads);

// Decode-step attention of one (request, key/value head) task (decode_attention_impl.h), with
// `scratch` of groups * (2 head_dim + length + 1) + length floats; `next_task`: the task the same
// thread runs next, whose first keys it prefetches (-1: none).
using DecodeAttentionFn = void (*)(const DecodeAttentionParams& p, int64_t task, int64_t next_task, float* scratch);

// Kernels indexed by the float DType values: main[log_probs][behavior], select[entropies][log_probs],
// check_entropies[entropies], decode_attention[q/k/v dtype] (float32 and bfloat16 only).
struct KernelTable {
  MainChunkFn main[4][4];
  SelectFn select[4][4];
  CheckEntropiesFn check_entropies[4];
  DecodeAttentionFn decode_attention[4];
};

// The table of the instruction set chosen for this CPU (loss_cpu.cpp decides, once).
const KernelTable& cpu_kernels();

// The entry points of the instruction-set files: each writes its kernels into the table. Generic
// writes every entry; AVX2 and AVX-512 overwrite the entries they specialize (all but the float64
// log_probs row, which stays generic). Call the AVX2 / AVX-512 ones only on a CPU that has them
// (and only when compiled in: FLASHREINFORCE_HAVE_AVX2 / FLASHREINFORCE_HAVE_AVX512).
namespace isa_generic {
void fill_kernels(KernelTable& table);
}
namespace isa_avx2 {
void fill_kernels(KernelTable& table);
}
namespace isa_avx512 {
void fill_kernels(KernelTable& table);
}
// The bfloat16 decode attention with AVX-512 BF16 (decode_attention_avx512_bf16.cpp): over the AVX-512
// table's entry, only on a CPU with that extension (FLASHREINFORCE_HAVE_AVX512_BF16).
namespace isa_avx512_bf16 {
void fill_decode_attention_bf16(KernelTable& table);
}

// Whether the CPU path uses AVX-512 BF16 instructions (loss_cpu.cpp decides: the instruction set is
// "avx512", the CPU has the extension, and FLASHREINFORCE_CPU_ISA does not name "avx512", which keeps
// AVX-512 without it).
bool cpu_uses_avx512_bf16();

template <class T> struct DTypeOf;
template <> struct DTypeOf<math::Half> { static constexpr DType value = DType::kFloat16; };
template <> struct DTypeOf<math::BFloat16> { static constexpr DType value = DType::kBFloat16; };
template <> struct DTypeOf<float> { static constexpr DType value = DType::kFloat32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::kFloat64; };

}  // namespace cpu
}  // namespace flashreinforce
