// Arithmetic helpers shared by the CPU kernels (lookup_reduce_*_cpu.cpp, sparse_optim_cpu.cpp):
// rounding to a table's element type, and multiply-add with a fixed number of roundings.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace rmt_cpu {

// x rounded to T, to nearest with ties to even (the identity when T is x's type). The bf16 case
// is written out branch-free (NaN -> the quiet NaN 0x7FC0, as c10 converts it): c10's conversion
// returns early for NaN, which keeps GCC from vectorizing a loop of them, and rounding a row of
// a bf16 table's gradient element by element made its backward twice as slow as the fp32 one's.
template <typename T, typename A>
inline T round_to(A x) {
  return static_cast<T>(x);
}

template <>
inline c10::BFloat16 round_to<c10::BFloat16, float>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint16_t nearest = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return c10::BFloat16(std::isnan(x) ? uint16_t(0x7FC0) : nearest, c10::BFloat16::from_bits());
}

// a * b + c: one rounding (std::fma) where the target has fused multiply-add (x86-64 with FMA3,
// AArch64), else two. Written out rather than left to the compiler's contraction of a * b + c,
// which differs between instantiations (GCC fused the bf16-table score-gradient dot product but
// not the fp32 one), so a narrow table's results are the fp32 ones bit for bit.
template <typename T>
inline T madd(T a, T b, T c) {
#if defined(__FP_FAST_FMAF) && defined(__FP_FAST_FMA)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

}  // namespace rmt_cpu
