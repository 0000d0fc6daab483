// Per-token arithmetic shared by the CPU and the CUDA paths.
//
// Everything here is an inline __host__ __device__ function, so the CPU tests exercise exactly the
// arithmetic the GPU runs. Float32 math uses branch-free polynomial exp/log (select instead of
// branches) so that compilers vectorize the CPU loops and GPUs run them without divergence;
// float64 math uses the C library (the double path is for accuracy, not speed).
#pragma once

#include <cstdint>
#include <cstring>

#include <math.h>

#include "flashreinforce/core.h"
#include "flashreinforce/host_device.h"

namespace flashreinforce {
namespace math {

// ---------------------------------------------------------------------------------------------
// Bit casts and the 16-bit float formats (storage only; arithmetic is done in float32).

FR_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

FR_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

FR_HD uint64_t f64_bits(double x) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(x));
#else
  uint64_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

FR_HD double f64_from_bits(uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

// The same by compute type (bits_of / from_bits; BitsOf<C>::type is the unsigned integer type).
template <class C> struct BitsOf;
template <> struct BitsOf<float> { using type = uint32_t; };
template <> struct BitsOf<double> { using type = uint64_t; };
FR_HD uint32_t bits_of(float x) { return f32_bits(x); }
FR_HD uint64_t bits_of(double x) { return f64_bits(x); }
FR_HD float from_bits(uint32_t u) { return f32_from_bits(u); }
FR_HD double from_bits(uint64_t u) { return f64_from_bits(u); }

// IEEE binary16 -> float32, exact (normals, subnormals, inf, NaN), branch-free.
FR_HD float half_to_float(uint16_t h) {
  const uint32_t shifted = static_cast<uint32_t>(h & 0x7fffu) << 13;  // exponent + mantissa
  const uint32_t exponent = shifted & 0x0f800000u;
  uint32_t bits = shifted + ((127u - 15u) << 23);
  bits = (exponent == 0x0f800000u) ? bits + ((128u - 16u) << 23) : bits;  // inf / NaN
  // Subnormal (and zero): renormalize through one float subtraction.
  const float sub = f32_from_bits(bits + (1u << 23)) - f32_from_bits(113u << 23);
  const uint32_t sub_bits = f32_bits(sub);
  bits = (exponent == 0u) ? sub_bits : bits;
  return f32_from_bits(bits | (static_cast<uint32_t>(h & 0x8000u) << 16));
}

// float32 -> IEEE binary16, round to nearest even; overflow gives inf, NaN stays NaN.
FR_HD uint16_t float_to_half(float f) {
  uint32_t u = f32_bits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t out;
  if (u >= (143u << 23)) {  // >= 65536 (after rounding this overflows), inf or NaN
    out = (u > (255u << 23)) ? 0x7e00u : 0x7c00u;
  } else if (u < (113u << 23)) {  // half subnormal or zero: let float addition do the rounding
    const float magic = f32_from_bits(126u << 23);  // 0.5
    const float r = f32_from_bits(u) + magic;
    out = f32_bits(r) - (126u << 23);
  } else {
    const uint32_t mant_odd = (u >> 13) & 1u;
    u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu;
    u += mant_odd;
    out = u >> 13;
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

FR_HD float bf16_to_float(uint16_t b) { return f32_from_bits(static_cast<uint32_t>(b) << 16); }

// float32 -> bfloat16, round to nearest even; NaN stays a quiet NaN.
FR_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = ((u >> 16) & 0x8000u) | 0x7fc0u;
  return static_cast<uint16_t>(((u & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
}

// Storage types: 16-bit floats travel as raw bits.
struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

FR_HD float to_compute(Half x, float) { return half_to_float(x.bits); }
FR_HD float to_compute(BFloat16 x, float) { return bf16_to_float(x.bits); }
FR_HD float to_compute(float x, float) { return x; }
FR_HD float to_compute(double x, float) { return static_cast<float>(x); }
FR_HD double to_compute(Half x, double) { return half_to_float(x.bits); }
FR_HD double to_compute(BFloat16 x, double) { return bf16_to_float(x.bits); }
FR_HD double to_compute(float x, double) { return x; }
FR_HD double to_compute(double x, double) { return x; }

template <class S> struct Store;
template <> struct Store<Half> {
  FR_HD static Half from(float x) { return Half{float_to_half(x)}; }
  FR_HD static Half from(double x) { return Half{float_to_half(static_cast<float>(x))}; }
};
template <> struct Store<BFloat16> {
  FR_HD static BFloat16 from(float x) { return BFloat16{float_to_bf16(x)}; }
  FR_HD static BFloat16 from(double x) { return BFloat16{float_to_bf16(static_cast<float>(x))}; }
};
template <> struct Store<float> {
  FR_HD static float from(float x) { return x; }
  FR_HD static float from(double x) { return static_cast<float>(x); }
};
template <> struct Store<double> {
  FR_HD static double from(float x) { return x; }
  FR_HD static double from(double x) { return x; }
};

// Whether a compute-dtype value stays finite when stored as S: |x| below the midpoint between S's
// largest finite value and the next power of two (round to nearest even takes that midpoint up to
// infinity), i.e. 65520 for float16 and (2 - 2^-8) 2^127 for bfloat16; float32 and float64 only
// need x finite. NaN fails. Branch-free (two compares), so the loops around it vectorize.
FR_HD float store_limit(Half) { return 65520.0f; }
FR_HD float store_limit(BFloat16) { return f32_from_bits(0x7f7f8000u); }
FR_HD float store_limit(float) { return f32_from_bits(0x7f800000u); }
FR_HD double store_limit(double) { return static_cast<double>(f32_from_bits(0x7f800000u)); }
template <class S, class C> FR_HD bool fits_storage(C x) {
  const C limit = static_cast<C>(store_limit(S()));
  return (x < limit) & (x > -limit);
}

// Compute type for a log_probs storage type: float64 stays float64, everything else is float32.
template <class S> struct ComputeOf { using type = float; };
template <> struct ComputeOf<double> { using type = double; };

// ---------------------------------------------------------------------------------------------
// exp.
//
// Written for vectorized CPU loops as much as for GPUs: a loop over these functions is bound by
// the length of its dependency chains (the out-of-order core overlaps only a few iterations of a
// long body), then by the number of operations, and selects cost more than arithmetic (an AVX2
// blend is 2-3 micro-ops on Intel cores; a select against 0 is one AND). Hence Estrin's scheme for
// the polynomials, integer tricks instead of float selects where the sign is known, and no
// float-to-int conversion (undefined for the NaN of an invalid input, so it would need a guard).

// The float32 exponential's core, shared by exp_fast and the Bernoulli KL: Cody-Waite range
// reduction x = n ln 2 + r (|r| <= ln 2 / 2; ln 2 split in two parts so that n * the first part is
// exact) and Cephes' expf polynomial, e^r = 1 + r + r^2 poly(r), in Estrin's form. n is rounded by
// adding 1.5 * 2^23 (no library call, so the loops around it vectorize) and read from the bits of
// that sum. |x| < 2^21.
struct ExpReduction {
  float fx;    // n, as a float
  uint32_t n;  // n, two's complement
  float r;     // the reduced argument
  float r2;    // r * r
  float poly;  // poly(r), degree 5
};

FR_HD ExpReduction exp_reduce(float x) {
  const float kMagic = 12582912.0f;  // 1.5 * 2^23: the sum's last bit has weight 1
  const float v = x * 1.44269504088896341f + kMagic;
  ExpReduction e;
  e.n = f32_bits(v) - f32_bits(kMagic);
  e.fx = v - kMagic;
  float r = x - e.fx * 0.693359375f;
  r = r - e.fx * -2.12194440e-4f;
  e.r = r;
  e.r2 = r * r;
  const float p01 = 1.9875691500e-4f * r + 1.3981999507e-3f;
  const float p23 = 8.3334519073e-3f * r + 4.1665795894e-2f;
  const float p45 = 1.6666665459e-1f * r + 5.0000001201e-1f;
  e.poly = (e.r2 * e.r2) * p01 + (e.r2 * p23 + p45);
  return e;
}

// 2^n for an integer n in [-126, 127], from the exponent field.
FR_HD float exp2_int(uint32_t n) { return f32_from_bits((n + 127u) << 23); }

// exp for float32 (exp_reduce); about 1 ulp. Overflow gives +inf (x > ln(FLT_MAX)); results below
// FLT_MIN flush to 0 (an absolute error below 1.2e-38); NaN propagates. Branch-free.
FR_HD float exp_fast(float x) {
  const float kHi = 88.72283172607421875f;  // ln(FLT_MAX), rounded down: exp(kHi) is finite
  const float kLo = -87.33654475055310f;    // ln(FLT_MIN)
  float xc = x > kHi ? kHi : x;
  xc = xc < kLo ? kLo : xc;  // NaN stays NaN
  const ExpReduction e = exp_reduce(xc);
  const float y = e.poly * e.r2 + e.r + 1.0f;
  // Scale by 2^n by adding to the exponent field: y is in [0.7, 1.5], the result stays normal.
  float res = f32_from_bits(f32_bits(y) + (e.n << 23));
  res = x > kHi ? f32_from_bits(0x7f800000u) : res;
  res = x < kLo ? 0.0f : res;
  return res + (xc - xc);  // xc - xc is 0, or NaN when x is: NaN propagates without a select
}

FR_HD float exp_c(float x) { return exp_fast(x); }
FR_HD double exp_c(double x) { return ::exp(x); }

// ---------------------------------------------------------------------------------------------
// The clamped Bernoulli KL proxy (docs/semantics.md, computation step 3):
//   d = p (log p - log q) + (1 - p) (log(1-p) - log(1-q)),  p = clamp(exp(behavior)),
//   q = clamp(exp(current)), clamps to [1e-6, 1 - 1e-6].
// Written that way, its two terms cancel to first order when p is close to q (d ~ (p-q)^2), and a
// float32 evaluation loses most digits of a small KL. With log_ratio = log p - log q,
// z = q expm1(log_ratio) / (1 - q) (so that 1 - z = (1-p)/(1-q)) and h(z) = -z - log(1 - z) >= 0,
// the same quantity is
//   d = q g(log_ratio) + q z expm1(log_ratio) - (1 - p) h(z),   g = log_ratio e^log_ratio - expm1(log_ratio) >= 0,
// whose three terms have the same order of magnitude when |z| is small (then h comes from a
// series) and keep a few-ulp accuracy. Where |z| is large the two terms of the direct form no
// longer cancel badly, and the direct form is used. 1 - p and 1 - q never come from 1 - p.

// Probabilities in the gate are clamped to [1e-6, 1 - 1e-6] (rounded to C). Since exp is
// monotone, clamp(exp(x)) = exp(clamp(x, kLogLo, kLogHi)) with the logs of those bounds: the code
// clamps log-probabilities, which also gives log p of a clamped p without computing a log.
template <class C> struct Clamp;
template <> struct Clamp<float> {
  static constexpr float kLogLo = -13.8155107f;      // ln(float32(1e-6))
  static constexpr float kLogHi = -1.01327953e-06f;  // ln(float32(1 - float32(1e-6)))
};
template <> struct Clamp<double> {
  static constexpr double kLogLo = -13.815510557964274;     // ln(1e-6)
  static constexpr double kLogHi = -1.000000500029089e-06;  // ln(double(1 - 1e-6))
};

// Clamp of a float32 log-probability to [lo, hi] (lo < hi < 0) on its bits: for x <= 0 (-0.0 for
// +0.0) the bit patterns read as signed integers are in the reverse order of the values, and
// integer min / max vectorize as single instructions where float selects become blends. Invalid
// inputs (positive, NaN, -inf) land in [lo, hi] too, so what follows stays finite (they are
// reported as errors; their KL is never used).
FR_HD float clamp_log_prob(float x) {
  using K = Clamp<float>;
  // As int32, the bits of hi (the bound closest to 0) are the smallest integer, those of lo the largest.
  const int32_t ihi = static_cast<int32_t>(f32_bits(K::kLogHi));
  const int32_t ilo = static_cast<int32_t>(f32_bits(K::kLogLo));
  int32_t i = static_cast<int32_t>(f32_bits(x) | 0x80000000u);
  i = i < ihi ? ihi : i;  // x above hi
  i = i > ilo ? ilo : i;  // x below lo
  return f32_from_bits(static_cast<uint32_t>(i));
}

// The float32 KL in two halves: kl_partial does everything up to log(1 - z), kl_finish the rest
// (bernoulli_kl runs both). The CPU main pass runs them in two loops: each loop's dependency chain
// is short enough for the core to overlap several vector iterations.
struct KlPartial {
  float z;          // q expm1(log_ratio) / (1 - q)
  float P;          // 1 - p
  float near;       // q g(log_ratio) + q z expm1(log_ratio): the stable form without its -(1-p) h(z)
  float far;        // p log_ratio: the direct form's first term
  float exp_log_ratio;  // e^log_ratio = p / q (ratio_from_kl)
};

FR_HD KlPartial kl_partial(float behavior, float current) {
  const float log_p = clamp_log_prob(behavior);
  const float log_q = clamp_log_prob(current);
  // q = scale (1 + s) and 1 - q = (1 - scale) - scale s, both to a few ulp (both parts exact).
  const ExpReduction eq = exp_reduce(log_q);
  const float s = eq.poly * eq.r2 + eq.r;
  const float scale = exp2_int(eq.n);
  const float q = scale * s + scale;
  const float Q = (1.0f - scale) - scale * s;
  // expm1(log_ratio) and its excess expm1(log_ratio) - log_ratio (= log_ratio^2/2 + ...) without cancellation
  // (|log_ratio| <= 14); with n == 0, r == log_ratio exactly and the excess is the polynomial part.
  const float log_ratio = log_p - log_q;
  const ExpReduction ed = exp_reduce(log_ratio);
  const float sd = ed.poly * ed.r2 + ed.r;
  const float scale_d = exp2_int(ed.n);
  const float em = scale_d * sd + (scale_d - 1.0f);
  const float excess = ed.n == 0u ? ed.poly * ed.r2 : em - log_ratio;
  const float qem = q * em;  // p - q
  KlPartial k;
  k.z = qem / Q;
  k.P = Q - qem;
  k.near = q * (log_ratio * em - excess) + k.z * qem;
  k.far = (q + qem) * log_ratio;
  k.exp_log_ratio = scale_d * sd + scale_d;
  return k;
}

// log(1 - z) = log w: w = m 2^e with m in [sqrt(1/2), sqrt(2)) (from the bits), f = m - 1 and
// Cephes' logf polynomial, log(1 + f) = f - f^2/2 + f^3 poly(f) (Estrin's form). When e == 0 (z in
// (1 - sqrt(2), 1 - sqrt(1/2)]), f is -z itself, not 1 - z rounded, so that
// h(z) = f^2/2 - f^3 poly(f) keeps its relative accuracy as z -> 0: the stable form is used there,
// the direct form elsewhere.
FR_HD float kl_finish(const KlPartial& k) {
  const float w = 1.0f - k.z;  // (1-p)/(1-q) > 0
  uint32_t ix = f32_bits(w) + (0x3f800000u - 0x3f3504f3u);
  const int32_t e = static_cast<int32_t>(ix >> 23) - 127;
  ix = (ix & 0x007fffffu) + 0x3f3504f3u;
  const float f = e == 0 ? -k.z : f32_from_bits(ix) - 1.0f;
  const float f2 = f * f, f4 = f2 * f2;
  const float c01 = -2.4999993993e-1f * f + 3.3333331174e-1f;
  const float c23 = -1.6668057665e-1f * f + 2.0000714765e-1f;
  const float c45 = -1.2420140846e-1f * f + 1.4249322787e-1f;
  const float c67 = -1.1514610310e-1f * f + 1.1676998740e-1f;
  const float poly = f4 * (f4 * 7.0376836292e-2f + (f2 * c67 + c45)) + (f2 * c23 + c01);
  const float h = 0.5f * f2 - poly * (f2 * f);
  const float fe = static_cast<float>(e);
  const float log_w = (f - h) + fe * -2.12194440e-4f + fe * 0.693359375f;
  return e == 0 ? k.near - k.P * h : k.far + k.P * log_w;
}

FR_HD float bernoulli_kl(float behavior, float current) { return kl_finish(kl_partial(behavior, current)); }

// The importance ratio exp(current - behavior) from the KL's e^log_ratio, without an exp of its own:
// exp(current - behavior) = exp(c) / e^log_ratio, where c = (current - log_q) - (behavior - log_p) is
// the difference of the two clamping corrections. c is 0 when neither log-prob was clamped and
// below 2.1e-6 in magnitude when only the upper bound clamped them; exp(c) is then 1 + c to float32
// precision, and the ratio is within about 2 ulp. Returns false when |c| >= 2^-14 (a log-prob below
// ln 1e-6, or an invalid one): the ratio is then exp_fast(current - behavior).
FR_HD bool ratio_from_kl(float behavior, float current, float exp_log_ratio, float* ratio) {
  const float c = (current - clamp_log_prob(current)) - (behavior - clamp_log_prob(behavior));
  const float inv = 1.0f / exp_log_ratio;
  *ratio = c * inv + inv;
  return (c < 6.103515625e-05f) & (c > -6.103515625e-05f);
}

// Float64: the same two forms from the C library (the double path is for accuracy, not speed);
// h from the atanh series, w = -z / (2 - z), log(1 - z) = 2 (w + w^3/3 + ...) and
// -z - 2w = z^2 / (2 - z) (|w| <= 1/7 for |z| <= 1/4: eight terms reach float64 precision).
FR_HD double bernoulli_kl(double behavior, double current) {
  using K = Clamp<double>;
  const double log_p = behavior < K::kLogLo ? K::kLogLo : (behavior > K::kLogHi ? K::kLogHi : behavior);
  const double log_q = current < K::kLogLo ? K::kLogLo : (current > K::kLogHi ? K::kLogHi : current);
  const double p = ::exp(log_p), one_minus_p = -::expm1(log_p);
  const double q = ::exp(log_q), one_minus_q = -::expm1(log_q);
  const double log_ratio = log_p - log_q;
  const double em = ::expm1(log_ratio);
  const double series =
      log_ratio * log_ratio *
      (0.5 + log_ratio * (1.0 / 6 + log_ratio * (1.0 / 24 + log_ratio * (1.0 / 120 + log_ratio * (1.0 / 720 + log_ratio * (1.0 / 5040))))));
  const double excess = (log_ratio < 0.01 && log_ratio > -0.01) ? series : em - log_ratio;  // expm1(log_ratio) - log_ratio
  const double inv_one_minus_q = 1.0 / one_minus_q;
  const double z = q * em * inv_one_minus_q;
  if (z <= 0.25 && z >= -0.25) {
    const double inv = 1.0 / (2.0 - z);
    const double w = -z * inv;
    const double w2 = w * w;
    const double atanh_tail =
        1.0 / 3 + w2 * (1.0 / 5 + w2 * (1.0 / 7 + w2 * (1.0 / 9 + w2 * (1.0 / 11 + w2 * (1.0 / 13 + w2 * (1.0 / 15 + w2 * (1.0 / 17)))))));
    const double h = z * z * inv - 2.0 * w * w2 * atanh_tail;
    return q * (log_ratio * em - excess) + z * q * em - one_minus_p * h;
  }
  return p * log_ratio + one_minus_p * ::log(one_minus_p * inv_one_minus_q);
}

// ---------------------------------------------------------------------------------------------
// The other gate metrics (docs/semantics.md, "Gate metrics"). Each is a per-token term of the
// behavior and current log-probabilities, averaged over a trajectory's policy tokens exactly like
// the Bernoulli KL above; only the term differs.

// kpop: the larger of the forward and the reverse clamped Bernoulli KL of the token.
FR_HD float kpop_term(float behavior, float current) {
  const float forward = bernoulli_kl(behavior, current);
  const float reverse = bernoulli_kl(current, behavior);
  return forward > reverse ? forward : reverse;
}
FR_HD double kpop_term(double behavior, double current) {
  const double forward = bernoulli_kl(behavior, current);
  const double reverse = bernoulli_kl(current, behavior);
  return forward > reverse ? forward : reverse;
}

// k3 = e^d - 1 - d with d = current - behavior (the k3 estimator of KL(behavior || current) from a
// token the behavior policy sampled; unclamped log-probabilities). Float32, branch-free: for
// |d| < ln 2 / 2 the reduction leaves r == d exactly and e^d - 1 - d is the polynomial part
// r^2 poly(r) (no cancellation as d -> 0); elsewhere expm1(d) - d loses a few ulp at most.
// Above 88, e^d (inf above ln FLT_MAX) is the whole value; below -87, e^d is below an ulp of 1 + |d|.
FR_HD float k3_term(float behavior, float current) {
  const float d = current - behavior;
  const float kHi = 88.0f, kLo = -87.0f;
  float dc = d > kHi ? kHi : d;
  dc = dc < kLo ? kLo : dc;  // NaN stays NaN
  const ExpReduction e = exp_reduce(dc);
  const float s = e.poly * e.r2 + e.r;  // e^r - 1
  const float scale = exp2_int(e.n);
  const float em = scale * s + (scale - 1.0f);  // expm1(dc)
  float k = e.n == 0u ? e.poly * e.r2 : em - dc;
  k = d > kHi ? exp_fast(d) - d : k;
  k = d < kLo ? -1.0f - d : k;
  return k;
}
// Float64: the Taylor series below |d| = 0.01 (seven terms reach float64 precision), expm1 above.
FR_HD double k3_term(double behavior, double current) {
  const double d = current - behavior;
  if (d < 0.01 && d > -0.01) {
    return d * d * (0.5 + d * (1.0 / 6 + d * (1.0 / 24 + d * (1.0 / 120 + d * (1.0 / 720 + d * (1.0 / 5040))))));
  }
  return ::expm1(d) - d;
}

// log_ratio: |current - behavior|; its trajectory mean bounds the geometric-mean importance ratio.
FR_HD float log_ratio_term(float behavior, float current) {
  const float d = current - behavior;
  return d < 0.0f ? -d : d;
}
FR_HD double log_ratio_term(double behavior, double current) {
  const double d = current - behavior;
  return d < 0.0 ? -d : d;
}

// The gate's per-token term by metric (the CUDA path and the CPU's non-default metrics).
template <class C>
FR_HD C gate_term(GateMetric metric, C behavior, C current) {
  switch (metric) {
    case GateMetric::kKpop: return kpop_term(behavior, current);
    case GateMetric::kK3: return k3_term(behavior, current);
    case GateMetric::kLogRatio: return log_ratio_term(behavior, current);
    case GateMetric::kBinaryKl: break;
  }
  return bernoulli_kl(behavior, current);
}

// A policy-token log probability is valid when finite and <= 0 (NaN fails both comparisons).
FR_HD bool valid_log_prob(float x) { return (x <= 0.0f) & (x >= -3.40282347e38f); }
FR_HD bool valid_log_prob(double x) { return (x <= 0.0) & (x >= -1.7976931348623157e308); }

// ---------------------------------------------------------------------------------------------
// Order-preserving unsigned keys for finite entropies (bigger entropy -> bigger key). -0.0 is
// folded onto +0.0 so that equal values always give equal keys.

FR_HD uint32_t entropy_key(float e) {
  const uint32_t u = f32_bits(e + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
FR_HD uint64_t entropy_key(double e) {
  const uint64_t u = f64_bits(e + 0.0);
  return (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
}

// Entropy storage -> key type (16-bit floats and float32 compare as float32, float64 as float64).
template <class E> struct EntropyKey { using type = uint32_t; using value = float; };
template <> struct EntropyKey<double> { using type = uint64_t; using value = double; };

}  // namespace math
}  // namespace flashreinforce
