// CUDA kernels of the fused lookup-reduce (bf16/fp16/fp32 inputs, fp32 accumulation, any D).
// No torch headers: see lookup_reduce_cuda_kernels.h for the interface and the torch binding
// in lookup_reduce_cuda.cpp.
//
// Dtypes: the kernels take the table's element type table_t (table, table gradient) and the
// scores' scalar_t (scores, output, output gradient, score gradients): one type for both, or a
// bf16/fp16 table with fp32 scores (dispatch_dtypes). Every value is converted exactly to fp32,
// products are accumulated with explicit fused multiply-adds, and each result is rounded once to
// its type, so a narrow table's results are the fp32 ones on its values, bit for bit.
//
// Forward: one warp per output row (token, virtual block). The lanes load up to 32 of the
// token's lookups (row index, block match) at once and pass them round with warp shuffles; each
// lane holds COLS fp32 accumulators (columns lane, lane+32, ...), so a row of D <= 32*COLS is
// read in COLS coalesced 128-byte transactions per lookup, wider rows in chunks of 32*COLS.
//
// Backward: cub radix sort of the lookups by row (stable, so each row's lookups stay in position
// order), run-length encoding into unique rows and an exclusive scan into segment starts, all
// without leaving the device. Then one group of lanes (a half warp for D <= 64, else a warp) per
// unique row: it sums the row's lookups in sorted order (no atomics: bit-identical table
// gradients) and writes the gradient row either to a compact [U, D] buffer or straight into a
// dense [N, D] gradient, and computes the score gradients of those lookups against the row (a
// fixed shuffle-reduction tree per column slice).
#include "lookup_reduce_cuda_kernels.h"

#include "cuda_numerics.cuh"

#include <cub/cub.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>


namespace {

constexpr int kWarp = 32;
constexpr int kHalfWarp = 16;
constexpr int kWarpsPerBlock = 4;
constexpr int kThreads = kWarp * kWarpsPerBlock;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kRowLoadsInFlight = 16;  // forward: row loads a lane issues before its FMAs

__device__ __forceinline__ int64_t warp_id() {
  return static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
}

unsigned blocks_for_warps(int64_t warps) {
  return static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

template <typename table_t, typename scalar_t, int COLS>
__global__ void __launch_bounds__(kThreads)
forward_kernel(const table_t* __restrict__ table, const int64_t* __restrict__ indices,
               const scalar_t* __restrict__ scores, const int64_t* __restrict__ block_ids,
               scalar_t* __restrict__ out, int64_t rows_out, int64_t K, int C, int D, int64_t E) {
  const int64_t w = warp_id();
  if (w >= rows_out) return;
  const int lane = threadIdx.x % kWarp;
  const int64_t t = w / E, b = w % E;
  const int Dc = D / C;
  for (int d0 = 0; d0 < D; d0 += kWarp * COLS) {
    int col[COLS];
#pragma unroll
    for (int v = 0; v < COLS; ++v) col[v] = (d0 + v * kWarp + lane) / Dc;
    float acc[COLS] = {};
    for (int64_t k0 = 0; k0 < K; k0 += kWarp) {
      const int n = static_cast<int>(K - k0 < kWarp ? K - k0 : kWarp);
      const int64_t mine = t * K + k0 + lane;
      int64_t my_row = 0;
      int my_take = 0;
      if (lane < n) {
        my_row = indices[mine];
        my_take = block_ids == nullptr || block_ids[mine] == b;
      }
      // UNROLL lookups at a time: every row and score load is issued before the first FMA,
      // so a lane keeps kRowLoadsInFlight row loads in flight; the sum stays in lookup order.
      constexpr int UNROLL = kRowLoadsInFlight / COLS;
      for (int j0 = 0; j0 < n; j0 += UNROLL) {
        float val[UNROLL][COLS], sc[UNROLL][COLS];
#pragma unroll
        for (int i = 0; i < UNROLL; ++i) {
          const int j = j0 + i;
          const bool take = __shfl_sync(kFullMask, my_take, j % kWarp) && j < n;
          const int64_t row = __shfl_sync(kFullMask, my_row, j % kWarp);
          const int64_t p = t * K + k0 + j;
#pragma unroll
          for (int v = 0; v < COLS; ++v) {
            const int d = d0 + v * kWarp + lane;
            const bool ok = take && d < D;
            val[i][v] = ok ? to_float(table[row * D + d]) : 0.f;
            sc[i][v] = ok ? to_float(scores[p * C + col[v]]) : 0.f;
          }
        }
#pragma unroll
        for (int i = 0; i < UNROLL; ++i)
#pragma unroll
          for (int v = 0; v < COLS; ++v) acc[v] = fmaf(sc[i][v], val[i][v], acc[v]);
      }
    }
#pragma unroll
    for (int v = 0; v < COLS; ++v) {
      const int d = d0 + v * kWarp + lane;
      if (d < D) out[w * D + d] = from_float<scalar_t>(acc[v]);
    }
  }
}

__global__ void iota_kernel(int64_t* __restrict__ out, int64_t M) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < M) out[i] = i;
}

