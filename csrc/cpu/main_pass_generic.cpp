// Main pass compiled for the baseline instruction set (every log_probs / behavior dtype pair).
#define FR_ISA_NAMESPACE isa_generic
#include "main_pass_impl.h"

namespace flashreinforce {
namespace cpu {

const MainPassTable& main_pass_generic() {
  static const MainPassTable table = isa_generic::make_table(/*with_float64_log_probs=*/true);
  return table;
}

#if !defined(FLASHREINFORCE_HAVE_AVX2)
const MainPassTable* main_pass_avx2() { return nullptr; }
#endif
#if !defined(FLASHREINFORCE_HAVE_AVX512)
const MainPassTable* main_pass_avx512() { return nullptr; }
#endif

}  // namespace cpu
}  // namespace flashreinforce
