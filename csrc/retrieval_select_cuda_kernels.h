// Plain C++ interface of the CUDA kernels of the fused retrieval's selection (no torch headers),
// so that they compile with a bare `nvcc -c` and the torch binding (retrieval_select_cuda.cpp)
// stays thin. Every launcher returns a cudaError_t value (0 = success). The contract, tie rule and
// arithmetic are rmt.ops.fused_retrieval's; the layouts of the working buffers are stated in
// retrieval_select_cuda_kernels.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

enum RmtSelectDtype { RMT_SELECT_FLOAT32 = 0, RMT_SELECT_BFLOAT16 = 1 };

// The candidates of grid side `side` for every token and head: queries q [T, H, r, D] (strides
// sq0, sq1, sq2, unit last stride), keys [H, 2, r, n, D] contiguous, weights [H, r] (u or t,
// TDQKR; null for product keys). Lists of `width` entries (m; n while every key is a candidate),
// two of them (top, bottom) for TDQKR while 2m < n, written sorted by key index to cand_idx
// [T, H, 2, c] (int32), cand_side [T, H, 2, c, r] (float32); cand_val [T, H, 2, c] is scratch.
int rmt_retrieval_candidates_cuda(int dtype, const void* q, int64_t sq0, int64_t sq1, int64_t sq2, const void* keys,
                                  const float* weights, int side, int64_t T, int64_t H, int64_t r, int64_t n,
                                  int64_t D, int64_t width, int lists, int64_t c, int32_t* cand_idx, float* cand_val,
                                  float* cand_side, cudaStream_t stream);

// The grid top-m per token and head over both sides' candidates (sorted by key index): addr
// [T, H, m] int64 grid addresses, best first; sel [T, H, 2, r, m] the side scores at them in the
// inputs' dtype. core [H, r, r] is the aggregated core (TDQKR) or null (product keys); best_val
// [T, H, m] float32 is scratch.
int rmt_retrieval_grid_cuda(int dtype, const int32_t* cand_idx, const float* cand_side, const float* core, int64_t T,
                            int64_t H, int64_t r, int64_t n, int64_t m, int64_t c, float* best_val, int64_t* addr,
                            void* sel, cudaStream_t stream);
