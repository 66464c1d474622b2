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
// key-major result (rows = its key count, a few to a few dozen) laid out token-major. kRows: the
// row count fixed at compile time, or 0 (read at run time).
template <int kRows, typename scalar_t>
inline void transpose_rows(const scalar_t* src, int64_t src_stride, scalar_t* dst, int64_t rows, int64_t cols) {
  const int64_t R = kRows ? kRows : rows;
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < R; ++r) dst[c * R + r] = src[r * src_stride + c];
}

// The transpose above, with the row counts of the RMT's reads and writes (R, 2R or 3R keys for R
// of 2 to 16) as compile-time constants: GCC then vectorizes the inner loop, which it does not
// for a row count read at run time.
template <typename scalar_t>
inline void transpose(const scalar_t* src, int64_t src_stride, scalar_t* dst, int64_t rows, int64_t cols) {
  switch (rows) {
    case 2: return transpose_rows<2>(src, src_stride, dst, rows, cols);
    case 3: return transpose_rows<3>(src, src_stride, dst, rows, cols);
    case 4: return transpose_rows<4>(src, src_stride, dst, rows, cols);
    case 6: return transpose_rows<6>(src, src_stride, dst, rows, cols);
    case 8: return transpose_rows<8>(src, src_stride, dst, rows, cols);
    case 12: return transpose_rows<12>(src, src_stride, dst, rows, cols);
    case 16: return transpose_rows<16>(src, src_stride, dst, rows, cols);
    default: return transpose_rows<0>(src, src_stride, dst, rows, cols);
  }
}

}  // namespace rmt_cpu