// Sum over the LANES lanes of one row group (a whole warp, or half of it): a fixed tree.
template <int LANES>
__device__ __forceinline__ float group_sum(float x, unsigned mask) {
  for (int offset = LANES / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(mask, x, offset, LANES);
  return x;
}

// LANES lanes per unique row u < *num_unique (32 / LANES rows per warp, each group on its own
// shuffle mask, so the groups' segments may differ in length):
// dst[(dense ? row : u) * D + d] = sum over the row's lookups p (sorted order) of
// scores[p, d/Dc] * grad_out[p/K, block[p], d]; and for each of them
// grad_scores[p, c] = <table row, grad_out row of p> over column slice c. Rows of
// D <= LANES * COLS take one pass with the table row held in registers (loaded before the
// segment, so its latency overlaps the segment's loads); wider rows take two passes over chunks
// of LANES * COLS columns. Half-warp groups for narrow rows put two rows' chains of dependent
// loads (segment -> position -> gradient row) in flight per warp.
template <typename table_t, typename scalar_t, int LANES, int COLS>
__global__ void __launch_bounds__(kThreads)
backward_kernel(const scalar_t* __restrict__ grad_out, const table_t* __restrict__ table,
                const scalar_t* __restrict__ scores, const int64_t* __restrict__ block_ids,
                const int64_t* __restrict__ sorted_positions, const int64_t* __restrict__ seg_start,
                const int64_t* __restrict__ unique_rows, const int64_t* __restrict__ num_unique,
                table_t* __restrict__ dst, bool dense, scalar_t* __restrict__ grad_scores,
                int64_t K, int C, int D, int64_t E) {
  constexpr int kGroups = kWarp / LANES;
  const int lane = threadIdx.x % kWarp, group = lane / LANES, l = lane % LANES;
  const unsigned mask = LANES == kWarp ? kFullMask : ((1u << LANES) - 1) << (group * LANES);
  const int64_t u = warp_id() * kGroups + group;
  if (u >= *num_unique) return;
  const int64_t start = seg_start[u], end = seg_start[u + 1], row = unique_rows[u];
  const int Dc = D / C;
  const table_t* trow = table + row * D;
  table_t* out = dst + (dense ? row : u) * D;
  if (D <= LANES * COLS) {
    float tv[COLS], acc[COLS] = {};
    int col[COLS];
#pragma unroll
    for (int v = 0; v < COLS; ++v) {
      const int d = v * LANES + l;
      tv[v] = d < D ? to_float(trow[d]) : 0.f;
      col[v] = d < D ? d / Dc : -1;
    }
    for (int64_t j = start; j < end; ++j) {
      const int64_t p = sorted_positions[j];
      const int64_t b = block_ids != nullptr ? block_ids[p] : 0;
      const scalar_t* g = grad_out + ((p / K) * E + b) * D;
      float gv[COLS];
#pragma unroll
      for (int v = 0; v < COLS; ++v) {
        const int d = v * LANES + l;
        gv[v] = d < D ? to_float(g[d]) : 0.f;
        acc[v] = fmaf(d < D ? to_float(scores[p * C + col[v]]) : 0.f, gv[v], acc[v]);
      }
      for (int c = 0; c < C; ++c) {
        float dot = 0.f;
#pragma unroll
        for (int v = 0; v < COLS; ++v) dot = col[v] == c ? fmaf(tv[v], gv[v], dot) : dot;
        dot = group_sum<LANES>(dot, mask);
        if (l == 0) grad_scores[p * C + c] = from_float<scalar_t>(dot);
      }
    }
#pragma unroll
    for (int v = 0; v < COLS; ++v) {
      const int d = v * LANES + l;
      if (d < D) out[d] = from_float<table_t>(acc[v]);
    }
    return;
  }
  for (int d0 = 0; d0 < D; d0 += LANES * COLS) {
    float acc[COLS] = {};
    for (int64_t j = start; j < end; ++j) {
      const int64_t p = sorted_positions[j];
      const int64_t b = block_ids != nullptr ? block_ids[p] : 0;
      const scalar_t* g = grad_out + ((p / K) * E + b) * D;
#pragma unroll
      for (int v = 0; v < COLS; ++v) {
        const int d = d0 + v * LANES + l;
        if (d < D) acc[v] = fmaf(to_float(scores[p * C + d / Dc]), to_float(g[d]), acc[v]);
      }
    }
#pragma unroll
    for (int v = 0; v < COLS; ++v) {
      const int d = d0 + v * LANES + l;
      if (d < D) out[d] = from_float<table_t>(acc[v]);
    }
  }
  for (int64_t j = start; j < end; ++j) {
    const int64_t p = sorted_positions[j];
    const int64_t b = block_ids != nullptr ? block_ids[p] : 0;
    const scalar_t* g = grad_out + ((p / K) * E + b) * D;
    for (int c = 0; c < C; ++c) {
      float dot = 0.f;
      for (int d = c * Dc + l; d < (c + 1) * Dc; d += LANES) dot = fmaf(to_float(trow[d]), to_float(g[d]), dot);
      dot = group_sum<LANES>(dot, mask);
      if (l == 0) grad_scores[p * C + c] = from_float<scalar_t>(dot);
    }
  }
}

template <int N>
using Int = std::integral_constant<int, N>;

// Calls launch(table_t{}, scalar_t{}) for the table's and the scores' dtype codes: one dtype for
// both, or a bf16/fp16 table with fp32 scores.
template <typename F>
int dispatch_dtypes(int table_dtype, int score_dtype, F&& launch) {
  if (table_dtype == score_dtype) {
    switch (table_dtype) {
      case RMT_FLOAT32: return launch(float{}, float{});
      case RMT_BFLOAT16: return launch(__nv_bfloat16{}, __nv_bfloat16{});
      case RMT_FLOAT16: return launch(__half{}, __half{});
      default: return static_cast<int>(cudaErrorInvalidValue);
    }
  }
  if (score_dtype != RMT_FLOAT32) return static_cast<int>(cudaErrorInvalidValue);
  switch (table_dtype) {
    case RMT_BFLOAT16: return launch(__nv_bfloat16{}, float{});
    case RMT_FLOAT16: return launch(__half{}, float{});
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

// Calls launch(Int<COLS>{}) with the per-lane column count for rows of D columns over `lanes`
// lanes: one pass for D <= 4 * lanes, chunks of 4 * lanes beyond.
template <typename F>
int dispatch_cols(int64_t D, int lanes, F&& launch) {
  if (D <= lanes) return launch(Int<1>{});
  if (D <= 2 * lanes) return launch(Int<2>{});
  return launch(Int<4>{});
}

using SortKey = unsigned long long;

}  // namespace

int rmt_lookup_reduce_forward_cuda(int table_dtype, int score_dtype, const void* table,
                                   const int64_t* indices, const void* scores, const int64_t* block_ids, void* out,
                                   int64_t T, int64_t K, int64_t C, int64_t D, int64_t E,
                                   cudaStream_t stream) {
  if (T * E == 0) return static_cast<int>(cudaSuccess);
  return dispatch_dtypes(table_dtype, score_dtype, [&](auto table_tag, auto score_tag) {
    using table_t = decltype(table_tag);
    using scalar_t = decltype(score_tag);
    return dispatch_cols(D, kWarp, [&](auto cols) {
      forward_kernel<table_t, scalar_t, decltype(cols)::value><<<blocks_for_warps(T * E), kThreads, 0, stream>>>(
          static_cast<const table_t*>(table), indices, static_cast<const scalar_t*>(scores), block_ids,
          static_cast<scalar_t*>(out), T * E, K, static_cast<int>(C), static_cast<int>(D), E);
      return static_cast<int>(cudaGetLastError());
    });
  });
}

size_t rmt_lookup_reduce_sort_workspace_bytes(int64_t M) {
  size_t sort_bytes = 0, rle_bytes = 0, scan_bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const SortKey*>(nullptr),
                                  static_cast<SortKey*>(nullptr), static_cast<const int64_t*>(nullptr),
                                  static_cast<int64_t*>(nullptr), M);
  cub::DeviceRunLengthEncode::Encode(nullptr, rle_bytes, static_cast<const SortKey*>(nullptr),
                                     static_cast<SortKey*>(nullptr), static_cast<int64_t*>(nullptr),
                                     static_cast<int64_t*>(nullptr), M);
  cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<const int64_t*>(nullptr),
                                static_cast<int64_t*>(nullptr), M + 1);
  size_t bytes = sort_bytes > rle_bytes ? sort_bytes : rle_bytes;
  return bytes > scan_bytes ? bytes : scan_bytes;
}

