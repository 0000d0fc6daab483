// Main pass compiled with AVX-512 (F/BW/DQ/VL) + FMA (float32-compute dtypes only).
#define FR_ISA_NAMESPACE isa_avx512
#include "main_pass_impl.h"

namespace flashreinforce {
namespace cpu {

const MainPassTable* main_pass_avx512() {
  static const MainPassTable table = isa_avx512::make_table(/*with_float64_log_probs=*/false);
  return &table;
}

}  // namespace cpu
}  // namespace flashreinforce
