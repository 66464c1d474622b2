// Software prefetches shared by the CPU kernels (lookup_reduce_*_cpu.cpp, sparse_optim_cpu.cpp): the
// rows, output-gradient rows, scores and optimizer state that the kernels touch at random (or
// ascending but far apart, which the hardware prefetchers do not follow) are requested ahead of use.
#pragma once

#include <cstdint>

namespace rmt_cpu {

// Prefetches the 64-byte line at p into L2 (prefetcht1), not into L1: a prefetch into L1 holds one
// of the core's few L1 miss slots until its line arrives, and the kernels keep dozens of lines in
// flight (docs/kernels.md).
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// Every 64-byte line of the bytes at p, into L2.
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) prefetch_l2(c + off);
}

}  // namespace rmt_cpu