int rmt_lookup_reduce_sort_cuda(const int64_t* indices, int64_t M, int end_bit,
                                int64_t* positions_in, int64_t* sorted_keys,
                                int64_t* sorted_positions, int64_t* unique_rows, int64_t* counts,
                                int64_t* seg_start, int64_t* num_unique, void* workspace,
                                size_t workspace_bytes, cudaStream_t stream) {
  if (M == 0) {
    cudaError_t err = cudaMemsetAsync(num_unique, 0, sizeof(int64_t), stream);
    if (err != cudaSuccess) return static_cast<int>(err);
    return static_cast<int>(cudaMemsetAsync(seg_start, 0, sizeof(int64_t), stream));
  }
  cudaError_t err = cudaMemsetAsync(counts, 0, (M + 1) * sizeof(int64_t), stream);
  if (err != cudaSuccess) return static_cast<int>(err);
  iota_kernel<<<static_cast<unsigned>((M + kThreads - 1) / kThreads), kThreads, 0, stream>>>(positions_in, M);
  err = cudaGetLastError();
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
  if (err != cudaSuccess) return static_cast<int>(err);
  // counts[U:] stay zero, so the scan over M + 1 entries needs no host copy of U: seg_start[u]
  // is the first sorted position of unique row u and seg_start[U] = M.
  bytes = workspace_bytes;
  return static_cast<int>(cub::DeviceScan::ExclusiveSum(workspace, bytes, counts, seg_start, M + 1, stream));
}

