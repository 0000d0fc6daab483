// C++ tests of the framework-agnostic core (CPU path) against a double-precision computation
// written here from docs/semantics.md, on random segments and edge cases. Run through CTest
// (python_tests/ops/test_cpp_core.py builds and runs it). The random cases come from a seed, fresh each run
// and printed with the command that replays it: `test_core --seed SEED` (or `test_core SEED`, or
// FR_TEST_SEED=SEED in the environment, which also reaches it through ctest).
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "flashreinforce/core.h"
#include "flashreinforce/decode_attention.h"
#include "flashreinforce/layer_glue.h"
#include "flashreinforce/token_math.h"

#if defined(FR_HAVE_QUADMATH)
#include <quadmath.h>
#endif

using namespace flashreinforce;

static int g_failures = 0;
static std::string g_case;

#define CHECK(cond)                                                                            \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      std::fprintf(stderr, "FAIL [%s] %s:%d: %s\n", g_case.c_str(), __FILE__, __LINE__, #cond); \
      ++g_failures;                                                                            \
    }                                                                                          \
  } while (0)

// ---------------------------------------------------------------------------------------------
// Double-precision computation (straightforward; long double for the cancelling KL).

struct Problem {
  std::vector<int64_t> cu;
  std::vector<double> lp, blp, ent;  // values as doubles (exactly representable in the input dtype)
  std::vector<uint8_t> mask, failures;
  std::vector<double> rewards;
  double delta = INFINITY, q = 1.0;
  bool no_is = false;
  GateMetric metric = GateMetric::kBinaryKl;
  double trunc = INFINITY;
  LossAgg agg = LossAgg::kSeqMeanTokenMean;
  double lsf = 0.0;
  int64_t num_policy_tokens = 0;
};

struct Result {
  double loss = 0;
  std::vector<double> grad, adv, kl, rate;
  std::vector<uint8_t> admitted;
  std::vector<int64_t> policy, retained;
};

// The cancelling Bernoulli KL needs more than long double: log p - log q of nearly equal p, q
// keeps only ~1e-20 absolute accuracy there, which is 1e-4 of a KL of 1e-16. __float128
// (113-bit significand) where available.
#if defined(FR_HAVE_QUADMATH)
using Wide = __float128;
static Wide wide_exp(Wide x) { return expq(x); }
static Wide wide_log(Wide x) { return logq(x); }
static Wide wide_log1p(Wide x) { return log1pq(x); }
#else
using Wide = long double;
static Wide wide_exp(Wide x) { return std::exp(x); }
static Wide wide_log(Wide x) { return std::log(x); }
static Wide wide_log1p(Wide x) { return std::log1p(x); }
#endif

static double kl_exact(double behavior, double current, bool f32) {
  // Clamp bounds in the compute dtype: float32 rounds 1 - 1e-6 to 1 - 1.0133e-6.
  const Wide lo = f32 ? (Wide)9.99999997475242708e-07 : (Wide)1e-6;
  const Wide hi = f32 ? (Wide)0.999998986721038818359375 : (Wide)(1.0 - 1e-6);
  Wide p = wide_exp((Wide)behavior), q = wide_exp((Wide)current);
  p = p < lo ? lo : (p > hi ? hi : p);
  q = q < lo ? lo : (q > hi ? hi : q);
  return (double)(p * (wide_log(p) - wide_log(q)) + (1 - p) * (wide_log1p(-p) - wide_log1p(-q)));
}

// The float32 KL of the log-probabilities as the kernel clamps them (log side, the float32 bounds
// of math::Clamp), in wide arithmetic: the arithmetic alone, also next to the clamps, where the
// bounds of kl_exact (on the probability side) differ from the kernel's by a rounding.
static double kl_exact_logs(float behavior, float current) {
  const double lo = math::Clamp<float>::kLogLo, hi = math::Clamp<float>::kLogHi;
  const Wide a = (Wide)std::min(hi, std::max(lo, (double)behavior));
  const Wide b = (Wide)std::min(hi, std::max(lo, (double)current));
  const Wide p = wide_exp(a), q = wide_exp(b);
  return (double)(p * (a - b) + (1 - p) * (wide_log1p(-p) - wide_log1p(-q)));
}

// k3 = e^d - 1 - d, d = current - behavior, in wide arithmetic (a series near 0, where expm1 - d cancels).
static double k3_exact(double behavior, double current) {
  const Wide d = (Wide)current - (Wide)behavior;
  if (d < (Wide)0.01 && d > (Wide)-0.01) {
    Wide term = d * d / 2, sum = 0;
    for (int k = 3; k < 20; ++k) {
      sum += term;
      term *= d / k;
    }
    return (double)sum;
  }
  return (double)(wide_exp(d) - 1 - d);
}

// The gate metric's per-token term (docs/semantics.md, "Gate metrics"), independent of the kernel's.
static double gate_exact(GateMetric metric, double behavior, double current, bool f32) {
  switch (metric) {
    case GateMetric::kKpop: return std::max(kl_exact(behavior, current, f32), kl_exact(current, behavior, f32));
    case GateMetric::kK3: return k3_exact(behavior, current);
    case GateMetric::kLogRatio: return std::fabs(current - behavior);
    case GateMetric::kBinaryKl: break;
  }
  return kl_exact(behavior, current, f32);
}

static Result expected(const Problem& P, bool f32) {
  const int64_t b = static_cast<int64_t>(P.rewards.size());
  const int64_t n = static_cast<int64_t>(P.lp.size());
  Result R;
  R.grad.assign(n, 0.0);
  double mean = 0;
  for (double r : P.rewards) mean += r;
  mean /= b;
  for (int64_t i = 0; i < b; ++i) {
    std::vector<int64_t> pos;
    for (int64_t t = P.cu[i]; t < P.cu[i + 1]; ++t)
      if (P.mask.empty() || P.mask[t]) pos.push_back(t);
    const int64_t T = static_cast<int64_t>(pos.size());
    double kl = 0;
    for (int64_t t : pos) kl += gate_exact(P.metric, P.blp[t], P.lp[t], f32);
    double seq_kl = P.no_is ? 0.0 : std::max(0.0, kl / T);
    const bool ok = P.no_is || seq_kl <= P.delta;
    std::vector<int64_t> kept = pos;
    if (P.q < 1.0 && P.failures[i]) {
      const int64_t k = static_cast<int64_t>(std::ceil(P.q * T));
      std::stable_sort(kept.begin(), kept.end(), [&](int64_t a, int64_t c) { return P.ent[a] > P.ent[c]; });
      kept.resize(std::min<int64_t>(k, T));
    }
    const double a = P.rewards[i] - mean;
    double s = 1.0 / (T * (double)b);
    if (P.agg == LossAgg::kSeqMeanTokenSumNorm) s = 1.0 / (P.lsf * b);
    if (ok) {
      for (int64_t t : kept) {
        const double rho = P.no_is ? 1.0 : std::min(std::exp(P.lp[t] - P.blp[t]), P.trunc);
        R.grad[t] = -rho * a * s;
        R.loss += R.grad[t] * P.lp[t];
      }
    }
    R.adv.push_back(a);
    R.kl.push_back(seq_kl);
    R.admitted.push_back(ok);
    R.policy.push_back(T);
    R.retained.push_back(ok ? (int64_t)kept.size() : 0);
  }
  return R;
}

