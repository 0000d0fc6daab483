// Reading one element of a typed buffer as a double, on the host and on the device.
// Shared by the CPU and the CUDA path (rewards of any real type).
#pragma once

#include <cstdint>

#include "flashreinforce/core.h"
#include "flashreinforce/token_math.h"

namespace flashreinforce {

// Element i of p, stored as dtype, converted to double (rounded to nearest for 64-bit integers;
// bool and uint8 read as 0/1 and 0..255).
FR_HD double load_as_double(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat16: return math::half_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kBFloat16: return math::bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kFloat32: return static_cast<const float*>(p)[i];
    case DType::kFloat64: return static_cast<const double*>(p)[i];
    case DType::kInt32: return static_cast<const int32_t*>(p)[i];
    case DType::kInt64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::kInt8: return static_cast<const int8_t*>(p)[i];
    case DType::kInt16: return static_cast<const int16_t*>(p)[i];
    case DType::kUInt16: return static_cast<const uint16_t*>(p)[i];
    case DType::kUInt32: return static_cast<const uint32_t*>(p)[i];
    case DType::kUInt64: return static_cast<double>(static_cast<const uint64_t*>(p)[i]);
    case DType::kBool:
    case DType::kUInt8: return static_cast<const uint8_t*>(p)[i];
  }
  return 0.0;
}

}  // namespace flashreinforce
