// Main pass compiled with AVX2 + FMA (float32-compute dtypes only; float64 uses the generic one).
#define FR_ISA_NAMESPACE isa_avx2
#include "main_pass_impl.h"

namespace flashreinforce {
namespace cpu {

const MainPassTable* main_pass_avx2() {
  static const MainPassTable table = isa_avx2::make_table(/*with_float64_log_probs=*/false);
  return &table;
}

}  // namespace cpu
}  // namespace flashreinforce
