// CUDA kernels of the fused lookup-reduce (bf16/fp16/fp32 inputs, fp32 accumulation, any D).
// No torch headers: see lookup_reduce_cuda_kernels.h for the interface and the torch binding
// in lookup_reduce_cuda.cpp.
//
// Forward: one thread block per (token, virtual block); threads stride over the D columns.
// Backward: cub radix sort of the lookups by row + run-length encoding, then one thread block
// per unique row sums its lookups in sorted order (no atomics, bit-identical results); score
// gradients: one warp per lookup, a fixed shuffle-reduction tree.
#include "lookup_reduce_cuda_kernels.h"

#include <cub/cub.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

constexpr int kWarp = 32;
constexpr int kMaxThreads = 256;
constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

int threads_for(int64_t D) {
  const int64_t rounded = ((D + kWarp - 1) / kWarp) * kWarp;
  return static_cast<int>(rounded < kMaxThreads ? rounded : kMaxThreads);
}

template <typename scalar_t>
__global__ void forward_kernel(const scalar_t* __restrict__ table, const int64_t* __restrict__ indices,
                               const scalar_t* __restrict__ scores, const int64_t* __restrict__ block_ids,
                               scalar_t* __restrict__ out, int64_t K, int64_t C, int64_t D, int64_t E) {
  const int64_t t = blockIdx.x / E;
  const int64_t b = blockIdx.x % E;
  const int64_t Dc = D / C;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    const int64_t c = d / Dc;
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t p = t * K + k;
      if (block_ids != nullptr && block_ids[p] != b) continue;
      acc += to_float(scores[p * C + c]) * to_float(table[indices[p] * D + d]);
    }
    out[blockIdx.x * D + d] = from_float<scalar_t>(acc);
  }
}

__global__ void iota_kernel(int64_t* __restrict__ out, int64_t M) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < M) out[i] = i;
}

template <typename scalar_t>
__global__ void row_grad_kernel(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ scores,
                                const int64_t* __restrict__ block_ids,
                                const int64_t* __restrict__ sorted_positions,
                                const int64_t* __restrict__ seg_start, scalar_t* __restrict__ values,
                                int64_t K, int64_t C, int64_t D, int64_t E) {
  const int64_t u = blockIdx.x;
  const int64_t Dc = D / C;
  const int64_t start = seg_start[u], end = seg_start[u + 1];
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    const int64_t c = d / Dc;
    float acc = 0.f;
    for (int64_t j = start; j < end; ++j) {
      const int64_t p = sorted_positions[j];
      const int64_t b = block_ids != nullptr ? block_ids[p] : 0;
      acc += to_float(scores[p * C + c]) * to_float(grad_out[((p / K) * E + b) * D + d]);
    }
    values[u * D + d] = from_float<scalar_t>(acc);
  }
}

template <typename scalar_t>
__global__ void score_grad_kernel(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ table,
                                  const int64_t* __restrict__ indices, const int64_t* __restrict__ block_ids,
                                  scalar_t* __restrict__ grad_scores, int64_t M, int64_t K, int64_t C,
                                  int64_t D, int64_t E) {
  const int64_t p = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (p >= M) return;
  const int64_t Dc = D / C;
  const int64_t b = block_ids != nullptr ? block_ids[p] : 0;
  const scalar_t* row = table + indices[p] * D;
  const scalar_t* g = grad_out + ((p / K) * E + b) * D;
  for (int64_t c = 0; c < C; ++c) {
    float dot = 0.f;
    for (int64_t d = c * Dc + lane; d < (c + 1) * Dc; d += kWarp) dot += to_float(row[d]) * to_float(g[d]);
    for (int offset = kWarp / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (lane == 0) grad_scores[p * C + c] = from_float<scalar_t>(dot);
  }
}

template <typename F>
int dispatch_dtype(int dtype, F&& launch) {
  switch (dtype) {
    case RMT_FLOAT32: return launch(float{});
    case RMT_BFLOAT16: return launch(__nv_bfloat16{});
    case RMT_FLOAT16: return launch(__half{});
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

using SortKey = unsigned long long;

}  // namespace

int rmt_lookup_reduce_forward_cuda(int dtype, const void* table, const int64_t* indices,
                                   const void* scores, const int64_t* block_ids, void* out,
                                   int64_t T, int64_t K, int64_t C, int64_t D, int64_t E,
                                   cudaStream_t stream) {
  if (T * E == 0) return static_cast<int>(cudaSuccess);
  return dispatch_dtype(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    forward_kernel<scalar_t><<<static_cast<unsigned>(T * E), threads_for(D), 0, stream>>>(
        static_cast<const scalar_t*>(table), indices, static_cast<const scalar_t*>(scores), block_ids,
        static_cast<scalar_t*>(out), K, C, D, E);
    return static_cast<int>(cudaGetLastError());
  });
}

size_t rmt_lookup_reduce_sort_workspace_bytes(int64_t M) {
  size_t sort_bytes = 0, rle_bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const SortKey*>(nullptr),
                                  static_cast<SortKey*>(nullptr), static_cast<const int64_t*>(nullptr),
                                  static_cast<int64_t*>(nullptr), M);
  cub::DeviceRunLengthEncode::Encode(nullptr, rle_bytes, static_cast<const SortKey*>(nullptr),
                                     static_cast<SortKey*>(nullptr), static_cast<int64_t*>(nullptr),
                                     static_cast<int64_t*>(nullptr), M);
  return sort_bytes > rle_bytes ? sort_bytes : rle_bytes;
}

