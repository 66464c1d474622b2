// Fused retrieval's selection, CUDA: the streaming top-m of the memory layers' keys (UltraMem
// arXiv 2411.12364 Eq. 2-3, 7-10) without the [T, H, r, n] score tensors. The contract, tie rule
// and arithmetic are rmt.ops.fused_retrieval's, and every step is the CPU backend's
// (retrieval_select_cpu.cpp) with one thread in the place of one token of a CPU task:
//
// candidates_kernel, one thread per token, a block per (32 tokens, head) of one grid side: the
// block stages a tile of the side's keys (all ranks, widened to float) in shared memory; each
// thread scores its token against them (s_a = q_a . k_a, a float sum rounded once to the inputs'
// dtype) and offers them to its running lists (ranked_list.h, the CPU backend's): product keys the
// m best s_0, TDQKR the m largest and m smallest rank-1 objectives o = w_0 s_0 + w_1 s_1 + ...
// (Eq. 8-9), every key while 2m >= n. Keys arrive in index order, so the tie rule is the lists'
// insertion. Each thread's lists live in its rows of the candidate buffers (global memory, touched
// only when an entry enters: a register bound filters the rest), and are finally sorted by key
// index in place.
//
// grid_kernel, one thread per (token, head): the grid over both sides' index-sorted candidates
// (s_row + s_col, or sum_b (sum_a s_row[a] C[a, b]) s_col[b] with the aggregated core C), visited
// in row-major order (= address order) into a top-m list whose ties go to the earlier entry.
//
// Built with --fmad=false: every product and sum is rounded on its own, as the reference's torch
// operations round them, so that the selection agrees with it bit for bit given the same side
// scores. Buffers: cand_idx [T, H, 2, c] int32, cand_val [T, H, 2, c] float, cand_side
// [T, H, 2, c, r] float (entry-major, the lists' layout), best_val [T, H, m] float; the top list
// occupies entries [0, width) of a row, the bottom list [width, 2 width).
#include "retrieval_select_cuda_kernels.h"

#include <cuda_bf16.h>

#include <algorithm>

#include "cuda_numerics.cuh"
#include "ranked_list.h"

