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
// exp / log.

// Nearest integer of |x| < 2^22 (ties to even), by adding and subtracting 1.5 * 2^23: no library
// call, so the loops around it vectorize (floorf does not without -fno-trapping-math).
FR_HD float round_to_int(float x) {
  const float kMagic = 12582912.0f;
  return (x + kMagic) - kMagic;
}

// The float32 exponential's core, shared by exp_fast, exp_parts and expm1_with_excess: Cody-Waite
// range reduction x = fx ln 2 + r (|r| <= ln 2 / 2; ln 2 split in two parts so that fx * the
// first part is exact) and Cephes' expf polynomial, e^r = 1 + r + r^2 poly(r). |x| < 2^22 / log2(e).
struct ExpReduction {
  float fx;    // the integer exponent, as a float
  float r;     // the reduced argument
  float poly;  // poly(r), degree 5
};

FR_HD ExpReduction exp_reduce(float x) {
  ExpReduction e;
  e.fx = round_to_int(x * 1.44269504088896341f);
  float r = x - e.fx * 0.693359375f;
  r = r - e.fx * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  e.r = r;
  e.poly = y;
  return e;
}

// 2^fx for an integer-valued fx in [-126, 127], from the exponent field.
FR_HD float exp2_int(float fx) {
  return f32_from_bits(static_cast<uint32_t>(static_cast<int32_t>(fx) + 127) << 23);
}

// exp for float32 (exp_reduce); about 1 ulp. Overflow gives +inf (x > ln(FLT_MAX)); results below
// FLT_MIN flush to 0 (an absolute error below 1.2e-38); NaN propagates. Branch-free.
FR_HD float exp_fast(float x) {
  const float kHi = 88.72283935546875f;   // ln(FLT_MAX), rounded down
  const float kLo = -87.33654475055310f;  // ln(FLT_MIN)
  float xc = x > kHi ? kHi : x;
  xc = xc < kLo ? kLo : xc;
  xc = (xc == xc) ? xc : 0.0f;  // NaN -> 0 here; fixed up below
  const ExpReduction e = exp_reduce(xc);
  const float fx = e.fx;
  const float r = e.r;
  const float z = r * r;
  const float y = e.poly * z + r + 1.0f;
  // Scale by 2^fx by adding to the exponent field: y is in [0.7, 1.5], the result stays normal.
  const int32_t n = static_cast<int32_t>(fx);
  float res = f32_from_bits(f32_bits(y) + (static_cast<uint32_t>(n) << 23));
  const float kInf = f32_from_bits(0x7f800000u);
  res = x > kHi ? kInf : res;
  res = x < kLo ? 0.0f : res;
  return (x == x) ? res : x;
}

// exp(x) split as scale * (1 + s) with scale = 2^n and s = e^r - 1 (|r| <= ln2 / 2), for
// x in [ln(FLT_MIN), 0]. Gives both exp(x) = scale + scale * s and, without cancellation,
// 1 - exp(x) = (1 - scale) - scale * s (accurate to a few ulp even when exp(x) is close to 1).
FR_HD void exp_parts(float x, float* scale, float* s) {
  const float kLo = -87.33654475055310f;
  float xc = x > 0.0f ? 0.0f : x;
  xc = xc < kLo ? kLo : xc;
  xc = (xc == xc) ? xc : 0.0f;
  const ExpReduction e = exp_reduce(xc);
  const float z = e.r * e.r;
  *s = e.poly * z + e.r;
  *scale = exp2_int(e.fx);
}

// Natural log for positive normal float32 (the only arguments used here: probabilities and
// 1 - probability, both >= 1e-6). Frexp-style reduction to [sqrt(1/2), sqrt(2)) and Cephes' logf
// polynomial; about 1 ulp. Branch-free.
FR_HD float log_fast(float x) {
  const uint32_t bits = f32_bits(x);
  int32_t e = static_cast<int32_t>((bits >> 23) & 0xffu) - 126;  // x = m * 2^e, m in [0.5, 1)
  const float m = f32_from_bits((bits & 0x007fffffu) | 0x3f000000u);
  const bool small = m < 0.707106781186547524f;
  e = small ? e - 1 : e;
  const float f = small ? (m + m - 1.0f) : (m - 1.0f);
  const float z = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z;
  const float fe = static_cast<float>(e);
  y += -2.12194440e-4f * fe;
  y += -0.5f * z;
  float r = f + y;
  r += 0.693359375f * fe;
  return r;
}

FR_HD float exp_c(float x) { return exp_fast(x); }
FR_HD double exp_c(double x) { return ::exp(x); }

// ---------------------------------------------------------------------------------------------
// The clamped Bernoulli KL proxy (docs/semantics.md, computation step 3).

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

template <class C> FR_HD C clamp_to(C x, C lo, C hi) {
  x = x < lo ? lo : x;
  return x > hi ? hi : x;
}