// ---------------------------------------------------------------------------------------------
// Running the core.

template <class T> struct Typed;
template <> struct Typed<float> {
  static constexpr DType kType = DType::kFloat32;
};
template <> struct Typed<double> {
  static constexpr DType kType = DType::kFloat64;
};

template <class T> static TensorView view(std::vector<T>& v, DType dtype) {
  TensorView t;
  t.data = v.data();
  t.dtype = dtype;
  t.numel = static_cast<int64_t>(v.size());
  return t;
}
template <class T> static TensorView scalar_view(T& x, DType dtype) {
  TensorView t;
  t.data = &x;
  t.dtype = dtype;
  t.numel = 1;
  return t;
}

// Storage for one run of the core: the inputs in type T and the outputs, with their views.
template <class T>
struct Run {
  std::vector<T> lp, blp, ent, grad, adv, kl;
  std::vector<double> rewards;
  std::vector<int64_t> cu, policy, retained;
  std::vector<uint8_t> mask, failures, admitted;
  T loss = 0, rate = 0;
  LossParams params;

  explicit Run(const Problem& P)
      : lp(P.lp.begin(), P.lp.end()), blp(P.blp.begin(), P.blp.end()), ent(P.ent.begin(), P.ent.end()),
        grad(P.lp.size()), adv(P.rewards.size()), kl(P.rewards.size()), rewards(P.rewards), cu(P.cu),
        policy(P.rewards.size()), retained(P.rewards.size()), mask(P.mask), failures(P.failures),
        admitted(P.rewards.size()) {
    const DType t = Typed<T>::kType;
    LossParams& p = params;
    p.log_probs = view(lp, t);
    p.behavior_log_probs = view(blp, t);
    p.rewards = view(rewards, DType::kFloat64);
    p.cu_seqlens = view(cu, DType::kInt64);
    if (!mask.empty()) p.action_mask = view(mask, DType::kBool);
    if (P.q < 1.0) {
      p.entropies = view(ent, t);
      p.failures = view(failures, DType::kBool);
    }
    p.options.delta = P.delta;
    p.options.negative_token_fraction = P.q;
    p.options.no_is = P.no_is;
    p.options.gate_metric = P.metric;
    p.options.is_truncation = P.trunc;
    p.options.loss_agg = P.agg;
    p.options.loss_scale_factor = P.lsf;
    p.options.num_policy_tokens = P.num_policy_tokens;
    p.loss = scalar_view(loss, t);
    p.grad = view(grad, t);
    p.advantages = view(adv, t);
    p.sequence_kl = view(kl, t);
    p.admitted = view(admitted, DType::kBool);
    p.acceptance_rate = scalar_view(rate, t);
    p.policy_tokens = view(policy, DType::kInt64);
    p.retained_tokens = view(retained, DType::kInt64);
  }
};

template <class T>
static Error run_core(const Problem& P, Result& out, int threads) {
  Run<T> run(P);
  const char* problem = check_params(run.params);
  if (problem != nullptr) {
    std::fprintf(stderr, "  check_params: %s\n", problem);
    CHECK(problem == nullptr);
    return Error{};
  }
  const Error e = loss_forward_cpu(run.params, threads);
  out.loss = run.loss;
  out.grad.assign(run.grad.begin(), run.grad.end());
  out.adv.assign(run.adv.begin(), run.adv.end());
  out.kl.assign(run.kl.begin(), run.kl.end());
  out.admitted = run.admitted;
  out.policy = run.policy;
  out.retained = run.retained;
  out.rate = {static_cast<double>(run.rate)};
  return e;
}

static void compare(const Problem& P, const Result& got, bool f32) {
  const Result want = expected(P, f32);
  const size_t b = P.rewards.size();
  double gmax = 0, terms = 0;
  for (double g : want.grad) gmax = std::max(gmax, std::fabs(g));
  for (size_t t = 0; t < want.grad.size(); ++t) {
    if (want.grad[t] != 0) terms += std::fabs(want.grad[t] * P.lp[t]);
  }
  CHECK(got.policy == want.policy);
  bool same_admission = true;
  for (size_t i = 0; i < b; ++i) {
    const double tol = f32 ? 5e-3 * want.kl[i] + 1e-9 : 1e-10 * want.kl[i] + 1e-300;
    if (!(std::fabs(got.kl[i] - want.kl[i]) <= tol)) {
      std::fprintf(stderr, "  kl[%zu] = %.17g, want %.17g\n", i, got.kl[i], want.kl[i]);
      CHECK(false);
    }
    const bool far = std::fabs(want.kl[i] - P.delta) > 1e-2 * P.delta;
    if (far) CHECK(got.admitted[i] == want.admitted[i]);
    same_admission = same_admission && got.admitted[i] == want.admitted[i];
  }
  if (!same_admission) return;
  CHECK(got.retained == want.retained);
  const double gtol = (f32 ? 1e-5 : 1e-10) * gmax;
  for (size_t t = 0; t < want.grad.size(); ++t) {
    if (!(std::fabs(got.grad[t] - want.grad[t]) <= gtol)) {
      std::fprintf(stderr, "  grad[%zu] = %.17g, want %.17g\n", t, got.grad[t], want.grad[t]);
      CHECK(false);
      break;
    }
  }
  CHECK(std::fabs(got.loss - want.loss) <= (f32 ? 1e-5 : 1e-10) * terms + 1e-300);
}

