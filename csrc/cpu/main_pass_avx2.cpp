// Main pass compiled with AVX2 + FMA (float32-compute dtypes only; float64 uses the generic one).
#define FR_ISA_NAMESPACE isa_avx2
#include "filter_impl.h"
#include "main_pass_impl.h"

namespace flashreinforce {
namespace cpu {

const KernelTable* kernels_avx2() {
  static const KernelTable table = [] {
    KernelTable t{};
    isa_avx2::fill_main(t, /*with_float64_log_probs=*/false);
    isa_avx2::fill_filter(t);
    return t;
  }();
  return &table;
}

}  // namespace cpu
}  // namespace flashreinforce
