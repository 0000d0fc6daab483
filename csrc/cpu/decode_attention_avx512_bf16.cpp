// The decode attention of bfloat16 caches compiled with AVX-512 BF16 as well (decode_attention_impl.h:
// the scores by vdpbf16ps, on the stored queries and keys). Entered only through the kernel table,
// where loss_cpu.cpp's dispatch found the CPU's AVX-512 and its BF16 extension. Its one external
// symbol is isa_avx512_bf16::fill_decode_attention_bf16 (see main_pass.h).
#define FR_ISA_NAMESPACE isa_avx512_bf16
#include "decode_attention_impl.h"

namespace flashreinforce {
namespace cpu {
namespace isa_avx512_bf16 {

void fill_decode_attention_bf16(KernelTable& table) {
  table.decode_attention[static_cast<int>(DType::kBFloat16)] = &decode_attention_task<math::BFloat16>;
}

}  // namespace isa_avx512_bf16
}  // namespace cpu
}  // namespace flashreinforce
