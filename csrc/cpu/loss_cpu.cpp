// CPU path of the fused FlashREINFORCE loss (driver). See docs/kernel.md for the design:
//   1. offsets: validate cu_seqlens (or build the padded ones), count T_i from the mask;
//   2. per trajectory: advantages (finite in the compute dtype), loss scale, keep mode of the filter;
//   3. filter: validate entropies, select the kept tokens of each failed trajectory by a radix
//      select on order-preserving keys, and write keep flags (1 / 0) into the gradient buffer;
//   4. main pass over fixed chunks (main_pass_impl.h): KL sums, validation, gradient, loss terms;
//   5. combine the per-chunk partial sums in a fixed order, gate, zero rejected trajectories.
// No temporary buffer proportional to N is allocated: only O(B + N / kChunk) bookkeeping and a
// small per-thread scratch for the filter's candidate tokens.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <limits>
#include <utility>
#include <vector>

#include "flashreinforce/core.h"
#include "flashreinforce/dtype_load.h"
#include "flashreinforce/token_math.h"
#include "flashreinforce/trajectory.h"
#include "main_pass.h"
#include "thread_pool.h"

namespace flashreinforce {
namespace cpu {
namespace {

using math::BFloat16;
using math::Half;

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
      // bool tensors hold bytes 0 / 1; a piece has at most kChunk tokens (32-bit lanes suffice).
      const uint8_t* __restrict m = mask + t;
      const int32_t len = static_cast<int32_t>(end - t);
      int32_t sum = 0;
      if (len < 64) {  // short pieces: no vector set-up and horizontal sum
        for (int32_t u = 0; u < len; ++u) sum += m[u];
      } else {
#pragma omp simd reduction(+ : sum)
        for (int32_t u = 0; u < len; ++u) sum += m[u];
      }
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

// Instruction set of the main pass, the filter, the decode attention and the skinny products
// (skinny_gemm_cpu.cpp, which runs its AVX-512 kernels only under "avx512"): the best one compiled in
// that the CPU supports, or a lower one named by the environment variable FLASHREINFORCE_CPU_ISA
// (generic, avx2 or avx512; for tests and benchmarks: a name above what the CPU supports, or
// unknown, gives the best one). AVX-512 BF16 (the bfloat16 decode attention's scores and the
// skinny products' bfloat16 kernel) is used where the CPU has it, unless the name is avx512, which
// keeps the AVX-512 path other CPUs take.
// This is the only place that decides; the instruction-set files are entered only through the table
// built here, after the CPU check (main_pass.h).
enum class Isa { kGeneric, kAvx2, kAvx512 };

Isa best_supported_isa() {
  Isa best = Isa::kGeneric;
#if defined(FLASHREINFORCE_HAVE_AVX2) || defined(FLASHREINFORCE_HAVE_AVX512)
  __builtin_cpu_init();  // also checks that the OS saves the vector registers (XGETBV)
#endif
#if defined(FLASHREINFORCE_HAVE_AVX2)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::kAvx2;
#endif
#if defined(FLASHREINFORCE_HAVE_AVX512)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma")) {
    best = Isa::kAvx512;
  }
#endif
  return best;
}

struct Dispatch {
  Isa isa = Isa::kGeneric;
  bool avx512_bf16 = false;  // AVX-512 BF16 kernels over the AVX-512 ones
  KernelTable table{};
};

const Dispatch& dispatch() {
  static const Dispatch d = [] {
    Dispatch r;
    const Isa best = best_supported_isa();
    r.isa = best;
    bool keep_bf16 = true;
    if (const char* env = std::getenv("FLASHREINFORCE_CPU_ISA")) {
      const std::string want(env);
      if (want == "generic") r.isa = Isa::kGeneric;
      if (want == "avx2" && best == Isa::kAvx512) r.isa = Isa::kAvx2;
      keep_bf16 = want != "avx512";
    }
#if defined(FLASHREINFORCE_HAVE_AVX512_BF16)
    r.avx512_bf16 = r.isa == Isa::kAvx512 && keep_bf16 && __builtin_cpu_supports("avx512bf16");
#else
    (void)keep_bf16;
#endif
    isa_generic::fill_kernels(r.table);
#if defined(FLASHREINFORCE_HAVE_AVX2)
    if (r.isa == Isa::kAvx2) isa_avx2::fill_kernels(r.table);
#endif
#if defined(FLASHREINFORCE_HAVE_AVX512)
    if (r.isa == Isa::kAvx512) isa_avx512::fill_kernels(r.table);
#endif
#if defined(FLASHREINFORCE_HAVE_AVX512_BF16)
    if (r.avx512_bf16) isa_avx512_bf16::fill_decode_attention_bf16(r.table);
#endif
    return r;
  }();
  return d;
}


Error make_error(ErrorCode code, int64_t index) {
  Error e;
  e.code = code;
  e.index = index;
  return e;
}

}  // namespace

const KernelTable& cpu_kernels() { return dispatch().table; }

bool cpu_uses_avx512_bf16() { return dispatch().avx512_bf16; }

// Name of the instruction set the CPU main pass and filter use (float64 log_probs: always generic).
const char* cpu_isa_name() {
  switch (dispatch().isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kGeneric: break;
  }
  return "generic";
}

}  // namespace cpu

