// The lookup-reduce backward: table and score gradients (lookup_reduce_backward_cpu.h).
//
// Table gradient outputs:
//   sparse: the touched rows [U] and their gradients [U, D];
//   dense:  the [N, D] gradient written in one pass, each chunk of table rows zero-filled
//           between its touched rows, which are written directly (no [U, D] intermediate).
// Outputs (rows, row or dense table gradients, score gradients) come from the calling thread's
// pools of buffers (pooled_buffer).
#include "lookup_reduce_backward_cpu.h"

namespace rmt_lookup {

namespace {

// Streams the gradient row acc[0:D] to dst[0:D], rounded once (into stage[0:D]) where table_t is
// narrower than the accumulator.
template <typename table_t, typename acc_t>
inline void store_row(table_t* __restrict dst, const acc_t* __restrict acc, table_t* __restrict stage, int64_t D) {
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(table_t));
  if (std::is_same<table_t, acc_t>::value) {
    stream_store(dst, acc, row_bytes);
  } else {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) stage[d] = round_to<table_t>(acc[d]);
    stream_store(dst, stage, row_bytes);
  }
}

inline void no_prefetch(int64_t) {}

// Sparse output: rows[u] and values[u, :] for every run u. Chunks hold about equal lookup counts.
template <typename table_t, typename scalar_t>
void sparse_backward_kernel(const scalar_t* __restrict grad_out, const table_t* __restrict table,
                            const scalar_t* __restrict scores, const int64_t* __restrict blk,
                            const SortedLookups& s, int64_t* __restrict rows, table_t* __restrict values,
                            scalar_t* __restrict grad_scores, int64_t M, int64_t K, int64_t C,
                            int64_t D, int64_t E) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t U = s.num_runs, chunks = num_chunks(U);
  const int64_t* start = s.run_start.data();
  const Divisor token_of(K);
  dispatch_row_shape(D, C, [&](auto kD, auto kC) {
#pragma omp parallel num_threads(at::get_num_threads())
    {
      std::vector<acc_t> acc(D);
      std::vector<table_t> stage(D);
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t ch = 0; ch < chunks; ++ch) {
        // the runs whose first lookup lies in the chunk's share of the M sorted lookups
        const int64_t lo = std::lower_bound(start, start + U, ch * M / chunks) - start;
        const int64_t hi = std::lower_bound(start, start + U, (ch + 1) * M / chunks) - start;
        std::copy(s.rows.data() + lo, s.rows.data() + hi, rows + lo);  // each chunk its runs' rows
        for (int64_t u = lo; u < hi; ++u) {
          run_gradient<table_t, scalar_t, acc_t, decltype(kD)::value, decltype(kC)::value>(
              u, s, grad_out, table, scores, blk, acc.data(), grad_scores, 0, M, M, token_of, C, D, E, no_prefetch);
          store_row(values + u * D, acc.data(), stage.data(), D);
        }
      }
      stream_fence();
    }
  });
}

// Dense output: grad_table [N, D]; chunk ch owns table rows [ch*N/chunks, (ch+1)*N/chunks) and
// writes each of them exactly once (zeros, or the gradient of the run with that row).
template <typename table_t, typename scalar_t>
void dense_backward_kernel(const scalar_t* __restrict grad_out, const table_t* __restrict table,
                           const scalar_t* __restrict scores, const int64_t* __restrict blk,
                           const SortedLookups& s, table_t* __restrict grad_table,
                           scalar_t* __restrict grad_scores, int64_t M, int64_t N, int64_t K, int64_t C,
                           int64_t D, int64_t E) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t U = s.num_runs, chunks = num_chunks(N);
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(table_t));
  const int64_t* urows = s.rows.data();
  const Divisor token_of(K);
  dispatch_row_shape(D, C, [&](auto kD, auto kC) {
#pragma omp parallel num_threads(at::get_num_threads())
    {
      std::vector<acc_t> acc(D);
      std::vector<table_t> stage(D);
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const int64_t row_lo = ch * N / chunks, row_hi = (ch + 1) * N / chunks;
        int64_t zero_from = row_lo;
        for (int64_t u = std::lower_bound(urows, urows + U, row_lo) - urows; u < U && urows[u] < row_hi; ++u) {
          stream_store(grad_table + zero_from * D, nullptr, (urows[u] - zero_from) * row_bytes);
          run_gradient<table_t, scalar_t, acc_t, decltype(kD)::value, decltype(kC)::value>(
              u, s, grad_out, table, scores, blk, acc.data(), grad_scores, 0, M, M, token_of, C, D, E, no_prefetch);
          store_row(grad_table + urows[u] * D, acc.data(), stage.data(), D);
          zero_from = urows[u] + 1;
        }
        stream_store(grad_table + zero_from * D, nullptr, (row_hi - zero_from) * row_bytes);
      }
      stream_fence();
    }
  });
}

