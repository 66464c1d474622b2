// Register-tiled products with one short side, shared by the RMT's read (matrix_rmsnorm_cpu.cpp)
// and write (matrix_write_cpu.cpp) kernels, float32, with Dk (the key width) 16 or 32, every RMT
// config's. With a[h, j] = a[h*sh + j*sj] (a strided [n, m] operand, n = the number of keys:
// 3 to 36):
//
//   rows_by_keys   out[j, k] = sum_h a[h, j] b[h, k]     b [n, Dk]   (the write; the read's dy)
//                  (+ add[j, k] after the sum, where add is given: the write's residual)
//   keys_by_rows   out[h, k] = sum_j a[h, j] y[j, k]     y [m, Dk]   (the read's and the write's dkeys)
//
// Written by hand because these GEMMs have a reduction or output side of only n or Dk, shapes for
// which MKL's sgemm ran at a fraction of its speed on larger ones (docs/benchmarks.md): register
// tiles of 8 kLanes / Dk rows (or keys) by Dk lanes, 8 accumulators of kLanes floats, vectorized
// with GCC's vector extension: 16 lanes (AVX-512 registers) where the build targets AVX-512, else 8
// (AVX registers, or pairs of SSE ones). Each output element is one lane summing its terms in a
// fixed order (h, respectively j, ascending), so results do not depend on the thread count or
// on the lane width. The plain references are the same products through at::mm / F.linear.
#pragma once

#include <cstdint>
#include <cstring>

namespace rmt_cpu {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
inline vec load(const float* p) { vec v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

// out[t, :] = sum_i a[i*si + t*st] v[i, :] for t < T (v [steps, Dk]): T x Dk/kLanes accumulators,
// one pass over v. Both products are this tile: rows_by_keys steps over the keys (v = b) for T
// rows, keys_by_rows over the rows (v = y) for T keys. T = 8 kLanes / Dk: 8 accumulators. Where
// add is given, out[t, :] = (the sum) + add[t, :], one rounding, as adding the two tensors
// afterwards rounds.
template <int DK, int T>
inline void outer_product_tile(const float* a, int64_t si, int64_t st, const float* v, float* out, int64_t steps,
                               const float* add) {
  constexpr int NV = DK / kLanes;
  vec acc[T][NV] = {};
  for (int64_t i = 0; i < steps; ++i) {
    vec vv[NV];
    for (int q = 0; q < NV; ++q) vv[q] = load(v + i * DK + kLanes * q);
    for (int t = 0; t < T; ++t) {
      const float s = a[i * si + t * st];
      for (int q = 0; q < NV; ++q) acc[t][q] += s * vv[q];
    }
  }
  for (int t = 0; t < T; ++t)
    for (int q = 0; q < NV; ++q)
      store(out + t * DK + kLanes * q, add ? acc[t][q] + load(add + t * DK + kLanes * q) : acc[t][q]);
}

// The tiles over count outputs: out[t, :] = sum_i a[i*si + t*st] v[i, :] (+ add[t, :]) for t < count.
template <int DK>
void outer_products(const float* a, int64_t si, int64_t st, const float* v, float* out, int64_t steps, int64_t count,
                    const float* add) {
  constexpr int T = 8 * kLanes / DK, Half = T > 1 ? T / 2 : 1;
  int64_t t = 0;
  for (; t + T <= count; t += T)
    outer_product_tile<DK, T>(a + t * st, si, st, v, out + t * DK, steps, add ? add + t * DK : nullptr);
  // A remainder of T/2 or more (4 keys with 16 lanes and Dk 16): half a tile, then one at a time.
  for (; Half > 1 && t + Half <= count; t += Half)
    outer_product_tile<DK, Half>(a + t * st, si, st, v, out + t * DK, steps, add ? add + t * DK : nullptr);
  for (; t < count; ++t)
    outer_product_tile<DK, 1>(a + t * st, si, st, v, out + t * DK, steps, add ? add + t * DK : nullptr);
}

inline bool tiled_width(int64_t dk) { return dk == 16 || dk == 32; }

inline void outer_products(int64_t dk, const float* a, int64_t si, int64_t st, const float* v, float* out,
                           int64_t steps, int64_t count, const float* add = nullptr) {
  if (dk == 16)
    outer_products<16>(a, si, st, v, out, steps, count, add);
  else
    outer_products<32>(a, si, st, v, out, steps, count, add);
}

// The two products of the header comment, for a runtime Dk of 16 or 32 (the caller checks
// tiled_width).
inline void rows_by_keys(int64_t dk, const float* a, int64_t sh, int64_t sj, const float* b, float* out, int64_t n,
                         int64_t m, const float* add = nullptr) {
  outer_products(dk, a, sh, sj, b, out, n, m, add);
}

inline void keys_by_rows(int64_t dk, const float* a, int64_t sh, int64_t sj, const float* y, float* out, int64_t n,
                         int64_t m) {
  outer_products(dk, a, sj, sh, y, out, m, n);
}

}  // namespace rmt_cpu
