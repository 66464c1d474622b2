// Software prefetches shared by the CPU kernels (lookup_reduce_cpu.cpp, sparse_optim_cpu.cpp): the
// rows, output-gradient rows, scores and optimizer state that the kernels touch at random (or
// ascending but far apart, which the hardware prefetchers do not follow) are requested ahead of use.
#pragma once

#include <cstdint>

namespace rmt_cpu {

// Prefetches the 64-byte line at p into L2 (prefetcht1), not into L1. A prefetch into L1 holds one
// of the core's few L1 miss slots until its line arrives, and the kernels keep dozens of lines in
// flight. Measured on one core of a 2-core AMD EPYC (1M x 64 fp32 table, T=4096, cold cache):
// - the lookup-reduce forward with its rows prefetched into L1: 4.0 instead of 2.7 ms (K=32);
// - the fused row-wise Adagrad backward with the scores, score-gradient slots and block ids
//   prefetched into L1 (the score-gradient slots for writing): 7.6 instead of 7.3 ms at K=32, 27.1
//   instead of 24.1 ms at K=128;
// - the sparse backward at K=128, C=2, E=4, the same: 45.5 instead of 33.5 ms;
// - the fused SparseAdam backward with the moments prefetched for writing (prefetchw, into L1):
//   16.9-19.9 instead of 13.6-14.9 ms at K=32, 51.6 instead of 41.7 ms at K=128;
// - the unfused SparseAdam step of 123k rows, its rows and moments prefetched for writing:
//   12.3-13.3 instead of 9.9-11.4 ms (the row-wise Adagrad step measured the same either way).
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// Every 64-byte line of the bytes at p, into L2.
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) prefetch_l2(c + off);
}

}  // namespace rmt_cpu
