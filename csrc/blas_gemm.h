// A row-major GEMM on raw pointers for the per-block products of the RMT's CPU kernels
// (matrix_rmsnorm_cpu.cpp, matrix_write_cpu.cpp):
//
//   C [M, N] = op(A) [M, K] op(B) [K, N],   op(X) = X, or X transposed where trans_X is set,
//
// each operand stored row-major with its own row stride (lda, ldb, ldc: the stored rows, i.e.
// [K, M] for a transposed A). float32 and float64 call the BLAS that libtorch_cpu exports
// (sgemm_ / dgemm_: MKL's on torch's x86 wheels, declared as torch's own CPUBlas.cpp declares
// them) directly. Written by hand because the kernels run one small GEMM per block of 64 tokens,
// and at::mm_out's per-call overhead on narrowed views of the blocks (narrow, transpose, the
// dispatcher, mm's checks) is a visible share of a small model's step. The plain reference is the same product through at::mm_out on tensors
// wrapping the same memory, which this header falls back to for bfloat16 (no such BLAS symbol),
// for dimensions over 32-bit BLAS ints, and where libtorch exports no sgemm_ / dgemm_.
#pragma once

#include <torch/extension.h>

#include <climits>
#include <cstdint>

// The Fortran BLAS interface (LP64: 32-bit ints). Weak: where libtorch_cpu does not export them,
// they resolve to null and every product takes at::mm_out.
extern "C" {
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc) __attribute__((weak));
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc) __attribute__((weak));
}

namespace rmt_cpu {

// The stored [rows, cols] matrix at p (row stride ld) as a tensor of `like`'s options, transposed
// where trans is set: the logical operand, without copying.
inline torch::Tensor wrap(const void* p, int64_t rows, int64_t cols, int64_t ld, bool trans,
                          const torch::TensorOptions& like) {
  auto t = torch::from_blob(const_cast<void*>(p), {rows, cols}, {ld, 1}, like);
  return trans ? t.t() : t;
}

// The reference: the product through at::mm_out, on tensors wrapping the operands' memory.
template <typename scalar_t>
void gemm_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const scalar_t* A, int64_t lda,
                    const scalar_t* B, int64_t ldb, scalar_t* C, int64_t ldc) {
  const auto opts = torch::TensorOptions().dtype(c10::CppTypeToScalarType<scalar_t>::value);
  auto c = torch::from_blob(C, {M, N}, {ldc, 1}, opts);
  at::mm_out(c, wrap(A, trans_a ? K : M, trans_a ? M : K, lda, trans_a, opts),
             wrap(B, trans_b ? N : K, trans_b ? K : N, ldb, trans_b, opts));
}

// Column-major BLAS computes the row-major C as its transpose: C^T [N, M] = op(B)^T op(A)^T, and a
// row-major stored matrix is, to BLAS, its own transpose, so B comes first and each op flips
// meaning.
template <typename scalar_t, typename Blas>
bool blas_gemm(Blas* fn, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const scalar_t* A,
               int64_t lda, const scalar_t* B, int64_t ldb, scalar_t* C, int64_t ldc) {
  for (int64_t d : {M, N, K, lda, ldb, ldc})
    if (d > INT_MAX) return false;
  if (fn == nullptr) return false;
  if (M == 0 || N == 0) return true;  // nothing to write
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
  const scalar_t one = 1, zero = 0;
  fn(&ta, &tb, &m, &n, &k, &one, B, &la, A, &lb, &zero, C, &lc);
  return true;
}

template <typename scalar_t>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const scalar_t* A, int64_t lda,
          const scalar_t* B, int64_t ldb, scalar_t* C, int64_t ldc) {
  bool done = false;
  if constexpr (std::is_same<scalar_t, float>::value)
    done = blas_gemm(sgemm_, trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc);
  else if constexpr (std::is_same<scalar_t, double>::value)
    done = blas_gemm(dgemm_, trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc);
  if (!done) gemm_reference(trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc);
}

}  // namespace rmt_cpu