namespace {

constexpr int kTokens = 32;      // threads (tokens) per block of candidates_kernel
constexpr int kMaxKeys = 32;     // keys per shared-memory tile, at most
constexpr int kGridThreads = 128;
constexpr int kMaxRank = 16;

template <typename scalar_t>
__global__ void __launch_bounds__(kTokens)
    candidates_kernel(const scalar_t* __restrict__ q, int64_t sq0, int64_t sq1, int64_t sq2,
                      const scalar_t* __restrict__ keys, const float* __restrict__ weights, int side, int64_t T,
                      int64_t H, int64_t r, int64_t n, int64_t D, int64_t width, int lists, int64_t c, int tile,
                      int32_t* __restrict__ cand_idx, float* __restrict__ cand_val, float* __restrict__ cand_side) {
  extern __shared__ float ks[];  // [tile, r, D]
  const int64_t t = blockIdx.x * int64_t(kTokens) + threadIdx.x, h = blockIdx.y;
  const bool active = t < T;
  const int64_t row = ((active ? t : 0) * H + h) * 2 + side;
  using Top = rmt_select::Ranked<float, int32_t, true>;
  using Bottom = rmt_select::Ranked<float, int32_t, false>;
  Top top{width, r, 0, cand_val + row * c, cand_idx + row * c, cand_side + row * c * r};
  Bottom bottom{width, r, 0, cand_val + row * c + width, cand_idx + row * c + width,
                cand_side + (row * c + width) * r};
  const bool tucker = weights != nullptr, keep_all = lists == 1 && width == n && tucker;
  float w[kMaxRank];
  for (int64_t a = 0; a < r; ++a) w[a] = tucker ? weights[h * r + a] : 0.f;
  const scalar_t* qt = q + (active ? t : 0) * sq0 + h * sq1;
  const scalar_t* kside = keys + (h * 2 + side) * r * n * D;
  float hi = top.bound(), lo = bottom.bound();
  float s[kMaxRank];
  for (int64_t j0 = 0; j0 < n; j0 += tile) {
    const int64_t L = min(int64_t(tile), n - j0);
    __syncthreads();
    for (int64_t e = threadIdx.x; e < L * r * D; e += kTokens) {
      const int64_t jj = e / (r * D), a = (e / D) % r, d = e % D;
      ks[e] = to_float(kside[(a * n + j0 + jj) * D + d]);
    }
    __syncthreads();
    if (!active) continue;
    for (int64_t jj = 0; jj < L; ++jj) {
      for (int64_t a = 0; a < r; ++a) {
        const float* k = ks + (jj * r + a) * D;
        const scalar_t* qa = qt + a * sq2;
        float acc = 0.f;
        for (int64_t d = 0; d < D; ++d) acc = acc + to_float(qa[d]) * k[d];
        s[a] = rounded<scalar_t>(acc);
      }
      const int32_t j = int32_t(j0 + jj);
      if (keep_all) {
        top.push(0.f, j, s, 1);
        continue;
      }
      float o = s[0];
      if (tucker) {
        o = w[0] * s[0];
        for (int64_t a = 1; a < r; ++a) o = o + w[a] * s[a];
      }
      if (o > hi) {
        top.push(o, j, s, 1);
        hi = top.bound();
      }
      if (lists == 2 && o <= lo) {
        bottom.push(o, j, s, 1);
        lo = bottom.bound();
      }
    }
  }
  if (!active) return;
  int32_t* idx = cand_idx + row * c;
  float* sd = cand_side + row * c * r;
  for (int64_t e = 1; e < c; ++e) {  // by key index (the lists never share a key)
    const int32_t key = idx[e];
    for (int64_t a = 0; a < r; ++a) s[a] = sd[e * r + a];
    int64_t p = e;
    for (; p > 0 && idx[p - 1] > key; --p) {
      idx[p] = idx[p - 1];
      for (int64_t a = 0; a < r; ++a) sd[p * r + a] = sd[(p - 1) * r + a];
    }
    idx[p] = key;
    for (int64_t a = 0; a < r; ++a) sd[p * r + a] = s[a];
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kGridThreads)
    grid_kernel(const int32_t* __restrict__ cand_idx, const float* __restrict__ cand_side,
                const float* __restrict__ core, int64_t T, int64_t H, int64_t r, int64_t n, int64_t m, int64_t c,
                float* __restrict__ best_val, int64_t* __restrict__ addr, scalar_t* __restrict__ sel) {
  const int64_t th = blockIdx.x * int64_t(kGridThreads) + threadIdx.x;
  if (th >= T * H) return;
  const int64_t h = th % H;
  const int32_t* ri = cand_idx + (th * 2 + 0) * c;
  const int32_t* ci = cand_idx + (th * 2 + 1) * c;
  const float* sr = cand_side + (th * 2 + 0) * c * r;
  const float* sc = cand_side + (th * 2 + 1) * c * r;
  rmt_select::Ranked<float, int64_t, true> best{m, 0, 0, best_val + th * m, addr + th * m, nullptr};
  float bound = best.bound();
  float rv[kMaxRank];
  for (int64_t i = 0; i < c; ++i) {
    if (core != nullptr) {  // rv[b] = sum_a s_row[a] C[a, b], in order of a
      const float* C = core + h * r * r;
      for (int64_t b = 0; b < r; ++b) {
        float v = C[b] * sr[i * r];
        for (int64_t a = 1; a < r; ++a) v = v + C[a * r + b] * sr[i * r + a];
        rv[b] = v;
      }
    }
    for (int64_t j = 0; j < c; ++j) {
      float g;
      if (core == nullptr) {
        g = sr[i * r] + sc[j * r];
      } else {
        g = rv[0] * sc[j * r];
        for (int64_t b = 1; b < r; ++b) g = g + rv[b] * sc[j * r + b];
      }
      if (g > bound || best.size < m) {
        best.push(g, i * c + j, nullptr, 0);
        bound = best.bound();
      }
    }
  }
  for (int64_t k = 0; k < m; ++k) {
    const int64_t pos = addr[th * m + k], i = pos / c, j = pos % c;
    addr[th * m + k] = int64_t(ri[i]) * n + ci[j];
    for (int64_t a = 0; a < r; ++a) {
      sel[((th * 2 + 0) * r + a) * m + k] = from_float<scalar_t>(sr[i * r + a]);
      sel[((th * 2 + 1) * r + a) * m + k] = from_float<scalar_t>(sc[j * r + a]);
    }
  }
}

template <typename scalar_t>
int launch_candidates(const void* q, int64_t sq0, int64_t sq1, int64_t sq2, const void* keys, const float* weights,
                      int side, int64_t T, int64_t H, int64_t r, int64_t n, int64_t D, int64_t width, int lists,
                      int64_t c, int32_t* cand_idx, float* cand_val, float* cand_side, cudaStream_t stream) {
  const int64_t per_key = r * D * int64_t(sizeof(float));
  const int tile = int(std::min<int64_t>(kMaxKeys, std::max<int64_t>(1, (48 << 10) / per_key)));
  const size_t bytes = size_t(tile * per_key);
  if (bytes > (48 << 10)) {  // one key of a very wide rank-r slice: ask for more shared memory
    cudaError_t err = cudaFuncSetAttribute(candidates_kernel<scalar_t>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    if (err != cudaSuccess) return err;
  }
  dim3 grid((T + kTokens - 1) / kTokens, H);
  candidates_kernel<scalar_t><<<grid, kTokens, bytes, stream>>>(
      static_cast<const scalar_t*>(q), sq0, sq1, sq2, static_cast<const scalar_t*>(keys), weights, side, T, H, r,
      n, D, width, lists, c, tile, cand_idx, cand_val, cand_side);
  return cudaGetLastError();
}

template <typename scalar_t>
int launch_grid(const int32_t* cand_idx, const float* cand_side, const float* core, int64_t T, int64_t H, int64_t r,
                int64_t n, int64_t m, int64_t c, float* best_val, int64_t* addr, void* sel, cudaStream_t stream) {
  const int64_t pairs = T * H;
  grid_kernel<scalar_t><<<(pairs + kGridThreads - 1) / kGridThreads, kGridThreads, 0, stream>>>(
      cand_idx, cand_side, core, T, H, r, n, m, c, best_val, addr, static_cast<scalar_t*>(sel));
  return cudaGetLastError();
}

}  // namespace

int rmt_retrieval_candidates_cuda(int dtype, const void* q, int64_t sq0, int64_t sq1, int64_t sq2, const void* keys,
                                  const float* weights, int side, int64_t T, int64_t H, int64_t r, int64_t n,
                                  int64_t D, int64_t width, int lists, int64_t c, int32_t* cand_idx, float* cand_val,
                                  float* cand_side, cudaStream_t stream) {
  if (r < 1 || r > kMaxRank || T == 0) return T == 0 ? cudaSuccess : cudaErrorInvalidValue;
  if (dtype == RMT_SELECT_FLOAT32)
    return launch_candidates<float>(q, sq0, sq1, sq2, keys, weights, side, T, H, r, n, D, width, lists, c, cand_idx,
                                    cand_val, cand_side, stream);
  if (dtype == RMT_SELECT_BFLOAT16)
    return launch_candidates<__nv_bfloat16>(q, sq0, sq1, sq2, keys, weights, side, T, H, r, n, D, width, lists, c,
                                            cand_idx, cand_val, cand_side, stream);
  return cudaErrorInvalidValue;
}

int rmt_retrieval_grid_cuda(int dtype, const int32_t* cand_idx, const float* cand_side, const float* core, int64_t T,
                            int64_t H, int64_t r, int64_t n, int64_t m, int64_t c, float* best_val, int64_t* addr,
                            void* sel, cudaStream_t stream) {
  if (r < 1 || r > kMaxRank || T == 0) return T == 0 ? cudaSuccess : cudaErrorInvalidValue;
  if (dtype == RMT_SELECT_FLOAT32)
    return launch_grid<float>(cand_idx, cand_side, core, T, H, r, n, m, c, best_val, addr, sel, stream);
  if (dtype == RMT_SELECT_BFLOAT16)
    return launch_grid<__nv_bfloat16>(cand_idx, cand_side, core, T, H, r, n, m, c, best_val, addr, sel, stream);
  return cudaErrorInvalidValue;
}
