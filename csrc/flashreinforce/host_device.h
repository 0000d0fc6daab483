// FR_HD: marks the small inline functions shared by the CPU and the CUDA path (__host__ __device__
// under nvcc, a forced-inline function elsewhere), so the CPU tests exercise exactly the code the
// GPU runs.
#pragma once

#if defined(__CUDACC__)
#define FR_HD __host__ __device__ __forceinline__
#else
#define FR_HD inline __attribute__((always_inline))
#endif
