// The bfloat16 skinny-product kernel (skinny_gemm_kernels.h), compiled for AVX-512 BF16.
#define FR_SKINNY_DTYPE 16
#include "skinny_gemm_isa.h"
#include "skinny_gemm_kernels.h"

namespace flashreinforce {
namespace cpu {

void skinny_panels_avx512_bf16(const SkinnyGemmParams& p, int64_t begin, int64_t end) {
  panels_of_product(p, begin, end);
}

}  // namespace cpu
}  // namespace flashreinforce
