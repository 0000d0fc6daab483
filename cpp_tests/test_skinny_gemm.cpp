// C++ tests of the packed skinny product (flashreinforce/skinny_gemm.h) against a double-precision
// product, on random shapes: row counts in whole and partial groups of 8, output columns in whole and
// partial panels, odd and even in_features, strided rows, with and without a bias; results the same
// bits for any number of threads; the checks' messages. Run through CTest. Where the CPU lacks a
// dtype's kernels the product is not run (said on stdout) and only the packing and checks are tested.
// Seed: `test_skinny_gemm --seed SEED` (else FR_TEST_SEED, else fresh), printed with each run.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashreinforce/skinny_gemm.h"
#include "flashreinforce/token_math.h"

using namespace flashreinforce;

static int g_failures = 0;

#define CHECK(cond, ...)                                                  \
  do {                                                                    \
    if (!(cond)) {                                                        \
      std::fprintf(stderr, "FAIL %s:%d: %s | ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                  \
      std::fprintf(stderr, "\n");                                         \
      ++g_failures;                                                       \
    }                                                                     \
  } while (0)

// Values exactly representable in both dtypes (bfloat16-rounded), so one double reference serves both.
static float draw(std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  return math::bf16_to_float(math::float_to_bf16(u(rng)));
}

struct Case {
  int64_t rows, in, out, x_stride, y_stride;
  bool bias;
};

// One product of `c` in `dt`, compared with the double product; returns y (as float) for the thread
// check.
static std::vector<float> run_case(DType dt, const Case& c, int threads, uint64_t data_seed) {
  std::mt19937_64 data(data_seed);
  const int64_t w_stride = c.in + 3;
  std::vector<float> w(c.out * w_stride), x(std::max<int64_t>(1, c.rows) * c.x_stride), b(c.out);
  for (auto& v : w) v = draw(data);
  for (auto& v : x) v = draw(data);
  for (auto& v : b) v = draw(data);
  const bool f32 = dt == DType::kFloat32;
  std::vector<uint16_t> w16(w.size()), x16(x.size()), b16(b.size());
  for (size_t i = 0; i < w.size(); ++i) w16[i] = math::float_to_bf16(w[i]);
  for (size_t i = 0; i < x.size(); ++i) x16[i] = math::float_to_bf16(x[i]);
  for (size_t i = 0; i < b.size(); ++i) b16[i] = math::float_to_bf16(b[i]);

  const int64_t elements = skinny_gemm_packed_elements(dt, c.out, c.in);
  std::vector<float> packed32(f32 ? elements : 0, -7.0f);
  std::vector<uint16_t> packed16(f32 ? 0 : elements, 0xFFFF);
  SkinnyPackParams pk;
  pk.dtype = dt, pk.out_features = c.out, pk.in_features = c.in, pk.weight_stride = w_stride;
  pk.weight = f32 ? static_cast<const void*>(w.data()) : w16.data();
  pk.packed = f32 ? static_cast<void*>(packed32.data()) : packed16.data();
  CHECK(std::string(skinny_pack_check(pk)).empty(), "%s", skinny_pack_check(pk));
  skinny_pack_cpu(pk, threads);
  // Every packed element is a weight element or zero padding (nothing left as the fill value).
  for (int64_t i = 0; i < elements; ++i) {
    const bool filled = f32 ? packed32[i] != -7.0f : packed16[i] != 0xFFFF;
    if (!filled) {
      CHECK(filled, "packed element %lld not written", static_cast<long long>(i));
      break;
    }
  }
  std::vector<float> result(c.rows * c.out, 0.0f);
  if (!skinny_gemm_supported(dt) || c.rows == 0) return result;

  std::vector<float> y32(std::max<int64_t>(1, c.rows) * c.y_stride, 123.0f);
  std::vector<uint16_t> y16(y32.size(), 0x4242);
  SkinnyGemmParams p;
  p.dtype = dt, p.rows = c.rows, p.in_features = c.in, p.out_features = c.out;
  p.x = f32 ? static_cast<const void*>(x.data()) : x16.data(), p.x_stride = c.x_stride;
  p.packed = pk.packed;
  p.bias = c.bias ? (f32 ? static_cast<const void*>(b.data()) : b16.data()) : nullptr;
  p.y = f32 ? static_cast<void*>(y32.data()) : y16.data(), p.y_stride = c.y_stride;
  CHECK(std::string(skinny_gemm_check(p)).empty(), "%s", skinny_gemm_check(p));
  skinny_gemm_cpu(p, threads);

  double worst = 0.0;
  for (int64_t r = 0; r < c.rows; ++r) {
    for (int64_t n = 0; n < c.out; ++n) {
      double ref = c.bias ? b[n] : 0.0, mag = c.bias ? std::fabs(b[n]) : 0.0;
      for (int64_t k = 0; k < c.in; ++k) {
        ref += static_cast<double>(x[r * c.x_stride + k]) * w[n * w_stride + k];
        mag += std::fabs(static_cast<double>(x[r * c.x_stride + k]) * w[n * w_stride + k]);
      }
      const float got = f32 ? y32[r * c.y_stride + n] : math::bf16_to_float(y16[r * c.y_stride + n]);
      result[r * c.out + n] = got;
      // float32 sums: a few units of float32 rounding of the magnitude; bfloat16 adds the one rounding
      // of the result (half a unit of its 8-bit significand).
      const double tol =
          4e-7 * mag * std::sqrt(static_cast<double>(c.in)) + (f32 ? 0.0 : std::fabs(ref) / 256.0) + 1e-30;
      worst = std::max(worst, std::fabs(got - ref) / tol);
    }
    // Columns past out_features (the stride's gap) are left alone.
    for (int64_t n = c.out; n < c.y_stride; ++n) {
      const bool kept = f32 ? y32[r * c.y_stride + n] == 123.0f : y16[r * c.y_stride + n] == 0x4242;
      CHECK(kept, "row %lld column %lld past out_features written", static_cast<long long>(r),
            static_cast<long long>(n));
    }
  }
  CHECK(worst <= 1.0, "%s rows %lld in %lld out %lld bias %d: error %.3g of the tolerance",
        f32 ? "float32" : "bfloat16", static_cast<long long>(c.rows), static_cast<long long>(c.in),
        static_cast<long long>(c.out), static_cast<int>(c.bias), worst);
  return result;
}

static void check_errors() {
  SkinnyGemmParams p;
  p.dtype = DType::kFloat64, p.rows = 1, p.in_features = 4, p.out_features = 4;
  CHECK(std::string(skinny_gemm_check(p)).find("dtype") != std::string::npos, "%s", skinny_gemm_check(p));
  p.dtype = DType::kFloat32;
  p.in_features = 0;
  CHECK(std::string(skinny_gemm_check(p)).find("sizes") != std::string::npos, "%s", skinny_gemm_check(p));
  p.in_features = 4;
  CHECK(std::string(skinny_gemm_check(p)).find("null") != std::string::npos, "%s", skinny_gemm_check(p));
  float buf[64] = {};
  p.x = buf, p.packed = buf, p.y = buf, p.rows = 2, p.x_stride = 3, p.y_stride = 4;
  CHECK(std::string(skinny_gemm_check(p)).find("x_stride") != std::string::npos, "%s", skinny_gemm_check(p));
  SkinnyPackParams k;
  k.dtype = DType::kBFloat16, k.out_features = 2, k.in_features = 5;
  k.weight = buf, k.packed = buf, k.weight_stride = 4;
  CHECK(std::string(skinny_pack_check(k)).find("weight_stride") != std::string::npos, "%s", skinny_pack_check(k));
  k.weight = nullptr;
  CHECK(std::string(skinny_pack_check(k)).find("null") != std::string::npos, "%s", skinny_pack_check(k));
  CHECK(skinny_gemm_packed_elements(DType::kBFloat16, 49, 5) == 2 * kSkinnyPanel * 6, "bfloat16 packed size");
  CHECK(skinny_gemm_packed_elements(DType::kFloat32, 48, 5) == kSkinnyPanel * 5, "float32 packed size");
}

int main(int argc, char** argv) {
  const char* given = std::getenv("FR_TEST_SEED");
  if (argc == 3 && std::strcmp(argv[1], "--seed") == 0) given = argv[2];
  const uint64_t seed = given != nullptr ? std::strtoull(given, nullptr, 10) : std::random_device{}();
  std::printf("seed %llu (replay: %s --seed %llu)\n", static_cast<unsigned long long>(seed), argv[0],
              static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    const char* name = dt == DType::kFloat32 ? "float32" : "bfloat16";
    std::printf("%s kernels: %s\n", name, skinny_gemm_supported(dt) ? "run" : "not run here, by the CPU or FLASHREINFORCE_CPU_ISA (packing only)");
    std::vector<Case> cases = {{8, 64, 48, 64, 48, false},  {1, 1, 1, 1, 1, true},     {7, 5, 17, 5, 17, true},
                               {32, 96, 144, 100, 150, true}, {9, 33, 50, 40, 64, false}, {0, 8, 8, 8, 8, false},
                               {17, 130, 97, 130, 97, true}};
    for (int i = 0; i < 6; ++i) {
      const int64_t rows = 1 + static_cast<int64_t>(rng() % 40), in = 1 + static_cast<int64_t>(rng() % 300);
      const int64_t out = 1 + static_cast<int64_t>(rng() % 200);
      cases.push_back({rows, in, out, in + static_cast<int64_t>(rng() % 5), out + static_cast<int64_t>(rng() % 5),
                       (rng() & 1) != 0});
    }
    for (const Case& c : cases) {
      const uint64_t data_seed = rng();
      const std::vector<float> one = run_case(dt, c, 1, data_seed);
      for (int threads : {2, 3}) {
        const std::vector<float> more = run_case(dt, c, threads, data_seed);
        CHECK(std::memcmp(one.data(), more.data(), one.size() * sizeof(float)) == 0,
              "%s rows %lld: %d threads differ from 1", name, static_cast<long long>(c.rows), threads);
      }
    }
  }
  check_errors();
  if (g_failures) {
    std::fprintf(stderr, "%d check(s) failed (seed %llu)\n", g_failures, static_cast<unsigned long long>(seed));
    return 1;
  }
  std::printf("all skinny product checks passed\n");
  return 0;
}
