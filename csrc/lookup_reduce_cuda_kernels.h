// Plain C++ interface of the CUDA lookup-reduce kernels (no torch headers), so the kernels
// compile with a bare `nvcc -c` and the torch binding (lookup_reduce_cuda.cpp) stays thin.
// Every launcher returns a cudaError_t value (0 = success). Index arrays are int64 and
// contiguous; tensors are row-major: table [N, D], indices/block_ids [T, K], scores [T, K, C],
// out/grad_out [T, E, D], values [U, D].
//
// Dtypes (RmtDtype codes): table_dtype is the table's and its gradient's (dst), score_dtype that
// of scores, out, grad_out and grad_scores; either equal, or a bf16/fp16 table with fp32 scores
// (other pairs return cudaErrorInvalidValue). Accumulation is in fp32.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

enum RmtDtype { RMT_FLOAT32 = 0, RMT_BFLOAT16 = 1, RMT_FLOAT16 = 2 };

// out[t, b, :] = sum_{k: block[t,k]==b} scores[t,k,d/(D/C)] * table[indices[t,k], :]; block_ids
// may be null (one block).
int rmt_lookup_reduce_forward_cuda(int table_dtype, int score_dtype, const void* table,
                                   const int64_t* indices, const void* scores, const int64_t* block_ids, void* out,
                                   int64_t T, int64_t K, int64_t C, int64_t D, int64_t E,
                                   cudaStream_t stream);

// Bytes of scratch space rmt_lookup_reduce_sort_cuda needs for M lookups.
size_t rmt_lookup_reduce_sort_workspace_bytes(int64_t M);

// Stable radix sort of the M flat lookups by row (bits [0, end_bit) of the index), run-length
// encoding and a scan, all on the device: unique_rows[0:U], seg_start[0:U+1] (seg_start[U] = M),
// *num_unique = U. counts and seg_start have M + 1 entries.
int rmt_lookup_reduce_sort_cuda(const int64_t* indices, int64_t M, int end_bit,
                                int64_t* positions_in, int64_t* sorted_keys,
                                int64_t* sorted_positions, int64_t* unique_rows, int64_t* counts,
                                int64_t* seg_start, int64_t* num_unique, void* workspace,
                                size_t workspace_bytes, cudaStream_t stream);

// For each unique row u < *num_unique (max_unique bounds the launch): the gradient row, the sum
// over the row's lookups p (in sorted order) of scores[p, d/(D/C)] * grad_out[p/K, block[p], :],
// written to dst[u] (dense = 0, dst is [U, D]) or dst[row] (dense = 1, dst is the [N, D] table
// gradient, zeroed by the caller); and grad_scores[p, c] = <table row, grad_out row> over column
// slice c. Deterministic: no atomics.
int rmt_lookup_reduce_backward_cuda(int table_dtype, int score_dtype, const void* grad_out,
                                    const void* table, const void* scores, const int64_t* block_ids,
                                    const int64_t* sorted_positions, const int64_t* seg_start,
                                    const int64_t* unique_rows, const int64_t* num_unique,
                                    int64_t max_unique, void* dst, int dense, void* grad_scores,
                                    int64_t K, int64_t C, int64_t D, int64_t E, cudaStream_t stream);

// The backward with the optimizer step fused in (rmt/ops/fused_update.py), for D <= 512 (else
// cudaErrorInvalidValue): per unique row, the gradient as above times grad_scale steps
// table[row] and its fp32 state in place (adam != 0: SparseAdam, state1/state2 the moments, lr
// the bias-corrected step size; else row-wise Adagrad, state1 the per-row sums); score gradients
// of positions in [score_lo, score_hi) into grad_scores[p - score_lo]; row_sq[u] the row's
// squared gradient norm. No gradient row is stored.
int rmt_lookup_reduce_backward_update_cuda(int table_dtype, int score_dtype, const void* grad_out, void* table,
                                           const void* scores, const int64_t* block_ids,
                                           const int64_t* sorted_positions, const int64_t* seg_start,
                                           const int64_t* unique_rows, const int64_t* num_unique,
                                           int64_t max_unique, void* grad_scores, int64_t score_lo,
                                           int64_t score_hi, int adam, float* state1, float* state2, float* row_sq,
                                           int64_t K, int64_t C, int64_t D, int64_t E, float grad_scale, float lr,
                                           float one_minus_beta1, float one_minus_beta2, float eps,
                                           float weight_decay, cudaStream_t stream);