int rmt_lookup_reduce_backward_cuda(int table_dtype, int score_dtype, const void* grad_out,
                                    const void* table, const void* scores, const int64_t* block_ids,
                                    const int64_t* sorted_positions, const int64_t* seg_start,
                                    const int64_t* unique_rows, const int64_t* num_unique,
                                    int64_t max_unique, void* dst, int dense, void* grad_scores,
                                    int64_t K, int64_t C, int64_t D, int64_t E, cudaStream_t stream) {
  if (max_unique == 0) return static_cast<int>(cudaSuccess);
  return dispatch_dtypes(table_dtype, score_dtype, [&](auto table_tag, auto score_tag) {
    using table_t = decltype(table_tag);
    using scalar_t = decltype(score_tag);
    auto launch = [&](auto lanes, auto cols) {
      constexpr int LANES = decltype(lanes)::value;
      backward_kernel<table_t, scalar_t, LANES, decltype(cols)::value>
          <<<blocks_for_warps((max_unique + kWarp / LANES - 1) / (kWarp / LANES)), kThreads, 0, stream>>>(
              static_cast<const scalar_t*>(grad_out), static_cast<const table_t*>(table),
              static_cast<const scalar_t*>(scores), block_ids, sorted_positions, seg_start, unique_rows,
              num_unique, static_cast<table_t*>(dst), dense != 0, static_cast<scalar_t*>(grad_scores), K,
              static_cast<int>(C), static_cast<int>(D), E);
      return static_cast<int>(cudaGetLastError());
    };
    // Half-warp rows up to D = 64 (one pass), whole-warp rows beyond.
    if (D <= 4 * kHalfWarp) return dispatch_cols(D, kHalfWarp, [&](auto cols) { return launch(Int<kHalfWarp>{}, cols); });
    return launch(Int<kWarp>{}, Int<4>{});
  });
}

