// Plain C++ interface of the CUDA lookup-reduce kernels (no torch headers), so the kernels
// compile with a bare `nvcc -c` and the torch binding (lookup_reduce_cuda.cpp) stays thin.
// Every launcher returns a cudaError_t value (0 = success). Index arrays are int64 and
// contiguous; tensors are row-major: table [N, D], indices/block_ids [T, K], scores [T, K, C],
// out/grad_out [T, E, D], values [U, D].
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

enum RmtDtype { RMT_FLOAT32 = 0, RMT_BFLOAT16 = 1, RMT_FLOAT16 = 2 };

// out[t, b, :] = sum_{k: block[t,k]==b} scores[t,k,d/(D/C)] * table[indices[t,k], :]; block_ids
// may be null (one block).
int rmt_lookup_reduce_forward_cuda(int dtype, const void* table, const int64_t* indices,
                                   const void* scores, const int64_t* block_ids, void* out,
                                   int64_t T, int64_t K, int64_t C, int64_t D, int64_t E,
                                   cudaStream_t stream);

// Bytes of scratch space rmt_lookup_reduce_sort_cuda needs for M lookups.
size_t rmt_lookup_reduce_sort_workspace_bytes(int64_t M);

// Stable radix sort of the M flat lookups by row (bits [0, end_bit) of the index), then
// run-length encoding: unique_rows[0:U], counts[0:U], *num_unique = U (device memory).
int rmt_lookup_reduce_sort_cuda(const int64_t* indices, int64_t M, int end_bit,
                                int64_t* positions_in, int64_t* sorted_keys,
                                int64_t* sorted_positions, int64_t* unique_rows, int64_t* counts,
                                int64_t* num_unique, void* workspace, size_t workspace_bytes,
                                cudaStream_t stream);

// values[u, :] = sum over the lookups p of row u (in sorted order) of
// scores[p, d/(D/C)] * grad_out[p/K, block[p], :]; grad_scores[p, c] = <table row, grad_out row>
// over column slice c. seg_start has U+1 entries. Deterministic: no atomics.
int rmt_lookup_reduce_backward_cuda(int dtype, const void* grad_out, const void* table,
                                    const int64_t* indices, const void* scores,
                                    const int64_t* block_ids, const int64_t* sorted_positions,
                                    const int64_t* seg_start, int64_t U,
                                    void* values, void* grad_scores, int64_t T, int64_t K,
                                    int64_t C, int64_t D, int64_t E, cudaStream_t stream);
