// Helpers of the CPU kernels that split their rows into blocks, one block per parallel task
// (matrix_rmsnorm_cpu.cpp, matrix_write_cpu.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace rmt_cpu {

// Sums per-block partials [blocks, n] in block order, so the result does not depend on which
// thread computed which block.
inline torch::Tensor sum_blocks(const torch::Tensor& partial) {
  auto total = torch::zeros({partial.size(1)}, partial.options());
  AT_DISPATCH_FLOATING_TYPES(partial.scalar_type(), "sum_blocks", [&] {
    scalar_t* out = total.data_ptr<scalar_t>();
    const scalar_t* p = partial.data_ptr<scalar_t>();
    for (int64_t b = 0; b < partial.size(0); ++b)
      for (int64_t j = 0; j < partial.size(1); ++j) out[j] += p[b * partial.size(1) + j];
  });
  return total;
}

// dst [cols, rows] = src [rows, cols] transposed, src's rows src_stride elements apart: a
// key-major result (rows = its key count, a few to a few dozen) laid out token-major.
template <typename scalar_t>
inline void transpose(const scalar_t* src, int64_t src_stride, scalar_t* dst, int64_t rows, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r) dst[c * rows + r] = src[r * src_stride + c];
}

}  // namespace rmt_cpu