at::Tensor score_gradient_buffer(const at::Tensor& scores) {
  thread_local std::vector<at::Tensor> pool;
  return pooled_buffer(pool, scores.numel(), scores.numel(), scores.options()).view(scores.sizes());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> lookup_reduce_backward(
    const at::Tensor& grad_out, const at::Tensor& table, const at::Tensor& indices, const at::Tensor& scores,
    const c10::optional<at::Tensor>& block_ids, int64_t num_blocks) {
  thread_local std::vector<at::Tensor> row_pool, value_pool;
  const int64_t T = indices.size(0), K = indices.size(1), C = scores.size(2), D = table.size(1);
  SortedLookups& sorted = caller_sort_scratch();
  sort_lookups(indices.data_ptr<int64_t>(), nullptr, T * K, table.size(0), sorted);
  const int64_t U = sorted.num_runs;
  // 25% headroom: the next batch's unique-row count differs a little
  auto rows = pooled_buffer(row_pool, U, U + U / 4, indices.options());
  auto values = pooled_buffer(value_pool, U * D, U * D + U * D / 4, table.options()).view({U, D});
  auto grad_scores = score_gradient_buffer(scores);
  dispatch_dtypes(table, scores, "lookup_reduce_backward", [&](auto table_tag, auto score_tag) {
    using table_t = decltype(table_tag);
    using scalar_t = decltype(score_tag);
    sparse_backward_kernel<table_t, scalar_t>(grad_out.data_ptr<scalar_t>(), table.data_ptr<table_t>(),
                                              scores.data_ptr<scalar_t>(), block_ptr(block_ids), sorted,
                                              rows.data_ptr<int64_t>(), values.data_ptr<table_t>(),
                                              grad_scores.data_ptr<scalar_t>(), T * K, K, C, D, num_blocks);
  });
  return {rows, values, grad_scores};
}

std::tuple<at::Tensor, at::Tensor> lookup_reduce_backward_dense(
    const at::Tensor& grad_out, const at::Tensor& table, const at::Tensor& indices, const at::Tensor& scores,
    const c10::optional<at::Tensor>& block_ids, int64_t num_blocks) {
  thread_local std::vector<at::Tensor> pool;
  const int64_t T = indices.size(0), K = indices.size(1), C = scores.size(2);
  const int64_t N = table.size(0), D = table.size(1);
  SortedLookups& sorted = caller_sort_scratch();
  sort_lookups(indices.data_ptr<int64_t>(), nullptr, T * K, N, sorted);
  auto grad_table = pooled_buffer(pool, N * D, N * D, table.options()).view({N, D});
  auto grad_scores = score_gradient_buffer(scores);
  dispatch_dtypes(table, scores, "lookup_reduce_backward_dense", [&](auto table_tag, auto score_tag) {
    using table_t = decltype(table_tag);
    using scalar_t = decltype(score_tag);
    dense_backward_kernel<table_t, scalar_t>(grad_out.data_ptr<scalar_t>(), table.data_ptr<table_t>(),
                                             scores.data_ptr<scalar_t>(), block_ptr(block_ids), sorted,
                                             grad_table.data_ptr<table_t>(), grad_scores.data_ptr<scalar_t>(),
                                             T * K, N, K, C, D, num_blocks);
  });
  return {grad_table, grad_scores};
}

// Score gradients alone, grad_scores[t, k, c] = <table row, output-gradient row> over column slice
// c, tokens in order (no sort): the backward of a batch whose table gradient the fused update
// sums later. The same fixed-order dot products as the backward's, so the same bits.
at::Tensor lookup_reduce_score_gradients(const at::Tensor& grad_out, const at::Tensor& table, const at::Tensor& indices,
                                         const at::Tensor& scores, const c10::optional<at::Tensor>& block_ids,
                                         int64_t num_blocks) {
  const int64_t T = indices.size(0), K = indices.size(1), C = scores.size(2), D = table.size(1);
  const int64_t M = T * K, E = num_blocks, Dc = D / C;
  auto grad_scores = at::empty_like(scores);
  dispatch_dtypes(table, scores, "lookup_reduce_score_gradients", [&](auto table_tag, auto score_tag) {
    using table_t = decltype(table_tag);
    using scalar_t = decltype(score_tag);
    using acc_t = typename Acc<scalar_t>::type;
    const table_t* __restrict tab = table.data_ptr<table_t>();
    const scalar_t* __restrict g = grad_out.data_ptr<scalar_t>();
    const int64_t* __restrict idx = indices.data_ptr<int64_t>();
    const int64_t* __restrict blk = block_ptr(block_ids);
    scalar_t* __restrict out = grad_scores.data_ptr<scalar_t>();
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(table_t));
#pragma omp parallel for schedule(dynamic, kTokensPerChunk) num_threads(at::get_num_threads())
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = t * K; i < (t + 1) * K; ++i) {
        if (i + kPrefetchDistance < M) prefetch_row(tab + idx[i + kPrefetchDistance] * D, row_bytes);
        const table_t* row = tab + idx[i] * D;
        const scalar_t* gr = g + (t * E + (blk ? blk[i] : 0)) * D;
        for (int64_t c = 0; c < C; ++c)
          out[i * C + c] = round_to<scalar_t>(fixed_order_dot<acc_t>(row + c * Dc, gr + c * Dc, Dc));
      }
    }
  });
  return grad_scores;
}

}  // namespace rmt_lookup