Error loss_forward_cpu(const LossParams& p, int num_threads) {
  using namespace cpu;
  const LossOptions& opt = p.options;
  const int64_t n = p.num_tokens(), b = p.batch();
  // A helper joins a few microseconds after its wake-up at best (tasks are claimed dynamically, so
  // a late one costs nothing but the wake-up itself): below ~32k tokens (~40 us) per thread it
  // does not pay.
  constexpr int64_t kMinTokensPerThread = 32768;
  num_threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, n / kMinTokensPerThread)));
  const DType lp_dtype = p.log_probs.dtype, blp_dtype = p.behavior_log_probs.dtype;
  const DType compute = compute_dtype(lp_dtype);
  const bool compute_double = compute == DType::kFloat64;
  const uint8_t* mask = p.action_mask.as<const uint8_t>();

  // 1. Offsets.
  std::vector<int64_t> cu(b + 1);
  if (!p.cu_seqlens.present()) {
    for (int64_t i = 0; i <= b; ++i) cu[i] = i * p.padded_row_length;
  } else if (p.cu_seqlens.dtype == DType::kInt32) {
    const int32_t* c = p.cu_seqlens.as<const int32_t>();
    for (int64_t i = 0; i <= b; ++i) cu[i] = c[i];
  } else {
    std::memcpy(cu.data(), p.cu_seqlens.data, sizeof(int64_t) * (b + 1));
  }
  if (cu[0] != 0) return make_error(ErrorCode::kBadCuSeqlens, 0);
  for (int64_t i = 0; i < b; ++i) {
    if (cu[i + 1] < cu[i]) return make_error(ErrorCode::kBadCuSeqlens, i + 1);
  }
  if (cu[b] != n) return make_error(ErrorCode::kBadCuSeqlens, b);

  std::vector<int64_t> counts;
  if (mask) {
    count_policy_tokens(mask, cu, n, num_threads, counts);
  } else {
    counts.resize(b);
    for (int64_t i = 0; i < b; ++i) counts[i] = cu[i + 1] - cu[i];
  }
  int64_t total_policy = 0;
  for (int64_t i = 0; i < b; ++i) {
    if (counts[i] == 0) return make_error(ErrorCode::kNoPolicyTokens, i);
    total_policy += counts[i];
  }
  if (opt.num_policy_tokens > 0 && opt.num_policy_tokens < total_policy) {
    return make_error(ErrorCode::kTooFewPolicyTokens, total_policy);
  }

  // 2. Per trajectory: advantages, scales, keep modes.
  std::vector<double> rewards(b);
  double reward_sum = 0.0;
  for (int64_t i = 0; i < b; ++i) {
    rewards[i] = load_as_double(p.rewards.data, p.rewards.dtype, i);
    if (!finite_in_compute(rewards[i], compute_double)) return make_error(ErrorCode::kNonFiniteReward, i);
    reward_sum += rewards[i];
  }
  const double baseline = opt.has_reward_baseline ? opt.reward_baseline : reward_sum / static_cast<double>(b);
  for (int64_t i = 0; i < b; ++i) {
    if (!finite_in_compute(rewards[i] - baseline, compute_double)) {
      return make_error(ErrorCode::kNonFiniteAdvantage, i);
    }
  }
  const double num_traj = opt.num_trajectories > 0 ? static_cast<double>(opt.num_trajectories) : static_cast<double>(b);
  const double num_policy = opt.num_policy_tokens > 0 ? static_cast<double>(opt.num_policy_tokens)
                                                      : static_cast<double>(total_policy);
  const bool filter = opt.filter();
  const uint8_t* failures = p.failures.as<const uint8_t>();
  std::vector<double> coef(b);
  std::vector<uint8_t> keep(b);
  std::vector<int64_t> keep_count(b);
  std::vector<int64_t> selected;
  for (int64_t i = 0; i < b; ++i) {
    const double advantage = round_to_compute(compute, rewards[i] - baseline);
    store_compute(p.advantages.data, compute, i, advantage);
    coef[i] = advantage * loss_scale(opt.loss_agg, counts[i], num_traj, num_policy, opt.loss_scale_factor);
    p.policy_tokens.as<int64_t>()[i] = counts[i];
    const KeepPlan plan = keep_plan(filter, filter && failures[i], opt.negative_token_fraction, counts[i]);
    keep[i] = plan.mode;
    keep_count[i] = plan.kept;
    if (plan.mode == kKeepFlags) selected.push_back(i);
  }

  // 3. Filter: validate entropies, then select and write keep flags into grad.
  int64_t bad_entropy = -1;
  if (filter) {
    const int e = static_cast<int>(p.entropies.dtype);
    bad_entropy = cpu_kernels().check_entropies[e](p, num_threads);
    if (bad_entropy >= 0) {
      // Still run the main pass (log-prob errors are reported first), without the selection.
      for (int64_t i : selected) keep[i] = kKeepAll;
    } else if (!selected.empty()) {
      cpu_kernels().select[e][static_cast<int>(lp_dtype)](p, cu, selected, keep_count, num_threads);
    }
  }

  // 4. Main pass.
  using Overflow = MainPassArgs::Overflow;
  const int64_t chunks = num_chunks(n);
  std::vector<double> body_kl(b, 0.0), body_loss(b, 0.0), head_kl(chunks, 0.0), head_loss(chunks, 0.0);
  std::vector<Overflow> body_overflow(b), head_overflow(chunks);
  std::vector<int64_t> head_segment(chunks, -1);
  std::vector<int64_t> bad_lp(chunks, -1), bad_blp(chunks, -1);
  MainPassArgs args;
  args.num_tokens = n;
  args.batch = b;
  args.log_probs = p.log_probs.data;
  args.behavior = p.behavior_log_probs.data;
  args.mask = mask;
  args.grad = p.grad.data;
  args.cu = cu.data();
  args.coef = coef.data();
  args.keep = keep.data();
  args.no_is = opt.no_is;
  args.gate_metric = opt.gate_metric;
  args.truncation = opt.is_truncation;
  args.body_kl = body_kl.data();
  args.body_loss = body_loss.data();
  args.body_overflow = body_overflow.data();
  args.head_segment = head_segment.data();
  args.head_kl = head_kl.data();
  args.head_loss = head_loss.data();
  args.head_overflow = head_overflow.data();
  args.bad_log_prob = bad_lp.data();
  args.bad_behavior = bad_blp.data();
  const MainChunkFn fn = cpu_kernels().main[static_cast<int>(lp_dtype)][static_cast<int>(blp_dtype)];
  parallel_for(num_threads, chunks, [&](int64_t c) { fn(args, c); });

  // 5. Combine in a fixed order, then report errors by priority.
  for (int64_t c = 0; c < chunks; ++c) {
    if (bad_lp[c] >= 0) return make_error(ErrorCode::kBadLogProb, bad_lp[c]);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    if (bad_blp[c] >= 0) return make_error(ErrorCode::kBadBehaviorLogProb, bad_blp[c]);
  }
  if (bad_entropy >= 0) return make_error(ErrorCode::kBadEntropy, bad_entropy);
  auto first_of = [](int64_t a, int64_t c) { return a < 0 ? c : (c < 0 ? a : std::min(a, c)); };
  std::vector<Overflow> overflow(body_overflow);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t s = head_segment[c];
    if (s < 0) continue;
    body_kl[s] += head_kl[c];
    body_loss[s] += head_loss[c];
    overflow[s].ratio = first_of(overflow[s].ratio, head_overflow[c].ratio);
    overflow[s].gradient = first_of(overflow[s].gradient, head_overflow[c].gradient);
  }
  std::vector<uint8_t> admitted(b);
  Overflow first_overflow;
  int64_t num_admitted = 0;
  double loss = 0.0;
  for (int64_t i = 0; i < b; ++i) {
    const double kl = opt.no_is ? 0.0 : round_to_compute(compute, std::max(0.0, body_kl[i] / static_cast<double>(counts[i])));
    const bool ok = kl <= opt.delta;
    admitted[i] = ok;
    store_compute(p.sequence_kl.data, compute, i, kl);
    p.admitted.as<uint8_t>()[i] = ok;
    p.retained_tokens.as<int64_t>()[i] = ok ? keep_count[i] : 0;
    if (ok) {
      ++num_admitted;
      loss += body_loss[i];
      first_overflow.ratio = first_of(first_overflow.ratio, overflow[i].ratio);
      first_overflow.gradient = first_of(first_overflow.gradient, overflow[i].gradient);
    }
  }
  if (first_overflow.ratio >= 0) return make_error(ErrorCode::kRatioOverflow, first_overflow.ratio);
  if (first_overflow.gradient >= 0) return make_error(ErrorCode::kGradientOverflow, first_overflow.gradient);
  std::vector<int64_t> rejected;
  for (int64_t i = 0; i < b; ++i) {
    if (!admitted[i]) rejected.push_back(i);
  }
  const size_t elem = dtype_size(lp_dtype);
  char* grad_bytes = p.grad.as<char>();
  parallel_for(num_threads, static_cast<int64_t>(rejected.size()), [&](int64_t j) {
    const int64_t i = rejected[j];
    // All-zero bits is +0.0 in every float format.
    std::memset(grad_bytes + cu[i] * elem, 0, (cu[i + 1] - cu[i]) * elem);
  });
  // Non-policy tokens of admitted trajectories already hold 0 (written by the main pass).
  store_compute(p.loss.data, compute, 0, loss);
  store_compute(p.acceptance_rate.data, compute, 0, static_cast<double>(num_admitted) / static_cast<double>(b));
  return Error{};
}

}  // namespace flashreinforce
