// The running candidate list of the fused retrieval's selection (rmt.ops.fused_retrieval), shared
// by the CPU backend (retrieval_select_cpu.cpp, one list per token in a task) and the CUDA one
// (retrieval_select_cuda_kernels.cu, one list per thread): a list sorted under the tie rule of
// rmt.ops.topm, to which entries are offered in increasing index.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define RMT_HOST_DEVICE __host__ __device__
#else
#define RMT_HOST_DEVICE
#endif

namespace rmt_select {

// Up to k (value, index I, r side scores) entries. kTop: decreasing values, equal values in
// increasing index; else increasing values, equal values in decreasing index (TDQKR's m smallest,
// the last m of the order). Entries are offered in increasing index, so the tie rule is the
// insertion's: an entry enters the top list only above its k-th value (an equal one has a higher
// index), and the bottom list at or below its largest (an equal one with a higher index is
// further down the order). The side scores of entry p are side[p * r + a].
template <typename A, typename I, bool kTop>
struct Ranked {
  int64_t k, r, size = 0;
  A* val;
  I* idx;
  A* side;

  RMT_HOST_DEVICE inline bool enters(A v) const {
    if (size < k) return true;
    return kTop ? v > val[k - 1] : v <= val[k - 1];
  }
  RMT_HOST_DEVICE inline A bound() const {
    if (size < k) return kTop ? -static_cast<A>(INFINITY) : static_cast<A>(INFINITY);
    return val[k - 1];
  }
  // Offers (v, i) with side scores s[a * stride].
  RMT_HOST_DEVICE inline void push(A v, I i, const A* s, int64_t stride) {
    if (!enters(v)) return;
    if (size == k) --size;
    int64_t p = size++;
    while (p > 0 && (kTop ? val[p - 1] < v : val[p - 1] >= v)) {
      val[p] = val[p - 1];
      idx[p] = idx[p - 1];
      for (int64_t a = 0; a < r; ++a) side[p * r + a] = side[(p - 1) * r + a];
      --p;
    }
    val[p] = v;
    idx[p] = i;
    for (int64_t a = 0; a < r; ++a) side[p * r + a] = s[a * stride];
  }
};

}  // namespace rmt_select