namespace {

// The backward with the optimizer fused in (rmt/ops/fused_update.py): backward_kernel's one-pass
// path (the row held in registers, D <= LANES * COLS), score gradients only for positions in
// [score_lo, score_hi) (written at p - score_lo), then the row's gradient times grad_scale steps
// the row and its fp32 state in place, no gradient row stored: SparseAdam (ADAM; lr is the
// bias-corrected step size, state1/state2 the moments) or row-wise Adagrad (state1 the per-row
// sums). Every operation rounded on its own (__f*_rn intrinsics: no contraction into fused
// multiply-adds, IEEE division and square root), as in the unfused step. row_sq[u] receives the
// row's squared gradient norm (a fixed shuffle tree).
//
// A row of at most kLongRow lookups is summed by one group of lanes (backward_update_kernel);
// a longer one (a hot row: UltraMem's retrieval at initialization sends 2,000 of a batch's
// 65,536 lookups to one row, which a single warp walks in ~3.5 ms) by a block of kLongWarps
// warps (long_rows_update_kernel), each summing a contiguous slice of the row's sorted lookups,
// the slices' sums added in slice order: deterministic, the same bits on every run.
constexpr int64_t kLongRow = 32;
constexpr int kLongWarps = 16;

struct UpdateArgs {
  float grad_scale, lr, one_minus_beta1, one_minus_beta2, eps, weight_decay;
};

// Sorted lookups [start, end) of a row into acc (lane l holds columns v * LANES + l), and the
// score gradients of those in [score_lo, score_hi) against the row's values tv.
template <typename scalar_t, int LANES, int COLS>
__device__ __forceinline__ void sum_lookups(int64_t start, int64_t end, const float (&tv)[COLS], const int (&col)[COLS],
                                            float (&acc)[COLS], const scalar_t* __restrict__ grad_out,
                                            const scalar_t* __restrict__ scores, const int64_t* __restrict__ block_ids,
                                            const int64_t* __restrict__ sorted_positions,
                                            scalar_t* __restrict__ grad_scores, int64_t score_lo, int64_t score_hi,
                                            int64_t K, int C, int D, int64_t E, int l, unsigned mask) {
  for (int64_t j = start; j < end; ++j) {
    const int64_t p = sorted_positions[j];
    const int64_t b = block_ids != nullptr ? block_ids[p] : 0;
    const scalar_t* g = grad_out + ((p / K) * E + b) * D;
    float gv[COLS];
#pragma unroll
    for (int v = 0; v < COLS; ++v) {
      const int d = v * LANES + l;
      gv[v] = d < D ? to_float(g[d]) : 0.f;
      acc[v] = fmaf(d < D ? to_float(scores[p * C + col[v]]) : 0.f, gv[v], acc[v]);
    }
    if (p >= score_lo && p < score_hi) {
      for (int c = 0; c < C; ++c) {
        float dot = 0.f;
#pragma unroll
        for (int v = 0; v < COLS; ++v) dot = col[v] == c ? fmaf(tv[v], gv[v], dot) : dot;
        dot = group_sum<LANES>(dot, mask);
        if (l == 0) grad_scores[(p - score_lo) * C + c] = from_float<scalar_t>(dot);
      }
    }
  }
}

// The row's values (tv) and column slices (col) held by lane l.
template <typename table_t, int LANES, int COLS>
__device__ __forceinline__ void load_row(const table_t* trow, int D, int C, int l, float (&tv)[COLS], int (&col)[COLS]) {
  const int Dc = D / C;
#pragma unroll
  for (int v = 0; v < COLS; ++v) {
    const int d = v * LANES + l;
    tv[v] = d < D ? to_float(trow[d]) : 0.f;
    col[v] = d < D ? d / Dc : -1;
  }
}

// Steps row u (table row trow, values tv) with its summed gradient acc.
template <typename table_t, int LANES, int COLS, bool ADAM>
__device__ __forceinline__ void step_row(table_t* trow, int64_t row, int64_t u, const float (&tv)[COLS],
                                         const float (&acc)[COLS], float* __restrict__ state1,
                                         float* __restrict__ state2, float* __restrict__ row_sq, int D,
                                         const UpdateArgs& a, int l, unsigned mask) {
  float g[COLS], sq = 0.f;
#pragma unroll
  for (int v = 0; v < COLS; ++v) {
    g[v] = __fmul_rn(acc[v], a.grad_scale);
    sq = __fadd_rn(sq, __fmul_rn(g[v], g[v]));
  }
  sq = group_sum<LANES>(sq, mask);
  if (l == 0) row_sq[u] = sq;
  if (ADAM) {
#pragma unroll
    for (int v = 0; v < COLS; ++v) {
      const int d = v * LANES + l;
      if (d >= D) continue;
      const int64_t off = row * D + d;
      const float m = __fadd_rn(state1[off], __fmul_rn(__fsub_rn(g[v], state1[off]), a.one_minus_beta1));
      const float s = __fadd_rn(state2[off], __fmul_rn(__fsub_rn(__fmul_rn(g[v], g[v]), state2[off]), a.one_minus_beta2));
      state1[off] = m;
      state2[off] = s;
      trow[d] = from_float<table_t>(__fsub_rn(tv[v], __fmul_rn(a.lr, __fdiv_rn(m, __fadd_rn(__fsqrt_rn(s), a.eps)))));
    }
  } else {
    float gw[COLS], sq_w = 0.f;
#pragma unroll
    for (int v = 0; v < COLS; ++v) {
      // no term at all for weight_decay 0 (row_optim.h, NoDecay): g + 0 * inf would be NaN
      gw[v] = a.weight_decay == 0.f ? g[v] : __fadd_rn(g[v], __fmul_rn(a.weight_decay, tv[v]));
      sq_w = __fadd_rn(sq_w, __fmul_rn(gw[v], gw[v]));
    }
    sq_w = group_sum<LANES>(sq_w, mask);
    const float total = __fadd_rn(state1[row], __fdiv_rn(sq_w, static_cast<float>(D)));
    __syncwarp(mask);
    if (l == 0) state1[row] = total;
    const float scale = __fdiv_rn(a.lr, __fadd_rn(__fsqrt_rn(total), a.eps));
#pragma unroll
    for (int v = 0; v < COLS; ++v) {
      const int d = v * LANES + l;
      if (d < D) trow[d] = from_float<table_t>(__fsub_rn(tv[v], __fmul_rn(scale, gw[v])));
    }
  }
}

template <typename table_t, typename scalar_t, int LANES, int COLS, bool ADAM>
__global__ void __launch_bounds__(kThreads)
backward_update_kernel(const scalar_t* __restrict__ grad_out, table_t* __restrict__ table,
                       const scalar_t* __restrict__ scores, const int64_t* __restrict__ block_ids,
                       const int64_t* __restrict__ sorted_positions, const int64_t* __restrict__ seg_start,
                       const int64_t* __restrict__ unique_rows, const int64_t* __restrict__ num_unique,
                       scalar_t* __restrict__ grad_scores, int64_t score_lo, int64_t score_hi,
                       float* __restrict__ state1, float* __restrict__ state2, float* __restrict__ row_sq,
                       int64_t K, int C, int D, int64_t E, UpdateArgs a) {
  constexpr int kGroups = kWarp / LANES;
  const int lane = threadIdx.x % kWarp, group = lane / LANES, l = lane % LANES;
  const unsigned mask = LANES == kWarp ? kFullMask : ((1u << LANES) - 1) << (group * LANES);
  const int64_t u = warp_id() * kGroups + group;
  if (u >= *num_unique) return;
  const int64_t start = seg_start[u], end = seg_start[u + 1], row = unique_rows[u];
  if (end - start > kLongRow) return;  // long_rows_update_kernel's
  table_t* trow = table + row * D;
  float tv[COLS], acc[COLS] = {};
  int col[COLS];
  load_row<table_t, LANES, COLS>(trow, D, C, l, tv, col);
  sum_lookups<scalar_t, LANES, COLS>(start, end, tv, col, acc, grad_out, scores, block_ids, sorted_positions,
                                     grad_scores, score_lo, score_hi, K, C, D, E, l, mask);
  step_row<table_t, LANES, COLS, ADAM>(trow, row, u, tv, acc, state1, state2, row_sq, D, a, l, mask);
}

// The rows of more than kLongRow lookups, a block of kLongWarps warps each. Block b takes the
// unique rows u = b + i * gridDim.x, checking a block's worth of them at once, so the long rows
// (wherever they fall in row order) spread over all blocks. Every warp loads the row and sums
// its slice of the lookups (with their score gradients, before the row changes); warp 0 adds
// the slices' sums in slice order and steps the row.
template <typename table_t, typename scalar_t, int COLS, bool ADAM>
__global__ void __launch_bounds__(kLongWarps * kWarp)
long_rows_update_kernel(const scalar_t* __restrict__ grad_out, table_t* __restrict__ table,
                        const scalar_t* __restrict__ scores, const int64_t* __restrict__ block_ids,
                        const int64_t* __restrict__ sorted_positions, const int64_t* __restrict__ seg_start,
                        const int64_t* __restrict__ unique_rows, const int64_t* __restrict__ num_unique,
                        scalar_t* __restrict__ grad_scores, int64_t score_lo, int64_t score_hi,
                        float* __restrict__ state1, float* __restrict__ state2, float* __restrict__ row_sq,
                        int64_t K, int C, int D, int64_t E, UpdateArgs a) {
  __shared__ float partial[kLongWarps][kWarp * COLS];
  __shared__ int64_t found[kLongWarps * kWarp];
  __shared__ int num_found;
  const int w = threadIdx.x / kWarp, l = threadIdx.x % kWarp;
  const int64_t U = *num_unique;
  for (int64_t base = 0; blockIdx.x + base * gridDim.x < U; base += blockDim.x) {
    if (threadIdx.x == 0) num_found = 0;
    __syncthreads();
    const int64_t u = blockIdx.x + (base + threadIdx.x) * gridDim.x;
    if (u < U && seg_start[u + 1] - seg_start[u] > kLongRow) found[atomicAdd(&num_found, 1)] = u;
    __syncthreads();
    for (int i = 0; i < num_found; ++i) {
      const int64_t v_u = found[i], start = seg_start[v_u], end = seg_start[v_u + 1], row = unique_rows[v_u];
      const int64_t per = (end - start + kLongWarps - 1) / kLongWarps;
      const int64_t lo = min(end, start + w * per), hi = min(end, lo + per);
      table_t* trow = table + row * D;
      float tv[COLS], acc[COLS] = {};
      int col[COLS];
      load_row<table_t, kWarp, COLS>(trow, D, C, l, tv, col);
      sum_lookups<scalar_t, kWarp, COLS>(lo, hi, tv, col, acc, grad_out, scores, block_ids, sorted_positions,
                                         grad_scores, score_lo, score_hi, K, C, D, E, l, kFullMask);
#pragma unroll
      for (int v = 0; v < COLS; ++v) partial[w][v * kWarp + l] = acc[v];
      __syncthreads();
      if (w == 0) {
#pragma unroll
        for (int v = 0; v < COLS; ++v) {
          acc[v] = partial[0][v * kWarp + l];
          for (int s = 1; s < kLongWarps; ++s) acc[v] = __fadd_rn(acc[v], partial[s][v * kWarp + l]);
        }
        step_row<table_t, kWarp, COLS, ADAM>(trow, row, v_u, tv, acc, state1, state2, row_sq, D, a, l, kFullMask);
      }
      __syncthreads();
    }
  }
}

int long_row_blocks() {
  int device = 0, sms = 1;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return 2 * sms;
}

}  // namespace

