// Per-token arithmetic shared by the CPU and the CUDA paths.
//
// Everything here is an inline __host__ __device__ function, so the CPU tests exercise exactly the
// arithmetic the GPU runs. Float32 math uses branch-free polynomial exp/log (select instead of
// branches) so that compilers vectorize the CPU loops and GPUs run them without divergence;
// float64 math uses the C library (the double path is for accuracy, not speed).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FR_HD __host__ __device__ __forceinline__
#else
#define FR_HD inline __attribute__((always_inline))
#endif

#include <math.h>

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

// Compute type for a log_probs storage type: float64 stays float64, everything else is float32.
template <class S> struct ComputeOf { using type = float; };
template <> struct ComputeOf<double> { using type = double; };

// ---------------------------------------------------------------------------------------------
// exp / log / log1p.

// exp for float32: Cody-Waite range reduction by ln 2 and a degree-6 polynomial (Cephes' expf
// coefficients); about 1 ulp. Overflow gives +inf (x > ln(FLT_MAX)); results below FLT_MIN
// flush to 0 (an absolute error below 1.2e-38); NaN propagates. Branch-free.
FR_HD float exp_fast(float x) {
  const float kHi = 88.72283935546875f;   // ln(FLT_MAX), rounded down
  const float kLo = -87.33654475055310f;  // ln(FLT_MIN)
  float xc = x > kHi ? kHi : x;
  xc = xc < kLo ? kLo : xc;
  xc = (xc == xc) ? xc : 0.0f;  // NaN -> 0 here; fixed up below
  const float fx = floorf(xc * 1.44269504088896341f + 0.5f);
  float r = xc - fx * 0.693359375f;  // ln 2 split in two parts for an exact product
  r = r - fx * -2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  // Scale by 2^fx by adding to the exponent field: y is in [0.7, 1.5], the result stays normal.
  const int32_t n = static_cast<int32_t>(fx);
  float res = f32_from_bits(f32_bits(y) + (static_cast<uint32_t>(n) << 23));
  const float kInf = f32_from_bits(0x7f800000u);
  res = x > kHi ? kInf : res;
  res = x < kLo ? 0.0f : res;
  return (x == x) ? res : x;
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

// log1p(x) for x in (-1, 0]: log(1 + x) with the rounding error of 1 + x corrected to first order
// (keeps full relative accuracy for tiny |x|, where log(1 + x) alone would lose it).
FR_HD float log1p_fast(float x) {
  const float u = 1.0f + x;
  const float correction = (x - (u - 1.0f)) / u;
  return log_fast(u) + correction;
}

FR_HD float exp_c(float x) { return exp_fast(x); }
FR_HD float log1p_c(float x) { return log1p_fast(x); }
FR_HD double exp_c(double x) { return ::exp(x); }
FR_HD double log1p_c(double x) { return ::log1p(x); }

// ---------------------------------------------------------------------------------------------
// The clamped Bernoulli KL proxy (SEMANTICS.md step 3).

template <class C> struct Clamp;
template <> struct Clamp<float> {
  // p, q are clamped to [1e-6, 1 - 1e-6] in float32; log p of a clamped p is the clamp of the log
  // to [ln(1e-6f), ln(1 - 1e-6f)] (monotone), which saves a log per probability.
  static constexpr float kLo = 9.99999997e-07f;
  static constexpr float kHi = 0.999998987f;      // float32(1 - float32(1e-6))
  static constexpr float kLogLo = -13.8155107f;   // ln(kLo)
  static constexpr float kLogHi = -1.01327953e-06f;  // ln(kHi)
};
template <> struct Clamp<double> {
  static constexpr double kLo = 1e-6;
  static constexpr double kHi = 1.0 - 1e-6;
  static constexpr double kLogLo = -13.815510557964274;    // ln(1e-6)
  static constexpr double kLogHi = -1.000000500029089e-06;  // ln(double(1 - 1e-6))
};

template <class C> FR_HD C clamp_to(C x, C lo, C hi) {
  x = x < lo ? lo : x;
  return x > hi ? hi : x;
}

// d = p (log p - log q) + (1 - p) (log(1-p) - log(1-q)) with p = clamp(exp(behavior)),
// q = clamp(exp(current)). Finite for any finite inputs (and for -inf inputs).
template <class C> FR_HD C bernoulli_kl(C behavior, C current) {
  using K = Clamp<C>;
  const C p = clamp_to<C>(exp_c(behavior), K::kLo, K::kHi);
  const C q = clamp_to<C>(exp_c(current), K::kLo, K::kHi);
  const C log_p = clamp_to<C>(behavior, K::kLogLo, K::kLogHi);
  const C log_q = clamp_to<C>(current, K::kLogLo, K::kLogHi);
  return p * (log_p - log_q) + (C(1) - p) * (log1p_c(-p) - log1p_c(-q));
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
