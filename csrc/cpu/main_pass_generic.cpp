// Main pass, filter and decode attention compiled for the baseline instruction set (every log_probs /
// behavior dtype pair).
// Its one external symbol is isa_generic::fill_kernels (see main_pass.h).
#define FR_ISA_NAMESPACE isa_generic
#include "filter_impl.h"
#include "main_pass_impl.h"
#include "decode_attention_impl.h"

namespace flashreinforce {
namespace cpu {
namespace isa_generic {

void fill_kernels(KernelTable& table) {
  fill_main(table, /*with_float64_log_probs=*/true);
  fill_filter(table);
  fill_decode_attention(table);
}

}  // namespace isa_generic
}  // namespace cpu
}  // namespace flashreinforce
