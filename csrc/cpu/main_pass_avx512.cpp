// Main pass compiled with AVX-512 (F/BW/DQ/VL) + FMA (float32-compute dtypes only).
#define FR_ISA_NAMESPACE isa_avx512
#include "filter_impl.h"
#include "main_pass_impl.h"

namespace flashreinforce {
namespace cpu {

const KernelTable* kernels_avx512() {
  static const KernelTable table = [] {
    KernelTable t{};
    isa_avx512::fill_main(t, /*with_float64_log_probs=*/false);
    isa_avx512::fill_filter(t);
    return t;
  }();
  return &table;
}

}  // namespace cpu
}  // namespace flashreinforce
