// Main pass compiled for the baseline instruction set (every log_probs / behavior dtype pair).
#define FR_ISA_NAMESPACE isa_generic
#include "filter_impl.h"
#include "main_pass_impl.h"

namespace flashreinforce {
namespace cpu {

const KernelTable& kernels_generic() {
  static const KernelTable table = [] {
    KernelTable t{};
    isa_generic::fill_main(t, /*with_float64_log_probs=*/true);
    isa_generic::fill_filter(t);
    return t;
  }();
  return table;
}

#if !defined(FLASHREINFORCE_HAVE_AVX2)
const KernelTable* kernels_avx2() { return nullptr; }
#endif
#if !defined(FLASHREINFORCE_HAVE_AVX512)
const KernelTable* kernels_avx512() { return nullptr; }
#endif

}  // namespace cpu
}  // namespace flashreinforce
