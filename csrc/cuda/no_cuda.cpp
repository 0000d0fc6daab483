// Compiled instead of the CUDA sources when the module is built without CUDA.
#include <stdexcept>

#include "flashreinforce/core.h"

namespace flashreinforce {

bool has_cuda() { return false; }

size_t cuda_workspace_bytes(int64_t, int64_t, bool) { return 0; }

Error loss_forward_cuda(const LossParams&, void*, int64_t*, void*, bool) {
  throw std::runtime_error("flashreinforce was built without CUDA");
}

}  // namespace flashreinforce