// Random problem: lengths from `lengths`, 75% policy tokens (first token of each trajectory is
// a prompt token unless it is the only one), masked slots hold NaN / inf garbage; log-probs down
// to -depth.
static Problem random_problem(std::mt19937_64& rng, const std::vector<int64_t>& lengths, double spread, double q,
                              bool ties, double depth = 6.0) {
  Problem P;
  std::uniform_real_distribution<double> u(0, 1);
  std::normal_distribution<double> nrm(0, 1);
  P.cu.push_back(0);
  for (int64_t L : lengths) P.cu.push_back(P.cu.back() + L);
  const int64_t n = P.cu.back();
  P.mask.assign(n, 0);
  P.lp.resize(n);
  P.blp.resize(n);
  P.ent.resize(n);
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t a = P.cu[i], b = P.cu[i + 1];
    bool any = false;
    for (int64_t t = a; t < b; ++t) {
      P.mask[t] = (t > a || b - a == 1) && u(rng) < 0.75;
      any = any || P.mask[t];
    }
    if (!any) P.mask[b - 1] = 1;
  }
  for (int64_t t = 0; t < n; ++t) {
    // Round to float so the float32 run sees exactly these values.
    const double x = (double)(float)(-depth * u(rng) * u(rng));
    const double y = (double)(float)std::min(0.0, x + spread * nrm(rng));
    P.lp[t] = P.mask[t] ? x : NAN;
    P.blp[t] = P.mask[t] ? y : INFINITY;
    P.ent[t] = P.mask[t] ? (ties ? 0.5 * (double)(rng() % 3) : (double)(float)(5.0 * u(rng))) : NAN;
  }
  for (size_t i = 0; i < lengths.size(); ++i) {
    P.rewards.push_back(u(rng) < 0.5 ? 1.0 : 0.0);
    P.failures.push_back(u(rng) < 0.5);
  }
  P.q = q;
  return P;
}

template <class T>
static void check_case(const std::string& name, const Problem& P) {
  g_case = name + (sizeof(T) == 4 ? " [float32]" : " [float64]");
  Result got;
  const Error e = run_core<T>(P, got, 2);
  CHECK(e.code == ErrorCode::kOk);
  if (e.code == ErrorCode::kOk) compare(P, got, sizeof(T) == 4);
}

// A seed as the command line or FR_TEST_SEED gives it: decimal digits only, within 64 bits.
static bool parse_seed(const char* text, uint64_t& seed) {
  if (text == nullptr || *text == '\0') return false;
  for (const char* c = text; *c != '\0'; ++c) {
    if (*c < '0' || *c > '9') return false;
  }
  errno = 0;
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text, &end, 10);
  if (errno == ERANGE || *end != '\0') return false;
  seed = static_cast<uint64_t>(value);
  return true;
}

static void usage(const char* program) {
  std::fprintf(stderr,
               "usage: %s [--seed SEED | SEED]\n"
               "  the random cases come from SEED, else from the environment variable FR_TEST_SEED, else from a\n"
               "  fresh seed; the seed and the command that replays it are printed either way\n",
               program);
}