int rmt_lookup_reduce_backward_update_cuda(int table_dtype, int score_dtype, const void* grad_out, void* table,
                                           const void* scores, const int64_t* block_ids,
                                           const int64_t* sorted_positions, const int64_t* seg_start,
                                           const int64_t* unique_rows, const int64_t* num_unique,
                                           int64_t max_unique, void* grad_scores, int64_t score_lo,
                                           int64_t score_hi, int adam, float* state1, float* state2, float* row_sq,
                                           int64_t K, int64_t C, int64_t D, int64_t E, float grad_scale, float lr,
                                           float one_minus_beta1, float one_minus_beta2, float eps,
                                           float weight_decay, cudaStream_t stream) {
  if (max_unique == 0) return static_cast<int>(cudaSuccess);
  if (D > kWarp * 16) return static_cast<int>(cudaErrorInvalidValue);
  return dispatch_dtypes(table_dtype, score_dtype, [&](auto table_tag, auto score_tag) {
    using table_t = decltype(table_tag);
    using scalar_t = decltype(score_tag);
    const UpdateArgs args{grad_scale, lr, one_minus_beta1, one_minus_beta2, eps, weight_decay};
    auto launch = [&](auto lanes, auto cols, auto is_adam) {
      constexpr int LANES = decltype(lanes)::value;
      constexpr bool ADAM = decltype(is_adam)::value;
      backward_update_kernel<table_t, scalar_t, LANES, decltype(cols)::value, ADAM>
          <<<blocks_for_warps((max_unique + kWarp / LANES - 1) / (kWarp / LANES)), kThreads, 0, stream>>>(
              static_cast<const scalar_t*>(grad_out), static_cast<table_t*>(table),
              static_cast<const scalar_t*>(scores), block_ids, sorted_positions, seg_start, unique_rows, num_unique,
              static_cast<scalar_t*>(grad_scores), score_lo, score_hi, state1, state2, row_sq, K,
              static_cast<int>(C), static_cast<int>(D), E, args);
      cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return static_cast<int>(err);
      // whole-warp columns per lane for the long rows: D <= 32 * LONG_COLS
      auto long_rows = [&](auto long_cols) {
        long_rows_update_kernel<table_t, scalar_t, decltype(long_cols)::value, ADAM>
            <<<long_row_blocks(), kLongWarps * kWarp, 0, stream>>>(
                static_cast<const scalar_t*>(grad_out), static_cast<table_t*>(table),
                static_cast<const scalar_t*>(scores), block_ids, sorted_positions, seg_start, unique_rows,
                num_unique, static_cast<scalar_t*>(grad_scores), score_lo, score_hi, state1, state2, row_sq, K,
                static_cast<int>(C), static_cast<int>(D), E, args);
        return static_cast<int>(cudaGetLastError());
      };
      if (D <= kWarp) return long_rows(Int<1>{});
      if (D <= 2 * kWarp) return long_rows(Int<2>{});
      if (D <= 4 * kWarp) return long_rows(Int<4>{});
      if (D <= 8 * kWarp) return long_rows(Int<8>{});
      return long_rows(Int<16>{});
    };
    auto by_optimizer = [&](auto lanes, auto cols) {
      return adam ? launch(lanes, cols, std::true_type{}) : launch(lanes, cols, std::false_type{});
    };
    // Half-warp rows up to D = 64, whole-warp rows up to 16 columns per lane (D = 512).
    if (D <= 4 * kHalfWarp) return dispatch_cols(D, kHalfWarp, [&](auto cols) { return by_optimizer(Int<kHalfWarp>{}, cols); });
    if (D <= 4 * kWarp) return by_optimizer(Int<kWarp>{}, Int<4>{});
    if (D <= 8 * kWarp) return by_optimizer(Int<kWarp>{}, Int<8>{});
    return by_optimizer(Int<kWarp>{}, Int<16>{});
  });
}
