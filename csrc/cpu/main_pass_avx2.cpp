// Main pass, filter and decode attention compiled with AVX2 + FMA (float32-compute dtypes; float64
// stays generic).
// Its one external symbol is isa_avx2::fill_kernels (see main_pass.h).
#define FR_ISA_NAMESPACE isa_avx2
#include "filter_impl.h"
#include "main_pass_impl.h"
#include "decode_attention_impl.h"

namespace flashreinforce {
namespace cpu {
namespace isa_avx2 {

void fill_kernels(KernelTable& table) {
  fill_main(table, /*with_float64_log_probs=*/false);
  fill_filter(table);
  fill_decode_attention(table);
}

}  // namespace isa_avx2
}  // namespace cpu
}  // namespace flashreinforce
