// The lookup-reduce forward: tokens in order (chunks of tokens per thread), the rows a few lookups
// ahead prefetched. With one virtual block and column groups of a multiple of kTile columns, each
// kTile-column output tile is accumulated in registers; otherwise one pass per token accumulates
// all E blocks in a small buffer.
#include "lookup_reduce_cpu.h"

namespace rmt_lookup {

namespace {

// Output columns accumulated in registers per pass (four 512-bit or eight 256-bit registers of fp32).
constexpr int64_t kTile = 64;

// Forward of token t when E == 1 and kTile divides D/C: each kTile-column tile of the output is
// accumulated in a fixed-size local array, which the compiler keeps in vector registers. The
// first tile prefetches the rows kPrefetchDistance lookups ahead.
template <typename table_t, typename scalar_t>
inline void forward_token_tiles(const table_t* __restrict table, const int64_t* __restrict idx,
                                const scalar_t* __restrict scores, scalar_t* __restrict o, int64_t t,
                                int64_t M, int64_t K, int64_t C, int64_t D) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t Dc = D / C, row_bytes = D * static_cast<int64_t>(sizeof(table_t));
  for (int64_t d0 = 0; d0 < D; d0 += kTile) {
    const int64_t c = d0 / Dc;
    acc_t acc[kTile] = {};
    for (int64_t i = t * K; i < (t + 1) * K; ++i) {
      if (d0 == 0 && i + kPrefetchDistance < M) prefetch_row(table + idx[i + kPrefetchDistance] * D, row_bytes);
      const acc_t w = static_cast<acc_t>(scores[i * C + c]);
      const table_t* __restrict row = table + idx[i] * D + d0;
#pragma omp simd
      for (int64_t d = 0; d < kTile; ++d) acc[d] = madd(w, static_cast<acc_t>(row[d]), acc[d]);
    }
    for (int64_t d = 0; d < kTile; ++d) o[d0 + d] = round_to<scalar_t>(acc[d]);
  }
}

// Forward of token t, general case (virtual blocks, narrow column groups): one pass over the
// token's lookups accumulating into acc[E * D] in memory. kD, kC: D and C fixed at compile time,
// or 0 (see dispatch_row_shape).
template <typename table_t, typename scalar_t, typename acc_t, int64_t kD, int64_t kC>
inline void forward_token_blocks(const table_t* __restrict table, const int64_t* __restrict idx,
                                 const scalar_t* __restrict scores, const int64_t* __restrict blk,
                                 acc_t* __restrict acc, scalar_t* __restrict o, int64_t t, int64_t M,
                                 int64_t K, int64_t runtime_C, int64_t runtime_D, int64_t E) {
  const int64_t C = kC ? kC : runtime_C, D = kD ? kD : runtime_D;
  const int64_t Dc = D / C, row_bytes = D * static_cast<int64_t>(sizeof(table_t));
  std::fill(acc, acc + E * D, acc_t(0));
  for (int64_t i = t * K; i < (t + 1) * K; ++i) {
    if (i + kPrefetchDistance < M) prefetch_row(table + idx[i + kPrefetchDistance] * D, row_bytes);
    const table_t* __restrict row = table + idx[i] * D;
    acc_t* __restrict a = acc + (blk ? blk[i] : 0) * D;
    for (int64_t c = 0; c < C; ++c) {
      const acc_t w = static_cast<acc_t>(scores[i * C + c]);
#pragma omp simd
      for (int64_t d = c * Dc; d < (c + 1) * Dc; ++d) a[d] = madd(w, static_cast<acc_t>(row[d]), a[d]);
    }
  }
#pragma omp simd
  for (int64_t j = 0; j < E * D; ++j) o[j] = round_to<scalar_t>(acc[j]);
}

template <typename table_t, typename scalar_t>
void forward_kernel(const table_t* __restrict table, const int64_t* __restrict idx,
                    const scalar_t* __restrict scores, const int64_t* __restrict blk,
                    scalar_t* __restrict out, int64_t T, int64_t K, int64_t C, int64_t D,
                    int64_t E) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t M = T * K;
  const bool tiles = E == 1 && (D / C) % kTile == 0;
  dispatch_row_shape(D, C, [&](auto kD, auto kC) {
#pragma omp parallel num_threads(at::get_num_threads())
    {
      std::vector<acc_t> acc(tiles ? 0 : E * D);
#pragma omp for schedule(dynamic, kTokensPerChunk)
      for (int64_t t = 0; t < T; ++t) {
        if (tiles) {
          forward_token_tiles(table, idx, scores, out + t * D, t, M, K, C, D);
        } else {
          forward_token_blocks<table_t, scalar_t, acc_t, decltype(kD)::value, decltype(kC)::value>(
              table, idx, scores, blk, acc.data(), out + t * E * D, t, M, K, C, D, E);
        }
      }
    }
  });
}

}  // namespace

at::Tensor lookup_reduce_forward(const at::Tensor& table, const at::Tensor& indices, const at::Tensor& scores,
                                 const c10::optional<at::Tensor>& block_ids, int64_t num_blocks) {
  const int64_t T = indices.size(0), K = indices.size(1), C = scores.size(2), D = table.size(1);
  auto out = at::empty({T, num_blocks, D}, scores.options());
  dispatch_dtypes(table, scores, "lookup_reduce_forward", [&](auto table_tag, auto score_tag) {
    using table_t = decltype(table_tag);
    using scalar_t = decltype(score_tag);
    forward_kernel<table_t, scalar_t>(table.data_ptr<table_t>(), indices.data_ptr<int64_t>(),
                                      scores.data_ptr<scalar_t>(), block_ptr(block_ids),
                                      out.data_ptr<scalar_t>(), T, K, C, D, num_blocks);
  });
  return out;
}

}  // namespace rmt_lookup
