// The entry points of the AVX-512 skinny-product kernels (skinny_gemm_kernels.h), each in a file compiled
// for its instruction set; skinny_gemm_cpu.cpp calls them only where the CPU has that set.
#pragma once

#include <cstdint>

#include "flashreinforce/skinny_gemm.h"

namespace flashreinforce {
namespace cpu {

// The instruction set the CPU path uses (loss_cpu.cpp, the one place that decides: the CPU's best, or
// a lower one named by FLASHREINFORCE_CPU_ISA): the kernels below run only where it is "avx512".
const char* cpu_isa_name();
// Whether that path uses AVX-512 BF16 (the bfloat16 kernel below runs only then).
bool cpu_uses_avx512_bf16();

// Panels [begin, end) of p (float32; AVX-512F).
void skinny_panels_avx512_f32(const SkinnyGemmParams& p, int64_t begin, int64_t end);
// Panels [begin, end) of p (bfloat16; AVX-512F, BW, VL and BF16).
void skinny_panels_avx512_bf16(const SkinnyGemmParams& p, int64_t begin, int64_t end);

}  // namespace cpu
}  // namespace flashreinforce
