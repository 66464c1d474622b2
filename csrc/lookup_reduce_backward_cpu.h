// One row's gradient from its sorted lookups, shared by the backward (lookup_reduce_backward_cpu.cpp)
// and the backward with the optimizer fused in (lookup_reduce_update_cpu.cpp).
//
// The backward is deterministic and atomic-free: the lookups are sorted by row
// (lookup_reduce_sort_cpu.h), the sorted runs are cut into chunks at run boundaries and the threads
// take whole chunks. One thread reduces each run in sorted order, so every row's gradient is the
// same sum in the same order whatever the thread count; the same pass computes the score
// gradients, reading each touched table row once, in ascending address order.
#pragma once

#include "lookup_reduce_cpu.h"
#include "lookup_reduce_sort_cpu.h"

namespace rmt_lookup {

// Adds lookup p's share to its row's gradient acc[0:D] (each column slice c of its output-gradient
// row g times its score c) and, where score_lo <= p < score_hi, writes its score gradients, the
// dot products of the slices of its table row tr and of g.
template <typename table_t, typename scalar_t, typename acc_t>
inline void add_lookup(int64_t p, const table_t* __restrict tr, const scalar_t* __restrict g,
                       const scalar_t* __restrict scores, acc_t* __restrict acc, scalar_t* __restrict grad_scores,
                       int64_t score_lo, int64_t score_hi, int64_t C, int64_t Dc) {
  for (int64_t c = 0; c < C; ++c) {
    const acc_t w = static_cast<acc_t>(scores[p * C + c]);
    acc_t* __restrict a = acc + c * Dc;
    const scalar_t* __restrict gc = g + c * Dc;
#pragma omp simd
    for (int64_t d = 0; d < Dc; ++d) a[d] = madd(w, static_cast<acc_t>(gc[d]), a[d]);
    if (p >= score_lo && p < score_hi)
      grad_scores[(p - score_lo) * C + c] = round_to<scalar_t>(fixed_order_dot<acc_t>(tr + c * Dc, gc, Dc));
  }
}

// Gradient of run u (row s.rows[u]), kD and kC as in dispatch_row_shape: accumulates the row
// gradient in acc[0:D] and writes the score gradients of the run's lookups at positions p in
// [score_lo, score_hi), to grad_scores[(p - score_lo) * C + c] (all lookups but in the fused
// update of several batches' lookups, whose other batches have theirs computed elsewhere). Lookup
// p belongs to token token_of(p) = p / K. For the sorted lookup kPrefetchDistance ahead it
// prefetches the table row, the output-gradient row, the score and the score-gradient slot (and
// the block id twice as far ahead), and calls ahead(row) (the optimizer state of the fused
// update): those are read in sorted-row order, i.e. at random, and after the other layers' work
// they are not in cache.
template <typename table_t, typename scalar_t, typename acc_t, int64_t kD, int64_t kC, typename Ahead>
inline void run_gradient(int64_t u, const SortedLookups& s, const scalar_t* __restrict grad_out,
                         const table_t* __restrict table, const scalar_t* __restrict scores,
                         const int64_t* __restrict blk, acc_t* __restrict acc, scalar_t* __restrict grad_scores,
                         int64_t score_lo, int64_t score_hi, int64_t M, const Divisor& token_of,
                         int64_t runtime_C, int64_t runtime_D, int64_t E, Ahead&& ahead) {
  const int64_t C = kC ? kC : runtime_C, D = kD ? kD : runtime_D;
  const int64_t Dc = D / C;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(table_t));
  const int64_t grad_row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
  const uint64_t* __restrict sorted = s.packed.data();
  const table_t* __restrict tr = table + s.rows[u] * D;
  std::fill(acc, acc + D, acc_t(0));
  for (int64_t j = s.run_start[u]; j < s.run_start[u + 1]; ++j) {
    // the block id is read to find the prefetched gradient row, so it is fetched first, further ahead
    if (blk && j + 2 * kPrefetchDistance < M) prefetch_l2(blk + sorted_pos(sorted[j + 2 * kPrefetchDistance]));
    if (j + kPrefetchDistance < M) {
      const uint64_t far = sorted[j + kPrefetchDistance];
      const int64_t q = sorted_pos(far);
      prefetch_row(table + sorted_row(far) * D, row_bytes);
      prefetch_row(grad_out + (token_of(q) * E + (blk ? blk[q] : 0)) * D, grad_row_bytes);
      prefetch_l2(scores + q * C);
      if (q >= score_lo && q < score_hi) prefetch_l2(grad_scores + (q - score_lo) * C);
      ahead(sorted_row(far));
    }
    const int64_t p = sorted_pos(sorted[j]);
    add_lookup(p, tr, grad_out + (token_of(p) * E + (blk ? blk[p] : 0)) * D, scores, acc, grad_scores, score_lo,
               score_hi, C, Dc);
  }
}

}  // namespace rmt_lookup