// p = exp(log_p) and 1 - p for a clamped log_p, both to a few ulp (1 - p without cancellation,
// also when p is close to 1). Float32: exp(log_p) = scale * (1 + s) (exp_parts), and
// 1 - p = (1 - scale) - scale * s where both parts are exact.
FR_HD void prob_pair(float log_p, float* p, float* one_minus_p) {
  float scale, s;
  exp_parts(log_p, &scale, &s);
  *p = scale + scale * s;
  *one_minus_p = (1.0f - scale) - scale * s;
}
FR_HD void prob_pair(double log_p, double* p, double* one_minus_p) {
  *p = ::exp(log_p);
  *one_minus_p = -::expm1(log_p);
}

// expm1(d) and its excess expm1(d) - d (= d^2/2 + d^3/6 + ...) without cancellation, |d| <= 14.
FR_HD float expm1_with_excess(float d, float* excess) {
  const ExpReduction e = exp_reduce(d);
  const float z = e.r * e.r;
  const float s = e.poly * z + e.r;  // e^r - 1
  const float scale = exp2_int(e.fx);
  const float em = scale * s + (scale - 1.0f);
  // With fx == 0, r == d exactly and the excess is the polynomial part poly * r^2.
  *excess = e.fx == 0.0f ? e.poly * z : em - d;
  return em;
}
FR_HD double expm1_with_excess(double d, double* excess) {
  const double em = ::expm1(d);
  const double series =
      d * d * (0.5 + d * (1.0 / 6 + d * (1.0 / 24 + d * (1.0 / 120 + d * (1.0 / 720 + d * (1.0 / 5040))))));
  *excess = (d < 0.01 && d > -0.01) ? series : em - d;
  return em;
}

// h(z) = -z - log(1 - z) = sum_{k>=2} z^k / k >= 0, for |z| <= 1/4.
// float32: the power series through z^12 (truncation < 1e-8 relative), Horner, no division.
// float64: the atanh series, w = -z / (2 - z), log(1 - z) = 2 (w + w^3/3 + ...) and
// -z - 2w = z^2 / (2 - z) (|w| <= 1/7: eight terms reach float64 precision).
FR_HD float h_small(float z) {
  float y = 1.0f / 12;
  y = y * z + 1.0f / 11;
  y = y * z + 1.0f / 10;
  y = y * z + 1.0f / 9;
  y = y * z + 1.0f / 8;
  y = y * z + 1.0f / 7;
  y = y * z + 1.0f / 6;
  y = y * z + 1.0f / 5;
  y = y * z + 1.0f / 4;
  y = y * z + 1.0f / 3;
  y = y * z + 1.0f / 2;
  return y * z * z;
}
FR_HD double h_small(double z) {
  const double inv = 1.0 / (2.0 - z);
  const double w = -z * inv;
  const double w2 = w * w;
  const double series =
      1.0 / 3 + w2 * (1.0 / 5 + w2 * (1.0 / 7 + w2 * (1.0 / 9 + w2 * (1.0 / 11 + w2 * (1.0 / 13 + w2 * (1.0 / 15 + w2 * (1.0 / 17)))))));
  return z * z * inv - 2.0 * w * w2 * series;
}

FR_HD float log_c(float x) { return log_fast(x); }
FR_HD double log_c(double x) { return ::log(x); }

// The clamped Bernoulli KL proxy (docs/semantics.md, computation step 3):
//   d = p (log p - log q) + (1 - p) (log(1-p) - log(1-q)),  p = clamp(exp(behavior)),
//   q = clamp(exp(current)), clamps to [1e-6, 1 - 1e-6].
// Written that way, its two terms cancel to first order when p is close to q (d ~ (p-q)^2), and a
// float32 evaluation loses most digits of a small KL. With delta = log p - log q,
// z = q expm1(delta) / (1 - q) (so that 1 - z = (1-p)/(1-q)) and h(z) = -z - log(1 - z) >= 0,
// the same quantity is
//   d = q g(delta) + q z expm1(delta) - (1 - p) h(z),   g = delta e^delta - expm1(delta) >= 0,
// whose three terms have the same order of magnitude when |z| <= 1/4 (then h comes from a series)
// and keep a few-ulp accuracy. For |z| > 1/4 the two terms of the direct form no longer cancel
// badly, and the direct form is used. 1 - p and 1 - q come from expm1, never from 1 - p.
template <class C> FR_HD C bernoulli_kl(C behavior, C current) {
  using K = Clamp<C>;
  const C log_p = clamp_to<C>(behavior, K::kLogLo, K::kLogHi);
  const C log_q = clamp_to<C>(current, K::kLogLo, K::kLogHi);
  C p, one_minus_p, q, one_minus_q;
  prob_pair(log_p, &p, &one_minus_p);
  prob_pair(log_q, &q, &one_minus_q);
  const C delta = log_p - log_q;
  C excess;
  const C em = expm1_with_excess(delta, &excess);
  const C inv_one_minus_q = C(1) / one_minus_q;
  const C z = q * em * inv_one_minus_q;
  const C stable = q * (delta * em - excess) + z * q * em - one_minus_p * h_small(z);
  const C direct = p * delta + one_minus_p * log_c(one_minus_p * inv_one_minus_q);
  return (z <= C(0.25) && z >= C(-0.25)) ? stable : direct;
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