// ---------------------------------------------------------------------------------------------
// Decode attention (flashreinforce/decode_attention.h) against a double computation, on a random
// case: strided queries, a cache buffer longer than the length read, masked positions (and, with
// `empty_request`, one request with none attended), float32 or bfloat16 storage, 1 and 2 threads.
static void check_decode_attention(std::mt19937_64& rng, DType dtype, int64_t B, int64_t H, int64_t G, int64_t D,
                                   int64_t L, bool empty_request) {
  const bool bf16 = dtype == DType::kBFloat16;
  g_case = "decode attention " + std::string(bf16 ? "bf16" : "f32") + " B" + std::to_string(B) + " H" +
           std::to_string(H) + " G" + std::to_string(G) + " D" + std::to_string(D) + " L" + std::to_string(L);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<double> u(0, 1);
  const int64_t cap = L + 3, q_group = D + 5;  // cache capacity beyond L; padded query rows
  const int64_t q_head = G * q_group, q_batch = H * q_head + 7;
  const int64_t kv_pos = D, kv_head = cap * D, kv_batch = H * kv_head;
  const int64_t mask_batch = L + 2;
  // Values stored in the dtype, and the doubles they represent.
  auto fill = [&](int64_t n, std::vector<uint16_t>& bits, std::vector<float>& f32, std::vector<double>& exact) {
    bits.assign(n, 0), f32.assign(n, 0.0f), exact.assign(n, 0.0);
    for (int64_t i = 0; i < n; ++i) {
      const float x = normal(rng);
      if (bf16) {
        bits[i] = math::float_to_bf16(x);
        exact[i] = math::bf16_to_float(bits[i]);
      } else {
        f32[i] = x;
        exact[i] = x;
      }
    }
  };
  std::vector<uint16_t> qb, kb, vb;
  std::vector<float> qf, kf, vf;
  std::vector<double> qx, kx, vx;
  fill(B * q_batch, qb, qf, qx);
  fill(B * kv_batch, kb, kf, kx);
  fill(B * kv_batch, vb, vf, vx);
  std::vector<uint8_t> mask(B * mask_batch, 0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < L; ++j) mask[b * mask_batch + j] = u(rng) < 0.8 ? 1 : 0;
    mask[b * mask_batch + L - 1] = 1;  // this step's own token
    if (empty_request && b == B / 2) std::fill(mask.begin() + b * mask_batch, mask.begin() + b * mask_batch + L, 0);
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  DecodeAttentionParams p;
  p.dtype = dtype;
  p.batch = B, p.kv_heads = H, p.groups = G, p.head_dim = D, p.length = L, p.scale = scale;
  p.q = bf16 ? static_cast<const void*>(qb.data()) : qf.data();
  p.k = bf16 ? static_cast<const void*>(kb.data()) : kf.data();
  p.v = bf16 ? static_cast<const void*>(vb.data()) : vf.data();
  p.q_stride_batch = q_batch, p.q_stride_head = q_head, p.q_stride_group = q_group;
  p.k_stride_batch = p.v_stride_batch = kv_batch;
  p.k_stride_head = p.v_stride_head = kv_head;
  p.k_stride_pos = p.v_stride_pos = kv_pos;
  p.mask = mask.data(), p.mask_stride_batch = mask_batch;
  const int64_t n_out = B * H * G * D;
  std::vector<uint16_t> out_bits[2];
  std::vector<float> out_f32[2];
  for (int t = 0; t < 2; ++t) {
    out_bits[t].assign(n_out, 0xffff), out_f32[t].assign(n_out, NAN);
    p.out = bf16 ? static_cast<void*>(out_bits[t].data()) : out_f32[t].data();
    CHECK(std::string(decode_attention_check(p)).empty());
    decode_attention_cpu(p, t + 1);
  }
  CHECK(out_bits[0] == out_bits[1]);
  CHECK(std::memcmp(out_f32[0].data(), out_f32[1].data(), n_out * sizeof(float)) == 0);
  // float32 scores, softmax and sums: within 1e-5 of the absolute mass sum_j p_j |v_j| (bfloat16
  // output: plus its own rounding, 2^-9 relative).
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        std::vector<double> sc(L, -INFINITY);
        double mx = -INFINITY;
        for (int64_t j = 0; j < L; ++j) {
          if (!mask[b * mask_batch + j]) continue;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) {
            dot += qx[b * q_batch + h * q_head + g * q_group + d] * kx[b * kv_batch + h * kv_head + j * kv_pos + d];
          }
          sc[j] = dot * scale;
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j < L; ++j) sum += std::isfinite(sc[j]) ? std::exp(sc[j] - mx) : 0.0;
        for (int64_t d = 0; d < D; ++d) {
          double want = 0, mass = 0;
          for (int64_t j = 0; j < L; ++j) {
            if (!std::isfinite(sc[j])) continue;
            const double w = std::exp(sc[j] - mx) / sum * vx[b * kv_batch + h * kv_head + j * kv_pos + d];
            want += w;
            mass += std::fabs(w);
          }
          const int64_t o = ((b * H + h) * G + g) * D + d;
          const double got = bf16 ? math::bf16_to_float(out_bits[0][o]) : out_f32[0][o];
          if (!std::isfinite(mx)) {  // no attended position: zeros
            CHECK(got == 0.0);
            continue;
          }
          const double tol = 1e-5 * mass + (bf16 ? std::ldexp(std::fabs(want), -8) : 0.0);
          CHECK(std::fabs(got - want) <= tol);
        }
      }
    }
  }
  // The structural check names what is wrong.
  DecodeAttentionParams bad = p;
  bad.dtype = DType::kFloat64;
  CHECK(std::string(decode_attention_check(bad)).find("dtype") != std::string::npos);
  if (L > 1) {  // a single position has no stride to check
    bad = p;
    bad.k_stride_pos = D - 1;
    CHECK(std::string(decode_attention_check(bad)).find("k_stride_pos") != std::string::npos);
  }
  bad = p;
  bad.mask = nullptr;
  CHECK(std::string(decode_attention_check(bad)).find("null") != std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// The learner's RMS norm and SwiGLU with their gradients (flashreinforce/layer_glue.h) against double
// computations of the same float32 inputs, and the same bits on 1 and 3 threads (sums whose order
// depends on the sizes only). Values of a few units, as a decoder layer's activations.
static void check_layer_glue(std::mt19937_64& rng, int64_t rows, int64_t hidden) {
  g_case = "layer glue rows " + std::to_string(rows) + " hidden " + std::to_string(hidden);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto draw = [&](int64_t n, float scale) {
    std::vector<float> v(n);
    for (float& x : v) x = scale * normal(rng);
    return v;
  };
  const std::vector<float> x = draw(rows * hidden, 3.0f), w = draw(hidden, 1.0f), g = draw(rows * hidden, 1.0f);
  std::vector<float> out[2], inv[2], gx[2], gw[2];
  for (int t = 0; t < 2; ++t) {
    out[t].assign(rows * hidden, NAN), inv[t].assign(rows, NAN), gx[t].assign(rows * hidden, NAN);
    gw[t].assign(hidden, NAN);
    NormForwardParams f;
    f.rows = rows, f.hidden = hidden, f.x = x.data(), f.weight = w.data(), f.out = out[t].data();
    f.inv = inv[t].data(), f.eps = 1e-5f;
    CHECK(std::string(norm_forward_check(f)).empty());
    norm_forward_cpu(f, 1 + 2 * t);
    NormBackwardParams b;
    b.rows = rows, b.hidden = hidden, b.x = x.data(), b.weight = w.data(), b.inv = inv[t].data();
    b.grad_out = g.data(), b.grad_x = gx[t].data(), b.grad_weight = gw[t].data();
    CHECK(std::string(norm_backward_check(b)).empty());
    norm_backward_cpu(b, 1 + 2 * t);
  }
  CHECK(std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float)) == 0);
  CHECK(std::memcmp(gx[0].data(), gx[1].data(), gx[0].size() * sizeof(float)) == 0);
  CHECK(std::memcmp(gw[0].data(), gw[1].data(), gw[0].size() * sizeof(float)) == 0);
  std::vector<double> gw_want(hidden, 0.0), gw_mass(hidden, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.data() + r * hidden;
    const float* gr = g.data() + r * hidden;
    double ss = 0, dot = 0, dmass = 0;
    for (int64_t i = 0; i < hidden; ++i) ss += double(xr[i]) * xr[i];
    const double iv = 1.0 / std::sqrt(ss / hidden + 1e-5);
    CHECK(std::fabs(inv[0][r] - iv) <= 1e-6 * iv);
    for (int64_t i = 0; i < hidden; ++i) {
      dot += double(gr[i]) * w[i] * xr[i];
      dmass += std::fabs(double(gr[i]) * w[i] * xr[i]);
    }
    for (int64_t i = 0; i < hidden; ++i) {
      const double y = xr[i] * iv;
      CHECK(std::fabs(out[0][r * hidden + i] - w[i] * y) <= 1e-6 * std::fabs(w[i] * y) + 1e-7);
      const double want = iv * (double(gr[i]) * w[i] - xr[i] * iv * iv * dot / hidden);
      const double mass = iv * (std::fabs(double(gr[i]) * w[i]) + std::fabs(xr[i]) * iv * iv * dmass / hidden);
      CHECK(std::fabs(gx[0][r * hidden + i] - want) <= 1e-5 * mass);
      gw_want[i] += gr[i] * y;
      gw_mass[i] += std::fabs(gr[i] * y);
    }
  }
  for (int64_t i = 0; i < hidden; ++i) CHECK(std::fabs(gw[0][i] - gw_want[i]) <= 1e-5 * gw_mass[i]);

  // SwiGLU over rows * hidden elements (not a multiple of the task size), both gradients and each alone.
  const int64_t n = rows * hidden;
  const std::vector<float> gate = draw(n, 4.0f), up = draw(n, 1.0f);
  std::vector<float> h[2], dg[2], du[2];
  for (int t = 0; t < 2; ++t) {
    h[t].assign(n, NAN), dg[t].assign(n, NAN), du[t].assign(n, NAN);
    SiluMulForwardParams f;
    f.size = n, f.gate = gate.data(), f.up = up.data(), f.out = h[t].data();
    CHECK(std::string(silu_mul_forward_check(f)).empty());
    silu_mul_forward_cpu(f, 1 + 2 * t);
    SiluMulBackwardParams b;
    b.size = n, b.gate = gate.data(), b.up = up.data(), b.grad_out = g.data();
    b.grad_gate = dg[t].data(), b.grad_up = du[t].data();
    CHECK(std::string(silu_mul_backward_check(b)).empty());
    silu_mul_backward_cpu(b, 1 + 2 * t);
  }
  CHECK(std::memcmp(h[0].data(), h[1].data(), n * sizeof(float)) == 0);
  CHECK(std::memcmp(dg[0].data(), dg[1].data(), n * sizeof(float)) == 0);
  CHECK(std::memcmp(du[0].data(), du[1].data(), n * sizeof(float)) == 0);
  for (int64_t i = 0; i < n; ++i) {
    const double s = 1.0 / (1.0 + std::exp(-double(gate[i])));
    const double silu = gate[i] * s;
    CHECK(std::fabs(h[0][i] - silu * up[i]) <= 1e-6 * std::fabs(silu * up[i]) + 1e-30);
    const double dgate = double(g[i]) * up[i] * s * (1.0 + gate[i] * (1.0 - s));
    // Near s = 1 a float32 sigmoid is off by up to an ulp of 1 (6e-8 absolute), and d/dgate multiplies
    // that error by the gate (the 1 - s term): the bound's last part.
    CHECK(std::fabs(dg[0][i] - dgate) <= 1e-6 * (std::fabs(g[i] * up[i]) * (s + std::fabs(gate[i]) * s * (1 - s)))
                                              + std::fabs(g[i] * up[i]) * std::fabs(gate[i]) * 1.2e-7 + 1e-30);
    CHECK(std::fabs(du[0][i] - g[i] * silu) <= 1e-6 * std::fabs(g[i] * silu) + 1e-30);
  }
  std::vector<float> only(n, NAN);
  SiluMulBackwardParams b;
  b.size = n, b.gate = gate.data(), b.up = up.data(), b.grad_out = g.data(), b.grad_gate = only.data();
  silu_mul_backward_cpu(b, 2);
  CHECK(std::memcmp(only.data(), dg[0].data(), n * sizeof(float)) == 0);
  b.grad_gate = nullptr, b.grad_up = only.data();
  silu_mul_backward_cpu(b, 2);
  CHECK(std::memcmp(only.data(), du[0].data(), n * sizeof(float)) == 0);
  // bfloat16: the norm's bf16 output (no inv kept) is its float32 output rounded once, bit for bit; the
  // SwiGLU on bf16 data is the float64 value of the rounded inputs, rounded once (within one bf16 ulp,
  // 2^-8 relative, plus float32's error), and its gradients likewise; threads do not change the bits.
  std::vector<uint16_t> out16[2];
  for (int t = 0; t < 2; ++t) {
    out16[t].assign(rows * hidden, 0xffff);
    NormForwardParams f;
    f.rows = rows, f.hidden = hidden, f.x = x.data(), f.weight = w.data(), f.out = out16[t].data();
    f.out_dtype = DType::kBFloat16, f.eps = 1e-5f;
    CHECK(std::string(norm_forward_check(f)).empty());
    norm_forward_cpu(f, 1 + 2 * t);
  }
  CHECK(out16[0] == out16[1]);
  for (int64_t i = 0; i < rows * hidden; ++i) CHECK(out16[0][i] == math::float_to_bf16(out[0][i]));
  auto to16 = [](const std::vector<float>& v) {
    std::vector<uint16_t> r(v.size());
    for (size_t i = 0; i < v.size(); ++i) r[i] = math::float_to_bf16(v[i]);
    return r;
  };
  const std::vector<uint16_t> gate16 = to16(gate), up16 = to16(up), g16 = to16(g);
  std::vector<uint16_t> h16[2], dg16[2], du16[2];
  for (int t = 0; t < 2; ++t) {
    h16[t].assign(n, 0xffff), dg16[t].assign(n, 0xffff), du16[t].assign(n, 0xffff);
    SiluMulForwardParams f;
    f.dtype = DType::kBFloat16, f.size = n, f.gate = gate16.data(), f.up = up16.data(), f.out = h16[t].data();
    CHECK(std::string(silu_mul_forward_check(f)).empty());
    silu_mul_forward_cpu(f, 1 + 2 * t);
    SiluMulBackwardParams b;
    b.dtype = DType::kBFloat16, b.size = n, b.gate = gate16.data(), b.up = up16.data(), b.grad_out = g16.data();
    b.grad_gate = dg16[t].data(), b.grad_up = du16[t].data();
    silu_mul_backward_cpu(b, 1 + 2 * t);
  }
  CHECK(h16[0] == h16[1] && dg16[0] == dg16[1] && du16[0] == du16[1]);
  for (int64_t i = 0; i < n; ++i) {
    const double gi = math::bf16_to_float(gate16[i]), ui = math::bf16_to_float(up16[i]);
    const double dy = math::bf16_to_float(g16[i]);
    const double s = 1.0 / (1.0 + std::exp(-gi)), silu = gi * s;
    const double dgate = dy * ui * s * (1.0 + gi * (1.0 - s));
    CHECK(std::fabs(math::bf16_to_float(h16[0][i]) - silu * ui) <= 4.0e-3 * std::fabs(silu * ui) + 1e-30);
    CHECK(std::fabs(math::bf16_to_float(du16[0][i]) - dy * silu) <= 4.0e-3 * std::fabs(dy * silu) + 1e-30);
    CHECK(std::fabs(math::bf16_to_float(dg16[0][i]) - dgate) <=
          4.0e-3 * std::fabs(dgate) + 1e-6 * std::fabs(dy * ui) * (1.0 + std::fabs(gi)) + 1e-30);
  }
  std::vector<uint16_t> only16(n, 0xffff);
  SiluMulBackwardParams b16;
  b16.dtype = DType::kBFloat16, b16.size = n, b16.gate = gate16.data(), b16.up = up16.data();
  b16.grad_out = g16.data(), b16.grad_up = only16.data();
  silu_mul_backward_cpu(b16, 2);
  CHECK(only16 == du16[0]);
  // The structural checks name what is wrong.
  NormForwardParams bad;
  bad.rows = 2, bad.hidden = 0;
  CHECK(std::string(norm_forward_check(bad)).find("hidden") != std::string::npos);
  bad.hidden = 4;
  CHECK(std::string(norm_forward_check(bad)).find("null") != std::string::npos);
  SiluMulForwardParams bad_silu;
  bad_silu.size = -1;
  CHECK(std::string(silu_mul_forward_check(bad_silu)).find("size") != std::string::npos);
  bad_silu.size = 4, bad_silu.dtype = DType::kFloat16;
  CHECK(std::string(silu_mul_forward_check(bad_silu)).find("dtype") != std::string::npos);
  NormForwardParams bad_out;
  bad_out.rows = 1, bad_out.hidden = 4, bad_out.out_dtype = DType::kFloat64;
  CHECK(std::string(norm_forward_check(bad_out)).find("out_dtype") != std::string::npos);
}