int rmt_lookup_reduce_sort_cuda(const int64_t* indices, int64_t M, int end_bit,
                                int64_t* positions_in, int64_t* sorted_keys,
                                int64_t* sorted_positions, int64_t* unique_rows, int64_t* counts,
                                int64_t* num_unique, void* workspace, size_t workspace_bytes,
                                cudaStream_t stream) {
  if (M == 0) return static_cast<int>(cudaMemsetAsync(num_unique, 0, sizeof(int64_t), stream));
  const unsigned blocks = static_cast<unsigned>((M + kMaxThreads - 1) / kMaxThreads);
  iota_kernel<<<blocks, kMaxThreads, 0, stream>>>(positions_in, M);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return static_cast<int>(err);
  size_t bytes = workspace_bytes;
  err = cub::DeviceRadixSort::SortPairs(workspace, bytes, reinterpret_cast<const SortKey*>(indices),
                                        reinterpret_cast<SortKey*>(sorted_keys), positions_in,
                                        sorted_positions, M, 0, end_bit, stream);
  if (err != cudaSuccess) return static_cast<int>(err);
  bytes = workspace_bytes;
  err = cub::DeviceRunLengthEncode::Encode(workspace, bytes, reinterpret_cast<const SortKey*>(sorted_keys),
                                           reinterpret_cast<SortKey*>(unique_rows), counts, num_unique, M,
                                           stream);
  return static_cast<int>(err);
}

int rmt_lookup_reduce_backward_cuda(int dtype, const void* grad_out, const void* table,
                                    const int64_t* indices, const void* scores,
                                    const int64_t* block_ids, const int64_t* sorted_positions,
                                    const int64_t* seg_start, int64_t U,
                                    void* values, void* grad_scores, int64_t T, int64_t K,
                                    int64_t C, int64_t D, int64_t E, cudaStream_t stream) {
  const int64_t M = T * K;
  return dispatch_dtype(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    if (U > 0) {
      row_grad_kernel<scalar_t><<<static_cast<unsigned>(U), threads_for(D), 0, stream>>>(
          static_cast<const scalar_t*>(grad_out), static_cast<const scalar_t*>(scores), block_ids,
          sorted_positions, seg_start, static_cast<scalar_t*>(values), K, C, D, E);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return static_cast<int>(err);
    }
    if (M > 0) {
      const unsigned blocks = static_cast<unsigned>((M + kWarpsPerBlock - 1) / kWarpsPerBlock);
      score_grad_kernel<scalar_t><<<blocks, kWarpsPerBlock * kWarp, 0, stream>>>(
          static_cast<const scalar_t*>(grad_out), static_cast<const scalar_t*>(table), indices, block_ids,
          static_cast<scalar_t*>(grad_scores), M, K, C, D, E);
    }
    return static_cast<int>(cudaGetLastError());
  });
}