// test_core [--seed SEED | SEED]: the random cases come from SEED, else from the environment variable
// FR_TEST_SEED (as in the Python tests; ctest passes it through), else from a fresh seed. The seed and
// the command that replays it are printed at the start and again on failure, and the generator's next
// draw after the last random case at the end (the same seed draws the same cases).
int main(int argc, char** argv) {
  const char* given = std::getenv("FR_TEST_SEED");
  const char* from = "FR_TEST_SEED";
  if (argc == 2 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0)) {
    usage(argv[0]);
    return 0;
  } else if (argc == 3 && std::strcmp(argv[1], "--seed") == 0) {
    given = argv[2];
    from = "--seed";
  } else if (argc == 2 && std::strncmp(argv[1], "--seed=", 7) == 0) {
    given = argv[1] + 7;
    from = "--seed";
  } else if (argc == 2 && argv[1][0] != '-') {
    given = argv[1];
    from = "SEED";
  } else if (argc != 1) {
    usage(argv[0]);
    return 2;
  }
  uint64_t seed = 0;
  if (given != nullptr) {
    if (!parse_seed(given, seed)) {
      std::fprintf(stderr, "%s: %s must be a whole number from 0 to 2^64 - 1, got '%s'\n", argv[0], from, given);
      usage(argv[0]);
      return 2;
    }
  } else {
    std::mt19937_64 fresh(std::random_device{}());
    seed = fresh();
  }
  const unsigned long long shown = static_cast<unsigned long long>(seed);
  std::mt19937_64 rng(seed);
  std::printf("seed %llu (replay: %s --seed %llu)\n", shown, argv[0], shown);
  std::fflush(stdout);

  // Random segments: 1 token to thousands, with and without the filter, gate on and off.
  for (int rep = 0; rep < 4; ++rep) {
    std::vector<int64_t> lengths;
    for (int i = 0; i < 40; ++i) lengths.push_back(1 + static_cast<int64_t>(rng() % (i % 9 == 8 ? 5000 : 60)));
    for (double q : {1.0, 0.3}) {
      Problem P = random_problem(rng, lengths, 0.05, q, rep % 2 == 1);
      check_case<double>("random", P);
      check_case<float>("random", P);
      std::vector<double> kls = expected(P, false).kl;
      std::sort(kls.begin(), kls.end());
      P.delta = 0.5 * (kls[kls.size() / 2] + kls[kls.size() / 2 - 1]);
      check_case<double>("random gated", P);
      P.no_is = true;
      check_case<double>("random no_is", P);
      P.no_is = false;
      P.agg = LossAgg::kSeqMeanTokenSumNorm;
      P.lsf = 4096;
      check_case<float>("random sum-norm", P);
    }
  }
  // Every gate metric, with and without truncated ratios, gate on and off, both compute types.
  for (int m = 0; m < kNumGateMetrics; ++m) {
    std::vector<int64_t> lengths;
    for (int i = 0; i < 30; ++i) lengths.push_back(1 + static_cast<int64_t>(rng() % (i % 7 == 6 ? 3000 : 70)));
    Problem P = random_problem(rng, lengths, 0.2, m % 2 == 0 ? 1.0 : 0.4, false);
    P.metric = static_cast<GateMetric>(m);
    const std::string name = std::string("metric ") + gate_metric_name(P.metric);
    check_case<double>(name, P);
    check_case<float>(name, P);
    std::vector<double> kls = expected(P, false).kl;
    std::sort(kls.begin(), kls.end());
    P.delta = 0.5 * (kls[kls.size() / 2] + kls[kls.size() / 2 - 1]);
    P.trunc = 1.5;
    check_case<double>(name + " gated, truncated", P);
    check_case<float>(name + " gated, truncated", P);
    P.no_is = true;  // every term is 0, every trajectory admitted, the cap above every ratio of 1
    check_case<double>(name + " no_is", P);
  }
  // A ratio that overflows float32 is clipped, not an overflow error, once truncated.
  {
    Problem P = random_problem(rng, std::vector<int64_t>(4, 3), 0.0, 1.0, false);
    P.blp[P.cu[1] + 1] = -100.0;
    P.lp[P.cu[1] + 1] = -1.0;
    P.mask[P.cu[1] + 1] = 1;
    Result got;
    CHECK(run_core<float>(P, got, 1).code == ErrorCode::kRatioOverflow);
    P.trunc = 2.0;
    check_case<float>("overflowing ratio, truncated", P);
  }
  // Log-probs far below the clamp ln(1e-6) and far apart: the KL's clamped branches, and ratios that
  // the CPU main pass computes with exp of their own (a block with such a token).
  for (double spread : {0.5, 8.0}) {
    std::vector<int64_t> lengths;
    for (int i = 0; i < 30; ++i) lengths.push_back(1 + static_cast<int64_t>(rng() % (i % 7 == 6 ? 3000 : 80)));
    Problem P = random_problem(rng, lengths, spread, 1.0, false, 40.0);
    check_case<double>("deep log-probs", P);
    check_case<float>("deep log-probs", P);
  }
  // Single-token trajectories only.
  {
    Problem P = random_problem(rng, std::vector<int64_t>(50, 1), 0.1, 0.5, false);
    check_case<double>("single tokens", P);
  }
  // All masked but one token in a long trajectory.
  {
    Problem P = random_problem(rng, {3000, 2, 1}, 0.05, 1.0, false);
    std::fill(P.mask.begin(), P.mask.begin() + 3000, 0);
    P.mask[1777] = 1;
    P.lp[1777] = -0.3;
    P.blp[1777] = -0.31;
    check_case<double>("all masked but one", P);
    check_case<float>("all masked but one", P);
  }
  // Huge lengths: one 300k-token failed trajectory of tied entropies (the radix select's
  // threshold bin exceeds its candidate scratch), beside short ones.
  {
    std::vector<int64_t> lengths = {300000, 5, 9, 1};
    Problem P = random_problem(rng, lengths, 0.02, 0.37, true);
    P.failures = {1, 1, 0, 1};
    check_case<float>("huge tied trajectory", P);
    Problem Q = P;
    for (int64_t t = 0; t < 300000; ++t) Q.ent[t] = Q.mask[t] ? 1.25 : NAN;  // every entropy equal
    check_case<double>("huge all-equal entropies", Q);
  }
  // Filter ties: exact-count keep with ties broken by position.
  {
    Problem P;
    P.cu = {0, 7};
    P.lp = {-1, -1, -1, -1, -1, -1, -1};
    P.blp = P.lp;
    P.mask = {0, 1, 1, 1, 1, 1, 1};
    P.ent = {9, 2, 3, 2, 3, 2, 1};
    P.rewards = {0.0, 1.0};
    P.cu = {0, 7, 8};
    P.lp.push_back(-1);
    P.blp.push_back(-1);
    P.mask.push_back(1);
    P.ent.push_back(0);
    P.failures = {1, 0};
    P.q = 0.5;  // T = 6, keep 3: the two 3.0s and the first 2.0 (position 1)
    g_case = "filter ties";
    Result got;
    CHECK(run_core<double>(P, got, 1).code == ErrorCode::kOk);
    CHECK(got.retained[0] == 3);
    CHECK(got.grad[1] != 0 && got.grad[2] != 0 && got.grad[4] != 0);
    CHECK(got.grad[3] == 0 && got.grad[5] == 0 && got.grad[6] == 0 && got.grad[0] == 0);
    check_case<double>("filter ties", P);
  }
  // Thread count independence (bitwise).
  {
    std::vector<int64_t> lengths;
    for (int i = 0; i < 64; ++i) lengths.push_back(1 + static_cast<int64_t>(rng() % 20000));
    Problem P = random_problem(rng, lengths, 0.05, 0.5, false);
    P.delta = 0.01;
    g_case = "threads";
    Result r1, r2, r4;
    run_core<float>(P, r1, 1);
    run_core<float>(P, r2, 2);
    run_core<float>(P, r4, 4);
    CHECK(r1.loss == r2.loss && r1.loss == r4.loss);
    CHECK(r1.grad == r2.grad && r1.grad == r4.grad);
    CHECK(r1.kl == r2.kl && r1.kl == r4.kl);
  }
  // Errors: code and index.
  {
    Problem P = random_problem(rng, {4, 5, 6}, 0.05, 1.0, false);
    Result r;
    g_case = "error cu";
    Problem Q = P;
    Q.cu[1] = 10;
    Q.cu[2] = 9;
    Error e = run_core<double>(Q, r, 2);
    CHECK(e.code == ErrorCode::kBadCuSeqlens && e.index == 2);
    g_case = "error no policy";
    Q = P;
    std::fill(Q.mask.begin() + 4, Q.mask.begin() + 9, 0);
    e = run_core<double>(Q, r, 2);
    CHECK(e.code == ErrorCode::kNoPolicyTokens && e.index == 1);
    g_case = "error log prob";
    Q = P;
    const int64_t t = std::find(Q.mask.begin() + 9, Q.mask.end(), 1) - Q.mask.begin();
    Q.lp[t] = 0.5;
    e = run_core<double>(Q, r, 2);
    CHECK(e.code == ErrorCode::kBadLogProb && e.index == t);
    g_case = "error overflow";
    Q = P;
    Q.blp[t] = -800.0;
    Q.lp[t] = -0.1;
    e = run_core<double>(Q, r, 2);
    CHECK(e.code == ErrorCode::kRatioOverflow && e.index == t);
    e = run_core<float>(Q, r, 2);
    CHECK(e.code == ErrorCode::kRatioOverflow && e.index == t);
    g_case = "error reward";
    Q = P;
    Q.rewards[2] = NAN;
    e = run_core<double>(Q, r, 2);
    CHECK(e.code == ErrorCode::kNonFiniteReward && e.index == 2);
    g_case = "error reward in float32";  // finite in float64, infinite once rounded to float32
    Q = P;
    Q.rewards[1] = 1e39;
    e = run_core<float>(Q, r, 2);
    CHECK(e.code == ErrorCode::kNonFiniteReward && e.index == 1);
    CHECK(run_core<double>(Q, r, 2).code == ErrorCode::kOk);
    g_case = "error advantage";  // rewards finite in float32, reward - mean is not
    Q = P;
    Q.rewards = {3e38, 3e38, -3e38};
    e = run_core<float>(Q, r, 2);
    CHECK(e.code == ErrorCode::kNonFiniteAdvantage && e.index == 2);
    CHECK(run_core<double>(Q, r, 2).code == ErrorCode::kOk);
    g_case = "error too few policy tokens";
    Q = P;
    int64_t total = 0;
    for (uint8_t m : Q.mask) total += m;
    Q.agg = LossAgg::kTokenMean;
    Q.num_policy_tokens = total - 1;
    e = run_core<double>(Q, r, 2);
    CHECK(e.code == ErrorCode::kTooFewPolicyTokens && e.index == total);
    Q.num_policy_tokens = total;
    CHECK(run_core<double>(Q, r, 2).code == ErrorCode::kOk);
    g_case = "error gradient overflow";  // the ratio e^20 is finite, rho * A * s is not (float32)
    Q = P;
    const int64_t t0 = std::find(Q.mask.begin(), Q.mask.begin() + 4, 1) - Q.mask.begin();
    Q.rewards = {1e36, 0.0, 0.0};
    Q.lp[t0] = -0.5;
    Q.blp[t0] = -20.5;
    e = run_core<float>(Q, r, 2);
    CHECK(e.code == ErrorCode::kGradientOverflow && e.index == t0);
    CHECK(run_core<double>(Q, r, 2).code == ErrorCode::kOk);
    g_case = "ratio overflow before gradient overflow";  // priority: code first, then index
    Q.blp[t] = -800.0;
    Q.lp[t] = -0.1;
    e = run_core<float>(Q, r, 2);
    CHECK(e.code == ErrorCode::kRatioOverflow && e.index == t);
  }
  // Structural checks of the parameters (check_params).
  {
    g_case = "check_params";
    Problem P = random_problem(rng, {4, 5}, 0.05, 0.5, false);
    Run<float> ok(P);
    CHECK(check_params(ok.params) == nullptr);
    Run<float> no_behavior(P);
    no_behavior.params.behavior_log_probs = TensorView();
    CHECK(check_params(no_behavior.params) != nullptr);
    Run<float> no_entropies(P);
    no_entropies.params.entropies = TensorView();
    CHECK(check_params(no_entropies.params) != nullptr);
    no_entropies.params.options.negative_token_fraction = 1.0;  // the filter is off: not needed
    CHECK(check_params(no_entropies.params) == nullptr);
    Run<float> short_grad(P);
    short_grad.params.grad.numel -= 1;
    CHECK(check_params(short_grad.params) != nullptr);
    Run<float> wrong_cu(P);
    wrong_cu.params.cu_seqlens.numel = 2;
    CHECK(check_params(wrong_cu.params) != nullptr);
  }
  // Per-token arithmetic of the shared header against long double.
  {
    g_case = "token math";
    std::uniform_real_distribution<double> u(0, 1);
    double worst = 0;
    for (int k = 0; k < 200000; ++k) {
      const float x = static_cast<float>(-8.0 * u(rng) * u(rng));
      const float y = std::min(0.0f, static_cast<float>(x + std::exp(-12.0 * u(rng)) * (u(rng) - 0.5)));
      const double got = math::bernoulli_kl(y, x);
      const double want = kl_exact(y, x, true);
      if (want > 0) worst = std::max(worst, std::fabs(got - want) / want);
      const float e = math::exp_fast(x - y);
      CHECK(std::fabs(e - std::exp((double)x - (double)y)) <= 4e-7 * std::exp((double)x - (double)y));
    }
    std::printf("float32 bernoulli_kl worst relative error %.3g\n", worst);
    // Harder pairs, 20k each: far apart, both near 0, both near the lower clamp, one at the upper
    // clamp, a few ulp apart.
    double worst_hard = 0;
    for (int kind = 0; kind < 5; ++kind) {
      for (int k = 0; k < 20000; ++k) {
        float x, y;
        if (kind == 0) {
          x = static_cast<float>(-16.0 * u(rng));
          y = static_cast<float>(-16.0 * u(rng));
        } else if (kind == 1) {
          x = -static_cast<float>(std::exp(-18.0 * u(rng)));
          y = -static_cast<float>(std::exp(-18.0 * u(rng)));
        } else if (kind == 2) {
          x = static_cast<float>(-13.8155 + 0.01 * (u(rng) - 0.5));
          y = static_cast<float>(x + 0.02 * (u(rng) - 0.5));
        } else if (kind == 3) {
          x = static_cast<float>(-20.0 * u(rng));
          y = u(rng) < 0.5 ? 0.0f : -static_cast<float>(1e-7 * u(rng));
          if (u(rng) < 0.5) std::swap(x, y);
        } else {
          x = static_cast<float>(-14.0 * u(rng));
          y = x;
          for (int steps = 1 + static_cast<int>(rng() % 5); steps > 0; --steps) y = std::nextafter(y, u(rng) < 0.5 ? 0.0f : -1.0f);
          y = std::min(0.0f, y);
        }
        const double want = kl_exact_logs(y, x);
        if (want > 0) worst_hard = std::max(worst_hard, std::fabs(math::bernoulli_kl(y, x) - want) / want);
      }
    }
    std::printf("float32 bernoulli_kl worst relative error on the harder pairs %.3g\n", worst_hard);
    // The k3 term in float32 against wide arithmetic: tiny, moderate and large differences.
    double worst_k3 = 0;
    for (int k = 0; k < 100000; ++k) {
      const float x = static_cast<float>(-10.0 * u(rng));
      const float y = static_cast<float>(x + (u(rng) - 0.5) * std::exp(8.0 * u(rng) - 12.0 + (k % 3) * 4.0));
      const double want = k3_exact(y, x);
      if (want > 1e-30) worst_k3 = std::max(worst_k3, std::fabs(math::k3_term(y, x) - want) / want);
    }
    std::printf("float32 k3 term worst relative error %.3g\n", worst_k3);
    CHECK(worst_k3 < 1e-5);
    CHECK(math::k3_term(0.0f, 100.0f) == std::numeric_limits<float>::infinity());
    CHECK(std::fabs(math::k3_term(0.0f, -95.0f) - 94.0f) <= 1e-5f * 94.0f);
    CHECK(math::k3_term(-1.0f, -1.0f) == 0.0f && math::log_ratio_term(-2.0f, -0.5f) == 1.5f);
    CHECK(worst_hard < 3e-5);  // observed ~2.5e-6
    // exp_fast at its edges: the largest float whose exp is finite, the next one (inf), NaN, +-inf.
    const float kInf = std::numeric_limits<float>::infinity();
    CHECK(std::isfinite(math::exp_fast(88.72283172607421875f)));
    CHECK(math::exp_fast(88.72283935546875f) == kInf);
    CHECK(math::exp_fast(kInf) == kInf && math::exp_fast(-kInf) == 0.0f);
    CHECK(std::isnan(math::exp_fast(std::numeric_limits<float>::quiet_NaN())));
    CHECK(math::exp_fast(0.0f) == 1.0f && math::exp_fast(-100.0f) == 0.0f);
    CHECK(worst < 3e-5);  // observed ~2e-6 over 200k random pairs
    for (float h : {0.0f, 1.0f, -2.5f, 65504.0f, 6.1e-5f, 5.96e-8f, 1e-3f, 3.14159f}) {
      const uint16_t bits = math::float_to_half(h);
      const float back = math::half_to_float(bits);
      CHECK(std::fabs(back - h) <= std::fabs(h) * 1e-3f + 6e-8f);
    }
    CHECK(math::bf16_to_float(math::float_to_bf16(1.0f)) == 1.0f);
    CHECK(math::entropy_key(-0.0f) == math::entropy_key(0.0f));
    CHECK(math::entropy_key(-1.0f) < math::entropy_key(0.5f));
  }

  // Decode attention: register-wide head dimensions (the blocked path) and others (plain loops),
  // groups below, at and above the four queries scored together, lengths from one position to a
  // few register blocks and beyond, and a request with no attended position. The values pass takes
  // the head dimension four register blocks at a time: 48 and 96 leave three and two (AVX-512) or
  // one (AVX2) over; bfloat16 key rows are converted once per block up to head_dim 256 (320 is past it).
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    check_decode_attention(rng, dtype, 2, 1, 3, 48, 25, false);
    check_decode_attention(rng, dtype, 2, 2, 2, 96, 33, false);
    check_decode_attention(rng, dtype, 1, 1, 2, 320, 30, false);
    check_decode_attention(rng, dtype, 3, 2, 3, 64, 37, false);
    check_decode_attention(rng, dtype, 2, 1, 1, 16, 1, false);
    check_decode_attention(rng, dtype, 4, 3, 5, 128, 70, true);
    check_decode_attention(rng, dtype, 2, 2, 7, 40, 19, false);
    check_decode_attention(rng, dtype, 1, 2, 4, 32, 16 + static_cast<int64_t>(rng() % 200), false);
  }
  // The learner's layer glue: rows in whole and partial blocks of the weight gradient's sum, widths
  // in whole and partial reduction tasks and vector registers.
  check_layer_glue(rng, 70, 576);
  check_layer_glue(rng, 1, 33);
  check_layer_glue(rng, 33, 1024 + static_cast<int64_t>(rng() % 100));

  std::printf("seed %llu: next draw after the random cases %016llx\n", shown,
              static_cast<unsigned long long>(rng()));
  if (g_failures) {
    std::fprintf(stderr, "%d check(s) failed (seed %llu; replay: %s --seed %llu)\n", g_failures, shown, argv[0],
                 shown);
    return 1;
  }
  std::printf("all core checks passed\n");
  return 0;
}
